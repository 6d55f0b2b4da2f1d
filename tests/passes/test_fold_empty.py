"""fold_empty: statically empty values become ``empty.memory_format``, cat drops empty inputs, reductions over
nothing become ``full`` of their value (passes/fold_empty.py)."""

from dayzero.passes.fold_empty import fold_empty

from .ir_spec import assert_ir, ir

# a partial rotary embedding whose rotated part spans the whole head: the pass-through half is empty
ROTARY_TAIL = """
graph main symbols(seq in [1, 32]) {
  %0 = input {name="x"} : float32[1, 4, seq, 16]
  %1 = slice.Tensor(%0) {dim=3, start=16, end=9223372036854775807, step=1} : float32[1, 4, seq, 0]
  %2 = neg(%1) : float32[1, 4, seq, 0]
  %3 = cat(%0, %2) {dim=-1, tensors=2} : float32[1, 4, seq, 16]
  %4 = sum.dim_IntList(%2) {dim=[-1], keepdim=false, dtype=null} : float32[1, 4, seq]
  %5 = add.Tensor(%3, %3) {alpha=1} : float32[1, 4, seq, 16]
  return %5, %4, %2
}
"""


def test_empty_values_fold_cat_drops_them_and_a_sum_over_nothing_is_zero():
    assert_ir(fold_empty(ir(ROTARY_TAIL)), """
    graph main symbols(seq in [1, 32]) {
      %0 = input {name="x"} : float32[1, 4, seq, 16]
      %1 = add.Tensor(%0, %0) {alpha=1} : float32[1, 4, seq, 16]
      %2 = full {size=[1, 4, `seq`], fill_value=0.0, dtype="float32"} : float32[1, 4, seq]
      %3 = empty.memory_format {size=[1, 4, `seq`, 0], dtype="float32"} : float32[1, 4, seq, 0]
      return %1, %2, %3
    }
    """)


def test_an_empty_input_that_decided_the_dtype_casts_the_cat():
    before = """
    graph main symbols(seq in [1, 32]) {
      %0 = input {name="x"} : float32[seq, 8]
      %1 = input {name="y"} : float64[seq, 8]
      %2 = slice.Tensor(%1) {dim=1, start=8, end=8, step=1} : float64[seq, 0]
      %3 = cat(%0, %2) {dim=1, tensors=2} : float64[seq, 8]
      return %3
    }
    """
    assert_ir(fold_empty(ir(before)), """
    graph main symbols(seq in [1, 32]) {
      %0 = input {name="x"} : float32[seq, 8]
      %1 = input {name="y"} : float64[seq, 8]
      %2 = _to_copy(%0) {dtype="float64"} : float64[seq, 8]
      return %2
    }
    """)


def test_a_product_over_nothing_is_one_and_amax_over_nothing_keeps_its_kernel():
    before = """
    graph main symbols(seq in [1, 32]) {
      %0 = input {name="x"} : float32[seq, 0]
      %1 = prod.dim_int(%0) {dim=1, keepdim=false, dtype=null} : float32[seq]
      %2 = amax(%0) {dim=[1], keepdim=false} : float32[seq]
      return %1, %2
    }
    """
    # amax of nothing raises in ATen, so the shapes of this graph cannot be checked by running it on meta tensors
    assert_ir(fold_empty(ir(before, shapes=False)), """
    graph main symbols(seq in [1, 32]) {
      %0 = input {name="x"} : float32[seq, 0]
      %1 = full {size=[`seq`], fill_value=1.0, dtype="float32"} : float32[seq]
      %2 = amax(%0) {dim=[1], keepdim=false} : float32[seq]
      return %1, %2
    }
    """, shapes=False)


def test_a_graph_without_empty_values_is_left_alone():
    before = """
    graph main symbols(seq in [1, 32]) {
      %0 = input {name="x"} : float32[1, 4, seq, 16]
      %1 = slice.Tensor(%0) {dim=3, start=8, end=16, step=1} : float32[1, 4, seq, 8]
      %2 = cat(%1, %1) {dim=-1, tensors=2} : float32[1, 4, seq, 16]
      %3 = sum.dim_IntList(%1) {dim=[-1], keepdim=false, dtype=null} : float32[1, 4, seq]
      return %2, %3
    }
    """
    assert_ir(fold_empty(ir(before)), before)
