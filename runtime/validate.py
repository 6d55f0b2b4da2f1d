"""Artifact validation: everything the runtime reads from an artifact is checked before any kernel runs.

An artifact directory is untrusted input (DESIGN.md "Serving, scale and trust"). ``Runtime.__init__`` calls, in
this order, and each raises ``UserError`` with one line naming the file and the field:

    check_files(dir)          artifact.json: the format version, then every file it lists (program.json,
                              kernels.so, weights.json, ...) present with its size and sha256; before any other
                              file is parsed and before kernels.so is dlopen-ed (a truncated library is a size
                              mismatch here, not a SIGBUS in the loader)
    read_json(path)           a JSON file, parse errors as one line
    check_program_json(pj)    schema (the type of every field the runtime reads), then per program: buffer ids,
                              dtypes, shapes (ints >= 0 or expressions of the declared symbols, through
                              ``shape_dim``), offsets >= 0 and 64-byte aligned, aliases at their root's offset,
                              every buffer's end (at the symbols' upper bounds, each request slot of the
                              per-request state zones) within arena_bytes, and no two buffers live at the same
                              step sharing bytes (lifetimes recomputed from the steps here, independently of the
                              planner, and a sweep over byte offsets: ``overlapping_live``); persistent buffers
                              (weights, states) at one offset and size in every program; the KV pools' block
                              counts against the pool buffers (runtime/kv_pages.py hands out block ids below them)
    check_weights(wj, pj)     weights.json: every weight buffer has an entry of its dtype and shape; copy runs lie
                              within the destination and read from checkpoint keys the manifest lists
    check_kernels(pj, lib)    after dlopen: every step's kernel is a function of the library

Reading a file never evaluates its text: shape expressions are parsed by ``shape_dim``, i.e. the IR's dimension
grammar (passes/ir/shape_expr.py), never by eval or sympify.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

from dayzero import UserError
from dayzero.codegen.artifact import FORMAT, FORMAT_PREFIX, MANIFEST, file_digest
from dayzero.passes.ir.collective import COLLECTIVES, MESH_AXES, Mesh
from dayzero.passes.ir.dayzero_ops import BLOCK_TABLE, INPUT_KINDS
from dayzero.passes.ir.ops import DTYPE_BYTES
from dayzero.passes.ir.shape_expr import dim_at, parse_dim, symbol_table
from dayzero.passes.memory_plan import ALIGN, PER_REQUEST_ZONES, ZONES



# ---- files ---------------------------------------------------------------------------------------------------

def read_json(path: Path, what: str | None = None):
    """Parse a JSON file; a missing file or bad JSON is a UserError naming it."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UserError(f"{path.parent}: not a dayzero artifact (no {what or path.name})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read ({e})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except RecursionError:
        raise UserError(f"{path}: JSON nested too deeply") from None


def check_format(fmt, where: str) -> None:
    if not isinstance(fmt, str) or not fmt.startswith(FORMAT_PREFIX):
        raise UserError(f"{where}: not a dayzero artifact (format {fmt!r})")
    if fmt != FORMAT:
        raise UserError(f"{where}: artifact format {fmt!r} is not supported (this dayzero reads {FORMAT!r}: "
                        f"recompile)")


