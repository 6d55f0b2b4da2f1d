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
GEMV kernels have a static T (1..8 decode tokens); GEMM kernels a symbolic T (one compiled kernel serves every T).

Decoding, exact in fp32 (checked bit for bit against lowprec in the tests):
- E2M1 code c -> the fp16 bit pattern ((c & 7) << 9) | ((c & 8) << 12) is c's value times 2^-14 (the code's
  exponent/mantissa land in fp16's, code exponent 0 becomes an fp16 subnormal that the hardware converts exactly),
  so value = float32(reinterpret_f16(bits)) * 2^14. Computed for the 16 codes once per call (``lut``).
- E8M0 s -> reinterpret_f32(s << 23) = 2^(s-127) for s >= 1, and 0x00400000 (2^-127) for s = 0.
- E4M3 byte b -> reinterpret_f16(((b & 0x7F) << 7) | ((b & 0x80) << 8)) = value * 2^-8; the 2^8 goes into the
  block scale (exact: a power of two).

Host CPU schedules (AVX-512): per (row, 32-value block) the 16-entry table ``lut * scale`` is built in one
register and the nibbles are looked up with one ``vpermps`` per 16 values (``_permvar``); GEMV is parallel over
output rows, 4 rows at a time sharing the activation loads, 16 lanes of partial sums per row. GEMM dequantises an
[OT, K] weight tile into an L2-resident buffer once and reuses it for every token tile, with a 4-row x 64-token
register tile over a transposed, zero-padded copy of x. CUDA: the same definitions (table lookup instead of
vpermps), scheduled by dlight's GPU rules (GEMV / Matmul / Reduction / Fallback, thread-bound); not hand-tuned yet.

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


def e8m0_value(s):
    """uint8 E8M0 code -> fp32 2^(s-127) (s = 0 gives the subnormal 2^-127; 0xFF is rejected by validators)."""
    u = s.astype("uint32")
    return tirx.reinterpret("float32", tirx.Select(u == _u32(0), _u32(0x400000), u << _u32(23)))


def e4m3_value_div256(b):
    """uint8 E4M3 byte -> fp32 value * 2^-8 (exact; NaN codes 0x7F/0xFF decode to 480/256, as no checkpoint has them)."""
    u = b.astype("uint16")
    bits = ((u & _u16(0x7F)) << _u16(7)) | ((u & _u16(0x80)) << _u16(8))
    return tirx.reinterpret("float16", bits).astype("float32")


def _permvar(table_lane, index):
    """One lane of AVX-512 ``vpermps``: result lane i = table[index_i & 15], table = the 16 lanes of table_lane.

    Only meaningful inside a loop vectorised by exactly 16 whose lane i reads table[i]: the schedules below make
    sure of it (``_check_permvar_lanes``)."""
    return tirx.call_llvm_pure_intrin("float32", "llvm.x86.avx512.permvar.sf.512", table_lane, index)


# ------------------------------------------------------------------------------------------ targets
def _is_cuda(target: dict) -> bool:
    return target.get("kind") == "cuda"


def _has_avx512(target: dict) -> bool:
    import tvm.target.codegen as cg

    return target.get("kind") == "llvm" and bool(cg.target_has_features("avx512f", tvm.target.Target(target)))


def _num_threads(target: dict) -> int:
    return int(target.get("num-cores", 1))


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


