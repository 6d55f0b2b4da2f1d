"""compressed_attention: DeepSeek-V4's heavily compressed attention (HCA), as traced, over cat([sliding K=V cache,
compressed entries]) with a window mask, a causal block bias and per-head sinks, becomes one
``compressed_attention`` node that reads only the rows a query sees (passes/compressed_attention.py)."""

import torch

from dayzero.passes.compressed_attention import compressed_attention

from .ir_spec import assert_ir, ir

# the first HCA layer of make-tiny deepseek_v4 (4 heads over 1 KV head, D = 32, a 64-row sliding cache read through
# a window of 8, 9 compressed entries), after the passes before this one; its values cut at what the pass keeps:
# q, the written K=V cache ``kv``, the compressed ``entries``, the query positions ``qpos``, the entry positions
# (``cache_position``) and the sinks. Constants are read by value (fold_constants folded them; the pass gets them as its constants).
HCA = """
graph main symbols(seq in [1, 64]) {
  %0 = input {name="cache_position"} : int64[seq]
  %1 = input {name="q"} : float32[1, 4, seq, 32]
  %2 = input {name="kv"} : float32[1, 1, 64, 32]
  %3 = input {name="entries"} : float32[1, 1, 9, 32]
  %4 = input {name="qpos"} : int64[seq]
  %5 = expand(%1) {implicit=false, size=[1, 4, `seq`, 32]} : float32[1, 4, seq, 32]
  %6 = view(%5) {size=[4, `seq`, 32]} : float32[4, seq, 32]
  %7 = cat(%2, %3) {dim=2, tensors=2} : float32[1, 1, 73, 32]
  %8 = unsqueeze(%7) {dim=2} : float32[1, 1, 1, 73, 32]
  %9 = expand(%8) {implicit=false, size=[1, 1, 4, 73, 32]} : float32[1, 1, 4, 73, 32]
  %10 = view(%9) {size=[1, 4, 73, 32]} : float32[1, 4, 73, 32]
  %11 = permute(%10) {dims=[0, 1, 3, 2]} : float32[1, 4, 32, 73]
  %12 = expand(%11) {implicit=false, size=[1, 4, 32, 73]} : float32[1, 4, 32, 73]
  %13 = view(%12) {size=[4, 32, 73]} : float32[4, 32, 73]
  %14 = bmm(%6, %13) : float32[4, seq, 73]
  %15 = view(%14) {size=[1, 4, `seq`, 73]} : float32[1, 4, seq, 73]
  %16 = weight {name="const.scale"} : float32[]
  %17 = mul.Tensor(%15, %16) : float32[1, 4, seq, 73]
  %18 = weight {name="const.true"} : bool[]
  %19 = weight {name="const.rows"} : int64[1, 1, 1, 64]
  %20 = unsqueeze(%4) {dim=0} : int64[1, seq]
  %21 = unsqueeze(%20) {dim=1} : int64[1, 1, seq]
  %22 = unsqueeze(%21) {dim=3} : int64[1, 1, seq, 1]
  %23 = weight {name="const.window"} : int64[]
  %24 = sub.Tensor(%22, %23) {alpha=1} : int64[1, 1, seq, 1]
  %25 = gt.Tensor(%19, %24) : bool[1, 1, seq, 64]
  %26 = bitwise_and.Tensor(%18, %25) : bool[1, 1, seq, 64]
  %27 = le.Tensor(%19, %22) : bool[1, 1, seq, 64]
  %28 = bitwise_and.Tensor(%26, %27) : bool[1, 1, seq, 64]
  %29 = expand(%28) {implicit=false, size=[1, -1, `seq`, 64]} : bool[1, 1, seq, 64]
  %30 = weight {name="const.zero"} : float32[]
  %31 = weight {name="const.big"} : float32[]
  %32 = where.self(%29, %30, %31) : float32[1, 1, seq, 64]
  %33 = weight {name="const.entries"} : int64[1, 1, 1, 9]
  %34 = unsqueeze(%0) {dim=0} : int64[1, seq]
  %35 = expand(%34) {implicit=false, size=[1, -1]} : int64[1, seq]
  %36 = weight {name="const.one"} : int64[]
  %37 = add.Tensor(%35, %36) {alpha=1} : int64[1, seq]
  %38 = weight {name="const.rate"} : int64[]
  %39 = div.Tensor_mode(%37, %38) {rounding_mode="floor"} : int64[1, seq]
  %40 = unsqueeze(%39) {dim=1} : int64[1, 1, seq]
  %41 = unsqueeze(%40) {dim=-1} : int64[1, 1, seq, 1]
  %42 = ge.Tensor(%33, %41) : bool[1, 1, seq, 9]
  %43 = weight {name="const.inf"} : float32[]
  %44 = full {dtype="float32", fill_value=0, size=[1, 1, `seq`, 9]} : float32[1, 1, seq, 9]
  %45 = where.self(%42, %43, %44) : float32[1, 1, seq, 9]
  %46 = cat(%32, %45) {dim=-1, tensors=2} : float32[1, 1, seq, 73]
  %47 = add.Tensor(%17, %46) {alpha=1} : float32[1, 4, seq, 73]
  %48 = weight {name="sinks"} : float32[4]
  %49 = view(%48) {size=[1, -1, 1, 1]} : float32[1, 4, 1, 1]
  %50 = expand(%49) {implicit=false, size=[1, -1, `seq`, -1]} : float32[1, 4, seq, 1]
  %51 = cat(%47, %50) {dim=-1, tensors=2} : float32[1, 4, seq, 74]
  %52 = max.dim(%51) {dim=-1, keepdim=true} : (float32[1, 4, seq, 1], int64[1, 4, seq, 1])
  %53 = getitem(%52) {index=0} : float32[1, 4, seq, 1]
  %54 = sub.Tensor(%51, %53) {alpha=1} : float32[1, 4, seq, 74]
  %55 = softmax.int(%54) {dim=-1, dtype="float32"} : float32[1, 4, seq, 74]
  %56 = slice.Tensor(%55) {dim=3, end=-1, start=0, step=1} : float32[1, 4, seq, 73]
  %57 = clone(%56) : float32[1, 4, seq, 73]
  %58 = expand(%57) {implicit=false, size=[1, 4, `seq`, 73]} : float32[1, 4, seq, 73]
  %59 = view(%58) {size=[4, `seq`, 73]} : float32[4, seq, 73]
  %60 = unsqueeze(%7) {dim=2} : float32[1, 1, 1, 73, 32]
  %61 = expand(%60) {implicit=false, size=[1, 1, 4, 73, 32]} : float32[1, 1, 4, 73, 32]
  %62 = view(%61) {size=[1, 4, 73, 32]} : float32[1, 4, 73, 32]
  %63 = expand(%62) {implicit=false, size=[1, 4, 73, 32]} : float32[1, 4, 73, 32]
  %64 = view(%63) {size=[4, 73, 32]} : float32[4, 73, 32]
  %65 = bmm(%59, %64) : float32[4, seq, 32]
  return %65
}
}
"""


