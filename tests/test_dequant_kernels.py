"""Dequant kernels vs torch (dequantise with lowprec, then matmul in float64).

Tolerance (fp32 accumulation over K terms, different order): max |y - ref| <= 1e-5 * max|ref| + 1e-6 * sqrt(K)
* rms(x) * rms(W) ... stated simply as rtol-of-max 2e-6 * sqrt(K / 32): observed ~1e-7 .. 5e-7.
Shapes include non-multiples of every tile (O = 7, 129; K = 200 for FP8; T = 1, 70, 200 with one compiled GEMM).
CUDA sm_90: compile-only (no GPU needed); GPU numerics in tools/gpu_dequant_check.py.
"""

import math

import numpy as np
import pytest
import torch
import tvm

from dayzero import UserError
from dayzero.codegen.kernels import dequant as dq
from dayzero.frontend import lowprec
from dayzero.targets.host import cuda_target_dict, host_target_dict

HOST = host_target_dict()
# x86 without AVX2 (every x86-64 CPU runs it): the portable integer-bit decode ("arith"), run here for real
GENERIC_X86 = {"kind": "llvm", "mcpu": "x86-64", "num-cores": 2}
EXACT = {"mxfp4_gemv": {"int8": False}}  # the exact fp32 route of the MXFP4 GEMV (x86 hosts take the integer one)


