"""Dense ``linear`` over a low-precision weight read as stored: the kernels of
``dequant_linear_{int4,mxfp4,fp8,bf16}``.

Every kernel computes ``y[t, n] = sum_k x[t, k] * W[n, k]`` (``passes/dequant.py`` makes the nodes; a bias stays a
separate add) with W decoded from its storage as it is read, never materialised in full:

    int4    packed uint8 [R, C/2] (two 4-bit codes per byte, low nibble first along C), scales fp32 S,
            [zero points fp32 S]; storage [R, C] = [N, K] (layout nk: MatMulNBits) or [K, N] (kn: a blocked
            DequantizeLinear feeding MatMul). One scale per ``block`` values along storage axis ``block_axis``:
            S = [R/bs, C] (axis 0) or [R, C/bs] (axis 1).
                c = (packed[r, c' // 2] >> 4 (c' % 2)) & 15  [^ 8 when signed]     (r, c') = (n, k) | (k, n)
                W[n, k] = ((float(c) - offset) - zp[s(r, c')]) * scales[s(r, c')]
            in exactly the order of the ONNX chain (every step exact in fp32 but the last, so bit-exact with it).
    mxfp4   blocks uint8 [N, K/32, 16] + E8M0 scales uint8 [N, K/32]  (``codegen/kernels/dequant/``'s kernels)
    fp8     weight float8_e4m3fn [N, K] + scale_inv fp32 [ceil(N/128), ceil(K/128)]
    bf16    weight bfloat16 [N, K] (a checkpoint's bf16 projection / LM head kept as published: half the bytes of an
            fp32 copy, which is what a decode GEMV is bound by); W[n, k] = float(weight[n, k]), exact

Argument order: x fp32 [T, K], the weight's stored tensors as above, y fp32 [T, N]. A node whose T is a static
int gets the decode GEMV up to ``GEMV_MAX_T`` (64; bf16 / FP8 up to ``GEMV_MAX_T_DECODED``, 8): T unrolled,
parallel over groups of rows (``gemv.gemv_tile``), lanes of partial sums over k, each packed byte read once from
memory. Any other T gets the prefill GEMM: an [OT, K] weight tile decoded once into an L2-resident buffer and
reused for every token tile (``dequant.gemm.token_tile``: 24 on AVX2, 64 on AVX-512), one compiled kernel for
every T. When T is bounded by one vector of tokens (``t_max``: a static T, or the program's bound on a symbolic
one, e.g. a batched decode step's requests, --max-batch) the GEMM takes its few-token tile instead (one token
vector x 8-16 weight rows: 8 requests are not padded to 24/64 tokens); a T that may be larger carries both
tiles, the few-token one taken at run time up to one vector of tokens (``kernel``); a bf16 / FP8 T bounded by 8
first takes the GEMV for 1, 2, 4 or 8 tokens (the rows past T zero), whose T accumulators per row keep the weight
stream at bandwidth where the token-vector tile decodes and broadcasts every weight (18432 x 7168 bf16, znver4,
8 tokens: 16.5 against 53 ms); bf16 at 8 tokens on AVX-512 and AVX2 is ``dequant/gemv_bf16.py``'s hand-written
kernel (the TE GEMV spilled its accumulators there). The CPU schedules are ``dequant/``'s
(``gemv.fp8_gemv_cpu`` / ``gemm.gemm_cpu`` over a ``wd`` decode stage; MXFP4 takes ``gemv.mxfp4_gemv`` /
``gemm.mxfp4_gemm`` whole); CUDA goes through the same dlight rules as there (compiles for sm_90; not
hand-tuned).

In the kernel table (``codegen/kernels/table.py``): ``prim_func`` gives the unscheduled kernel carrying its
parameters, and ``schedule_rule`` rebuilds it scheduled for the real target (as ``moe.py`` does). What the int4
kernel takes is ``targets/capabilities.py``'s ``dequant_linear_int4_problem``.
"""

from __future__ import annotations

import functools
import json

import tvm
from tvm import te, tirx

from dayzero import InternalError, UserError
from dayzero.codegen.kernels.dequant import decode, gemm, gemv, gemv_bf16
from dayzero.codegen.kernels.dequant.scheduling import cuda_rules, mark_scheduled
from dayzero.codegen.parallel import either
from dayzero.passes.ir.formats import FP8_BLOCK_SIZE
from dayzero.passes.ir.reference_dequant import int4_storage
from dayzero.targets.capabilities import dequant_linear_int4_problem

