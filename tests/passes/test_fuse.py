"""fuse: element-wise chains, row reductions with their element-wise prologue / epilogue, and the views between
them become one ``fused`` node (passes/fuse.py); a value read outside its group is never duplicated and a group
holds at most one reduction. Each case also compiles every fused kernel for the host under the default schedule
and compares it with its reference (the members' references run in order) at T = 1 and an odd length, and checks
the pass did not change what the graph computes (the reference interpreter on both graphs)."""

from __future__ import annotations

import re

import pytest
import torch
import tvm

from dayzero.codegen import program, schedule
from dayzero.passes.fuse import fuse
from dayzero.passes.ir import ops
from dayzero.passes.ir.interp import run_graph
from dayzero.passes.ir.node import Graph
from dayzero.passes.ir.verify import concrete_shape
from dayzero.targets.host import host_target_dict

from .ir_spec import assert_ir, ir

LENGTHS = (1, 7)


def _values(g: Graph, seq: int, seed: int = 0) -> tuple[dict, dict]:
    """Random inputs and weights of ``g`` at ``seq`` (positive: norms and rsqrt stay finite)."""
    gen = torch.Generator().manual_seed(seed)
    ins = {n.attr["name"]: torch.rand(concrete_shape(n.shape, {"seq": seq}), generator=gen) + 0.1 for n in g.inputs}
    ws = {n.attr["name"]: torch.rand(concrete_shape(n.shape, {}), generator=gen) + 0.1
          for n in g.nodes() if n.op == "weight"}
    return ins, ws


def _check_numerics(before: Graph, after: Graph) -> None:
    """``after`` computes what ``before`` did, and every fused kernel matches its reference."""
    target = tvm.target.Target(host_target_dict())
    kernels = []
    for n in after.nodes():
        if n.op != "fused":
            continue
        k = program.Kernel("k", n.op, program.make_prim_func(n, "k"), "", node=n)
        mod = schedule.schedule_kernel(k, target, None, {s: (lo, hi) for s, lo, hi in after.symbols})
        lib = tvm.compile(tvm.IRModule({"k": mod["main"].with_attr("global_symbol", "k")}), target=target)
        kernels.append((n, k, lib))
    assert kernels, "no fused node to check"
    for seq in LENGTHS:
        ins, ws = _values(before, seq)
        want = run_graph(before, ins, ws.__getitem__)
        vals = {}
        got = run_graph(after, ins, ws.__getitem__, observe=lambda n, v: vals.__setitem__(id(n), v))
        for w, o in zip(want, got):
            torch.testing.assert_close(o, w, rtol=0, atol=0)
        for n, k, lib in kernels:
            args = [vals[id(i)].contiguous() for i in n.inputs]
            ref = ops.get("fused").call(args, n.attr, {"seq": seq})
            out = torch.empty_like(ref)
            lib["k"](*args, out, *[seq for _ in k.func.attrs["dayzero.scalar_symbols"]])
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def _fused(before: str, expected: str, count: int = 1) -> None:
    g = ir(before)
    after, found = fuse(g)
    assert found.patterns == ({"fused": count} if count else {})
    assert_ir(after, expected)
    if count:
        _check_numerics(g, after)


HEAD = "graph main symbols(seq in [1, 64]) {\n"


RMS_NORM = HEAD + """
      %0 = input {name="h"} : float32[1, seq, 64]
      %1 = weight {name="q_norm.weight"} : float32[16]
      %2 = weight {name="eps"} : float32[]
      %3 = view(%0) {size=[1, `seq`, -1, 16]} : float32[1, seq, 4, 16]
      %4 = pow.Tensor_Scalar(%3) {exponent=2} : float32[1, seq, 4, 16]
      %5 = mean.dim(%4) {dim=[-1], dtype=null, keepdim=true} : float32[1, seq, 4, 1]
      %6 = add.Tensor(%5, %2) {alpha=1} : float32[1, seq, 4, 1]
      %7 = rsqrt(%6) : float32[1, seq, 4, 1]
      %8 = mul.Tensor(%3, %7) : float32[1, seq, 4, 16]
      %9 = mul.Tensor(%1, %8) : float32[1, seq, 4, 16]
      return %9
    }
    """


