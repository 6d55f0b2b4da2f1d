"""The typed ``dequant`` op the frontend's low-precision binding emits (passes/dequant.py): its reference and its
lowering equal lowprec's dequantisers bit for bit, and it fuses into the same kernels as the ATen chain that a graph
arriving without the binding holds."""

import pytest
import torch
import tvm

from dayzero.codegen import program
from dayzero.frontend import lowprec
from dayzero.passes import dequant as dq
from dayzero.passes.ir.node import Graph, Node, Span, TensorType, rewrite
from dayzero.passes.ir.reference_dequant import dequant_reference
from dayzero.tools.compiler import run_pipeline

from _dequant_chain import dequant_graph

CASES = {  # name -> (format, stored fp32 shape, block, transposed)
    "mxfp4": ("mxfp4", (3, 8, 64), 32, False),
    "mxfp4_in_major": ("mxfp4", (3, 8, 64), 32, True),
    "fp8_row_block_16": ("fp8", (2, 40, 200), (16, 128), False),
}


def _stored(fmt, shape, block, seed=0):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return lowprec.quantize_mxfp4(w) if fmt == "mxfp4" else lowprec.quantize_fp8_block(w, block)


def _expected(fmt, data, scale, block, transposed):
    w = lowprec.dequant_mxfp4(data, scale) if fmt == "mxfp4" else lowprec.dequant_fp8_block(data, scale, block)
    return (w.transpose(-1, -2) if transposed else w).contiguous()


def _typed(fmt, data_t, scale_t, block, transposed, out_shape):
    data = Node.make("weight", (), {"name": "w.data"}, [TensorType(*data_t)])
    scale = Node.make("weight", (), {"name": "w.scale"}, [TensorType(*scale_t)])
    return Node.make(dq.OP_DEQUANT, (data, scale), {"format": fmt, "block": block, "transposed": transposed,
                                                   "out_dtype": "float32"}, [TensorType("float32", out_shape)])


def _types(data, scale):
    from dayzero.passes.ir.ops import dtype_name

    return (dtype_name(data.dtype), tuple(data.shape)), (dtype_name(scale.dtype), tuple(scale.shape))


@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_and_lowering_equal_lowprec_bit_for_bit(case):
    fmt, shape, block, transposed = CASES[case]
    data, scale = _stored(fmt, shape, block)
    want = _expected(fmt, data, scale, block, transposed)
    attrs = {"format": fmt, "block": block, "transposed": transposed, "out_dtype": "float32"}
    got = dequant_reference([data, scale], attrs)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    meta = dequant_reference([data.to("meta"), scale.to("meta")], attrs)
    assert meta.shape == want.shape and meta.dtype == torch.float32
    # the lowering of the op alone (no consumer fused it)
    n = _typed(fmt, *_types(data, scale), block, transposed, tuple(want.shape))
    ins = [Node.make("input", (), {"name": f"x{k}"}, [t]) for k, t in enumerate((n.inputs[0].type,
                                                                                   n.inputs[1].type))]
    f = program.make_prim_func(n.replace(inputs=tuple(ins)), "k")
    lib = tvm.compile(tvm.IRModule({"k": f}), target={"kind": "llvm"})
    out = torch.empty_like(want)
    stored = data.view(torch.uint8) if data.dtype == torch.float8_e4m3fn else data
    lib["k"](stored.contiguous() if fmt == "mxfp4" else data.contiguous(), scale.contiguous(), out)
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
def test_typed_op_and_aten_chain_meet_in_the_same_fused_linear(fmt):
    """linear(x, W) with W the typed op (the frontend's binding) or the ATen chain (ONNX, user modules): the
    dequant pass makes the same dequant_linear node, reading the same stored tensors."""
    N, K, T = (200, 256, 3) if fmt == "fp8" else (48, 64, 3)
    if fmt == "mxfp4":
        data_t, scale_t, block = ("uint8", (N, K // 32, 16)), ("uint8", (N, K // 32)), 32
    else:
        data_t, scale_t, block = ("float8_e4m3fn", (N, K)), ("float32", (-(-N // 128), -(-K // 128))), (128, 128)
    sub = dequant_graph(fmt, False, data_t, scale_t)
    typed = _typed(fmt, data_t, scale_t, block, False, (N, K))
    bind = {"blocks": typed.inputs[0], "weight": typed.inputs[0], "scales": typed.inputs[1],
            "scale_inv": typed.inputs[1]}
    chain = rewrite(sub, lambda m: bind[m.attr["name"]] if m.op == "input" else None).outputs[0]
    x = Node.make("input", (), {"name": "x"}, [TensorType("float32", (T, K))])
    fused = []
    for w in (typed, chain):
        y = Node.make("linear", (x, w), {"bias": False}, [TensorType("float32", (T, N))], Span("proj", "test"))
        g, found = run_pipeline(Graph("main", (x,), (y,)), verify=True)
        assert found.patterns.get("dequant.linear") == 1
        (node,) = [n for n in g.nodes() if n.op.startswith("dequant_linear")]
        assert not [n for n in g.nodes() if n.op == dq.OP_DEQUANT]
        fused.append((node.op, node.attrs, [i.attr.get("name") for i in node.inputs]))
    assert fused[0] == fused[1] and fused[0][0] == f"dequant_linear_{fmt}"


def test_typed_op_verifies_and_its_text_form_round_trips():
    from dayzero.passes.ir.node import structurally_equal
    from dayzero.passes.ir.text import parse_graph, print_graph
    from dayzero.passes.ir.verify import verify

    n = _typed("fp8", ("float8_e4m3fn", (40, 200)), ("float32", (3, 2)), (16, 128), False, (40, 200))
    g = Graph("main", (), (n,))
    verify(g)
    assert structurally_equal(parse_graph(print_graph(g)), g)