def _mxfp4_stages(B, S, e, O: int, G: int, lanes16: bool):
    """lut[c], sc[o, g], tbl[o, g, c] = lut[c] * sc[o, g], wd[o, g, h, j] = W[o, 32g + 2j + h]."""
    lut = te.compute((16,), lambda c: e2m1_value(c), name="lut")
    sc = te.compute((O, G), lambda o, g: e8m0_value(S[_at(e, o, g)]), name="sc")
    tbl = te.compute((O, G, 16), lambda o, g, c: lut[c] * sc[o, g], name="tbl")

    def code(o, g, h, j):
        return tirx.Cast("int32", tirx.shift_right(B[_at(e, o, g, j)], tirx.Cast("uint8", h * 4)))

    if lanes16:
        wd = te.compute((O, G, 2, 16), lambda o, g, h, j: _permvar(tbl[o, g, j], code(o, g, h, j)), name="wd")
    else:
        wd = te.compute(
            (O, G, 2, 16), lambda o, g, h, j: tbl[o, g, code(o, g, h, j) & 15], name="wd"
        )
    return wd


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
    Internally xp[t, g, h, j] = x[t, 32g + 2j + h] (the nibble order), part[t, o, j] 16 partial sums per row.
    """
    _check_dims("mxfp4_gemv", out_features, in_features, n_tokens)
    T, O, K, G = n_tokens, out_features, in_features, in_features // 32
    x = te.placeholder((T, K), "float32", name="x")
    B, S, e = _weight_args("mxfp4", O, K, num_experts)
    avx = _has_avx512(target)
    wd = _mxfp4_stages(B, S, e, O, G, lanes16=avx)
    xp = te.compute((T, G, 2, 16), lambda t, g, h, j: x[t, g * 32 + j * 2 + h], name="xp")
    g_, h_ = te.reduce_axis((0, G), "g"), te.reduce_axis((0, 2), "h")
    part = te.compute((T, O, 16), lambda t, o, j: te.sum(xp[t, g_, h_, j] * wd[o, g_, h_, j], axis=[g_, h_]),
                      name="part")
    jj = te.reduce_axis((0, 16), "jj")
    y = te.compute((T, O), lambda t, o: te.sum(part[t, o, jj], axis=jj), name="y")
    sch = tvm.s_tir.Schedule(te.create_prim_func(_args(x, B, S, e, y)))
    if _is_cuda(target):
        return _cuda_rules(sch, target)
    else:
        _mxfp4_gemv_cpu(sch, O, permvar=avx)
    return _done(sch)


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


def _mxfp4_gemv_cpu(sch, O: int, permvar: bool, rows: int = 4):
    rows = rows if O % rows == 0 else (2 if O % 2 == 0 else 1)
    by = sch.get_sblock("y")
    t, o, jr = sch.get_loops(by)
    oo, oi = sch.split(o, [None, rows])
    sch.reorder(oo, oi, t, jr)
    sch.parallel(oo)
    bp = sch.get_sblock("part")
    sch.compute_at(bp, oo)
    sch.set_scope(bp, 0, "local")
    lp = sch.get_loops(bp)
    sp, pg, ph = lp[1:-2], lp[-2], lp[-1]
    sch.reorder(pg, ph, *sp)
    sch.vectorize(sp[-1])
    for loop in sp[:-1]:
        sch.unroll(loop)
    for name in ("wd", "tbl"):
        blk = sch.get_sblock(name)
        sch.compute_at(blk, pg)
        sch.set_scope(blk, 0, "local")
        loops = sch.get_loops(blk)
        sch.vectorize(loops[-1])  # 16 lanes: j for wd (the _permvar contract), c for tbl
        if name == "wd":
            _check_permvar_lanes(sch, loops[-1], permvar)
            for loop in loops[-3:-1]:
                sch.unroll(loop)
    bs = sch.get_sblock("sc")
    sch.compute_at(bs, oo)
    sch.set_scope(bs, 0, "local")
    sch.vectorize(sch.get_loops(bs)[-1])
    sch.unroll(ph)
    init = sch.decompose_reduction(bp, pg)
    sch.vectorize(sch.get_loops(init)[-1])
    sch.vectorize(sch.get_loops(sch.get_sblock("xp"))[-1])


def _check_permvar_lanes(sch, loop, permvar: bool):
    if permvar and int(sch.get(loop).extent) != 16:
        raise InternalError("the vpermps lookup needs its loop vectorised by exactly 16 lanes")


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
    Internally xt[b, g, h, j, i] = x[64b + i, 32g + 2j + h] (0 past T; token tiles of 64 outermost so one tile's
    activations are contiguous), yt[o, tp] = sum_{g,h,j} wd[o, g, h, j] * xt[tp // 64, g, h, j, tp % 64],
    y[t, o] = yt[o, t].
    """
    _check_dims("mxfp4_gemm", out_features, in_features)
    O, K, G = out_features, in_features, in_features // 32
    T = te.var("T")
    tt = _token_tile(target)
    Tp = (T + (tt - 1)) // tt * tt
    x = te.placeholder((T, K), "float32", name="x")
    B, S, e = _weight_args("mxfp4", O, K, num_experts)
    avx = _has_avx512(target)
    wd = _mxfp4_stages(B, S, e, O, G, lanes16=avx)
    xt = te.compute((Tp // tt, G, 2, 16, tt), lambda b, g, h, j, i: tirx.if_then_else(
        b * tt + i < T, x[tirx.min(b * tt + i, T - 1), g * 32 + j * 2 + h], _f32(0.0)), name="xt")
    g_, h_, j_ = te.reduce_axis((0, G), "g"), te.reduce_axis((0, 2), "h"), te.reduce_axis((0, 16), "j")
    yt = te.compute((O, Tp), lambda o, t: te.sum(wd[o, g_, h_, j_] * xt[t // tt, g_, h_, j_, t % tt],
                                                 axis=[g_, h_, j_]), name="yt")
    y = te.compute((T, O), lambda t, o: yt[o, t], name="y")
    sch = tvm.s_tir.Schedule(te.create_prim_func(_args(x, B, S, e, y)))
    if _is_cuda(target):
        return _cuda_rules(sch, target)
    else:
        _gemm_cpu(sch, O, K, fmt="mxfp4", permvar=avx)
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
        _gemm_cpu(sch, O, K, fmt="fp8", permvar=False)
    return _done(sch)


def _token_tile(target: dict) -> int:
    return 64


def _gemm_cpu(sch, O: int, K: int, fmt: str, permvar: bool, orows: int = 4, tvec: int = 4):
    """yt tile loops: o_outer (parallel, OT rows) / t_outer / o_mid / k... / o_inner(orows) / t (tvec x 16 lanes)."""
    ot = max(orows, min(64, (768 * 1024) // (4 * K) // orows * orows))  # decoded [OT, K] tile <= 768 KiB (L2)
    while O % ot and ot > orows:
        ot -= orows
    if O % ot:
        ot, orows = 1, 1
    byt = sch.get_sblock("yt")
    loops = sch.get_loops(byt)
    o, t, red = loops[0], loops[1], loops[2:]
    o_o, o_m, o_i = sch.split(o, [None, ot // orows, orows])
    t_o, t_i = sch.split(t, [None, 16 * tvec])
    sch.reorder(o_o, t_o, o_m, *red, o_i, t_i)
    sch.parallel(o_o)
    acc = sch.cache_write(byt, 0, "local")
    sch.reverse_compute_at(acc, o_m)
    sch.vectorize(sch.get_loops(acc)[-1])
    sch.unroll(o_i)
    t_io, t_ii = sch.split(t_i, [tvec, 16])
    sch.unroll(t_io)
    sch.vectorize(t_ii)
    init = sch.decompose_reduction(byt, red[0])
    sch.vectorize(sch.get_loops(init)[-1])
    bw = sch.get_sblock("wd")
    sch.compute_at(bw, o_o)  # decode the [OT, K] tile once, reuse it for every token tile
    if fmt == "mxfp4":
        lw = sch.get_loops(bw)
        sch.vectorize(lw[-1])
        _check_permvar_lanes(sch, lw[-1], permvar)
        sch.unroll(lw[-2])
        for name in ("tbl",):
            blk = sch.get_sblock(name)
            sch.compute_at(blk, lw[-3])
            sch.set_scope(blk, 0, "local")
            sch.vectorize(sch.get_loops(blk)[-1])
        sch.compute_inline(sch.get_sblock("sc"))
    else:
        sch.compute_inline(sch.get_sblock("sc"))
        lw = sch.get_loops(bw)
        ko, ki = sch.split(lw[-1], [None, 16])
        sch.vectorize(ki)
    bx = sch.get_sblock("xt")
    lx = sch.get_loops(bx)
    sch.parallel(lx[0])
    sch.vectorize(sch.split(lx[-1], [None, 16])[-1])
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