def _constants(big: float = -3.4028234663852886e38) -> dict:
    return {"const.scale": torch.tensor(32 ** -0.5), "const.true": torch.tensor(True),
            "const.rows": torch.arange(64).reshape(1, 1, 1, 64), "const.window": torch.tensor(8),
            "const.zero": torch.tensor(0.0), "const.big": torch.tensor(big),
            "const.entries": torch.arange(9).reshape(1, 1, 1, 9), "const.one": torch.tensor(1),
            "const.rate": torch.tensor(4), "const.inf": torch.tensor(float("-inf"))}


def test_heavily_compressed_attention_becomes_one_node():
    after, found = compressed_attention(ir(HCA, shapes=False), _constants())
    assert found.patterns == {"compressed_attention.hca": 1}
    # window 8 from the window mask, rate 4 from the block bias (entry e is visible once (pos + 1) // 4 > e)
    assert_ir(after, """
    graph main symbols(seq in [1, 64]) {
      %0 = input {name="cache_position"} : int64[seq]
      %1 = input {name="q"} : float32[1, 4, seq, 32]
      %2 = input {name="kv"} : float32[1, 1, 64, 32]
      %3 = input {name="entries"} : float32[1, 1, 9, 32]
      %4 = input {name="qpos"} : int64[seq]
      %5 = weight {name="sinks"} : float32[4]
      %6 = compressed_attention(%1, %2, %4, %3, %5, %0) {epos=true, idx=false, rate=4, scale=0.1767766922712326,
                                                         window=8} : float32[1, 4, seq, 32]
      %7 = view(%6) {size=[4, `seq`, 32]} : float32[4, seq, 32]
      return %7
    }
    """, shapes=False)