def _weights(fmt, O, K, E=None, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(((E,) if E else ()) + (O, K)).astype(np.float32)
    if fmt == "mxfp4":
        a, b = lowprec.quantize_mxfp4(w)
        W = lowprec.dequant_mxfp4(a, b)
    else:
        a, b = lowprec.quantize_fp8_block(w)
        W = lowprec.dequant_fp8_block(a, b)
        a = a.view(np.uint8)
    # torch allocations: 64-byte aligned, as the kernels require
    return torch.from_numpy(np.ascontiguousarray(a)).clone(), torch.from_numpy(b).clone(), W


def _check(y, x, W, K):
    ref = x.numpy().astype(np.float64) @ W.astype(np.float64).T
    err = np.abs(y.numpy() - ref).max() / np.abs(ref).max()
    assert err <= 2e-6 * math.sqrt(K / 32), err


@pytest.mark.parametrize("fmt,T,O,K", [(fmt, *shape) for fmt in ("mxfp4", "fp8_block")
                                        for shape in ((1, 64, 64), (3, 129, 320), (8, 7, 256), (2, 130, 200))
                                        if fmt != "mxfp4" or shape[2] % 32 == 0])  # MXFP4 blocks are 32 along K
def test_gemv_matches_torch(fmt, T, O, K):
    # the exact routes (MXFP4's integer route quantises x: tests/test_dequant_int8.py)
    blocks, scales, W = _weights(fmt, O, K)
    f = dq.build(f"{fmt}_gemv", T, O, K, target=HOST, **EXACT.get(f"{fmt}_gemv", {}))
    x = torch.randn(T, K)
    y = torch.empty(T, O)
    f(x, blocks, scales, y)
    _check(y, x, W, K)


@pytest.mark.parametrize("fmt,O,K", [("mxfp4", 129, 320), ("mxfp4", 7, 64), ("fp8_block", 130, 300)])
def test_gemm_one_kernel_every_T(fmt, O, K):
    blocks, scales, W = _weights(fmt, O, K)
    f = dq.build(f"{fmt}_gemm", O, K, target=HOST)  # symbolic T: one compiled kernel
    for T in (1, 70, 200):
        x = torch.randn(T, K)
        y = torch.empty(T, O)
        f(x, blocks, scales, y)
        _check(y, x, W, K)


@pytest.mark.parametrize("kind", ["mxfp4_gemv", "mxfp4_gemm", "fp8_block_gemv", "fp8_block_gemm"])
def test_expert_index(kind):
    fmt = kind.rsplit("_", 1)[0]
    E, O, K, T = 3, 36, 128, 4
    blocks, scales, W = _weights(fmt, O, K, E=E)
    args = (T, O, K) if kind.endswith("gemv") else (O, K)
    f = dq.build(kind, *args, num_experts=E, target=HOST, **EXACT.get(kind, {}))
    x = torch.randn(T, K)
    for e in (2, 0):
        y = torch.empty(T, O)
        f(x, blocks, scales, e, y)
        _check(y, x, W[e], K)


@pytest.mark.parametrize("target", [HOST, GENERIC_X86], ids=["host", "generic_x86"])
def test_scale_code_zero_and_extremes_exact(target):
    # E8M0 code 0 is 2^-127 (a subnormal scale), 254 is 2^127 (6 * 2^127 overflows to inf, as in the reference):
    # the GEMV with a one-hot x reads W exactly, every FP4 code included (16 bytes of each block cover all 256
    # code pairs across the rows), through the host's lookup and through the portable decode.
    O, K = 8, 64
    codes = np.arange(256, dtype=np.uint8).reshape(O * 2, 16)
    blocks = torch.from_numpy(codes.reshape(O, 2, 16).copy())
    sc = np.array([[0, 1], [100, 127], [140, 200], [126, 60], [254, 253], [2, 128], [131, 119], [127, 127]],
                  np.uint8)
    scales = torch.from_numpy(sc)
    W = lowprec.dequant_mxfp4(blocks.numpy(), sc)
    f = dq.build("mxfp4_gemv", 1, O, K, target=target, int8=False)
    for k in range(K):
        x = torch.zeros(1, K)
        x[0, k] = 1.0
        y = torch.empty(1, O)
        f(x, blocks, scales, y)
        np.testing.assert_array_equal(y.numpy()[0], W[:, k])  # exact (a sum with +0 turns -0 into +0)


@pytest.mark.parametrize("kind,args", [("mxfp4_gemv", (3, 129, 320)), ("mxfp4_gemm", (129, 320))])
def test_portable_decode_matches_torch(kind, args):
    # the decode a CPU without AVX2 (or CUDA) gets: integer bit arithmetic, no table lookups
    assert dq.lookup_mode(GENERIC_X86) == "arith"
    O, K = args[-2:]
    blocks, scales, W = _weights("mxfp4", O, K)
    f = dq.build(kind, *args, target=GENERIC_X86)
    for T in ((args[0],) if kind.endswith("gemv") else (1, 70)):
        x = torch.randn(T, K)
        y = torch.empty(T, O)
        f(x, blocks, scales, y)
        _check(y, x, W, K)


@pytest.mark.parametrize("mcpu,mode,must_have", [
    ("haswell", "pshufb", r"vpshufb"),             # AVX2: byte lookups on xmm, 8-lane ymm FMAs
    ("znver3", "pshufb", r"vpshufb"),
    ("skylake-avx512", "permvar16", r"vperm[a-z0-9]*\s[^\n]*zmm"),  # AVX-512: one 16-lane permute per 16 codes
    ("znver4", "permvar16", r"vperm[a-z0-9]*\s[^\n]*zmm"),
])
def test_x86_schedules_compile_vectorised(mcpu, mode, must_have):
    # every x86 host gets a vectorised decode, whatever this machine is (compile only: AVX-512 may not run here)
    import re

    tgt = {"kind": "llvm", "mcpu": mcpu, "num-cores": 2}
    assert dq.lookup_mode(tgt) == mode
    for f in (dq.mxfp4_gemv(1, 64, 256, target=tgt, int8=False), dq.mxfp4_gemm(64, 256, target=tgt)):
        asm = tvm.compile(tvm.IRModule({"main": f}), target=tgt).mod.inspect_source("asm")
        assert re.search(must_have, asm), mcpu
        assert not re.search(r"call\w*\s+_*extendhfsf2", asm)  # no software fp16 conversion in the decode


def test_bad_shapes_are_user_errors():
    with pytest.raises(UserError, match="in_features % 32"):
        dq.mxfp4_gemv(1, 64, 40, target=HOST)
    with pytest.raises(UserError, match="unknown dequant kernel"):
        dq.build("int4_gemv", 1, 2, 3, target=HOST)


@pytest.mark.parametrize("kind,args", [("mxfp4_gemv", (2, 256, 512)), ("fp8_block_gemv", (2, 256, 500)),
                                       ("mxfp4_gemm", (256, 512)), ("fp8_block_gemm", (256, 500))])
def test_cuda_sm90_compiles(kind, args):
    tgt = cuda_target_dict("sm_90")
    f = getattr(dq, kind)(*args, target=tgt)
    assert f.attrs["tirx.is_scheduled"]
    lib = tvm.compile(tvm.IRModule({"main": f}), target=tgt)
    src = lib.mod.imports[0].inspect_source() if lib.mod.imports else lib.mod.inspect_source()
    assert "threadIdx.x" in src and "__global__" in src
