"""The integer MXFP4 decode GEMV (codegen/kernels/dequant/gemv_int8.py) and its route rule.

Two references, both computed here in float64 from the stored bytes (lowprec decodes them):
- the quantised reference: x rounded to int8 per 32-block exactly as the kernel's docstring says, times W. The
  kernel's only other error is fp32 rounding: max |y - ref| <= 1e-6 * max |ref| (observed ~1e-7 .. 4e-7).
- the fp32 reference x @ W^T: the kernel differs by the activation rounding alone, which is bounded, per output,
  by sum_g (sx[t, g] / 2) * sum_{k in g} |W[o, k]| (each qx is within half a step sx of x / sx); checked as that
  bound, not as a loose relative tolerance.
Shapes cover every tail of the block loop (G = K / 32 with G % 4 = 0, 1, 2, 3, and G < 4), odd O, T up to 16,
both integer modes (vnni: vpdpbusd on zmm; maddubs: AVX2 vpmaddubsw + vpmaddwd, run here as haswell code).
"""

import numpy as np
import pytest
import torch
import tvm

from dayzero import UserError
from dayzero.codegen.kernels import dequant as dq
from dayzero.codegen.kernels.dequant.gemv_int8 import INT8_MAX_T, int8_mode, int8_route, mxfp4_gemv_int8
from dayzero.frontend import lowprec
from dayzero.targets.host import cuda_target_dict, host_target_dict

HOST = host_target_dict()
HASWELL = {"kind": "llvm", "mcpu": "haswell", "num-cores": 2}  # AVX2 without VNNI: the maddubs mode
GENERIC_X86 = {"kind": "llvm", "mcpu": "x86-64", "num-cores": 2}
MODES = [pytest.param(HOST, id="host")] + ([pytest.param(HASWELL, id="haswell")]
                                           if int8_mode(HOST) == "vnni" else [])

pytestmark = pytest.mark.skipif(int8_mode(HOST) is None, reason="the host has no AVX2: no integer route to run")


