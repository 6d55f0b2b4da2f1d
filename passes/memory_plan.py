"""memory_plan: lifetimes -> one arena (offsets), checked by an independent verifier.

The last pass of the pipeline, written as a pure function::

    [Buffer(id, size, start, end, zone)]  --plan(alignment)-->  Plan(offsets, arena_bytes, peak_live_bytes, ...)

A buffer is live over the *closed* interval of program steps ``[start, end]``. Two buffers *conflict* when their
intervals intersect; conflicting buffers must get disjoint byte ranges ``[offset, offset + size)``.

Algorithms (one signature ``(buffers, alignment) -> {id: offset}``; every one runs, the smallest arena wins):

* ``greedy_by_size``: largest buffer first; each goes into the *smallest* gap between already-placed conflicting
  buffers that holds it (best fit), or above the highest of them.
* ``greedy_by_breadth``: the same best-fit placement, in the order of the busiest step a buffer is live at
  (the sum of live sizes there), largest first: buffers of the peak step are packed before the rest.
* ``greedy_by_lifetime``: the same best-fit placement, longest-lived buffers first (they pin the bottom of the
  arena; short-lived ones pack into the gaps above).
* ``interval_first_fit``: buffers in order of their start step (then larger first), each at the *lowest*
  offset that fits, as a TLSF-style allocator would hand them out while replaying the program.

Why every algorithm is correct: a buffer is placed once, at an offset chosen by scanning the byte ranges of the
already-placed buffers *it conflicts with*, sorted by offset; the offset it takes is either below the first of
those ranges by at least its size, or in a gap between two of them at least its size wide, or at or above the end
of the highest one.  So its range misses every one of them.  Conflict is symmetric and every pair of buffers has a
later-placed member, so every conflicting pair was checked once, when the later one was placed: no two live buffers
overlap.  Offsets are only ever 0 or an ``align_up`` of a range end, so they are multiples of the alignment; each
buffer occupies its size rounded up to the alignment, which keeps the next offset aligned.

Why ``peak_live_bytes`` is a lower bound: at the step where the sum of live (aligned) sizes is largest, those
buffers all conflict pairwise, so they need disjoint ranges inside the arena; no placement can be smaller.

``verify`` does not trust any of that: it is separate code (a sweep over start steps, each buffer checked against
every buffer still live there, so every pair that is live together) that checks every such pair, every alignment
and the arena bound, and ``plan`` always calls it (InternalError on failure, never only in debug).

Zones (``plan_zones``): long-lived regions (weights, KV cache, cross-layer state, dequant workspace, activations,
I/O) are planned one at a time and laid out one after another, each zone's base aligned, so a zone never shares
bytes with another zone whatever the lifetimes say.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Hashable, Iterable, Sequence

import numpy as np

from dayzero import InternalError, UserError

ALIGN = 64  # bytes: every buffer offset and zone base is a multiple (DESIGN.md: 64-byte aligned at least)

# The order zones are laid out in, low addresses first (the long-lived ones first).
ZONES = (
    "weights",
    "low_precision_weights",
    "kv_cache",
    "cross_layer_state",
    "dequant_workspace",
    "kv_pages",
    "activations",
    "io",
)
# the zones of state a program keeps per request: replicated once per request slot (codegen/memory.py)
PER_REQUEST_ZONES = ("kv_cache", "cross_layer_state")


@dataclasses.dataclass(frozen=True)
class Buffer:
    """A buffer of ``size`` bytes live over program steps ``[start, end]`` (both included)."""

    id: Hashable
    size: int
    start: int
    end: int
    zone: str = "activations"


@dataclasses.dataclass(frozen=True)
class Plan:
    """The result of :func:`plan`: byte offsets into one arena, and how good the arena is."""

    offsets: dict
    arena_bytes: int
    peak_live_bytes: int
    algorithm: str
    per_algorithm: dict

    @property
    def ratio(self) -> float:
        """arena / peak-live lower bound (1.0 is optimal)."""
        return self.arena_bytes / self.peak_live_bytes if self.peak_live_bytes else 1.0


@dataclasses.dataclass(frozen=True)
class ZonedPlan:
    """Zones laid out one after another: ``zones[z] = (base, bytes)``; ``offsets`` are absolute."""

    offsets: dict
    total_bytes: int
    zones: dict
    plans: dict

    def summary(self) -> dict:
        """``{zone: bytes}`` in layout order."""
        return {z: size for z, (_, size) in self.zones.items()}


def align_up(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def _check_inputs(buffers: Sequence[Buffer], alignment: int) -> None:
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise UserError(f"memory plan: alignment must be a positive power of two, got {alignment!r}")
    seen = set()
    for b in buffers:
        if b.id in seen:
            raise UserError(f"memory plan: buffer id {b.id!r} appears twice")
        seen.add(b.id)
        if not isinstance(b.size, int) or b.size < 0:
            raise UserError(f"memory plan: buffer {b.id!r} has size {b.size!r}; sizes are integers >= 0")
        if b.end < b.start:
            raise UserError(f"memory plan: buffer {b.id!r} ends (step {b.end}) before it starts (step {b.start})")


def peak_live_bytes(buffers: Iterable[Buffer], alignment: int = ALIGN) -> int:
    """max over steps of the sum of aligned sizes live at that step (a sweep over start/end events)."""
    events = []
    for b in buffers:
        size = align_up(b.size, alignment)
        events.append((b.start, 1, size))
        events.append((b.end + 1, 0, -size))  # at the same step, frees (0) sort before allocations (1)
    live = peak = 0
    for _, _, delta in sorted(events):
        live += delta
        peak = max(peak, live)
    return peak


def _place(order: Sequence[Buffer], alignment: int, best_fit: bool) -> dict:
    """Place buffers in ``order``; each goes into a gap among the placed buffers it conflicts with.

    The placed buffers live in numpy arrays, so finding the ones a buffer conflicts with and the gaps between them
    is a few vector operations per buffer rather than a Python loop over everything placed (a tiny DeepSeek-V4's
    ~2,500 buffers per program took 10 s per algorithm that way)."""
    n = len(order)
    p_start, p_end = np.empty(n, np.int64), np.empty(n, np.int64)
    p_lo, p_hi = np.empty(n, np.int64), np.empty(n, np.int64)  # byte range [lo, hi) with hi aligned up
    k, offsets = 0, {}
    for b in order:
        size = align_up(b.size, alignment)
        if size == 0:
            offsets[b.id] = 0
            continue
        hit = (p_start[:k] <= b.end) & (b.start <= p_end[:k])  # the placed buffers live at some step with b
        lo, hi = p_lo[:k][hit], p_hi[:k][hit]
        chosen = 0
        if lo.size:
            by_offset = np.lexsort((hi, lo))
            lo, hi = lo[by_offset], hi[by_offset]
            cursor = np.maximum.accumulate(hi)  # the lowest free byte above ranges 0..i
            below = np.concatenate(([0], cursor[:-1]))
            gaps = lo - below
            fits = np.flatnonzero(gaps >= size)
            if fits.size == 0:
                chosen = int(cursor[-1])
            elif best_fit:
                chosen = int(below[fits[np.argmin(gaps[fits])]])  # argmin: the first of equal gaps
            else:
                chosen = int(below[fits[0]])
        offsets[b.id] = chosen
        p_start[k], p_end[k], p_lo[k], p_hi[k] = b.start, b.end, chosen, align_up(chosen + size, alignment)
        k += 1
    return offsets


def greedy_by_size(buffers: Sequence[Buffer], alignment: int) -> dict:
    order = sorted(buffers, key=lambda b: (-b.size, b.start, b.end, str(b.id)))
    return _place(order, alignment, best_fit=True)


def greedy_by_breadth(buffers: Sequence[Buffer], alignment: int) -> dict:
    if not buffers:
        return {}
    starts = np.array([b.start for b in buffers], np.int64)
    ends = np.array([b.end for b in buffers], np.int64)
    sizes = np.array([align_up(b.size, alignment) for b in buffers], np.int64)
    steps = np.unique(starts)  # the live sum only grows at a start step
    by_start, by_end = np.argsort(starts, kind="stable"), np.argsort(ends, kind="stable")
    started = np.concatenate(([0], np.cumsum(sizes[by_start])))[np.searchsorted(starts[by_start], steps, "right")]
    ended = np.concatenate(([0], np.cumsum(sizes[by_end])))[np.searchsorted(ends[by_end], steps, "left")]
    live_at = started - ended  # at each start step: started at or before it, minus ended before it
    first = np.searchsorted(steps, starts, "left")  # b's start is a step, so its own live_at is in range
    last = np.searchsorted(steps, ends, "right")
    breadth = {b.id: int(live_at[i:j].max()) for b, i, j in zip(buffers, first.tolist(), last.tolist())}
    order = sorted(buffers, key=lambda b: (-breadth[b.id], -b.size, b.start, str(b.id)))
    return _place(order, alignment, best_fit=True)


def greedy_by_lifetime(buffers: Sequence[Buffer], alignment: int) -> dict:
    # longest-lived first: they pin the bottom of the arena and short-lived buffers pack into the gaps above
    # (on tiny gpt-oss prefill: 1.006x peak-live where by-size gave 1.27x)
    order = sorted(buffers, key=lambda b: (-(b.end - b.start), -b.size, b.start, str(b.id)))
    return _place(order, alignment, best_fit=True)


def interval_first_fit(buffers: Sequence[Buffer], alignment: int) -> dict:
    order = sorted(buffers, key=lambda b: (b.start, -b.size, b.end, str(b.id)))
    return _place(order, alignment, best_fit=False)


ALGORITHMS: dict[str, Callable[[Sequence[Buffer], int], dict]] = {
    "greedy_by_size": greedy_by_size,
    "greedy_by_breadth": greedy_by_breadth,
    "greedy_by_lifetime": greedy_by_lifetime,
    "interval_first_fit": interval_first_fit,
}


def arena_bytes(buffers: Sequence[Buffer], offsets: dict, alignment: int) -> int:
    return max((offsets[b.id] + align_up(b.size, alignment) for b in buffers), default=0)


def verify(buffers: Sequence[Buffer], plan: Plan, alignment: int = ALIGN) -> None:
    """Raise InternalError unless ``plan`` is a valid placement of ``buffers`` (independent of the placers)."""
    problems = []
    for b in buffers:
        if b.id not in plan.offsets:
            problems.append(f"buffer {b.id!r} has no offset")
            continue
        off = plan.offsets[b.id]
        if off < 0 or off % alignment:
            problems.append(f"buffer {b.id!r} at offset {off} is not {alignment}-byte aligned")
        if off + b.size > plan.arena_bytes:
            problems.append(f"buffer {b.id!r} [{off}, {off + b.size}) ends past the arena ({plan.arena_bytes})")
    if problems:
        raise InternalError("memory plan verifier: " + "; ".join(problems))
    live: list[Buffer] = []  # a sweep in start order: each buffer is checked against those still live there
    for b in sorted((b for b in buffers if b.size), key=lambda b: b.start):
        live = [a for a in live if a.end >= b.start]
        ob = plan.offsets[b.id]
        for a in live:
            oa = plan.offsets[a.id]
            if max(oa, ob) < min(oa + a.size, ob + b.size):
                problems.append(
                    f"buffers {a.id!r} [{oa}, {oa + a.size}) steps [{a.start}, {a.end}] and "
                    f"{b.id!r} [{ob}, {ob + b.size}) steps [{b.start}, {b.end}] overlap while both are live"
                )
        live.append(b)
    if plan.arena_bytes < plan.peak_live_bytes:
        problems.append(f"arena {plan.arena_bytes} is below the peak-live lower bound {plan.peak_live_bytes}")
    if problems:
        raise InternalError("memory plan verifier: " + "; ".join(problems[:5]))


def plan(buffers: Sequence[Buffer], alignment: int = ALIGN) -> Plan:
    """Run every algorithm, keep the smallest arena (ties: the first in ALGORITHMS), verify it, return it."""
    buffers = list(buffers)
    _check_inputs(buffers, alignment)
    peak = peak_live_bytes(buffers, alignment)
    results = {name: fn(buffers, alignment) for name, fn in ALGORITHMS.items()}
    per_algorithm = {name: arena_bytes(buffers, offs, alignment) for name, offs in results.items()}
    best = min(per_algorithm, key=per_algorithm.get)
    result = Plan(dict(results[best]), per_algorithm[best], peak, best, per_algorithm)
    verify(buffers, result, alignment)
    return result


def plan_zones(buffers: Sequence[Buffer], alignment: int = ALIGN) -> ZonedPlan:
    """Plan each zone on its own and lay the zones out in ZONES order, each base ``alignment``-aligned."""
    buffers = list(buffers)
    unknown = sorted({b.zone for b in buffers} - set(ZONES))
    if unknown:
        raise UserError(f"memory plan: unknown zone(s) {', '.join(unknown)}; zones are {', '.join(ZONES)}")
    offsets, zones, plans, base = {}, {}, {}, 0
    for zone in ZONES:
        members = [b for b in buffers if b.zone == zone]
        if not members:
            continue
        p = plan(members, alignment)
        size = align_up(p.arena_bytes, alignment)
        zones[zone], plans[zone] = (base, size), p
        offsets.update({k: base + v for k, v in p.offsets.items()})
        base += size
    _check_inputs(buffers, alignment)  # ids unique across zones too
    return ZonedPlan(offsets, base, zones, plans)
