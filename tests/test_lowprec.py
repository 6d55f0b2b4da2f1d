"""Low-precision formats: our reference dequantisers are bit-exact against transformers' own code and ml_dtypes.

Spec:
- MXFP4 (gpt-oss layout) dequant == transformers.integrations.mxfp4.convert_moe_packed_tensors (fp32), bit for bit,
  on every byte value (so every FP4 code in both nibbles) and every E8M0 code but the NaN one (0..254).
- FP8-block dequant == transformers.integrations.finegrained_fp8._dequantize_fp8_weight (fp32), bit for bit,
  including partial edge blocks.
- Writers round-trip: quantise -> dequantise -> quantise gives the same bytes; errors stay within the format's step.
- Validators raise UserError naming the tensor.
"""

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dayzero import UserError
from dayzero.frontend import lowprec
from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight
from transformers.integrations.mxfp4 import convert_moe_packed_tensors


def _bits(a) -> np.ndarray:
    a = a.numpy() if isinstance(a, torch.Tensor) else a
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _hf_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """transformers' dequant of [E, O, G, 16] -> [E, in, out]; transpose back to [E, O, in]."""
    out = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    return out.transpose(1, 2).contiguous().numpy()


def test_fp4_table_is_ml_dtypes_and_transformers():
    from transformers.integrations.mxfp4 import FP4_VALUES

    assert _bits(lowprec.FP4_E2M1_VALUES).tolist() == _bits(np.array(FP4_VALUES, np.float32)).tolist()


def test_mxfp4_every_byte_every_scale_bit_exact():
    # blocks [1, 255, 16, 16]: row o uses scale code o (0..254); the 256 bytes cover every (lo, hi) nibble pair.
    all_bytes = np.arange(256, dtype=np.uint8).reshape(16, 16)
    blocks = np.broadcast_to(all_bytes, (1, 255, 16, 16)).copy()
    scales = np.broadcast_to(np.arange(255, dtype=np.uint8)[None, :, None], (1, 255, 16)).copy()
    ours = lowprec.dequant_mxfp4(blocks, scales)
    assert ours.shape == (1, 255, 512) and ours.dtype == np.float32
    np.testing.assert_array_equal(_bits(ours), _bits(_hf_mxfp4(blocks, scales)))
    # and against ml_dtypes element by element: value = e2m1(code) * e8m0(scale)
    b, s = blocks[0, 7, 3, 5], scales[0, 7, 3]
    e = float(np.array([s], np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float32)[0])
    lo = float(np.array([b & 15], np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)[0])
    hi = float(np.array([b >> 4], np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)[0])
    assert ours[0, 7, 3 * 32 + 10] == np.float32(lo * e) and ours[0, 7, 3 * 32 + 11] == np.float32(hi * e)


@settings(max_examples=40, deadline=None)
@given(
    shape=st.tuples(st.integers(1, 3), st.integers(1, 9), st.integers(1, 5)),
    data=st.data(),
)
def test_mxfp4_random_bytes_bit_exact(shape, data):
    e, o, g = shape
    blocks = data.draw(hnp.arrays(np.uint8, (e, o, g, 16)))
    scales = data.draw(hnp.arrays(np.uint8, (e, o, g), elements=st.integers(0, 254)))
    ours = lowprec.dequant_mxfp4(blocks, scales)
    np.testing.assert_array_equal(_bits(ours), _bits(_hf_mxfp4(blocks, scales)))
    # torch in -> torch out, same bits
    t = lowprec.dequant_mxfp4(torch.from_numpy(blocks), torch.from_numpy(scales))
    assert isinstance(t, torch.Tensor)
    np.testing.assert_array_equal(_bits(t), _bits(ours))


