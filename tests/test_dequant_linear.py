"""Dequantised weights feeding a dense linear, as a specification.

- ONNX 4-bit block-quantised matmuls (``MatMulNBits`` with and without zero points, blocked ``DequantizeLinear``
  int4 and uint4 + zero point) compile with the dequant pattern firing into ``dequant_linear_int4``, whose kernel
  takes the hand-scheduled route, and match onnxruntime (fp32, max |diff| <= 1e-4 x max |reference|) at several
  (batch, seq) from one artifact.
- FP8-block (DeepSeek layout) and MXFP4 chains feeding ``linear`` (and ``matmul`` through the transposed chain)
  fuse into ``dequant_linear_fp8`` / ``dequant_linear_mxfp4``; the fused graph computes what the chain did.
- Every kernel (int4 in both layouts, both block axes, signed / zero point; fp8 with partial edge blocks; mxfp4)
  matches its torch reference: decode GEMV (static T) and prefill GEMM (symbolic T, run at several T); they also
  compile for CUDA sm_90.
- A chain with a wrong bit layout (swapped nibbles, a mask of 7, a shift of 3) or without its scale multiply is
  left alone.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import tvm
from onnx import TensorProto, helper

from dayzero.codegen.kernels import dequant_linear as kl
from dayzero.frontend import lowprec
from dayzero.frontend.onnx.importer import trace_onnx
from dayzero.passes.ir import interp
from dayzero.passes.ir import reference_dequant as rd
from dayzero.passes.ir.node import Graph, Node, Span, TensorType, rewrite
from dayzero.passes.ir.text import make_symbol, parse_graph, print_graph
from dayzero.tools.compiler import run_pipeline
from dayzero.runtime.executor import load
from dayzero.targets.capabilities import int4_storage
from dayzero.targets.host import cuda_target_dict, host_target_dict
from dayzero.tools.driver import compile_model
from dayzero.tools.onnx_reference import reference_outputs

from _dequant_chain import dequant_graph

TOL = 1e-4
HOST = host_target_dict()


# ---- ONNX models (onnx.helper) -------------------------------------------------------------------------------

def _pack(vals: np.ndarray) -> np.ndarray:
    v = vals.astype(np.uint8).reshape(-1)
    return (v[0::2] | (v[1::2] << 4)).astype(np.uint8)


def _save(nodes, inits, path, K, N, opset=21, contrib=False):
    graph = helper.make_graph(nodes, "q", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["batch", "seq", K])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", "seq", N])], inits)
    imports = [helper.make_opsetid("", opset)] + ([helper.make_opsetid("com.microsoft", 1)] if contrib else [])
    model = helper.make_model(graph, opset_imports=imports)
    model.ir_version = 10
    onnx.save(model, str(path))
    return path


def matmul_nbits(path, zero_points: bool, K=128, N=48, bs=32):
    rng = np.random.default_rng(1)
    nb = K // bs
    q = rng.integers(0, 16, (N, nb, bs))
    inits = [helper.make_tensor("B", TensorProto.UINT8, [N, nb, bs // 2], _pack(q).tobytes(), raw=True),
             helper.make_tensor("scales", TensorProto.FLOAT, [N * nb],
                                (rng.random(N * nb) * 0.1 + 0.01).astype(np.float32))]
    ins = ["A", "B", "scales"]
    if zero_points:
        inits.append(helper.make_tensor("zp", TensorProto.UINT8, [N * nb // 2],
                                        _pack(rng.integers(0, 16, (N, nb))).tobytes(), raw=True))
        ins.append("zp")
    nodes = [helper.make_node("MatMulNBits", ins, ["Y"], domain="com.microsoft", name="qproj", K=K, N=N, bits=4,
                              block_size=bs)]
    return _save(nodes, inits, path, K, N, contrib=True)


def dequantize_linear(path, signed: bool, zero_points: bool, K=128, N=32, bs=32):
    rng = np.random.default_rng(2)
    lo, hi, ty = (-8, 8, TensorProto.INT4) if signed else (0, 16, TensorProto.UINT4)
    inits = [helper.make_tensor("W", ty, [K, N], rng.integers(lo, hi, (K, N)).reshape(-1).tolist()),
             helper.make_tensor("W_scale", TensorProto.FLOAT, [K // bs, N],
                                (rng.random((K // bs, N)) * 0.1 + 0.01).astype(np.float32))]
    ins = ["W", "W_scale"]
    if zero_points:
        inits.append(helper.make_tensor("W_zp", ty, [K // bs, N], rng.integers(lo, hi, (K // bs, N)).reshape(-1)
                                        .tolist()))
        ins.append("W_zp")
    nodes = [helper.make_node("DequantizeLinear", ins, ["Wf"], name="dq", axis=0, block_size=bs),
             helper.make_node("MatMul", ["A", "Wf"], ["Y"], name="mm")]
    return _save(nodes, inits, path, K, N)


ONNX_CASES = {
    "nbits": lambda p: matmul_nbits(p, zero_points=False),
    "nbits_zp": lambda p: matmul_nbits(p, zero_points=True),
    "dq_int4": lambda p: dequantize_linear(p, signed=True, zero_points=False),
    "dq_uint4_zp": lambda p: dequantize_linear(p, signed=False, zero_points=True),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(ONNX_CASES))
def test_onnx_4bit_matmul_fuses_and_matches_onnxruntime(tmp_path, case):
    path = ONNX_CASES[case](tmp_path / "q.onnx")
    fe = trace_onnx(str(path), 16)
    g, found = run_pipeline(fe.traced.graph, verify=True)
    assert found.patterns.get("dequant.linear") == 1
    assert [n.op for n in g.nodes() if n.op.startswith("dequant_linear")] == ["dequant_linear_int4"]
    assert not {"bitwise_and.Tensor", "cat", "mul.Tensor", "linear", "matmul"} & {n.op for n in g.nodes()}
    report = compile_model(str(path), tmp_path / "art", max_seq=16, verify=True)
    assert report["patterns"]["dequant.linear"] == 1
    fused = [k for k, op in report["kernel_ops"].items() if op == "dequant_linear_int4"]
    assert fused and all(report["routes"][k] == "hand-scheduled" for k in fused)
    rt = load(tmp_path / "art")  # one artifact, several (batch, seq)
    rng = np.random.default_rng(0)
    for shape in [(1, 1), (1, 5), (3, 16), (8, 16)]:
        a = rng.standard_normal((*shape, 128)).astype(np.float32)
        got = rt.run(a)[0].numpy()
        ref = reference_outputs(path, {"A": a})[0]
        assert got.shape == ref.shape
        assert np.abs(got.astype(np.float64) - ref).max() <= TOL * max(np.abs(ref).max(), 1e-6), (case, shape)


# ---- negative: chains that differ in a checked detail are left alone -----------------------------------------

def _nbits_text(tmp_path) -> str:
    fe = trace_onnx(str(matmul_nbits(tmp_path / "n.onnx", zero_points=True)), 16)
    return print_graph(fe.traced.graph)


def _fires(text: str) -> bool:
    g, found = run_pipeline(parse_graph(text), verify=True)
    return bool(found.patterns.get("dequant.linear")) or any(n.op.startswith("dequant_linear") for n in g.nodes())


def test_chain_with_wrong_bit_layout_or_missing_scale_is_left_alone(tmp_path):
    text = _nbits_text(tmp_path)
    assert _fires(text)
    lines = text.splitlines()
    cat = next(i for i, ln in enumerate(lines) if " = cat(" in ln)
    a, b = lines[cat].split("cat(")[1].split(")")[0].split(", ")
    variants = {
        "mask 7": text.replace("fill_value=15", "fill_value=7"),
        "shift 3": text.replace("fill_value=4,", "fill_value=3,"),
        "high nibble first": "\n".join(lines[:cat] + [lines[cat].replace(f"cat({a}, {b})", f"cat({b}, {a})")]
                                       + lines[cat + 1:]),
    }
    mul = next(ln for ln in lines if " = mul.Tensor(" in ln)
    var, lhs = mul.split(" = ")[0].strip(), mul.split("mul.Tensor(")[1].split(",")[0]
    no_scale = [ln for ln in lines if ln is not mul]
    variants["no scale multiply"] = "\n".join(no_scale).replace(f"({var})", f"({lhs})")
    for name, t in variants.items():
        assert t != text, name
        assert not _fires(t), name


# ---- FP8-block and MXFP4 chains feeding linear ---------------------------------------------------------------

def _linear_graph(fmt: str, N: int, K: int, T, via_matmul: bool = False):
    """x [T, K] -> linear(x, W) (or matmul(x, W.T)) with W = the lowprec dequant chain over stored weights."""
    in_major = via_matmul and fmt == "mxfp4"
    if fmt == "mxfp4":
        data_t, scale_t = ("uint8", (N, K // 32, 16)), ("uint8", (N, K // 32))
    else:
        data_t, scale_t = ("float8_e4m3fn", (N, K)), ("float32", (-(-N // 128), -(-K // 128)))
    sub = dequant_graph(fmt, in_major, data_t, scale_t)
    bind = {"blocks": Node.make("weight", (), {"name": "w.data"}, [TensorType(*data_t)]),
            "weight": Node.make("weight", (), {"name": "w.data"}, [TensorType(*data_t)]),
            "scales": Node.make("weight", (), {"name": "w.scale"}, [TensorType(*scale_t)]),
            "scale_inv": Node.make("weight", (), {"name": "w.scale"}, [TensorType(*scale_t)])}
    w = rewrite(sub, lambda m: bind[m.attr["name"]] if m.op == "input" else None).outputs[0]
    x = Node.make("input", (), {"name": "x"}, [TensorType("float32", (T, K))])
    span = Span("proj", "test")
    if via_matmul:
        if fmt == "fp8":
            w = Node.make("transpose.int", (w,), {"dim0": 0, "dim1": 1}, [TensorType("float32", (K, N))], span)
        y = Node.make("matmul", (x, w), {}, [TensorType("float32", (T, N))], span)
    else:
        y = Node.make("linear", (x, w), {"bias": False}, [TensorType("float32", (T, N))], span)
    syms = ((T.name, 1, 128),) if not isinstance(T, int) else ()
    return Graph("main", (x,), (y,), syms)


def _stored(fmt: str, N: int, K: int, seed=0):
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(seed))
    if fmt == "mxfp4":
        return lowprec.quantize_mxfp4(w)
    return lowprec.quantize_fp8_block(w)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("via_matmul", [False, True])
def test_fp8_and_mxfp4_chains_feeding_linear_fuse(fmt, via_matmul):
    N, K = (200, 300) if fmt == "fp8" else (48, 64)
    seq = make_symbol("seq")
    g = _linear_graph(fmt, N, K, seq, via_matmul)
    fused, found = run_pipeline(g, verify=True)
    assert found.patterns.get("dequant.linear") == 1
    assert [n.op for n in fused.nodes() if n.op.startswith("dequant_linear")] == [f"dequant_linear_{fmt}"]
    data, scale = _stored(fmt, N, K)
    ws = dict(found.constants, **{"w.data": data, "w.scale": scale})
    x = torch.randn(7, K)
    got = interp.run_graph(fused, {"x": x}, ws.__getitem__)[0]
    want = interp.run_graph(fold(g), {"x": x}, ws.__getitem__)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def fold(g):
    from dayzero.passes.fold_constants import fold_constants

    return fold_constants(g)[0]


# ---- kernels vs torch ----------------------------------------------------------------------------------------

INT4 = {
    "nk_axis1_offset8": dict(layout="nk", block=32, block_axis=1, signed=False, offset=8.0, zero_point=False),
    "nk_axis1_zp": dict(layout="nk", block=32, block_axis=1, signed=False, offset=0.0, zero_point=True),
    "kn_axis0_signed": dict(layout="kn", block=32, block_axis=0, signed=True, offset=8.0, zero_point=False),
    "kn_axis0_zp": dict(layout="kn", block=16, block_axis=0, signed=False, offset=0.0, zero_point=True),
    "kn_axis1_signed_zp": dict(layout="kn", block=8, block_axis=1, signed=True, offset=8.0, zero_point=True),
}


def _int4_args(p, seed=0):
    g = torch.Generator().manual_seed(seed)
    (R, C), ss = int4_storage(p)
    packed = torch.randint(0, 256, (R, C // 2), dtype=torch.uint8, generator=g)
    scales = torch.rand(ss, generator=g) * 0.1 + 0.01
    ws = [packed, scales] + ([torch.randint(0, 16, ss, generator=g).float()] if p["zero_point"] else [])
    return ws, rd.int4_dequant_ref(*ws, *([None] * (3 - len(ws))), p)


def _weights(fmt, p):
    """(the kernel's weight arguments, the fp32 weight they stand for) of format FMT at P's N, K."""
    if fmt == "int4":
        return _int4_args(p)
    if fmt == "bf16":
        wt = torch.randn(p["N"], p["K"], generator=torch.Generator().manual_seed(4)).bfloat16()
        return [wt], wt.float()
    data, scale = _stored(fmt, p["N"], p["K"], seed=3)
    ref = lowprec.dequant_mxfp4(data, scale) if fmt == "mxfp4" else lowprec.dequant_fp8_block(data, scale)
    return [data, scale], ref


KERNEL_CASES = [("int4", k) for k in sorted(INT4)] + [("fp8", "edges"), ("mxfp4", "plain")]


@pytest.mark.parametrize("fmt,case", KERNEL_CASES)
@pytest.mark.parametrize("T", [3, None])
def test_kernel_matches_torch(fmt, case, T):
    N, K = {"int4": (40, 96), "fp8": (200, 300), "mxfp4": (48, 64)}[fmt]
    p = dict(INT4.get(case, {}), fmt=fmt, N=N, K=K, T=T)
    ws, w = _weights(fmt, p)
    f = kl.build(p, HOST)
    for t in ([T] if T is not None else [1, 5, 70]):
        x = torch.randn(t, K, generator=torch.Generator().manual_seed(t))
        y = torch.empty(t, N)
        f(x, *ws, y)
        want = x.double() @ w.double().t()
        assert float((y.double() - want).abs().max()) <= 1e-5 * float(want.abs().max()), (fmt, case, t)
        ref = rd.linear_reference(fmt)([x, *ws], dict(p))
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("fmt,T,want_T", [("bf16", 8, 8), ("bf16", 12, None), ("fp8", 12, None), ("fp8", 100, None),
                                          ("mxfp4", 12, 12)])
def test_a_static_token_count_past_eight_takes_the_gemm_with_its_bound(fmt, T, want_T):
    """bf16 / FP8 weights: a static T of 9..64 takes the GEMM (its tile bounded by t_max = T: 16 tokens, not 64)
    instead of a GEMV with T accumulators per row (1.6-2.6x slower from T = 16); MXFP4 keeps its GEMV to 64."""
    N, K = 40, 64
    ins = [TensorType("float32", (T, K)), TensorType("bfloat16" if fmt == "bf16" else "uint8", (N, K))]
    node = Node.make(f"dequant_linear_{fmt}", tuple(Node.make("input", (), {"name": f"i{j}"}, [t])
                                                    for j, t in enumerate(ins)), {"N": N, "K": K},
                     [TensorType("float32", (T, N))])
    p = kl.params(node)
    assert p["T"] == want_T and p.get("t_max") == (T if want_T is None else None)
    if fmt == "bf16":
        wt = torch.randn(N, K, generator=torch.Generator().manual_seed(7)).bfloat16()
        x = torch.randn(T, K, generator=torch.Generator().manual_seed(8))
        y = torch.empty(T, N)
        kl.build(p, host_target_dict())(x, wt, y)
        want = x.double() @ wt.double().t()
        assert float((y.double() - want).abs().max()) <= 1e-5 * float(want.abs().max())


@pytest.mark.parametrize("K,want", [(300, (1, 2)), (4096, (1, 2)), (4100, (5, 1)), (5000, (8, 1))])
def test_one_token_bf16_gemv_streams_rows_whose_activations_fit_l1(K, want):
    """At T = 1 a bf16 weight whose activations fit within 16 KiB (K <= 4096) streams one row at a time with two
    accumulator vectors (x padded to 32: K = 300 reads 320); a wider one takes gemv_rows' groups of rows (at most 8
    dividing N: 5 of N = 100, 8 of N = 200), one accumulator each; both match torch."""
    from dayzero.codegen.kernels.dequant import gemv

    N = 100 if K == 4100 else 200
    assert gemv.gemv_tile("bf16", 1, N, K) == want
    assert gemv.gemv_tile("bf16", 2, N, K)[1] == 1 and gemv.gemv_tile("fp8", 1, N, K) == (4, 1)
    wt = torch.randn(N, K, generator=torch.Generator().manual_seed(5)).bfloat16()
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(6))
    y = torch.empty(1, N)
    kl.build(dict(fmt="bf16", N=N, K=K, T=1), host_target_dict())(x, wt, y)
    want_y = x.double() @ wt.double().t()
    assert float((y.double() - want_y).abs().max()) <= 1e-5 * float(want_y.abs().max())


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("N", [200, 36, 44, 6])
def test_few_token_gemm_matches_torch_for_every_batch_up_to_its_bound(fmt, N):
    """A symbolic T bounded by one token vector (``t_max``: a batched decode step) takes the few-token tile: one
    token vector x the most weight rows dividing N (on AVX2 200: 8, 36: 12, 44: 4; 6: none, the usual tile);
    every T up to the bound and beyond it (the tile loop covers any T) matches torch."""
    from dayzero.codegen.kernels.dequant import gemm

    K = 300
    p = dict(fmt=fmt, N=N, K=K, T=None, t_max=8)
    ws, w = _weights(fmt, p)
    host = host_target_dict()
    rows, tvec, lanes = gemm._gemm_tile(host, 8, N)
    assert (tvec == 1 and N % rows == 0 and rows >= 4) if N != 6 else tvec > 1
    assert gemm.token_tile(host, 8, N) == tvec * lanes and gemm.token_tile(host) > lanes
    assert '"xt"' in str(kl.kernel(p, host, scheduled=False))
    f = kl.build(p, host)
    for t in [1, 2, 5, 8, 11]:
        x = torch.randn(t, K, generator=torch.Generator().manual_seed(t))
        y = torch.empty(t, N)
        f(x, *ws, y)
        want = x.double() @ w.double().t()
        assert float((y.double() - want).abs().max()) <= 1e-5 * float(want.abs().max()), (fmt, N, t)


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_a_batched_decode_step_of_up_to_eight_requests_runs_the_gemv(fmt):
    """A symbolic T bounded by 8 (a batched decode step, --max-batch 8) runs the GEMV for 1, 2, 4 or 8 tokens, the
    rows past T zero, chosen at run time; a larger T still takes the GEMM. The few-token GEMM had read full-width
    DeepSeek-V3.2's bf16 projections at 4-5 GB/s at every batch (18432 x 7168: 53-60 ms against 8.7-17 for these
    GEMVs, ``/tmp/sv/bfmb.py``), 1258 of a 1449 ms step for 8 requests. A bound past 8 keeps the GEMM alone."""
    K, N = 300, 44
    p = dict(fmt=fmt, N=N, K=K, T=None, t_max=8)
    ws, w = _weights(fmt, p)
    host = host_target_dict()
    assert '"y_rf' in kl.kernel(p, host).script() and '"y_rf' not in kl.kernel(dict(p, t_max=12), host).script()
    f = kl.build(p, host)
    for t in [1, 2, 3, 4, 7, 8, 11]:
        x = torch.randn(t, K, generator=torch.Generator().manual_seed(t))
        y = torch.full((t, N), float("nan"))
        f(x, *ws, y)
        want = x.double() @ w.double().t()
        assert float((y.double() - want).abs().max()) <= 1e-5 * float(want.abs().max()), (fmt, t)


def test_the_bf16_gemv_holds_as_many_accumulators_as_the_target_has_vector_registers():
    """rows x T accumulator vectors within the registers, at most 8 rows dividing N: AVX-512's 32 give T = 4 eight
    rows and T = 8 four; AVX2's 16 half that."""
    from dayzero.codegen.kernels.dequant import gemv

    assert [gemv.gemv_tile("bf16", t, 200, 7168, 32)[0] for t in (1, 2, 4, 8)] == [8, 8, 8, 4]
    assert [gemv.gemv_tile("bf16", t, 200, 7168, 16)[0] for t in (1, 2, 4, 8)] == [8, 8, 4, 2]
    assert gemv.gemv_tile("bf16", 8, 6, 7168, 32)[0] == 3 and gemv.gemv_tile("fp8", 8, 200, 7168, 32) == (4, 1)