def test_a_window_mask_filled_with_a_finite_value_stays_dense():
    before = ir(HCA, shapes=False)
    after, found = compressed_attention(before, _constants(big=-1.0))  # masked scores still count
    assert_ir(after, before, shapes=False)
    assert found.patterns == {}


# the same HCA layer in the row-batched decode step (frontend/decode_export.py RowDecodeStep, DeepSeek-V4's
# ``decode_batch``): batch row b is request b, one query at its own position ``positions[b]``; the window bias is
# built per row as [batch, 64] and unsqueezed to [batch, 1, 1, 64], the block bias per row [batch, 1, 1, 9]
ROW_HCA = """
graph main symbols(batch in [1, 16]) {
  %0 = input {name="positions"} : int64[batch]
  %1 = input {name="q"} : float32[batch, 4, 1, 32]
  %2 = input {name="kv"} : float32[batch, 1, 64, 32]
  %3 = input {name="entries"} : float32[batch, 1, 9, 32]
  %4 = view(%1) {size=[`4*batch`, 1, 32]} : float32[`4*batch`, 1, 32]
  %5 = cat(%2, %3) {dim=2, tensors=2} : float32[batch, 1, 73, 32]
  %6 = unsqueeze(%5) {dim=2} : float32[batch, 1, 1, 73, 32]
  %7 = expand(%6) {implicit=false, size=[`batch`, 1, 4, 73, 32]} : float32[batch, 1, 4, 73, 32]
  %8 = view(%7) {size=[`batch`, 4, 73, 32]} : float32[batch, 4, 73, 32]
  %9 = permute(%8) {dims=[0, 1, 3, 2]} : float32[batch, 4, 32, 73]
  %10 = clone(%9) : float32[batch, 4, 32, 73]
  %11 = view(%10) {size=[`4*batch`, 32, 73]} : float32[`4*batch`, 32, 73]
  %12 = bmm(%4, %11) : float32[`4*batch`, 1, 73]
  %13 = view(%12) {size=[`batch`, 4, 1, 73]} : float32[batch, 4, 1, 73]
  %14 = weight {name="const.scale"} : float32[]
  %15 = mul.Tensor(%13, %14) : float32[batch, 4, 1, 73]
  %16 = view(%0) {size=[-1, 1]} : int64[batch, 1]
  %17 = weight {name="const.rows"} : int64[1, 64]
  %18 = le.Tensor(%17, %16) : bool[batch, 64]
  %19 = weight {name="const.window"} : int64[]
  %20 = sub.Tensor(%16, %19) {alpha=1} : int64[batch, 1]
  %21 = gt.Tensor(%17, %20) : bool[batch, 64]
  %22 = bitwise_and.Tensor(%18, %21) : bool[batch, 64]
  %23 = weight {name="const.zero"} : float32[]
  %24 = weight {name="const.big"} : float32[]
  %25 = where.self(%22, %23, %24) : float32[batch, 64]
  %26 = unsqueeze(%25) {dim=1} : float32[batch, 1, 64]
  %27 = unsqueeze(%26) {dim=2} : float32[batch, 1, 1, 64]
  %28 = weight {name="const.entries"} : int64[1, 1, 1, 9]
  %29 = weight {name="const.one"} : int64[]
  %30 = add.Tensor(%16, %29) {alpha=1} : int64[batch, 1]
  %31 = weight {name="const.rate"} : int64[]
  %32 = div.Tensor_mode(%30, %31) {rounding_mode="floor"} : int64[batch, 1]
  %33 = unsqueeze(%32) {dim=1} : int64[batch, 1, 1]
  %34 = unsqueeze(%33) {dim=-1} : int64[batch, 1, 1, 1]
  %35 = ge.Tensor(%28, %34) : bool[batch, 1, 1, 9]
  %36 = weight {name="const.inf"} : float32[]
  %37 = full {dtype="float32", fill_value=0, size=[`batch`, 1, 1, 9]} : float32[batch, 1, 1, 9]
  %38 = where.self(%35, %36, %37) : float32[batch, 1, 1, 9]
  %39 = cat(%27, %38) {dim=-1, tensors=2} : float32[batch, 1, 1, 73]
  %40 = add.Tensor(%15, %39) {alpha=1} : float32[batch, 4, 1, 73]
  %41 = weight {name="sinks"} : float32[4]
  %42 = view(%41) {size=[1, -1, 1, 1]} : float32[1, 4, 1, 1]
  %43 = expand(%42) {implicit=false, size=[`batch`, -1, 1, -1]} : float32[batch, 4, 1, 1]
  %44 = cat(%40, %43) {dim=-1, tensors=2} : float32[batch, 4, 1, 74]
  %45 = max.dim(%44) {dim=-1, keepdim=true} : (float32[batch, 4, 1, 1], int64[batch, 4, 1, 1])
  %46 = getitem(%45) {index=0} : float32[batch, 4, 1, 1]
  %47 = sub.Tensor(%44, %46) {alpha=1} : float32[batch, 4, 1, 74]
  %48 = softmax.int(%47) {dim=-1, dtype="float32"} : float32[batch, 4, 1, 74]
  %49 = slice.Tensor(%48) {dim=3, end=-1, start=0, step=1} : float32[batch, 4, 1, 73]
  %50 = clone(%49) : float32[batch, 4, 1, 73]
  %51 = view(%50) {size=[`4*batch`, 1, 73]} : float32[`4*batch`, 1, 73]
  %52 = clone(%8) : float32[batch, 4, 73, 32]
  %53 = view(%52) {size=[`4*batch`, 73, 32]} : float32[`4*batch`, 73, 32]
  %54 = bmm(%51, %53) : float32[`4*batch`, 1, 32]
  return %54
}
"""