def test_rms_norm_with_the_view_it_reads_is_one_kernel():
    """Qwen3's q_norm: a view of the projection, pow / mean / add eps / rsqrt / mul / mul by the weight."""
    _fused(RMS_NORM, HEAD + """
      %0 = input {name="h"} : float32[1, seq, 64]
      %1 = weight {name="q_norm.weight"} : float32[16]
      %2 = weight {name="eps"} : float32[]
      %3 = fused(%0, %2, %1) {body=[
        ["view", [0], [["size", [1, `seq`, -1, 16]]], "float32", [1, `seq`, 4, 16]],
        ["pow.Tensor_Scalar", [3], [["exponent", 2]], "float32", [1, `seq`, 4, 16]],
        ["mean.dim", [4], [["dim", [-1]], ["dtype", null], ["keepdim", true]], "float32", [1, `seq`, 4, 1]],
        ["add.Tensor", [5, 1], [["alpha", 1]], "float32", [1, `seq`, 4, 1]],
        ["rsqrt", [6], [], "float32", [1, `seq`, 4, 1]],
        ["mul.Tensor", [3, 7], [], "float32", [1, `seq`, 4, 16]],
        ["mul.Tensor", [2, 8], [], "float32", [1, `seq`, 4, 16]]]} : float32[1, seq, 4, 16]
      return %3
    }
    """)


SOFTMAX_BODY = """
      %0 = input {name="scores"} : float32[1, 4, seq, seq]
      %1 = input {name="mask"} : float32[1, 1, seq, seq]
      %2 = mul.Scalar(%0) {other=0.25} : float32[1, 4, seq, seq]
      %3 = add.Tensor(%2, %1) {alpha=1} : float32[1, 4, seq, seq]
      %4 = softmax.int(%3) {dim=-1, dtype=null} : float32[1, 4, seq, seq]
      %5 = _to_copy(%4) {dtype="bfloat16"} : bfloat16[1, 4, seq, seq]
      return %5
    }
    """


def test_softmax_with_its_scale_mask_prologue_and_cast_epilogue():
    _fused(HEAD + SOFTMAX_BODY, HEAD + """
      %0 = input {name="scores"} : float32[1, 4, seq, seq]
      %1 = input {name="mask"} : float32[1, 1, seq, seq]
      %2 = fused(%0, %1) {body=[
        ["mul.Scalar", [0], [["other", 0.25]], "float32", [1, 4, `seq`, `seq`]],
        ["add.Tensor", [2, 1], [["alpha", 1]], "float32", [1, 4, `seq`, `seq`]],
        ["softmax.int", [3], [["dim", -1], ["dtype", null]], "float32", [1, 4, `seq`, `seq`]],
        ["_to_copy", [4], [["dtype", "bfloat16"]], "bfloat16", [1, 4, `seq`, `seq`]]]} : bfloat16[1, 4, seq, seq]
      return %2
    }
    """)
    # the composed kernel keeps softmax's exp as a stage (MATERIALIZE) read by the sum and the output: inlined
    # like the other members, each element's exp was computed twice
    (node,) = [n for n in fuse(ir(HEAD + SOFTMAX_BODY))[0].nodes() if n.op == "fused"]
    assert program.make_prim_func(node, "k").script().count("T.exp(") == 1


GLU_HEAD = HEAD + """
  %0 = input {name="x"} : float32[seq, 64]
  %1 = weight {name="gate.weight"} : float32[128, 64]
  %2 = weight {name="up.weight"} : float32[128, 64]
  %3 = weight {name="down.weight"} : float32[64, 128]
  %4 = linear(%0, %1) {bias=false} : float32[seq, 128]
  %5 = linear(%0, %2) {bias=false} : float32[seq, 128]
"""


