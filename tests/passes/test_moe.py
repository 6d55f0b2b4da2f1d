"""moe: routed experts as traced from transformers' ``batched_mm`` experts (gather per-assignment expert weights,
bmm, activation, bmm, weight by the router, sum over k) become one ``moe_experts`` node (passes/moe.py)."""

from dayzero.passes.moe import moe

from .ir_spec import assert_ir, ir

# T = seq tokens, k = 2 experts each (S = 2*seq assignments), E = 4 experts, H = 16, I = 16 (sizes the kernel takes): SwiGLU experts stored as
# [E, out, in] (Qwen3-MoE's layout "nk"); the down GEMM gathers its weights by ``down_ids``
BATCHED_MM = """
graph main symbols(seq in [1, 16]) {
  %0 = input {name="x"} : float32[seq, 16]
  %1 = input {name="ids"} : int64[seq, 2]
  %2 = input {name="w"} : float32[seq, 2]
  %3 = input {name="other_ids"} : int64[seq, 2]
  %4 = weight {name="experts.gate_up_proj"} : float32[4, 32, 16]
  %5 = weight {name="experts.down_proj"} : float32[4, 16, 16]
  %6 = view(%1) {size=[-1]} : int64[`2*seq`]
  %7 = view(DOWN_IDS) {size=[-1]} : int64[`2*seq`]
  %8 = index.Tensor(%5, %7) {indices=[true]} : float32[`2*seq`, 16, 16]
  %9 = index.Tensor(%4, %6) {indices=[true]} : float32[`2*seq`, 32, 16]
  %10 = unsqueeze(%0) {dim=1} : float32[seq, 1, 16]
  %11 = expand(%10) {implicit=false, size=[`seq`, 2, 16]} : float32[seq, 2, 16]
  %12 = clone(%11) : float32[seq, 2, 16]
  %13 = view(%12) {size=[`2*seq`, 16]} : float32[`2*seq`, 16]
  %14 = unsqueeze(%13) {dim=-1} : float32[`2*seq`, 16, 1]
  %15 = bmm(%9, %14) : float32[`2*seq`, 32, 1]
  %16 = squeeze.dims(%15) {dim=[-1]} : float32[`2*seq`, 32]
  %17 = split_with_sizes(%16) {dim=-1, split_sizes=[16, 16]} : (float32[`2*seq`, 16], float32[`2*seq`, 16])
  %18 = getitem(%17) {index=0} : float32[`2*seq`, 16]
  %19 = silu(%18) : float32[`2*seq`, 16]
  %20 = getitem(%17) {index=1} : float32[`2*seq`, 16]
  %21 = mul.Tensor(%19, %20) : float32[`2*seq`, 16]
  %22 = unsqueeze(%21) {dim=-1} : float32[`2*seq`, 16, 1]
  %23 = bmm(%8, %22) : float32[`2*seq`, 16, 1]
  %24 = squeeze.dims(%23) {dim=[-1]} : float32[`2*seq`, 16]
  %25 = view(%2) {size=[-1]} : float32[`2*seq`]
  %26 = unsqueeze(%25) {dim=-1} : float32[`2*seq`, 1]
  %27 = mul.Tensor(%24, %26) : float32[`2*seq`, 16]
  %28 = view(%27) {size=[`seq`, 2, 16]} : float32[seq, 2, 16]
  %29 = sum.dim_IntList(%28) {dim=[1], dtype=null, keepdim=false} : float32[seq, 16]
  %30 = add.Tensor(%29, %0) {alpha=1} : float32[seq, 16]
  return %30, %3
}
"""


def test_batched_mm_experts_become_one_moe_experts_node():
    after, found = moe(ir(BATCHED_MM.replace("DOWN_IDS", "%1")), {})
    assert found.patterns == {"moe.grouped_experts": 1}
    assert_ir(after, """
    graph main symbols(seq in [1, 16]) {
      %0 = input {name="x"} : float32[seq, 16]
      %1 = input {name="ids"} : int64[seq, 2]
      %2 = input {name="w"} : float32[seq, 2]
      %3 = input {name="other_ids"} : int64[seq, 2]
      %4 = weight {name="experts.gate_up_proj"} : float32[4, 32, 16]
      %5 = weight {name="experts.down_proj"} : float32[4, 16, 16]
      %6 = moe_experts(%0, %1, %2, %4, %5) {act=["mul", ["silu", ["col", 0, 1, 16]], ["col", 16, 1, 16]],
                                            down_bias=false, gate_up_bias=false, inter=16, layout="nk"}
           : float32[seq, 16]
      %7 = add.Tensor(%6, %0) {alpha=1} : float32[seq, 16]
      return %7, %3
    }
    """)


def test_experts_whose_two_gemms_are_routed_differently_are_left_alone():
    before = ir(BATCHED_MM.replace("DOWN_IDS", "%3"))
    after, found = moe(before, {})
    assert_ir(after, before)
    assert found.patterns == {}