def check_files(art: Path) -> dict:
    """Check artifact.json's format and every file it lists (presence, size, sha256); returns its ``files``."""
    art = Path(art)
    if not art.is_dir():
        raise UserError(f"{art}: not a dayzero artifact (no such directory)")
    if not (art / MANIFEST).is_file() and (art / "program.json").is_file():
        raise UserError(f"{art}: no {MANIFEST} (compiled by an older dayzero, or not an artifact): recompile")
    man = read_json(art / MANIFEST)
    where = str(art / MANIFEST)
    if not isinstance(man, dict):
        raise UserError(f"{where}: not a JSON object")
    check_format(man.get("format"), where)
    files = man.get("files")
    if not isinstance(files, dict) or not files:
        raise UserError(f"{where}: 'files' must be a non-empty object of file name -> {{bytes, sha256}}")
    for name in ("program.json", "kernels.so", "weights.json"):
        if name not in files:
            raise UserError(f"{where}: does not list {name}")
    for name, ent in sorted(files.items()):
        parts = name.split("/") if isinstance(name, str) else []
        if not 1 <= len(parts) <= 2 or any(not c or c.startswith(".") or "\\" in c for c in parts):
            raise UserError(f"{where}: file name {str(name)[:60]!r} is not a file of the artifact (a plain name, "
                            "or dir/name one level down)")
        if len(parts) == 2 and (art / parts[0]).is_symlink():
            raise UserError(f"{art}: {parts[0]} is a symbolic link, not a directory of the artifact")
        if not (isinstance(ent, dict) and _is_int(ent.get("bytes")) and ent["bytes"] >= 0
                and isinstance(ent.get("sha256"), str)):
            raise UserError(f"{where}: files.{name} must be {{bytes: int >= 0, sha256: str}}")
        p = art / name
        if not p.is_file() or p.is_symlink():
            raise UserError(f"{art}: {name} is missing (the artifact lists it)")
        size = p.stat().st_size
        if size != ent["bytes"]:
            raise UserError(f"{p}: {size} bytes, the artifact lists {ent['bytes']} (truncated or replaced)")
        if file_digest(p) != ent["sha256"]:
            raise UserError(f"{p}: sha256 differs from the artifact's manifest (corrupted or replaced)")
    return files


# ---- shape expressions -----------------------------------------------------------------------------------------

def shape_dim(d, env: dict[str, int]) -> int:
    """The value of one shape dimension (an int, or an expression text of the program's symbols) under ENV: parsed
    by the IR's dimension grammar (passes/ir/shape_expr.py), never evaluated."""
    if not (_is_int(d) or isinstance(d, str)):
        raise UserError(f"shape dimension {str(d)[:40]!r} is neither an integer nor an expression of the symbols")
    return dim_at(d, env)


# ---- program.json --------------------------------------------------------------------------------------------

def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class _Where:
    """Field checks that name the path of the bad field (``program.json: programs.prefill.buffers[3].dtype``)."""

    def __init__(self, file: str):
        self.file = file

    def fail(self, path: str, msg: str):
        raise UserError(f"{self.file}: {path}: {msg}")

    def obj(self, x, path: str) -> dict:
        if not isinstance(x, dict):
            self.fail(path, f"expected an object, got {type(x).__name__}")
        return x

    def lst(self, x, path: str) -> list:
        if not isinstance(x, list):
            self.fail(path, f"expected a list, got {type(x).__name__}")
        return x

    def key(self, d: dict, k: str, path: str):
        if k not in d:
            self.fail(path, f"missing field {k!r}")
        return d[k]

    def int(self, x, path: str, lo: int | None = 0, hi: int | None = None) -> int:
        if not _is_int(x):
            self.fail(path, f"expected an integer, got {x!r:.40}")
        if lo is not None and x < lo:
            self.fail(path, f"{x} is below {lo}")
        if hi is not None and x > hi:
            self.fail(path, f"{x} is above {hi}")
        return x

    def str(self, x, path: str, none: bool = False):
        if x is None and none:
            return x
        if not isinstance(x, str):
            self.fail(path, f"expected a string{' or null' if none else ''}, got {x!r:.40}")
        return x


def _corners(symbols: dict[str, tuple[int, int]]):
    """Every assignment of each symbol to its lower or upper bound (the extremes of a shape's size)."""
    names = sorted(symbols)
    for combo in itertools.product(*[sorted(set(symbols[s])) for s in names]):
        yield dict(zip(names, combo))


def buffer_max_bytes(b: dict, symbols: dict[str, tuple[int, int]], w: _Where, path: str) -> int:
    """Bytes of buffer B at the largest of its sizes over the symbols' bounds (checked at every corner of the
    symbols its shape mentions, and each dimension non-negative there). A batched program declares a symbol per
    request and cache (tiny DeepSeek-V4's decode_batch: 18), so the corners of all of them (2^18) would take
    minutes per buffer; a buffer's shape names one or two."""
    table = symbol_table(symbols)
    used = {str(x) for d in b["shape"] if isinstance(d, str) for x in parse_dim(d, table).free_symbols}
    best = 0
    for env in _corners({s: r for s, r in symbols.items() if s in used}):
        n = 1
        for d in b["shape"]:
            v = shape_dim(d, env)
            if not _is_int(v) or v < 0:
                w.fail(f"{path}.shape", f"dimension {d!r} is {v} at {env}")
            n *= v
        best = max(best, n * DTYPE_BYTES[b["dtype"]])
    return best