def test_silu_glu_between_the_projections():
    """silu(gate) * up: the two projections stay their own kernels, the gating is one."""
    _fused(GLU_HEAD + """
      %6 = silu(%4) : float32[seq, 128]
      %7 = mul.Tensor(%6, %5) : float32[seq, 128]
      %8 = linear(%7, %3) {bias=false} : float32[seq, 64]
      return %8
    }
    """, GLU_HEAD + """
      %6 = fused(%4, %5) {body=[["silu", [0], [], "float32", [`seq`, 128]],
                                ["mul.Tensor", [2, 1], [], "float32", [`seq`, 128]]]} : float32[seq, 128]
      %7 = linear(%6, %3) {bias=false} : float32[seq, 64]
      return %7
    }
    """)


def test_rotary_half_rotation_is_one_kernel():
    """q * cos + cat(-q[..., 8:], q[..., :8]) * sin: slices, neg, cat and the products in one kernel."""
    _fused(HEAD + """
      %0 = input {name="q"} : float32[1, 4, seq, 16]
      %1 = input {name="cos"} : float32[1, 1, seq, 16]
      %2 = input {name="sin"} : float32[1, 1, seq, 16]
      %3 = mul.Tensor(%0, %1) : float32[1, 4, seq, 16]
      %4 = slice.Tensor(%0) {dim=3, end=9223372036854775807, start=8, step=1} : float32[1, 4, seq, 8]
      %5 = neg(%4) : float32[1, 4, seq, 8]
      %6 = slice.Tensor(%0) {dim=3, end=8, start=0, step=1} : float32[1, 4, seq, 8]
      %7 = cat(%5, %6) {dim=-1, tensors=2} : float32[1, 4, seq, 16]
      %8 = mul.Tensor(%7, %2) : float32[1, 4, seq, 16]
      %9 = add.Tensor(%3, %8) {alpha=1} : float32[1, 4, seq, 16]
      return %9
    }
    """, HEAD + """
      %0 = input {name="q"} : float32[1, 4, seq, 16]
      %1 = input {name="cos"} : float32[1, 1, seq, 16]
      %2 = input {name="sin"} : float32[1, 1, seq, 16]
      %3 = fused(%0, %1, %2) {body=[
        ["mul.Tensor", [0, 1], [], "float32", [1, 4, `seq`, 16]],
        ["slice.Tensor", [0], [["dim", 3], ["end", 9223372036854775807], ["start", 8], ["step", 1]], "float32",
         [1, 4, `seq`, 8]],
        ["neg", [4], [], "float32", [1, 4, `seq`, 8]],
        ["slice.Tensor", [0], [["dim", 3], ["end", 8], ["start", 0], ["step", 1]], "float32", [1, 4, `seq`, 8]],
        ["cat", [5, 6], [["dim", -1], ["tensors", 2]], "float32", [1, 4, `seq`, 16]],
        ["mul.Tensor", [7, 2], [], "float32", [1, 4, `seq`, 16]],
        ["add.Tensor", [3, 8], [["alpha", 1]], "float32", [1, 4, `seq`, 16]]]} : float32[1, 4, seq, 16]
      return %3
    }
    """)


def test_elementwise_chain_is_one_kernel():
    _fused(HEAD + """
      %0 = input {name="a"} : float32[seq, 32]
      %1 = input {name="b"} : float32[seq, 32]
      %2 = add.Tensor(%0, %1) {alpha=1} : float32[seq, 32]
      %3 = tanh(%2) : float32[seq, 32]
      %4 = mul.Tensor(%3, %1) : float32[seq, 32]
      %5 = sigmoid(%4) : float32[seq, 32]
      return %5
    }
    """, HEAD + """
      %0 = input {name="a"} : float32[seq, 32]
      %1 = input {name="b"} : float32[seq, 32]
      %2 = fused(%0, %1) {body=[["add.Tensor", [0, 1], [["alpha", 1]], "float32", [`seq`, 32]],
                                ["tanh", [2], [], "float32", [`seq`, 32]],
                                ["mul.Tensor", [3, 1], [], "float32", [`seq`, 32]],
                                ["sigmoid", [4], [], "float32", [`seq`, 32]]]} : float32[seq, 32]
      return %2
    }
    """)


