"""Format decode for the dequant kernels: MXFP4 / FP8 codes -> exact fp32, the weight arguments, the lookup mode.

    MXFP4   blocks uint8 [O, G, 16] + scales uint8 [O, G],   K = 32 G
            W[o, 32g + 2j + h] = E2M1((blocks[o, g, j] >> 4h) & 15) * 2^(scales[o, g] - 127)
    FP8     weight uint8 (E4M3 bytes) [O, K] + scale_inv fp32 [ceil(O/128), ceil(K/128)]
            W[o, k] = E4M3(weight[o, k]) * scale_inv[o // 128, k // 128]

With ``num_experts=E`` the weights carry a leading expert dim ([E, O, G, 16], [E, O, G]; [E, O, K],
[E, ceil(O/128), ceil(K/128)]) and the kernel takes an int32 ``expert`` argument selecting one of them.

Decoding, exact in fp32 (checked bit for bit against lowprec in the tests):
- MXFP4: the kernels decode 2 E2M1(c), a small integer (0, 1, 2, 3, 4, 6, 8, 12, signed), and multiply a
  32-value block's partial dot product by sc2 = 2^(s - 128) once, instead of scaling every weight (exact: the
  scale is a power of two). How the code becomes a float depends on the target (``lookup_mode``):
  AVX2 ``pshufb`` (the GEMV: ``_mxfp4_gemv_avx2``, 8 codes per ymm shuffle straight into fp32 bits plus one
  subtraction; the GEMM's tile decode: 16 codes per xmm shuffle over an int8 table, then int8 -> fp32),
  AVX-512 ``vpermps`` zmm over the 16 values, else integer bit arithmetic (``e2m1_x2_value``; CUDA too).
  ``e2m1_x2_table`` / ``e2m1_x2_lookup`` are that per-lane decode for any kernel whose lane loop is vectorised by
  16 (the fused MoE kernel's tiles use them too). ``e2m1_value`` (the fp16 bit trick: ((c & 7) << 9) |
  ((c & 8) << 12) is c's value times 2^-14 as fp16) is kept for the expert workspace's convert.
- E8M0 s -> reinterpret_f32(s << 23) = 2^(s-127) for s >= 1, and 0x00400000 (2^-127) for s = 0.
- E4M3 byte b -> reinterpret_f16(((b & 0x7F) << 7) | ((b & 0x80) << 8)) = value * 2^-8; the 2^8 goes into the
  block scale (exact: a power of two).
"""

from __future__ import annotations

import functools

import tvm
from tvm import te, tirx

from dayzero import UserError
from dayzero.passes.ir.formats import FP8_BLOCK_SIZE

_u16 = functools.partial(tirx.const, dtype="uint16")
_u32 = functools.partial(tirx.const, dtype="uint32")
f32 = functools.partial(tirx.const, dtype="float32")


def e2m1_value(code):
    """int E2M1 code (0..15) -> exact fp32 value, via the fp16 subnormal trick (see module docstring)."""
    u = code.astype("uint16")
    bits = ((u & _u16(7)) << _u16(9)) | ((u & _u16(8)) << _u16(12))
    return tirx.reinterpret("float16", bits).astype("float32") * f32(16384.0)


def e2m1_x2_value(code):
    """uint32 E2M1 code (0..15) -> exact fp32 2 * value, from integer bit arithmetic only (vectorises on any SIMD
    ISA, no fp16 conversion): magnitude m = code & 7 is 2v = m for m < 2, else the float with exponent and
    mantissa (m << 22) + bits(1.0), i.e. 2, 3, 4, 6, 8, 12; code bit 3 is the sign."""
    m = code & _u32(7)
    mag = tirx.Select(m >= _u32(2), (m << _u32(22)) + _u32(0x3F800000), m * _u32(0x3F800000))
    return tirx.reinterpret("float32", mag | ((code & _u32(8)) << _u32(28)))


def e8m0_value(s):
    """uint8 E8M0 code -> fp32 2^(s-127) (s = 0 gives the subnormal 2^-127; 0xFF is rejected by validators)."""
    u = s.astype("uint32")
    return tirx.reinterpret("float32", tirx.Select(u == _u32(0), _u32(0x400000), u << _u32(23)))


