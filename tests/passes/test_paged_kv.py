"""paged_kv: per-token KV caches become pools of fixed-size blocks addressed through a block table input
(passes/paged_kv.py): the write and every reader take the table; a cache some other op reads stays contiguous."""

from dayzero.passes.paged_kv import paged_kv

from .ir_spec import assert_ir, ir

HEAD = """
graph main symbols(seq in [1, 64]) {
  %0 = input {name="q"} : float32[1, 4, seq, 16]
  %1 = input {name="k"} : float32[1, 2, seq, 16]
  %2 = input {name="v"} : float32[1, 2, seq, 16]
  %3 = input {name="cache_position"} : int64[seq]
"""
CONTIGUOUS = HEAD + """
  %4 = state {name="cache_0_keys", zone="kv_cache"} : float32[1, 2, 64, 16]
  %5 = state {name="cache_0_values", zone="kv_cache"} : float32[1, 2, 64, 16]
  %6 = state_index_put(%4, %3, %1) {indices=[false, false, true]} : float32[1, 2, 64, 16]
  %7 = state_index_put(%5, %3, %2) {indices=[false, false, true]} : float32[1, 2, 64, 16]
  %8 = cache_attention(%0, %6, %7, %3) {scale=0.25, sinks=false, window=0} : float32[1, 4, seq, 16]
  return %8, %6, %7
}
"""


def test_caches_become_block_pools_read_and_written_through_one_table():
    # 64 positions in blocks of 16: a table of 4 entries; 2 requests' worth of blocks + the scratch block = 9
    after, found = paged_kv(ir(CONTIGUOUS), {"block_size": 16, "max_batch": 2})
    assert_ir(after, HEAD + """
      %4 = input {kind="block_table", name="block_table"} : int32[4]
      %5 = state {name="cache_0_keys", zone="kv_pages"} : float32[1, 2, 144, 16]
      %6 = state {name="cache_0_values", zone="kv_pages"} : float32[1, 2, 144, 16]
      %7 = paged_state_index_put(%5, %3, %1, %4) {block_size=16, dim=2} : float32[1, 2, 144, 16]
      %8 = paged_state_index_put(%6, %3, %2, %4) {block_size=16, dim=2} : float32[1, 2, 144, 16]
      %9 = cache_attention(%0, %7, %8, %3, %4) {length=64, paged=16, scale=0.25, sinks=false, window=0}
           : float32[1, 4, seq, 16]
      return %9, %7, %8
    }
    """, shapes=False)
    resolved = found.kv_pages
    assert (resolved["table_len"], resolved["length"]) == (4, 64)
    assert resolved["tables"] == [{"name": "block_table", "window": 0, "blocks": 9,
                                   "states": ["cache_0_keys", "cache_0_values"]}]


def test_a_cache_that_a_generic_op_reads_stays_contiguous():
    before = ir(CONTIGUOUS.replace("return %8, %6, %7", "%9 = mul.Tensor(%6, %7) : float32[1, 2, 64, 16]\n"
                                                      "  return %8, %9"))
    assert_ir(paged_kv(before, {"block_size": 16, "max_batch": 2})[0], before)


def test_without_a_block_size_caches_stay_contiguous():
    before = ir(CONTIGUOUS)
    assert_ir(paged_kv(before, {"block_size": 0})[0], before)
    assert_ir(paged_kv(before, None)[0], before)