def test_a_value_read_by_two_groups_is_not_duplicated():
    """exp(x) feeds an element-wise op and a projection: it is materialised once, so neither side fuses it; a
    graph output in the middle of a chain is materialised too."""
    before = HEAD + """
      %0 = input {name="x"} : float32[seq, 64]
      %1 = weight {name="w"} : float32[64, 64]
      %2 = exp(%0) : float32[seq, 64]
      %3 = neg(%2) : float32[seq, 64]
      %4 = linear(%2, %1) {bias=false} : float32[seq, 64]
      %5 = tanh(%4) : float32[seq, 64]
      %6 = sigmoid(%5) : float32[seq, 64]
      return %3, %5, %6
    }
    """
    _fused(before, before, count=0)


def test_a_second_reduction_does_not_join_a_group_that_has_one():
    """Variance (mean of (x - mean x)^2): the inner mean stays its own kernel; the outer one takes the sub / pow
    prologue and the scale epilogue."""
    _fused(HEAD + """
      %0 = input {name="x"} : float32[seq, 64]
      %1 = mean.dim(%0) {dim=[-1], dtype=null, keepdim=true} : float32[seq, 1]
      %2 = sub.Tensor(%0, %1) {alpha=1} : float32[seq, 64]
      %3 = pow.Tensor_Scalar(%2) {exponent=2} : float32[seq, 64]
      %4 = mean.dim(%3) {dim=[-1], dtype=null, keepdim=true} : float32[seq, 1]
      %5 = mul.Scalar(%4) {other=2.0} : float32[seq, 1]
      return %5
    }
    """, HEAD + """
      %0 = input {name="x"} : float32[seq, 64]
      %1 = mean.dim(%0) {dim=[-1], dtype=null, keepdim=true} : float32[seq, 1]
      %2 = fused(%0, %1) {body=[
        ["sub.Tensor", [0, 1], [["alpha", 1]], "float32", [`seq`, 64]],
        ["pow.Tensor_Scalar", [2], [["exponent", 2]], "float32", [`seq`, 64]],
        ["mean.dim", [3], [["dim", [-1]], ["dtype", null], ["keepdim", true]], "float32", [`seq`, 1]],
        ["mul.Scalar", [4], [["other", 2.0]], "float32", [`seq`, 1]]]} : float32[seq, 1]
      return %2
    }
    """)


@pytest.mark.parametrize("bad, why", [
    ([["rsqrt", [5], [], "float32", ["seq", 32]]], "not defined before it"),
    ([["no_such_op", [0], [], "float32", ["seq", 32]]], "unknown op"),
])
def test_the_verifier_refuses_a_malformed_body(bad, why):
    from dayzero.passes.ir.node import Node, TensorType
    from dayzero.passes.ir.shape_expr import make_symbol
    from dayzero.passes.ir.verify import VerifyError, verify

    seq = make_symbol("seq")
    x = Node.make("input", (), {"name": "x"}, [TensorType("float32", (seq, 32))])
    body = tuple((op, tuple(a), (), dt, tuple(seq if d == "seq" else d for d in shp)) for op, a, _, dt, shp in bad)
    n = Node.make("fused", (x,), {"body": body}, [TensorType("float32", (seq, 32))])
    with pytest.raises(VerifyError, match=why):
        verify(Graph("main", (x,), (n,), (("seq", 1, 64),)))