def e4m3_value_div256(b):
    """uint8 E4M3 byte -> fp32 value * 2^-8 (exact; NaN codes 0x7F/0xFF decode to 480/256, as no checkpoint has them)."""
    u = b.astype("uint16")
    bits = ((u & _u16(0x7F)) << _u16(7)) | ((u & _u16(0x80)) << _u16(8))
    return tirx.reinterpret("float16", bits).astype("float32")


def e2m1_x2_table(mode: str, c):
    """Entry c (0..15) of the 16-entry lookup table that ``e2m1_x2_lookup`` reads in MODE (``lookup_mode``):
    2 E2M1(c) as int8 (``pshufb``: -12..12) or fp32 (``permvar16``, and ``arith``, which reads no table)."""
    v = e2m1_x2_value(tirx.Cast("uint32", c))
    return tirx.Cast("int8", v) if mode == "pshufb" else v


def e2m1_x2_lookup(mode: str, table_lane, code):
    """fp32 2 E2M1(code) for code a uint8 0..15, the way MODE (``lookup_mode``) decodes: one ``pshufb`` xmm (AVX2)
    or ``vpermps`` zmm (AVX-512) per 16 codes over the table of ``e2m1_x2_table``, or integer bit arithmetic
    (``arith``: portable, CUDA). A table lookup is one lane of a vector instruction, so only meaningful inside a loop
    vectorised by exactly 16 whose lane i passes table_lane = table[i] (``arith`` ignores table_lane)."""
    if mode == "pshufb":
        return _pshufb16(table_lane, code).astype("float32")
    if mode == "permvar16":
        return _permvar(table_lane, tirx.Cast("int32", code))
    return e2m1_x2_value(tirx.Cast("uint32", code))


def _permvar(table_lane, index):
    """One lane of AVX-512 ``vpermps`` zmm: result lane i = table[index_i & 15], table = the 16 lanes of table_lane.

    Only meaningful inside a loop vectorised by exactly 16 whose lane i reads table[i]: the schedules below make
    sure of it (``check_lookup_lanes``)."""
    return tirx.call_llvm_pure_intrin("float32", "llvm.x86.avx512.permvar.sf.512", table_lane, index)


def _pshufb16(table_lane, index):
    """One lane of SSSE3 ``pshufb`` xmm: result lane i = table[index_i & 15] (index_i < 128), table = the 16 int8
    lanes of table_lane (same contract as ``_permvar``: a loop vectorised by exactly 16 whose lane i reads
    table[i])."""
    return tirx.call_llvm_pure_intrin("int8", "llvm.x86.ssse3.pshuf.b.128", table_lane,
                                      tirx.reinterpret("int8", index))


def is_cuda(target: dict) -> bool:
    return target.get("kind") == "cuda"


def has_feature(target: dict, feature: str) -> bool:
    import tvm.target.codegen as cg

    return target.get("kind") == "llvm" and bool(cg.target_has_features(feature, tvm.target.Target(target)))


def lookup_mode(target) -> str:
    """How MXFP4 codes become floats on TARGET (a target dict or tvm Target; see ``mxfp4_decode``): ``permvar16``
    (AVX-512), ``pshufb`` (AVX2: 256-bit FMAs, SSSE3 byte lookups), ``arith`` (anything else, CUDA included)."""
    if isinstance(target, tvm.target.Target):
        target = {k: v for k, v in target.export().items()}
    if has_feature(target, "avx512f"):
        return "permvar16"
    if has_feature(target, "avx2") and has_feature(target, "fma"):
        return "pshufb"
    return "arith"


def lookup_lanes(target: dict) -> int:
    """fp32 vector lanes of the decoded weights and accumulators: 16 on AVX-512 (a zmm), 8 otherwise (a ymm)."""
    return 16 if lookup_mode(target) == "permvar16" else 8


def check_dims(kind: str, out_features: int, in_features: int, n_tokens: int | None = None):
    if out_features <= 0 or in_features <= 0:
        raise UserError(f"{kind}: out/in features must be positive, got {out_features}x{in_features}")
    if kind.startswith("mxfp4") and in_features % 32:
        raise UserError(f"{kind}: MXFP4 needs in_features % 32 == 0, got {in_features}")
    if n_tokens is not None and not 1 <= n_tokens <= 64:
        raise UserError(f"{kind}: decode GEMV takes 1..64 tokens, got {n_tokens}")