@settings(max_examples=40, deadline=None)
@given(
    shape=st.tuples(st.integers(1, 2), st.integers(1, 300), st.integers(1, 300)),
    data=st.data(),
)
def test_fp8_block_random_bytes_bit_exact(shape, data):
    e, r, c = shape
    codes = data.draw(hnp.arrays(np.uint8, (e, r, c)))
    codes[(codes & 0x7F) == 0x7F] = 0x7E  # 0x7F / 0xFF are E4M3 NaN: not a weight value
    nr, nc = -(-r // 128), -(-c // 128)
    sc = data.draw(
        hnp.arrays(np.float32, (e, nr, nc), elements=st.floats(2.0**-30, 2.0**10, width=32))
    )
    ours = lowprec.dequant_fp8_block(codes.view(ml_dtypes.float8_e4m3fn), sc)
    w = torch.from_numpy(codes).view(torch.float8_e4m3fn)
    ref = _dequantize_fp8_weight(w, torch.from_numpy(sc), [128, 128], torch.float32)
    np.testing.assert_array_equal(_bits(ours), _bits(ref))
    # and element-wise against ml_dtypes
    i, j = r - 1, c - 1
    want = np.float32(codes[0, i, j : j + 1].view(ml_dtypes.float8_e4m3fn).astype(np.float32)[0] * sc[0, i // 128, j // 128])
    assert ours[0, i, j] == want
    t = lowprec.dequant_fp8_block(w, torch.from_numpy(sc))
    assert isinstance(t, torch.Tensor)
    np.testing.assert_array_equal(_bits(t), _bits(ours))


def test_fp8_every_code():
    codes = np.arange(256, dtype=np.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].reshape(2, 127)
    sc = np.array([[0.375]], np.float32)
    ours = lowprec.dequant_fp8_block(codes, sc)
    ref = _dequantize_fp8_weight(torch.from_numpy(codes).view(torch.float8_e4m3fn), torch.from_numpy(sc), [128, 128], torch.float32)
    np.testing.assert_array_equal(_bits(ours), _bits(ref))


# ------------------------------------------------------------------------------------------------ writers
@settings(max_examples=25, deadline=None)
@given(hnp.arrays(np.float32, (3, 64), elements=st.floats(-1e4, 1e4, width=32)))
def test_quantize_mxfp4_round_trip(w):
    blocks, scales = lowprec.quantize_mxfp4(w)
    assert blocks.shape == (3, 2, 16) and blocks.dtype == np.uint8 and scales.shape == (3, 2)
    assert (scales != 0xFF).all()
    d = lowprec.dequant_mxfp4(blocks, scales)
    b2, s2 = lowprec.quantize_mxfp4(d)
    # dequantised values are fixed points of the writer (the bytes may differ: 12 = 3 * 4 = 6 * 2)
    np.testing.assert_array_equal(lowprec.dequant_mxfp4(b2, s2), d)
    # error within half a step of the largest E2M1 gap (2 at the top: |err| <= 1 * scale)
    scale = lowprec.e8m0_to_float32(scales)[..., None]
    err = np.abs(d.reshape(3, 2, 32) - w.reshape(3, 2, 32))
    assert (err <= scale * 1.0 + 1e-30).all()


def test_quantize_mxfp4_matches_checkpoint_rule():
    w = np.zeros((1, 32), np.float32)
    w[0, :4] = [6.0, -3.0, 0.5, 0.25]
    blocks, scales = lowprec.quantize_mxfp4(w)
    assert scales[0, 0] == 127  # amax 6 -> scale 1
    assert blocks[0, 0, 0] == (0x7 | (0xD << 4)) and blocks[0, 0, 1] == (0x1 | (0x0 << 4))  # 0.25 -> 0 (RNE)
    tb, ts = lowprec.quantize_mxfp4(torch.from_numpy(w))
    assert isinstance(tb, torch.Tensor) and tb.dtype == torch.uint8 and ts.dtype == torch.uint8


def test_quantize_fp8_block_round_trip():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((2, 200, 300)).astype(np.float32)
    q, s = lowprec.quantize_fp8_block(w)
    assert q.dtype == ml_dtypes.float8_e4m3fn and s.shape == (2, 2, 3) and s.dtype == np.float32
    d = lowprec.dequant_fp8_block(q, s)
    # round to nearest E4M3: half an ulp (2^-4 relative) for normals, half the smallest subnormal (2^-10) x scale
    full = np.repeat(np.repeat(s, 128, axis=-2), 128, axis=-1)[..., :200, :300]
    assert (np.abs(d - w) <= np.maximum(2.0**-4 * np.abs(w), 2.0**-10 * full)).all()
    # the one FP8 rule (make-tiny's too): power-of-two block scales, each block's amax in [224, 448] codes
    assert np.array_equal(np.exp2(np.round(np.log2(s))), s)
    qf = np.abs(np.asarray(q, np.float32))
    amax = [qf[e, r:r + 128, c:c + 128].max() for e in range(2) for r in (0, 128) for c in (0, 128, 256)]
    assert all(224 <= a <= 448 for a in amax)
    # dequantised values are fixed points, also re-blocked over a sub-range of rows (make-tiny's gate / up split)
    for part in (d, d[:, :100]):
        q2, s2 = lowprec.quantize_fp8_block(part)
        np.testing.assert_array_equal(lowprec.dequant_fp8_block(q2, s2), part)
    tq, ts = lowprec.quantize_fp8_block(torch.from_numpy(w))
    assert tq.dtype == torch.float8_e4m3fn
    np.testing.assert_array_equal(tq.view(torch.uint8).numpy(), q.view(np.uint8))


# ------------------------------------------------------------------------------------------------ validators
def test_validators_name_the_tensor():
    b = np.zeros((4, 2, 16), np.uint8)
    with pytest.raises(UserError, match="down_proj.*does not match"):
        lowprec.dequant_mxfp4(b, np.zeros((4, 3), np.uint8), name="down_proj")
    s = np.full((4, 2), 127, np.uint8)
    s[2, 1] = 0xFF
    with pytest.raises(UserError, match=r"gate_up_proj_scales.*NaN.*\[2, 1\]"):
        lowprec.validate_mxfp4(b, s, name="gate_up_proj")
    with pytest.raises(UserError, match="w_blocks.*uint8"):
        lowprec.validate_mxfp4(b.astype(np.float32), s, name="w")
    q = np.zeros((130, 10), np.uint8)
    for bad in (np.nan, np.inf, -np.inf):
        sc = np.ones((2, 1), np.float32)
        sc[1, 0] = bad
        with pytest.raises(UserError, match="q_proj_scale_inv.*NaN/Inf"):
            lowprec.dequant_fp8_block(q, sc, name="q_proj")
    with pytest.raises(UserError, match=r"q_proj.*\[2, 1\]"):
        lowprec.validate_fp8_block(q, np.ones((1, 1), np.float32), name="q_proj")
