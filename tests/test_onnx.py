"""The ONNX frontend, as a specification: models exported or written as ONNX compile through the shared pipeline and
match onnxruntime (fp32: max |diff| <= 1e-4 x max |reference|), with symbolic batch and sequence dims served by one
artifact; 4-bit block-quantised weights become an explicit dequant subgraph; unsupported operators are all named
in one error."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from dayzero import UnsupportedOpsError
from dayzero.frontend.onnx.importer import trace_onnx
from dayzero.passes.ir.verify import verify
from dayzero.runtime.executor import load
from dayzero.tools.driver import compile_model
from dayzero.tools.onnx_reference import reference_outputs

TOL = 1e-4


def _inputs(model_path, shapes, seed=0):
    m = onnx.load(str(model_path), load_external_data=False)
    rng = np.random.default_rng(seed)
    out = {}
    for vi, shape in zip(m.graph.input, shapes):
        if vi.type.tensor_type.elem_type == TensorProto.INT64:
            out[vi.name] = rng.integers(0, 256, shape).astype(np.int64)
        else:
            out[vi.name] = rng.standard_normal(shape).astype(np.float32)
    return out


def _check(model_path, art, shape_sets):
    rt = load(art)
    for shapes in shape_sets:
        ins = _inputs(model_path, shapes)
        got = rt.run(*ins.values())
        ref = reference_outputs(model_path, ins)
        assert len(got) == len(ref)
        for g, r in zip(got, ref):
            assert tuple(g.shape) == r.shape, shapes
            scale = max(float(np.abs(r).max()), 1e-6)
            assert float(np.abs(g.numpy().astype(np.float64) - r).max()) <= TOL * scale, shapes


def _export(module, args, path, dynamic_shapes, input_names):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, str(path), dynamo=True, dynamic_shapes=dynamic_shapes,
                          input_names=input_names, verbose=False)
    return path


class SmallCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.c2 = torch.nn.Conv2d(8, 16, 3, stride=2, padding=1, groups=2)
        self.inorm = torch.nn.InstanceNorm2d(16, affine=True)
        self.fc = torch.nn.Linear(16, 10)

    def forward(self, x):
        x = torch.relu(self.bn(self.c1(x)))
        x = torch.nn.functional.max_pool2d(x, 2)
        x = torch.nn.functional.gelu(self.inorm(self.c2(x)))
        x = torch.nn.functional.avg_pool2d(x, 2)
        x = torch.nn.functional.adaptive_avg_pool2d(x, 1).flatten(1)
        return torch.softmax(self.fc(x), -1)


@pytest.mark.slow
def test_small_cnn_matches_onnxruntime_at_several_batch_sizes(tmp_path):
    torch.manual_seed(0)
    cnn = SmallCNN().eval()
    with torch.no_grad():  # non-trivial batch-norm statistics
        cnn.bn.running_mean.uniform_(-0.5, 0.5)
        cnn.bn.running_var.uniform_(0.5, 2.0)
    batch = torch.export.Dim("batch", min=1, max=8)
    path = _export(cnn, (torch.randn(2, 3, 16, 16),), tmp_path / "cnn.onnx", {"x": {0: batch}}, ["x"])
    compile_model(str(path), tmp_path / "art", max_seq=64, verify=True)
    _check(path, tmp_path / "art", [[(1, 3, 16, 16)], [(3, 3, 16, 16)], [(8, 3, 16, 16)]])


@pytest.mark.slow
def test_tiny_llm_from_transformers_matches_onnxruntime_with_symbolic_batch_and_seq(tmp_path):
    from dayzero.tools.examples import tiny_dense

    module, _ = tiny_dense()
    batch = torch.export.Dim("batch", min=1, max=8)
    seq = torch.export.Dim("seq", min=1, max=64)
    ids = torch.randint(0, 256, (2, 8))
    path = _export(module, (ids,), tmp_path / "llm.onnx", {"input_ids": {0: batch, 1: seq}}, ["input_ids"])
    fe = trace_onnx(str(path), 64)
    g = fe.traced.graph
    assert [s for s, _, _ in g.symbols] == ["batch", "seq"]
    assert {n.op for n in g.nodes()} >= {"embedding", "matmul", "softmax.int"}
    assert all(n.span.module and "(opset" in n.span.source for n in g.nodes() if n.op not in ("input", "weight"))
    compile_model(str(path), tmp_path / "art", max_seq=64, verify=True)
    # one artifact, several (batch, seq)
    _check(path, tmp_path / "art", [[(1, 1)], [(1, 7)], [(2, 5)], [(3, 33)]])


# ---- hand-written models (onnx.helper) -----------------------------------------------------------------------

def _save(graph, path, opset=21, extra_opsets=()):
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), *extra_opsets])
    model.ir_version = 10
    onnx.save(model, str(path))
    return path


def _pack_uint4(vals: np.ndarray) -> np.ndarray:
    """[..., 2n] values in [0, 15] -> [..., n] bytes, low nibble first."""
    v = vals.astype(np.uint8)
    return (v[..., 0::2] | (v[..., 1::2] << 4)).astype(np.uint8)


def _matmul_nbits_model(path, zero_points: bool):
    K, N, bs = 64, 24, 16
    nb = K // bs
    rng = np.random.default_rng(1)
    q = rng.integers(0, 16, (N, nb, bs))
    scales = (rng.random((N * nb,)) * 0.1 + 0.01).astype(np.float32)
    inits = [helper.make_tensor("B", TensorProto.UINT8, [N, nb, bs // 2], _pack_uint4(q).tobytes(), raw=True),
             helper.make_tensor("scales", TensorProto.FLOAT, [N * nb], scales)]
    node_inputs = ["A", "B", "scales"]
    if zero_points:
        z = rng.integers(0, 16, (N, nb))
        inits.append(helper.make_tensor("zp", TensorProto.UINT8, [N * nb // 2], _pack_uint4(z).reshape(-1).tobytes(),
                                        raw=True))
        node_inputs.append("zp")
    node = helper.make_node("MatMulNBits", node_inputs, ["Y0"], domain="com.microsoft", name="qproj",
                            K=K, N=N, bits=4, block_size=bs)
    act = helper.make_node("Relu", ["Y0"], ["Y"], name="act")
    graph = helper.make_graph(
        [node, act], "nbits",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["batch", "seq", K])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", "seq", N])], inits)
    return _save(graph, path, extra_opsets=[helper.make_opsetid("com.microsoft", 1)])


def _dequantize_linear_model(path):
    """MatMul(A, DequantizeLinear(W int4 [K, N], scale [K/bs, N], block_size=bs, axis=0))."""
    K, N, bs = 64, 16, 32
    rng = np.random.default_rng(2)
    w = rng.integers(-8, 8, (K, N))
    scale = (rng.random((K // bs, N)) * 0.1 + 0.01).astype(np.float32)
    inits = [helper.make_tensor("W", TensorProto.INT4, [K, N], w.reshape(-1).tolist()),
             helper.make_tensor("W_scale", TensorProto.FLOAT, [K // bs, N], scale)]
    nodes = [helper.make_node("DequantizeLinear", ["W", "W_scale"], ["Wf"], name="dq", axis=0, block_size=bs),
             helper.make_node("MatMul", ["A", "Wf"], ["Y"], name="mm")]
    graph = helper.make_graph(
        nodes, "dq_block", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["batch", "seq", K])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", "seq", N])], inits)
    return _save(graph, path, opset=21)


@pytest.mark.slow
@pytest.mark.parametrize("zero_points", [False, True])
def test_matmul_nbits_becomes_an_explicit_dequant_subgraph_and_matches_onnxruntime(tmp_path, zero_points):
    path = _matmul_nbits_model(tmp_path / "nbits.onnx", zero_points)
    g = trace_onnx(str(path), 16).traced.graph
    verify(g)
    ops = [n.op for n in g.nodes()]
    # packed bytes stay packed in the graph: unpacked by ATen bit ops, scaled per block, feeding linear
    assert {"bitwise_and.Tensor", "bitwise_right_shift.Tensor", "_to_copy", "mul.Tensor", "linear"} <= set(ops)
    packed = [n for n in g.nodes() if n.op == "weight" and n.attr["name"] == "B"]
    assert packed and packed[0].dtype == "uint8"
    compile_model(str(path), tmp_path / "art", max_seq=16, verify=True)
    _check(path, tmp_path / "art", [[(1, 3, 64)], [(2, 16, 64)]])


@pytest.mark.slow
def test_blocked_dequantize_linear_int4_matches_onnxruntime(tmp_path):
    path = _dequantize_linear_model(tmp_path / "dq.onnx")
    g = trace_onnx(str(path), 16).traced.graph
    weights = {n.attr["name"]: n for n in g.nodes() if n.op == "weight"}
    assert weights["W.packed"].dtype == "uint8" and weights["W.packed"].shape == (64 * 16 // 2,)
    assert "matmul" in {n.op for n in g.nodes()}
    compile_model(str(path), tmp_path / "art", max_seq=16, verify=True)
    _check(path, tmp_path / "art", [[(1, 5, 64)], [(3, 16, 64)]])


def test_external_data_files_load(tmp_path):
    path = _matmul_nbits_model(tmp_path / "inline.onnx", zero_points=True)
    ext = tmp_path / "ext" / "model.onnx"
    ext.parent.mkdir()
    onnx.save(onnx.load(str(path)), str(ext), save_as_external_data=True, all_tensors_to_one_file=True,
              location="weights.bin", size_threshold=0)
    assert (ext.parent / "weights.bin").is_file()
    a, b = trace_onnx(str(path), 16).traced, trace_onnx(str(ext), 16).traced
    assert a.weights.keys() == b.weights.keys()
    assert all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights)


def _mixed_ops_model(path):
    """LayerNormalization, RMSNormalization, Attention (opset 23, GQA, causal), TopK, Where, Cast, Split, Concat,
    Expand, reductions, Range/Shape/Gather/ConstantOfShape shape arithmetic over symbolic batch and seq."""
    D, H, Hk = 32, 4, 2
    rng = np.random.default_rng(3)

    def w(name, *shape):
        return helper.make_tensor(name, TensorProto.FLOAT, list(shape), rng.standard_normal(shape).astype(np.float32)
                                  * 0.2)
    inits = [w("ln_w", D), w("ln_b", D), w("rms_w", D), w("Wq", D, D), w("Wk", D, D // 2), w("Wv", D, D // 2),
             helper.make_tensor("k", TensorProto.INT64, [1], [3]),
             helper.make_tensor("one", TensorProto.INT64, [], [1]),
             helper.make_tensor("zero", TensorProto.INT64, [], [0]),
             helper.make_tensor("axes0", TensorProto.INT64, [1], [0]),
             helper.make_tensor("axes_last", TensorProto.INT64, [1], [-1]),
             helper.make_tensor("split", TensorProto.INT64, [2], [D // 2, D // 2])]
    n = helper.make_node
    nodes = [
        n("LayerNormalization", ["x", "ln_w", "ln_b"], ["ln"], name="ln", axis=-1, epsilon=1e-5),
        n("RMSNormalization", ["ln", "rms_w"], ["h"], name="rms", axis=-1, epsilon=1e-6),
        n("MatMul", ["h", "Wq"], ["q"], name="q_proj"),
        n("MatMul", ["h", "Wk"], ["kk"], name="k_proj"),
        n("MatMul", ["h", "Wv"], ["vv"], name="v_proj"),
        n("Attention", ["q", "kk", "vv"], ["att"], name="attn", is_causal=1, q_num_heads=H, kv_num_heads=Hk),
        n("Split", ["att", "split"], ["a0", "a1"], name="split", axis=-1),
        n("Sigmoid", ["a1"], ["g"], name="gate"),
        n("Mul", ["a0", "g"], ["glu"], name="glu"),
        n("TopK", ["glu", "k"], ["tv", "ti"], name="topk", axis=-1),
        n("Cast", ["ti"], ["tif"], name="cast", to=TensorProto.FLOAT),
        n("ReduceSum", ["tv", "axes_last"], ["rs"], name="rsum", keepdims=1),
        n("ReduceMax", ["glu", "axes_last"], ["rm"], name="rmax", keepdims=1),
        n("Greater", ["rs", "rm"], ["gt"], name="gt"),
        n("Where", ["gt", "rs", "rm"], ["wh"], name="where"),
        # position ids from the symbolic seq length: Shape -> Gather -> Range -> Cast -> Unsqueeze -> Expand
        n("Shape", ["x"], ["xs"], name="shape"),
        n("Gather", ["xs", "one"], ["seqlen"], name="seqlen", axis=0),
        n("Range", ["zero", "seqlen", "one"], ["pos"], name="range"),
        n("Cast", ["pos"], ["posf"], name="posf", to=TensorProto.FLOAT),
        n("Unsqueeze", ["posf", "axes_last"], ["pos2"], name="pos2"),
        n("Concat", ["tif", "tv", "wh"], ["cat"], name="cat", axis=-1),
        n("Add", ["cat", "pos2"], ["y0"], name="add_pos"),
        n("Softmax", ["y0"], ["y"], name="softmax", axis=-1),
    ]
    graph = helper.make_graph(nodes, "mixed", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                             ["batch", "seq", D])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return _save(graph, path, opset=23)


@pytest.mark.slow
def test_mixed_llm_ops_opset23_match_onnxruntime(tmp_path):
    path = _mixed_ops_model(tmp_path / "mixed.onnx")
    g = trace_onnx(str(path), 32).traced.graph
    ops = {n.op for n in g.nodes()}
    assert {"layer_norm", "rsqrt", "scaled_dot_product_attention", "topk", "where.self", "arange.start_step"} <= ops
    compile_model(str(path), tmp_path / "art", max_seq=32, verify=True)
    _check(path, tmp_path / "art", [[(1, 1, 32)], [(2, 9, 32)]])


def test_unsupported_operators_are_all_listed_with_node_name_and_opset(tmp_path):
    n = helper.make_node
    nodes = [n("Det", ["x"], ["d"], name="the_det"), n("Relu", ["x"], ["r"], name="fine"),
             n("NonZero", ["r"], ["nz"], name="the_nonzero")]
    graph = helper.make_graph(nodes, "bad", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])],
                              [helper.make_tensor_value_info("d", TensorProto.FLOAT, []),
                               helper.make_tensor_value_info("nz", TensorProto.INT64, None)])
    path = _save(graph, tmp_path / "bad.onnx", opset=21)
    with pytest.raises(UnsupportedOpsError) as e:
        compile_model(str(path), tmp_path / "art", max_seq=16)
    msg = str(e.value)
    assert "Det" in msg and "the_det" in msg and "NonZero" in msg and "the_nonzero" in msg and "opset 21" in msg
    assert not (tmp_path / "art").exists()


def test_test_data_sets_next_to_the_model_are_the_reference(tmp_path):
    path = _matmul_nbits_model(tmp_path / "model.onnx", zero_points=False)
    ins = _inputs(path, [(1, 2, 64)])
    ref = reference_outputs(path, ins)
    d = tmp_path / "test_data_set_0"
    d.mkdir()
    (d / "input_0.pb").write_bytes(onnx.numpy_helper.from_array(ins["A"], "A").SerializeToString())
    (d / "output_0.pb").write_bytes(onnx.numpy_helper.from_array(ref[0], "Y").SerializeToString())
    from dayzero.tools.onnx_reference import test_data_inputs
    assert np.array_equal(test_data_inputs(path)["A"], ins["A"])
    assert np.array_equal(reference_outputs(path, {})[0], ref[0])


def _lrn_model(path, size):
    """Conv -> LRN (AlexNet / GoogLeNet / Inception's local response normalisation across channels) -> Relu, with a
    symbolic batch."""
    rng = np.random.default_rng(4)
    w = helper.make_tensor("W", TensorProto.FLOAT, [7, 3, 3, 3], rng.standard_normal((7, 3, 3, 3)).astype(np.float32))
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("LRN", ["c"], ["l"], name="lrn", size=size, alpha=0.3, beta=0.75, bias=2.0),
             helper.make_node("Relu", ["l"], ["y"], name="relu")]
    graph = helper.make_graph(nodes, "lrn", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                           ["batch", 3, 6, 5])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])
    return _save(graph, path, opset=13)


@pytest.mark.parametrize("size", [5, 3, 1])  # onnxruntime refuses an even size
def test_lrn_matches_onnxruntime(tmp_path, size):
    path = _lrn_model(tmp_path / "lrn.onnx", size)
    compile_model(str(path), tmp_path / "art", max_seq=16, verify=True)
    _check(path, tmp_path / "art", [[(1, 3, 6, 5)], [(3, 3, 6, 5)]])


def test_readme_lists_exactly_the_converted_operators():
    """The README's operator list is the converter tables (a converter added or removed shows up there)."""
    from pathlib import Path

    from dayzero.frontend.onnx.converters import CONTRIB, HANDLERS

    text = " ".join((Path(__file__).parents[1] / "README.md").read_text().split())
    listed = text.split("ONNX operators the importer converts")[1].split("compiled): ")[1].split(". ")[0]
    core, contrib = listed.split("; from `com.microsoft`: ")
    assert set(core.split(", ")) == set(HANDLERS) and set(contrib.split(", ")) == set(CONTRIB)
