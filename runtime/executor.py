"""The runtime: load an artifact, allocate one arena, bind the weights, run programs.

    arena = torch.empty(arena_bytes, uint8)     one allocation; every buffer is a 64-byte-aligned view into it
    weights zone  <- checkpoint recipes (copy runs from memory-mapped safetensors) / weights.safetensors
    prefill(input_ids) -> logits                symbols (seq) from the input's shape, then the steps in order

Kernels take DLPack views of the arena (TVM_NOTES: byte_offset must be 0 and the pointer 64-byte aligned, which
the planner guarantees). Argument lists are prepared once per distinct symbol binding and cached.
"""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Callable

import numpy as np
import sympy
import torch
import tvm
from safetensors import SafetensorError, safe_open

from dayzero import InternalError, UserError
from dayzero.codegen.artifact import recover_interrupted_swap
from dayzero.passes.ir.collective import Mesh
from dayzero.passes.ir.dayzero_ops import BLOCK_TABLE
from dayzero.passes.ir.ops import DTYPE_BYTES, torch_dtype
from dayzero.passes.ir.shape_expr import dim_function, parse_program_shapes
from dayzero.passes.memory_plan import ALIGN, PER_REQUEST_ZONES

from . import dist, request_checks, validate
from .kv_pages import KVPages

logger = logging.getLogger(__name__)



# a row program's compressed-entries state (kv_pages.row_entries) is gathered up to the row its requests' steps
# write, rounded up to this: its readers (tools/compiler.py ENTRY_READERS) read no row past a query's visible ones
# but the rest of the tile that holds the last (codegen/kernels/indexer.py JB = 16 rows), and discard it
ENTRY_ROWS_ALIGN = 64


class Filled:
    """A program input the caller writes straight into the program's own input buffer (``write(view)``), instead
    of handing over a tensor that ``run`` then copies there: a row program's gathered states."""

    def __init__(self, shape: tuple[int, ...], write: Callable[[torch.Tensor], None]):
        self.shape = torch.Size(shape)
        self.write = write

    def dim(self) -> int:
        return len(self.shape)