def _row_constants() -> dict:
    return dict(_constants(), **{"const.rows": torch.arange(64).reshape(1, 64)})


def test_row_batched_decode_attention_reads_each_rows_own_positions():
    after, found = compressed_attention(ir(ROW_HCA, shapes=False), _row_constants())
    assert found.patterns == {"compressed_attention.hca": 1}
    # one query per row: the window's and the block bias's positions are the rows' (qpos = epos = positions)
    assert_ir(after, """
    graph main symbols(batch in [1, 16]) {
      %0 = input {name="positions"} : int64[batch]
      %1 = input {name="q"} : float32[batch, 4, 1, 32]
      %2 = input {name="kv"} : float32[batch, 1, 64, 32]
      %3 = input {name="entries"} : float32[batch, 1, 9, 32]
      %4 = weight {name="sinks"} : float32[4]
      %5 = compressed_attention(%1, %2, %0, %3, %4, %0) {epos=true, idx=false, per_row=true, rate=4,
                                                         scale=0.1767766922712326, window=8} : float32[batch, 4, 1, 32]
      %6 = view(%5) {size=[`4*batch`, 1, 32]} : float32[`4*batch`, 1, 32]
      return %6
    }
    """, shapes=False)


def test_a_block_bias_at_one_position_for_every_row_stays_dense():
    # the window per row, but the HCA block bias from one position shared by the batch (not each row's): the
    # kernel could not give each row its own entries, so the attention stays dense
    text = ROW_HCA.replace('%30 = add.Tensor(%16, %29) {alpha=1} : int64[batch, 1]',
                           '%55 = input {name="cache_position"} : int64[1]\n'
                           '  %56 = view(%55) {size=[1, 1]} : int64[1, 1]\n'
                           '  %30 = add.Tensor(%56, %29) {alpha=1} : int64[1, 1]')
    text = text.replace("int64[batch, 1]\n  %31", "int64[1, 1]\n  %31")
    for a, b in (("%32 = div.Tensor_mode(%30, %31) {rounding_mode=\"floor\"} : int64[batch, 1]",
                  "%32 = div.Tensor_mode(%30, %31) {rounding_mode=\"floor\"} : int64[1, 1]"),
                 ("%33 = unsqueeze(%32) {dim=1} : int64[batch, 1, 1]", "%33 = unsqueeze(%32) {dim=1} : int64[1, 1, 1]"),
                 ("%34 = unsqueeze(%33) {dim=-1} : int64[batch, 1, 1, 1]",
                  "%34 = unsqueeze(%33) {dim=-1} : int64[1, 1, 1, 1]"),
                 ("%35 = ge.Tensor(%28, %34) : bool[batch, 1, 1, 9]", "%35 = ge.Tensor(%28, %34) : bool[1, 1, 1, 9]")):
        assert a in text
        text = text.replace(a, b)
    before = ir(text, shapes=False)
    after, found = compressed_attention(before, _row_constants())
    assert found.patterns == {}
    assert_ir(after, before, shapes=False)


