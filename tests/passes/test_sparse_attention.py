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


# ---- the lightning indexer over compressed keys (DeepSeek-V4's DeepseekV4Indexer + IndexerScorer) -------------

# 2 index heads of 16 over 17 compressed keys (a key per 4 positions: 64 / 4 + the scratch row); the scores are
# sum_h(relu(q_h·k) * scale * w_h) and key j is hidden from position p when j >= (p + 1) // 4 (upstream's
# future_mask: a key counts once its window of 4 positions is complete)
V4_KEYS = """
graph main symbols(seq in [1, 64]) {
  %0 = input {name="q"} : float32[1, seq, 2, 16]
  %1 = input {name="w"} : float32[1, seq, 2]
  %2 = input {name="cache_position"} : int64[seq]
  %3 = state {name="cache_1_indexer_entries", zone="kv_cache"} : float32[1, 17, 16]
"""
V4_INDEXER = V4_KEYS + """
  %4 = expand(%0) {implicit=false, size=[1, `seq`, 2, 16]} : float32[1, seq, 2, 16]
  %5 = view(%4) {size=[`seq`, 2, 16]} : float32[seq, 2, 16]
  %6 = permute(%3) {dims=[0, 2, 1]} : float32[1, 16, 17]
  %7 = unsqueeze(%6) {dim=1} : float32[1, 1, 16, 17]
  %8 = expand(%7) {implicit=false, size=[1, `seq`, 16, 17]} : float32[1, seq, 16, 17]
  %9 = view(%8) {size=[`seq`, 16, 17]} : float32[seq, 16, 17]
  %10 = bmm(%5, %9) : float32[seq, 2, 17]
  %11 = view(%10) {size=[1, `seq`, 2, 17]} : float32[1, seq, 2, 17]
  %12 = relu(%11) : float32[1, seq, 2, 17]
  %13 = weight {name="const.scale"} : float32[]
  %14 = mul.Tensor(%12, %13) : float32[1, seq, 2, 17]
  %15 = unsqueeze(%1) {dim=-1} : float32[1, seq, 2, 1]
  %16 = mul.Tensor(%14, %15) : float32[1, seq, 2, 17]
  %17 = sum.dim_IntList(%16) {dim=[2], dtype=null, keepdim=false} : float32[1, seq, 17]
  %18 = weight {name="const.keys"} : int64[1, 1, 17]
  %19 = unsqueeze(%2) {dim=0} : int64[1, seq]
  %20 = weight {name="const.one"} : int64[]
  %21 = add.Tensor(%19, %20) {alpha=1} : int64[1, seq]
  %22 = weight {name="const.rate"} : int64[]
  %23 = div.Tensor_mode(%21, %22) {rounding_mode="floor"} : int64[1, seq]
  %24 = unsqueeze(%23) {dim=-1} : int64[1, seq, 1]
  %25 = ge.Tensor(%18, %24) : bool[1, seq, 17]
  %26 = weight {name="const.ninf"} : float32[]
  %27 = where.self(%25, %26, %17) : float32[1, seq, 17]
  %28 = topk(%27) {dim=-1, k=2, largest=true, sorted=true} : (float32[1, seq, 2], int64[1, seq, 2])
  %29 = getitem(%28) {index=1} : int64[1, seq, 2]
  return %29
}
"""


def _v4_constants(scale: float = 0.25, one: int = 1) -> dict:
    return {"const.scale": torch.tensor(scale), "const.keys": torch.arange(17).reshape(1, 1, 17),
            "const.one": torch.tensor(one), "const.rate": torch.tensor(4), "const.ninf": torch.tensor(float("-inf"))}


def test_indexer_over_compressed_keys_becomes_dsa_indexer_topk_with_its_rate():
    after, found = sparse_attention(ir(V4_INDEXER), _v4_constants())
    assert found.patterns == {"sparse_attention.dsa_indexer_topk": 1}
    assert_ir(after, V4_KEYS + """
      %4 = dsa_indexer_topk(%0, %1, %3, %2) {fill=-inf, k=2, rate=4, scale=0.25, sorted=true} : int64[1, seq, 2]
      return %4
    }
    """)


def test_indexer_with_a_negative_scale_or_another_bound_stays_generic():
    """relu(x) * s is relu(x * s) (the op's order) only for s > 0; a bound (p + 2) // 4 is not the op's rule."""
    before = ir(V4_INDEXER)
    for constants in (_v4_constants(scale=-0.25), _v4_constants(one=2)):
        after, found = sparse_attention(before, constants)
        assert found.patterns == {}
        assert_ir(after, before)