def _weights(O, K, E=None, seed=0):
    """Trained-like MXFP4 weights: fan-in scaled normals quantised as published (lowprec.quantize_mxfp4)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(((E,) if E else ()) + (O, K)) / np.sqrt(K)).astype(np.float32)
    b, s = lowprec.quantize_mxfp4(w)
    return torch.from_numpy(b).clone(), torch.from_numpy(s).clone(), lowprec.dequant_mxfp4(b, s).astype(np.float64)


def _quantised_x(x):
    """(x rounded to int8 per 32-block, times its scale) and the scale sx [T, G], float64 (the kernel's rule)."""
    T, K = x.shape
    xb = x.numpy().astype(np.float32).reshape(T, K // 32, 32)
    amax = np.abs(xb).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv)  # fp32 product, rounded half to even, as the kernel
    sx = amax.astype(np.float64) / 127
    return (q * sx).reshape(T, K), sx[..., 0]


def _check(y, x, W):
    xq, sx = _quantised_x(x)
    ref_q = xq @ W.T
    err_q = np.abs(y.numpy() - ref_q).max() / max(np.abs(ref_q).max(), 1e-30)
    assert err_q <= 1e-6, err_q
    ref = x.numpy().astype(np.float64) @ W.T
    T, K = x.shape
    bound = (sx / 2) @ np.abs(W).reshape(W.shape[0], K // 32, 32).sum(-1).T  # [T, O]
    assert (np.abs(y.numpy() - ref) <= bound * (1 + 1e-5) + 1e-6 * np.abs(ref).max()).all()


@pytest.mark.parametrize("target", MODES)
@pytest.mark.parametrize("T,O,K", [(1, 7, 32), (3, 129, 320), (2, 64, 224), (5, 13, 96), (1, 64, 2880),
                                   (16, 8, 128), (4, 10, 160)])
def test_int8_gemv_matches_references(target, T, O, K):
    blocks, scales, W = _weights(O, K)
    f = dq.build("mxfp4_gemv", T, O, K, target=target, int8=True)
    x = torch.randn(T, K)
    x[0, :32] *= 40.0  # one block with a large range next to ordinary ones: scales are per block
    y = torch.empty(T, O)
    f(x, blocks, scales, y)
    _check(y, x, W)


@pytest.mark.parametrize("target", MODES)
def test_int8_gemv_expert_index(target):
    E, O, K, T = 3, 36, 192, 2
    blocks, scales, W = _weights(O, K, E=E)
    f = dq.build("mxfp4_gemv", T, O, K, num_experts=E, target=target, int8=True)
    x = torch.randn(T, K)
    for e in (2, 0):
        y = torch.empty(T, O)
        f(x, blocks, scales, e, y)
        _check(y, x, W[e])


def test_zero_blocks_and_every_code():
    # a block of x that is all zero contributes exactly 0 (its scale is 0, no 0/0); every code pair and scale
    # code (0 = 2^-127 .. 254) goes through the table; the result equals the quantised reference
    O, K = 8, 96
    blocks = torch.from_numpy(np.arange(O * 3 * 16, dtype=np.int64).astype(np.uint8).reshape(O, 3, 16).copy())
    sc = np.array([[0, 1, 127], [100, 127, 128], [140, 125, 120], [126, 60, 130], [131, 119, 127],
                   [2, 128, 126], [127, 127, 127], [129, 124, 127]], np.uint8)
    scales = torch.from_numpy(sc)
    W = lowprec.dequant_mxfp4(blocks.numpy(), sc).astype(np.float64)
    x = torch.randn(2, K)
    x[:, 32:64] = 0.0
    y = torch.empty(2, O)
    dq.build("mxfp4_gemv", 2, O, K, target=HOST, int8=True)(x, blocks, scales, y)
    assert np.isfinite(y.numpy()).all()
    _check(y, x, W)
    only_zero_block = x.clone()
    only_zero_block[:, :32] = 0.0
    only_zero_block[:, 64:] = 0.0
    dq.build("mxfp4_gemv", 2, O, K, target=HOST, int8=True)(only_zero_block, blocks, scales, y)
    assert (y == 0).all()


def test_route_rule():
    assert int8_route(HOST, 1) and int8_route(HOST, INT8_MAX_T)
    assert not int8_route(HOST, INT8_MAX_T + 1)  # a larger batch shares the exact decode across its tokens
    assert not int8_route(HOST, 1, int8=False)  # the option that keeps the exact fp32 kernel
    assert int8_route(HOST, 64, int8=True)
    assert not int8_route(GENERIC_X86, 1) and not int8_route(cuda_target_dict("sm_90"), 1)
    with pytest.raises(UserError, match="AVX2"):
        int8_route(GENERIC_X86, 1, int8=True)
    with pytest.raises(UserError, match="AVX2"):
        mxfp4_gemv_int8(1, 8, 64, target=GENERIC_X86)
    # the default GEMV takes the integer kernel on the host: not exact, within the activation-rounding bound
    blocks, scales, W = _weights(16, 64)
    x = torch.randn(1, 64)
    y, y_exact = torch.empty(1, 16), torch.empty(1, 16)
    dq.build("mxfp4_gemv", 1, 16, 64, target=HOST)(x, blocks, scales, y)
    dq.build("mxfp4_gemv", 1, 16, 64, target=HOST, int8=False)(x, blocks, scales, y_exact)
    _check(y, x, W)
    assert not torch.equal(y, y_exact)


@pytest.mark.parametrize("mcpu,mode,must_have", [
    ("haswell", "maddubs", r"vpmaddubsw[^\n]*ymm"),
    ("icelake-server", "vnni", r"vpdpbusd[^\n]*zmm"),
    ("znver4", "vnni", r"vpdpbusd[^\n]*zmm"),
])
def test_integer_instructions(mcpu, mode, must_have):
    # compile only: the byte dot products are the instructions the route is for
    import re

    tgt = {"kind": "llvm", "mcpu": mcpu, "num-cores": 2}
    assert int8_mode(tgt) == mode
    asm = tvm.compile(tvm.IRModule({"main": mxfp4_gemv_int8(1, 64, 2880, target=tgt)}),
                      target=tgt).mod.inspect_source("asm")
    assert re.search(must_have, asm), mcpu
    assert re.search(r"vpshufb", asm)


@pytest.mark.parametrize("offset", [16, 32, 48, 1])
def test_codes_at_any_address(offset):
    """The code bytes may start anywhere (a numpy array is only 16-byte aligned): the kernel's 16- to 64-byte code
    loads must not assume the 64 bytes of an arena buffer (they did: a segfault, or not, by where numpy put the
    array) and give the result of the same codes at an aligned address."""
    O, K = 8, 96
    codes = torch.randint(0, 256, (O, 3, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(offset))
    scales = torch.full((O, 3), 127, dtype=torch.uint8)
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(1))
    f = dq.build("mxfp4_gemv", 2, O, K, target=HOST, int8=True)
    want, got = torch.empty(2, O), torch.empty(2, O)
    f(x, codes, scales, want)
    big = torch.zeros(codes.numel() + 128, dtype=torch.uint8)
    start = (64 - big.data_ptr() % 64) % 64 + offset
    moved = big[start:start + codes.numel()].view(codes.shape)
    moved.copy_(codes)
    f(x, moved, scales, got)
    assert torch.equal(got, want)