# the row program's K=V states hold only the window ending at each row's query (frontend/decode_export.py
# RowDecodeStep): row j of request b at position positions[b] - 63 + j, the window bias ``rows + (pos - 63) >= 0``
_WINDOW_TERMS = """  %18 = le.Tensor(%17, %16) : bool[batch, 64]
  %19 = weight {name="const.window"} : int64[]
  %20 = sub.Tensor(%16, %19) {alpha=1} : int64[batch, 1]
  %21 = gt.Tensor(%17, %20) : bool[batch, 64]
  %22 = bitwise_and.Tensor(%18, %21) : bool[batch, 64]
"""
_HELD_TERM = """  %19 = weight {name="const.last"} : int64[]
  %20 = sub.Tensor(%16, %19) {alpha=1} : int64[batch, 1]
  %21 = add.Tensor(%17, %20) {alpha=1} : int64[batch, 64]
  %22 = ge.Scalar(%21) {other=0} : bool[batch, 64]
"""


def test_row_states_holding_the_window_ending_at_each_query_are_read_as_a_ring():
    assert _WINDOW_TERMS in ROW_HCA
    text = ROW_HCA.replace(_WINDOW_TERMS, _HELD_TERM)
    after, found = compressed_attention(ir(text, shapes=False), dict(_row_constants(), **{
        "const.last": torch.tensor(63)}))
    assert found.patterns == {"compressed_attention.hca": 1}
    (att,) = [n for n in after.nodes() if n.op == "compressed_attention"]
    assert att.attr["ring"] is True and att.attr["per_row"] is True and att.attr["window"] == 0
    assert att.inputs[1].attr["name"] == "kv" and att.inputs[2].attr["name"] == "positions"


def test_a_held_window_that_does_not_end_at_the_query_stays_dense():
    # the rows end one position before the query: no kernel layout says so, the attention stays dense
    before = ir(ROW_HCA.replace(_WINDOW_TERMS, _HELD_TERM), shapes=False)
    after, found = compressed_attention(before, dict(_row_constants(), **{"const.last": torch.tensor(62)}))
    assert found.patterns == {}
    assert_ir(after, before, shapes=False)
