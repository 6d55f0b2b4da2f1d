"""Memory layout of an artifact: one arena shared by all its programs (prefill, decode).

    [ weights | dequant workspace | kv_pages | kv_cache / cross-layer state ]  persistent, named: every program
                                                sees the same bytes; the state zones are replicated per request slot;
                                                the workspace (converted experts + their cache) and the paged KV
                                                pools (blocks handed to requests by the runtime) are shared by all
    [ activations + io of prefill ]             \\  programs never run at the same time, so their
    [ activations + io of decode  ]             /   regions start at the same base and overlap

Persistent buffers are placed once by name (a weight or a state is the same tensor in every program). Each
program's activations and I/O are planned on their own by ``passes/memory_plan.py`` (lifetimes over its steps,
sizes at the symbols' upper bounds, several algorithms, the smallest verified arena). Views share their root's
bytes: a root lives from its first to its last use through any of its views; program inputs and outputs live
for the whole program.
"""

from __future__ import annotations

from dayzero.passes.memory_plan import ALIGN, PER_REQUEST_ZONES, Buffer, ZonedPlan, align_up, plan_zones

from .program import Program

PERSISTENT = ("weights", "kv_cache", "cross_layer_state", "kv_pages")


def _root(prog: Program, b: int) -> int:
    a = prog.buffers[b].alias_of
    return b if a is None else a


def _lifetimes(prog: Program) -> tuple[dict[int, int], dict[int, int]]:
    n = len(prog.steps)
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, st in enumerate(prog.steps):
        for b in st.args:
            r = _root(prog, b)
            first.setdefault(r, i)
            last[r] = i
    for b in prog.inputs + prog.outputs:
        r = _root(prog, b)
        first[r], last[r] = 0, n
    return first, last


def cross_layer_roots(prog: Program) -> set[int]:
    """Activation buffers written in one block of a repeated stack (a decoder layer) and read in a later block of
    the same stack: the residual stream each layer hands to the next, ``hc_mult`` copies of it under DeepSeek-V4's
    hyper-connections.  They are planned in the ``cross_layer_state`` zone.  Found from the lifetimes and the
    steps' layer attribution alone (``Step.layer``: the block the frontend traced the step from), never from the
    model's type."""
    blocks = [st.layer for st in prog.steps]
    made: dict[int, tuple[str, int]] = {}
    out = set()
    for i, st in enumerate(prog.steps):
        for pos, b in enumerate(st.args):
            r = _root(prog, b)
            if prog.buffers[r].zone != "activations" or persistent_key(prog.buffers[r]) is not None:
                continue
            here = blocks[i]
            written = pos >= len(st.args) - st.outputs
            if r not in made:
                if written and here is not None:
                    made[r] = here
                continue
            src = made[r]
            if here is not None and here[0] == src[0] and here[1] > src[1]:
                out.add(r)
    return out


def persistent_key(b) -> str | None:
    if b.weight is not None:
        return "w:" + b.weight
    if b.state is not None:
        return "s:" + b.state
    return None


def _plan_persistent(bufs: list[Buffer]) -> ZonedPlan:
    """Persistent zones in ZONES order, except the per-request state zones, which go last so that their replicas
    (one per request slot) extend the arena upwards: a shared persistent zone that ZONES lists after them (the
    dequant workspace, one for all requests) is laid out before them instead."""
    shared = plan_zones([b for b in bufs if b.zone not in PER_REQUEST_ZONES], ALIGN)
    state = plan_zones([b for b in bufs if b.zone in PER_REQUEST_ZONES], ALIGN)
    base = shared.total_bytes
    zones = dict(shared.zones)
    zones.update({z: (base + b, n) for z, (b, n) in state.zones.items()})
    offsets = dict(shared.offsets)
    offsets.update({k: base + v for k, v in state.offsets.items()})
    return ZonedPlan(offsets, base + state.total_bytes, zones, {**shared.plans, **state.plans})


