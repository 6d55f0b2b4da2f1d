"""``dayzero bench tuning``: what tuning buys the demo model, and what a warm compile costs.

One run, side by side:
  1. cold compile with default schedules (a fresh, empty tuning database) -> prefill time at 64 tokens;
  2. compile with ``--tune N`` into that database -> prefill time, tuning time;
  3. warm compile of the same model (every record present) -> compile time, which must include no tuning.
Prefill times are medians over interleaved runs of the two artifacts, so machine noise hits both alike.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import click
import torch


def bench_tuning(trials: int = 32, minutes: float | None = 20, repeat: int = 30) -> dict:
    from dayzero.runtime import load
    from dayzero.tools.bench import BENCH_MODEL, machine_info
    from dayzero.tools.driver import compile_model
    from dayzero.tools.make_tiny import make_tiny

    work = Path(tempfile.mkdtemp(prefix="dayzero-bench-tuning-"))
    ckpt = make_tiny(BENCH_MODEL, work / "ckpt", seed=0)
    db = str(work / "tuning")
    t0 = time.perf_counter()
    cold = compile_model(str(ckpt), work / "default", max_seq=128, tuning_dir=db)
    cold_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    tuned = compile_model(str(ckpt), work / "tuned", max_seq=128, tuning_dir=db, tune=trials, tune_minutes=minutes)
    tuned_total_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    warm = compile_model(str(ckpt), work / "warm", max_seq=128, tuning_dir=db)
    warm_s = time.perf_counter() - t0

    rt_default, rt_tuned = load(work / "default"), load(work / "tuned")
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(0))
    rt_default.prefill(ids), rt_tuned.prefill(ids)
    td, tt = [], []
    for _ in range(repeat):
        for rt, acc in ((rt_default, td), (rt_tuned, tt)):
            t0 = time.perf_counter()
            rt.prefill(ids)
            acc.append(time.perf_counter() - t0)
    routes = {}
    for name, route in tuned["routes"].items():
        routes[route] = routes.get(route, 0) + 1
    return {
        "suite": "tuning", "machine": machine_info(),
        "results": [
            {"case": "prefill_64_tuned_vs_default", "unit": "s", "dayzero": statistics.median(tt),
             "baselines": {"default_schedule": statistics.median(td)}, "bound": None, "bound_name": None,
             "trials_per_kernel": trials, "kernels_tuned": tuned["seconds"].get("tuned_kernels", 0),
             "routes": routes, "per_kernel": tuned.get("tuned", {})},
            {"case": "warm_compile", "unit": "s", "dayzero": warm_s,
             "baselines": {"cold_compile_default": cold_s}, "bound": None, "bound_name": None,
             "warm_tune_s": warm["seconds"].get("tune_s", 0.0),
             "warm_trace_s": warm["seconds"]["trace_s"], "warm_codegen_s": warm["seconds"]["codegen_s"],
             "cold_trace_s": cold["seconds"]["trace_s"], "cold_codegen_s": cold["seconds"]["codegen_s"],
             "tuning_s": tuned["seconds"].get("tune_s", 0.0), "tuned_compile_total_s": tuned_total_s},
        ],
    }


@click.command("tuning")
@click.option("--trials", default=32, show_default=True, help="MetaSchedule trials per kernel")
@click.option("--minutes", default=20.0, show_default=True, help="tuning budget")
@click.option("--json", "as_json", is_flag=True)
def tuning_command(trials, minutes, as_json):
    """Demo model prefill, default schedules vs after tuning, and the warm-compile time."""
    import json

    res = bench_tuning(trials, minutes)
    if as_json:
        click.echo(json.dumps(res, indent=1, sort_keys=True))
        return
    a, b = res["results"]
    click.echo(f"prefill 64: tuned {a['dayzero'] * 1e3:.2f} ms vs default {a['baselines']['default_schedule'] * 1e3:.2f}"
               f" ms ({a['baselines']['default_schedule'] / a['dayzero']:.2f}x), {a['kernels_tuned']} kernels tuned")
    click.echo(f"warm compile {b['dayzero']:.2f} s (tuning {b['warm_tune_s']:.2f} s) vs cold "
               f"{b['baselines']['cold_compile_default']:.2f} s")
