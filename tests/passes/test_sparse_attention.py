"""sparse_attention: attention over a KV cache under a causal mask built from positions becomes one cache op that
reads only the rows each query may see (passes/sparse_attention.py, shape (a): dense causal attention, GQA)."""

import torch

from dayzero.passes.sparse_attention import sparse_attention

from .ir_spec import assert_ir, ir

# 4 query heads over 2 KV heads (repeat_kv: unsqueeze, expand, clone, view), a cache of 64 rows; the mask compares
# the constant arange(64) [1, 1, 1, 64] (folded by fold_constants) with each query's position: row <= position
STATES = """
graph main symbols(seq in [1, 64]) {
  %0 = input {name="q"} : float32[1, 4, seq, 16]
  %1 = input {name="k"} : float32[1, 2, seq, 16]
  %2 = input {name="v"} : float32[1, 2, seq, 16]
  %3 = input {name="cache_position"} : int64[seq]
  %4 = state {name="cache_0_keys", zone="kv_cache"} : float32[1, 2, 64, 16]
  %5 = state {name="cache_0_values", zone="kv_cache"} : float32[1, 2, 64, 16]
  %6 = state_index_put(%4, %3, %1) {indices=[false, false, true]} : float32[1, 2, 64, 16]
  %7 = state_index_put(%5, %3, %2) {indices=[false, false, true]} : float32[1, 2, 64, 16]
"""
CAUSAL_SDPA = STATES + """
  %8 = unsqueeze(%6) {dim=2} : float32[1, 2, 1, 64, 16]
  %9 = expand(%8) {implicit=false, size=[1, 2, 2, 64, 16]} : float32[1, 2, 2, 64, 16]
  %10 = clone(%9) : float32[1, 2, 2, 64, 16]
  %11 = view(%10) {size=[1, 4, 64, 16]} : float32[1, 4, 64, 16]
  %12 = unsqueeze(%7) {dim=2} : float32[1, 2, 1, 64, 16]
  %13 = expand(%12) {implicit=false, size=[1, 2, 2, 64, 16]} : float32[1, 2, 2, 64, 16]
  %14 = clone(%13) : float32[1, 2, 2, 64, 16]
  %15 = view(%14) {size=[1, 4, 64, 16]} : float32[1, 4, 64, 16]
  %16 = weight {name="const.rows"} : int64[1, 1, 1, 64]
  %17 = unsqueeze(%3) {dim=0} : int64[1, seq]
  %18 = unsqueeze(%17) {dim=1} : int64[1, 1, seq]
  %19 = unsqueeze(%18) {dim=3} : int64[1, 1, seq, 1]
  %20 = le.Tensor(%16, %19) : bool[1, 1, seq, 64]
  %21 = expand(%20) {implicit=false, size=[1, -1, `seq`, 64]} : bool[1, 1, seq, 64]
  %22 = scaled_dot_product_attention(%0, %11, %15, %21) {attn_mask=true, dropout_p=0.0, enable_gqa=false,
                                                         is_causal=false, scale=0.25} : float32[1, 4, seq, 16]
  return %22, %6, %7
}
"""


def _constants(rows: torch.Tensor) -> dict:
    return {"const.rows": rows.reshape(1, 1, 1, 64)}


def test_causal_attention_over_the_cache_becomes_cache_attention():
    after, found = sparse_attention(ir(CAUSAL_SDPA), _constants(torch.arange(64)))
    assert found.patterns == {"sparse_attention.cache_attention": 1}
    assert_ir(after, STATES + """
      %8 = cache_attention(%0, %6, %7, %3) {scale=0.25, sinks=false, window=0} : float32[1, 4, seq, 16]
      return %8, %6, %7
    }
    """, shapes=False)


def test_a_mask_that_is_not_causal_stays_dense():
    before = ir(CAUSAL_SDPA)
    after, found = sparse_attention(before, _constants(torch.arange(1, 65)))  # row r compares as r + 1: not row <= position
    assert_ir(after, before)
    assert found.patterns == {}
