"""dequant: a dequantisation chain feeding its consumer becomes one fused node that reads the weight as stored
(passes/dequant.py). Here: DeepSeek's FP8 weight (E4M3 values x one fp32 scale per 128x128 block) under a linear."""

from dayzero.passes.dequant import dequant

from .ir_spec import assert_ir, ir
from .test_dequant_bf16 import _BF16_LINEAR


def _fp8_linear(block_rows: int) -> str:
    """linear(x, W) with W [256, 128] = fp32(Wq) * S repeated block_rows times along rows and 128 along columns."""
    rows = 256 // block_rows
    return f"""
    graph main symbols(seq in [1, 16]) {{
      %0 = input {{name="x"}} : float32[1, seq, 128]
      %1 = weight {{name="proj.weight"}} : float8_e4m3fn[256, 128]
      %2 = weight {{name="proj.weight_scale_inv"}} : float32[{rows}, 1]
      %3 = _to_copy(%1) {{dtype="float32"}} : float32[256, 128]
      %4 = unsqueeze(%2) {{dim=1}} : float32[{rows}, 1, 1]
      %5 = expand(%4) {{implicit=false, size=[{rows}, {block_rows}, 1]}} : float32[{rows}, {block_rows}, 1]
      %6 = view(%5) {{size=[256, 1]}} : float32[256, 1]
      %7 = unsqueeze(%6) {{dim=2}} : float32[256, 1, 1]
      %8 = expand(%7) {{implicit=false, size=[256, 1, 128]}} : float32[256, 1, 128]
      %9 = view(%8) {{size=[256, 128]}} : float32[256, 128]
      %10 = mul.Tensor(%3, %9) : float32[256, 128]
      %11 = linear(%0, %10) {{bias=false}} : float32[1, seq, 256]
      return %11
    }}
    """


def test_an_fp8_block_scaled_weight_under_a_linear_becomes_dequant_linear_fp8():
    after, found = dequant(ir(_fp8_linear(128)), {})
    assert found.patterns == {"dequant.linear": 1}
    assert_ir(after, """
    graph main symbols(seq in [1, 16]) {
      %0 = input {name="x"} : float32[1, seq, 128]
      %1 = weight {name="proj.weight"} : float8_e4m3fn[256, 128]
      %2 = weight {name="proj.weight_scale_inv"} : float32[2, 1]
      %3 = view(%0) {size=[`seq`, 128]} : float32[seq, 128]
      %4 = dequant_linear_fp8(%3, %1, %2) {K=128, N=256} : float32[seq, 256]
      %5 = view(%4) {size=[1, `seq`, 256]} : float32[1, seq, 256]
      return %5
    }
    """)


def test_scale_blocks_other_than_128_by_128_stay_generic():
    before = ir(_fp8_linear(64))
    after, found = dequant(before, {})
    assert_ir(after, before)
    assert found.patterns == {}


def test_a_weight_shorter_than_its_scale_blocks_reads_the_repeated_scales_sliced():
    # W [200, 128]: DeepSeek's weight_dequant repeats S [2, 1] to [256, 128] and slices it to W's 200 rows
    before = ir("""
    graph main symbols(seq in [1, 16]) {
      %0 = input {name="x"} : float32[seq, 128]
      %1 = weight {name="proj.weight"} : float8_e4m3fn[200, 128]
      %2 = weight {name="proj.weight_scale_inv"} : float32[2, 1]
      %3 = _to_copy(%1) {dtype="float32"} : float32[200, 128]
      %4 = unsqueeze(%2) {dim=1} : float32[2, 1, 1]
      %5 = expand(%4) {implicit=false, size=[2, 128, 1]} : float32[2, 128, 1]
      %6 = view(%5) {size=[256, 1]} : float32[256, 1]
      %7 = unsqueeze(%6) {dim=2} : float32[256, 1, 1]
      %8 = expand(%7) {implicit=false, size=[256, 1, 128]} : float32[256, 1, 128]
      %9 = view(%8) {size=[256, 128]} : float32[256, 128]
      %10 = slice.Tensor(%9) {dim=0, start=0, end=200, step=1} : float32[200, 128]
      %11 = mul.Tensor(%3, %10) : float32[200, 128]
      %12 = linear(%0, %11) {bias=false} : float32[seq, 200]
      return %12
    }
    """)
    assert_ir(dequant(before, {})[0], """
    graph main symbols(seq in [1, 16]) {
      %0 = input {name="x"} : float32[seq, 128]
      %1 = weight {name="proj.weight"} : float8_e4m3fn[200, 128]
      %2 = weight {name="proj.weight_scale_inv"} : float32[2, 1]
      %3 = dequant_linear_fp8(%0, %1, %2) {K=128, N=200} : float32[seq, 200]
      return %3
    }
    """)


# ---- bf16 weights: fused by passes/dequant_bf16.py after shard, not here ------------------------------------

def test_an_upcast_bf16_weight_is_left_for_dequant_bf16_after_shard():
    before = ir(_BF16_LINEAR)
    after, found = dequant(before, {})
    assert_ir(after, before)
    assert found.patterns == {}