OPS = ("dequant_linear_int4", "dequant_linear_mxfp4", "dequant_linear_fp8", "dequant_linear_bf16")
GEMV_MAX_T = 64
# the most static tokens the bf16 / FP8 GEMV takes: its T accumulators per row lose to the GEMM's few-token tile
# past 8 (2880 x 2880, znver4, ms: bf16 T=8 3.5 vs 4.3, T=16 6.9 vs 4.2, T=64 31.8 vs 12.4; FP8 T=8 2.2 vs 3.2,
# T=12 5.3 vs 3.5)
GEMV_MAX_T_DECODED = 8

_u8 = functools.partial(tirx.const, dtype="uint8")
_f32 = functools.partial(tirx.const, dtype="float32")




# ------------------------------------------------------------------------------------------ definitions
def _int4_wd(P, S, Z, p: dict):
    """sc[a, b] = scales (inlined by the schedules), wd[n, k] = W[n, k] (see module docstring)."""
    bs, ax, nk = p["block"], p["block_axis"], p["layout"] == "nk"
    sc = te.compute(tuple(S.shape), lambda a, b: S[a, b], name="sc")

    def at(n, k):
        r, c = (n, k) if nk else (k, n)
        code = tirx.shift_right(P[r, c // 2], tirx.Cast("uint8", (c % 2) * 4)) & _u8(15)
        if p["signed"]:
            code = code ^ _u8(8)
        v = code.astype("float32")
        if p["offset"]:
            v = v - _f32(p["offset"])
        s = (r // bs, c) if ax == 0 else (r, c // bs)
        if Z is not None:
            v = v - Z[s]
        return v * sc[s]
    return te.compute((p["N"], p["K"]), at, name="wd")


def _fp8_wd(W, S, N: int, K: int):
    """wd[n, k] = E4M3(W[n, k]) * scale_inv[n // 128, k // 128], W float8_e4m3fn read as its bytes."""
    B = FP8_BLOCK_SIZE
    sc = te.compute(tuple(S.shape), lambda a, b: S[a, b] * _f32(256.0), name="sc")
    return te.compute((N, K), lambda n, k: decode.e4m3_value_div256(tirx.reinterpret("uint8", W[n, k]))
                      * sc[n // B, k // B], name="wd")


def _bf16_wd(W, N: int, K: int):
    """wd[n, k] = float(W[n, k]) (bf16 -> fp32: the bits shifted up 16, exact; inlined by the schedules)."""
    return te.compute((N, K), lambda n, k: W[n, k].astype("float32"), name="wd")


def _weight_placeholders(p: dict):
    N, K = p["N"], p["K"]
    if p["fmt"] == "bf16":
        return [te.placeholder((N, K), "bfloat16", name="weight")]
    if p["fmt"] == "int4":
        (R, C), ss = int4_storage(p)
        ph = [te.placeholder((R, C // 2), "uint8", name="packed"), te.placeholder(ss, "float32", name="scales")]
        if p["zero_point"]:
            ph.append(te.placeholder(ss, "float32", name="zero_points"))
        return ph
    B = FP8_BLOCK_SIZE
    return [te.placeholder((N, K), "float8_e4m3fn", name="weight"),
            te.placeholder((-(-N // B), -(-K // B)), "float32", name="scale_inv")]


def kernel(p: dict, target: dict, scheduled: bool = True) -> tirx.PrimFunc:
    """The PrimFunc for params P (fmt, N, K, T = int or None, int4 geometry) on TARGET (a target dict).

    A symbolic T with no bound within one token vector (``t_max``) gets both CPU GEMM tiles in one kernel, chosen
    at run time (``parallel.either``): the few-token tile up to one vector of tokens (a short prompt, a chunk's
    tail), the 64-token tile past it (2880 x 2880 bf16, znver4: T <= 16 10.7 -> 3.9 ms; T = 17..512 unchanged).
    bf16 / FP8 with a bound of at most ``GEMV_MAX_T_DECODED`` (a batched decode step) are first dispatched to the
    GEMV for the next power of two of tokens (``_kernel``'s ``gemv_t``)."""
    func = _kernel(p, target, scheduled)
    lanes = gemm.vector_lanes(target)
    if not scheduled or p["T"] is not None or p["fmt"] == "mxfp4" or decode.is_cuda(target):
        return func
    if p.get("t_max", lanes + 1) > lanes:
        func = either(func.params[0].shape[0] > lanes, func, _kernel({**p, "t_max": lanes}, target, scheduled))
    if p["fmt"] in ("bf16", "fp8") and p.get("t_max", GEMV_MAX_T_DECODED + 1) <= GEMV_MAX_T_DECODED:
        for tg in reversed([1 << i for i in range(GEMV_MAX_T_DECODED.bit_length()) if 1 << i < 2 * p["t_max"]]):
            gemv_t = _kernel({**p, "gemv_t": tg}, target, scheduled)
            func = either(gemv_t.params[0].shape[0] <= tg, gemv_t, func)
    return func


def _kernel(p: dict, target: dict, scheduled: bool) -> tirx.PrimFunc:
    N, K, T = p["N"], p["K"], p["T"]
    if p["fmt"] == "mxfp4":
        if T is not None:  # the exact fp32 GEMV: the op's reference is exact, and no compile option chooses the
            # integer route (gemv_int8) for a graph yet
            return gemv.mxfp4_gemv(T, N, K, target=target, int8=False)
        return gemm.mxfp4_gemm(N, K, target=target)
    problem = dequant_linear_int4_problem(p) if p["fmt"] == "int4" else None
    if problem:
        raise InternalError(f"dequant_linear_int4 cannot take {p}: {problem} (the pass checks first)")
    G = p.get("groups", 1)  # grouped: output rows [g N/G, (g+1) N/G) read x's columns [g K, (g+1) K)
    gemv_t = p.get("gemv_t")  # a symbolic T of at most gemv_t tokens run by the GEMV for gemv_t (``kernel``)
    if (T is not None or gemv_t) and scheduled and p["fmt"] == "bf16" and not decode.is_cuda(target) and \
            gemv_bf16.applies(target, T if T is not None else gemv_t, N, K, G):
        return gemv_bf16.bf16_gemv(N, K, T is None, gemv_bf16.lanes_for(target)).with_attr("tirx.is_scheduled",
                                                                                           True)
    ws = _weight_placeholders(p)
    if p["fmt"] == "int4":
        wd = _int4_wd(*ws, *([None] * (3 - len(ws))), p)
    else:
        wd = _bf16_wd(*ws, N, K) if p["fmt"] == "bf16" else _fp8_wd(*ws, N, K)
    out = None
    if T is not None or gemv_t:
        Tc = T if T is not None else gemv_t  # the GEMV's tokens: x's rows, zero past a symbolic T
        Tx = T if T is not None else te.var("T")
        rows, acc = gemv.gemv_tile(p["fmt"], Tc, N, K, gemm.vector_registers(target))
        x = te.placeholder((Tx, G * K), "float32", name="x")
        kp = -(-K // (16 * acc)) * 16 * acc

        def x_at(t, k, col):
            if T is not None:
                return tirx.if_then_else(k < K, x[t, col], _f32(0.0))
            return tirx.if_then_else(tirx.all(k < K, t < Tx), x[tirx.min(t, Tx - 1), col], _f32(0.0))
        if G == 1:
            xpad = te.compute((Tc, kp), lambda t, k: x_at(t, k, tirx.min(k, K - 1)), name="xpad")
            xrow = lambda t, o, k: xpad[t, k]  # noqa: E731
        else:
            xpad = te.compute((Tc, G, kp), lambda t, g, k: x_at(t, k, g * K + tirx.min(k, K - 1)), name="xpad")
            xrow = lambda t, o, k: xpad[t, o // (N // G), k]  # noqa: E731
        k_ = te.reduce_axis((0, kp), "k")
        y = te.compute((Tc, N), lambda t, o: te.sum(xrow(t, o, k_) * wd[o, tirx.min(k_, K - 1)], axis=k_), name="y")
        if T is None:
            out = te.compute((Tx, N), lambda t, o: y[t, o], name="yout")
    else:
        Tv = te.var("T")
        tt = gemm.token_tile(target, p.get("t_max"), N)
        Tp = (Tv + (tt - 1)) // tt * tt
        x = te.placeholder((Tv, G * K), "float32", name="x")
        k_ = te.reduce_axis((0, K), "k")
        if G == 1:
            xt = te.compute((Tp // tt, K, tt), lambda b, k, i: tirx.if_then_else(
                b * tt + i < Tv, x[tirx.min(b * tt + i, Tv - 1), k], _f32(0.0)), name="xt")
            yt = te.compute((N, Tp), lambda o, t: te.sum(wd[o, k_] * xt[t // tt, k_, t % tt], axis=k_), name="yt")
        else:
            xt = te.compute((Tp // tt, G, K, tt), lambda b, g, k, i: tirx.if_then_else(
                b * tt + i < Tv, x[tirx.min(b * tt + i, Tv - 1), g * K + k], _f32(0.0)), name="xt")
            yt = te.compute((N, Tp), lambda o, t: te.sum(wd[o, k_] * xt[t // tt, o // (N // G), k_, t % tt],
                                                         axis=k_), name="yt")
        y = te.compute((Tv, N), lambda t, o: yt[o, t], name="y")
    func = te.create_prim_func([x, *ws, y if out is None else out])
    if not scheduled:
        return func
    sch = tvm.s_tir.Schedule(func)
    if decode.is_cuda(target):
        return cuda_rules(sch, target)
    if T is not None or gemv_t:
        gemv.fp8_gemv_cpu(sch, K, rows, acc)
        if out is not None:
            sch.vectorize(sch.split(sch.get_loops(sch.get_sblock("yout"))[-1], [None, 16])[-1])
    else:
        gemm.gemm_cpu(sch, N, K, "fp8", target, p.get("t_max"))
    return mark_scheduled(sch)


_CACHE: dict = {}


def build(p: dict, target: dict):
    """Compile params P for TARGET (cached); returns the callable (CPU) or the runtime module (CUDA)."""
    key = (json.dumps(p, sort_keys=True), tuple(sorted((k, str(v)) for k, v in target.items())))
    if key not in _CACHE:
        lib = tvm.compile(tvm.IRModule({"main": kernel(p, target)}), target=target)
        _CACHE[key] = lib if decode.is_cuda(target) else lib["main"]
    return _CACHE[key]


# ------------------------------------------------------------------------------------------ registration
def params(node) -> dict:
    """The kernel parameters of a dequant_linear_* node (its attrs plus T: a static int that takes the GEMV, or None:
    the GEMM, which takes any T; a static T past the GEMV's limit gives the GEMM its bound ``t_max``)."""
    t = node.inputs[0].shape[0]
    p = {k: v for k, v in node.attr.items()}
    p["fmt"] = node.op.rsplit("_", 1)[1]
    limit = GEMV_MAX_T_DECODED if p["fmt"] in ("bf16", "fp8") else GEMV_MAX_T
    p["T"] = int(t) if isinstance(t, int) and t <= limit else None
    if isinstance(t, int) and p["T"] is None:
        p["t_max"] = int(t)
    return p


def _host() -> dict:
    return {"kind": "llvm"}


def prim_func(node) -> tirx.PrimFunc:
    """The kernel table's compute: the unscheduled kernel with its parameters, so the rule rebuilds it per target."""
    p = params(node)
    return kernel(p, _host(), scheduled=False).with_attr("dayzero.dequant_linear", json.dumps(p, sort_keys=True))


def schedule_rule(k, target: tvm.target.Target, symbols: dict | None = None):
    """The kernel rebuilt for ``target``; a symbolic T bounded by ``symbols`` (name -> (lo, hi)) gives the
    bound as ``t_max``: a batched decode step (T = the requests, at most --max-batch) takes the GEMM's
    few-token tile (``gemm._gemm_tile``)."""
    attrs = k.func.attrs
    if attrs is None or "dayzero.dequant_linear" not in attrs:
        return None
    if target.kind.name == "cuda":
        tgt = {"kind": "cuda", "arch": str(target.attrs.get("arch", "sm_90"))}
    elif target.kind.name == "llvm":
        ex = target.export()
        tgt = {"kind": "llvm", **{key: (int(ex[key]) if key == "num-cores" else str(ex[key]))
                                  for key in ("mcpu", "mtriple", "num-cores") if key in ex}}
    else:
        raise UserError(f"dequant_linear kernels have no schedule for target kind {target.kind.name}")
    p = json.loads(str(attrs["dayzero.dequant_linear"]))
    t = k.node.inputs[0].shape[0] if k.node is not None else None
    if p["T"] is None and getattr(t, "is_Symbol", False) and t.name in (symbols or {}):
        p["t_max"] = int(symbols[t.name][1])
    f = kernel(p, tgt)
    return tvm.IRModule({"main": f.with_attr("global_symbol", attrs["global_symbol"])})

