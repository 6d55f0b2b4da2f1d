"""fold_constants: values that depend on no input and no weight become weights bound from the artifact's constants
(passes/fold_constants.py): only statically shaped, non-empty values of at most MAX_ELEMENTS elements."""

import torch

from dayzero.passes.fold_constants import MAX_ELEMENTS, fold_constants

from .ir_spec import assert_ir, ir


def test_a_constant_chain_becomes_one_weight_holding_its_value():
    before = """
    graph main symbols(seq in [1, 32]) {
      %0 = input {name="x"} : float32[seq, 8]
      %1 = arange.start_step {dtype=null, end=8, start=0, step=1} : int64[8]
      %2 = mul.Tensor(%1, %1) : int64[8]
      %3 = _to_copy(%2) {dtype="float32"} : float32[8]
      %4 = add.Tensor(%0, %3) {alpha=1} : float32[seq, 8]
      return %4
    }
    """
    after, found = fold_constants(ir(before))
    constants = found.constants
    name, = (n.attr["name"] for n in after.nodes() if n.op == "weight")
    assert name.startswith("const.")
    torch.testing.assert_close(constants[name], torch.tensor([0.0, 1, 4, 9, 16, 25, 36, 49]), rtol=0, atol=0)
    assert_ir(after, f"""
    graph main symbols(seq in [1, 32]) {{
      %0 = input {{name="x"}} : float32[seq, 8]
      %1 = weight {{name="{name}"}} : float32[8]
      %2 = add.Tensor(%0, %1) {{alpha=1}} : float32[seq, 8]
      return %2
    }}
    """)


def test_values_shaped_by_a_symbol_empty_or_too_large_and_input_reads_stay():
    big = MAX_ELEMENTS + 1
    before = f"""
    graph main symbols(seq in [1, 32]) {{
      %0 = input {{name="x"}} : float32[seq]
      %1 = arange.start_step {{dtype=null, end=`seq`, start=0, step=1}} : int64[seq]
      %2 = full {{size=[{big}], fill_value=2.0, dtype="float32"}} : float32[{big}]
      %3 = empty.memory_format {{size=[0], dtype="float32"}} : float32[0]
      %4 = mul.Tensor(%0, %0) : float32[seq]
      return %1, %2, %3, %4
    }}
    """
    after, found = fold_constants(ir(before))
    assert_ir(after, before)
    assert found.constants == {}


def test_an_empty_buffer_folds_to_zeros_with_the_same_name_every_time():
    """MLA's expand_kv writes its keys into ``new_empty(...)`` slices: folded, the buffer is zeros (not whatever the
    allocator returned), so two compiles give the same constant and the same artifact bytes, and its tp blocks are
    equal (passes/shard.py splits it as one block)."""
    before = """
    graph main symbols(seq in [1, 32]) {
      %0 = input {name="x"} : float32[seq, 4, 64, 24]
      %1 = empty.memory_format {dtype="float32", size=[1, 4, 64, 24]} : float32[1, 4, 64, 24]
      %2 = add.Tensor(%0, %1) {alpha=1} : float32[seq, 4, 64, 24]
      return %2
    }
    """
    names = set()
    for _ in range(3):
        after, found = fold_constants(ir(before))
        name, = (n.attr["name"] for n in after.nodes() if n.op == "weight")
        assert torch.equal(found.constants[name], torch.zeros(1, 4, 64, 24))
        names.add(name)
    assert len(names) == 1
