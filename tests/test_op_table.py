"""dayzero's own ops are declared in one place (passes/ir/dayzero_ops.py) and their kernels listed in one table
(codegen/kernels/table.py); passes ask targets/capabilities.py, never codegen, whether a kernel takes a node."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from dayzero.codegen import lower
from dayzero.codegen.kernels.table import KERNELS
from dayzero.passes.ir import dayzero_ops, ops
from dayzero.passes.ir.node import Node, TensorType
from dayzero.targets import capabilities

PACKAGE = Path(__file__).resolve().parents[1]
FUSED = ("moe_experts", "moe_experts_mxfp4", "moe_experts_fp8", "moe_experts_mxfp4_ws", "dequant_linear_int4",
         "dequant_linear_mxfp4", "dequant_linear_fp8", "cache_attention", "sparse_attention", "mla_sparse_attention",
         "mla_attention", "dsa_indexer_topk", "compressed_attention", "paged_state_index_put")


def test_the_registry_knows_every_dayzero_op_without_importing_a_pass():
    """A fresh interpreter that imports only the IR knows the fused ops and parses a program that uses one (the
    ops used to exist only after the pass that creates them had been imported)."""
    code = ("from dayzero.passes.ir import ops\n"
            "from dayzero.passes.ir.text import parse_graph\n"
            f"missing = [o for o in {FUSED!r} if o not in ops.REGISTRY]\n"
            "assert not missing, missing\n"
            "g = parse_graph('graph main symbols() {\\n'\n"
            "    '  %0 = input {name=\"s\"} : float32[1, 1, 8, 4]\\n'\n"
            "    '  %1 = input {name=\"i\"} : int64[2]\\n'\n"
            "    '  %2 = input {name=\"v\"} : float32[1, 1, 2, 4]\\n'\n"
            "    '  %3 = input {kind=\"block_table\", name=\"block_table\"} : int32[2]\\n'\n"
            "    '  %4 = paged_state_index_put(%0, %1, %2, %3) {block_size=4, dim=2} : float32[1, 1, 8, 4]\\n'\n"
            "    '  return %4\\n}\\n')\n"
            "assert g.outputs[0].op == 'paged_state_index_put'\n"
            "import sys; assert not any(m.startswith('dayzero.passes.') and not m.startswith('dayzero.passes.ir')\n"
            "                           for m in sys.modules), 'a pass was imported'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_every_declared_op_has_a_kernel_or_a_lowering():
    from dayzero.passes.ir.collective import COLLECTIVES

    declared = {op.name for op in dayzero_ops.DAYZERO_OPS}
    # leaves and views; collectives run in the runtime with torch.distributed (runtime/dist.py), not as kernels
    bound_or_view = {"input", "weight", "state", "getitem", *COLLECTIVES}
    assert set(FUSED) <= declared
    for name in declared - bound_or_view:
        assert name in KERNELS or name in lower.LOWERINGS, name
    # and the kernel table names only declared ops
    assert set(KERNELS) <= declared


def test_passes_never_import_codegen():
    """Layers import one way: passes ask the target (targets/capabilities.py), never codegen."""
    bad = []
    for f in sorted((PACKAGE / "passes").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            level = getattr(node, "level", 0)
            for n in names:
                if "codegen" in n.split(".") or (level >= 2 and n.startswith("codegen")):
                    bad.append(f"{f.relative_to(PACKAGE)}:{node.lineno} imports {n}")
    assert not bad, bad


def _moe_node(H: int, GU: int, I: int, dtype: str = "float32") -> Node:
    x = Node.make("input", (), {"name": "x"}, [TensorType("float32", (3, H))])
    ids = Node.make("input", (), {"name": "ids"}, [TensorType("int64", (3, 2))])
    w = Node.make("input", (), {"name": "w"}, [TensorType("float32", (3, 2))])
    gu = Node.make("weight", (), {"name": "gu"}, [TensorType(dtype, (4, GU, H))])
    d = Node.make("weight", (), {"name": "d"}, [TensorType(dtype, (4, H, I))])
    attrs = {"layout": "nk", "act": ("col", 0, 1, I), "inter": I, "gate_up_bias": False, "down_bias": False}
    return Node.make("moe_experts", (x, ids, w, gu, d), attrs, [TensorType("float32", (3, H))])


@pytest.mark.parametrize("H, GU, I, dtype, ok", [(64, 64, 32, "float32", True), (64, 64, 24, "float32", False),
                                                 (60, 64, 32, "float32", False), (64, 64, 32, "int8", False)])
def test_the_kernel_table_answers_what_the_target_capabilities_say(H, GU, I, dtype, ok):
    n = _moe_node(H, GU, I, dtype)
    assert capabilities.moe_experts(H, GU, I, dtype, dtype) is ok
    for kind in capabilities.KINDS:
        assert KERNELS["moe_experts"].supports(kind, n) is ok
    assert not KERNELS["moe_experts"].supports("vulkan", n)


def test_the_expert_workspace_runs_on_the_host_cpu_only():
    from dayzero import UserError
    from dayzero.passes.expert_workspace import route_for

    assert capabilities.WORKSPACE_KINDS == ("llvm",)
    assert route_for(compute_dtype="bfloat16", cache_bytes=0, target_kind="llvm") == "workspace"
    with pytest.raises(UserError, match="host CPU only"):
        route_for(compute_dtype="float32", cache_bytes=0, route="workspace", target_kind="cuda")


def test_int4_geometry_problems_are_named():
    p = {"N": 8, "K": 6, "layout": "nk", "block": 4, "block_axis": 1}
    assert capabilities.dequant_linear_int4_problem(p) == "blocks of 4 do not tile 6"
    assert capabilities.dequant_linear_int4_problem(dict(p, K=7, block=7)) == \
        "odd row length 7 (a byte would straddle two rows)"
    assert capabilities.dequant_linear_int4_problem(dict(p, K=8)) is None
    assert ops.get("dequant_linear_int4").args[-2:] == (("N", "attr"), ("K", "attr"))


def test_scheduling_a_kernel_on_a_target_kind_it_is_not_written_for_is_an_internal_error():
    """The schedule chain asks the kernel table's supports(): the workspace kernel exists for the host CPU only."""
    import tvm

    from dayzero import InternalError
    from dayzero.codegen.program import Kernel
    from dayzero.codegen.schedule import schedule_kernel

    n = Node.make("moe_experts_mxfp4_ws", (), {}, [TensorType("float32", (1,))])
    fake = Kernel("k", n.op, None, "key", node=n)  # refused before the kernel's function is looked at
    with pytest.raises(InternalError, match="does not take k on target kind cuda"):
        schedule_kernel(fake, tvm.target.Target({"kind": "cuda", "arch": "sm_90"}), None)
