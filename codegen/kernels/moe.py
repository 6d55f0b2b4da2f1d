"""Routed experts as one hand-scheduled TIR kernel: permute by expert, grouped GEMM over routed experts, combine.

Arguments (the ``moe_experts`` node's inputs, then its output; see ``passes/moe.py``)::

    x    [T, H]      hidden states (T symbolic: one kernel for every T)
    ids  [T, k]      int, routed expert of each (token, slot)
    w    [T, k]      routing weight of each (token, slot)
    Wgu  [E, GU, H] (layout nk) | [E, H, GU] (kn)       b_gu [E, GU]  (if gate_up_bias)
    Wd   [E, H, I]  (layout nk) | [E, I, H]  (kn)       b_d  [E, H]   (if down_bias)
    y    [T, H]

Low-precision variants take each W as stored and decode it in registers where the GEMMs read it (no copy):
``moe_experts_mxfp4`` (blocks uint8 [E, out, in/32, 16] + E8M0 scales [E, out, in/32], layout nk; 16 codes per
contiguous byte load, looked up as the dequant kernels do: ``dequant_decode.e2m1_x2_lookup``) and
``moe_experts_fp8`` (float8_e4m3fn W in either layout + fp32 block scales [E, ceil(d1/br), ceil(d2/bc)]); see
``moe_experts_func``. Same phases, tiles and chunks: the 1/2-token tiles are the decode GEMV, the MB tiles the
prefill GEMM.

Phases (a = t*k + j is an assignment, S = T*k of them; p its position once sorted by expert):
1. counting sort (serial, O(S + E)): cnt[e] -> offs[e] (exclusive prefix sum), order[p] = a, stable in a.
2. gate/up grouped GEMM: G[p, n] = sum_h x[order[p] // k, h] * Wgu[e, n, h] (+ b_gu[e, n]) for p in
   [offs[e], offs[e+1]); parallel over PGU chunks (``parallel_chunks``: up to 16), chunk c owning the n-blocks
   [c*NBC, (c+1)*NBC) of EVERY expert, so the split over cores is the same whatever the routing (decode with 4
   experts keeps both cores streaming) and each core reads contiguous rows of each routed expert in order.
   An expert no token chose has an empty range and its weights are never touched.
3. activation: A[p, i] = act(G[p, :])[i], the node's expression (SwiGLU, gpt-oss clamped SwiGLU, ...).
4. down grouped GEMM: D[p, h] = sum_i A[p, i] * Wd[e, h, i] (+ b_d[e, h]), same chunk structure.
5. combine in token order: y[t, h] = sum_j w[t, j] * D[pos(t*k + j), h] (deterministic, no atomics).

Bytes: each routed expert's weights are read once per call from memory (every job reads a [NB, K] block of one
expert's matrix, all token tiles of that expert reuse it from cache), so a decode step reads exactly the routed
experts' bytes plus O(T*k*(H + GU)) activations: that is the bound by construction (``weight_bytes_read``).

GEMM micro-kernel (``expert_gemm_tiles``, shared with ``expert_workspace.py``, as are phases 1 and 5:
``sort_by_expert``, ``combine_in_token_order``), ``nk``: MB=4 token rows x NB=4 weight rows, 16 fp32 lanes of
partial sums each (16 zmm accumulators kept in registers: 16 FMAs per 8 loads), reduced at the end by a halving tree
of vector adds; an expert's last cnt % MB tokens run as a 2-token and a 1-token tile (a decode expert with 1 token
does 1 row of work, not MB). The small tiles prefetch (to L2) the next NB rows of the same expert, so DRAM latency
overlaps the FMAs; the MB tiles do not (the prefetch call makes LLVM spill the accumulators to memory every
iteration, measured slower). The small tiles' accumulators are their own buffers in the default scope, which TVM
puts on the stack: a "local" buffer inside a parallel loop is a TVMBackendAllocWorkspace pointer, which LLVM cannot
keep in registers past the prefetches (it stored every accumulator every block). MXFP4 tiles run block by block
(``expert_gemm_tiles(blockwise=True)``); on AVX-512 the fp32 tiles decode a block as 4 dwords broadcast to a zmm's
lane groups, shifted per group and looked up by vpermps (``dword_lookup``), with the block scales widened once a
job. Measured at gpt-oss-20b width, fp32 tiles (``dayzero bench moe --full-width``, same host, before / after both
changes): decode T = 1 3.5 -> 2.6 ms, T = 8 21.2 -> 16.8 ms (42% -> 65% and 37% -> 52% of the routed experts'
bytes / read bandwidth); prefill (``--mxfp4-routes``, T = 256) 30.3 -> 29.3 ms. ``kn`` uses the
same loop nest reading the transposed weight (strided loads: correct, not tuned). CUDA: the same phases with the
parallel loops bound to blocks (one thread each): compiles for sm_90, not tuned.

Variants: one TVMScript signature (``_func``) with every argument; ``drop_absent`` removes the bias parameters a
node does not have (its argument list is its inputs) and, for dense weights, the scale parameters.

Threads: T.parallel runs on TVM's pool, whose default on x86 is hardware_concurrency / 2; dayzero's import sizes it
to every CPU of the process instead (``dayzero/__init__.py``), unless the user set TVM_NUM_THREADS / OMP_NUM_THREADS.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from typing import Callable

import tvm
from tvm.script import tirx as T

from dayzero import InternalError
from dayzero.codegen.kernels.dequant import decode as dequant_decode
from dayzero.codegen.kernels.dequant.gemv_int8 import Int8Blocks, int8_mode
from dayzero.codegen.tvmscript import parsed_shallow, prefetch_l2
from dayzero.targets import capabilities
from dayzero.targets.capabilities import MOE_L, MOE_MB, MOE_NB

MB, NB, L = MOE_MB, MOE_NB, MOE_L  # the tiles (targets/capabilities.py states what they take)


def parallel_chunks(nblocks: int, most: int = 16) -> int:
    """Parallel chunks for a GEMM phase: the largest divisor of the n-block count up to ``most`` (a static split
    over the cores of contiguous n-block ranges; 16 chunks balance 2, 4, 8 or 16 threads)."""
    return max(d for d in range(1, most + 1) if nblocks % d == 0)


def act_value(expr, G, p, i):
    """The activation expression ``expr`` (the node's ``act`` attribute) at column i, a TIR expression over
    G[p, :] (``("col", start, stride, n)`` reads G[p, start + stride * i])."""
    f32 = lambda v: T.float32(v)  # noqa: E731

    def build(e):
        kind = e[0]
        if kind == "col":
            return G[p, e[1] + e[2] * i]
        if kind == "const":
            return f32(e[1])
        if kind == "clamp":
            v = build(e[1])
            if e[2] is not None:
                v = T.max(v, f32(e[2]))
            if e[3] is not None:
                v = T.min(v, f32(e[3]))
            return v
        if kind == "silu":
            v = build(e[1])
            return v * T.sigmoid(v)
        if kind == "sigmoid":
            return T.sigmoid(build(e[1]))
        if kind == "relu":
            return T.max(build(e[1]), f32(0))
        if kind == "tanh":
            return T.tanh(build(e[1]))
        if kind == "exp":
            return T.exp(build(e[1]))
        if kind == "neg":
            return -build(e[1])
        if kind == "gelu":
            v = build(e[1])
            return v * f32(0.5) * (f32(1) + T.erf(v * f32(0.7071067811865476)))
        a, b = build(e[1]), build(e[2])
        return {"mul": lambda: a * b, "add": lambda: a + b, "sub": lambda: a - b, "div": lambda: a / b}[kind]()
    return build(expr)


def no_prefetch(n, ko):
    """The ``prefetch`` of ``expert_gemm_tiles`` that prefetches nothing."""
    return T.evaluate(0)


@dataclass(frozen=True)
class BlockWeight:
    """An MXFP4 weight block by block for ``expert_gemm_tiles(blockwise=True)``: ``lo(n, g, l)`` / ``hi(n, g, l)``
    are 2 E2M1 of the low / high nibble of code byte l of block g of weight row n0 + n (fp32), ``scale(n, g)`` the
    block's 2^(s - 128), ``prefetch(n, g)`` a statement (the next rows' block g, or nothing)."""
    lo: Callable
    hi: Callable
    scale: Callable
    prefetch: Callable
    vector: bool = False  # lo / hi take no lane and give all L lanes at once (``dword_lookup``), scale a scalar


def expert_gemm_tiles(vec=T.vectorized, blockwise: bool = False, cuda: bool = False):
    """The token tiles of one expert against one block of NB weight rows, as a TIR macro: the GEMM micro-kernel of
    both expert kernels (this file's and ``expert_workspace.py``'s)::

        tiles(OUT, acc, p_lo, p_hi, n0, K, src, bias, mb_weight, weight, prefetch)
        OUT[p, n0 + n] = bias(n) + sum_{ko < K/L, l < L} src(p, ko, l) * weight(n, ko, l)    p_lo <= p < p_hi, n < NB

    ``src(p, ko, l)`` and ``weight(n, ko, l)`` are lane l of the ko-th L-lane chunk of the reduction (activation
    row p, weight row n0 + n) as fp32 expressions; the caller chooses which reduction index a (ko, l) stands for
    (MXFP4 takes the nibble order of its code bytes), the same for both. ``bias(n)`` is fp32.

    Tiles: (p_hi - p_lo) // MB tiles of MB rows reading ``mb_weight`` (which may read a staged copy of the block),
    then a 2-row and a 1-row tile for the remainder (a decode expert with 1 token does 1 row of work, not MB),
    reading ``weight`` and calling ``prefetch(n, ko)`` (a statement, ``no_prefetch`` for none) per chunk: only the
    small tiles prefetch, in an MB tile the prefetch call made LLVM keep the accumulators in memory (a store per
    FMA, measured slower). A tile keeps rows x NB x L fp32 partial sums in ``acc`` (local [MB, NB, L]), reduced at
    the end by a halving tree of vector adds. ``vec``: the lane loop (``T.vectorized`` on CPU, ``T.serial`` on
    CUDA).

    ``blockwise`` (MXFP4, nibble-order chunks): ``mb_weight`` and ``weight`` are :class:`BlockWeight` s and every
    tile runs block by block: per 32-value block and weight row the 16 code bytes are loaded and widened once for
    both nibbles (chunks 2g and 2g + 1) and the block's partial dot product is scaled once, as the dequant GEMV
    does (the element-wise form loads every byte twice and scales every looked-up vector); the 2- and 1-row tiles
    prefetch the next NB rows' block g (``weight.prefetch``), the MB tiles nothing (``mb_weight``'s). Measured at
    gpt-oss-20b width (32 experts, top-4, 2880 x 2880): decode T = 1 7.1 -> 3.6-4.2 ms (``dayzero bench moe
    --full-width``, the fp32 tiles), T = 512 0.98-1.05 -> 0.84-0.85 s."""

    @T.macro(hygienic=True)
    def zero(acc, rows):
        for m, n in T.grid(rows, NB):
            for l in vec(L):
                acc[m, n, l] = T.float32(0)

    @T.macro(hygienic=True)
    def store(OUT, acc, rows, p0, n0, bias):
        for m, n in T.grid(rows, NB):  # lanes reduced as a halving tree (vector adds), not 16 scalar adds
            for l in vec(L // 2):
                acc[m, n, l] = acc[m, n, l] + acc[m, n, l + L // 2]
            for l in vec(L // 4):
                acc[m, n, l] = acc[m, n, l] + acc[m, n, l + L // 4]
            for l in vec(L // 8):
                acc[m, n, l] = acc[m, n, l] + acc[m, n, l + L // 8]
            OUT[p0 + m, n0 + n] = bias(n) + (acc[m, n, 0] + acc[m, n, 1])

    @T.macro(hygienic=True)
    def tile(OUT, acc, rows, p0, n0, K, src, weight, bias, prefetch):
        zero(acc, rows)
        for ko in range(K // L):
            for n in T.unroll(NB):
                prefetch(n, ko)
            for m in T.unroll(rows):
                for n in T.unroll(NB):
                    for l in vec(L):
                        acc[m, n, l] = acc[m, n, l] + src(p0 + m, ko, l) * weight(n, ko, l)
        store(OUT, acc, rows, p0, n0, bias)

    @T.macro(hygienic=True)
    def block_tile(OUT, acc, rows, p0, n0, K, src, weight, bias, prefetch):
        zero(acc, rows)
        for g in range(K // 32):
            for n in T.unroll(NB):
                weight.prefetch(n, g)
            for n in T.unroll(NB):
                for m in T.unroll(rows):
                    if weight.vector:
                        acc[m, n, T.Ramp(0, 1, L)] = acc[m, n, T.Ramp(0, 1, L)] + (
                            src(p0 + m, 2 * g, None) * weight.lo(n, g, None)
                            + src(p0 + m, 2 * g + 1, None) * weight.hi(n, g, None)
                        ) * T.Broadcast(weight.scale(n, g), L)
                    else:
                        for l in vec(L):
                            acc[m, n, l] = acc[m, n, l] + (src(p0 + m, 2 * g, l) * weight.lo(n, g, l) + src(
                                p0 + m, 2 * g + 1, l) * weight.hi(n, g, l)) * weight.scale(n, g)
        store(OUT, acc, rows, p0, n0, bias)

    run = block_tile if blockwise else tile
    small = "local" if cuda else "global"

    @T.macro(hygienic=True)
    def tiles(OUT, acc, p_lo, p_hi, n0, K, src, bias, mb_weight, weight, prefetch):
        for mt in range((p_hi - p_lo) // MB):
            run(OUT, acc, MB, p_lo + mt * MB, n0, K, src, mb_weight, bias, no_prefetch)
        if (p_hi - p_lo) % MB >= 2:
            acc2 = T.alloc_buffer((2, NB, L), "float32", scope=small)  # on the stack (see the docstring)
            run(OUT, acc2, 2, p_hi - (p_hi - p_lo) % MB, n0, K, src, weight, bias, prefetch)
        if (p_hi - p_lo) % 2 == 1:
            acc1 = T.alloc_buffer((1, NB, L), "float32", scope=small)
            run(OUT, acc1, 1, p_hi - 1, n0, K, src, weight, bias, prefetch)
    return tiles


@T.macro(hygienic=True)
def sort_by_expert(IDS, offs, fill, order, pos, n_tok, E, k):
    """Counting sort of the S = n_tok * k assignments a = t * k + j (IDS[t, j] = expert) by expert, serial,
    O(S + E), stable in a: offs[e] = the first sorted position of expert e (offs[E] = the assignments in
    [0, E)), order[p] = the assignment at sorted position p, pos[a] = the sorted position of assignment a (fill
    [E]: scratch). An id outside [0, E) is another rank's expert (expert parallel: passes/shard.py): it is not
    sorted, no GEMM computes it and ``combine_in_token_order`` skips it."""
    for e in range(E + 1):
        offs[e] = 0
    for a in range(n_tok * k):
        if IDS[a // k, a % k] >= 0:
            if IDS[a // k, a % k] < E:
                offs[T.Cast("int32", IDS[a // k, a % k]) + 1] = offs[T.Cast("int32", IDS[a // k, a % k]) + 1] + 1
    for e in range(E):
        offs[e + 1] = offs[e + 1] + offs[e]
        fill[e] = offs[e]
    for a in range(n_tok * k):
        if IDS[a // k, a % k] >= 0:
            if IDS[a // k, a % k] < E:
                order[fill[T.Cast("int32", IDS[a // k, a % k])]] = T.Cast("int32", a)
                pos[a] = fill[T.Cast("int32", IDS[a // k, a % k])]
                fill[T.Cast("int32", IDS[a // k, a % k])] = fill[T.Cast("int32", IDS[a // k, a % k])] + 1


@T.macro(hygienic=True)
def combine_in_token_order(Y, WR, D, pos, IDS, E, n_tok, H, k, par, vec):
    """Y[t, h] = sum_j WR[t, j] * D[pos[t * k + j], h], j ascending, over the j whose expert IDS[t, j] is in
    [0, E) (the others are other ranks'): deterministic, no atomics (``par`` / ``vec``: the token and lane
    loops)."""
    for t in par(n_tok):
        for ho in range(H // L):
            for l in vec(L):
                Y[t, ho * L + l] = T.Cast(Y.dtype, T.float32(0))
        for j in range(k):
            if IDS[t, j] >= 0:
                if IDS[t, j] < E:
                    for ho in range(H // L):
                        for l in vec(L):
                            Y[t, ho * L + l] = Y[t, ho * L + l] + T.Cast(
                                Y.dtype, T.Cast("float32", WR[t, j]) * D[pos[t * k + j], ho * L + l])


@functools.lru_cache(maxsize=64)  # parsing the TVMScript takes seconds; a PrimFunc is immutable, shared safely
@parsed_shallow
def moe_experts_func(E: int, H: int, GU: int, I: int, k: int, *, layout: str, act, gate_up_bias: bool,
                     down_bias: bool, x_dtype="float32", ids_dtype="int64", w_dtype="float32", wt_dtype="float32",
                     out_dtype="float32", target_kind: str = "llvm", wfmt: str = "dense",
                     gate_up_block=(128, 128), down_block=(128, 128), decode: str | None = None,
                     int8: bool | str = False) -> tvm.tirx.PrimFunc:
    """``wfmt="mxfp4"``: the expert matrices arrive as published, blocks uint8 [E, out, in/32, 16] + scales uint8
    [E, out, in/32] (layout nk), and every weight element the GEMMs read is decoded in registers on the fly: no
    full-precision copy of any expert exists, the jobs read 4.25 bits per weight. The reduction runs in the nibble
    order of the code bytes (chunk ko = 2g + h, lane l: input 32g + 2l + h, the low (h = 0) or high nibble of byte
    l of block g), so a chunk's 16 codes are one contiguous 16-byte load; x is permuted into that order once per
    call (XP) and the activation phase writes A in it. A chunk's codes become 2 E2M1 by ``decode``
    (``dequant_decode.lookup_mode``: one ``pshufb`` on AVX2, one ``vpermps`` on AVX-512, integer bit arithmetic
    otherwise; ``dequant_decode.e2m1_x2_lookup``; None: ``arith`` for CUDA, the host CPU's mode for llvm), times
    2^(scale - 128) (exact: a small integer times a power of two).

    ``wfmt="fp8"``: each expert matrix is float8_e4m3fn in its parameter layout (Wgu [E, GU, H] nk / [E, H, GU]
    kn, Wd likewise) plus fp32 scales over its last two axes in blocks of ``gate_up_block`` / ``down_block``
    (rows, cols): Sgu [E, ceil(d1/br), ceil(d2/bc)], W[e, i1, i2] = E4M3(Wq[e, i1, i2]) * S[e, i1 // br, i2 // bc]
    (``frontend/checkpoint._fp8_param`` binds DeepSeek's 128x128 weight_scale_inv so; br < 128 where a tiny
    model's experts are shorter than a scale block). Decoded in registers as ``dequant_decode.e4m3_value_div256`` times
    256 * S (exact: a power of two), so the jobs read 1 byte per weight plus 4 bytes per block.

    ``int8`` (MXFP4 on x86 only; True: the host's ``gemv_int8.int8_mode``, or the mode named): every token tile runs
    on integers as ``gemv_int8`` does. x (per token, from XP) and A (per sorted position, after the activation) are
    quantised to int8 per 32-block once per call (``Int8Blocks.quantise_row``: XP's block g is the low nibbles' 16
    inputs then the high nibbles', so the code bytes' nibbles line up with QL / QH); a job's tiles (MB, 2, 1 rows as
    above) take ``Int8Blocks.block_dots`` over WMAX blocks per step for each of the NB weight rows, whose scales are
    widened once per job into SWV. Not the fp32 result: x and A are rounded to 8 bits per block (the op reference
    ``reference_moe.int8_blocks_ref`` rounds the same way). Measured at gpt-oss-20b width (32 experts, top-4,
    2880 x 2880, fresh routing per call, ``dayzero bench moe --full-width``): 2.3-2.6x the fp32 tiles' speed."""
    mx, f8 = wfmt == "mxfp4", wfmt == "fp8"
    if mx and (layout != "nk" or H % 32 or I % 32):
        raise InternalError(f"moe_experts mxfp4 kernel needs layout nk and H, I multiples of 32 (H={H}, I={I})")
    if GU % NB or H % NB or H % L or I % L:
        raise InternalError(f"moe_experts kernel needs H, GU multiples of {NB} and H, I multiples of {L} "
                            f"(H={H}, GU={GU}, I={I})")
    nk = layout == "nk"
    cuda = target_kind == "cuda"
    if mx and decode is None:
        from dayzero.targets.host import host_target_dict

        decode = "arith" if cuda else dequant_decode.lookup_mode(host_target_dict())
    if cuda and decode not in (None, "arith"):
        raise InternalError(f"moe_experts mxfp4 on CUDA decodes with integer arithmetic, not {decode!r}")
    q8 = None  # int8: the tiles' integer pieces (gemv_int8.Int8Blocks) in the host's mode, or the mode named
    if int8:
        from dayzero.targets.host import host_target_dict

        mode = None if cuda or not mx else int8 if isinstance(int8, str) else int8_mode(host_target_dict())
        if mode not in ("vnni", "maddubs"):
            raise InternalError("moe_experts int8 activations need MXFP4 experts on an x86 host with AVX2 "
                                f"(wfmt={wfmt}, target kind {target_kind})")
        q8 = Int8Blocks(mode)
    GH, GI = H // 32, I // 32

    def par(n):
        return T.thread_binding(n, thread="blockIdx.x") if cuda else T.parallel(n)

    def vec(n):
        return T.serial(n) if cuda else T.vectorized(n)

    def one():
        return T.thread_binding(1, thread="blockIdx.x") if cuda else T.serial(1)

    # AVX-512 fp32 tiles: a block's 16 code bytes as 4 dwords, broadcast to the 4 lane groups of a zmm (one load),
    # shifted per lane group, looked up with vpermps (which reads an index's low 4 bits): no byte widening
    dword = mx and not cuda and decode == "permvar16" and q8 is None

    def k_of(ko, l):
        """The reduction index that lane l of chunk ko stands for. MXFP4 (see above): the nibble order, lane l the
        low (ko even) or high nibble of byte l of block ko // 2; with ``dword``, lane l holds nibble l // 4 + 4 h
        (h = ko % 2) of the block's dword l % 4, input 32 g + 8 (l % 4) + l // 4 + 4 h."""
        if dword:
            return 32 * (ko // 2) + 8 * (l % 4) + l // 4 + 4 * (ko % 2)
        return 32 * (ko // 2) + 2 * l + ko % 2 if mx else ko * L + l

    def dword_lookup(WV, LUT, e, n, g, h, n_out, groups):
        """float32 x L: 2 E2M1 of the codes ``k_of`` puts in the lanes of chunk 2 g + h, weight row n (``dword``):
        the block's 4 dwords (WV: the blocks viewed as uint32) broadcast to 16 lanes, shifted right by
        4 (l // 4) + 16 h, vpermps over the 16-entry table (only the low 4 bits index it)."""
        words = WV[T.Ramp(((T.Cast("int64", e) * n_out + n) * groups + g) * 4, T.int64(1), 4)]  # int64 (see _func)
        shifts = T.Shuffle([T.Ramp(T.uint32(16 * h), T.uint32(4), 4)] * 4, [i // 4 for i in range(L)])
        codes = T.shift_right(T.Shuffle([words] * 4, list(range(L))), shifts)
        return T.call_llvm_pure_intrin(f"float32x{L}", "llvm.x86.avx512.permvar.sf.512", LUT[T.Ramp(0, 1, L)],
                                       T.reinterpret(f"int32x{L}", codes))

    def mx_blocks(W, S, LUT, e, n0, n_out, fetch, WV=None, groups=None, SWV=None):
        """The MXFP4 rows [n0, n0 + NB) of W block by block (``BlockWeight``); ``fetch``: its prefetch reads the
        next NB rows' block (clamped to the last row), else it is nothing. With ``dword`` the lookups are
        ``dword_lookup`` on WV (vector BlockWeight) and the scales SWV [NB G], widened once a job."""
        pre = lambda n, g: T.evaluate(0) if cuda or not fetch else prefetch_l2(  # noqa: E731
            W[e, T.min(n0 + NB + n, n_out - 1), g, 0])
        if dword:
            return BlockWeight(lambda n, g, _l: dword_lookup(WV, LUT, e, n0 + n, g, 0, n_out, groups),
                               lambda n, g, _l: dword_lookup(WV, LUT, e, n0 + n, g, 1, n_out, groups),
                               lambda n, g: SWV[n * groups + g], pre, vector=True)

        def nibble(h):
            def look(n, g, l):
                byte = W[e, n0 + n, g, l]
                code = T.shift_right(byte, T.uint8(4)) if h else T.bitwise_and(byte, T.uint8(15))
                return dequant_decode.e2m1_x2_lookup(decode, LUT[l], code)
            return look
        return BlockWeight(nibble(0), nibble(1),
                           lambda n, g: dequant_decode.e8m0_value(S[e, n0 + n, g]) * T.float32(0.5), pre)

    def fp8_at(W, S, blk, e, i1, i2):  # FP8 element [e, i1, i2] (storage axes) times its block scale
        return dequant_decode.e4m3_value_div256(T.reinterpret("uint8", W[e, i1, i2])) * \
            (S[e, i1 // blk[0], i2 // blk[1]] * T.float32(256))

    def w_at(W, S, LUT, blk, e, n, ko, l):  # weight [e, n, ko * L + l] of one expert matrix, fp32 (MXFP4: mx_blocks)
        if S is not None:
            return fp8_at(W, S, blk, e, n, ko * L + l) if nk else fp8_at(W, S, blk, e, ko * L + l, n)
        return T.Cast(f32, W[e, n, ko * L + l] if nk else W[e, ko * L + l, n])

    # FP8 prefill: an expert with >= MB tokens has its job's [NB, K] block decoded once into a per-thread fp32
    # buffer that every MB-token tile then reads (dense FMAs); fewer tokens (decode) decode in registers
    staged = f8 and nk and not cuda

    def gu_w(WB, W, S, LUT, e, n0, n, ko, l):
        return WB[n, ko * L + l] if WB is not None else w_at(W, S, LUT, gate_up_block, e, n0 + n, ko, l)

    def d_w(WB, W, S, LUT, e, n0, n, ko, l):
        return WB[n, ko * L + l] if WB is not None else w_at(W, S, LUT, down_block, e, n0 + n, ko, l)

    def staged_buf(wb):
        return wb if staged else None

    @T.macro(hygienic=True)
    def stage(wb, W, S, LUT, w_fn, e, n0, K):
        """wb[n, kk] = W[e, n0 + n, kk] decoded (FP8 staged kernels only; nothing otherwise)."""
        if staged:
            for n in range(NB):
                for ko in range(K // L):
                    for l in vec(L):
                        wb[n, ko * L + l] = w_fn(None, W, S, LUT, e, n0, n, ko, l)

    f32 = "float32"
    PGU, PD = parallel_chunks(GU // NB), parallel_chunks(H // NB)
    wgu_shape = (E, GU, H) if nk else (E, H, GU)
    wd_shape = (E, H, I) if nk else (E, I, H)
    tiles = expert_gemm_tiles(vec, blockwise=mx, cuda=cuda)

    def q8_rows(n):
        """Rows of a quantised-activation buffer: n with the integer tiles, else 1 (unused)."""
        return n if q8 is not None else 1

    def q8_prefetch(BF, O, G, e, n0, n, gc):
        """Prefetch (to L2) of step gc's code bytes of weight row n0 + NB + n (the next rows, clamped to the last)."""
        return prefetch_l2(BF[((e * O + T.min(n0 + NB + n, O - 1)) * G + gc * q8.WMAX) * 16])

    @T.macro(hygienic=True)
    def q8_tile(OUT, ACC8, SWV, rows, p0, n0, BF, O, G, e, LUT8, QL, QH, CORR, SX4, qrow, bias, fetch):
        """OUT[p0 + m, n0 + n] (m < rows, n < NB) on integers: weight row n0 + n's code bytes (BF: the blocks,
        flat) against the quantised activation row qrow(p0 + m) (gemv_int8.Int8Blocks), WMAX blocks per step,
        SWV [NB G] the rows' block scales; the partial sums of each (m, n) in 16 fp32 lanes of ACC8; ``fetch(n, gc)``
        a statement per step and weight row (the small tiles' prefetch of the next rows, as the fp32 tiles')."""
        for i in T.unroll(rows * NB):
            for l in T.vectorized(L):
                ACC8[i * L + l] = T.float32(0)
        for gc in range(G // q8.WMAX):
            for n in T.unroll(NB):
                fetch(n, gc)
            for n in T.unroll(NB):
                for m in T.unroll(rows):
                    ACC8[T.Ramp((m * NB + n) * L, 1, 4 * q8.WMAX)] = ACC8[T.Ramp((m * NB + n) * L, 1, 4 * q8.WMAX)] \
                        + q8.block_dots(BF, ((e * O + n0 + n) * G + gc * q8.WMAX) * 16, q8.WMAX, LUT8, QL, QH, CORR,
                                        SX4, qrow(p0 + m) * G + gc * q8.WMAX,
                                        q8.sw_lanes(SWV, n * G + gc * q8.WMAX, q8.WMAX))
        for n in T.unroll(NB):  # the blocks after the last full step: one of 2, then one of 1
            for m in T.unroll(rows):
                if G % q8.WMAX >= 2:
                    ACC8[T.Ramp((m * NB + n) * L, 1, 8)] = ACC8[T.Ramp((m * NB + n) * L, 1, 8)] + q8.block_dots(
                        BF, ((e * O + n0 + n) * G + G - G % q8.WMAX) * 16, 2, LUT8, QL, QH, CORR, SX4,
                        qrow(p0 + m) * G + G - G % q8.WMAX, q8.sw_lanes(SWV, n * G + G - G % q8.WMAX, 2))
                if G % 2 == 1:
                    ACC8[T.Ramp((m * NB + n) * L, 1, 4)] = ACC8[T.Ramp((m * NB + n) * L, 1, 4)] + q8.block_dots(
                        BF, ((e * O + n0 + n) * G + G - 1) * 16, 1, LUT8, QL, QH, CORR, SX4, qrow(p0 + m) * G + G - 1,
                        q8.sw_lanes(SWV, n * G + G - 1, 1))
        for m, n in T.grid(rows, NB):
            for l in T.vectorized(L // 2):
                ACC8[(m * NB + n) * L + l] = ACC8[(m * NB + n) * L + l] + ACC8[(m * NB + n) * L + l + L // 2]
            for l in T.vectorized(L // 4):
                ACC8[(m * NB + n) * L + l] = ACC8[(m * NB + n) * L + l] + ACC8[(m * NB + n) * L + l + L // 4]
            for l in T.vectorized(L // 8):
                ACC8[(m * NB + n) * L + l] = ACC8[(m * NB + n) * L + l] + ACC8[(m * NB + n) * L + l + L // 8]
            OUT[p0 + m, n0 + n] = bias(n) + (ACC8[(m * NB + n) * L] + ACC8[(m * NB + n) * L + 1])

    @T.macro(hygienic=True)
    def q8_tiles(OUT, ACC8, SWV, p_lo, p_hi, n0, BF, S, O, G, e, LUT8, QL, QH, CORR, SX4, qrow, bias):
        """The rows [p_lo, p_hi) of a job on integers: MB-row q8_tiles, then a 2-row and a 1-row one (as
        ``expert_gemm_tiles``), the NB weight rows' block scales widened once into SWV."""
        if p_hi - p_lo > 0:
            for n in range(NB):
                for g in T.vectorized(G):
                    SWV[n * G + g] = dequant_decode.e8m0_value(S[e, n0 + n, g]) * T.float32(0.5)
            for mt in range((p_hi - p_lo) // MB):
                q8_tile(OUT, ACC8, SWV, MB, p_lo + mt * MB, n0, BF, O, G, e, LUT8, QL, QH, CORR, SX4, qrow, bias,
                        no_prefetch)
            if (p_hi - p_lo) % MB >= 2:
                q8_tile(OUT, ACC8, SWV, 2, p_hi - (p_hi - p_lo) % MB, n0, BF, O, G, e, LUT8, QL, QH, CORR, SX4,
                        qrow, bias, lambda n, gc: q8_prefetch(BF, O, G, e, n0, n, gc))
            if (p_hi - p_lo) % 2 == 1:
                q8_tile(OUT, ACC8, SWV, 1, p_hi - 1, n0, BF, O, G, e, LUT8, QL, QH, CORR, SX4, qrow, bias,
                        lambda n, gc: q8_prefetch(BF, O, G, e, n0, n, gc))

    def bias(B, e, n):
        return T.float32(0) if B is None else T.Cast(f32, B[e, n])

    def prefetch(W, S, e, n, h):
        """Software prefetch (to L2) of the weight line [e, n, h] one n-block ahead: the next block of the same
        routed expert (clamped to its last row), so DRAM latency overlaps the current block's FMAs."""
        if (S is not None and not f8) or not nk or cuda:
            return T.evaluate(0)
        return prefetch_l2(W[e, n, h])

    def lanes(ko, l):
        """Index of lane l of chunk ko; l None: all L lanes (a vector tile)."""
        return T.Ramp(ko * L, 1, L) if l is None else ko * L + l

    def gu_src(X, XP, order, p, ko, l):  # x row of sorted position p, chunk ko lane l (None: all), fp32
        return XP[order[p] // k, lanes(ko, l)] if mx else T.Cast(f32, X[order[p] // k, ko * L + l])

    @T.macro(hygienic=True)
    def expert_block(src, row, w_of, W, WS, Bias, out, acc, wb, LUT, p_lo, p_hi, e, n0, n_out, k_in, groups, Q, WV):
        """Sorted positions [p_lo, p_hi) (expert e's tokens) x weight rows [n0, n0 + NB) (``expert_gemm_tiles``):
        src(p, ko, l) the input element, row(p) the token of sorted position p (integer tiles), w_of the weight
        element (``gu_w`` / ``d_w``). FP8 (``staged``): with >= MB tokens the block is decoded once into ``wb``
        and the MB tiles read it."""
        if q8 is not None and Q[2] is not None:  # integer tiles (the dense kernel has no flat weight views)
            q8_tiles(out, Q[0], Q[1], p_lo, p_hi, n0, Q[2], WS, n_out, groups, e, Q[3], Q[4], Q[5], Q[6], Q[7],
                     row, lambda n: bias(Bias, e, n0 + n))
        else:
            if p_hi - p_lo >= MB:
                stage(wb, W, WS, LUT, w_of, e, n0, k_in)
            if dword and p_hi - p_lo > 0:  # the NB rows' block scales, widened once a job (Q[1]: swv)
                for n in range(NB):
                    for g in T.vectorized(groups):
                        Q[1][n * groups + g] = dequant_decode.e8m0_value(WS[e, n0 + n, g]) * T.float32(0.5)
            tiles(out, acc, p_lo, p_hi, n0, k_in, src, lambda n: bias(Bias, e, n0 + n),
                  mx_blocks(W, WS, LUT, e, n0, n_out, False, WV, groups, Q[1]) if mx else
                  lambda n, ko, l: w_of(staged_buf(wb), W, WS, LUT, e, n0, n, ko, l),
                  mx_blocks(W, WS, LUT, e, n0, n_out, True, WV, groups, Q[1]) if mx else
                  lambda n, ko, l: w_of(None, W, WS, LUT, e, n0, n, ko, l),
                  lambda n, ko: prefetch(W, WS, e, T.min(n0 + NB + n, n_out - 1), ko * L))

    @T.macro(hygienic=True)
    def grouped_gemm(gate_up, parts, n_out, k_in, groups, ins, W, WS, Bias, out, LUT, offs, Q, WV):
        """One grouped GEMM over the routed experts (gate/up on ins = (X, XP, order); down on ins = (A,)): chunk
        c of ``parts`` owns n-blocks [c*nb, (c+1)*nb) of every expert, so each thread streams contiguous rows of
        each routed expert and the split does not depend on the routing (decode with 4 experts keeps every core
        busy). Q: the integer tiles' buffers after acc8 and swv."""
        for c in par(parts):
            acc = T.alloc_buffer((MB, NB, L), f32, scope="local")
            wb = T.alloc_buffer((NB, k_in if staged else 1), f32)
            acc8 = T.alloc_buffer((MB * NB * L,), f32, scope="local")
            swv = T.alloc_buffer((NB * groups if q8 is not None or dword else 1,), f32, scope="local")
            for e in range(E):
                for nbi in range(n_out // NB // parts):
                    if gate_up:
                        expert_block(lambda p, ko, l: gu_src(ins[0], ins[1], ins[2], p, ko, l),
                                     lambda p: ins[2][p] // k, gu_w, W, WS, Bias, out, acc, wb, LUT, offs[e],
                                     offs[e + 1], e, (c * (n_out // NB // parts) + nbi) * NB, n_out, k_in, groups,
                                     (acc8, swv, Q[0], Q[1], Q[2], Q[3], Q[4], Q[5]), WV)
                    else:
                        expert_block(lambda p, ko, l: ins[0][p, lanes(ko, l)], lambda p: p, d_w, W, WS, Bias, out,
                                     acc, wb, LUT, offs[e], offs[e + 1], e, (c * (n_out // NB // parts) + nbi) * NB,
                                     n_out, k_in, groups, (acc8, swv, Q[0], Q[1], Q[2], Q[3], Q[4], Q[5]), WV)

    @T.macro(hygienic=True)
    def body(X, IDS, WR, WGU, WGUS, BGU, WD, WDS, BD, Y, n_tok, FL):
        offs = T.alloc_buffer((E + 1,), "int32")
        fill = T.alloc_buffer((E,), "int32")
        order = T.alloc_buffer((n_tok * k,), "int32")
        pos = T.alloc_buffer((n_tok * k,), "int32")
        G = T.alloc_buffer((n_tok * k, GU), f32)
        A = T.alloc_buffer((n_tok * k, I), f32)  # MXFP4: its columns in nibble order (k_of)
        D = T.alloc_buffer((n_tok * k, H), f32)
        XP = T.alloc_buffer((n_tok if mx else 1, H), f32)  # MXFP4: x in nibble order
        LUT = T.alloc_buffer((16,), "int8" if decode == "pshufb" else f32)  # MXFP4: the decode's table
        # int8: x (per token) and A (per sorted position) quantised per 32-block for the decode tiles
        QXL = T.alloc_buffer((q8_rows(n_tok) * GH * 16,), "int8")
        QXH = T.alloc_buffer((q8_rows(n_tok) * GH * 16,), "int8")
        CX = T.alloc_buffer((q8_rows(n_tok) * GH * 4,), "int32")
        SXX = T.alloc_buffer((q8_rows(n_tok) * GH * 4,), f32)
        QAL = T.alloc_buffer((q8_rows(n_tok) * k * GI * 16,), "int8")
        QAH = T.alloc_buffer((q8_rows(n_tok) * k * GI * 16,), "int8")
        CA = T.alloc_buffer((q8_rows(n_tok) * k * GI * 4,), "int32")
        SXA = T.alloc_buffer((q8_rows(n_tok) * k * GI * 4,), f32)
        LUT8 = T.alloc_buffer((64 if q8 is not None else 1,), "int8")
        if mx:
            for c in range(16):
                LUT[c] = dequant_decode.e2m1_x2_table(decode, c)
            for t in par(n_tok):
                for ho in range(H // L):
                    for l in vec(L):
                        XP[t, ho * L + l] = T.Cast(f32, X[t, k_of(ho, l)])
                if q8 is not None:  # XP's block g: the low nibbles' 16 inputs, then the high nibbles'
                    q8.quantise_row(lambda g, h, j: XP[t, g * 32 + h * 16 + j], QXL, QXH, CX, SXX, t, GH)
            if q8 is not None:
                q8.fill_lut(LUT8)
        # 1. counting sort of assignments by expert
        for _s in one():
            sort_by_expert(IDS, offs, fill, order, pos, n_tok, E, k)
        # 2. gate/up grouped GEMM over the routed experts
        grouped_gemm(True, PGU, GU, H, GH, (X, XP, order), WGU, WGUS, BGU, G, LUT, offs,
                     (flat(FL, 0), LUT8, QXL, QXH, CX, SXX), flat(FL, 2))
        # 3. activation
        for p in par(n_tok * k):
            for io in range(I // L):
                for l in vec(L):
                    A[p, io * L + l] = act_value(act, G, p, k_of(io, l))
            if q8 is not None:
                q8.quantise_row(lambda g, h, j: A[p, g * 32 + h * 16 + j], QAL, QAH, CA, SXA, p, GI)
        # 4. down grouped GEMM
        grouped_gemm(False, PD, H, I, GI, (A,), WD, WDS, BD, D, LUT, offs, (flat(FL, 1), LUT8, QAL, QAH, CA, SXA),
                     flat(FL, 3))
        # 5. weighted combine in token order
        combine_in_token_order(Y, WR, D, pos, IDS, E, n_tok, H, k, par, vec)

    if mx:
        gu_st = (((E, GU, H // 32, 16), "uint8"), ((E, GU, H // 32), "uint8"))
        d_st = (((E, H, I // 32, 16), "uint8"), ((E, H, I // 32), "uint8"))
    elif f8:
        def scale_shape(shape, blk):
            return (E, -(-shape[1] // blk[0]), -(-shape[2] // blk[1]))
        gu_st = ((wgu_shape, "float8_e4m3fn"), (scale_shape(wgu_shape, gate_up_block), "float32"))
        d_st = ((wd_shape, "float8_e4m3fn"), (scale_shape(wd_shape, down_block), "float32"))
    else:  # dense: the weights as they are, no scales (the scale parameters are dropped)
        gu_st, d_st = ((wgu_shape, wt_dtype), None), ((wd_shape, wt_dtype), None)
    return _func(body, E, H, GU, k, gu_st, d_st, x_dtype, ids_dtype, w_dtype, wt_dtype, out_dtype,
                 gate_up_bias, down_bias)


WIDE_ELEMENTS = 1 << 31  # a stack of at least this many elements is indexed in int64


def wide(shape: tuple) -> tuple:
    """SHAPE as the kernel declares it: int64 dimensions when the stack has WIDE_ELEMENTS elements or more, so
    every flattened index into it is computed in int64 (DeepSeek-V3.2's FP8 gate_up stack, 256 x 4096 x 7168
    bytes, is past int32)."""
    if math.prod(shape) < WIDE_ELEMENTS:
        return tuple(shape)
    return tuple(tvm.tirx.IntImm("int64", int(d)) for d in shape)


def flat(FL, i: int):
    """The i-th flat weight view the stored kernels pass (``_func``), None for the dense kernel."""
    return None if FL is None else FL[i]


def optional(present: bool, buf):
    """``buf`` if the kernel variant takes that argument, else None (what a kernel body reads as "absent")."""
    return buf if present else None


def drop_absent(func: tvm.tirx.PrimFunc, gate_up_bias: bool, down_bias: bool, scales: bool = True
                ) -> tvm.tirx.PrimFunc:
    """FUNC, written with every argument and a body that reads the optional ones through ``optional``, without the
    parameters the variant does not take: the biases (buffers named BGU and BD) a node lacks, and without
    ``scales`` the scale tensors (GS and DS: dense weights). One TVMScript signature serves every variant, whose
    argument lists are the node's inputs (absent biases are not inputs)."""
    drop = {name for name, on in (("BGU", gate_up_bias), ("BD", down_bias), ("GS", scales), ("DS", scales))
            if not on}
    keep = [p for p in func.params if p.name not in drop]
    if len(func.params) - len(keep) != len(drop):
        raise InternalError(f"expert kernel: parameters {sorted(drop)} not found in {func.params}")
    return tvm.tirx.PrimFunc(keep, func.body, func.ret_type, func.attrs)


def _func(body, E, H, GU, k, gu_st, d_st, x_dtype, ids_dtype, w_dtype, b_dtype, out_dtype,
          gate_up_bias: bool, down_bias: bool) -> tvm.tirx.PrimFunc:
    """The kernel's one signature: each expert matrix given as ((shape, dtype), (shape, dtype) or None): as stored,
    MXFP4 (blocks, scales) or FP8 (weight, block scales), read with flat views for the integer tiles; or dense
    (weight, None), whose scale parameters are dropped with the absent biases (``drop_absent``)."""
    stored = gu_st[1] is not None
    ((gub, gubt), (gus, gust)), ((db, dbt), (ds, dst)) = [(m, s or ((1,), "float32")) for m, s in (gu_st, d_st)]
    (gub_n,), (db_n,) = wide((math.prod(gub),)), wide((math.prod(db),))
    # the dword views, indexed in int64: a stack of 2^31 bytes has 2^29 dwords but overflows the int32 byte math
    gub_w, db_w = (tvm.tirx.IntImm("int64", math.prod(m) // 4) for m in (gub, db))
    gub, db = wide(gub), wide(db)

    @T.prim_func
    def func(x_h: T.handle, ids_h: T.handle, w_h: T.handle, gub_h: T.handle, gus_h: T.handle, bgu_h: T.handle,
             db_h: T.handle, ds_h: T.handle, bd_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n_tok = T.int64()
        X = T.match_buffer(x_h, (n_tok, H), x_dtype)
        IDS = T.match_buffer(ids_h, (n_tok, k), ids_dtype)
        WR = T.match_buffer(w_h, (n_tok, k), w_dtype)
        GB = T.match_buffer(gub_h, gub, gubt)
        GS = T.match_buffer(gus_h, gus, gust)
        BGU = T.match_buffer(bgu_h, (E, GU), b_dtype)
        DB = T.match_buffer(db_h, db, dbt)
        DS = T.match_buffer(ds_h, ds, dst)
        BD = T.match_buffer(bd_h, (E, H), b_dtype)
        Y = T.match_buffer(y_h, (n_tok, H), out_dtype)
        GBF = T.decl_buffer((gub_n,), gubt, data=GB.data)  # flat views: the integer tiles' byte vectors
        DBF = T.decl_buffer((db_n,), dbt, data=DB.data)
        GBW = T.decl_buffer((gub_w,), "uint32", data=GB.data)  # and as dwords (the AVX-512 fp32 tiles' loads)
        DBW = T.decl_buffer((db_w,), "uint32", data=DB.data)
        body(X, IDS, WR, GB, optional(stored, GS), optional(gate_up_bias, BGU), DB, optional(stored, DS),
             optional(down_bias, BD), Y, n_tok, (GBF, DBF, GBW, DBW) if stored else None)

    return drop_absent(func, gate_up_bias, down_bias, stored)


def params(node) -> dict:
    a = node.attr
    x, ids, w, wgu = node.inputs[:4]
    wd = node.inputs[5 if a["gate_up_bias"] else 4]
    return dict(E=int(wgu.shape[0]), H=int(x.shape[1]), GU=int(wgu.shape[1] if a["layout"] == "nk" else wgu.shape[2]),
                I=int(a["inter"]), k=int(ids.shape[1]), layout=a["layout"], act=a["act"],
                gate_up_bias=a["gate_up_bias"], down_bias=a["down_bias"], x_dtype=x.dtype, ids_dtype=ids.dtype,
                w_dtype=w.dtype, wt_dtype=wgu.dtype, out_dtype=node.dtype, wd_dtype=wd.dtype)


def _build(p: dict, target_kind: str) -> tvm.tirx.PrimFunc:
    p = {k: _tuples(v) for k, v in p.items()}  # as the node's attrs hold them (JSON gives lists): one cache key
    p.pop("wd_dtype")
    E, H, GU, I, k = (p.pop(n) for n in ("E", "H", "GU", "I", "k"))
    return moe_experts_func(E, H, GU, I, k, target_kind=target_kind, **p)


def _tuples(v):
    return tuple(_tuples(x) for x in v) if isinstance(v, (list, tuple)) else v


def prim_func(node) -> tvm.tirx.PrimFunc | None:
    """The kernel table's compute (codegen/kernels/table.py): the host-CPU kernel, carrying its parameters so
    the schedule rule can rebuild it for the actual target (compute does not see the target)."""
    p = params(node)
    if not capabilities.moe_experts(p["H"], p["GU"], p["I"], p["wt_dtype"], p["wd_dtype"]):
        raise InternalError(f"moe_experts kernel cannot take {p} (the moe pass asks targets/capabilities.py first)")
    return _build(p, "llvm").with_attr("dayzero.moe_params", json.dumps(p, sort_keys=True))


def schedule_rule(kernel, target: tvm.target.Target, symbols: dict | None = None):
    """The kernel table's schedule rule: the same kernel written for the target (CPU: parallel + AVX-512 lanes; CUDA:
    phases bound to blocks)."""
    attrs = kernel.func.attrs
    if attrs is None or "dayzero.moe_params" not in attrs:
        return None
    kind = "cuda" if target.kind.name == "cuda" else "llvm"
    f = _build(json.loads(str(attrs["dayzero.moe_params"])), kind)
    f = f.with_attr("global_symbol", attrs["global_symbol"]).with_attr("tirx.is_scheduled", True)
    return tvm.IRModule({"main": f})


def bytes_read(ids, *, E: int, H: int, GU: int, I: int, wt_bytes: int = 4, act_bytes: int = 4) -> dict:
    """Bytes one call reads from memory, counted from the kernel's loop structure (phases 2 and 4).

    A job (expert e, n-block) runs ceil(cnt_e / MB) token tiles; each tile sweeps the job's [NB, K] weight block,
    the first from memory and the rest from L1 (NB * K * 4 = 16 KiB at K = 1024), so memory traffic per job is
    one block when cnt_e > 0 and nothing when cnt_e == 0; activations: x rows, G, A, D written and read once, y
    written, ids/weights read. Returns {"weights", "activations", "total", "routed_expert_bytes"}."""
    import torch

    ids = torch.as_tensor(ids)
    S = ids.numel()
    cnt = torch.bincount(ids.reshape(-1).long(), minlength=E)
    weights = 0
    for e in range(E):
        if cnt[e] > 0:
            weights += (GU // NB) * NB * H * wt_bytes  # phase 2 jobs of expert e
            weights += (H // NB) * NB * I * wt_bytes  # phase 4 jobs
    T = ids.shape[0]
    acts = (S * H + 2 * S * GU + 2 * S * I + 2 * S * H + T * H) * act_bytes + S * 16
    routed = int((cnt > 0).sum()) * (GU * H + H * I) * wt_bytes
    return {"weights": weights, "activations": acts, "total": weights + acts, "routed_expert_bytes": routed}


def params_mxfp4(node) -> dict:
    """moe_experts_mxfp4(x, ids, w, gu_blocks, gu_scales, [b_gu], d_blocks, d_scales, [b_d]) (passes/dequant.py)."""
    a = node.attr
    x, ids, w, gub = node.inputs[:4]
    bias = node.inputs[5] if a["gate_up_bias"] else (node.inputs[-1] if a["down_bias"] else None)
    return dict(E=int(gub.shape[0]), H=int(x.shape[1]), GU=int(gub.shape[1]), I=int(a["inter"]), k=int(ids.shape[1]),
                layout="nk", act=a["act"], gate_up_bias=a["gate_up_bias"], down_bias=a["down_bias"],
                x_dtype=x.dtype, ids_dtype=ids.dtype, w_dtype=w.dtype,
                wt_dtype=bias.dtype if bias is not None else "float32", out_dtype=node.dtype, wd_dtype="uint8",
                wfmt="mxfp4", **({"int8": True} if a.get("int8") else {}))


def prim_func_mxfp4(node) -> tvm.tirx.PrimFunc:
    p = params_mxfp4(node)
    if not capabilities.moe_experts_mxfp4(p["H"], p["GU"], p["I"]):
        raise InternalError(f"moe_experts_mxfp4 kernel cannot take {p} (the dequant pass checks first)")
    return _build(p, "llvm").with_attr("dayzero.moe_params", json.dumps(p, sort_keys=True))


def params_fp8(node) -> dict:
    """moe_experts_fp8(x, ids, w, gu_weight, gu_scale, [b_gu], d_weight, d_scale, [b_d]) (passes/dequant.py)."""
    a = node.attr
    x, ids, w, guw = node.inputs[:4]
    bias = node.inputs[5] if a["gate_up_bias"] else (node.inputs[-1] if a["down_bias"] else None)
    nk = a["layout"] == "nk"
    return dict(E=int(guw.shape[0]), H=int(x.shape[1]), GU=int(guw.shape[1] if nk else guw.shape[2]),
                I=int(a["inter"]), k=int(ids.shape[1]), layout=a["layout"], act=a["act"],
                gate_up_bias=a["gate_up_bias"], down_bias=a["down_bias"], x_dtype=x.dtype, ids_dtype=ids.dtype,
                w_dtype=w.dtype, wt_dtype=bias.dtype if bias is not None else "float32", out_dtype=node.dtype,
                wd_dtype="float8_e4m3fn", wfmt="fp8", gate_up_block=list(a["gate_up_block"]),
                down_block=list(a["down_block"]))


def prim_func_fp8(node) -> tvm.tirx.PrimFunc:
    p = params_fp8(node)
    if not capabilities.moe_experts_fp8(p["H"], p["GU"], p["I"]):
        raise InternalError(f"moe_experts_fp8 kernel cannot take {p} (the dequant pass checks first)")
    return _build(p, "llvm").with_attr("dayzero.moe_params", json.dumps(p, sort_keys=True))

