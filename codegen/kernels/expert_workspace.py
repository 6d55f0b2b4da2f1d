"""MXFP4 routed experts through a converted-expert workspace: convert -> compute -> reclaim -> reuse.

The fused route (``codegen/kernels/moe.py`` ``wfmt="mxfp4"``) decodes every weight element in registers each time
a token tile reads it. This route converts a routed expert ONCE per call into a slot of a fixed workspace, in the
target's compute dtype, and runs dense GEMMs over the converted slot for all of that expert's tokens; the slot is
then reclaimed for the next routed expert (of this layer, or of the next layer: the workspace is one ``state``
buffer, zone ``dequant_workspace``, shared by every layer and program with the same expert shape). With a cache
budget the workspace has several slots and keeps the last converted experts (keyed by (layer, expert)) under LRU
eviction, so an expert routed again in a later step or layer-call is not converted again.

Arguments (the ``moe_experts_mxfp4_ws`` node's inputs, then its output; see ``passes/expert_workspace.py``)::

    x     [T, H]             hidden states (T symbolic)
    ids   [T, k]  int        routed expert of each (token, slot);  w [T, k] routing weights
    gb    uint8 [E, GU, H/32, 16]   gs uint8 [E, GU, H/32]   (MXFP4 gate/up, as published)   b_gu [E, GU] (opt.)
    db    uint8 [E, H, I/32, 16]    ds uint8 [E, H, I/32]    (MXFP4 down)                    b_d  [E, H]  (opt.)
    layer int32 [1]          this layer's index (the cache key is layer * E + expert + 1; 0 marks an empty slot)
    ws    CD [S, GU*H + H*I] the workspace: slot s holds one expert, gate/up rows [GU, H] then down rows [H, I]
    meta  int64 [4 + 2S]     bookkeeping (zero at load): [0] tick, [1] hits, [2] conversions (misses),
                             [3] unused, [4, 4+S) slot tags, [4+S, 4+2S) tick of each slot's last use
    y     [T, H]

Compute dtypes (``CD``; a target property, targets/spec.py ``compute_dtype``):
- ``float32``: the slot holds fp32 weights (exact: E2M1 x E8M0 is an fp32 value); GEMMs in fp32.
- ``bfloat16``: the slot holds bf16 weights (also exact: E2M1 has 1 mantissa bit, bf16's exponent range is fp32's)
  and x is rounded to bf16 as it enters the GEMM (a bf16 matrix unit's inputs); fp32 accumulation.
- ``float8_e4m3fn``: the slot holds the E2M1 values as e4m3 bytes (exact) and the products take the block's E8M0
  scale from the resident scales (a 1x32 block-scaled fp8 GEMM, W8 with fp32 activations on this host, which has
  no fp8 FMA); half the workspace bytes of bf16.

Phases: 1. counting sort of the (token, slot) assignments by expert (serial, moe.py's ``sort_by_expert``). 2. one
SERIAL loop over the experts with tokens, ascending: LRU lookup (serial, O(S)); gate/up GEMM of its tokens
reading the slot (parallel over n-block chunks, the token tiles of moe.py's ``expert_gemm_tiles``: 4 tokens x 4
rows x 16 fp32 lanes), on a miss each chunk first converting its 4-row block into the victim slot (32 values per
scale byte, vectorised), so the GEMM reads the rows it just wrote from L1; activation; down GEMM (same).
3. weighted combine in token order (deterministic, no atomics: ``combine_in_token_order``). Experts nobody routed
are never read or converted.

Why a serial expert loop: the slot must be converted before its GEMMs read it and must not be reclaimed before
they finish; each phase is a parallel region of its own, so the cores split every expert's work whatever the
routing (decode with 4 experts keeps both cores busy, as in moe.py).

Which route a program takes (``passes/expert_workspace.route_for``), measured side by side with
``dayzero bench moe --mxfp4-routes --json`` on this host (2 znver4 cores shared with other jobs, load average 5-7,
so absolute times are noisy; the ratios below are workspace / fused time from two runs of the same bench), 64
experts, top-4, H=1024, I=512, MXFP4:
- prefill T=256 (16 tokens per expert): 0.58x / 0.57x (fp32 slot), bf16 slot 0.64x / 0.60x, fp8 slot 0.54x /
  0.69x; at T=64 (4 tokens per expert, ``--quick``) 0.94x. Converting once and reading the converted rows beats
  decoding every element once per 4-token tile, by more the more tokens an expert has, and short prompts fall
  back to the decode case below (parity), never worse -> workspace.
- decode T=1, no cache, a fresh routing per call: 0.97x / 0.98x, i.e. parity: each routed expert serves one token,
  and converting a 4-row block into the slot and reading it back from L1 costs what decoding in registers does
  (before the convert was fused into the GEMM's n-blocks, a separate convert pass made this 1.2x-1.8x slower).
  No gain, and the fused route needs no workspace -> fused.
- decode with an LRU cache of 96 MiB shared by 2 layers, Zipf(1.2) routing: fp32 slots (16 experts, hit rate
  0.44) 0.70x / 0.74x; bf16 slots (32 experts, hit rate 0.67) 0.56x / 0.64x. The cache pays with hot experts,
  but its budget is the user's to give, so it is opt-in (``--expert-cache BYTES``) and, when on, every program
  takes the workspace route (the cache persists across steps and programs only if they all read it).
A target whose compute dtype is not fp32 takes the workspace route in every program (the fused route computes in
fp32). CUDA: not written for it; CUDA targets keep the fused route.
Measured again after the fused kernel's decode became 16 codes per contiguous byte load looked up by one pshufb
(the dequant kernels' ``e2m1_x2_lookup``; it had been a scalar byte gather, 480 vpinsrb): the same bench on a
2-core znver3 (AVX2) host, load average 3.5-4.5, one run, workspace / fused = 1.28x at prefill T=256 (bf16 slot
1.34x, fp8 slot 1.41x), 3.5x at decode T=1, 2.6x (fp32) / 2.2x (bf16) with the LRU cache: on this host the fused
route is now the faster one in every case, so ``route_for`` (auto) takes the fused route in every program when
the compute dtype is fp32 and no cache is asked for; the workspace route serves non-fp32 compute dtypes (bf16 / fp8
targets) and an explicit ``--expert-cache``.
"""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

