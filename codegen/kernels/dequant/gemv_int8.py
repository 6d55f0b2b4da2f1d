"""Integer MXFP4 decode GEMV: y[t, o] ~= sum_k x[t, k] * W[o, k] with x quantised to int8 per 32-block.

The fp32 GEMV (``gemv.mxfp4_gemv``) decodes every FP4 code to fp32 and does one FMA per weight: at one token that
is more instructions than the 4.25 bits per weight take to arrive from memory. Here, as CPU engines that reach the
read bandwidth do, the dot product runs on bytes:

    qx[t, k]  = round(x[t, k] / sx[t, g]),  sx[t, g] = max_{k in block g} |x[t, k]| / 127      (int8, -127..127)
    w2[o, k]  = 2 E2M1(code of W[o, k])                                                        (int, -12..12)
    y[t, o]   = sum_g (sum_{k in g} w2[o, k] qx[t, k]) * 2^(scales[o, g] - 128) * sx[t, g]

The inner sum is exact in int32; both scales are applied once per block. It is not the fp32 result: x is rounded
to 8 bits per block (relative error of a block's dot product ~ 2^-9; measured in tests/test_dequant_int8.py and
``dayzero bench dequant``). Weights stay exact.

How a block becomes bytes (per row, ``W`` blocks per vector: 4 on AVX-512 (zmm), 2 on AVX2 (ymm), 1 for the tail):
the 16W code bytes are one load; low / high nibbles index ``pshufb`` over a 16-byte table of u[c] = 2 E2M1(c) + 12
(0..24, unsigned: the byte dot products take one unsigned operand), giving the even / odd k of each block. The
activations were quantised once per call into the same nibble order (QXL: even k, QXH: odd k, 16 bytes per block
each). Then per int32 lane (4 bytes of one block):

    vnni    vpdpbusd(acc, u, qx)                       acc += sum of 4 u8 * s8 products (AVX512-VNNI)
    maddubs vpmaddwd(vpmaddubsw(u, qx), 1) + acc        the same sum: no saturation, |2 * 24 * 127| < 2^15 (AVX2)

The accumulator starts at CORR = -12 * (the lane's 8 activations' sum), so it ends at sum w2 * qx exactly; it is
converted to fp32 and multiplied by the lane's block scale sw * sx (one vector per W blocks, the E8M0 scales widened
by a shuffle) into the row's fp32 accumulator. Rows per parallel group as the fp32 GEMV (``decode.gemv_rows``).

Route: ``int8_route`` says when ``gemv.mxfp4_gemv`` takes this kernel (x86 with AVX2 or AVX512-VNNI + BW, T <=
``INT8_MAX_T``); ``int8=False`` there keeps the exact fp32 kernel.
"""

from __future__ import annotations

from tvm import tirx

from dayzero import UserError
from dayzero.codegen.kernels.dequant.decode import check_dims, e2m1_x2_value, e8m0_value, gemv_rows, has_feature
from dayzero.codegen.tvmscript import parsed_shallow

# decode batches take the integer route; more tokens stay exact. Not a speed crossover: 2880 x 2880, one core, weights
# hot, the integer GEMV took 0.49x the fp32 one's time at T = 1, 0.6x at T = 4 to 16, 0.41x at T = 32
INT8_MAX_T = 16
_BIAS = 12  # u = 2 E2M1 + 12 >= 0

# (vector bits) -> LLVM intrinsic
_PSHUFB = {128: "llvm.x86.ssse3.pshuf.b.128", 256: "llvm.x86.avx2.pshuf.b", 512: "llvm.x86.avx512.pshuf.b.512"}
_VPDPBUSD = {128: "llvm.x86.avx512.vpdpbusd.128", 256: "llvm.x86.avx512.vpdpbusd.256",
             512: "llvm.x86.avx512.vpdpbusd.512"}
_PMADDUBSW = {128: "llvm.x86.ssse3.pmadd.ub.sw.128", 256: "llvm.x86.avx2.pmadd.ub.sw",
              512: "llvm.x86.avx512.pmaddubs.w.512"}
_PMADDWD = {128: "llvm.x86.sse2.pmadd.wd", 256: "llvm.x86.avx2.pmadd.wd", 512: "llvm.x86.avx512.pmaddw.d.512"}


