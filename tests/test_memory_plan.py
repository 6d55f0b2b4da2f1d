"""memory_plan: hand-built Before/Expected cases, the verifier catching broken plans, and random invariants."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dayzero import InternalError, UserError
from dayzero.passes.memory_plan import ALGORITHMS, Buffer, Plan, plan, plan_zones, verify


def B(id, size, start, end, zone="activations"):
    return Buffer(id, size, start, end, zone)


# ---- hand-built cases -------------------------------------------------------------------------------------------


def test_chain_reuses_memory():
    # Before: a -> b -> c, each only live while the next is computed.  a and c never meet, so c reuses a's bytes.
    bufs = [B("a", 100, 0, 1), B("b", 200, 1, 2), B("c", 100, 2, 3)]
    p = plan(bufs)
    # Expected: two 64-aligned slots, arena = 128 + 256.
    assert p.peak_live_bytes == 384
    assert p.arena_bytes == 384
    assert p.offsets["a"] == p.offsets["c"]
    assert {p.offsets["a"], p.offsets["b"]} == {0, 256}


def test_disjoint_lifetimes_share_offset_zero():
    p = plan([B(i, 1000, 2 * i, 2 * i + 1) for i in range(5)])
    assert set(p.offsets.values()) == {0}
    assert p.arena_bytes == p.peak_live_bytes == 1024


def test_all_live_together_is_the_sum():
    p = plan([B(0, 64, 0, 9), B(1, 1, 0, 9), B(2, 130, 5, 5)])
    assert p.arena_bytes == p.peak_live_bytes == 64 + 64 + 192
    assert all(off % 64 == 0 for off in p.offsets.values())


def test_closed_interval_end_step_is_live():
    # x ends at step 3 and y starts at step 3: they are live together and must not share bytes.
    p = plan([B("x", 64, 0, 3), B("y", 64, 3, 5)])
    assert p.offsets["x"] != p.offsets["y"]
    assert p.peak_live_bytes == 128


def test_zero_size_buffers_are_allowed():
    p = plan([B("z", 0, 0, 10), B("a", 64, 0, 10), B("w", 0, 3, 3)])
    assert p.arena_bytes == 64
    assert p.offsets["z"] == 0


def test_empty_program():
    p = plan([])
    assert (p.arena_bytes, p.peak_live_bytes, p.offsets) == (0, 0, {})


def test_gap_is_filled_best_fit():
    # Two long-lived buffers leave a 256-byte hole between them in the 0..11 window; a short buffer fits there.
    bufs = [B("lo", 256, 0, 10), B("hole", 256, 0, 4), B("hi", 256, 0, 10), B("late", 256, 6, 10)]
    p = plan(bufs)
    assert p.arena_bytes == p.peak_live_bytes == 768


def test_every_algorithm_is_reported_and_best_wins():
    bufs = [B(i, 64 * (1 + i % 5), i, i + 3) for i in range(30)]
    p = plan(bufs)
    assert set(p.per_algorithm) == set(ALGORITHMS)
    assert p.arena_bytes == min(p.per_algorithm.values())
    assert p.per_algorithm[p.algorithm] == p.arena_bytes


def test_bad_input_is_a_user_error():
    with pytest.raises(UserError, match="ends"):
        plan([B("x", 64, 5, 2)])
    with pytest.raises(UserError, match="twice"):
        plan([B("x", 64, 0, 1), B("x", 64, 0, 1)])
    with pytest.raises(UserError, match="size"):
        plan([B("x", -1, 0, 1)])
    with pytest.raises(UserError, match="power of two"):
        plan([B("x", 1, 0, 1)], alignment=48)


# ---- the verifier catches broken plans --------------------------------------------------------------------------


def test_verifier_catches_overlap_of_live_buffers():
    bufs = [B("a", 128, 0, 5), B("b", 128, 3, 8)]
    good = plan(bufs)
    broken = dataclasses.replace(good, offsets={"a": 0, "b": 64}, arena_bytes=256)
    with pytest.raises(InternalError, match="overlap"):
        verify(bufs, broken)


def test_verifier_catches_misalignment_and_missing_and_small_arena():
    bufs = [B("a", 128, 0, 5), B("b", 128, 6, 8)]
    with pytest.raises(InternalError, match="aligned"):
        verify(bufs, Plan({"a": 0, "b": 32}, 256, 128, "hand", {}))
    with pytest.raises(InternalError, match="no offset"):
        verify(bufs, Plan({"a": 0}, 256, 128, "hand", {}))
    with pytest.raises(InternalError, match="past the arena"):
        verify(bufs, Plan({"a": 0, "b": 128}, 128, 128, "hand", {}))


def test_verifier_accepts_overlap_of_non_conflicting_buffers():
    bufs = [B("a", 128, 0, 5), B("b", 128, 6, 8)]
    verify(bufs, Plan({"a": 0, "b": 0}, 128, 128, "hand", {}))


def test_plan_runs_the_verifier(monkeypatch):
    import dayzero.passes.memory_plan as mp

    monkeypatch.setitem(mp.ALGORITHMS, "broken", lambda bufs, align: {b.id: 0 for b in bufs})
    monkeypatch.setitem(mp.ALGORITHMS, "greedy_by_size", lambda bufs, align: {b.id: 0 for b in bufs})
    monkeypatch.setitem(mp.ALGORITHMS, "greedy_by_breadth", lambda bufs, align: {b.id: 0 for b in bufs})
    monkeypatch.setitem(mp.ALGORITHMS, "interval_first_fit", lambda bufs, align: {b.id: 0 for b in bufs})
    with pytest.raises(InternalError):
        plan([B("a", 64, 0, 1), B("b", 64, 1, 2)])


# ---- zones ------------------------------------------------------------------------------------------------------


def test_zones_are_contiguous_aligned_and_ordered():
    bufs = [
        B("act0", 100, 0, 1),
        B("act1", 100, 2, 3),
        B("w", 1000, 0, 3, zone="weights"),
        B("kv", 4000, 0, 3, zone="kv_cache"),
        B("hc", 10, 0, 3, zone="cross_layer_state"),
    ]
    zp = plan_zones(bufs)
    assert zp.summary() == {"weights": 1024, "kv_cache": 4032, "cross_layer_state": 64, "activations": 128}
    assert zp.zones["weights"] == (0, 1024)
    assert zp.zones["kv_cache"] == (1024, 4032)
    assert zp.zones["activations"] == (1024 + 4032 + 64, 128)
    assert zp.offsets["act0"] == zp.offsets["act1"] == 5120
    assert zp.total_bytes == sum(zp.summary().values())
    assert all(off % 64 == 0 for off in zp.offsets.values())


def test_unknown_zone_is_a_user_error():
    with pytest.raises(UserError, match="scratchpad"):
        plan_zones([B("a", 1, 0, 1, zone="scratchpad")])


# ---- realistic transformer lifetimes ----------------------------------------------------------------------------


def transformer_lifetimes(layers=8, tokens=512, hidden=1024, heads=16, kv_heads=4, ffn=2816, vocab=32000):
    """Activation lifetimes of a decoder stack in execution order (bf16), as a tracer would produce them."""
    bufs, step = [], 0
    hd = hidden // heads

    def new(name, size, uses_after):
        nonlocal step
        bufs.append(Buffer(name, size * 2, step, step + uses_after))
        step += 1

    res_alive = 0
    bufs.append(Buffer("x0", tokens * hidden * 2, 0, 0))  # embedding output
    for i in range(layers):
        start = step
        new(f"l{i}.norm1", tokens * hidden, 3)
        new(f"l{i}.q", tokens * hidden, 3)
        new(f"l{i}.k", tokens * kv_heads * hd, 2)
        new(f"l{i}.v", tokens * kv_heads * hd, 2)
        new(f"l{i}.scores", heads * tokens * tokens, 1)
        new(f"l{i}.probs", heads * tokens * tokens, 1)
        new(f"l{i}.attn", tokens * hidden, 1)
        new(f"l{i}.o", tokens * hidden, 1)
        new(f"l{i}.res1", tokens * hidden, 7)
        new(f"l{i}.norm2", tokens * hidden, 2)
        new(f"l{i}.gate", tokens * ffn, 2)
        new(f"l{i}.up", tokens * ffn, 1)
        new(f"l{i}.act", tokens * ffn, 1)
        new(f"l{i}.down", tokens * hidden, 1)
        # the residual stream entering the layer lives until the first add, then res1 until the second add
        prev = bufs[res_alive]
        bufs[res_alive] = Buffer(prev.id, prev.size, prev.start, start + 8)
        new(f"l{i}.res2", tokens * hidden, 2)
        res_alive = len(bufs) - 1
    new("final_norm", tokens * hidden, 1)
    new("logits", tokens * vocab, 0)
    return bufs


def test_transformer_arena_is_within_5_percent_of_peak_live():
    bufs = transformer_lifetimes()
    p = plan(bufs)
    assert p.arena_bytes <= 1.05 * p.peak_live_bytes, (p.ratio, p.per_algorithm)


def test_decode_shaped_lifetimes_are_within_5_percent():
    p = plan(transformer_lifetimes(layers=4, tokens=1, hidden=4096, heads=32, kv_heads=8, ffn=14336))
    assert p.arena_bytes <= 1.05 * p.peak_live_bytes, (p.ratio, p.per_algorithm)


# ---- random invariants ------------------------------------------------------------------------------------------

buffer_lists = st.lists(
    st.tuples(st.integers(0, 5000), st.integers(0, 40), st.integers(0, 15)),
    max_size=40,
).map(lambda rows: [Buffer(i, size, s, s + d) for i, (size, s, d) in enumerate(rows)])


@settings(max_examples=150, deadline=None)
@given(buffer_lists, st.sampled_from([1, 16, 64, 256]))
def test_random_lifetimes_every_algorithm_is_valid(bufs, alignment):
    p = plan(bufs, alignment)  # verify() runs inside on the winner
    assert p.arena_bytes >= p.peak_live_bytes
    assert all(off % alignment == 0 for off in p.offsets.values())
    for name, fn in ALGORITHMS.items():  # and every loser is valid too
        offs = fn(bufs, alignment)
        arena = max((offs[b.id] + -(-b.size // alignment) * alignment for b in bufs), default=0)
        verify(bufs, Plan(offs, arena, p.peak_live_bytes, name, {}), alignment)


def _placed_by_scanning(order, alignment, best_fit):
    """The placement rule written plainly (a scan over every placed buffer): the specification the planner's
    vectorised ``_place`` must reproduce offset for offset."""
    def up(n):
        return -(-n // alignment) * alignment

    placed, offsets = [], {}
    for b in order:
        size = up(b.size)
        if size == 0:
            offsets[b.id] = 0
            continue
        taken = sorted((off, off + sz) for o, off, sz in placed if o.start <= b.end and b.start <= o.end)
        chosen, best_gap, cursor = None, None, 0
        for lo, hi in taken:
            gap = lo - cursor
            if gap >= size and (best_gap is None or gap < best_gap):
                chosen, best_gap = cursor, gap
                if not best_fit:
                    break
            cursor = max(cursor, up(hi))
        offsets[b.id] = cursor if chosen is None else chosen
        placed.append((b, offsets[b.id], size))
    return offsets


@settings(max_examples=150, deadline=None)
@given(buffer_lists, st.sampled_from([1, 16, 64]), st.booleans(), st.randoms(use_true_random=False))
def test_placement_equals_the_plain_scan(bufs, alignment, best_fit, rnd):
    from dayzero.passes.memory_plan import _place

    order = list(bufs)
    rnd.shuffle(order)
    assert _place(order, alignment, best_fit) == _placed_by_scanning(order, alignment, best_fit)


def test_breadth_order_follows_the_busiest_step():
    # step 2 holds a (64) + b (128) + c (64) = 256; d is alone at step 10 with 192: a, b, c have breadth 256, d 192,
    # so b (the larger at the peak) goes first at offset 0 and d reuses the bottom
    from dayzero.passes.memory_plan import greedy_by_breadth

    offs = greedy_by_breadth([B("a", 64, 0, 2), B("b", 128, 2, 3), B("c", 64, 1, 2), B("d", 192, 10, 11)], 64)
    assert offs["b"] == 0 and offs["d"] == 0
    assert sorted((offs["a"], offs["c"])) == [128, 192]


# ---- cross-layer state: classified from which decoder layer wrote and read a buffer ----------------------------


def _program():
    """embedding -> layer 0 (norm, add) -> layer 1 (norm, add) -> head, with a persistent cache read in layer 1.
    Buffer 2 (layer 0's output) is read by layer 1: cross-layer.  Buffer 1 is written and read inside layer 0,
    buffer 0 is written outside the stack, buffer 4 (layer 1's output) is read only by the head."""
    from dayzero.codegen.program import BufferInfo, Program, Step

    p = Program("prefill", [])
    for i in range(6):
        p.buffers.append(BufferInfo(i, "float32", (4, 16), "activations"))
    p.buffers[5] = BufferInfo(5, "float32", (4, 16), "io", name="0")
    p.buffers.append(BufferInfo(6, "float32", (8, 16), "kv_cache", state="cache_1_keys"))
    p.buffers.append(BufferInfo(7, "float32", (4, 16), "activations", alias_of=2))  # a view of layer 0's output
    p.inputs, p.outputs = [], [5]
    # the layer is the frontend's attribution (Span.layer), carried by the step; the node text is only for reading
    steps = [("embedding at model.embed_tokens (m.py:1)", [0], None),
             ("rms_norm at model.layers.0.input_layernorm (m.py:2)", [0, 1], ("layers", 0)),
             ("add.Tensor at model.layers.0 (m.py:3)", [0, 1, 2], ("layers", 0)),
             ("rms_norm at model.layers.1.input_layernorm (m.py:2)", [7, 3], ("layers", 1)),
             ("add.Tensor at model.layers.1 (m.py:3)", [3, 6, 4], ("layers", 1)),
             ("linear at lm_head (m.py:4)", [4, 5], None)]
    for node, args, layer in steps:
        p.steps.append(Step("k", args, node, [], 1, layer))
    return p


def test_repeated_block_reads_the_stack_entry_from_a_module_path():
    from dayzero.passes.ir.node import repeated_block

    assert repeated_block("model.layers.12.mlp.experts") == ("layers", 12)
    assert repeated_block("visual.blocks.3.attn") == ("blocks", 3)
    assert repeated_block("/model/layers.2/self_attn/MatMul") == ("layers", 2)
    assert repeated_block("model.embed_tokens") is None
    assert repeated_block("model") is None


def test_cross_layer_state_follows_the_steps_layer_not_their_text():
    """A step's layer is structure (Step.layer, from the node's span), not read back from its text: with the
    attribution dropped, no buffer crosses a layer, whatever the step text says."""
    from dayzero.codegen.memory import cross_layer_roots

    p = _program()
    assert cross_layer_roots(p) == {2}
    for st in p.steps:
        st.layer = None
    assert cross_layer_roots(p) == set()


def test_buffer_handed_to_a_later_layer_is_cross_layer_state():
    from dayzero.codegen.memory import cross_layer_roots, plan_programs

    p = _program()
    assert cross_layer_roots(p) == {2}
    m = plan_programs([p], slots=2)["programs"]["prefill"]
    assert m["zones"]["cross_layer_state"] == 256 == m["peak_live_bytes"]["cross_layer_state"]
    assert m["zones"]["kv_cache"] == 2 * 512  # persistent state, one copy per slot, in its own zone
    drawn = {(b[1], b[4]) for b in m["buffers"]}
    assert (256, "cross_layer_state") in drawn and (512, "kv_cache") in drawn