from dayzero import InternalError
from dayzero.codegen.kernels.dequant import decode as dequant_decode
from dayzero.codegen.kernels.moe import (L, MB, NB, act_value, combine_in_token_order, drop_absent,
                                         expert_gemm_tiles, no_prefetch, optional, parallel_chunks, sort_by_expert)
from dayzero.codegen.tvmscript import parsed_shallow
from dayzero.passes.ir.dayzero_ops import WORKSPACE_META_HEAD as META_HEAD
from dayzero.passes.ir.dayzero_ops import WORKSPACE_STORAGE as STORAGE
from dayzero.passes.ir.dayzero_ops import workspace_meta_len as meta_len
from dayzero.passes.ir.dayzero_ops import workspace_slot_elems as slot_elems
from dayzero.targets import capabilities

OP = "moe_experts_mxfp4_ws"


def _e4m3_of_e2m1(code):
    """E2M1 code (0..15, int32) -> the e4m3 byte of the same value (exact): 0, 0.5 = 0x30, 1..6 = 0x38 + 4(m-2)."""
    m = code & 7
    mag = T.Select(m == 0, 0, T.Select(m == 1, 0x30, 0x38 + (m - 2) * 4))
    return T.Cast("uint8", mag | ((code & 8) << 4))


def _round_bf16(v):
    """fp32 -> the nearest bf16 value (ties to even), as fp32. Written with integer ops: TVM's simplifier folds
    Cast(f32, Cast(bf16, v)) back to v (measured: the pair changed nothing), which would skip the rounding."""
    u = T.reinterpret("uint32", v)
    r = (u + T.uint32(0x7FFF) + ((u >> T.uint32(16)) & T.uint32(1))) & T.uint32(0xFFFF0000)
    return T.reinterpret("float32", r)