def plan_programs(progs: list[Program], slots: int = 1) -> dict:
    """-> {"arena_bytes", "persistent": {key: offset}, "state_slots", "state_stride", "programs": {...}}.

    ``slots`` requests can be in flight at once: the state zones (KV cache, cross-layer state) are laid out
    ``slots`` times, ``state_stride`` bytes apart; request k's state lives at its slot-0 offset + k * stride."""
    # 1. persistent buffers, by name, once
    sizes: dict[str, tuple[int, str]] = {}
    for prog in progs:
        bounds = {s: hi for s, lo, hi in prog.symbols}
        for b in prog.buffers:
            key = persistent_key(b)
            if key is not None and b.alias_of is None:
                sizes[key] = (max(sizes.get(key, (0, ""))[0], b.max_bytes(bounds)), b.zone)
    keys = sorted(sizes)
    pz = _plan_persistent([Buffer(k, sizes[k][0], 0, 0, sizes[k][1]) for k in keys]) if keys else None
    persistent = dict(pz.offsets) if pz else {}
    base = align_up(pz.total_bytes, ALIGN) if pz else 0
    state = [pz.zones[z] for z in PER_REQUEST_ZONES if pz and z in pz.zones]
    stride = 0
    if state:  # zones are contiguous in ZONES order: the state zones form one span, replicated per slot
        lo, hi = min(b for b, _ in state), max(b + n for b, n in state)
        stride = align_up(hi - lo, ALIGN)
        if hi != base:  # a zone after the state zones would sit inside the replicas
            raise ValueError("state zones must be the last persistent zones")
        base += stride * (max(slots, 1) - 1)
    # 2. each program's own region, all starting at `base`
    out, top = {}, base
    for prog in progs:
        bounds = {s: hi for s, lo, hi in prog.symbols}
        first, last = _lifetimes(prog)
        n = len(prog.steps)
        cross = cross_layer_roots(prog)
        bufs = []
        for b in prog.buffers:
            if b.alias_of is not None or persistent_key(b) is not None:
                continue
            zone = "cross_layer_state" if b.id in cross else b.zone
            bufs.append(Buffer(b.id, b.max_bytes(bounds), first.get(b.id, 0), last.get(b.id, 0), zone))
        zp = plan_zones(bufs, ALIGN) if bufs else None
        local = {k: base + v for k, v in zp.offsets.items()} if zp else {}
        offsets = {}
        for b in prog.buffers:
            r = prog.buffers[_root(prog, b.id)]
            key = persistent_key(r)
            offsets[b.id] = persistent[key] if key is not None else local[r.id]
        zones = dict(pz.summary()) if pz else {}
        for z in PER_REQUEST_ZONES:
            if z in zones:
                zones[z] *= max(slots, 1)
        # a zone can hold persistent buffers (a cross-layer state kept between steps) and this program's own
        # (the streams handed from layer to layer): its figures are the sums
        peak, planned = {}, {}
        for z, v in (zp.summary() if zp else {}).items():
            zones[z] = zones.get(z, 0) + v
        for plans in (pz.plans if pz else {}, zp.plans if zp else {}):
            for z, p in plans.items():
                peak[z] = peak.get(z, 0) + p.peak_live_bytes
                planned[z] = planned.get(z, 0) + p.arena_bytes
        seen = {}  # one rectangle per persistent name (two nodes may read the same weight)
        for b in prog.buffers:
            key = persistent_key(b)
            if b.alias_of is None and key is not None:
                seen[key] = [persistent[key], b.max_bytes(bounds), 0, n, b.zone]
        drawn = list(seen.values())
        drawn += [[local[b.id], b.size, b.start, b.end, b.zone] for b in bufs]
        region = base + (zp.total_bytes if zp else 0)
        top = max(top, region)
        out[prog.name] = {
            "offsets": offsets, "zones": zones, "peak_live_bytes": peak, "planned_bytes": planned,
            "algorithm": {z: p.algorithm for z, p in (zp.plans.items() if zp else [])},
            "bounds": bounds, "steps": n, "buffers": sorted(drawn), "region_bytes": region,
        }
    for rep in out.values():
        rep["arena_bytes"] = top
    return {"arena_bytes": top, "persistent": persistent, "programs": out, "state_slots": max(slots, 1),
            "state_stride": stride}