def test_a_layer_output_stays_a_value():
    """The last residual add of decoder layer 1, read only by the final norm (outside the layers), is not fused
    into the norm: the layer's output stays a value of its own (``compare --streamed`` reads it)."""
    before = HEAD + """
      %0 = input {name="h"} : float32[seq, 64]
      %1 = input {name="r"} : float32[seq, 64]
      %2 = add.Tensor(%0, %1) {alpha=1} : float32[seq, 64] loc("model.layers.1", "m.py:9", "layers", 1)
      %3 = pow.Tensor_Scalar(%2) {exponent=2} : float32[seq, 64] loc("model.norm", "m.py:5")
      %4 = mean.dim(%3) {dim=[-1], dtype=null, keepdim=true} : float32[seq, 1] loc("model.norm", "m.py:5")
      %5 = rsqrt(%4) : float32[seq, 1] loc("model.norm", "m.py:6")
      %6 = mul.Tensor(%2, %5) : float32[seq, 64] loc("model.norm", "m.py:6")
      return %6
    }
    """
    _fused(before, HEAD + """
      %0 = input {name="h"} : float32[seq, 64]
      %1 = input {name="r"} : float32[seq, 64]
      %2 = add.Tensor(%0, %1) {alpha=1} : float32[seq, 64] loc("model.layers.1", "m.py:9", "layers", 1)
      %3 = fused(%2) {body=[
        ["pow.Tensor_Scalar", [0], [["exponent", 2]], "float32", [`seq`, 64]],
        ["mean.dim", [1], [["dim", [-1]], ["dtype", null], ["keepdim", true]], "float32", [`seq`, 1]],
        ["rsqrt", [2], [], "float32", [`seq`, 1]],
        ["mul.Tensor", [0, 3], [], "float32", [`seq`, 64]]]} : float32[seq, 64] loc("model.norm", "m.py:6")
      return %3
    }
    """)


def test_fused_kernels_compile_for_cuda_sm90():
    """The fused kernel goes through dlight's GPU rules like any other (compiled here; run on the lent GPU)."""
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    after, _ = fuse(ir(RMS_NORM))
    (n,) = [m for m in after.nodes() if m.op == "fused"]
    k = program.Kernel("k", n.op, program.make_prim_func(n, "k"), "", node=n)
    mod = schedule.schedule_kernel(k, target, None, {"seq": (1, 64)})
    assert k.route == "default"
    lib = tvm.compile(tvm.IRModule({"k": mod["main"].with_attr("global_symbol", "k")}), target=target)
    assert "rsqrt" in lib.mod.imports[0].inspect_source()


def test_views_between_symbolic_dims_index_without_a_symbolic_modulo():
    """[batch, 4, seq, 16] viewed as [4*batch, seq, 16] and back (attention's head split / merge under a symbolic
    batch): the outermost index of a view is what is left of the flat index, so no modulo by a symbolic extent
    reaches the kernel (LLVM took 80 s on one such rotary kernel of an ONNX LLM with symbolic batch and seq)."""
    before = ir("""graph main symbols(batch in [1, 8], seq in [1, 64]) {
      %0 = input {name="q"} : float32[batch, 4, seq, 16]
      %1 = view(%0) {size=[-1, `seq`, 16]} : float32[`4*batch`, seq, 16]
      %2 = neg(%1) : float32[`4*batch`, seq, 16]
      %3 = view(%2) {size=[`batch`, 4, `seq`, 16]} : float32[batch, 4, seq, 16]
      %4 = mul.Tensor(%3, %0) : float32[batch, 4, seq, 16]
      return %4
    }
    """)
    after, found = fuse(before)
    assert found.patterns == {"fused": 1}
    (n,) = [m for m in after.nodes() if m.op == "fused"]
    func = program.make_prim_func(n, "k")
    text = func.script()
    assert "% T.int64(4)" in text  # the head index within a row of four
    assert not re.search(r"(%|//) \(?batch", text), text  # no modulo or division by the symbolic batch
    target = tvm.target.Target(host_target_dict())
    k = program.Kernel("k", n.op, func, "", node=n)
    mod = schedule.schedule_kernel(k, target, None, {s: (lo, hi) for s, lo, hi in after.symbols})
    lib = tvm.compile(tvm.IRModule({"k": mod["main"].with_attr("global_symbol", "k")}), target=target)
    q = torch.randn(3, 4, 5, 16)
    out = torch.empty_like(q)
    lib["k"](q, out, *[{"batch": 3, "seq": 5}[s] for s in k.func.attrs["dayzero.scalar_symbols"]])
    torch.testing.assert_close(out, -q * q, rtol=0, atol=0)
