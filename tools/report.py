"""``dayzero report OUT [--json] [--plot FILE.png]``: what a compiled artifact is made of, from its files alone.

    report.json + program.json ──► kernels    kernel -> op, route (hand-scheduled / tuned / default / generic)
                               ──► op counts  steps per op (what the program executes), kernels per route
                               ──► patterns   pattern -> times found; unsupported ops (a list, empty when compiled)
                               ──► memory     per program: arena vs peak-live lower bound, zones (with
                                              cross_layer_state: the streams one decoder layer hands to a later
                                              one, see codegen/memory.cross_layer_roots), buffers
                               ──► kv_cache   per attention layer type: layers, cache bytes per token
    --plot                     ──► the arena over program time: one rectangle per buffer
                                   (x = [first step, last step + 1), y = [offset, offset + bytes)), zone colours

Nothing is recompiled: the buffer lifetimes come from report.json (``programs.<name>.memory.buffers`` =
``[offset, bytes, first_step, last_step, zone]``, written by ``codegen/memory.plan_programs``).

The KV-cache figures are read off the state buffers the programs share (``program.json``, zone ``kv_cache``),
one request slot's worth: a state with a dimension of the compiled maximum length (the longest prompt the prefill
program takes) grows with the context, ``bytes / max_length`` per token; any other state is a per-sequence
constant (``fixed_bytes``).  States are grouped by the layer index in their name; layers whose caches look the same
form one layer type, named by the checkpoint config's ``layer_types`` where it has one (else by the states'
names).  It reports what the cache *holds*: a sliding-window layer that keeps ``max_length`` rows shows it
(``rows`` against ``window``), it is not corrected to what the model needs.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from pathlib import Path

import click

from dayzero import UserError
from dayzero.passes.ir.shape_expr import check_symbols, dim_at, parse_program_shapes

ROUTES = ("hand-scheduled", "tuned", "default", "generic")
MIB = 1 << 20
# one fixed colour per zone, so plots of different models read the same way
ZONE_COLOURS = {"weights": "#4c72b0", "low_precision_weights": "#8172b2", "dequant_workspace": "#ccb974",
                "kv_cache": "#c44e52", "kv_pages": "#e377c2", "cross_layer_state": "#937860",
                "activations": "#55a868", "io": "#dd8452"}
_FALLBACK_COLOURS = ("#64b5cd", "#da8bc3", "#8c8c8c", "#ff9f9b")


def _read_json(path: str, what: str) -> dict:
    from dayzero.runtime.validate import read_json

    return read_json(Path(path), what)


def _check_artifact(artifact: str) -> None:
    """An artifact (its files against artifact.json's sizes and hashes), or at least its program and kernels."""
    from dayzero.codegen.artifact import MANIFEST
    from dayzero.runtime.validate import check_files

    if os.path.isfile(os.path.join(artifact, MANIFEST)):
        check_files(Path(artifact))
        return
    for what in ("program.json", "kernels.so"):
        if not os.path.isfile(os.path.join(artifact, what)):
            raise UserError(f"{artifact}: not a dayzero artifact (no {what})")


def _step_op(node: str) -> str:
    return node.split(" at ", 1)[0]


_LAYER_IN_NAME = re.compile(r"(?:^|[._])(\d+)(?=[._]|$)")
_DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
                "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


def _max_length(prog: dict) -> int | None:
    """The longest sequence the program takes: the token-id input's length at the symbols' upper bounds."""
    bounds = {s: hi for s, (lo, hi) in check_symbols(prog.get("symbols", [])).items()}
    names = set(prog.get("input_ranges", {}))
    for b in prog.get("buffers", []):
        if b.get("zone") == "io" and b.get("name") in names and b["shape"]:
            d = b["shape"][-1]
            return dim_at(d, bounds)
    return None


def _checkpoint_config(artifact: str) -> dict:
    """The checkpoint's config.json, where the artifact names a checkpoint directory that still has it."""
    try:
        with open(os.path.join(artifact, "weights.json")) as f:
            ck = json.load(f).get("checkpoint") or {}
        with open(os.path.join(ck.get("dir", ""), "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return {}
    return cfg.get("text_config", cfg) if isinstance(cfg, dict) else {}


def _state_entry(b: dict, length: int, desc: dict | None, pages: dict | None = None) -> dict:
    """One cache state's bytes: per token of context when it covers the whole context, else a per-sequence
    constant.  ``desc`` (report.json ``kv_cache_layout``, from the compile) names the token-position dim and the
    compression rate (one row per ``compress_rate`` tokens); without it a dim equal to ``length`` is taken as the
    position dim (older artifacts).  A paged state (zone ``kv_pages``) is a pool: a request holds at most
    ``length`` rows of it, and one in a sliding-window pool (the ``pages`` table listing it) ceil(W / bs) + 1
    blocks between calls (passes/paged_kv.py): a per-sequence constant, whatever the context."""
    nbytes = math.prod(b["shape"]) * _DTYPE_BYTES[b["dtype"]]
    if desc is not None:
        pos, rate = desc.get("position_dim"), desc.get("compress_rate") or 1
    else:
        pos, rate = (b["shape"].index(length) if length in b["shape"] else None), 1
    rows = b["shape"][pos] if pos is not None else None
    grows = rows is not None and rows * rate >= length  # a ring of the last rows (a window) does not grow
    entry = {"shape": b["shape"], "dtype": b["dtype"], "rows": rows, "compress_rate": rate,
             "bytes_per_token": nbytes / rows / rate if grows else 0, "fixed_bytes": 0 if grows else nbytes}
    window = desc.get("sliding_window") if desc is not None else None
    pool_window = next((t["window"] for t in (pages or {}).get("tables", []) if b["state"] in t.get("states", ())),
                       0) if b.get("zone") == "kv_pages" else 0
    if pool_window:  # blocks behind the window go back: ceil(W / bs) + 1 blocks between calls, a constant (the
        # pool may be smaller than the context: it is sized by the window and the prefill chunk)
        held = min(length, (-(-pool_window // pages["block_size"]) + 1) * pages["block_size"])
        entry.update(rows=held, pool_rows=rows, bytes_per_token=0, fixed_bytes=nbytes // rows * held)
    elif b.get("zone") == "kv_pages" and grows:
        entry.update(rows=length, pool_rows=rows)
    if window:
        entry["window"] = window
    return entry


def kv_cache_report(artifact: str, progs: dict, layout: list | None = None, pages: dict | None = None,
                    max_seq: int | None = None) -> dict | None:
    """``{"max_length", "slots", "bytes_per_token", "fixed_bytes", "layer_types": {type: {"layers",
    "bytes_per_token", "fixed_bytes", "rows", "window", "states": {...}}}}`` for one request slot, or None when the
    artifact keeps no KV cache.  ``bytes_per_token`` totals are over all layers.  ``layout`` is report.json's
    ``kv_cache_layout`` (layer, layer type, position dim, window, rate per state) where the compile wrote one.
    ``pages`` (report.json ``kv_pages``): paged caches (zone ``kv_pages``) are pools of blocks shared by the
    requests, a token's bytes the same; the report adds ``pages`` {block_size, blocks, tokens, pool_bytes}.
    ``max_seq`` (program.json): the cache length, when prefill takes shorter chunks (``--prefill-chunk``)."""
    states: dict[str, dict] = {}
    for pj in progs.values():
        for b in pj.get("buffers", []):
            if b.get("state") and b.get("alias_of") is None and b.get("zone") in ("kv_cache", "kv_pages"):
                states.setdefault(b["state"], b)
    prefill = progs.get("prefill") or next(iter(progs.values()), {})
    length = max_seq or _max_length(prefill)
    if not states or not length:
        return None
    described = {d["buffer"]: d for d in layout or [] if isinstance(d, dict) and "buffer" in d}
    cfg = {} if described else _checkpoint_config(artifact)
    types = cfg.get("layer_types") if isinstance(cfg.get("layer_types"), list) else []
    per_layer: dict = {}  # layer index (or None) -> {pattern: state entry}
    layer_type: dict = {}
    for name, b in sorted(states.items()):
        if any(not isinstance(d, int) for d in b["shape"]):
            raise UserError(f"{artifact}: state {name} has a symbolic shape {b['shape']}; a cache is static")
        m = _LAYER_IN_NAME.search(name)
        desc = described.get(name)
        layer = desc["layer"] if desc else int(m.group(1)) if m else None
        pattern = name[:m.start(1)] + "*" + name[m.end(1):] if m else name
        per_layer.setdefault(layer, {})[pattern] = _state_entry(b, length, desc, pages)
        if desc and desc.get("layer_type"):
            layer_type[layer] = desc["layer_type"]
        elif layer is not None and layer < len(types):
            layer_type[layer] = types[layer]
    groups: dict = {}
    for layer, sts in sorted(per_layer.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)):
        signature = json.dumps(sts, sort_keys=True)
        g = groups.setdefault((layer_type.get(layer), signature), {"layers": [], "states": sts})
        g["layers"].append(layer)
    out, total, fixed = {}, 0.0, 0
    for (named, _), g in groups.items():
        # unnamed: by what the layer's states are called after the layer index ("keys+values")
        name = named or "+".join((p.split("*", 1)[-1].strip("._") or p.split("*", 1)[0].strip("._"))
                                 for p in g["states"])
        while name in out:
            name += "'"
        n = len(g["layers"])
        sts = g["states"].values()
        per_token = sum(e["bytes_per_token"] for e in sts)
        const = sum(e["fixed_bytes"] for e in sts)
        rows = max((e["rows"] for e in sts if e["rows"] is not None), default=None)
        window = next((e["window"] for e in sts if e.get("window")), None)
        if window is None and named and "sliding" in named and not described:
            window = cfg.get("sliding_window")
        out[name] = {"layers": n, "layer_indices": g["layers"], "bytes_per_token": per_token, "fixed_bytes": const,
                     "rows": rows, "window": window, "states": g["states"]}
        total += n * per_token
        fixed += n * const
    slots = prefill.get("memory", {}).get("state_slots", 1)
    res = {"max_length": length, "slots": slots, "bytes_per_token": total, "fixed_bytes": fixed,
           "layer_types": out, "described": bool(described)}
    if pages:
        pool = sum(math.prod(b["shape"]) * _DTYPE_BYTES[b["dtype"]] for b in states.values() if b["zone"] == "kv_pages")
        res["pages"] = {"block_size": pages["block_size"], "pool_bytes": pool,
                        "tables": [{"name": t["name"], "window": t["window"], "blocks": t["blocks"] - 1,
                                    "tokens": (t["blocks"] - 1) * pages["block_size"]} for t in pages["tables"]]}
    return res


def build_report(artifact: str) -> dict:
    """The report object (what ``--json`` prints)."""
    _check_artifact(artifact)
    rep = _read_json(os.path.join(artifact, "report.json"), "report.json")
    pj_top = _read_json(os.path.join(artifact, "program.json"), "program.json")
    progs = pj_top.get("programs", {})
    for pj in progs.values():  # untrusted: every symbol and shape parses (a grammar) before anything reads them
        parse_program_shapes(pj)
    routes = rep.get("routes", {})
    kops = rep.get("kernel_ops", {})
    tuned = rep.get("tuned", {})
    kernels = {k: {"op": kops.get(k, "?"), "route": r, **({"tuned": tuned[k]} if k in tuned else {})}
               for k, r in sorted(routes.items())}
    op_counts: Counter = Counter()
    for pj in progs.values():
        op_counts.update(_step_op(s["node"]) for s in pj.get("steps", []))
    if not op_counts:  # programs without steps listed: count kernels instead
        op_counts.update(kops.values())
    programs = {}
    for name, p in rep.get("programs", {}).items():
        m = p.get("memory", {})
        mem = {k: v for k, v in m.items() if k != "buffers"}
        peak = sum(m.get("peak_live_bytes", {}).values())
        mem["peak_live_total_bytes"] = peak
        mem["arena_over_peak"] = round(m.get("arena_bytes", 0) / peak, 4) if peak else None
        # the program's own plan against its bound (the shared arena also holds the other programs' regions)
        planned = sum(m.get("planned_bytes", {}).values())
        mem["planned_over_peak"] = round(planned / peak, 4) if peak and planned else None
        mem["buffers"] = len(m.get("buffers", []))
        programs[name] = {"steps": p.get("steps"), "kernels": p.get("kernels"), "memory": mem}
    out = {
        "artifact": os.path.abspath(artifact),
        "model_type": rep.get("model_type", ""),
        "target": rep.get("target"),
        "kernels": kernels,
        "routes": {r: c for r, c in sorted(Counter(routes.values()).items())},
        "op_counts": dict(sorted(op_counts.items(), key=lambda kv: (-kv[1], kv[0]))),
        "patterns": dict(rep.get("patterns", {})),
        "unsupported": list(rep.get("unsupported", [])),
        "programs": programs,
        "kv_cache": kv_cache_report(artifact, progs, rep.get("kv_cache_layout"), rep.get("kv_pages"),
                                    pj_top.get("max_seq")),
        "experts": rep.get("experts"),  # low-precision expert route per program (passes/expert_workspace.py)
        "mesh": rep.get("mesh"),  # a sharded artifact (passes/shard.py): axes, weight bytes per rank vs the model's
    }
    out["plan"] = plan_agreement(artifact, out)
    return out


WEIGHT_ZONES = ("weights", "low_precision_weights")
WORKSPACE_ZONES = ("activations", "io", "cross_layer_state", "dequant_workspace")
_KV_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "fp8"}


def _prefill_tokens(artifact: str) -> int | None:
    """The most tokens the artifact's prefill program takes (its input_ids' length, or that symbol's bound: a
    chunked prefill, ``--prefill-chunk``); None without a prefill program."""
    try:
        p = _read_json(os.path.join(artifact, "program.json"), "program.json")["programs"]["prefill"]
        n = next(p["buffers"][b]["shape"][-1] for b in p["inputs"] if p["buffers"][b]["name"] == "input_ids")
        n = n if isinstance(n, int) else {s[0]: s[2] for s in p.get("symbols", [])}.get(n)
    except (KeyError, IndexError, TypeError, StopIteration):
        return None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def plan_agreement(artifact: str, r: dict) -> dict | None:
    """``dayzero plan --target host`` for the artifact's checkpoint config at its context (the cache length, one
    sequence), against what the compiled memory plan holds: weights (zones weights + low_precision_weights), the
    KV cache of one sequence, and the workspace (activations, io, cross-layer state, dequant workspace of the
    largest program). None for an artifact without a checkpoint config or not for the host CPU."""
    from dayzero.targets.host import host_spec
    from dayzero.tools.capacity import plan_capacity

    cfg = _checkpoint_config(artifact)
    kv = r.get("kv_cache")
    if not cfg or not kv or (r.get("target") or {}).get("kind") != "llvm":
        return None
    dtypes = {st["dtype"] for e in kv["layer_types"].values() for st in e["states"].values()}
    if len(dtypes) != 1 or next(iter(dtypes)) not in _KV_DTYPES:
        return None
    axes = (r.get("mesh") or {}).get("axes") or {}
    mesh = {"tp": int(axes.get("tp", 1)), "ep": int(axes.get("ep", 1))} if math.prod(axes.values()) > 1 else None
    try:  # a sharded artifact: one rank's plan (``plan --devices N --tp T --ep E``), as each rank plans its arena
        plan = plan_capacity(cfg, host_spec(), devices=math.prod(mesh.values()) if mesh else 1,
                             context=kv["max_length"], batch=1, kv_dtype=_KV_DTYPES[next(iter(dtypes))], mesh=mesh,
                             prefill_chunk=_prefill_tokens(artifact))
    except UserError as e:
        return {"error": str(e)}
    zones = [p["memory"].get("zones", {}) for p in r["programs"].values()]
    measured = {"weights": max(sum(z.get(k, 0) for k in WEIGHT_ZONES) for z in zones),
                "kv_bytes_per_sequence": int(kv["bytes_per_token"] * kv["max_length"] + kv["fixed_bytes"]),
                "workspace": max(sum(z.get(k, 0) for k in WORKSPACE_ZONES) for z in zones)}
    planned = {"weights": plan["per_device"]["weights"], "kv_bytes_per_sequence": plan["per_device"]["kv"],
               "workspace": plan["workspace_bytes"]["total"]}
    out = {"context": kv["max_length"], "kv_dtype": plan["kv_dtype"], "mesh": mesh}
    for k, m in measured.items():
        out[k] = {"plan": planned[k], "measured": m, "measured_over_plan": round(m / planned[k], 4) if planned[k]
                  else None}
    out["total"] = {"plan": sum(planned.values()), "measured": sum(measured.values()),
                    "measured_over_plan": round(sum(measured.values()) / sum(planned.values()), 4)}
    return out


def _state_replicas(pj: dict, steps: int) -> dict:
    """Rectangles of the request slots 1.. of every per-request state buffer (KV cache), ``state_stride`` bytes
    above slot 0's (codegen/memory.plan_programs lays the state zones out once per slot)."""
    from matplotlib.patches import Rectangle

    mem = pj.get("memory", {})
    slots, stride = mem.get("state_slots", 1), mem.get("state_stride", 0)
    out: dict[str, list] = {}
    if slots <= 1 or not stride:
        return out
    for b in pj.get("buffers", []):
        if not b.get("state") or b.get("alias_of") is not None or b.get("zone") not in ("kv_cache",
                                                                                        "cross_layer_state"):
            continue
        if any(not isinstance(d, int) for d in b["shape"]) or str(b["id"]) not in mem.get("offsets", {}):
            continue
        size = math.prod(b["shape"]) * _DTYPE_BYTES[b["dtype"]]
        for k in range(1, slots):
            off = mem["offsets"][str(b["id"])] + k * stride
            out.setdefault(b["zone"], []).append(Rectangle((0, off / MIB), steps, size / MIB))
    return out


def plot_arena(artifact: str, png: str) -> dict:
    """Draw every program's arena over time into PNG; returns ``{program: buffers drawn}``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.collections import PatchCollection
    from matplotlib.patches import Patch, Rectangle

    rep = _read_json(os.path.join(artifact, "report.json"), "report.json")
    progs = {n: p["memory"] for n, p in rep.get("programs", {}).items() if p.get("memory", {}).get("buffers")}
    if not progs:
        raise UserError(f"{artifact}: report.json has no buffer lifetimes (compiled by an older dayzero: recompile)")
    pfile = os.path.join(artifact, "program.json")
    pjs = _read_json(pfile, "program.json").get("programs", {}) if os.path.isfile(pfile) else {}
    fig, axes = plt.subplots(1, len(progs), figsize=(11 * len(progs), 6.5), squeeze=False)
    drawn = {}
    extra = iter(_FALLBACK_COLOURS * 4)  # zones without a colour of their own, in order (16 at most)
    colours = dict(ZONE_COLOURS)
    for ax, (name, m) in zip(axes[0], progs.items()):
        bufs = m["buffers"]
        steps = m.get("steps") or max(b[3] for b in bufs) + 1
        by_zone: dict[str, list] = {}
        for off, size, first, last, zone in bufs:
            if size <= 0:
                continue
            # x: the steps the buffer is live in, [first, last + 1), clipped to the program
            x0, x1 = first, min(last + 1, steps)
            by_zone.setdefault(zone, []).append(Rectangle((x0, off / MIB), max(x1 - x0, 0.6), size / MIB))
        replicas = _state_replicas(pjs.get(name, {}), steps)
        slots = pjs.get(name, {}).get("memory", {}).get("state_slots", 1)
        for zone, rects in by_zone.items():
            if zone not in colours:  # a fallback only for a zone without a colour of its own
                colours[zone] = next(extra)
            c = colours[zone]
            ax.add_collection(PatchCollection(rects, facecolor=c, edgecolor="black", linewidth=0.25, alpha=0.8))
            if replicas.get(zone):  # the other request slots' copies of the per-request state, lighter
                ax.add_collection(PatchCollection(replicas[zone], facecolor=c, edgecolor="black", linewidth=0.25,
                                                  alpha=0.35))
        # zones in layout order (bottom up, from the buffers' offsets): a dashed line at each zone's base
        lo = {z: min(off for off, size, _, _, zz in bufs if zz == z) for z in by_zone}
        order = sorted(by_zone, key=lambda z: lo[z])
        for z in order[1:]:
            ax.axhline(lo[z] / MIB, color="grey", linestyle="--", linewidth=0.6)
        arena = m["arena_bytes"]
        peak = sum(m.get("peak_live_bytes", {}).values())
        ax.set_xlim(0, steps)
        ax.set_ylim(0, max(arena, 1) / MIB * 1.02)
        ax.set_xlabel("program step")
        ax.set_ylabel("arena offset (MiB)")
        ratio = f" ({arena / peak:.2f}x)" if peak else ""
        ax.set_title(f"{rep.get('model_type') or 'model'} {name}: arena {arena / MIB:.2f} MiB vs peak-live "
                     f"{peak / MIB:.2f} MiB{ratio}\n{steps} steps, {len(bufs)} buffers, sized at "
                     + ", ".join(f"{s}={v}" for s, v in m.get("bounds", {}).items()), fontsize=10)
        zones, live = m.get("zones", {}), m.get("peak_live_bytes", {})
        handles = [Patch(facecolor=colours[z], edgecolor="black",
                         label=f"{z}: {zones.get(z, 0) / MIB:.2f} MiB"
                               + (f", {slots} request slots" if replicas.get(z) else "")
                               + f"\n(peak-live {live.get(z, 0) / MIB:.2f}" + (" per slot)" if replicas.get(z) else ")"))
                   for z in reversed(order)]  # the top zone first, as drawn
        ax.legend(handles=handles, title="zone (size)", loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
                  title_fontsize=8, frameon=False)
        ax.grid(True, linewidth=0.3, alpha=0.5)
        drawn[name] = sum(len(r) for r in by_zone.values())
    fig.tight_layout()
    try:
        fig.savefig(png, dpi=110)
    except OSError as e:
        raise UserError(f"cannot write {png}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
    return drawn


def _human(r: dict) -> None:
    click.echo(f"artifact: {r['artifact']}")
    click.echo(f"model_type: {r['model_type'] or '-'}   target: {r['target']}")
    click.echo("routes: " + ", ".join(f"{k} {v}" for k, v in r["routes"].items()))
    width = max((len(k) for k in r["kernels"]), default=0)
    for k, v in r["kernels"].items():
        t = v.get("tuned")
        extra = f"  default {t['default_s'] * 1e6:.1f} us -> tuned {t['tuned_s'] * 1e6:.1f} us" if t else ""
        click.echo(f"  {k:<{width}}  {v['route']:<14} {v['op']}{extra}")
    click.echo("op counts (steps): " + ", ".join(f"{k} {v}" for k, v in r["op_counts"].items()))
    click.echo("patterns: " + (", ".join(f"{k} x{v}" for k, v in r["patterns"].items()) or "none"))
    click.echo(f"unsupported: {len(r['unsupported'])}" + "".join(f"\n  {u}" for u in r["unsupported"]))
    m = r.get("mesh")
    if m and m.get("world", 1) > 1:
        click.echo(f"mesh: {', '.join(f'{a} {n}' for a, n in m['axes'].items())} ({m['world']} ranks, each plans its "
                   f"own arena): weights {m['weight_bytes_per_rank']:,} B per rank of the model's "
                   f"{m['weight_bytes_total']:,} B; collective steps " +
                   ", ".join(f"{p} {c}" for p, c in m["collectives"].items()))
    kv = r.get("kv_cache")
    if kv:
        ranked = " of one rank" if m and m.get("world", 1) > 1 else ""  # a sharded artifact: this rank's heads
        click.echo(f"kv cache{ranked} (one request slot of {kv['max_length']} tokens; {kv['slots']} slot(s)): "
                   f"{kv['bytes_per_token']:,.0f} B/token over all layers"
                   + (f" + {kv['fixed_bytes']:,} B fixed" if kv["fixed_bytes"] else ""))
        if kv.get("pages"):
            pg = kv["pages"]
            click.echo(f"  paged: blocks of {pg['block_size']} tokens shared by the requests, {pg['pool_bytes']:,} B "
                       "of pools: " + "; ".join(f"{t['name']} {t['blocks']} blocks ({t['tokens']:,} tokens"
                                               + (f", window {t['window']}: blocks behind it go back" if t["window"]
                                                  else "") + ")" for t in pg["tables"]))
        for t, e in kv["layer_types"].items():
            held = f", holds {e['rows']} rows, window {e['window']}" if e["window"] and e["rows"] else ""
            click.echo(f"  {t}: {e['layers']} layer(s), {e['bytes_per_token']:,.1f} B/token per layer"
                       + (f" + {e['fixed_bytes']:,} B fixed" if e["fixed_bytes"] else "") + held
                       + "  [" + ", ".join(f"{k} {v['dtype']}{v['shape']}" for k, v in e["states"].items()) + "]")
    ex = r.get("experts")
    if ex and any(ex.get("routes", {}).values()):
        zones = next(iter(r["programs"].values()))["memory"].get("zones", {})
        click.echo(f"low-precision experts: compute {ex['compute_dtype']}, cache budget {ex['cache_bytes']:,} B; "
                   + ", ".join(f"{p} {'+'.join(ops) or '-'}" for p, ops in ex["routes"].items())
                   + f"; resident {zones.get('low_precision_weights', 0):,} B as stored + "
                     f"{zones.get('dequant_workspace', 0):,} B workspace")
    pl = r.get("plan")
    if pl and "error" not in pl:
        ranks = "".join(f" --{a} {n}" for a, n in (pl.get("mesh") or {}).items())  # one rank of a sharded artifact
        ranks = f" --devices {math.prod(pl['mesh'].values())}{ranks}" if ranks else ""
        click.echo(f"plan (dayzero plan --target host{ranks} --context {pl['context']} --batch 1 --kv-dtype "
                   f"{pl['kv_dtype']}) "
                   "vs compiled: " + ", ".join(f"{k} {pl[k]['plan']:,} vs {pl[k]['measured']:,} B "
                                               f"(x{pl[k]['measured_over_plan']})"
                                               for k in ("weights", "kv_bytes_per_sequence", "workspace", "total")))
    for name, p in r["programs"].items():
        m = p["memory"]
        click.echo(f"{name}: {p['steps']} steps, {p['kernels']} kernels, arena {m['arena_bytes']} B vs peak-live "
                   f"{m['peak_live_total_bytes']} B (x{m['arena_over_peak']}; own plan x{m['planned_over_peak']}), "
                   f"zones {m.get('zones')}")


@click.command("report")
@click.argument("artifact", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@click.option("--plot", "plot", type=click.Path(dir_okay=False), default=None,
              help="draw the memory arena over program time into this PNG")
def report_cmd(artifact, as_json, plot):
    """Kernels and their routes (hand-scheduled / tuned / default / generic), op counts, patterns, unsupported ops
    and the memory plan of a compiled ARTIFACT."""
    r = build_report(artifact)
    if plot:
        plot_arena(artifact, plot)
        r["plot"] = os.path.abspath(plot)
    if as_json:
        click.echo(json.dumps(r, indent=1, sort_keys=True, default=str))
    else:
        _human(r)
        if plot:
            click.echo(f"plot: {r['plot']}")
