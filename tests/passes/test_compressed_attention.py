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
