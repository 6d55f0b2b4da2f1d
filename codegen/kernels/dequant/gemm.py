"""Prefill dequant-GEMM kernels: y[t, o] = sum_k x[t, k] * W[o, k] for a symbolic T (one compiled kernel serves
every T), W in MXFP4 or FP8-block storage, decoded as ``decode.py`` says.

  multiplied into every token's block partial sum, which is scaled once into the row's accumulator.
- GEMM: an [OT, K] weight tile is decoded (scale applied) into an L2-resident buffer once and reused for every
  token tile, with a rows x (tvec x V) register tile over a transposed, zero-padded copy of x: 4 x 3 ymm on
CUDA: the same definitions, scheduled by dlight's GPU rules (``scheduling.cuda_rules``).
"""

from __future__ import annotations

import tvm
from tvm import te, tirx

from dayzero.codegen.kernels.dequant.decode import (
    check_dims,
    f32,
    fp8_wd,
    has_feature,
    is_cuda,
    kernel_args,
    lookup_lanes,
    mxfp4_decode,
    weight_args,
)
from dayzero.codegen.kernels.dequant.scheduling import check_lookup_lanes, cuda_rules, has_block, mark_scheduled


def mxfp4_gemm(out_features: int, in_features: int, *, num_experts: int | None = None,
               target: dict) -> tirx.PrimFunc:
    """Prefill dequant-GEMM, y[t, o] = sum_k x[t, k] * W[o, k], W in MXFP4, T symbolic (any T >= 1).

    x       fp32  [T, K]           K = 32 G
    blocks  uint8 [(E,) O, G, 16]
    scales  uint8 [(E,) O, G]
    expert  int32                  only with num_experts
    y       fp32  [T, O]
    Internally (L, Q, P, p as in ``mxfp4_gemv``, tt = ``token_tile``): wdec[o, g, p, l] = wd * sc2 (the exact
    weight, decoded tile by tile), xt[b, g, p, l, i] = x[tt b + i, 32g + 2(qL + l) + h] (0 past T; token tiles
    outermost so one tile's activations are contiguous), yt[o, tp] = sum_{g,p,l} wdec[o, g, p, l] xt[tp // tt,
    g, p, l, tp % tt], y[t, o] = yt[o, t].
    """
    check_dims("mxfp4_gemm", out_features, in_features)
    O, K, G = out_features, in_features, in_features // 32
    T = te.var("T")
    tt = token_tile(target)
    Tp = (T + (tt - 1)) // tt * tt
    x = te.placeholder((T, K), "float32", name="x")
    B, S, e = weight_args("mxfp4", O, K, num_experts)
    L = 16 if is_cuda(target) else lookup_lanes(target)
    Q, P = 16 // L, 32 // L
    wd, sc2 = mxfp4_decode(B, S, e, O, G, L, target)
    wdec = te.compute((O, G, P, L), lambda o, g, p, l: wd[o, g, p, l] * sc2[o, g], name="wdec")
    xt = te.compute((Tp // tt, G, P, L, tt), lambda b, g, p, l, i: tirx.if_then_else(
        b * tt + i < T, x[tirx.min(b * tt + i, T - 1), g * 32 + ((p % Q) * L + l) * 2 + p // Q], f32(0.0)),
        name="xt")
    g_, p_, l_ = te.reduce_axis((0, G), "g"), te.reduce_axis((0, P), "p"), te.reduce_axis((0, L), "l")
    yt = te.compute((O, Tp), lambda o, t: te.sum(wdec[o, g_, p_, l_] * xt[t // tt, g_, p_, l_, t % tt],
                                                 axis=[g_, p_, l_]), name="yt")
    y = te.compute((T, O), lambda t, o: yt[o, t], name="y")
    sch = tvm.s_tir.Schedule(te.create_prim_func(kernel_args(x, B, S, e, y)))
    if is_cuda(target):
        return cuda_rules(sch, target)
    gemm_cpu(sch, O, K, "mxfp4", target)
    return mark_scheduled(sch)


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
    check_dims("fp8_block_gemm", out_features, in_features)
    O, K = out_features, in_features
    T = te.var("T")
    tt = token_tile(target)
    Tp = (T + (tt - 1)) // tt * tt
    x = te.placeholder((T, K), "float32", name="x")
    Wt, S, e = weight_args("fp8", O, K, num_experts)
    wd = fp8_wd(Wt, S, e, O, K)
    xt = te.compute((Tp // tt, K, tt), lambda b, k, i: tirx.if_then_else(
        b * tt + i < T, x[tirx.min(b * tt + i, T - 1), k], f32(0.0)), name="xt")
    k_ = te.reduce_axis((0, K), "k")
    yt = te.compute((O, Tp), lambda o, t: te.sum(wd[o, k_] * xt[t // tt, k_, t % tt], axis=k_), name="yt")
    y = te.compute((T, O), lambda t, o: yt[o, t], name="y")
    sch = tvm.s_tir.Schedule(te.create_prim_func(kernel_args(x, Wt, S, e, y)))
    if is_cuda(target):
        return cuda_rules(sch, target)
    else:
        gemm_cpu(sch, O, K, "fp8", target)
    return mark_scheduled(sch)


def _gemm_tile(target: dict, few_tokens: int | None = None, rows_of: int | None = None) -> tuple[int, int, int]:
    """(weight rows, token vectors, lanes) of the GEMM register tile: rows x tvec accumulator vectors of V lanes,
    plus tvec activation loads and one broadcast weight, within the vector registers: 4 x 4 zmm on AVX-512,
    4 x 3 ymm on AVX2 (16 registers; a 4 x 4 ymm tile of 16 accumulators spills).

    ``few_tokens`` (the most tokens a call takes, when that is at most one vector: a batched decode step): one
    token vector and more weight rows instead (16 zmm / 12 ymm accumulators, or the largest of 8 and 4 that
    divides ``rows_of``, the output rows), so a step of B <= V tokens computes V tokens, not 64 or 24. On AVX-512
    up to 8 tokens take 8-lane (ymm) vectors: a half-empty zmm costs as much as a full one, and on Zen 4 twice a
    ymm (its 512-bit FMAs run as two 256-bit halves): bf16 32768 x 2880 at 8 tokens 44.8 -> 34.2 ms, 2880 x 2880
    4.0 -> 3.0 ms (znver4)."""
    V = vector_lanes(target)
    if few_tokens is not None and few_tokens <= V and not is_cuda(target):
        lanes = 8 if few_tokens <= 8 else V
        for rows in ((16, 12, 8, 4) if V == 16 else (12, 8, 4)):  # AVX-512 has 32 vector registers, AVX2 16
            if rows_of is None or rows_of % rows == 0:
                return rows, 1, lanes
    return (4, 4, 16) if V == 16 else (4, 3, 8)


def vector_lanes(target: dict) -> int:
    """fp32 lanes of the target's widest vector: 16 (AVX-512, and CUDA's tile) or 8 (AVX2)."""
    return 16 if is_cuda(target) or has_feature(target, "avx512f") else 8


def vector_registers(target: dict) -> int:
    """The CPU target's vector registers: 32 zmm with AVX-512, 16 ymm with AVX2."""
    return 32 if has_feature(target, "avx512f") else 16


def token_tile(target: dict, few_tokens: int | None = None, rows_of: int | None = None) -> int:
    """Tokens per GEMM tile: the register tile's token vectors x lanes (64 on AVX-512, 24 on AVX2; one vector
    for ``few_tokens``)."""
    _, tvec, V = _gemm_tile(target, few_tokens, rows_of)
    return tvec * V


def gemm_cpu(sch, O: int, K: int, fmt: str, target: dict, few_tokens: int | None = None):
    """yt tile loops: o_outer (parallel, OT rows) / t_outer / o_mid / k... / o_inner(rows) / t (tvec x V lanes).

    The decoded [OT, K] weight tile (``wd`` / ``wdec``) is made once per o_outer and reused for every token tile;
    OT keeps it within about half of a 512 KiB L2 so the token tile's activations fit beside it. ``few_tokens``:
    see ``_gemm_tile``."""
    orows, tvec, V = _gemm_tile(target, few_tokens, O)
    ot = max(orows, min(64, (256 * 1024) // (4 * K)) // orows * orows)  # a multiple of orows
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
        if has_block(sch, "wq"):
            sch.compute_inline(bd)
            bq = sch.get_sblock("wq")
            sch.compute_at(bq, lw[-3])
            sch.set_scope(bq, 0, "local")
            lq = sch.get_loops(bq)
            check_lookup_lanes(sch, lq[-1], 16)
            sch.vectorize(lq[-1])
            sch.unroll(lq[-2])
        else:
            sch.compute_inline(bd)
    else:
        bw = sch.get_sblock("wd")
        sch.compute_at(bw, o_o)
        if has_block(sch, "sc"):  # a bf16 weight has no scales
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