def _check_buffer(b, i: int, symbols, w: _Where, path: str) -> None:
    p = f"{path}.buffers[{i}]"
    w.obj(b, p)
    if w.key(b, "id", p) != i:
        w.fail(f"{p}.id", f"is {b['id']!r}; buffer ids are their positions in the list")
    dt = w.key(b, "dtype", p)
    if not isinstance(dt, str) or dt not in DTYPE_BYTES:
        w.fail(f"{p}.dtype", f"{dt!r:.40} is not a known dtype ({', '.join(sorted(DTYPE_BYTES))})")
    for k, d in enumerate(w.lst(w.key(b, "shape", p), f"{p}.shape")):
        if _is_int(d):
            w.int(d, f"{p}.shape[{k}]")
        elif isinstance(d, str):
            shape_dim(d, {s: hi for s, (_, hi) in symbols.items()})  # parses, only declared symbols
        else:
            w.fail(f"{p}.shape[{k}]", f"{d!r:.40} is neither an integer nor an expression")
    z = w.key(b, "zone", p)
    if z not in ZONES:
        w.fail(f"{p}.zone", f"{z!r:.40} is not a memory zone ({', '.join(ZONES)})")
    for k in ("weight", "state", "name"):
        w.str(b.get(k), f"{p}.{k}", none=True)
    kind = b.get("input_kind")
    if kind is not None and kind not in INPUT_KINDS:
        w.fail(f"{p}.input_kind", f"{kind!r:.40} is not an input kind ({', '.join(INPUT_KINDS)})")
    a = w.key(b, "alias_of", p)
    if a is not None:
        w.int(a, f"{p}.alias_of", 0, i - 1 if i else 0)


def _check_collective(st: dict, bufs: list, mesh: Mesh, w: _Where, sp: str) -> None:
    """A collective step (runtime/dist.py): a known op over a mesh axis of the artifact's mesh, its size the
    axis's, one output of its input's dtype (and shape, but all_gather's dim), group_rank's int64 [1]."""
    c = w.obj(st["collective"], f"{sp}.collective")
    op, group = c.get("op"), c.get("group")
    if op not in COLLECTIVES:
        w.fail(f"{sp}.collective.op", f"{op!r:.40} is not a collective ({', '.join(COLLECTIVES)})")
    if group not in MESH_AXES or c.get("size") != mesh.size(group) or mesh.size(group) < 2:
        w.fail(f"{sp}.collective", f"group {group!r:.20} of size {c.get('size')!r:.20} is no axis of the mesh "
                                   f"{mesh.json()}")
    args = st["args"]
    if st["outputs"] != 1 or len(args) != (1 if op == "group_rank" else 2):
        w.fail(f"{sp}.args", f"{op} takes {0 if op == 'group_rank' else 1} input and writes 1 output")
    out = bufs[args[-1]]
    if op == "group_rank":
        if out["dtype"] != "int64" or out["shape"] != [1]:
            w.fail(f"{sp}.args", "group_rank writes int64 [1]")
        return
    x = bufs[args[0]]
    if x["dtype"] != out["dtype"] or len(x["shape"]) != len(out["shape"]):
        w.fail(f"{sp}.args", f"{op} reads {x['dtype']}{x['shape']} and writes {out['dtype']}{out['shape']}")
    if op == "all_gather":
        d = c.get("dim")
        if not _is_int(d) or not 0 <= d < len(x["shape"]):
            w.fail(f"{sp}.collective.dim", f"{d!r:.20} is not a dimension of {x['shape']}")
        if any(a != b for k, (a, b) in enumerate(zip(x["shape"], out["shape"])) if k != d):
            w.fail(f"{sp}.args", f"all_gather changes dimensions other than {d}")
    elif x["shape"] != out["shape"] or (op == "all_reduce" and c.get("reduce") != "sum"):
        w.fail(f"{sp}", f"{op} keeps its input's shape (and all_reduce sums)")


