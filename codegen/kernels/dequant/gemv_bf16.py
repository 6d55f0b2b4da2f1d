"""The bf16-weight GEMV for 8 tokens on AVX-512 and AVX2: y[t, n] = sum_k x[t, k] * W[n, k], x fp32 [T, K], W bfloat16
[N, K] as stored (``dequant_linear`` dispatches a batched decode step of 5-8 requests, or a static T = 8, to it).

The TE GEMV (``gemv.fp8_gemv_cpu`` over a bf16 upcast) keeps 8 tokens x 4 rows of 16-lane accumulators: all 32 zmm
registers, so LLVM spills 10 of them every k step; its x rows are K fp32 apart (a multiple of 4 KiB: the 8 rows'
vectors of one k step share an L1 set and evict each other); and each 16 weights cost a widening shuffle. Here:

    XP[ko, h, t, l] = x[t, 32 ko + 2 l + h]     x split once a call into even / odd columns, one k step's 16
                                                 vectors contiguous (1 KiB)
    per task of NBR weight rows (32 where N allows), per k block of KB = 512 (its XP, 16 KiB, stays in L1),
    per pair of rows (2 x 8 accumulators of 16 lanes in registers, kept in P [NBR, T, 16] between k blocks),
    per 32 values of k (one 64-byte line of each row):
        wv = W as uint32 [n, 16 ko : +16]        one load: lane j holds bf16 2j (low half) and 2j + 1 (high)
        lo = wv << 16, hi = wv & 0xFFFF0000       exactly W[n, 32 ko + 2j] and W[n, 32 ko + 2j + 1] as fp32
        acc[t] += XP[ko, 0, t] * lo + XP[ko, 1, t] * hi
    and each row's next k block prefetched to L2 a block ahead (the task's 32 rows stream at once).

The pair's accumulators are their own buffers in the default scope, which TVM puts on the stack so LLVM keeps them
in registers (a "local" or a 1 KiB buffer inside a parallel loop is a TVMBackendAllocWorkspace pointer). Products
exact, fp32 sums (in another order than the reference's).

Measured (znver4, 2 threads; old and new kernels called alternately 12 times in one process, medians): 8 tokens,
129280 x 4096 (DeepSeek-V4's LM head) 76.6 -> 58.8 ms; 32768 x 4096 19.6 -> 16.0; 32768 x 1024 6.7 -> 5.6;
4096 x 4096 2.3 -> 1.9. At 4 and 2 tokens it was 1.1-1.2x slower than the TE GEMV (whose rows x tokens fit the
registers there), so it takes 8 tokens only.

On AVX2 (``lanes_for``: 8 lanes) a line is 32 bytes (16 bf16) and rows go one at a time (8 tokens x 1 row of
8-lane accumulators: 8 of the 16 ymm registers; a pair would spill). Measured (znver3, 2 threads, alternately 5
times in one process, medians, against the TE GEMV): 18432 x 7168 77.2 -> 25.0 ms, 7168 x 18432 52.4 -> 37.0 ms,
32320 x 7168 83.2 -> 45.5 ms (DeepSeek-V3.2's MLP and a quarter of its LM head; 3.4-5.6 -> 7.1-10.6 GB/s).

A symbolic T (x's rows past it read as zero, their outputs not written) serves the batched decode step, whose
request count is only known at run time (``dequant_linear.kernel`` guards T <= 8).
"""

from __future__ import annotations

import functools

from tvm import tirx

from dayzero.codegen.kernels.dequant.decode import has_feature
from dayzero.codegen.tvmscript import parsed_shallow, prefetch_l2

TOKENS = 8
KB_CHOICES = (512, 256, 128, 64, 32)  # k block: the first dividing K (its XP, 2 x 8 x KB/2 fp32, in L1)
NBR_CHOICES = (32, 16, 8, 4, 2)  # weight rows per parallel task: the first dividing N


def lanes_for(target: dict) -> int:
    """fp32 lanes of the kernel's vectors on TARGET: 16 (AVX-512), 8 (AVX2 + FMA), 0 (neither: not taken)."""
    if target.get("kind") != "llvm":
        return 0
    if has_feature(target, "avx512f"):
        return 16
    return 8 if has_feature(target, "avx2") and has_feature(target, "fma") else 0


def applies(target: dict, tokens: int, n: int, k: int, groups: int = 1) -> bool:
    """Whether this kernel takes a bf16 GEMV of TOKENS tokens (the static count, or a symbolic count's bound) over
    an [n, k] weight on TARGET (a target dict): AVX-512 or AVX2, 8 tokens, k a multiple of a whole line (64 / 32
    bytes), n even, one group."""
    v = lanes_for(target)
    return bool(v) and tokens == TOKENS and k % (2 * v) == 0 and n % 2 == 0 and groups == 1


