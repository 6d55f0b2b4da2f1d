"""`dayzero bench moe`: the routed-expert kernel vs transformers' expert implementations on the same weights.

run_bench(quick) -> {"suite": "moe", "machine": {...}, "results": [...]} (DESIGN.md's bench JSON).

One transformers Qwen3-MoE sparse block (64 experts, top-4, hidden 1024, expert width 512, fp32, random
weights) routes random hidden states once; then the experts alone run on the same (hidden, top-k ids, top-k
weights), switching ``config._experts_implementation`` between ``eager`` (the per-expert Python loop),
``grouped_mm`` and ``batched_mm``, against dayzero's ``moe_experts`` kernel (``codegen/kernels/moe.py``) compiled
for this host. Cases:
- prefill_T256: seconds per call; bound null (compute bound; ``gflops`` reported). batched_mm is skipped here: it
  would gather a (1024, 1024, 1024)+(1024, 1024, 512) fp32 copy of the weights (6 GiB).
- decode_T1 / decode_T8: seconds per call, each call with a fresh routing over the 64-expert pool (384 MiB, larger
  than the caches), so the routed experts come from memory. bound = routed experts' bytes / read bandwidth
  measured in this run; ``bytes_read`` = what the kernel reads per step (each routed expert's matrices once, by
  its loop structure, plus activations), ``routed_expert_bytes`` = distinct routed experts x bytes per expert.
TVM's thread pool is set to the target's core count (``tvm_threads`` in the machine info), as torch uses every core;
each torch baseline is the better of torch on all its threads and on one (``baseline_threads``), see best_torch.
"""

from __future__ import annotations

import json
import time

import click

E, K_TOP, H, I = 64, 4, 1024, 512


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _block():
    import torch
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K_TOP,
                         norm_topk_prob=True)
    torch.manual_seed(0)
    blk = Qwen3MoeSparseMoeBlock(cfg).eval()
    with torch.no_grad():
        blk.experts.gate_up_proj.normal_(0, 0.02)
        blk.experts.down_proj.normal_(0, 0.02)
        blk.gate.weight.normal_(0, 0.02)
    return cfg, blk


def _kernel(target: dict):
    import tvm

    from dayzero.codegen.kernels.moe import moe_experts_func

    act = ("mul", ("silu", ("col", 0, 1, I)), ("col", I, 1, I))
    f = moe_experts_func(E, H, 2 * I, I, K_TOP, layout="nk", act=act, gate_up_bias=False, down_bias=False)
    return tvm.compile(tvm.IRModule({"main": f}), target=target)["main"]


def _tvm_threads(target: dict) -> int:
    """Run TVM's thread pool on every core of the target. Its default (no TVM_NUM_THREADS) halves
    hardware_concurrency on x86 to skip hyper-threads, so on this 2-vCPU host (1 thread per core) the kernel ran on
    ONE thread while torch used two. Must run before the first parallel kernel call creates the pool."""
    import os

    import tvm

    os.environ.setdefault("TVM_NUM_THREADS", str(int(target.get("num-cores", os.cpu_count() or 1))))
    return int(tvm.get_global_func("runtime.NumThreads")())