def gemv_rows(T: int, O: int) -> int:
    """Output rows per parallel group of the GEMV: 8 at T = 1 (8 independent accumulator chains hide the FMA
    latency; measured best on znver3 among 2/4/8/16), then T * rows <= 16 accumulator vectors (at T = 4, 2 rows
    ran 1.7x slower than 4 and 8 rows the same). Divides O."""
    rows = max(1, min(8, 16 // T))
    while O % rows:
        rows -= 1
    return rows


def weight_args(fmt: str, O: int, K: int, E: int | None):
    lead = (E,) if E else ()
    if fmt == "mxfp4":
        w = te.placeholder((*lead, O, K // 32, 16), "uint8", name="blocks")
        s = te.placeholder((*lead, O, K // 32), "uint8", name="scales")
    else:
        w = te.placeholder((*lead, O, K), "uint8", name="weight")
        s = te.placeholder((*lead, -(-O // FP8_BLOCK_SIZE), -(-K // FP8_BLOCK_SIZE)), "float32", name="scale_inv")
    e = tirx.Var("expert", "int32") if E else None
    return w, s, e


def _at(e, *idx):
    return (e, *idx) if e is not None else idx


def mxfp4_decode(B, S, e, O: int, G: int, L: int, target: dict):
    """(wd, sc2): wd[o, g, p, l] = 2 E2M1(code of W[o, 32g + 2(qL + l) + h]), h, q = divmod(p, Q), Q = 16 / L,
    and sc2[o, g] = 2^(scales[o, g] - 128), so W = wd * sc2 exactly (a small integer times a power of two; code 0
    gives 2^-128, a subnormal, still exact). The kernels apply sc2 once per 32-value block, to the block's partial
    dot product, not to every weight. How the codes become values depends on the target (``lookup_mode``):

    - pshufb (AVX2 / SSSE3): one ``pshufb`` per 16 codes looks the nibbles up in a 16-byte table of the signed
      integers 2 E2M1(c) (-12..12), then int8 -> fp32 (vpmovsxbd + vcvtdq2ps): no table per block, no permute
      across lanes, half the shuffle-port work of a vpermps lookup on 32-bit lanes.
    - permvar16 (AVX-512): one ``vpermps`` zmm per 16 codes over the 16 values 2 E2M1(c) in one register.
    - arith (anything else, CUDA included): ``e2m1_x2_value``, integer bit arithmetic.
    """
    mode = lookup_mode(target)
    Q = 16 // L
    sc2 = te.compute((O, G), lambda o, g: e8m0_value(S[_at(e, o, g)]) * f32(0.5), name="sc2")

    def code(o, g, h, j, dtype="uint32"):
        return (tirx.Cast(dtype, B[_at(e, o, g, j)]) >> tirx.Cast(dtype, h * 4)) & tirx.const(15, dtype)

    if mode == "pshufb":  # the int8 lookup (wq) and its widening (wd) are scheduled apart
        q8 = te.compute((16,), lambda c: e2m1_x2_table(mode, c), name="q8")
        wq = te.compute((O, G, 2, 16), lambda o, g, h, j: _pshufb16(q8[j], code(o, g, h, j, "uint8")), name="wq")
        wd = te.compute((O, G, 32 // L, L), lambda o, g, p, l: wq[o, g, p // Q, (p % Q) * L + l].astype("float32"),
                        name="wd")
    elif mode == "permvar16":
        v2 = te.compute((16,), lambda c: e2m1_x2_table(mode, c), name="v2")
        wd = te.compute((O, G, 2, 16), lambda o, g, p, l: e2m1_x2_lookup(mode, v2[l], code(o, g, p, l)), name="wd")
    else:
        wd = te.compute((O, G, 32 // L, L), lambda o, g, p, l: e2m1_x2_lookup(
            mode, None, code(o, g, p // Q, (p % Q) * L + l)), name="wd")
    return wd, sc2


def fp8_wd(W, S, e, O: int, K: int):
    """wd[o, k] = E4M3(W[o, k]) * scale_inv[o // 128, k // 128] (fp32)."""
    sc = te.compute(
        (-(-O // FP8_BLOCK_SIZE), -(-K // FP8_BLOCK_SIZE)), lambda a, b: S[_at(e, a, b)] * f32(256.0), name="sc"
    )
    return te.compute(
        (O, K), lambda o, k: e4m3_value_div256(W[_at(e, o, k)]) * sc[o // FP8_BLOCK_SIZE, k // FP8_BLOCK_SIZE], name="wd"
    )


def kernel_args(x, w, s, e, y):
    return [x, w, s, e, y] if e is not None else [x, w, s, y]