def int8_mode(target: dict) -> str | None:
    """The integer dot product TARGET has: ``vnni`` (AVX512-VNNI + BW + VL: vpdpbusd, 4 blocks per zmm),
    ``maddubs`` (AVX2: vpmaddubsw + vpmaddwd, 2 blocks per ymm), or None (no integer route: not x86, or no AVX2)."""
    if target.get("kind") != "llvm":
        return None
    if all(has_feature(target, f) for f in ("avx512vnni", "avx512bw", "avx512vl")):
        return "vnni"
    if has_feature(target, "avx2"):
        return "maddubs"
    return None


def int8_route(target: dict, n_tokens: int, int8: bool | None = None) -> bool:
    """Whether the MXFP4 decode GEMV of n_tokens tokens runs on integers (this file) on TARGET: with ``int8=None``
    (the default) when the target has an integer mode (``int8_mode``) and n_tokens <= INT8_MAX_T; ``int8=False``
    never (the exact fp32 kernel); ``int8=True`` always, a UserError where the target has no integer mode."""
    mode = int8_mode(target)
    if int8 is True and mode is None:
        raise UserError(f"the integer MXFP4 GEMV needs an x86 target with AVX2, got {target}")
    if int8 is None:
        return mode is not None and n_tokens <= INT8_MAX_T
    return bool(int8)


def mxfp4_gemv_int8(n_tokens: int, out_features: int, in_features: int, *, num_experts: int | None = None,
                    target: dict) -> tirx.PrimFunc:
    """The integer decode GEMV (module docstring); same arguments as ``gemv.mxfp4_gemv``:

    x       fp32  [T, K]           T = n_tokens (static, 1..64), K = in_features = 32 G
    blocks  uint8 [(E,) O, G, 16]
    scales  uint8 [(E,) O, G]
    expert  int32                  only with num_experts
    y       fp32  [T, O]
    """
    check_dims("mxfp4_gemv", out_features, in_features, n_tokens)
    mode = int8_mode(target)
    if mode is None:
        raise UserError(f"the integer MXFP4 GEMV needs an x86 target with AVX2, got {target}")
    return _kernel(n_tokens, out_features, in_features, num_experts, gemv_rows(n_tokens, out_features), mode)


