"""`dayzero bench dequant`: MXFP4 dequant-GEMV / GEMM vs torch eager and vs this machine's read bandwidth.

run_bench(quick) -> {"suite": "dequant", "machine": {...}, "results": [...]} (DESIGN.md's bench JSON).

Cases (out x in, real expert shapes: gpt-oss 2880x2880, DeepSeek-V3 2048x7168 both ways):
- decode_gemv_mxfp4_<O>x<K>_n<T>: dayzero = seconds per call reading weights that are NOT in cache (a rotation
  over a pool of distinct expert slabs larger than the last-level cache share we can hope for, like MoE decode
  where each layer reads other experts), on the route ``mxfp4_gemv`` chooses (``route``: int8 = x quantised per
  block + integer dot products, ``gemv_int8.py``; fp32 = exact decode); bound = weight bytes / streaming read
  bandwidth measured in this run; baselines.torch_eager = dequantise (LUT + ldexp, transformers' way) then
  matmul, same rotation; baselines.dayzero_fp32_route = the exact fp32 kernel, same rotation (``routes`` gives
  both routes' GB/s, one-core GB/s and max |y - x W^T| / max |x W^T| against the fp32 reference).
- prefill_gemm_mxfp4_<O>x<K>_T<T>: dayzero = dequant-GEMM from MXFP4; baselines.torch_matmul = x @ W.T on
  pre-dequantised fp32 weights (the bar: dayzero <= 2x of it); bound = flops / nothing measured -> null.
- decode_moe_fp8_* / prefill_moe_fp8_*: FP8-block routed experts through the fused moe kernel
  (``tools/bench_fp8_experts.py``).
"""

from __future__ import annotations

import os
import platform
import time

import click

GEMV_SHAPES = [(2880, 2880), (2048, 7168), (7168, 2048)]
GEMM_SHAPES = [(2880, 2880)]
GEMM_TOKENS = [128, 512, 1024]
BATCH_SHAPES = [(18432, 7168), (7168, 18432)]  # DeepSeek-V3.2's dense MLP up / down projections, bf16
BATCH_TOKENS = (1, 4, 8)


def best_time(fn, repeats: int, inner: int = 1) -> float:
    """Best wall-clock seconds per call of fn() over ``repeats`` timings of ``inner`` calls each (the timer of the
    bench suites: dequant, fp8 experts, moe). The best, not the mean: on a host shared with other jobs the
    noise only ever adds time."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t) / inner)
    return best


def best_torch_time(fn, repeats: int, timer=None) -> tuple[float, int]:
    """(seconds, threads): ``timer`` (default ``best_time``) of fn with torch on all its threads and on one, the
    better of the two. On a host shared with other jobs a core taken by another job stalls torch's OpenMP barriers
    (bench moe measured eager at 50 ms quiet, 2-3 s with one core busy), so a torch baseline gets its better
    setting and reports the thread count it used."""
    import torch

    n_all = torch.get_num_threads()
    times = {}
    for n in sorted({n_all, 1}, reverse=True):
        torch.set_num_threads(n)
        try:
            times[n] = (timer or best_time)(fn, repeats)
        finally:
            torch.set_num_threads(n_all)
    n = min(times, key=times.get)
    return times[n], n


def _best_cpu(fn, repeats: int) -> float:
    """Best CPU seconds of the calling thread for fn(): time another job takes from this core is not counted
    (run it with the work on this thread: TVM's pool at 1 thread, torch at 1 thread)."""
    best = float("inf")
    for _ in range(repeats):
        t = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t)
    return best


def _best_of_threads(fn, repeats: int, set_threads, counts) -> tuple[float, int]:
    """(best seconds, thread count) over running fn with each thread count. On a machine shared with other jobs a
    spinning barrier over all cores stalls whenever one core is taken (torch's OpenMP and TVM's pool alike), so
    each side gets its better setting; the pool is left at the last count."""
    best, who = float("inf"), counts[-1]
    for n in counts:
        set_threads(n)
        t = best_time(fn, repeats)
        if t < best:
            best, who = t, n
    return best, who