def _check_program(name: str, pj, w: _Where, mesh: Mesh) -> dict:
    """Schema of one program; returns {symbol: (lo, hi)}."""
    path = f"programs.{name}"
    w.obj(pj, path)
    if w.key(pj, "name", path) != name:
        w.fail(f"{path}.name", f"is {pj['name']!r:.40}, the program is listed as {name!r}")
    symbols = {}
    for k, s in enumerate(w.lst(w.key(pj, "symbols", path), f"{path}.symbols")):
        sp = f"{path}.symbols[{k}]"
        if not (isinstance(s, list) and len(s) == 3 and isinstance(s[0], str) and s[0].isidentifier()):
            w.fail(sp, "expected [name, lo, hi]")
        lo = w.int(s[1], f"{sp}[1]", 0)
        w.int(s[2], f"{sp}[2]", max(lo, 1), 1 << 40)
        symbols[s[0]] = (lo, s[2])
    bufs = w.lst(w.key(pj, "buffers", path), f"{path}.buffers")
    for i, b in enumerate(bufs):
        _check_buffer(b, i, symbols, w, path)
    for i, b in enumerate(bufs):
        a = b["alias_of"]
        if a is not None and (a >= i or bufs[a]["alias_of"] is not None):
            w.fail(f"{path}.buffers[{i}].alias_of", f"{a} is not an earlier root buffer")
        # a root in a weights zone is bound from weights.json and one in a cache zone is a named state; without
        # the name the runtime would leave its bytes unset
        role = {"weights": "weight", "low_precision_weights": "weight", "kv_cache": "state", "kv_pages": "state"}
        if a is None and b["zone"] in role and b.get(role[b["zone"]]) is None:
            w.fail(f"{path}.buffers[{i}]", f"in zone {b['zone']} but has no {role[b['zone']]} name")
    n = len(bufs)

    def bid(x, p):
        return w.int(x, p, 0, n - 1)
    for k in ("inputs", "outputs"):
        for j, x in enumerate(w.lst(w.key(pj, k, path), f"{path}.{k}")):
            bid(x, f"{path}.{k}[{j}]")
    for k, r in w.obj(pj.get("input_ranges", {}), f"{path}.input_ranges").items():
        if not (isinstance(r, list) and len(r) == 2 and all(_is_int(v) for v in r) and r[0] < r[1]):
            w.fail(f"{path}.input_ranges.{k}", "expected [lo, hi) integers with lo < hi")
    kernels = w.obj(w.key(pj, "kernels", path), f"{path}.kernels")
    for k, v in kernels.items():
        w.obj(v, f"{path}.kernels.{k}")
    for j, st in enumerate(w.lst(w.key(pj, "steps", path), f"{path}.steps")):
        sp = f"{path}.steps[{j}]"
        w.obj(st, sp)
        k = w.str(w.key(st, "kernel", sp), f"{sp}.kernel")
        if k not in kernels and st.get("collective") is None:
            w.fail(f"{sp}.kernel", f"{k!r:.60} is not one of the program's kernels")
        args = w.lst(w.key(st, "args", sp), f"{sp}.args")
        for m, x in enumerate(args):
            bid(x, f"{sp}.args[{m}]")
        w.int(w.key(st, "outputs", sp), f"{sp}.outputs", 0, len(args))
        if st.get("collective") is not None:
            _check_collective(st, bufs, mesh, w, sp)
        w.str(w.key(st, "node", sp), f"{sp}.node")
        for m, s in enumerate(w.lst(st.get("symbols", []), f"{sp}.symbols")):
            if s not in symbols:
                w.fail(f"{sp}.symbols[{m}]", f"{s!r:.40} is not a symbol of the program")
    mem = w.obj(w.key(pj, "memory", path), f"{path}.memory")
    w.int(w.key(mem, "arena_bytes", f"{path}.memory"), f"{path}.memory.arena_bytes", 1, 1 << 50)
    w.int(mem.get("state_slots", 1), f"{path}.memory.state_slots", 1, 1 << 16)
    w.int(mem.get("state_stride", 0), f"{path}.memory.state_stride", 0, 1 << 50)
    offs = w.obj(w.key(mem, "offsets", f"{path}.memory"), f"{path}.memory.offsets")
    for i in range(n):
        w.int(offs.get(str(i)), f"{path}.memory.offsets.{i}", 0, 1 << 50)
    return symbols