@pytest.mark.parametrize("fmt,case", [("int4", "nk_axis1_zp"), ("int4", "kn_axis0_signed"), ("fp8", "edges"),
                                      ("mxfp4", "plain"), ("bf16", "plain")])
@pytest.mark.parametrize("T", [2, None])
def test_kernels_compile_for_cuda_sm90(fmt, case, T):
    tgt = cuda_target_dict("sm_90")
    p = dict(INT4.get(case, {}), fmt=fmt, N=256, K=512, T=T)
    f = kl.kernel(p, tgt)
    assert f.attrs["tirx.is_scheduled"]
    lib = tvm.compile(tvm.IRModule({"main": f}), target=tgt)
    src = lib.mod.imports[0].inspect_source() if lib.mod.imports else lib.mod.inspect_source()
    assert "threadIdx.x" in src and "__global__" in src


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_an_unbounded_symbolic_t_takes_the_few_token_tile_up_to_one_vector_and_the_wide_one_past_it(fmt):
    """A symbolic T with no bound (a prefill's seq) carries both GEMM tiles, chosen at run time: a 5-token prompt
    is not padded to a 64-token tile. Every T around the switch (one vector of tokens) and far past it matches
    torch; the kernel branches on T against that vector."""
    from dayzero.codegen.kernels.dequant import gemm

    N, K = 48, 300
    p = dict(fmt=fmt, N=N, K=K, T=None)
    ws, w = _weights(fmt, p)
    host = host_target_dict()
    lanes = gemm.vector_lanes(host)
    text = str(kl.kernel(p, host))
    assert f"if T_1 > {lanes}:" in text
    f = kl.build(p, host)
    for t in [1, 3, lanes - 1, lanes, lanes + 1, 2 * lanes + 3, 130]:
        x = torch.randn(t, K, generator=torch.Generator().manual_seed(t))
        y = torch.empty(t, N)
        f(x, *ws, y)
        want = x.double() @ w.double().t()
        assert float((y.double() - want).abs().max()) <= 1e-5 * float(want.abs().max()), (fmt, t)


def test_up_to_eight_tokens_take_eight_lane_vectors_on_avx512():
    """The few-token tile's lanes: a batched step of at most 8 requests on AVX-512 uses 8-lane vectors (a
    half-empty zmm costs a full one, and two ymm on Zen 4), 9..16 requests 16 lanes, AVX2 always 8; the weight
    rows stay the most of 16 / 12 / 8 / 4 (AVX-512: 32 registers) or 12 / 8 / 4 (AVX2: 16) dividing N."""
    from dayzero.codegen.kernels.dequant import gemm

    avx512, avx2 = {"kind": "llvm", "mcpu": "skylake-avx512"}, {"kind": "llvm", "mcpu": "haswell"}
    assert gemm.vector_lanes(avx512) == 16 and gemm.vector_lanes(avx2) == 8
    assert gemm._gemm_tile(avx512, 8, 48) == (16, 1, 8) and gemm._gemm_tile(avx512, 1, 200) == (8, 1, 8)
    assert gemm._gemm_tile(avx512, 9, 48) == (16, 1, 16) and gemm.token_tile(avx512, 16, 48) == 16
    assert gemm._gemm_tile(avx2, 8, 48) == (12, 1, 8) and gemm._gemm_tile(avx512, None, 48) == (4, 4, 16)