def run_bench(quick: bool = False) -> dict:
    import torch

    from dayzero.targets.host import host_target_dict
    from dayzero.tools.bench import machine_info
    from dayzero.tools.bench_dequant import read_bandwidth

    target = host_target_dict()
    tvm_threads = _tvm_threads(target)
    cfg, blk = _block()
    kern = _kernel(target)
    ex = blk.experts
    expert_bytes = (ex.gate_up_proj[0].numel() + ex.down_proj[0].numel()) * 4
    bw = read_bandwidth(256 << 20)
    gen = torch.Generator().manual_seed(1)
    results = []

    def route(x):
        with torch.no_grad():
            _, w, ids = blk.gate(x)
        return ids, w

    def upstream(impl, x, ids, w):
        cfg._experts_implementation = impl
        with torch.no_grad():
            return ex(x, ids, w)

    n_torch = torch.get_num_threads()
    picked = {}

    def best_torch(name, fn, repeats):
        """Best of torch on all its threads and on one: on a shared host a core taken by another job stalls
        torch's OpenMP barriers (eager measured 50 ms quiet, 2-3 s with one core busy), so the baseline gets its
        better setting; the thread count used is reported (``baseline_threads``)."""
        times = {}
        for n in sorted({n_torch, 1}, reverse=True):
            torch.set_num_threads(n)
            try:
                times[n] = _best(fn, repeats)
            finally:
                torch.set_num_threads(n_torch)
        n = min(times, key=times.get)
        picked[name] = n
        return times[n]

    # prefill
    T = 64 if quick else 256
    x = torch.randn(T, H, generator=gen)
    ids, w = route(x)
    y = torch.empty(T, H)
    kern(x, ids, w, ex.gate_up_proj.data, ex.down_proj.data, y)
    ref = upstream("eager", x, ids, w)
    err = float((y - ref).abs().max() / ref.abs().max())
    r = 2 if quick else 3
    t_dz = _best(lambda: kern(x, ids, w, ex.gate_up_proj.data, ex.down_proj.data, y), r)
    base = {f"transformers_{impl}": best_torch(f"transformers_{impl}", lambda impl=impl: upstream(impl, x, ids, w), r)
            for impl in ("eager", "grouped_mm")}
    flops = 2 * T * K_TOP * 3 * H * I
    results.append({"case": f"prefill_T{T}", "unit": "s", "dayzero": t_dz, "baselines": base,
                    "baseline_threads": dict(picked), "bound": None,
                    "bound_name": None, "gflops": flops / t_dz / 1e9, "max_rel_err": err,
                    "speedup_vs_eager": base["transformers_eager"] / t_dz,
                    "note": "batched_mm skipped at prefill: it materialises T*k per-token weight copies (6 GiB)"})
    # decode: a fresh routing each call over the whole pool
    for T in (1, 8):
        n_calls = 4 if quick else 8
        xs = [torch.randn(T, H, generator=gen) for _ in range(n_calls)]
        routes = [route(xx) for xx in xs]
        y = torch.empty(T, H)
        uniq = [int(torch.unique(ids).numel()) for ids, _ in routes]

        def run_dz():
            for xx, (ids, w) in zip(xs, routes):
                kern(xx, ids, w, ex.gate_up_proj.data, ex.down_proj.data, y)

        def run_up(impl):
            for xx, (ids, w) in zip(xs, routes):
                upstream(impl, xx, ids, w)
        kern(xs[0], *routes[0], ex.gate_up_proj.data, ex.down_proj.data, y)
        errs = float((y - upstream("eager", xs[0], *routes[0])).abs().max())
        t_dz = _best(run_dz, r) / n_calls
        base = {f"transformers_{impl}": best_torch(f"transformers_{impl}", lambda impl=impl: run_up(impl), r) / n_calls
                for impl in ("eager", "grouped_mm", "batched_mm")}
        routed = sum(uniq) / n_calls * expert_bytes
        act_bytes = T * K_TOP * (H + 2 * I + I + H) * 4 * 2 + T * H * 4  # x, G, A, D written+read, y
        read = routed + act_bytes
        results.append({"case": f"decode_T{T}", "unit": "s", "dayzero": t_dz, "baselines": base,
                        "baseline_threads": {k: picked[k] for k in base},
                        "bound": routed / bw, "bound_name": "routed expert bytes / measured read bandwidth",
                        "bytes_read": read, "routed_expert_bytes": routed, "bytes_ratio": read / routed,
                        "achieved_GBps": routed / t_dz / 1e9, "ratio_to_bound": t_dz / (routed / bw),
                        "max_abs_err": errs, "speedup_vs_eager": base["transformers_eager"] / t_dz})
    m = machine_info()
    m.update({"read_bandwidth_GBps": bw / 1e9, "target": target, "tvm_threads": tvm_threads})
    return {"suite": "moe", "machine": m, "results": results}


@click.command("moe")
@click.option("--json", "as_json", is_flag=True, help="Print the bench JSON object.")
@click.option("--quick", is_flag=True, help="Prefill at 64 tokens, fewer repeats.")
def moe_command(as_json: bool, quick: bool):
    """Routed experts (64 experts, top-4, 1024 x 512): dayzero vs transformers eager / grouped_mm / batched_mm."""
    out = run_bench(quick=quick)
    if as_json:
        click.echo(json.dumps(out, indent=1))
        return
    click.echo(f"read bandwidth {out['machine']['read_bandwidth_GBps']:.1f} GB/s, "
               f"torch threads {out['machine']['threads']}, tvm threads {out['machine']['tvm_threads']}")
    for r in out["results"]:
        base = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in r["baselines"].items())
        extra = f"{r['speedup_vs_eager']:.1f}x eager"
        if r["bound"] is not None:
            extra += f", {r['ratio_to_bound']:.2f}x bound, bytes {r['bytes_ratio']:.3f}x routed"
        click.echo(f"{r['case']:14s} {r['dayzero'] * 1e3:8.2f} ms  ({base})  {extra}")


if __name__ == "__main__":
    moe_command()