class _Program:
    def __init__(self, pj: dict, lib, arena: torch.Tensor, max_bytes: list[int]):
        self.name = pj["name"]
        self.max_bytes = max_bytes  # per buffer, as validated (runtime/validate.py): no view is larger
        # shape text -> expression, parsed by a grammar, never evaluated (program.json is untrusted input)
        self.symbols, self._exprs = parse_program_shapes(pj)
        self.buffers = pj["buffers"]
        self.offsets = {int(k): v for k, v in pj["memory"]["offsets"].items()}
        self.state_slots = pj["memory"].get("state_slots", 1)
        self.state_stride = pj["memory"].get("state_stride", 0)
        self.inputs = pj["inputs"]
        self.input_ranges = pj.get("input_ranges", {})
        self.outputs = pj["outputs"]
        self.arena = arena

        def root(b):
            a = self.buffers[b]["alias_of"]
            return b if a is None else a
        # outputs that are the new contents of a state (a KV cache written in place) are not returned
        self.user_outputs = [o for o in self.outputs if self.buffers[root(o)].get("state") is None]
        # block-table inputs (passes/paged_kv.py: input kind block_table), last: the runtime passes them
        self.table_inputs = [self.buffers[b]["name"] for b in self.inputs
                             if self.buffers[b].get("input_kind") == BLOCK_TABLE]
        self.states = {b["state"]: b["id"] for b in self.buffers if b.get("state") and b["alias_of"] is None
                       and b["zone"] in PER_REQUEST_ZONES}
        # states of every request (the dequant workspace and its expert cache): one copy, zeroed at load only
        self.shared_states = {b["state"]: b["id"] for b in self.buffers if b.get("state") and b["alias_of"] is None
                              and b["zone"] not in PER_REQUEST_ZONES}
        self._in_state = {b["id"] for b in self.buffers if self.buffers[root(b["id"])].get("state")
                          and self.buffers[root(b["id"])]["zone"] in PER_REQUEST_ZONES}
        order = list(self.symbols)
        fns = {d: dim_function(e, order) for d, e in self._exprs.items()}
        self._shape_fns = [[fns[d] if isinstance(d, str) else d for d in b["shape"]] for b in self.buffers]
        self._order = order
        self._funcs = {}
        self.steps = []
        for st in pj["steps"]:
            if st.get("collective") is not None:  # torch.distributed between kernels (runtime/dist.py)
                attrs = {k: v for k, v in st["collective"].items() if k != "op"}
                self.steps.append((dist.step(st["collective"]["op"], attrs, st["node"]), st["args"], [],
                                   st["node"], st["outputs"]))
                continue
            f = self._funcs.get(st["kernel"])
            if f is None:
                f = self._funcs[st["kernel"]] = lib[st["kernel"]]
            self.steps.append((f, st["args"], st.get("symbols", []), st["node"], st["outputs"]))
        # argument lists per (symbol binding, request slot); the views they hold of buffers outside the request
        # slots are shared by every slot of a binding, so a server's first call in a new slot makes only that
        # slot's state views (a DeepSeek-V4 program has thousands of views). One binding per prefill length: the
        # shared views of every length up to the bound are kept (a server's prompts take many lengths, and a
        # binding made again cost ~0.4 s on tiny DeepSeek-V4: its prompts, cycling through more lengths than
        # the cache held, rebuilt them on every prefill)
        bindings = int(np.prod([hi - lo + 1 for lo, hi in self.symbols.values()])) if self.symbols else 1
        self._shared_views = lru_cache(maxsize=min(max(16, bindings), 256))(lambda env: {})
        # a program with no per-request state (every cache paged, e.g. Qwen3-MoE's prefill) reads the same buffers
        # from every slot: one argument list per binding serves them all. Keyed by (binding, slot), a 16-slot
        # server's prompts of ~30 lengths overflowed the 64 lists kept, and each prefill rebuilt its list (every
        # view converted to a TVM tensor again)
        self._prepared = lru_cache(maxsize=64 if self._in_state else min(max(64, bindings), 256))(self._prepare)
        self._arena_as = {}  # dtype -> the arena viewed as that dtype (a buffer's view is one slice of it)

    def shape(self, bid: int, env: tuple) -> tuple[int, ...]:
        return tuple(d if isinstance(d, int) else int(d(*env)) for d in self._shape_fns[bid])

    def view(self, bid: int, env: tuple, slot: int = 0) -> torch.Tensor:
        """A buffer as a tensor view of the arena; state buffers (and their views) of request slot ``slot``."""
        b = self.buffers[bid]
        shape = self.shape(bid, env)
        n = math.prod(shape)
        off = self.offsets[bid] + (slot * self.state_stride if bid in self._in_state else 0)
        width = DTYPE_BYTES[b["dtype"]]
        nbytes = n * width
        if nbytes > self.max_bytes[bid]:
            raise UserError(f"buffer {bid} of program {self.name} is {nbytes} bytes at {env}, above the "
                            f"{self.max_bytes[bid]} its memory plan was checked for")
        if off % ALIGN:
            raise InternalError(f"buffer {bid} at unaligned offset {off}")
        whole = self._arena_as.get(b["dtype"])
        if whole is None:  # offsets are ALIGN-aligned, so a multiple of every dtype's width
            usable = self.arena.numel() - self.arena.numel() % width
            whole = self._arena_as[b["dtype"]] = self.arena[:usable].view(torch_dtype(b["dtype"]))
        v = whole[off // width:off // width + n]
        if n == 0:  # torch strides a 0-element tensor as if each 0 were 1; kernels check TVM's compact strides
            return v.as_strided(shape, [int(np.prod(shape[k + 1:])) for k in range(len(shape))])
        return v.view(shape)

    def _cache(self, env: tuple, slot: int = 0):
        """The prepared argument lists of a binding in a request slot (one list for every slot when the program
        has no per-request state)."""
        return self._prepared(env, slot if self._in_state else 0)

    def _prepare(self, env: tuple, slot: int = 0):
        shared, own = self._shared_views(env), {}

        def v(bid):
            views = own if bid in self._in_state else shared
            if bid not in views:
                views[bid] = self.view(bid, env, slot)
            return views[bid]
        values = dict(zip(self._order, env))
        calls = [(_no_call if n_out and all(v(a).numel() == 0 for a in args[-n_out:]) else f,  # nothing to write
                  [v(a) for a in args] + [values[s] for s in syms]) for f, args, syms, _, n_out in self.steps]
        # the same calls over TVM tensors made once here: a torch argument is converted (DLPack) on every call,
        # ~0.8 us each, more than a small kernel runs
        # (a collective step is torch.distributed's and keeps its torch views)
        native = {}
        for f, args in calls:
            for a in args:
                if isinstance(a, torch.Tensor) and id(a) not in native and not getattr(f, "torch_views", False):
                    native[id(a)] = _native(a)
        fast = [(f, args if getattr(f, "torch_views", False) else
                 [native[id(a)] if isinstance(a, torch.Tensor) else a for a in args]) for f, args in calls]
        return calls, fast, [v(i) for i in self.inputs], [v(o) for o in self.user_outputs]

    def bind(self, inputs: list[torch.Tensor]) -> tuple:
        for bid, t in zip(self.inputs, inputs):
            name = self.buffers[bid]["name"]
            if name in self.input_ranges and isinstance(t, Filled):
                raise InternalError(f"{name}: an input whose values are checked cannot be written in place")
            if name in self.input_ranges and t.numel():
                lo, hi = self.input_ranges[name]
                bad = (t < lo) | (t >= hi)
                if bool(bad.any()):
                    raise UserError(f"{name}: value {int(t[bad][0])} is outside [{lo}, {hi}) (vocabulary size {hi})")
        env = {}
        for bid, t in zip(self.inputs, inputs):
            for d, size in zip(self.buffers[bid]["shape"], t.shape):
                if isinstance(d, str) and d in self.symbols:
                    env[d] = int(size)
                elif isinstance(d, str):  # a linear dimension of one symbol (8*seq_blocks): solve for it
                    e = self._exprs[d]
                    free = list(e.free_symbols)
                    if len(free) == 1 and free[0].name in self.symbols and free[0].name not in env:
                        poly = sympy.Poly(e, free[0])
                        if poly.degree() == 1:
                            a, b = (int(c) for c in poly.all_coeffs())
                            if (int(size) - b) % a:
                                raise UserError(f"dimension {int(size)} is not of the compiled form {d}")
                            env[free[0].name] = (int(size) - b) // a
        for s, (lo, hi) in self.symbols.items():
            if s not in env:
                raise InternalError(f"symbol {s} is not bound by any input dimension")
            if not lo <= env[s] <= hi:
                raise UserError(f"{s}={env[s]} is outside the compiled range [{lo}, {hi}]")
        return tuple(env[s] for s in self._order)

    def pad(self, inputs: list[torch.Tensor]) -> tuple[list[torch.Tensor], dict[str, int]]:
        """Pad inputs on the right up to the nearest length the program was compiled for.

        A symbolic input dimension may be constrained (traced as ``8*seq_blocks`` with seq_blocks >= 2, or
        ``seq`` >= 4): a shorter or unaligned length is padded with zeros (token id 0) to the smallest size the
        expression takes at or above it. For a causal LM, tokens appended on the right do not change the logits
        of the tokens before them, so the outputs are sliced back (``run`` does it). Returns the padded inputs and
        {dimension expression: original size} for the dimensions that were padded."""
        padded, orig = [], {}
        for bid, t in zip(self.inputs, inputs):
            for axis, d in enumerate(self.buffers[bid]["shape"]):
                if not isinstance(d, str) or d in self.symbols or axis >= t.dim():
                    continue
                e = self._exprs[d]
                free = list(e.free_symbols)
                if len(free) != 1 or free[0].name not in self.symbols:
                    continue
                lo, hi = self.symbols[free[0].name]
                size = int(t.shape[axis])
                a, b = sympy.Poly(e, free[0]).all_coeffs() if sympy.Poly(e, free[0]).degree() == 1 else (None, None)
                if a is None or int(a) <= 0:
                    continue
                v = max(lo, -(-(size - int(b)) // int(a)))
                if v > hi:
                    continue  # bind() reports the out-of-range length
                target = int(a) * v + int(b)
                if target != size:
                    pad = [0, 0] * (t.dim() - axis - 1) + [0, target - size]
                    t = torch.nn.functional.pad(t, pad)
                    orig[d] = size
            padded.append(t)
        # a bare symbol with a lower bound (seq >= 4): pad up to it
        for k, (bid, t) in enumerate(zip(self.inputs, padded)):
            for axis, d in enumerate(self.buffers[bid]["shape"]):
                if isinstance(d, str) and d in self.symbols and axis < t.dim():
                    lo, _ = self.symbols[d]
                    size = int(t.shape[axis])
                    if 0 < size < lo:
                        t = torch.nn.functional.pad(t, [0, 0] * (t.dim() - axis - 1) + [0, lo - size])
                        orig[d] = size
            padded[k] = t
        return padded, orig

    def run(self, inputs: list[torch.Tensor], observe=None, slot: int = 0, views: bool = False) -> list[torch.Tensor]:
        """Run the steps; ``observe(step_index, node, output_views)`` (debugging, compare) sees each step's
        outputs right after it ran, before the arena reuses their bytes. Inputs shorter than (or not aligned to)
        what the program accepts are padded on the right and the outputs sliced back (see ``pad``). ``views``:
        the outputs are the arena's own views, not copies, valid until the next run of any program (a caller that
        reads them at once, such as the row-batched decode step writing its states back)."""
        with _glue_on_this_thread():
            inputs, orig = self.pad(inputs)
            outs = self._run(inputs, observe, slot, views)
            if orig:
                res = []
                for bid, o in zip(self.user_outputs, outs):
                    for axis, d in enumerate(self.buffers[bid]["shape"]):
                        if isinstance(d, str) and d in orig:
                            o = o.narrow(axis, 0, orig[d])
                    res.append(o.contiguous())
                outs = res
        return outs

    def _run(self, inputs: list[torch.Tensor], observe=None, slot: int = 0, views: bool = False) -> list[torch.Tensor]:
        if not 0 <= slot < self.state_slots:
            raise InternalError(f"request slot {slot} outside [0, {self.state_slots})")
        if len(inputs) != len(self.inputs):  # an input left unbound would be read as whatever the arena holds
            raise UserError(f"program {self.name} takes {len(self.inputs)} inputs, got {len(inputs)}")
        env = self.bind(inputs)
        calls, fast, in_views, out_views = self._cache(env, slot)
        for view, t in zip(in_views, inputs):
            if tuple(view.shape) != tuple(t.shape):
                raise UserError(f"input shape {tuple(t.shape)} does not match the program's {tuple(view.shape)}")
            t.write(view) if isinstance(t, Filled) else view.copy_(t)
        if observe is None:
            for f, args in fast:
                f(*args)
        else:
            for k, ((f, args), (_, bids, _, node, n_out)) in enumerate(zip(calls, self.steps)):
                f(*args)
                n_in = len(bids) - n_out
                observe(k, node, args[n_in:n_in + n_out])
        return list(out_views) if views else [o.clone() for o in out_views]


@contextmanager
def _glue_on_this_thread():
    """torch's copies, clones and indexing around the kernels (inputs into the arena, outputs out of it, a row
    program's gathers) run on the calling thread: above its grain size (32768 elements) torch hands them to its
    OpenMP pool, whose threads and TVM's (use_all_cores) then contend for the same cores. Measured on tiny
    DeepSeek-V4 (2 cores, median of 25): a 16-request decode_batch step took 47 ms of CPU (100 ms wall) with
    torch's 2 threads, 3 ms (7 ms wall) with 1; 8 requests (under the grain): 1.6 ms either way. The kernels keep
    TVM's pool."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _native(t: torch.Tensor):
    """``t`` as a TVM tensor sharing its memory (zero copy), or ``t`` itself where DLPack does not take its dtype."""
    try:
        return tvm.runtime.from_dlpack(t)
    except Exception:  # noqa: BLE001 - a dtype DLPack lacks: the call converts it each time, as before
        return t


def _no_call(*args) -> None:
    """Stands for a kernel whose outputs are all empty at this binding (a dimension such as ``seq - 1`` is 0)."""


def return_freed_heap() -> None:
    """Hand the heap pages freed since start back to the OS (glibc ``malloc_trim``; elsewhere nothing). Binding
    weights allocates and frees tens of MB of transient buffers (read buffers, the non-finite scan's masks) below
    glibc's mmap threshold, which glibc keeps resident after they are freed: 4% on top of the arena after loading
    full-width gpt-oss (2 layers: 144 of 3,286 MB), none after this."""
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim(0)


def use_all_cores() -> int:
    """The number of threads TVM's CPU pool runs kernels on: every CPU this process may use, as dayzero's import
    sized it (``dayzero/__init__.py``), or the user's TVM_NUM_THREADS / OMP_NUM_THREADS. A pool that some code
    started before dayzero was imported keeps its size (``config_threadpool`` cannot grow a started pool past
    it): logged, since kernels then run on fewer cores than asked."""
    import os

    n = int(tvm.get_global_func("runtime.NumThreads")())
    want = os.environ.get("TVM_NUM_THREADS", "")
    if want.isdigit() and n < int(want):
        logger.warning("TVM's thread pool runs %d thread(s), not TVM_NUM_THREADS=%s: it started before dayzero "
                       "was imported", n, want)
    return n


class Runtime:
    """A loaded artifact: ``prefill(input_ids) -> logits``."""

    def __init__(self, path: str | Path, progress: Callable[[int, int], None] | None = None,
                 dist_timeout_s: float = dist.DEFAULT_TIMEOUT_S):
        """``progress(bytes_bound, bytes_total)`` is called as the weights are bound (a load progress bar). A
        sharded artifact (its ``mesh``) joins its process groups here (runtime/dist.py: under torchrun, every
        collective waits ``dist_timeout_s`` at most) and binds only this rank's shards of the weights."""
        self.path = Path(path)
        # every file checked (format, sizes, hashes, schema, bounds, overlap) before dlopen and any kernel: validate.py
        recover_interrupted_swap(self.path)
        validate.check_files(self.path)
        self.program_json = validate.read_json(self.path / "program.json")
        self.manifest = validate.read_json(self.path / "weights.json")
        max_bytes = validate.check_program_json(self.program_json)
        validate.check_weights(self.manifest, self.program_json)
        self.mesh = Mesh.from_json(self.program_json.get("mesh"))
        self.rank = dist.setup(self.mesh, self.program_json.get("target", {}).get("kind", "llvm"), dist_timeout_s)
        self.lib = tvm.runtime.load_module(str(self.path / "kernels.so"))
        validate.check_kernels(self.program_json, self.lib)
        self.threads = use_all_cores()
        progs = self.program_json["programs"]
        arena_bytes = max(p["memory"]["arena_bytes"] for p in progs.values())
        # torch's CPU allocator aligns large allocations to 64 bytes; checked, since kernels require it
        try:
            self.arena = torch.empty(arena_bytes + ALIGN, dtype=torch.uint8)
        except RuntimeError as e:  # validated, but may still exceed this machine's memory
            raise UserError(f"{path}: cannot allocate the artifact's arena of {arena_bytes} bytes "
                            f"({str(e).splitlines()[0][:120]})") from None
        shift = (-self.arena.data_ptr()) % ALIGN
        self.arena = self.arena[shift:shift + arena_bytes]
        self.programs = {name: _Program(pj, self.lib, self.arena, max_bytes[name]) for name, pj in progs.items()}
        self._bind_weights(progress)
        return_freed_heap()
        for prog in self.programs.values():  # shared states start empty (an expert cache with no valid slot)
            for bid in prog.shared_states.values():
                prog.view(bid, ()).zero_()
        self.lengths: dict[int, int] = {}
        self.pending: dict[int, int | None] = {}  # per slot: the last generated token, not yet in the cache
        # the paged KV pools' free list and block tables (runtime/kv_pages.py); None: contiguous caches
        self.kv = KVPages.of(self.program_json, self.max_batch) if self.stateful else None
        from .multimodal import attach  # image + text artifacts (multimodal.json): runtime/multimodal.py
        self.multimodal = attach(self)
        if self.stateful:
            self.reset()

    def _bind_weights(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Copy every weight into the arena: the artifact's own tensors, and checkpoint tensors by their recipes'
        copy runs. The checkpoint is untrusted: its files must still have the fingerprints recorded at compile and
        every source tensor its recorded dtype and shape (``check_bound_files``), each run must lie within its
        source and destination, and, unless the artifact was compiled with --allow-nonfinite, the bound float
        weights must be finite. Every failure is a UserError naming the file and tensor.

        Checkpoint bytes are read with plain reads straight into the arena (through a bounded buffer where the
        dtypes differ), ``LOAD_CHUNK`` elements at a time, each byte once: a memory map would keep every page it
        read resident until its file closed, a whole checkpoint's worth on top of the arena at full size."""
        from dayzero.frontend.checkpoint import LOAD_CHUNK, TensorReader, check_bound_files

        tensors = self.manifest["tensors"]
        ck = self.manifest.get("checkpoint")
        own = self.path / "weights.safetensors"
        headers = check_bound_files(ck.get("files", {}), ck.get("tensors", {})) if ck is not None else {}
        handles = {}
        todo = {}  # a weight is placed once by name; programs may read different weights (vision, text)
        for prog in self.programs.values():
            for bid, b in enumerate(prog.buffers):
                if b.get("weight") is not None and b.get("alias_of") is None:
                    todo.setdefault(b["weight"], (prog, bid))
        total = sum(prog.max_bytes[bid] for prog, bid in todo.values())
        bound = 0
        name = None
        try:
            for name, (prog, bid) in todo.items():
                if progress is not None:
                    progress(bound, total)
                bound += prog.max_bytes[bid]
                entry = tensors.get(name)
                if entry is None:
                    raise UserError(f"{self.path}/weights.json: no entry for weight {name}, which the programs read")
                dst = prog.view(bid, ())
                if entry["source"] == "artifact":
                    if "own" not in handles:
                        handles["own"] = safe_open(str(own), framework="pt")
                    if name not in handles["own"].keys():
                        raise UserError(f"weights.safetensors has no tensor {name} (weights.json lists it there)")
                    t = handles["own"].get_tensor(name)
                    if t.numel() != dst.numel():
                        raise UserError(f"weights.safetensors: {name} has {t.numel()} elements, its buffer "
                                        f"{dst.numel()}")
                    dst.copy_(t.reshape(dst.shape))
                    continue
                if ck is None or "tensors" not in ck:
                    raise UserError(f"{self.path}/weights.json: weight {name} comes from a checkpoint the artifact "
                                    "does not record (compiled by an older dayzero? recompile it)")
                flat = dst.reshape(-1)
                runs = entry.get("runs", ())
                if "shard" in entry:  # this rank's slice only (passes/shard.py; checked by validate.check_weights)
                    runs = entry["shard_runs"][self.mesh.coord(self.rank, entry["shard"]["group"])]
                for run in runs:
                    if not (isinstance(run, list) and len(run) == 4 and isinstance(run[1], str) and
                            all(isinstance(x, int) and not isinstance(x, bool) for x in (run[0], *run[2:]))):
                        raise UserError(f"{self.path}/weights.json: weight {name}: copy run {run!r} is not "
                                        "[dst, key, src, length]")
                    d0, key, s0, length = run
                    src_info = ck["tensors"].get(key)
                    if src_info is None:
                        raise UserError(f"{self.path}/weights.json: weight {name} reads checkpoint tensor {key}, "
                                        "which the artifact does not record")
                    f = src_info["file"]
                    shape = src_info["shape"]
                    numel = int(np.prod(shape)) if shape else 1
                    if min(d0, s0, length) < 0 or d0 + length > flat.numel() or s0 + length > numel:
                        raise UserError(f"{self.path}/weights.json: weight {name}: copy run {[d0, key, s0, length]} "
                                        f"lies outside {key} ({numel} elements) or the weight ({flat.numel()})")
                    if f not in handles:
                        handles[f] = TensorReader(f)
                    handles[f].read_into(flat[d0:d0 + length], headers[f].tensors[key], s0)
                if not self.manifest.get("allow_nonfinite", False) and dst.dtype.is_floating_point:
                    if any(bool((~torch.isfinite(p.float() if p.element_size() == 1 else p)).any())
                           for p in flat.split(LOAD_CHUNK)):
                        keys = sorted({r[1] for r in runs})
                        raise UserError(f"weight {name} (checkpoint tensor {', '.join(keys[:3])}) holds NaN/Inf "
                                        "values; the artifact was compiled without --allow-nonfinite")
            if progress is not None:
                progress(total, total)
        except FileNotFoundError as e:
            raise UserError(f"checkpoint file missing: {e.filename or e}") from None
        except SafetensorError as e:
            raise UserError(f"checkpoint file unreadable while binding {name}: {e}") from None
        finally:
            for h in handles.values():
                if isinstance(h, TensorReader):
                    h.close()
            handles.clear()

    # -- serving ------------------------------------------------------------------------------------------------
    @property
    def stateful(self) -> bool:
        """True when the artifact has a decode program sharing a KV cache with prefill."""
        return "decode" in self.programs

    @property
    def max_length(self) -> int:
        """Tokens a request may hold in total (prompt + generated): the compiled cache length (read once: the
        engine asks at every request and decode step)."""
        if getattr(self, "_max_length", None) is None:
            if self.program_json.get("max_seq"):
                self._max_length = int(self.program_json["max_seq"])
            else:
                prog = self.programs["prefill"]  # artifacts without a cache (or from before chunked prefill)
                self._max_length = max(hi for lo, hi in prog.symbols.values()) if prog.symbols else 0
        return self._max_length

    @property
    def prefill_chunk(self) -> int:
        """The most tokens one prefill call takes (``dayzero compile --prefill-chunk``): the longest token-id input
        the prefill program accepts; ``prefill`` splits a longer prompt into chunks of this size."""
        prog = self.programs["prefill"]
        if not prog.symbols:
            return self.max_length
        ids = next(b for b in prog.inputs if prog.buffers[b]["name"] == "input_ids")
        return prog.shape(ids, tuple(prog.symbols[s][1] for s in prog._order))[-1]

    @property
    def tokenizer(self):
        """The checkpoint's tokenizer carried in the artifact (transformers' own class), or None without one."""
        if not hasattr(self, "_tokenizer"):
            from .text import load_tokenizer

            self._tokenizer = load_tokenizer(self.path)
        return self._tokenizer

    @property
    def eos_ids(self) -> list[int]:
        """Token ids that end a generation: the checkpoint's generation config and its tokenizer's eos token."""
        if not hasattr(self, "_eos_ids"):
            from .text import eos_ids

            self._eos_ids = eos_ids(self.path, self.tokenizer)
        return self._eos_ids

    @property
    def max_batch(self) -> int:
        """Requests that can be in flight at once (each has its own KV-cache slot)."""
        return self.programs["prefill"].state_slots

    @property
    def vocab_size(self) -> int | None:
        """Token ids the model takes are in [0, vocab_size) (None: the artifact does not state a range)."""
        prog = self.programs["prefill"]
        if not prog.inputs:
            return None
        rng = prog.input_ranges.get(prog.buffers[prog.inputs[0]]["name"])
        return None if rng is None else int(rng[1])

    def reset(self, slot: int | None = None) -> None:
        """Forget the request in a cache slot (all slots when None): states are zero when a request starts."""
        slots = range(self.max_batch) if slot is None else [request_checks.slot(slot, self.max_batch)]
        prog = self.programs["prefill"]
        for k in slots:
            for bid in prog.states.values():
                prog.view(bid, (), k).zero_()
            if self.kv is not None:
                self.kv.release(k)
            self.lengths[k] = 0
            self.pending[k] = None

    def run_program(self, name: str, inputs: list[torch.Tensor], slot: int, tokens: int,
                    observe=None) -> list[torch.Tensor]:
        """Run a program of the request in ``slot``, which holds ``tokens`` positions once it ran: their KV blocks
        are taken first (runtime/kv_pages.py; a full pool is a UserError for this request), and the slot's block
        table is passed to a program that reads paged caches. ``observe``: as ``Program.run``'s (per-step timing,
        tools/bench_long.py)."""
        prog = self.programs[name]
        if self.kv is None or not prog.table_inputs:
            return prog.run(inputs, observe=observe, slot=slot)
        self.kv.ensure(slot, tokens)
        out = prog.run(list(inputs) + [self.kv.table(t, slot) for t in prog.table_inputs], observe=observe, slot=slot)
        self.kv.trim(slot, tokens)  # sliding-window pools: blocks the next query cannot see go back
        return out

    @property
    def length(self) -> int:
        return self.lengths.get(0, 0)

    def _ids(self, input_ids, name: str = "input_ids") -> torch.Tensor:
        """One request's token ids -> int64 [1, n], each in the vocabulary (runtime/validate.py)."""
        return request_checks.token_ids(input_ids, self.vocab_size, name)

    def _token(self, token_id) -> torch.Tensor:
        """The one token id ``decode`` appends -> int64 [1, 1]."""
        ids = self._ids(token_id, "token_id")
        if ids.shape[1] != 1:
            raise UserError(f"token_id: decode appends one token id, got {ids.shape[1]}")
        return ids

    def prefill(self, input_ids, slot: int = 0, append: bool = False, last: bool = False) -> torch.Tensor:
        """Logits [1, P, V] of the prompt; on a stateful artifact it also starts a request in cache slot
        ``slot`` (fills its cache). ``append=True`` adds the tokens to the request already in the slot (a second
        turn of a conversation): positions continue after its history, which is read from the cache, never
        prefilled again. A prompt longer than ``prefill_chunk`` runs as several prefill calls of at most that many
        tokens, each appended after the ones before. ``last=True``: the last position's logits only, [1, 1, V]
        (what generation reads; a 1M-token prompt's whole logits are 1 GB at V = 256)."""
        slot = request_checks.slot(slot, self.max_batch)
        if self.multimodal is not None:
            out = self.multimodal.prefill(input_ids, slot=slot)
            return out[:, -1:] if last else out
        ids = self._ids(input_ids)
        prog = self.programs["prefill"]
        if not self.stateful:
            out = prog.run([ids])[0]
            return out[:, -1:] if last else out
        n = ids.shape[1]
        start = self.lengths.get(slot, 0) if append else 0
        if append and start == 0:
            raise UserError("nothing to append to: start the request with prefill(prompt_ids)")
        if start + n > self.max_length:
            raise UserError(f"prompt of {n} tokens after {start} cached ones is longer than the compiled "
                            f"maximum {self.max_length}")
        if not append:
            self.reset(slot)
        chunk = self.prefill_chunk
        if last:
            for k in range(0, n, chunk):
                out = self._prefill_chunk(ids[:, k:k + chunk], slot, last=True)
            return out[:, -1:]
        logits = [self._prefill_chunk(ids[:, k:k + chunk], slot) for k in range(0, n, chunk)]
        return logits[0] if len(logits) == 1 else torch.cat(logits, dim=1)

    def _prefill_chunk(self, ids: torch.Tensor, slot: int, last: bool = False) -> torch.Tensor:
        """One prefill call: ``ids`` [1, n] (n <= prefill_chunk) at the positions after the slot's history.
        ``last``: only the last token's logits are wanted, [1, 1, V]: the ``prefill_last`` program computes the LM
        head for that row alone (passes/last_position.py), where the artifact has it."""
        name = "prefill_last" if last and "prefill_last" in self.programs else "prefill"
        prog = self.programs[name]
        n = ids.shape[1]
        start = self.lengths.get(slot, 0)
        (padded, _), _ = prog.pad([ids, torch.zeros(n, dtype=torch.int64)])
        # padding tokens sit at positions after the prompt (written to the cache, never attended: the next chunk
        # or decode overwrites them)
        width = padded.shape[-1]
        if start + width > self.max_length:
            raise UserError(f"the request reached the cache budget of {self.max_length} tokens")
        padded_ids = torch.nn.functional.pad(ids, [0, width - n])
        inputs = [padded_ids, torch.arange(start, start + width)]
        if name == "prefill_last":
            inputs.append(torch.tensor([n - 1]))  # the chunk's last real token (0 <= n - 1 < width)
        logits = self.run_program(name, inputs, slot, start + n)[0][:, :n]
        self.lengths[slot] = start + n
        return logits.contiguous()

    def decode(self, token_id, slot: int = 0) -> torch.Tensor:
        """Logits [1, 1, V] after appending one token to the request in ``slot``; reads and extends its cache."""
        slot = request_checks.slot(slot, self.max_batch)
        if not self.stateful:
            raise UserError("this artifact has no decode program (its model's cache has no static form): "
                            "generation is not available for it")
        length = self.lengths.get(slot, 0)
        if length == 0:
            raise UserError("decode before prefill: start a request with prefill(prompt_ids)")
        if length >= self.max_length:
            raise UserError(f"the request reached the cache budget of {self.max_length} tokens")
        if self.multimodal is not None:
            return self.multimodal.decode(token_id, slot=slot)
        ids = self._token(token_id)
        out = self.run_program("decode", [ids, torch.tensor([length])], slot, length + 1)[0]
        self.lengths[slot] = length + 1
        return out

    @property
    def has_batched_decode(self) -> bool:
        """True when the artifact has a batched decode program (``decode_batch``): every architecture whose KV
        caches are fully paged, multimodal ones included (their text decode; runtime/multimodal.py gives the
        M-RoPE positions), and DeepSeek-V4, whose compressed caches are per-request states: its ``decode_batch``
        takes them as inputs, one row per request (``_decode_rows``)."""
        return "decode_batch" in self.programs and self.kv is not None

    def decode_batch(self, tokens: list[int], slots: list[int]) -> torch.Tensor:
        """Logits [B, V] after appending ``tokens[i]`` to the request in ``slots[i]``, for B requests in one run
        of the batched decode program: each at its own position, reading and writing its own KV blocks (taken
        and trimmed per request as ``run_program`` does), every weight read once for all of them."""
        if not self.has_batched_decode:
            raise UserError("this artifact has no batched decode program (its caches are not all paged): step "
                            "each request with decode(token, slot)")
        tokens, slots = list(tokens), list(slots)
        if not slots or len(tokens) != len(slots):
            raise UserError(f"decode_batch takes one token per slot: got {len(tokens)} tokens for {len(slots)} slots")
        prog = self.programs["decode_batch"]
        if len(slots) > self.max_batch:
            raise UserError(f"{len(slots)} requests in one step but the artifact serves {self.max_batch} at once "
                            "(--max-batch)")
        for s in slots:
            if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or not 0 <= s < self.max_batch:
                raise UserError(f"slot {s!r} is not a request slot: slots are 0..{self.max_batch - 1}")
        if len(set(int(s) for s in slots)) != len(slots):
            raise UserError(f"slots {slots}: a request appears twice in one step")
        for t in tokens:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                raise UserError(f"token {t!r} is not a token id")
        slots = [int(s) for s in slots]
        positions = [self.lengths.get(s, 0) for s in slots]
        for s, n in zip(slots, positions):
            if n == 0:
                raise UserError(f"slot {s}: decode before prefill: start a request with prefill(prompt_ids, slot)")
            if n >= self.max_length:
                raise UserError(f"slot {s}: the request reached the cache budget of {self.max_length} tokens")
        ids = torch.tensor([[int(t) for t in tokens]], dtype=torch.int64)
        lo, hi = prog.input_ranges.get("input_ids", (0, 2 ** 63))
        for s, t in zip(slots, tokens):
            if not lo <= int(t) < hi:
                raise UserError(f"slot {s}: token {int(t)} is outside [{lo}, {hi}) (vocabulary size {hi})")
        for s, n in zip(slots, positions):
            try:
                self.kv.ensure(s, n + 1)
            except UserError as e:  # a full pool: no step runs; blocks taken for the slots before stay theirs
                raise UserError(f"slot {s}: {e}") from None
        pos = torch.tensor(positions, dtype=torch.int64)
        if self._row_batched:
            out = self._decode_rows(prog, ids.view(-1, 1), pos, slots)
            for s, n in zip(slots, positions):
                self.lengths[s] = n + 1
                self.kv.trim(s, n + 1)
            return out.reshape(len(slots), -1)
        tables = [self.kv.batch_table(t, slots) for t in prog.table_inputs]
        inputs = [ids, pos] if self.multimodal is None else self.multimodal.decode_inputs(ids, pos, slots)
        out = prog.run(inputs + tables)[0]
        for s, n in zip(slots, positions):
            self.lengths[s] = n + 1
            self.kv.trim(s, n + 1)
        return out.reshape(len(slots), -1)

    @property
    def _row_batched(self) -> bool:
        """True when ``decode_batch`` is DeepSeek-V4's row program (frontend/decode_export.py ``RowDecodeStep``):
        row b is request b, and its states are inputs and outputs rather than states of the program."""
        prog = self.programs["decode_batch"]
        return len(prog.inputs) > 2 and prog.buffers[prog.inputs[1]]["name"] == "positions"

    @cached_property
    def _row_plan(self) -> list[tuple[str, str | None, int]]:
        """Per state input of the row program: (state, its block-table class or None for a per-request state,
        rows L of a paged one: the window ending at the request's token, ``kv_pages.row_window``, or, in an
        artifact without it, positions [0, L)); checked against the decode program's states (program.json is
        untrusted)."""
        prog, dec = self.programs["decode_batch"], self.programs["decode"]
        pages = self.program_json["kv_pages"]
        table_of = {s: c["name"] for c in pages["tables"] for s in c["states"]}
        plan = []
        for bid in prog.inputs[2:]:
            b = prog.buffers[bid]
            name, shape = b["name"], list(b["shape"])
            own = dec.states.get(name, dec.shared_states.get(name))
            want = None if own is None else list(dec.buffers[own]["shape"])
            if want is not None and name in table_of:  # [1, H, blocks * bs, D] -> [B, H, L, D]
                want[2] = pages.get("row_window", pages["length"])
            if want is None or shape[1:] != want[1:] or b["dtype"] != dec.buffers[own]["dtype"] or \
                    (name not in dec.states and name not in table_of):
                raise UserError(f"program.json: decode_batch input {name!r} is no state of the decode program")
            plan.append((name, table_of.get(name), int(shape[2]) if name in table_of else 0))
        return plan

    @cached_property
    def _row_views(self) -> dict[str, torch.Tensor]:
        """State -> its view in the decode program's arena: a per-request state as every slot's copy at once,
        [slots, ...] (slot k's copy lies ``state_stride`` bytes after slot k-1's: one strided view), so a step
        gathers and scatters it with one indexed op, not one per request; a paged pool [H, blocks * bs, D]."""
        dec = self.programs["decode"]
        views = {}
        for name, table_name, _ in self._row_plan:
            if table_name is not None:
                views[name] = dec.view(dec.shared_states[name], ())[0]
                continue
            bid, n = dec.states[name], dec.state_slots
            first, last = dec.view(bid, (), 0), dec.view(bid, (), n - 1)  # view() checks every slot's bounds
            step, rem = divmod(dec.state_stride, first.element_size())
            if first.shape[0] != 1 or rem or (n > 1 and step < first.numel()):
                raise InternalError(f"state {name}: slot copies {dec.state_stride} bytes apart do not stack")
            views[name] = first.as_strided((n, *first.shape[1:]), (step, *first.stride()[1:]),
                                           first.storage_offset())
            if views[name][n - 1].data_ptr() != last.data_ptr():
                raise InternalError(f"state {name}: the stacked view misses slot {n - 1}'s copy")
        return views

    def _decode_rows(self, prog, ids: torch.Tensor, pos: torch.Tensor, slots: list[int]) -> torch.Tensor:
        """One run of the row program: each input state is the requests' states stacked (a per-request state: the
        slots' copies; a paged K=V cache: the L rows of the window ending at each request's token, positions
        [p - L + 1, p], read through its block table, positions before 0 as position 0's row, which the mask
        hides; an artifact without ``kv_pages.row_window``: positions [0, L), blocks handed back read the scratch
        block), and each output's new contents go back (a per-request state: whole; a paged cache: the one row
        each request wrote, its last row, or row p in the old layout)."""
        with _glue_on_this_thread():
            return self._decode_rows_here(prog, ids, pos, slots)

    def _decode_rows_here(self, prog, ids: torch.Tensor, pos: torch.Tensor, slots: list[int]) -> torch.Tensor:
        views = self._row_views
        bs = self.kv.block_size
        rows = torch.arange(len(slots))
        at_slots = torch.tensor(slots, dtype=torch.int64)
        entries = self._row_entries
        inputs, back = [ids, pos], []
        for name, table_name, length in self._row_plan:
            src = views[name]
            if table_name is None and name in entries:  # rows up to the one each step writes; that row back
                at = (pos // entries[name]).clamp_(max=src.shape[1] - 1)
                n = min(src.shape[1], -(-(int(at.max()) + 1) // ENTRY_ROWS_ALIGN) * ENTRY_ROWS_ALIGN)
                inputs.append(Filled((len(slots), *src.shape[1:]), lambda view, src=src, n=n: [
                    view[k, :n].copy_(src[s, :n]) for k, s in enumerate(slots)]))
                back.append((src, at))
                continue
            if table_name is None:
                inputs.append(Filled((len(slots), *src.shape[1:]),
                                     lambda view, src=src: torch.index_select(src, 0, at_slots, out=view)))
                back.append(src)
                continue
            pool = views[name]
            table = self.kv.batch_table(table_name, slots).long()  # [B, table_len]
            at = self._held_positions(pos, length)  # [B, L]: the position of each row
            where = table.gather(1, at // bs) * bs + at % bs  # [B, L]: pool row of each position
            inputs.append(pool.index_select(1, where.flatten()).view(pool.shape[0], len(slots), -1, pool.shape[2])
                          .transpose(0, 1))
            back.append((pool, table[rows, pos // bs] * bs + pos % bs, self._row_window is None))
        out = prog.run(inputs, views=True)  # the new states are read once, straight from the arena
        for dest, new in zip(back, out[1:]):
            if isinstance(dest, torch.Tensor):
                dest.index_copy_(0, at_slots, new)
            elif len(dest) == 2:  # compressed entries: the row each step wrote
                src, at = dest
                src[at_slots, at] = new[rows, at]
            else:
                pool, at, whole = dest
                pool[:, at] = (new[rows, :, pos] if whole else new[:, :, -1]).transpose(0, 1)
        return out[0].clone()

    @cached_property
    def _row_entries(self) -> dict[str, int]:
        """``kv_pages.row_entries``: {per-request state: compress rate} of the row program's compressed entries
        read only below each query's causal bound (tools/compiler.py ``rows_entries``); {} in an older artifact
        (every such state gathered and written back whole)."""
        plan = {name: table for name, table, _ in self._row_plan}
        ent = self.program_json["kv_pages"].get("row_entries", {})
        for name in ent:
            if plan.get(name, "") is not None or self._row_views[name].dim() != 3:
                raise UserError(f"program.json: kv_pages.row_entries names {name!r:.40}, no per-request "
                                "[rows, width] state of the batched decode step")
        return ent

    @cached_property
    def _row_window(self) -> int | None:
        """``kv_pages.row_window`` (the row program's paged states hold the window ending at each request's
        token), or None (an older artifact's: every position)."""
        return self.program_json["kv_pages"].get("row_window")

    def _held_positions(self, pos: torch.Tensor, length: int) -> torch.Tensor:
        """[B, length]: the position of each row the row program takes of a paged state, for requests at ``pos``:
        the window ending at the token (before position 0: position 0, masked), or [0, length)."""
        if self._row_window is None:
            return torch.arange(length).expand(len(pos), -1)
        return (pos.view(-1, 1) - (length - 1) + torch.arange(length)).clamp_(min=0)

    def generate(self, prompt_ids, max_new_tokens: int = 32, stop_ids=(), temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, images=None, slot: int = 0, append: bool = False) -> list[int]:
        """Prefill the prompt, then decode up to ``max_new_tokens`` tokens (greedy when temperature is 0, else
        temperature + nucleus sampling with a seeded generator); stops after a token in ``stop_ids``.
        ``images`` (paths, PIL images, arrays) join the prompt at its image tokens (multimodal artifacts).
        ``append=True`` continues the conversation in ``slot``: its history (including the last generated token)
        stays in the cache and only the new turn is prefilled."""
        request_checks.sampling(max_new_tokens, temperature, top_p, seed)
        slot = request_checks.slot(slot, self.max_batch)
        if self.multimodal is not None:
            return self.multimodal.generate(prompt_ids, max_new_tokens, images or (), stop_ids, temperature,
                                            top_p, seed)
        if images:
            raise UserError("this artifact has no vision program: images need a multimodal checkpoint")
        ids = self._ids(prompt_ids)
        stops = self._stops(stop_ids)
        if append and self.pending.get(slot) is not None:  # the last generated token is not in the cache yet
            ids = torch.cat([torch.tensor([[self.pending[slot]]]), ids], dim=1)
        history = self.lengths.get(slot, 0) if append else 0
        if history + ids.shape[1] + max_new_tokens > self.max_length:
            raise UserError(f"prompt ({ids.shape[1]}) + max_new_tokens ({max_new_tokens}) exceeds the compiled "
                            f"maximum of {self.max_length} tokens")
        gen = torch.Generator().manual_seed(seed)
        logits = self.prefill(ids, slot=slot, append=append, last=True)[0, -1]
        self.pending[slot] = None
        out: list[int] = []
        for k in range(max_new_tokens):
            tok = _pick(logits, temperature, top_p, gen)
            out.append(tok)
            if tok in stops or k == max_new_tokens - 1:
                self.pending[slot] = tok  # sampled, not yet written to the cache
                break
            logits = self.decode(tok, slot=slot)[0, -1]
        return out

    def _stops(self, stop_ids) -> set[int]:
        """Stop token ids (any iterable of ids, or one id) -> a set, each in the vocabulary."""
        if isinstance(stop_ids, (set, frozenset, range)):
            stop_ids = list(stop_ids)
        return set(request_checks.token_ids(stop_ids, self.vocab_size, "stop_ids", allow_empty=True)[0].tolist())

    def run(self, *inputs) -> list[torch.Tensor]:
        """Run the prefill program on generic inputs (ONNX models: any names, dtypes, ranks), given in the
        program's input order; symbols bind from their shapes. Returns every output."""
        prog = self.programs["prefill"]
        if len(inputs) != len(prog.inputs):
            raise UserError(f"the program takes {len(prog.inputs)} inputs, got {len(inputs)}")
        ts = [x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x)) for x in inputs]
        return prog.run(ts)

def generate_batch(rt: "Runtime", prompts: list, max_new_tokens: int = 32, stop_ids=(), temperature: float = 0.0,
                   top_p: float = 1.0, seed: int = 0) -> list[dict]:
    """Serve several requests at once, each in its own KV-cache slot, decode steps interleaved.

    A request that fails (empty prompt, a token outside the vocabulary, a prompt longer than the compiled maximum,
    a request beyond the cache budget, a malformed one: not a list of int ids) gets its error; the others keep going.
    Bad parameters shared by every request (max_new_tokens, stop_ids, temperature, top_p, seed) raise a
    UserError before any request runs. Returns per request ``{"tokens": [...], "error": str | None}``."""
    request_checks.sampling(max_new_tokens, temperature, top_p, seed)
    stops = rt._stops(stop_ids)
    request_checks.batch(prompts, rt.max_batch, "prompts", "a list of requests (token id lists)")
    results = [{"tokens": [], "error": None} for _ in prompts]
    logits: dict[int, torch.Tensor] = {}
    gens = {}
    for k, prompt in enumerate(prompts):
        try:
            ids = rt._ids(prompt)
            if ids.shape[1] + max_new_tokens > rt.max_length:
                raise UserError(f"prompt ({ids.shape[1]}) + max_new_tokens ({max_new_tokens}) exceeds the "
                                f"cache budget of {rt.max_length} tokens")
            logits[k] = rt.prefill(ids, slot=k, last=True)[0, -1]
            gens[k] = torch.Generator().manual_seed(seed + k)
        except UserError as e:
            results[k]["error"] = str(e)
            if rt.stateful:
                rt.reset(k)  # its KV blocks go back to the pool for the others
    def step(tok, k):
        try:
            return rt.decode(tok, slot=k)[0, -1]
        except UserError:
            rt.reset(k)  # a request that failed (the KV pool is full) frees its blocks for the others
            raise
    decode_interleaved(results, logits, gens, step, max_new_tokens, stops, temperature, top_p,
                       batch_step=rt.decode_batch if rt.has_batched_decode else None)
    return results


def decode_interleaved(results: list[dict], logits: dict, gens: dict, step, max_new_tokens: int, stop_ids,
                       temperature: float, top_p: float, raise_errors: bool = False, batch_step=None) -> None:
    """Decode steps of every live request until each stops; ``step(token, k) -> next logits`` of request k (in
    slot k). With ``batch_step(tokens, ks) -> logits [B, V]`` (``Runtime.decode_batch``), two or more live
    requests advance in one call; when that call refuses (a full KV pool), each steps alone that round. A request
    whose step raises a UserError records it and drops out (others keep going). The parameters are the
    callers', already checked (request_checks.sampling; stop_ids: ints)."""
    stops = set(int(s) for s in stop_ids)
    active = sorted(k for k in logits if max_new_tokens > 0)
    while active:
        moving = []  # (token, k) of the requests that go on
        for k in active:
            tok = _pick(logits[k], temperature, top_p, gens[k])
            results[k]["tokens"].append(tok)
            if tok not in stops and len(results[k]["tokens"]) < max_new_tokens:
                moving.append((tok, k))
        if batch_step is not None and len(moving) > 1:
            try:
                rows = batch_step([t for t, _ in moving], [k for _, k in moving])
            except UserError:
                rows = None  # nothing ran: one request at a time finds the one that cannot go on
            if rows is not None:
                for (_, k), row in zip(moving, rows):
                    logits[k] = row
                active = [k for _, k in moving]
                continue
        active = []
        for tok, k in moving:
            try:
                logits[k] = step(tok, k)
                active.append(k)
            except UserError as e:
                if raise_errors:
                    raise
                results[k]["error"] = str(e)


def _pick(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < top_p  # the smallest prefix whose mass reaches top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=gen))


def load(path: str | Path, progress: Callable[[int, int], None] | None = None,
         dist_timeout_s: float = dist.DEFAULT_TIMEOUT_S) -> Runtime:
    return Runtime(path, progress, dist_timeout_s)
