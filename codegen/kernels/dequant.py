"""Dequant-GEMV (decode) and dequant-GEMM (prefill) over low-precision weights read as published.

Every kernel computes ``y[t, o] = sum_k x[t, k] * W[o, k]`` with W given in its storage format (see
``dayzero.frontend.lowprec`` for the formats), never materialised in full:

    MXFP4   blocks uint8 [O, G, 16] + scales uint8 [O, G],   K = 32 G
            W[o, 32g + 2j + h] = E2M1((blocks[o, g, j] >> 4h) & 15) * 2^(scales[o, g] - 127)
    FP8     weight uint8 (E4M3 bytes) [O, K] + scale_inv fp32 [ceil(O/128), ceil(K/128)]
            W[o, k] = E4M3(weight[o, k]) * scale_inv[o // 128, k // 128]

With ``num_experts=E`` the weights carry a leading expert dim ([E, O, G, 16], [E, O, G]; [E, O, K],
[E, ceil(O/128), ceil(K/128)]) and the kernel takes an int32 ``expert`` argument selecting one of them.

Argument order of every PrimFunc:  x fp32 [T, K], weight..., scales..., [expert int32], y fp32 [T, O].
GEMV kernels have a static T (1..64 decode tokens); GEMM kernels a symbolic T (one compiled kernel serves every T).

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

Host CPU schedules (any x86: AVX2 and AVX-512 alike, lanes and tiles from the target's features):
- GEMV (``mxfp4_gemv``): parallel over groups of output rows (8 at T = 1: 8 independent accumulator chains);
  per row and block the 16 code bytes are read once, looked up into P vectors of L lanes in registers, each
  multiplied into every token's block partial sum, which is scaled once into the row's accumulator.
- GEMM: an [OT, K] weight tile is decoded (scale applied) into an L2-resident buffer once and reused for every
  token tile, with a rows x (tvec x V) register tile over a transposed, zero-padded copy of x: 4 x 3 ymm on
  AVX2, 4 x 4 zmm on AVX-512 (``_gemm_tile``).
CUDA: the same definitions, scheduled by dlight's GPU rules (GEMV / Matmul / Reduction / Fallback,
thread-bound); not hand-tuned yet.

Compiled kernels need 64-byte-aligned, offset-0 tensors (torch allocations are; numpy views may not be).
"""

from __future__ import annotations

import functools

import tvm
from tvm import te, tirx

from ... import InternalError, UserError

KERNELS = ("mxfp4_gemv", "mxfp4_gemm", "fp8_block_gemv", "fp8_block_gemm")
FP8_BLOCK = 128

_u16 = functools.partial(tirx.const, dtype="uint16")
_u32 = functools.partial(tirx.const, dtype="uint32")
_f32 = functools.partial(tirx.const, dtype="float32")