@parsed_shallow
def workspace_func(E: int, H: int, GU: int, I: int, k: int, *, act, gate_up_bias: bool, down_bias: bool,
                   compute_dtype: str, slots: int, cache: bool, x_dtype="float32", ids_dtype="int64",
                   w_dtype="float32", b_dtype="float32", out_dtype="float32") -> tvm.tirx.PrimFunc:
    """The kernel for one expert shape (host CPU). ``cache=False``: one slot, every routed expert converted on
    every call (meta counts conversions); ``cache=True``: ``slots`` slots under LRU."""
    if not capabilities.moe_experts_mxfp4_ws(H, GU, I):
        raise InternalError(f"expert workspace kernel needs H, I multiples of 32 and GU of {NB} "
                            f"(H={H}, GU={GU}, I={I})")
    if compute_dtype not in STORAGE:
        raise InternalError(f"expert workspace: compute dtype {compute_dtype!r} is not one of {sorted(STORAGE)}")
    if slots < 1 or (not cache and slots != 1):
        raise InternalError(f"expert workspace: {slots} slots with cache={cache}")
    S, WE, GUH = slots, slot_elems(H, GU, I), GU * H
    sd = STORAGE[compute_dtype]
    f32 = "float32"
    bf16 = compute_dtype == "bfloat16"
    fp8 = compute_dtype == "float8_e4m3fn"
    PGU, PD = parallel_chunks(GU // NB), parallel_chunks(H // NB)
    tiles = expert_gemm_tiles()
    TAGS, LAST = META_HEAD, META_HEAD + S

    def xin(v):  # an activation as the GEMM's input dtype sees it (bf16: rounded once, before the GEMMs)
        return _round_bf16(T.Cast(f32, v)) if bf16 else T.Cast(f32, v)

    def stored(value, code):  # a decoded weight -> the workspace's element
        if fp8:
            return _e4m3_of_e2m1(code)
        return T.Cast(sd, value)

    def wv(WS, slot, idx, SC, e, n, kk):  # a workspace element as fp32 (fp8: times its block scale)
        if fp8:
            return dequant_decode.e4m3_value_div256(WS[slot, idx]) * \
                (dequant_decode.e8m0_value(SC[e, n, kk // 32]) * T.float32(256.0))
        return T.Cast(f32, WS[slot, idx])

    def row_bias(B, e, n0):  # bias(n) of ``expert_gemm_tiles``: row n0 + n of the bias, fp32
        return lambda n: T.float32(0) if B is None else T.Cast(f32, B[e, n0 + n])

    def slot_weight(WS, slot, SC, e, n0, K, base):  # weight(n, ko, l): row n0 + n of the matrix at ``base``
        return lambda n, ko, l: wv(WS, slot, base + (n0 + n) * K + ko * L + l, SC, e, n0 + n, ko * L + l)

    @T.macro(hygienic=True)
    def convert(B, SC, WS, slot, e, n0, K, base):
        """WS[slot, base + n*K + j] = E2M1(B[e, n, j]) * 2^(SC[e, n, j/32] - 127) for the NB rows n0 + [0, NB)."""
        for n in range(NB):
            for g in range(K // 32):
                for j in T.vectorized(32):
                    WS[slot, base + (n0 + n) * K + g * 32 + j] = stored(
                        dequant_decode.e2m1_value(T.shift_right(T.Cast("int32", B[e, n0 + n, g, j // 2]), (j % 2) * 4)
                                           & 15) * dequant_decode.e8m0_value(SC[e, n0 + n, g]),
                        T.shift_right(T.Cast("int32", B[e, n0 + n, g, j // 2]), (j % 2) * 4) & 15)

    @T.macro(hygienic=True)
    def gemm(SRC, row_of, B, WS, SC, BIAS, OUT, p_lo, p_hi, slot, hit, e, N, K, base, P):
        """Expert e's sorted positions [p_lo, p_hi) x all N output rows, split into P chunks of n-blocks. On a miss
        (``hit`` 0) each n-block is converted into the slot just before its token tiles read it, so the converted
        rows are read back from L1 (the convert is split over the cores as the GEMM is)."""
        for c in T.parallel(P):
            acc = T.alloc_buffer((MB, NB, L), f32, scope="local")
            for nbi in range(N // NB // P):
                if hit == 0:
                    convert(B, SC, WS, slot, e, (c * (N // NB // P) + nbi) * NB, K, base)
                tiles(OUT, acc, p_lo, p_hi, (c * (N // NB // P) + nbi) * NB, K,
                      lambda p, ko, l: SRC[row_of(p), ko * L + l], row_bias(BIAS, e, (c * (N // NB // P) + nbi) * NB),
                      slot_weight(WS, slot, SC, e, (c * (N // NB // P) + nbi) * NB, K, base),
                      slot_weight(WS, slot, SC, e, (c * (N // NB // P) + nbi) * NB, K, base), no_prefetch)

    @T.macro(hygienic=True)
    def body(X, IDS, WR, GB, GS, BGU, DB, DS, BD, LAYER, WS, META, Y, n_tok):
        offs = T.alloc_buffer((E + 1,), "int32")
        fill = T.alloc_buffer((E,), "int32")
        order = T.alloc_buffer((n_tok * k,), "int32")
        pos = T.alloc_buffer((n_tok * k,), "int32")
        G = T.alloc_buffer((n_tok * k, GU), f32)
        A = T.alloc_buffer((n_tok * k, I), f32)
        D = T.alloc_buffer((n_tok * k, H), f32)
        XC = T.alloc_buffer((n_tok, H), f32)  # x as the compute dtype sees it, once (not once per weight row)
        cur = T.alloc_buffer((2,), "int32")  # slot, hit (1) or convert (0)
        for t in T.parallel(n_tok):
            for ho in range(H // L):
                for l in T.vectorized(L):
                    XC[t, ho * L + l] = xin(X[t, ho * L + l])
        # 1. counting sort of assignments by expert
        sort_by_expert(IDS, offs, fill, order, pos, n_tok, E, k)
        # 2. the routed experts one after another: lookup, convert on a miss, compute from the slot
        for e in range(E):
            if offs[e + 1] > offs[e]:
                META[0] = META[0] + T.int64(1)
                cur[0] = 0
                cur[1] = 0
                if cache:
                    for s in range(S):  # a tag match, else the least recently used slot (empty slots: tick 0)
                        if META[TAGS + s] == T.Cast("int64", LAYER[0]) * T.int64(E) + T.int64(e + 1):
                            cur[0] = s
                            cur[1] = 1
                    if cur[1] == 0:
                        for s in range(S):
                            if META[LAST + s] < META[LAST + cur[0]]:
                                cur[0] = s
                    META[TAGS + cur[0]] = T.Cast("int64", LAYER[0]) * T.int64(E) + T.int64(e + 1)
                    META[LAST + cur[0]] = META[0]
                if cur[1] == 1:
                    META[1] = META[1] + T.int64(1)
                else:
                    META[2] = META[2] + T.int64(1)
                gemm(XC, lambda p: order[p] // k, GB, WS, GS, BGU, G, offs[e], offs[e + 1], cur[0], cur[1], e, GU,
                     H, 0, PGU)
                for p in T.parallel(offs[e + 1] - offs[e]):
                    for io in range(I // L):
                        for l in T.vectorized(L):
                            A[offs[e] + p, io * L + l] = xin(act_value(act, G, offs[e] + p, io * L + l))
                gemm(A, lambda p: p, DB, WS, DS, BD, D, offs[e], offs[e + 1], cur[0], cur[1], e, H, I, GUH, PD)
        # 3. weighted combine in token order
        combine_in_token_order(Y, WR, D, pos, IDS, E, n_tok, H, k, T.parallel, T.vectorized)

    gub, gus, db, ds = (E, GU, H // 32, 16), (E, GU, H // 32), (E, H, I // 32, 16), (E, H, I // 32)
    ML = meta_len(S)

    @T.prim_func
    def kernel(x_h: T.handle, ids_h: T.handle, w_h: T.handle, gub_h: T.handle, gus_h: T.handle, bgu_h: T.handle,
               db_h: T.handle, ds_h: T.handle, bd_h: T.handle, layer_h: T.handle, ws_h: T.handle, meta_h: T.handle,
               y_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n_tok = T.int64()
        X = T.match_buffer(x_h, (n_tok, H), x_dtype)
        IDS = T.match_buffer(ids_h, (n_tok, k), ids_dtype)
        WR = T.match_buffer(w_h, (n_tok, k), w_dtype)
        GB = T.match_buffer(gub_h, gub, "uint8")
        GS = T.match_buffer(gus_h, gus, "uint8")
        BGU = T.match_buffer(bgu_h, (E, GU), b_dtype)
        DB = T.match_buffer(db_h, db, "uint8")
        DS = T.match_buffer(ds_h, ds, "uint8")
        BD = T.match_buffer(bd_h, (E, H), b_dtype)
        LAYER = T.match_buffer(layer_h, (1,), "int32")
        WS = T.match_buffer(ws_h, (S, WE), sd)
        META = T.match_buffer(meta_h, (ML,), "int64")
        Y = T.match_buffer(y_h, (n_tok, H), out_dtype)
        body(X, IDS, WR, GB, GS, optional(gate_up_bias, BGU), DB, DS, optional(down_bias, BD), LAYER, WS, META, Y,
             n_tok)

    return drop_absent(kernel, gate_up_bias, down_bias)


def params(node) -> dict:
    """Kernel parameters of a moe_experts_mxfp4_ws node (passes/expert_workspace.py)."""
    a = node.attr
    x, ids, w, gb = node.inputs[:4]
    ws = node.inputs[-2]
    bias = node.inputs[5] if a["gate_up_bias"] else (node.inputs[-4] if a["down_bias"] else None)
    return dict(E=int(gb.shape[0]), H=int(x.shape[1]), GU=int(gb.shape[1]), I=int(a["inter"]), k=int(ids.shape[1]),
                act=a["act"], gate_up_bias=a["gate_up_bias"], down_bias=a["down_bias"],
                compute_dtype=a["compute_dtype"], slots=int(ws.shape[0]), cache=bool(a["cache"]),
                x_dtype=x.dtype, ids_dtype=ids.dtype, w_dtype=w.dtype,
                b_dtype=bias.dtype if bias is not None else "float32", out_dtype=node.dtype)


def prim_func(node) -> tvm.tirx.PrimFunc:
    """The kernel table's compute: the host-CPU kernel, written scheduled (the pass routes only LLVM targets here)."""
    p = params(node)
    E, H, GU, I, k = (p.pop(n) for n in ("E", "H", "GU", "I", "k"))
    f = workspace_func(E, H, GU, I, k, **p)
    return f.with_attr("tirx.is_scheduled", True)



def geometry(node) -> tuple[int, int, int]:
    """(H, GU, I) of a moe_experts_mxfp4_ws node: what targets/capabilities.py's answer depends on."""
    p = params(node)
    return p["H"], p["GU"], p["I"]