def _root(bufs: list, i: int) -> int:
    a = bufs[i]["alias_of"]
    return i if a is None else a


def _persistent_key(b: dict) -> str | None:
    if b.get("weight") is not None:
        return "w:" + b["weight"]
    if b.get("state") is not None:
        return "s:" + b["state"]
    return None


def check_program_json(pj) -> dict[str, list[int]]:
    """Schema, bounds, alignment and overlap of program.json (see the module docstring). Returns, per program,
    each buffer's largest size in bytes as validated (at the corners of the symbols' ranges): the runtime checks
    every view it makes against it, so a shape expression larger between the corners is refused too."""
    w = _Where("program.json")
    w.obj(pj, "(top)")
    check_format(pj.get("format"), "program.json")
    progs = w.obj(w.key(pj, "programs", "(top)"), "programs")
    if "prefill" not in progs:
        w.fail("programs", "has no prefill program")
    mesh = Mesh.from_json(pj.get("mesh"))
    symbols = {name: _check_program(name, p, w, mesh) for name, p in progs.items()}
    arena = {p["memory"]["arena_bytes"] for p in progs.values()}
    if len(arena) != 1:
        w.fail("programs", f"disagree on arena_bytes ({sorted(arena)}): one arena is shared")
    arena_bytes = arena.pop()
    replicas = {(p["memory"].get("state_slots", 1), p["memory"].get("state_stride", 0)) for p in progs.values()}
    if len(replicas) != 1:
        w.fail("programs", f"disagree on (state_slots, state_stride) ({sorted(replicas)}): the states are shared")
    slots, stride = replicas.pop()
    # persistent buffers: one offset and one extent per name across programs (every program sees their bytes)
    persistent: dict[str, tuple[int, int, str, bool]] = {}  # key -> (offset, bytes, where, per request)
    sizes = {}
    for name, p in progs.items():
        bufs, offs = p["buffers"], p["memory"]["offsets"]
        for i, b in enumerate(bufs):
            path = f"programs.{name}.buffers[{i}]"
            sizes[name, i] = size = buffer_max_bytes(b, symbols[name], w, path)
            off = offs[str(i)]
            if off % ALIGN:
                w.fail(f"programs.{name}.memory.offsets.{i}", f"{off} is not {ALIGN}-byte aligned")
            r = _root(bufs, i)
            if r != i:
                if off != offs[str(r)]:
                    w.fail(f"programs.{name}.memory.offsets.{i}", f"the view of buffer {r} is at {off}, not at "
                                                                   f"its root's {offs[str(r)]}")
                continue
            per_request = b.get("state") is not None and b["zone"] in PER_REQUEST_ZONES
            end = off + size + ((slots - 1) * stride if per_request else 0)
            if end > arena_bytes:
                w.fail(path, f"[{off}, {end}) ends past the arena ({arena_bytes} bytes)")
            key = _persistent_key(b)
            if key is not None:
                seen = persistent.setdefault(key, (off, size, path, per_request))
                if seen[0] != off or seen[3] != per_request:
                    w.fail(path, f"{key[2:]} is at offset {off} here but {seen[0]} in {seen[2]}")
                persistent[key] = (off, max(seen[1], size), seen[2], per_request)
        for i, b in enumerate(bufs):
            r = _root(bufs, i)
            if r != i and sizes[name, i] > sizes[name, r]:
                w.fail(f"programs.{name}.buffers[{i}]", f"a view of {sizes[name, i]} bytes of buffer {r} of "
                                                        f"{sizes[name, r]}")
    if slots > 1:
        state = [(o, s) for o, s, _, per in persistent.values() if per]
        if state:
            lo, hi = min(o for o, _ in state), max(o + s for o, s in state)
            if stride < hi - lo:
                w.fail("memory.state_stride", f"{stride} is smaller than the per-request state span {hi - lo}")
    for name, p in progs.items():
        _check_overlap(name, p, persistent, sizes, slots, stride)
        _check_index_inputs(name, p, w)
    _check_kv_pages(pj.get("kv_pages"), progs, sizes, w)
    return {name: [sizes[name, i] for i in range(len(p["buffers"]))] for name, p in progs.items()}


