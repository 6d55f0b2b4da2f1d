"""inplace_state: a functionalised cache write (index_put + assign back) becomes ``state_index_put``, which writes
the rows into the state's buffer (passes/inplace_state.py); only when nothing else reads the old contents."""

from dayzero.passes.inplace_state import inplace_state

from .ir_spec import assert_ir, ir

HEAD = """
graph main symbols(seq in [1, 64]) {
  %0 = input {name="cache_position"} : int64[seq]
  %1 = input {name="k"} : float32[1, 2, seq, 16]
  %2 = state {name="cache_0_keys", zone="kv_cache"} : float32[1, 2, 64, 16]
"""


def test_a_cache_write_assigned_back_becomes_an_in_place_write():
    before = HEAD + """
      %3 = index_put(%2, %0, %1) {accumulate=false, indices=[false, false, true]} : float32[1, 2, 64, 16]
      %4 = mul.Tensor(%3, %3) : float32[1, 2, 64, 16]
      %5 = assign(%2, %3) : float32[1, 2, 64, 16]
      return %4, %5
    }
    """
    after, found = inplace_state(ir(before))
    assert found.patterns == {"inplace_kv_write": 1}
    assert_ir(after, HEAD + """
      %3 = state_index_put(%2, %0, %1) {indices=[false, false, true]} : float32[1, 2, 64, 16]
      %4 = mul.Tensor(%3, %3) : float32[1, 2, 64, 16]
      return %4, %3
    }
    """)


def test_a_state_whose_old_contents_are_read_keeps_the_copy():
    before = HEAD + """
      %3 = index_put(%2, %0, %1) {accumulate=false, indices=[false, false, true]} : float32[1, 2, 64, 16]
      %4 = mul.Tensor(%3, %2) : float32[1, 2, 64, 16]
      %5 = assign(%2, %3) : float32[1, 2, 64, 16]
      return %4, %5
    }
    """
    after, found = inplace_state(ir(before))
    assert found.patterns == {}
    assert_ir(after, before)


def test_an_accumulating_write_keeps_the_copy():
    before = HEAD + """
      %3 = index_put(%2, %0, %1) {accumulate=true, indices=[false, false, true]} : float32[1, 2, 64, 16]
      %4 = assign(%2, %3) : float32[1, 2, 64, 16]
      return %4
    }
    """
    after, found = inplace_state(ir(before))
    assert found.patterns == {}
    assert_ir(after, before)