def read_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Streaming read bandwidth in bytes/s: best of `repeats` torch sums over an nbytes fp32 array, on all of
    torch's threads or one, the better (``best_torch_time``: a core taken by another job stalls the threaded sum)."""
    import torch

    a = torch.ones(nbytes // 4, dtype=torch.float32)
    a.sum()
    return nbytes / best_torch_time(lambda: a.sum(), repeats)[0]


def _torch_dequant_mxfp4(blocks, scales):
    """transformers' way (mxfp4.convert_moe_packed_tensors): LUT on each nibble, then ldexp by the E8M0 scale."""
    import torch

    from ..frontend.lowprec import FP4_E2M1_VALUES

    lut = torch.from_numpy(FP4_E2M1_VALUES)
    o, g, _ = blocks.shape
    w = torch.empty(o, g, 32)
    w[..., 0::2] = lut[(blocks & 0x0F).long()]
    w[..., 1::2] = lut[(blocks >> 4).long()]
    w = torch.ldexp(w, scales.to(torch.int32)[..., None] - 127)
    return w.reshape(o, g * 32)


def real_like_error(O: int, K: int, tgt: dict, gen) -> dict:
    """Errors of the MXFP4 GEMV routes at one token on trained-like weights (fan-in scaled normals quantised as
    published) and activations (normal, a few channels x20 as hidden states have): max |y - ref| / max |ref| with
    ref = transformers' own dequant (``convert_moe_packed_tensors``, fp32) then matmul in float64; and, for
    scale, upstream's bf16 path (bf16 dequant, bf16 matmul) against the same reference."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from ..codegen.kernels import dequant as dq
    from ..frontend import lowprec

    w = (torch.randn(O, K, generator=gen) / K ** 0.5).numpy()
    b, s = lowprec.quantize_mxfp4(w)
    blocks, scales = torch.from_numpy(b).clone(), torch.from_numpy(s).clone()  # torch allocations: 64-byte aligned
    x = torch.randn(1, K, generator=gen)
    x[0, torch.randperm(K, generator=gen)[:8]] *= 20.0
    Wt = convert_moe_packed_tensors(blocks[None], scales[None], dtype=torch.float32)[0]  # [K, O], upstream's
    ref = (x.double() @ Wt.double())[0]
    out = {}
    for route, int8 in (("int8", True), ("fp32", False)):
        y = torch.empty(1, O)
        dq.build("mxfp4_gemv", 1, O, K, target=tgt, int8=int8)(x, blocks, scales, y)
        out[f"{route}_vs_upstream_dequant_matmul"] = float((y[0].double() - ref).abs().max() / ref.abs().max())
    Wb = convert_moe_packed_tensors(blocks[None], scales[None], dtype=torch.bfloat16)[0]
    yb = (x.bfloat16() @ Wb)[0].double()
    out["upstream_bf16_vs_upstream_dequant_matmul"] = float((yb - ref).abs().max() / ref.abs().max())
    return out


def _machine(bw: float, tvm_threads: int) -> dict:
    from ..codegen.kernels import dequant as dq
    from ..targets.host import host_target_dict

    tgt = host_target_dict()
    return {
        "cpu": platform.processor() or platform.machine(),
        "target": tgt,
        "mxfp4_lookup": dq.lookup_mode(tgt),
        "cores": os.cpu_count(),
        "tvm_threads": tvm_threads,
        "read_bandwidth_GBps": round(bw / 1e9, 2),
        "loadavg": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def run_bench(quick: bool = False) -> dict:
    import torch
    import tvm

    from ..codegen.kernels import dequant as dq
    from ..codegen.kernels.dequant.gemv_int8 import int8_mode
    from ..frontend import lowprec
    from ..runtime.executor import use_all_cores
    from ..targets.host import host_target_dict

    # TVM's pool defaults to half the CPUs on x86: size it as the runtime does, before the first kernel call
    tvm_threads = use_all_cores()
    tgt = host_target_dict()
    pool_bytes = (256 if quick else 1024) << 20
    bw = read_bandwidth(pool_bytes)
    config_pool = tvm.get_global_func("runtime.config_threadpool")
    n_torch = torch.get_num_threads()

    def tvm_threads_(n):
        config_pool(0, n)

    def one_core_tvm(fn, repeats):
        config_pool(0, 1)
        try:
            return _best_cpu(fn, repeats)
        finally:
            config_pool(0, tvm_threads)

    def one_core_torch(fn, repeats):
        torch.set_num_threads(1)
        try:
            return _best_cpu(fn, repeats)
        finally:
            torch.set_num_threads(n_torch)
    results = []
    gen = torch.Generator().manual_seed(0)
    for O, K in GEMV_SHAPES[:1] if quick else GEMV_SHAPES:
        G = K // 32
        wbytes = O * G * 17
        P = max(2, pool_bytes // wbytes)
        blocks = torch.randint(0, 256, (P, O, G, 16), dtype=torch.uint8, generator=gen)
        scales = torch.randint(118, 130, (P, O, G), dtype=torch.uint8, generator=gen)
        W0 = torch.from_numpy(lowprec.dequant_mxfp4(blocks[0].numpy(), scales[0].numpy()))
        first = len(results)  # this shape's first (one-token) case
        for T in (1,) if quick else (1, 4):
            x = torch.randn(T, K, generator=gen)
            y = torch.empty(T, O)
            ref = x @ W0.T  # fp32 reference of expert slab 0
            routes = {}  # route -> (cold s/call, threads, one-core CPU s, max |y - ref| / max |ref|)
            for route, int8 in (("int8", True), ("fp32", False)):
                if int8 and int8_mode(tgt) is None:
                    continue
                f = dq.build("mxfp4_gemv", T, O, K, num_experts=P, target=tgt, int8=int8)
                f(x, blocks, scales, 0, y)
                err = float((y - ref).abs().max() / ref.abs().max())

                def sweep(f=f):
                    for e in range(P):
                        f(x, blocks, scales, e, y)

                t, n = _best_of_threads(sweep, 3, tvm_threads_, (1, tvm_threads))
                routes[route] = (t / P, n, one_core_tvm(sweep, 2) / P, err)
            chosen = "int8" if dq.int8_route(tgt, T) else "fp32"
            t_dz, dz_threads, cpu_dz, err = routes[chosen]
            f = dq.build("mxfp4_gemv", T, O, K, num_experts=P, target=tgt)
            ne = min(P, 8 if quick else 16)

            def eager():
                for e in range(ne):
                    x @ _torch_dequant_mxfp4(blocks[e], scales[e]).T

            t_eager, eager_threads = _best_of_threads(eager, 2, torch.set_num_threads, (1, n_torch))
            t_eager /= ne
            hot = best_time(lambda: f(x, blocks, scales, 0, y), 5, 20)
            bound = wbytes / bw
            baselines = {"torch_eager": t_eager}
            if "fp32" in routes and chosen != "fp32":
                baselines["dayzero_fp32_route"] = routes["fp32"][0]
            results.append({
                "case": f"decode_gemv_mxfp4_{O}x{K}_n{T}", "unit": "s", "dayzero": t_dz,
                "baselines": baselines, "bound": bound, "bound_name": "weight_bytes/read_bandwidth",
                "route": chosen, "weight_bytes": wbytes, "achieved_GBps": wbytes / t_dz / 1e9,
                "fraction_of_bandwidth": bound / t_dz, "speedup_vs_torch_eager": t_eager / t_dz,
                "max_rel_err_vs_fp32": err, "dayzero_cache_hot": hot, "tvm_threads": dz_threads,
                "baseline_threads": eager_threads,
                # load-independent: CPU seconds of the same cold sweep on one core (TVM pool at 1 thread)
                "dayzero_one_core_cpu_s": cpu_dz, "one_core_GBps": wbytes / cpu_dz / 1e9,
                "routes": {r: {"s": v[0], "GBps": wbytes / v[0] / 1e9, "fraction_of_bandwidth": bound / v[0],
                               "one_core_GBps": wbytes / v[2] / 1e9, "max_rel_err_vs_fp32": v[3]}
                           for r, v in routes.items()},
            })
        del blocks, scales
        if int8_mode(tgt) is not None:
            results[first]["real_like_error"] = real_like_error(O, K, tgt, gen)
    for O, K in GEMM_SHAPES:
        G = K // 32
        blocks = torch.randint(0, 256, (O, G, 16), dtype=torch.uint8, generator=gen)
        scales = torch.randint(118, 130, (O, G), dtype=torch.uint8, generator=gen)
        W = _torch_dequant_mxfp4(blocks, scales).contiguous()
        f = dq.build("mxfp4_gemm", O, K, target=tgt)
        for T in GEMM_TOKENS[:1] if quick else GEMM_TOKENS:
            x = torch.randn(T, K, generator=gen)
            y = torch.empty(T, O)
            f(x, blocks, scales, y)
            err = float((y - x @ W.T).abs().max() / (x @ W.T).abs().max())
            r = 2 if T >= 512 else 3
            t_dz, dz_threads = _best_of_threads(lambda: f(x, blocks, scales, y), r, tvm_threads_,
                                                (1, tvm_threads))
            t_mm, mm_threads = _best_of_threads(lambda: torch.matmul(x, W.T), r, torch.set_num_threads,
                                                (1, n_torch))
            cpu_dz = one_core_tvm(lambda: f(x, blocks, scales, y), r)
            cpu_mm = one_core_torch(lambda: torch.matmul(x, W.T), r)
            results.append({
                "case": f"prefill_gemm_mxfp4_{O}x{K}_T{T}", "unit": "s", "dayzero": t_dz,
                "baselines": {"torch_matmul_predequantised": t_mm}, "bound": None, "bound_name": None,
                "gflops": 2 * T * O * K / t_dz / 1e9, "ratio_vs_torch_matmul": t_mm / t_dz, "max_rel_err": err,
                "tvm_threads": dz_threads, "baseline_threads": mm_threads,
                # load-independent, side by side: both on one core, CPU seconds of the calling thread
                "dayzero_one_core_cpu_s": cpu_dz, "torch_one_core_cpu_s": cpu_mm,
                "one_core_ratio_vs_torch_matmul": cpu_mm / cpu_dz,
            })
    from .bench_fp8_experts import fp8_expert_cases  # FP8-block experts (moe_experts_fp8), same bandwidth

    results += bf16_batch_cases(bw, quick, tgt, gen)
    results += fp8_expert_cases(bw, quick)
    return {"suite": "dequant", "machine": _machine(bw, tvm_threads), "results": results}


def bf16_batch_cases(bw: float, quick: bool, tgt: dict, gen) -> list[dict]:
    """decode_batch_bf16_<O>x<K>_n<T>: a bf16 projection in a batched decode step (T the requests, symbolic, at
    most --max-batch 8) on today's route (the GEMV for the next power of two of tokens), side by side with the
    few-token GEMM that route replaced (``baselines.few_token_gemm``) and torch eager's bf16 linear (x cast to
    bf16, as the upstream model runs in bf16); bound = weight bytes / read bandwidth (the weight, 264 MB, is read
    from memory every call)."""
    import torch
    import tvm

    from ..codegen.kernels import dequant_linear as kl

    out = []
    for O, K in BATCH_SHAPES[:1] if quick else BATCH_SHAPES:
        w = torch.randn(O, K, generator=gen).bfloat16()
        p = dict(fmt="bf16", N=O, K=K, T=None, t_max=8)
        now = kl.build(p, tgt)
        before = tvm.compile(tvm.IRModule({"main": kl._kernel(p, tgt, True)}), target=tgt)["main"]
        for T in BATCH_TOKENS[1:] if quick else BATCH_TOKENS:
            x = torch.randn(T, K, generator=gen)
            y = torch.empty(T, O)
            ref = x.double() @ w.double().T
            now(x, w, y)
            err = float((y.double() - ref).abs().max() / ref.abs().max())
            t_dz = best_time(lambda: now(x, w, y), 5)
            t_few = best_time(lambda: before(x, w, y), 3)
            t_torch, threads = best_torch_time(lambda: torch.nn.functional.linear(x.bfloat16(), w), 3)
            bound = O * K * 2 / bw
            out.append({
                "case": f"decode_batch_bf16_{O}x{K}_n{T}", "unit": "s", "dayzero": t_dz,
                "baselines": {"few_token_gemm": t_few, "torch_eager_bf16": t_torch}, "bound": bound,
                "bound_name": "weight_bytes/read_bandwidth", "weight_bytes": O * K * 2,
                "achieved_GBps": O * K * 2 / t_dz / 1e9, "fraction_of_bandwidth": bound / t_dz,
                "speedup_vs_torch_eager": t_torch / t_dz, "speedup_vs_few_token_gemm": t_few / t_dz,
                "max_rel_err_vs_fp64": err, "baseline_threads": threads,
            })
    return out


@click.command("dequant")
@click.option("--json", "as_json", is_flag=True, help="Print the bench JSON object.")
@click.option("--quick", is_flag=True, help="Fewer shapes and a smaller weight pool.")
def dequant_command(as_json: bool, quick: bool):
    """MXFP4 dequant-GEMV (decode) and dequant-GEMM (prefill) vs torch and the machine's read bandwidth."""
    out = run_bench(quick=quick)
    from dayzero.tools.bench import baselines_text, echo_bench

    def line(r):
        extra = (f"{r['achieved_GBps']:.1f} GB/s = {r['fraction_of_bandwidth']:.0%} of bw, "
                 f"{r['speedup_vs_torch_eager']:.1f}x eager" if "achieved_GBps" in r
                 else f"{r['gflops']:.0f} GFLOP/s, {r['ratio_vs_torch_matmul']:.2f}x torch")
        return f"{r['case']:40s} {r['dayzero'] * 1e3:8.3f} ms  ({baselines_text(r, 1e3, '.3f', 'ms')})  {extra}"
    m = out["machine"]
    echo_bench(out, as_json, line, f"read bandwidth {m['read_bandwidth_GBps']} GB/s, target {m['target']}")


if __name__ == "__main__":
    dequant_command()
