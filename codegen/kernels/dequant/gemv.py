"""Decode dequant-GEMV kernels: y[t, o] = sum_k x[t, k] * W[o, k] for 1..64 tokens (a static T), W in MXFP4 or
FP8-block storage, decoded as ``decode.py`` says.

Host CPU schedules (any x86: AVX2 and AVX-512 alike, lanes and tiles from the target's features):
- GEMV (``mxfp4_gemv``): parallel over groups of output rows (8 at T = 1: 8 independent accumulator chains);
  per row and block the 16 code bytes are read once, looked up into P vectors of L lanes in registers, each
CUDA: the same definitions, scheduled by dlight's GPU rules (``scheduling.cuda_rules``).
"""

from __future__ import annotations

import tvm
from tvm import te, tirx

from dayzero import InternalError
from dayzero.codegen.kernels.dequant.decode import (
    check_dims,
    e2m1_x2_value,
    e8m0_value,
    f32,
    fp8_wd,
    gemv_rows,
    is_cuda,
    kernel_args,
    lookup_lanes,
    lookup_mode,
    mxfp4_decode,
    weight_args,
)
from dayzero.codegen.kernels.dequant.gemv_int8 import int8_route, mxfp4_gemv_int8
from dayzero.codegen.kernels.dequant.scheduling import check_lookup_lanes, cuda_rules, has_block, mark_scheduled
from dayzero.codegen.tvmscript import parsed_shallow