def _check_overlap(name: str, p: dict, persistent: dict, sizes: dict, slots: int, stride: int) -> None:
    """No two buffers live at the same step share bytes: lifetimes from the steps (a root lives from the first to
    the last step that uses it through any view; inputs and outputs the whole program; persistent buffers of
    every program always, each request slot's replica of the per-request states too)."""
    bufs, offs = p["buffers"], p["memory"]["offsets"]
    n = len(p["steps"])
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for j, st in enumerate(p["steps"]):
        for a in st["args"]:
            r = _root(bufs, a)
            first.setdefault(r, j)
            last[r] = j
    for a in p["inputs"] + p["outputs"]:
        r = _root(bufs, a)
        first[r], last[r] = 0, n
    items = []  # (offset, bytes, first step, last step, what)
    for key, (off, size, where, per) in persistent.items():
        for k in range(slots if per else 1):
            items.append((off + k * stride, size, 0, n, f"{where} ({key[2:]}{f', request slot {k}' if per else ''})"))
    for i, b in enumerate(bufs):
        if b["alias_of"] is None and _persistent_key(b) is None and i in first:
            items.append((offs[str(i)], sizes[name, i], first[i], last[i], f"programs.{name}.buffers[{i}]"))
    clash = overlapping_live(items)
    if clash is not None:
        (o1, s1, a1, b1, w1), (o2, s2, a2, b2, w2) = clash
        raise UserError(f"program.json: {w1} [{o1}, {o1 + s1}) steps [{a1}, {b1}] and {w2} [{o2}, {o2 + s2}) steps "
                        f"[{a2}, {b2}] overlap while both are live")


def overlapping_live(items: list[tuple]) -> tuple | None:
    """The first pair of ``(offset, bytes, first step, last step, ...)`` items that share bytes while both are live,
    or None. Independent of the planner (passes/memory_plan.py), like its own ``verify``, but a sweep over byte
    offsets: only pairs whose byte ranges meet are compared (verify compares every pair, O(n^2): a minute for a
    few thousand buffers, too slow for every load)."""
    order = sorted((it for it in items if it[1] > 0), key=lambda it: it[0])
    for k, a in enumerate(order):
        end = a[0] + a[1]
        for b in order[k + 1:]:
            if b[0] >= end:
                break
            if max(a[2], b[2]) <= min(a[3], b[3]):
                return a, b
    return None


def _check_index_inputs(name: str, p: dict, w: _Where) -> None:
    """A program input an embedding step reads as row indices has a checked range within the table's rows (the
    runtime checks every input against input_ranges before any kernel runs; the kernel itself does not)."""
    bufs, ranges = p["buffers"], p.get("input_ranges", {})
    inputs = set(p["inputs"])
    for j, st in enumerate(p["steps"]):
        if st.get("collective") is not None or p["kernels"][st["kernel"]].get("op") != "embedding" or \
                len(st["args"]) < 3:
            continue
        table, idx = st["args"][0], st["args"][1]
        if idx not in inputs:
            continue
        rows = bufs[table]["shape"][0] if bufs[table]["shape"] else None
        r = ranges.get(bufs[idx].get("name"))
        if r is None or not _is_int(rows) or r[0] < 0 or r[1] > rows:
            w.fail(f"programs.{name}.input_ranges", f"input {bufs[idx].get('name')!r:.40} indexes {rows!r:.20} rows "
                                                    f"(steps[{j}]) but its range is {r!r:.40}")