@functools.lru_cache(maxsize=32)
@parsed_shallow
def bf16_gemv(N: int, K: int, symbolic: bool, lanes: int = 16) -> tirx.PrimFunc:
    """The kernel (module docstring); ``symbolic``: x and y have a symbolic row count Tx <= 8 (the caller guards
    it), else exactly 8 rows; ``lanes`` (``lanes_for``): 16 takes rows in pairs (2 x 8 accumulators of the 32 zmm
    registers), 8 one row at a time (8 of the 16 ymm)."""
    from tvm.script import tirx as T

    V = lanes
    RP = 2 if V == 16 else 1  # rows whose accumulators are in registers at once
    TT, KH, NKO = TOKENS, K // 2, K // (2 * V)
    KB = next(b for b in KB_CHOICES if K % b == 0 and b % (2 * V) == 0)
    NBR = next(r for r in NBR_CHOICES if N % r == 0)
    KS = KB // (2 * V)  # k steps (lines of a row: 2V bf16) in a block
    fv = f"float32x{V}"

    def prefetch(W32, row, ko):
        """Prefetch (to L2) of the row's line one k block ahead (clamped to its last line)."""
        return prefetch_l2(W32[row * KH + T.min(ko + KS, NKO - 1) * V])

    def halves(W32, row, ko):
        """fp32 x V of W[row, 2V ko + 2j] (lo) and W[row, 2V ko + 2j + 1] (hi): expressions, not bindings (a
        TVMScript assignment becomes a buffer); LLVM shares the one load."""
        wv = W32[T.Ramp(row * KH + ko * V, 1, V)]
        return (T.reinterpret(fv, T.shift_left(wv, T.Broadcast(T.uint32(16), V))),
                T.reinterpret(fv, T.bitwise_and(wv, T.Broadcast(T.uint32(0xFFFF0000), V))))

    @T.macro(hygienic=True)
    def row_sums(W32, XP, acc, row, ko):
        for t in T.unroll(TT):
            acc[t, T.Ramp(0, 1, V)] = acc[t, T.Ramp(0, 1, V)] + XP[ko, 0, t, T.Ramp(0, 1, V)] * \
                halves(W32, row, ko)[0] + XP[ko, 1, t, T.Ramp(0, 1, V)] * halves(W32, row, ko)[1]

    @T.macro(hygienic=True)
    def pair(W32, XP, P, r0, row0, kb):
        """Rows row0, row0 + 1 (P's r0, r0 + 1) over k block kb, their partial sums in registers."""
        acc0 = T.alloc_buffer((TT, V), "float32")
        acc1 = T.alloc_buffer((TT, V), "float32")
        for t in T.unroll(TT):
            for l in T.vectorized(V):
                acc0[t, l] = P[r0, t, l]
                acc1[t, l] = P[r0 + 1, t, l]
        for ki in range(KS):
            prefetch(W32, row0, kb * KS + ki)
            prefetch(W32, row0 + 1, kb * KS + ki)
            row_sums(W32, XP, acc0, row0, kb * KS + ki)
            row_sums(W32, XP, acc1, row0 + 1, kb * KS + ki)
        for t in T.unroll(TT):
            for l in T.vectorized(V):
                P[r0, t, l] = acc0[t, l]
                P[r0 + 1, t, l] = acc1[t, l]

    @T.macro(hygienic=True)
    def single(W32, XP, P, r0, row0, kb):
        """Row row0 (P's r0) over k block kb, its partial sums in registers."""
        acc0 = T.alloc_buffer((TT, V), "float32")
        for t in T.unroll(TT):
            for l in T.vectorized(V):
                acc0[t, l] = P[r0, t, l]
        for ki in range(KS):
            prefetch(W32, row0, kb * KS + ki)
            row_sums(W32, XP, acc0, row0, kb * KS + ki)
        for t in T.unroll(TT):
            for l in T.vectorized(V):
                P[r0, t, l] = acc0[t, l]

    rows = pair if RP == 2 else single

    @T.macro(hygienic=True)
    def store(Y, P, Tx, r, row):
        for t in T.unroll(TT):
            if V == 16:
                for l in T.vectorized(8):
                    P[r, t, l] = P[r, t, l] + P[r, t, l + 8]
            for l in T.vectorized(4):
                P[r, t, l] = P[r, t, l] + P[r, t, l + 4]
            if t < Tx:
                Y[t, row] = (P[r, t, 0] + P[r, t, 2]) + (P[r, t, 1] + P[r, t, 3])

    @T.macro(hygienic=True)
    def body(X, W, Y, Tx):
        W32 = T.decl_buffer((N * KH,), "uint32", data=W.data)
        XP = T.alloc_buffer((NKO, 2, TT, V), "float32")
        for ko, h, t, l in T.grid(NKO, 2, TT, V):
            XP[ko, h, t, l] = T.if_then_else(t < Tx, X[T.min(t, Tx - 1), 2 * V * ko + 2 * l + h], T.float32(0))
        for task in T.parallel(N // NBR):
            P = T.alloc_buffer((NBR, TT, V), "float32")
            for r, t in T.grid(NBR, TT):
                for l in T.vectorized(V):
                    P[r, t, l] = T.float32(0)
            for kb in range(K // KB):
                for rp in range(NBR // RP):
                    rows(W32, XP, P, rp * RP, task * NBR + rp * RP, kb)
            for r in range(NBR):
                store(Y, P, Tx, r, task * NBR + r)

    if symbolic:
        @T.prim_func
        def func(x_h: T.handle, w_h: T.handle, y_h: T.handle):
            T.func_attr({"tirx.noalias": True})
            Tx = T.int32()
            X = T.match_buffer(x_h, (Tx, K), "float32")
            W = T.match_buffer(w_h, (N, K), "bfloat16")
            Y = T.match_buffer(y_h, (Tx, N), "float32")
            body(X, W, Y, Tx)
        return _rooted(func)

    @T.prim_func
    def func_static(x_h: T.handle, w_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        X = T.match_buffer(x_h, (TT, K), "float32")
        W = T.match_buffer(w_h, (N, K), "bfloat16")
        Y = T.match_buffer(y_h, (TT, N), "float32")
        body(X, W, Y, TT)
    return _rooted(func_static)


def _rooted(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """FUNC with its body under a root block, as TE-made kernels have it (``parallel.either`` composes those)."""
    from tvm.s_tir.stmt import SBlock, SBlockRealize

    return func.with_body(SBlockRealize([], True, SBlock([], [], [], "root", func.body)))