def mxfp4_gemv(n_tokens: int, out_features: int, in_features: int, *, num_experts: int | None = None,
               target: dict, int8: bool | None = None) -> tirx.PrimFunc:
    """Decode dequant-GEMV, y[t, o] = sum_k x[t, k] * W[o, k], W in MXFP4.

    Two routes: the integer GEMV of ``gemv_int8`` (x quantised to int8 per 32-block, integer dot products on the
    codes: not exact, ~2^-9 relative) where ``gemv_int8.int8_route(target, n_tokens, int8)`` says so (x86 with
    AVX2, n_tokens <= INT8_MAX_T, unless int8=False), else the exact fp32 kernel below.

    x       fp32  [T, K]           T = n_tokens (static, 1..64), K = in_features = 32 G
    blocks  uint8 [(E,) O, G, 16]  O = out_features
    scales  uint8 [(E,) O, G]
    expert  int32                  only with num_experts: which [O, G, 16] slab to read
    y       fp32  [T, O]
    Internally, with L fp32 lanes (``lookup_lanes``), Q = 16 / L, P = 2Q vectors per block, p = h Q + q:
    xp[t, g, p, l] = x[t, 32g + 2(qL + l) + h] (the nibble order), wd / sc2 from ``mxfp4_decode``,
    blk[t, o, g, l] = sum_p xp[t, g, p, l] wd[o, g, p, l] (one block's partial dot product, L lanes),
    part[t, o, l] = sum_g blk[t, o, g, l] sc2[o, g] (the scale applied once per block), y = sum_l part.
    """
    check_dims("mxfp4_gemv", out_features, in_features, n_tokens)
    if int8_route(target, n_tokens, int8):
        return mxfp4_gemv_int8(n_tokens, out_features, in_features, num_experts=num_experts, target=target)
    T, O, K, G = n_tokens, out_features, in_features, in_features // 32
    if lookup_mode(target) == "pshufb":
        return _mxfp4_gemv_avx2(T, O, K, num_experts).with_attr("tirx.is_scheduled", True)
    x = te.placeholder((T, K), "float32", name="x")
    B, S, e = weight_args("mxfp4", O, K, num_experts)
    cuda = is_cuda(target)
    L = 16 if cuda else lookup_lanes(target)
    Q, P = 16 // L, 32 // L
    wd, sc2 = mxfp4_decode(B, S, e, O, G, L, target)
    xp = te.compute((T, G, P, L), lambda t, g, p, l: x[t, g * 32 + ((p % Q) * L + l) * 2 + p // Q], name="xp")
    p_ = te.reduce_axis((0, P), "p")
    blk = te.compute((T, O, G, L), lambda t, o, g, l: te.sum(xp[t, g, p_, l] * wd[o, g, p_, l], axis=p_),
                     name="blk")
    g_ = te.reduce_axis((0, G), "g")
    part = te.compute((T, O, L), lambda t, o, l: te.sum(blk[t, o, g_, l] * sc2[o, g_], axis=g_), name="part")
    l_ = te.reduce_axis((0, L), "l")
    y = te.compute((T, O), lambda t, o: te.sum(part[t, o, l_], axis=l_), name="y")
    sch = tvm.s_tir.Schedule(te.create_prim_func(kernel_args(x, B, S, e, y)))
    if cuda:
        return cuda_rules(sch, target)
    _mxfp4_gemv_cpu(sch, gemv_rows(T, O), L)
    return mark_scheduled(sch)


_MAGIC = 0x4B  # pshufb table offset: 0x4B4B4B4B as fp32 is 2^23 + 0x4B4B4B, whose unit in the last place is 1.0


@parsed_shallow
def _mxfp4_gemv_avx2(T_: int, O: int, K: int, E: int | None) -> tirx.PrimFunc:
    """The AVX2 decode GEMV, hand-vectorised (same arguments and numerics as ``mxfp4_gemv``; the TE form cannot
    regroup byte lanes into float lanes, which is what saves the int8 -> int32 widening and the conversion here).

    Per row and 32-value block: the 16 code bytes are widened once to two uint32x8 (vpmovzxbd from memory); each
    lane's nibble (``& 15`` / ``>> 4``) indexes ``vpshufb`` over a 32-byte table holding 0x4B + 2 E2M1(c), whose
    other three bytes come back as table[0] = 0x4B, so the lane's bits are 0x4B4B4B4B + 2 E2M1(c): the float
    2^23 + 0x4B4B4B + 2 E2M1(c) exactly, and one subtraction leaves 2 E2M1(c) (exact: integers below 2^24).
    The four vectors meet the activations (permuted into nibble order once per call) in a sum tree, the block's
    partial sum is scaled by sc2 once, into one accumulator per (token, row); rows per group from ``gemv_rows``.
    """
    import struct

    from tvm.script import tirx as T

    G = K // 32
    R = gemv_rows(T_, O)
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
    check_dims("fp8_block_gemv", out_features, in_features, n_tokens)
    T, O, K = n_tokens, out_features, in_features
    x = te.placeholder((T, K), "float32", name="x")
    Wt, S, e = weight_args("fp8", O, K, num_experts)
    wd = fp8_wd(Wt, S, e, O, K)
    kp = -(-K // 16) * 16
    xpad = te.compute((T, kp), lambda t, k: tirx.if_then_else(k < K, x[t, tirx.min(k, K - 1)], f32(0.0)),
                      name="xpad")
    k_ = te.reduce_axis((0, kp), "k")
    y = te.compute((T, O), lambda t, o: te.sum(xpad[t, k_] * wd[o, tirx.min(k_, K - 1)], axis=k_), name="y")
    sch = tvm.s_tir.Schedule(te.create_prim_func(kernel_args(x, Wt, S, e, y)))
    if is_cuda(target):
        return cuda_rules(sch, target)
    else:
        fp8_gemv_cpu(sch, K)
    return mark_scheduled(sch)


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
    check_lookup_lanes(sch, lw, L)
    sch.vectorize(lw)
    if has_block(sch, "wq"):
        bq = sch.get_sblock("wq")
        sch.compute_at(bq, at_row)
        sch.set_scope(bq, 0, "local")
        lq = sch.get_loops(bq)
        check_lookup_lanes(sch, lq[-1], 16)
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


def gemv_tile(fmt: str, T: int, N: int, K: int, registers: int = 16) -> tuple[int, int]:
    """(output rows per parallel task, accumulator vectors per row) of ``fp8_gemv_cpu``.

    bf16 rows x T accumulators up to the target's vector ``registers``, at most 8 rows (dividing N): with AVX-512's
    32, T = 4 takes 8 rows and T = 8 4 (18432 x 7168, znver4: 9.5 / 16.3 ms against 11.2 / 25.5 with 16); 16
    (AVX2) gives ``gemv_rows``' groups.

    A bf16 row at T = 1 whose activations fit well within L1 (4 K <= 16 KiB: gpt-oss's 2880, 4096) streams one
    row at a time with two accumulators: the weight is then one sequential read (gpt-oss's LM head, 201088 x 2880,
    at 25 GB/s against 17.5 with 8 interleaved rows on znver4, whose read bandwidth is ~30 GB/s; ``dayzero bench
    ops`` times the 32768-row slice); a wider x (7168: 28 KiB) falls out of L1 when re-read per row (11.5 GB/s),
    so there the rows of ``gemv_rows`` share each x load. FP8 (its scales decoded per element): 4 rows."""
    if fmt == "bf16" and T == 1 and 4 * K <= 16 * 1024:
        return 1, 2
    if fmt != "bf16":
        return 4, 1
    rows = max(1, min(8, registers // T))
    while N % rows:
        rows -= 1
    return rows, 1


def fp8_gemv_cpu(sch, K: int, rows: int = 4, acc: int = 1):
    """The GEMV ``y[t, o] = sum_k xpad[t, k] * wd[o, k]`` over a per-element decode stage ``wd`` (FP8 with its
    scales ``sc``, or a bf16 upcast): ``rows`` output rows per parallel task, ``acc`` vectors of 16 lanes of partial
    sums over k per row (independent FMA chains; xpad's length must be a multiple of 16 acc)."""
    by = sch.get_sblock("y")
    t, o, k = sch.get_loops(by)
    T, O = int(sch.get(t).extent), int(sch.get(o).extent)
    rows = rows if O % rows == 0 else (2 if O % 2 == 0 else 1)
    W = 16 * acc
    nko = -(-K // W)
    ko, kl = sch.split(k, [nko, W])
    rf = sch.rfactor(kl, 2)  # y_rf[t, o, l] = sum_ko: W lanes of partial sums per (t, o)
    sch.compute_inline(sch.get_sblock("wd"))
    if has_block(sch, "sc"):  # a bf16 weight has no scales
        sch.compute_inline(sch.get_sblock("sc"))
    sch.set_scope(rf, 0, "local")
    ty, oy, ly = sch.get_loops(by)
    oyo, oyi = sch.split(oy, [None, rows])
    sch.reorder(oyo, oyi, ty, ly)
    sch.parallel(oyo)
    sch.compute_at(rf, oyo)
    # compute_at lays the new loops out in block-iter order (lane, t, o, ko), dropping unit extents
    own = dict(zip([n for n, ext in (("l", W), ("t", T), ("o", rows), ("ko", nko)) if ext > 1],
                   sch.get_loops(rf)[1:]))
    la, lv = sch.split(own["l"], [acc, 16])
    order = [own[n] for n in ("ko", "o", "t") if n in own] + [la, lv]
    sch.reorder(*order)
    sch.vectorize(lv)
    for n in ("o", "t"):
        if n in own:
            sch.unroll(own[n])
    sch.unroll(la)
    init = sch.decompose_reduction(rf, order[0])
    sch.vectorize(sch.get_loops(init)[-1])
    bx = sch.get_sblock("xpad")
    sch.vectorize(sch.split(sch.get_loops(bx)[-1], [None, 16])[-1])