def _check_kv_pages(cfg, progs: dict, sizes: dict, w: _Where) -> None:
    """The pools' block counts against the pool buffers: runtime/kv_pages.py hands out block ids below
    ``blocks``, and a kernel writes row ``block * block_size + p % block_size`` of the pool."""
    pools = {}
    for name, p in progs.items():
        for i, b in enumerate(p["buffers"]):
            if b["alias_of"] is None and b.get("state") is not None and b["zone"] == "kv_pages":
                pools.setdefault(b["state"], (name, i, b))
    if cfg is None:
        if pools:
            w.fail("kv_pages", f"missing, but {sorted(pools)[0]} is a paged state (zone kv_pages)")
        return
    w.obj(cfg, "kv_pages")
    bs = w.int(w.key(cfg, "block_size", "kv_pages"), "kv_pages.block_size", 1, 1 << 20)
    tl = w.int(w.key(cfg, "table_len", "kv_pages"), "kv_pages.table_len", 1, 1 << 30)
    length = w.int(w.key(cfg, "length", "kv_pages"), "kv_pages.length", 1, tl * bs)
    # the runtime serves requests up to the largest symbol bound; positions past `length` have no table entry
    top = max((hi for p in progs.values() for _, _, hi in p["symbols"]), default=0)
    if top > length:
        w.fail("kv_pages.length", f"{length} is below the programs' largest symbol bound {top}")
    if "row_window" in cfg:  # the rows of each paged state the row-batched decode step takes per request
        w.int(cfg["row_window"], "kv_pages.row_window", 1, length)
    if "row_entries" in cfg:  # {state: compress rate}: compressed entries the row step reads below the bound
        for name, rate in w.obj(cfg["row_entries"], "kv_pages.row_entries").items():
            w.str(name, "kv_pages.row_entries key")
            w.int(rate, f"kv_pages.row_entries[{name!r:.40}]", 1, length)
    paged, names = set(), set()
    for k, t in enumerate(w.lst(w.key(cfg, "tables", "kv_pages"), "kv_pages.tables")):
        tp = f"kv_pages.tables[{k}]"
        w.obj(t, tp)
        tname = w.str(w.key(t, "name", tp), f"{tp}.name")
        w.int(w.key(t, "window", tp), f"{tp}.window", 0)
        blocks = w.int(w.key(t, "blocks", tp), f"{tp}.blocks", 2, 1 << 40)
        for s in w.lst(w.key(t, "states", tp), f"{tp}.states"):
            if s not in pools:
                w.fail(f"{tp}.states", f"{s!r:.40} is not a paged state buffer (zone kv_pages) of any program")
            pname, i, b = pools[s]
            if not any(_is_int(d) and d == blocks * bs for d in b["shape"]):
                w.fail(f"{tp}.blocks", f"{blocks} blocks of {bs} rows do not match the pool of {s} "
                                       f"(programs.{pname}.buffers[{i}] shape {b['shape']})")
            paged.add(s)
        names.add(tname)
        for name, p in progs.items():
            for i in p["inputs"]:
                b = p["buffers"][i]
                # [table_len], or [tokens, table_len] in a batched decode program (one table row per token)
                if b.get("name") == tname and not (b["shape"] == [tl] or (
                        len(b["shape"]) == 2 and b["shape"][1] == tl and isinstance(b["shape"][0], str))):
                    w.fail(f"programs.{name}.buffers[{i}].shape", f"the block table {tname} is {b['shape']}, "
                                                                  f"kv_pages.table_len is {tl}")
    for name, p in progs.items():  # the runtime passes a table to each input of kind block_table
        for i in p["inputs"]:
            n = p["buffers"][i].get("name") or ""
            if p["buffers"][i].get("input_kind") == BLOCK_TABLE and n not in names:
                w.fail(f"programs.{name}.buffers[{i}].name", f"{n!r:.40} is not a table of kv_pages.tables")
    if set(pools) - paged:
        w.fail("kv_pages.tables", f"no table maps the paged state(s) {sorted(set(pools) - paged)}")


# ---- weights.json --------------------------------------------------------------------------------------------

