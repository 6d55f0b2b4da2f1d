"""expert_workspace: MXFP4 routed experts take the workspace route (passes/expert_workspace.py): each
``moe_experts_mxfp4`` becomes ``moe_experts_mxfp4_ws`` reading its layer index (a constant) and the shared
workspace and cache-metadata states, named by expert shape, compute dtype and slot count."""

import torch

from dayzero.passes.expert_workspace import expert_workspace

from .ir_spec import assert_ir, ir

# two layers of E = 8 experts, H = 64, gate/up GU = 64, I = 32, stored as MXFP4 blocks and E8M0 scales
ACT = '["mul", ["silu", ["col", 0, 1, 32]], ["col", 32, 1, 32]]'
HEAD = """
graph main symbols(seq in [1, 16]) {
  %0 = input {name="x"} : float32[seq, 64]
  %1 = input {name="ids"} : int64[seq, 2]
  %2 = input {name="w"} : float32[seq, 2]
  %3 = weight {name="l0.gate_up.blocks", zone="low_precision_weights"} : uint8[8, 64, 2, 16]
  %4 = weight {name="l0.gate_up.scales", zone="low_precision_weights"} : uint8[8, 64, 2]
  %5 = weight {name="l0.down.blocks", zone="low_precision_weights"} : uint8[8, 64, 1, 16]
  %6 = weight {name="l0.down.scales", zone="low_precision_weights"} : uint8[8, 64, 1]
  %7 = weight {name="l1.gate_up.blocks", zone="low_precision_weights"} : uint8[8, 64, 2, 16]
  %8 = weight {name="l1.gate_up.scales", zone="low_precision_weights"} : uint8[8, 64, 2]
  %9 = weight {name="l1.down.blocks", zone="low_precision_weights"} : uint8[8, 64, 1, 16]
  %10 = weight {name="l1.down.scales", zone="low_precision_weights"} : uint8[8, 64, 1]
"""
FUSED = HEAD + f"""
  %11 = moe_experts_mxfp4(%0, %1, %2, %3, %4, %5, %6) {{act={ACT}, down_bias=false, gate_up_bias=false, inter=32}}
        : float32[seq, 64]
  %12 = moe_experts_mxfp4(%11, %1, %2, %7, %8, %9, %10) {{act={ACT}, down_bias=false, gate_up_bias=false,
                                                        inter=32}} : float32[seq, 64]
  return %12
}}
"""


def _workspace_route(dtype: str, slots: int, cache: str) -> str:
    tag = f"{dtype}.gu64.h64.i32.s{slots}"
    storage = dtype
    # a converted expert: gate/up [64, 64] then down [64, 32]; metadata: 4 counters + a tag and a tick per slot
    # each layer's node reads its own state nodes of one name: one buffer, shared by name
    return HEAD + f"""
      %11 = weight {{name="expert_workspace.layer0"}} : int32[1]
      %12 = weight {{name="expert_workspace.layer1"}} : int32[1]
      %13 = state {{name="expert_workspace.{tag}", zone="dequant_workspace"}} : {storage}[{slots}, 6144]
      %14 = state {{name="expert_cache.{tag}", zone="dequant_workspace"}} : int64[{4 + 2 * slots}]
      %15 = moe_experts_mxfp4_ws(%0, %1, %2, %3, %4, %5, %6, %11, %13, %14)
            {{act={ACT}, cache={cache}, compute_dtype="{dtype}", down_bias=false, gate_up_bias=false, inter=32}}
            : float32[seq, 64]
      %16 = state {{name="expert_workspace.{tag}", zone="dequant_workspace"}} : {storage}[{slots}, 6144]
      %17 = state {{name="expert_cache.{tag}", zone="dequant_workspace"}} : int64[{4 + 2 * slots}]
      %18 = moe_experts_mxfp4_ws(%15, %1, %2, %7, %8, %9, %10, %12, %16, %17)
            {{act={ACT}, cache={cache}, compute_dtype="{dtype}", down_bias=false, gate_up_bias=false, inter=32}}
            : float32[seq, 64]
      return %18
    }}
    """


def test_without_a_cache_every_layer_converts_into_one_shared_slot():
    after, found = expert_workspace(ir(FUSED, shapes=False))
    assert_ir(after, _workspace_route("float32", 1, "false"), shapes=False)
    assert found.constants["expert_workspace.layer0"].tolist() == [0]
    assert found.constants["expert_workspace.layer1"].tolist() == [1]
    assert found.constants["expert_workspace.layer0"].dtype == torch.int32
    assert found.patterns == {"expert_workspace": 2}


def test_a_cache_budget_of_three_converted_bf16_experts_gives_three_slots():
    budget = 3 * 6144 * 2  # three slots of 6144 bf16 elements
    after, _ = expert_workspace(ir(FUSED, shapes=False), compute_dtype="bfloat16", cache_bytes=budget)
    assert_ir(after, _workspace_route("bfloat16", 3, "true"), shapes=False)


def test_a_program_without_mxfp4_experts_is_left_alone():
    before = ir(HEAD + """
      %11 = add.Tensor(%0, %0) {alpha=1} : float32[seq, 64]
      return %11, %3
    }
    """)
    assert_ir(expert_workspace(before)[0], before)