# ------------------------------------------------------------------------------------------ decoding
def e2m1_value(code):
    """int E2M1 code (0..15) -> exact fp32 value, via the fp16 subnormal trick (see module docstring)."""
    u = code.astype("uint16")
    bits = ((u & _u16(7)) << _u16(9)) | ((u & _u16(8)) << _u16(12))
    return tirx.reinterpret("float16", bits).astype("float32") * _f32(16384.0)


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
    sure of it (``_check_lookup_lanes``)."""
    return tirx.call_llvm_pure_intrin("float32", "llvm.x86.avx512.permvar.sf.512", table_lane, index)


def _pshufb16(table_lane, index):
    """One lane of SSSE3 ``pshufb`` xmm: result lane i = table[index_i & 15] (index_i < 128), table = the 16 int8
    lanes of table_lane (same contract as ``_permvar``: a loop vectorised by exactly 16 whose lane i reads
    table[i])."""
    return tirx.call_llvm_pure_intrin("int8", "llvm.x86.ssse3.pshuf.b.128", table_lane,
                                      tirx.reinterpret("int8", index))


# ------------------------------------------------------------------------------------------ targets
def _is_cuda(target: dict) -> bool:
    return target.get("kind") == "cuda"


def _num_threads(target: dict) -> int:
    return int(target.get("num-cores", 1))


def _has_feature(target: dict, feature: str) -> bool:
    import tvm.target.codegen as cg

    return target.get("kind") == "llvm" and bool(cg.target_has_features(feature, tvm.target.Target(target)))


def lookup_mode(target) -> str:
    """How MXFP4 codes become floats on TARGET (a target dict or tvm Target; see ``_mxfp4_decode``): ``permvar16``
    (AVX-512), ``pshufb`` (AVX2: 256-bit FMAs, SSSE3 byte lookups), ``arith`` (anything else, CUDA included)."""
    if isinstance(target, tvm.target.Target):
        target = {k: v for k, v in target.export().items()}
    if _has_feature(target, "avx512f"):
        return "permvar16"
    if _has_feature(target, "avx2") and _has_feature(target, "fma"):
        return "pshufb"
    return "arith"


def _lookup_lanes(target: dict) -> int:
    """fp32 vector lanes of the decoded weights and accumulators: 16 on AVX-512 (a zmm), 8 otherwise (a ymm)."""
    return 16 if lookup_mode(target) == "permvar16" else 8


def _vector_registers(target: dict) -> int:
    return 32 if _has_feature(target, "avx512f") else 16


def _gemv_rows(T: int, O: int) -> int:
    """Output rows per parallel group of the GEMV: 8 at T = 1 (8 independent accumulator chains hide the FMA
    latency; measured best on znver3 among 2/4/8/16), then T * rows <= 16 accumulator vectors (at T = 4, 2 rows
    ran 1.7x slower than 4 and 8 rows the same). Divides O."""
    rows = max(1, min(8, 16 // T))
    while O % rows:
        rows -= 1
    return rows


def _check_lookup_lanes(sch, loop, L: int):
    if int(sch.get(loop).extent) != L:
        raise InternalError(f"the vpermps lookup needs its loop vectorised by exactly {L} lanes")


# ------------------------------------------------------------------------------------------ definitions
def _check_dims(kind: str, out_features: int, in_features: int, n_tokens: int | None = None):
    if out_features <= 0 or in_features <= 0:
        raise UserError(f"{kind}: out/in features must be positive, got {out_features}x{in_features}")
    if kind.startswith("mxfp4") and in_features % 32:
        raise UserError(f"{kind}: MXFP4 needs in_features % 32 == 0, got {in_features}")
    if n_tokens is not None and not 1 <= n_tokens <= 64:
        raise UserError(f"{kind}: decode GEMV takes 1..64 tokens, got {n_tokens}")


def _weight_args(fmt: str, O: int, K: int, E: int | None):
    lead = (E,) if E else ()
    if fmt == "mxfp4":
        w = te.placeholder((*lead, O, K // 32, 16), "uint8", name="blocks")
        s = te.placeholder((*lead, O, K // 32), "uint8", name="scales")
    else:
        w = te.placeholder((*lead, O, K), "uint8", name="weight")
        s = te.placeholder((*lead, -(-O // FP8_BLOCK), -(-K // FP8_BLOCK)), "float32", name="scale_inv")
    e = tirx.Var("expert", "int32") if E else None
    return w, s, e


def _at(e, *idx):
    return (e, *idx) if e is not None else idx


def _mxfp4_decode(B, S, e, O: int, G: int, L: int, target: dict):
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
    sc2 = te.compute((O, G), lambda o, g: e8m0_value(S[_at(e, o, g)]) * _f32(0.5), name="sc2")

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


def _fp8_wd(W, S, e, O: int, K: int):
    """wd[o, k] = E4M3(W[o, k]) * scale_inv[o // 128, k // 128] (fp32)."""
    sc = te.compute(
        (-(-O // FP8_BLOCK), -(-K // FP8_BLOCK)), lambda a, b: S[_at(e, a, b)] * _f32(256.0), name="sc"
    )
    return te.compute(
        (O, K), lambda o, k: e4m3_value_div256(W[_at(e, o, k)]) * sc[o // FP8_BLOCK, k // FP8_BLOCK], name="wd"
    )


def _args(x, w, s, e, y):
    return [x, w, s, e, y] if e is not None else [x, w, s, y]


# ------------------------------------------------------------------------------------------ GEMV
def mxfp4_gemv(n_tokens: int, out_features: int, in_features: int, *, num_experts: int | None = None,
               target: dict) -> tirx.PrimFunc:
    """Decode dequant-GEMV, y[t, o] = sum_k x[t, k] * W[o, k], W in MXFP4.

    x       fp32  [T, K]           T = n_tokens (static, 1..64), K = in_features = 32 G
    blocks  uint8 [(E,) O, G, 16]  O = out_features
    scales  uint8 [(E,) O, G]
    expert  int32                  only with num_experts: which [O, G, 16] slab to read
    y       fp32  [T, O]
    Internally, with L fp32 lanes (``_lookup_lanes``), Q = 16 / L, P = 2Q vectors per block, p = h Q + q:
    xp[t, g, p, l] = x[t, 32g + 2(qL + l) + h] (the nibble order), wd / sc2 from ``_mxfp4_decode``,
    blk[t, o, g, l] = sum_p xp[t, g, p, l] wd[o, g, p, l] (one block's partial dot product, L lanes),
    part[t, o, l] = sum_g blk[t, o, g, l] sc2[o, g] (the scale applied once per block), y = sum_l part.
    """
    _check_dims("mxfp4_gemv", out_features, in_features, n_tokens)
    T, O, K, G = n_tokens, out_features, in_features, in_features // 32
    if lookup_mode(target) == "pshufb":
        return _mxfp4_gemv_avx2(T, O, K, num_experts).with_attr("tirx.is_scheduled", True)
    x = te.placeholder((T, K), "float32", name="x")
    B, S, e = _weight_args("mxfp4", O, K, num_experts)
    cuda = _is_cuda(target)
    L = 16 if cuda else _lookup_lanes(target)
    Q, P = 16 // L, 32 // L
    wd, sc2 = _mxfp4_decode(B, S, e, O, G, L, target)
    xp = te.compute((T, G, P, L), lambda t, g, p, l: x[t, g * 32 + ((p % Q) * L + l) * 2 + p // Q], name="xp")
    p_ = te.reduce_axis((0, P), "p")
    blk = te.compute((T, O, G, L), lambda t, o, g, l: te.sum(xp[t, g, p_, l] * wd[o, g, p_, l], axis=p_),
                     name="blk")
    g_ = te.reduce_axis((0, G), "g")
    part = te.compute((T, O, L), lambda t, o, l: te.sum(blk[t, o, g_, l] * sc2[o, g_], axis=g_), name="part")
    l_ = te.reduce_axis((0, L), "l")
    y = te.compute((T, O), lambda t, o: te.sum(part[t, o, l_], axis=l_), name="y")
    sch = tvm.s_tir.Schedule(te.create_prim_func(_args(x, B, S, e, y)))
    if cuda:
        return _cuda_rules(sch, target)
    _mxfp4_gemv_cpu(sch, _gemv_rows(T, O), L)
    return _done(sch)


_MAGIC = 0x4B  # pshufb table offset: 0x4B4B4B4B as fp32 is 2^23 + 0x4B4B4B, whose unit in the last place is 1.0


def _mxfp4_gemv_avx2(T_: int, O: int, K: int, E: int | None) -> tirx.PrimFunc:
    """The AVX2 decode GEMV, hand-vectorised (same arguments and numerics as ``mxfp4_gemv``; the TE form cannot
    regroup byte lanes into float lanes, which is what saves the int8 -> int32 widening and the conversion here).

    Per row and 32-value block: the 16 code bytes are widened once to two uint32x8 (vpmovzxbd from memory); each
    lane's nibble (``& 15`` / ``>> 4``) indexes ``vpshufb`` over a 32-byte table holding 0x4B + 2 E2M1(c), whose
    other three bytes come back as table[0] = 0x4B, so the lane's bits are 0x4B4B4B4B + 2 E2M1(c): the float
    2^23 + 0x4B4B4B + 2 E2M1(c) exactly, and one subtraction leaves 2 E2M1(c) (exact: integers below 2^24).
    The four vectors meet the activations (permuted into nibble order once per call) in a sum tree, the block's
    partial sum is scaled by sc2 once, into one accumulator per (token, row); rows per group from ``_gemv_rows``.
    """
    import struct

    from tvm.script import tirx as T

    G = K // 32
    R = _gemv_rows(T_, O)
    C = struct.unpack("<f", struct.pack("<I", _MAGIC * 0x01010101))[0]

    def codes(B, e, o, g, j):
        """uint32x8: blocks[(e,) o, g, j:j + 8] widened (bound once and used for both nibbles: with one use, LLVM
        narrows the nibble ops to bytes and widens each nibble separately, twice the widening work)"""
        return T.Cast("uint32x8", B[(e, o, g, T.Ramp(j, 1, 8)) if E else (o, g, T.Ramp(j, 1, 8))])

    def weights(LUT, u, h):
        """float32x8: 2 E2M1 of nibble h of the widened bytes u"""
        idx = u >> T.Broadcast(T.uint32(4), 8) if h else u & T.Broadcast(T.uint32(15), 8)
        bits = T.call_llvm_pure_intrin("int8x32", "llvm.x86.avx2.pshuf.b", LUT[T.Ramp(0, 1, 32)],
                                       T.reinterpret("int8x32", idx))
        return T.reinterpret("float32x8", bits) - T.Broadcast(T.float32(C), 8)

    def scale(S, e, o, g):
        return e8m0_value(S[(e, o, g) if E else (o, g)]) * T.float32(0.5)

    def table(i):
        return T.Cast("int8", T.Cast("int32", e2m1_x2_value(T.Cast("uint32", i % 16))) + _MAGIC)

    def xv(XP, t, g, p):
        return XP[t, g, p, T.Ramp(0, 1, 8)]

    @T.macro(hygienic=True)
    def body(X, B, S, e, Y):
        XP = T.alloc_buffer((T_, G, 4, 8), "float32")
        LUT = T.alloc_buffer((32,), "int8")
        for i in range(32):
            LUT[i] = table(i)
        for t, g, p in T.grid(T_, G, 4):
            for l in T.vectorized(8):
                XP[t, g, p, l] = X[t, g * 32 + ((p % 2) * 8 + l) * 2 + p // 2]
        for oo in T.parallel(O // R):
            SC = T.alloc_buffer((R, G), "float32", scope="local")
            ACC = T.alloc_buffer((T_ * R, 8), "float32", scope="local")
            for r in range(R):
                for g in T.vectorized(G):
                    SC[r, g] = scale(S, e, oo * R + r, g)
            for i in T.unroll(T_ * R):
                for l in T.vectorized(8):
                    ACC[i, l] = T.float32(0)
            for g in range(G):
                for r in T.unroll(R):
                    u0 = codes(B, e, oo * R + r, g, 0)
                    u1 = codes(B, e, oo * R + r, g, 8)
                    w00 = weights(LUT, u0, 0)  # (h, q) = (0, 0): xp p = 0
                    w10 = weights(LUT, u0, 1)  # (1, 0): p = 2
                    w01 = weights(LUT, u1, 0)  # (0, 1): p = 1
                    w11 = weights(LUT, u1, 1)  # (1, 1): p = 3
                    for t in T.unroll(T_):
                        ACC[t * R + r, T.Ramp(0, 1, 8)] = ACC[t * R + r, T.Ramp(0, 1, 8)] + (
                            (xv(XP, t, g, 0) * w00 + xv(XP, t, g, 1) * w01)
                            + (xv(XP, t, g, 2) * w10 + xv(XP, t, g, 3) * w11)) * T.Broadcast(SC[r, g], 8)
            for t, r in T.grid(T_, R):
                Y[t, oo * R + r] = T.float32(0)
                for l in range(8):
                    Y[t, oo * R + r] = Y[t, oo * R + r] + ACC[t * R + r, l]

    if E:
        @T.prim_func
        def with_expert(x: T.Buffer((T_, K), "float32"), blocks: T.Buffer((E, O, G, 16), "uint8"),
                        scales: T.Buffer((E, O, G), "uint8"), expert: T.int32, y: T.Buffer((T_, O), "float32")):
            T.func_attr({"tirx.noalias": True})
            body(x, blocks, scales, expert, y)
        return with_expert

    @T.prim_func
    def one(x: T.Buffer((T_, K), "float32"), blocks: T.Buffer((O, G, 16), "uint8"),
            scales: T.Buffer((O, G), "uint8"), y: T.Buffer((T_, O), "float32")):
        T.func_attr({"tirx.noalias": True})
        body(x, blocks, scales, None, y)
    return one


def fp8_block_gemv(n_tokens: int, out_features: int, in_features: int, *, num_experts: int | None = None,
                   target: dict) -> tirx.PrimFunc:
    """Decode dequant-GEMV, y[t, o] = sum_k x[t, k] * W[o, k], W in FP8 E4M3 with 128x128 block scales.

    x         fp32  [T, K]                                T = n_tokens (static, 1..64)
    weight    uint8 [(E,) O, K]                           E4M3 bytes (a float8_e4m3fn tensor viewed as uint8)
    scale_inv fp32  [(E,) ceil(O/128), ceil(K/128)]       partial edge blocks allowed
    expert    int32                                       only with num_experts
    y         fp32  [T, O]
    Internally part[t, o, l] = sum_{k % 16 == l} x[t, k] * W[o, k] (16 lanes; K padded to 16 with zeros in x).
    """
    _check_dims("fp8_block_gemv", out_features, in_features, n_tokens)
    T, O, K = n_tokens, out_features, in_features
    x = te.placeholder((T, K), "float32", name="x")
    Wt, S, e = _weight_args("fp8", O, K, num_experts)
    wd = _fp8_wd(Wt, S, e, O, K)
    kp = -(-K // 16) * 16
    xpad = te.compute((T, kp), lambda t, k: tirx.if_then_else(k < K, x[t, tirx.min(k, K - 1)], _f32(0.0)),
                      name="xpad")
    k_ = te.reduce_axis((0, kp), "k")
    y = te.compute((T, O), lambda t, o: te.sum(xpad[t, k_] * wd[o, tirx.min(k_, K - 1)], axis=k_), name="y")
    sch = tvm.s_tir.Schedule(te.create_prim_func(_args(x, Wt, S, e, y)))
    if _is_cuda(target):
        return _cuda_rules(sch, target)
    else:
        _fp8_gemv_cpu(sch, K)
    return _done(sch)


def _mxfp4_gemv_cpu(sch, rows: int, L: int):
    """Parallel over groups of ``rows`` output rows. Per 32-value block g and row o: the block's codes are looked
    up (``wq``, two 16-byte vectors) and widened vector by vector (``wd``, L lanes, in registers), each vector
    multiplied into the block partial sums of every token (``blk``), which are then scaled once into the row's
    accumulators (``part``). Loop nest under the row group: g / o / (p / t / l) then (t / l)."""
    by = sch.get_sblock("y")
    t, o, l = sch.get_loops(by)
    oo, oi = sch.split(o, [None, rows])
    sch.reorder(oo, oi, t, l)
    sch.parallel(oo)
    bp = sch.get_sblock("part")
    sch.compute_at(bp, oo)
    sch.set_scope(bp, 0, "local")
    own = _loops_by_iter(sch, bp, oo)
    sch.reorder(*[own[n] for n in ("g", "o", "t", "l") if n in own])
    sch.vectorize(own["l"])
    for n in ("o", "t"):
        if n in own:
            sch.unroll(own[n])
    at_row = own["o"] if "o" in own else own["g"]
    bb = sch.get_sblock("blk")
    sch.compute_at(bb, at_row)
    sch.set_scope(bb, 0, "local")
    ob = _loops_by_iter(sch, bb, at_row)
    sch.reorder(*[ob[n] for n in ("p", "t", "l") if n in ob])
    sch.vectorize(ob["l"])
    for n in ("p", "t"):
        if n in ob:
            sch.unroll(ob[n])
    bw = sch.get_sblock("wd")
    sch.compute_at(bw, ob["p"])
    sch.set_scope(bw, 0, "local")
    lw = sch.get_loops(bw)[-1]
    _check_lookup_lanes(sch, lw, L)
    sch.vectorize(lw)
    if _has_block(sch, "wq"):
        bq = sch.get_sblock("wq")
        sch.compute_at(bq, at_row)
        sch.set_scope(bq, 0, "local")
        lq = sch.get_loops(bq)
        _check_lookup_lanes(sch, lq[-1], 16)
        sch.vectorize(lq[-1])
        sch.unroll(lq[-2])
    bs = sch.get_sblock("sc2")
    sch.compute_at(bs, oo)
    sch.set_scope(bs, 0, "local")
    sch.vectorize(sch.split(sch.get_loops(bs)[-1], [None, 8])[-1])
    sch.decompose_reduction(bb, ob["p"])
    init = sch.decompose_reduction(bp, own["g"])
    sch.vectorize(sch.get_loops(init)[-1])
    sch.vectorize(sch.get_loops(sch.get_sblock("xp"))[-1])


def _loops_by_iter(sch, block, above) -> dict:
    """{iter name: loop} for the loops that compute_at created for BLOCK under loop ABOVE, keyed by the block iter
    each one drives (TE names iters after the compute's axes: v_t -> "t"; unit extents get no loop)."""
    loops = sch.get_loops(block)
    top = [sch.get(lp).same_as(sch.get(above)) for lp in loops].index(True)
    realize = sch.get(loops[-1]).body
    if not isinstance(realize, tvm.s_tir.SBlockRealize):
        raise InternalError(f"expected the block directly under its innermost loop, got {type(realize).__name__}")
    by_var = {sch.get(lp).loop_var.name: lp for lp in loops[top + 1:]}
    out = {}
    for iv, val in zip(realize.block.iter_vars, realize.iter_values):
        own = [v.name for v in tirx.analysis.undefined_vars(val) if v.name in by_var]
        if len(own) == 1:
            out[iv.var.name.removeprefix("v_")] = by_var[own[0]]
    return out


def _has_block(sch, name: str) -> bool:
    try:
        sch.get_sblock(name)
        return True
    except Exception:  # noqa: BLE001 - tvm raises a ScheduleError subclass
        return False


def _fp8_gemv_cpu(sch, K: int, rows: int = 4):
    by = sch.get_sblock("y")
    t, o, k = sch.get_loops(by)
    T, O = int(sch.get(t).extent), int(sch.get(o).extent)
    rows = rows if O % rows == 0 else (2 if O % 2 == 0 else 1)
    nko = -(-K // 16)
    ko, kl = sch.split(k, [nko, 16])
    rf = sch.rfactor(kl, 2)  # y_rf[t, o, l] = sum_ko: 16 lanes of partial sums per (t, o)
    sch.compute_inline(sch.get_sblock("wd"))
    sch.compute_inline(sch.get_sblock("sc"))
    sch.set_scope(rf, 0, "local")
    ty, oy, ly = sch.get_loops(by)
    oyo, oyi = sch.split(oy, [None, rows])
    sch.reorder(oyo, oyi, ty, ly)
    sch.parallel(oyo)
    sch.compute_at(rf, oyo)
    # compute_at lays the new loops out in block-iter order (lane, t, o, ko), dropping unit extents
    own = dict(zip([n for n, ext in (("l", 16), ("t", T), ("o", rows), ("ko", nko)) if ext > 1],
                   sch.get_loops(rf)[1:]))
    order = [own[n] for n in ("ko", "o", "t", "l") if n in own]
    sch.reorder(*order)
    sch.vectorize(own["l"])
    for n in ("o", "t"):
        if n in own:
            sch.unroll(own[n])
    init = sch.decompose_reduction(rf, order[0])
    sch.vectorize(sch.get_loops(init)[-1])
    bx = sch.get_sblock("xpad")
    sch.vectorize(sch.split(sch.get_loops(bx)[-1], [None, 16])[-1])


# ------------------------------------------------------------------------------------------ GEMM
def mxfp4_gemm(out_features: int, in_features: int, *, num_experts: int | None = None,
               target: dict) -> tirx.PrimFunc:
    """Prefill dequant-GEMM, y[t, o] = sum_k x[t, k] * W[o, k], W in MXFP4, T symbolic (any T >= 1).

    x       fp32  [T, K]           K = 32 G
    blocks  uint8 [(E,) O, G, 16]
    scales  uint8 [(E,) O, G]
    expert  int32                  only with num_experts
    y       fp32  [T, O]
    Internally (L, Q, P, p as in ``mxfp4_gemv``, tt = ``_token_tile``): wdec[o, g, p, l] = wd * sc2 (the exact
    weight, decoded tile by tile), xt[b, g, p, l, i] = x[tt b + i, 32g + 2(qL + l) + h] (0 past T; token tiles
    outermost so one tile's activations are contiguous), yt[o, tp] = sum_{g,p,l} wdec[o, g, p, l] xt[tp // tt,
    g, p, l, tp % tt], y[t, o] = yt[o, t].
    """
    _check_dims("mxfp4_gemm", out_features, in_features)
    O, K, G = out_features, in_features, in_features // 32
    T = te.var("T")
    tt = _token_tile(target)
    Tp = (T + (tt - 1)) // tt * tt
    x = te.placeholder((T, K), "float32", name="x")
    B, S, e = _weight_args("mxfp4", O, K, num_experts)
    L = 16 if _is_cuda(target) else _lookup_lanes(target)
    Q, P = 16 // L, 32 // L
    wd, sc2 = _mxfp4_decode(B, S, e, O, G, L, target)
    wdec = te.compute((O, G, P, L), lambda o, g, p, l: wd[o, g, p, l] * sc2[o, g], name="wdec")
    xt = te.compute((Tp // tt, G, P, L, tt), lambda b, g, p, l, i: tirx.if_then_else(
        b * tt + i < T, x[tirx.min(b * tt + i, T - 1), g * 32 + ((p % Q) * L + l) * 2 + p // Q], _f32(0.0)),
        name="xt")
    g_, p_, l_ = te.reduce_axis((0, G), "g"), te.reduce_axis((0, P), "p"), te.reduce_axis((0, L), "l")
    yt = te.compute((O, Tp), lambda o, t: te.sum(wdec[o, g_, p_, l_] * xt[t // tt, g_, p_, l_, t % tt],
                                                 axis=[g_, p_, l_]), name="yt")
    y = te.compute((T, O), lambda t, o: yt[o, t], name="y")
    sch = tvm.s_tir.Schedule(te.create_prim_func(_args(x, B, S, e, y)))
    if _is_cuda(target):
        return _cuda_rules(sch, target)
    _gemm_cpu(sch, O, K, "mxfp4", target)
    return _done(sch)


def fp8_block_gemm(out_features: int, in_features: int, *, num_experts: int | None = None,
                   target: dict) -> tirx.PrimFunc:
    """Prefill dequant-GEMM, y[t, o] = sum_k x[t, k] * W[o, k], W in FP8 E4M3 + 128x128 scale_inv, T symbolic.

    x         fp32  [T, K]
    weight    uint8 [(E,) O, K]
    scale_inv fp32  [(E,) ceil(O/128), ceil(K/128)]
    expert    int32              only with num_experts
    y         fp32  [T, O]
    Internally xt[b, k, i] = x[64b + i, k] (0 past T), yt[o, tp] = sum_k wd[o, k] * xt[tp // 64, k, tp % 64],
    y[t, o] = yt[o, t].
    """
    _check_dims("fp8_block_gemm", out_features, in_features)
    O, K = out_features, in_features
    T = te.var("T")
    tt = _token_tile(target)
    Tp = (T + (tt - 1)) // tt * tt
    x = te.placeholder((T, K), "float32", name="x")
    Wt, S, e = _weight_args("fp8", O, K, num_experts)
    wd = _fp8_wd(Wt, S, e, O, K)
    xt = te.compute((Tp // tt, K, tt), lambda b, k, i: tirx.if_then_else(
        b * tt + i < T, x[tirx.min(b * tt + i, T - 1), k], _f32(0.0)), name="xt")
    k_ = te.reduce_axis((0, K), "k")
    yt = te.compute((O, Tp), lambda o, t: te.sum(wd[o, k_] * xt[t // tt, k_, t % tt], axis=k_), name="yt")
    y = te.compute((T, O), lambda t, o: yt[o, t], name="y")
    sch = tvm.s_tir.Schedule(te.create_prim_func(_args(x, Wt, S, e, y)))
    if _is_cuda(target):
        return _cuda_rules(sch, target)
    else:
        _gemm_cpu(sch, O, K, "fp8", target)
    return _done(sch)


def _gemm_tile(target: dict) -> tuple[int, int, int]:
    """(weight rows, token vectors, lanes) of the GEMM register tile: rows x tvec accumulator vectors of V lanes,
    plus tvec activation loads and one broadcast weight, within the vector registers: 4 x 4 zmm on AVX-512,
    4 x 3 ymm on AVX2 (16 registers; a 4 x 4 ymm tile of 16 accumulators spills)."""
    if _is_cuda(target) or _has_feature(target, "avx512f"):
        return 4, 4, 16
    return 4, 3, 8


def _token_tile(target: dict) -> int:
    """Tokens per GEMM tile: the register tile's token vectors x lanes (64 on AVX-512, 24 on AVX2)."""
    _, tvec, V = _gemm_tile(target)
    return tvec * V


def _gemm_cpu(sch, O: int, K: int, fmt: str, target: dict):
    """yt tile loops: o_outer (parallel, OT rows) / t_outer / o_mid / k... / o_inner(rows) / t (tvec x V lanes).

    The decoded [OT, K] weight tile (``wd`` / ``wdec``) is made once per o_outer and reused for every token tile;
    OT keeps it within about half of a 512 KiB L2 so the token tile's activations fit beside it."""
    orows, tvec, V = _gemm_tile(target)
    ot = max(orows, min(64, (256 * 1024) // (4 * K) // orows * orows))
    while O % ot and ot > orows:
        ot -= orows
    if O % ot:
        ot, orows = 1, 1
    byt = sch.get_sblock("yt")
    loops = sch.get_loops(byt)
    o, t, red = loops[0], loops[1], loops[2:]
    o_o, o_m, o_i = sch.split(o, [None, ot // orows, orows])
    t_o, t_i = sch.split(t, [None, V * tvec])
    sch.reorder(o_o, t_o, o_m, *red, o_i, t_i)
    sch.parallel(o_o)
    acc = sch.cache_write(byt, 0, "local")
    sch.reverse_compute_at(acc, o_m)
    sch.vectorize(sch.split(sch.get_loops(acc)[-1], [None, V])[-1])
    sch.unroll(o_i)
    t_io, t_ii = sch.split(t_i, [tvec, V])
    sch.unroll(t_io)
    sch.vectorize(t_ii)
    init = sch.decompose_reduction(byt, red[0])
    sch.vectorize(sch.split(sch.get_loops(init)[-1], [None, V])[-1])
    if fmt == "mxfp4":
        bw = sch.get_sblock("wdec")
        sch.compute_at(bw, o_o)  # decode the [OT, K] tile once, reuse it for every token tile
        lw = sch.get_loops(bw)  # o_o / o / g / p / l
        sch.vectorize(lw[-1])
        sch.unroll(lw[-2])
        sch.compute_inline(sch.get_sblock("sc2"))
        bd = sch.get_sblock("wd")
        if _has_block(sch, "wq"):
            sch.compute_inline(bd)
            bq = sch.get_sblock("wq")
            sch.compute_at(bq, lw[-3])
            sch.set_scope(bq, 0, "local")
            lq = sch.get_loops(bq)
            _check_lookup_lanes(sch, lq[-1], 16)
            sch.vectorize(lq[-1])
            sch.unroll(lq[-2])
        else:
            sch.compute_inline(bd)
    else:
        bw = sch.get_sblock("wd")
        sch.compute_at(bw, o_o)
        sch.compute_inline(sch.get_sblock("sc"))
        lw = sch.get_loops(bw)
        ko, ki = sch.split(lw[-1], [None, V])
        sch.vectorize(ki)
    bx = sch.get_sblock("xt")
    lx = sch.get_loops(bx)
    sch.parallel(lx[0])
    sch.vectorize(sch.split(lx[-1], [None, V])[-1])
    by = sch.get_sblock("y")
    ty, oy = sch.get_loops(by)
    sch.parallel(ty)


# ------------------------------------------------------------------------------------------ CUDA
def _cuda_rules(sch, target: dict) -> tirx.PrimFunc:
    """CUDA: the decode stages are inlined into the reduction, then dlight's GPU rules, first that applies:
    GEMV (thread-bound reduction), Matmul, Reduction, Fallback. Rule-based, not hand-tuned: numbers on a GPU come
    from tools/gpu_dequant_check.py."""
    from tvm.s_tir import dlight as dl

    func = sch.mod["main"]
    mod = tvm.IRModule({"main": func})
    with tvm.target.Target(target):
        mod = dl.ApplyDefaultSchedule(dl.gpu.GEMV(), dl.gpu.Matmul(), dl.gpu.Reduction(), dl.gpu.Fallback())(mod)
    return mod["main"].with_attr("tirx.is_scheduled", True)


# ------------------------------------------------------------------------------------------ build
def _done(sch) -> tirx.PrimFunc:
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


_CACHE: dict = {}


def build(kind: str, *args, target: dict, **kwargs):
    """Compile kernel KIND (one of KERNELS) for TARGET; cached per (kind, args, target). Returns the callable."""
    if kind not in KERNELS:
        raise UserError(f"unknown dequant kernel {kind!r}; expected one of {', '.join(KERNELS)}")
    key = (kind, args, tuple(sorted(kwargs.items())), tuple(sorted((k, str(v)) for k, v in target.items())))
    if key not in _CACHE:
        func = globals()[kind](*args, target=target, **kwargs)
        lib = tvm.compile(tvm.IRModule({"main": func}), target=target)
        _CACHE[key] = lib if _is_cuda(target) else lib["main"]
    return _CACHE[key]