def check_weights(wj, pj: dict) -> None:
    """Every weight buffer has a weights.json entry of its dtype and shape; copy runs within the destination
    and reading from checkpoint keys the manifest lists (runs within the source are checked as the checkpoint
    is opened: ``check_run_source``); a sharded weight has one list of runs per rank of its mesh axis."""
    mesh = Mesh.from_json(pj.get("mesh"))
    w = _Where("weights.json")
    w.obj(wj, "(top)")
    check_format(wj.get("format"), "weights.json")
    tensors = w.obj(w.key(wj, "tensors", "(top)"), "tensors")
    ck = wj.get("checkpoint")
    keys = {}
    if ck is not None:
        w.obj(ck, "checkpoint")
        w.str(ck.get("dir"), "checkpoint.dir", none=True)
        keys = w.obj(w.key(ck, "keys", "checkpoint"), "checkpoint.keys")
        for k, f in keys.items():
            w.str(f, f"checkpoint.keys.{k}")
    for pname, p in pj["programs"].items():
        for i, b in enumerate(p["buffers"]):
            name = b.get("weight")
            if name is None or b["alias_of"] is not None:
                continue
            tp = f"tensors.{name}"
            if name not in tensors:
                w.fail("tensors", f"no entry for weight {name!r} (programs.{pname}.buffers[{i}])")
            e = w.obj(tensors[name], tp)
            if e.get("dtype") != b["dtype"]:
                w.fail(f"{tp}.dtype", f"{e.get('dtype')!r:.40} but the program's buffer is {b['dtype']}")
            if e.get("shape") != b["shape"] or not all(_is_int(d) for d in b["shape"]):
                w.fail(f"{tp}.shape", f"{e.get('shape')!r:.60} but the program's buffer is {b['shape']}")
            numel = math.prod(b["shape"])
            src = e.get("source")
            if src == "artifact":
                continue
            if src != "checkpoint":
                w.fail(f"{tp}.source", f"{src!r:.40} is neither 'artifact' nor 'checkpoint'")
            if "shard" in e:  # one list of runs per group rank (passes/shard.py)
                sh = w.obj(e["shard"], f"{tp}.shard")
                parts = mesh.size(sh.get("group")) if sh.get("group") in MESH_AXES else None
                if parts is None or parts < 2 or sh.get("parts") != parts or not _is_int(sh.get("dim")) or \
                        not 0 <= sh["dim"] < len(b["shape"]):
                    w.fail(f"{tp}.shard", f"{str(sh)[:60]} is not a split over an axis of the mesh {mesh.json()}")
                lists = w.lst(w.key(e, "shard_runs", tp), f"{tp}.shard_runs")
                if len(lists) != parts:
                    w.fail(f"{tp}.shard_runs", f"{len(lists)} lists of runs for {parts} ranks")
                runs = [(f"{tp}.shard_runs[{i}][{k}]", run) for i, lst in enumerate(lists)
                        for k, run in enumerate(w.lst(lst, f"{tp}.shard_runs[{i}]"))]
            else:
                runs = [(f"{tp}.runs[{k}]", run) for k, run in enumerate(w.lst(w.key(e, "runs", tp), f"{tp}.runs"))]
            for rp, run in runs:
                if not (isinstance(run, list) and len(run) == 4):
                    w.fail(rp, "expected [dst_offset, checkpoint key, src_offset, length]")
                d0 = w.int(run[0], f"{rp}[0]")
                key = w.str(run[1], f"{rp}[1]")
                w.int(run[2], f"{rp}[2]")
                length = w.int(run[3], f"{rp}[3]")
                if d0 + length > numel:
                    w.fail(rp, f"copies [{d0}, {d0 + length}) into a tensor of {numel} elements")
                if key not in keys:
                    w.fail(f"{rp}[1]", f"{key!r:.60} is not a key of checkpoint.keys")


def check_run_source(name: str, key: str, s0: int, length: int, shape) -> None:
    """A copy run reads elements [s0, s0 + length) of checkpoint tensor KEY (shape SHAPE)."""
    numel = math.prod(shape)
    if s0 + length > numel:
        raise UserError(f"weights.json: tensors.{name}: a run reads [{s0}, {s0 + length}) of checkpoint tensor "
                        f"{key} of {numel} elements")


# ---- kernels.so ------------------------------------------------------------------------------------------------

def check_kernels(pj: dict, lib) -> None:
    """Every kernel a step calls is a function of the loaded library."""
    for name, p in pj["programs"].items():
        for k in sorted({st["kernel"] for st in p["steps"] if st.get("collective") is None}):
            if not lib.implements_function(k, True):
                raise UserError(f"kernels.so has no function {k!r} (program.json: programs.{name})")
