"""dequant_bf16: a checkpoint's bf16 projection / embedding table under its exact fp32 upcast (the frontend's
binding, frontend/lowprec.bind_bf16) becomes a node reading the bf16 weight as stored (passes/dequant_bf16.py)."""

from dayzero.passes.dequant_bf16 import dequant_bf16

from .ir_spec import assert_ir, ir


_BF16_LINEAR = """
    graph main symbols(seq in [1, 16]) {
      %0 = input {name="x"} : float32[1, seq, 53]
      %1 = weight {name="lm_head.weight"} : bfloat16[37, 53]
      %2 = _to_copy(%1) {dtype="float32"} : float32[37, 53]
      %3 = linear(%0, %2) {bias=false} : float32[1, seq, 37]
      return %3
    }
    """


def test_an_upcast_bf16_weight_under_a_linear_becomes_dequant_linear_bf16():
    after, found = dequant_bf16(ir(_BF16_LINEAR), {})
    assert found.patterns == {"dequant_bf16.linear": 1}
    assert_ir(after, """
    graph main symbols(seq in [1, 16]) {
      %0 = input {name="x"} : float32[1, seq, 53]
      %1 = weight {name="lm_head.weight"} : bfloat16[37, 53]
      %2 = view(%0) {size=[`seq`, 53]} : float32[seq, 53]
      %3 = dequant_linear_bf16(%2, %1) {K=53, N=37} : float32[seq, 37]
      %4 = view(%3) {size=[1, `seq`, 37]} : float32[1, seq, 37]
      return %4
    }
    """)


def test_a_bf16_linear_with_a_bias_adds_it_after_the_kernel():
    after, found = dequant_bf16(ir("""
    graph main symbols() {
      %0 = input {name="x"} : float32[1, 53]
      %1 = weight {name="q.weight"} : bfloat16[37, 53]
      %2 = weight {name="q.bias"} : float32[37]
      %3 = _to_copy(%1) {dtype="float32"} : float32[37, 53]
      %4 = linear(%0, %3, %2) {bias=true} : float32[1, 37]
      return %4
    }
    """), {})
    assert found.patterns == {"dequant_bf16.linear": 1}
    assert_ir(after, """
    graph main symbols() {
      %0 = input {name="x"} : float32[1, 53]
      %1 = weight {name="q.weight"} : bfloat16[37, 53]
      %2 = dequant_linear_bf16(%0, %1) {K=53, N=37} : float32[1, 37]
      %3 = weight {name="q.bias"} : float32[37]
      %4 = add.Tensor(%2, %3) {alpha=1} : float32[1, 37]
      return %4
    }
    """)


def test_an_embedding_of_an_upcast_bf16_table_gathers_bf16_rows_then_converts_them():
    after, found = dequant_bf16(ir("""
    graph main symbols(seq in [1, 16]) {
      %0 = input {name="ids"} : int64[1, seq]
      %1 = weight {name="embed.weight"} : bfloat16[37, 53]
      %2 = _to_copy(%1) {dtype="float32"} : float32[37, 53]
      %3 = embedding(%2, %0) {padding_idx=-1, scale_grad_by_freq=false, sparse=false} : float32[1, seq, 53]
      return %3
    }
    """), {})
    assert found.patterns == {"dequant_bf16.embedding": 1}
    assert_ir(after, """
    graph main symbols(seq in [1, 16]) {
      %0 = weight {name="embed.weight"} : bfloat16[37, 53]
      %1 = input {name="ids"} : int64[1, seq]
      %2 = embedding(%0, %1) {padding_idx=-1, scale_grad_by_freq=false, sparse=false} : bfloat16[1, seq, 53]
      %3 = _to_copy(%2) {dtype="float32"} : float32[1, seq, 53]
      return %3
    }
    """)


def test_an_upcast_of_another_dtype_or_a_plain_fp32_linear_stays_as_it_is():
    for text in (_BF16_LINEAR.replace("bfloat16[37, 53]", "float16[37, 53]"),
                 _BF16_LINEAR.replace('_to_copy(%1) {dtype="float32"}', 'abs(%1)').replace(
                     "bfloat16[37, 53]", "float32[37, 53]")):
        before = ir(text)
        after, found = dequant_bf16(before, {})
        assert_ir(after, before)
        assert found.patterns == {}
