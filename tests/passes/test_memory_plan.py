"""memory_plan: lifetimes -> one arena, offsets checked by an independent verifier (passes/memory_plan.py). The
expected arenas are worked out by hand: sizes round up to the 64-byte alignment, buffers live over closed step
intervals, and a buffer dead before another starts may share its bytes."""

import pytest

from dayzero import InternalError
from dayzero.passes.memory_plan import Buffer, Plan, plan, plan_zones, verify

# a -> b -> c: each step reads the previous value and writes the next (100 B = 128 B aligned, 200 B = 256 B)
CHAIN = [Buffer("a", 100, 0, 1), Buffer("b", 200, 1, 2), Buffer("c", 100, 2, 3)]


def test_a_chain_reuses_the_bytes_of_values_that_died():
    p = plan(CHAIN)
    assert (p.peak_live_bytes, p.arena_bytes) == (128 + 256, 128 + 256)  # c takes a's bytes: a is dead at step 2
    assert all(off % 64 == 0 for off in p.offsets.values())
    assert p.offsets["a"] != p.offsets["b"] and p.offsets["b"] != p.offsets["c"]


def test_values_live_at_one_step_never_share_bytes():
    overlapping = CHAIN[:2] + [Buffer("c", 100, 1, 3)]  # c now starts while a is live: all three live at step 1
    p = plan(overlapping)
    assert (p.peak_live_bytes, p.arena_bytes) == (512, 512)
    assert len({p.offsets[k] for k in "abc"}) == 3


def test_zones_are_laid_out_one_after_another_in_zone_order():
    bufs = [Buffer("x", 100, 0, 0, zone="activations"), Buffer("w", 100, 0, 3, zone="weights"),
            Buffer("y", 64, 1, 1, zone="activations")]
    z = plan_zones(bufs)
    assert z.zones == {"weights": (0, 128), "activations": (128, 128)}  # x and y never live together
    assert (z.offsets["w"], z.offsets["x"], z.offsets["y"], z.total_bytes) == (0, 128, 128, 256)


def test_the_verifier_refuses_live_buffers_that_overlap():
    bad = Plan({"a": 0, "b": 64, "c": 0}, arena_bytes=384, peak_live_bytes=384, algorithm="hand",
               per_algorithm={})
    with pytest.raises(InternalError, match="overlap while both are live"):
        verify(CHAIN, bad)