class Int8Blocks:
    """The integer block dot products of one mode (``int8_mode``) as TIR pieces, shared by this GEMV and the fused
    MoE kernel's decode tiles (codegen/kernels/moe.py). A quantised row is G blocks: ``QL`` / ``QH`` int8 [rows G
    16] (the first / second 16 values of each block in the order the code bytes' low / high nibbles stand for),
    ``CORR`` int32 [rows G 4] (-12 x each lane's 8 values' sum) and ``SX4`` fp32 [rows G 4] (sx per lane).

    ``WMAX``: blocks per main step (4 on vnni, 2 on maddubs); ``fill_lut(LUT)``: the 64-byte pshufb table of u;
    ``quantise_row(xv, QL, QH, CORR, SX4, row, G)``: quantise row ``row`` from ``xv(g, h, j)``, the fp32 value the
    (h = 0: low, 1: high) nibble of code byte j of block g multiplies; ``block_dots(...)``: W blocks of one weight
    row against one quantised row (float32 x 4W, scaled); ``sw_lanes``: the weight scales widened to those lanes."""

    def __init__(self, mode: str):
        from tvm.script import tirx as T

        self.mode = mode
        self.WMAX = 4 if mode == "vnni" else 2

        @T.macro(hygienic=True)
        def fill_lut(LUT):
            for i in range(64):
                LUT[i] = T.Cast("int8", T.Cast("int32", e2m1_x2_value(T.Cast("uint32", i % 16))) + _BIAS)

        @T.macro(hygienic=True)
        def quantise_row(xv, QL, QH, CORR, SX4, row, G):
            AM = T.alloc_buffer((1,), "float32", scope="local")
            for g in range(G):
                AM[0] = T.float32(0)
                for h, j in T.grid(2, 16):
                    AM[0] = T.max(AM[0], T.fabs(xv(g, h, j)))
                inv = T.Select(AM[0] > T.float32(0), T.float32(127) / AM[0], T.float32(0))
                for j in T.vectorized(16):
                    QL[(row * G + g) * 16 + j] = T.Cast("int8", T.round(xv(g, 0, j) * inv))
                    QH[(row * G + g) * 16 + j] = T.Cast("int8", T.round(xv(g, 1, j) * inv))
                for jj in range(4):
                    CORR[(row * G + g) * 4 + jj] = T.int32(0)
                    for j in range(4):
                        CORR[(row * G + g) * 4 + jj] = CORR[(row * G + g) * 4 + jj] - T.int32(_BIAS) * (
                            T.Cast("int32", QL[(row * G + g) * 16 + jj * 4 + j])
                            + T.Cast("int32", QH[(row * G + g) * 16 + jj * 4 + j]))
                    SX4[(row * G + g) * 4 + jj] = AM[0] * T.float32(1.0 / 127)
        self.fill_lut, self.quantise_row = fill_lut, quantise_row

    @staticmethod
    def vec(buf, start, n):
        from tvm.script import tirx as T

        return buf[T.Ramp(start, 1, n)]

    def dot(self, acc, u, q, nb):
        """acc (int32 x nb/4) + per lane the sum of 4 products u (u8) * q (s8), nb bytes each."""
        from tvm.script import tirx as T

        bits = 8 * nb
        if self.mode == "vnni":
            return T.call_llvm_pure_intrin(f"int32x{nb // 4}", _VPDPBUSD[bits], acc, u, q)
        p16 = T.call_llvm_pure_intrin(f"int16x{nb // 2}", _PMADDUBSW[bits], u, q)
        return acc + T.call_llvm_pure_intrin(f"int32x{nb // 4}", _PMADDWD[bits], p16,
                                             T.Broadcast(T.int16(1), nb // 2))

    def lookup(self, LUT, idx, nb):
        from tvm.script import tirx as T

        return T.call_llvm_pure_intrin(f"int8x{nb}", _PSHUFB[8 * nb], self.vec(LUT, 0, nb),
                                       T.reinterpret(f"int8x{nb}", idx))

    def sw_lanes(self, SWV, i0, W):
        """float32 x 4W: lane i = SWV[i0 + i // 4] (a row's block scales, widened by a shuffle)"""
        from tvm.script import tirx as T

        if W == 1:
            return T.Broadcast(SWV[i0], 4)
        return T.Shuffle([self.vec(SWV, i0, W)] * 4, [w for w in range(W) for _ in range(4)])

    def block_dots(self, BF, base, W, LUT, QL, QH, CORR, SX4, q0, swl):
        """float32 x 4W: lane i = (the 8 products of lane i % 4 of block i // 4) * sw * sx, for the W blocks of
        code bytes at BF[base:] against quantised blocks q0.. (rows G + g) of QL/QH/CORR/SX4; ``swl``: the
        blocks' weight scales per lane (``sw_lanes``)."""
        from tvm.script import tirx as T

        nb, n, c = 16 * W, 4 * W, self.vec(BF, base, 16 * W)
        u_lo = self.lookup(LUT, c & T.Broadcast(T.uint8(15), nb), nb)
        u_hi = self.lookup(LUT, c >> T.Broadcast(T.uint8(4), nb), nb)
        acc = self.dot(self.vec(CORR, q0 * 4, n), u_lo, self.vec(QL, q0 * 16, nb), nb)
        acc = self.dot(acc, u_hi, self.vec(QH, q0 * 16, nb), nb)
        return T.Cast(f"float32x{n}", acc) * (swl * self.vec(SX4, q0 * 4, n))


@parsed_shallow
def _kernel(T_: int, O: int, K: int, E: int | None, R: int, mode: str) -> tirx.PrimFunc:
    from tvm.script import tirx as T

    G = K // 32
    ib = Int8Blocks(mode)
    WMAX = ib.WMAX
    main, rest = divmod(G, WMAX)  # G = main vectors of WMAX blocks, then a 2-block and a 1-block step for the rest

    def sw_value(S, e, o, g):
        """2^(scales[(e,) o, g] - 128): the block scale of the doubled codes"""
        return e8m0_value(S[(e, o, g) if E else (o, g)]) * T.float32(0.5)

    def base_of(e, o, g0):
        return ((e * O + o) * G + g0) * 16 if E else (o * G + g0) * 16

    def block_dots(BF, SWV, e, o, r, g0, W, LUT, QXL, QXH, CORR, SX4, t):
        """float32 x 4W: lane i = (its 8 products of row o, block g0 + i // 4, token t) * sw * sx"""
        return ib.block_dots(BF, base_of(e, o, g0), W, LUT, QXL, QXH, CORR, SX4, t * G + g0,
                             ib.sw_lanes(SWV, r * G + g0, W))

    @T.macro(hygienic=True)
    def apply_step(BF, SWV, e, o, r, g0, W, LUT, QXL, QXH, CORR, SX4, ACC):
        for t in T.unroll(T_):
            ACC[T.Ramp((t * R + r) * 16, 1, 4 * W)] = ACC[T.Ramp((t * R + r) * 16, 1, 4 * W)] + block_dots(
                BF, SWV, e, o, r, g0, W, LUT, QXL, QXH, CORR, SX4, t)

    @T.macro(hygienic=True)
    def main_step(BF, SWV, e, o, r, g0, LUT, QXL, QXH, CORR, SX4, ACC):
        apply_step(BF, SWV, e, o, r, g0, WMAX, LUT, QXL, QXH, CORR, SX4, ACC)

    @T.macro(hygienic=True)
    def tail_steps(BF, SWV, e, o, r, LUT, QXL, QXH, CORR, SX4, ACC):
        if rest >= 2:
            apply_step(BF, SWV, e, o, r, G - rest, 2, LUT, QXL, QXH, CORR, SX4, ACC)
        if rest % 2 == 1:
            apply_step(BF, SWV, e, o, r, G - 1, 1, LUT, QXL, QXH, CORR, SX4, ACC)

    @T.macro(hygienic=True)
    def body(X, BF, S, e, Y):
        QXL = T.alloc_buffer((T_ * G * 16,), "int8")
        QXH = T.alloc_buffer((T_ * G * 16,), "int8")
        CORR = T.alloc_buffer((T_ * G * 4,), "int32")
        SX4 = T.alloc_buffer((T_ * G * 4,), "float32")
        LUT = T.alloc_buffer((64,), "int8")
        ib.fill_lut(LUT)
        for t in range(T_):
            ib.quantise_row(lambda g, h, j: X[t, g * 32 + 2 * j + h], QXL, QXH, CORR, SX4, t, G)
        for oo in T.parallel(O // R):
            ACC = T.alloc_buffer((T_ * R * 16,), "float32", scope="local")
            SWV = T.alloc_buffer((R * G,), "float32", scope="local")  # the group's 2^(scales - 128), vectorised
            for r in range(R):
                for g in T.vectorized(G):
                    SWV[r * G + g] = sw_value(S, e, oo * R + r, g)
            for i in T.unroll(T_ * R):
                for l in T.vectorized(16):
                    ACC[i * 16 + l] = T.float32(0)
            for gc in range(main):
                for r in T.unroll(R):
                    main_step(BF, SWV, e, oo * R + r, r, gc * WMAX, LUT, QXL, QXH, CORR, SX4, ACC)
            for r in T.unroll(R):
                tail_steps(BF, SWV, e, oo * R + r, r, LUT, QXL, QXH, CORR, SX4, ACC)
            for t, r in T.grid(T_, R):
                Y[t, oo * R + r] = T.float32(0)
                for l in range(16):
                    Y[t, oo * R + r] = Y[t, oo * R + r] + ACC[(t * R + r) * 16 + l]

    if E:
        @T.prim_func
        def with_expert(x: T.Buffer((T_, K), "float32"), blocks: T.Buffer((E, O, G, 16), "uint8", align=1),
                        scales: T.Buffer((E, O, G), "uint8"), expert: T.int32, y: T.Buffer((T_, O), "float32")):
            T.func_attr({"tirx.noalias": True})
            bf = T.decl_buffer((E * O * G * 16,), "uint8", data=blocks.data)
            body(x, bf, scales, expert, y)
        return with_expert.with_attr("tirx.is_scheduled", True)

    @T.prim_func
    def one(x: T.Buffer((T_, K), "float32"), blocks: T.Buffer((O, G, 16), "uint8", align=1),
            scales: T.Buffer((O, G), "uint8"), y: T.Buffer((T_, O), "float32")):
        T.func_attr({"tirx.noalias": True})
        bf = T.decl_buffer((O * G * 16,), "uint8", data=blocks.data)
        body(x, bf, scales, None, y)
    return one.with_attr("tirx.is_scheduled", True)
