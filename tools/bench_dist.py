"""``dayzero bench dist``: a checkpoint's ``--ep 2`` and ``--tp 2`` artifacts on 2 gloo ranks (127.0.0.1) against
its 1-rank artifact, in one run.

Per model (make-tiny, seed 0): compile the three artifacts (same max_seq / max_batch), then time, as the median of
``repeat`` calls after a warm-up, a prefill of ``prefill`` tokens and one decode step (after a 16-token prompt)
on 1 rank (TVM on every core of the machine) and on 2 ranks (each rank's TVM on cores / 2 threads, its own process:
the same cores in total). Reported beside each 2-rank time: the 1-rank time, the seconds the 2 ranks spent inside
collectives (rank 0, median), the bytes the collective steps wrote per rank (all_reduce of the partial sums:
T x H fp32 per MoE layer under EP, per attention / dense MLP / embedding under TP; all_gather of the logits under
TP) against the routed experts' arithmetic (2 T k (H GU + I H) flops), and each rank's resident weight bytes and
KV-cache bytes against half the 1-rank artifact's (under TP the routed experts stay whole: only --ep splits them).
``bound`` is the 1-rank time / 2 (a perfect split).
The same script runs with NCCL on a GPU machine (the artifacts' target decides the backend, runtime/dist.py).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from pathlib import Path

import click

MODELS = ("qwen3_moe", "gpt_oss", "deepseek_v32", "deepseek_v4")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _measure(art: str, prefill: int, repeat: int) -> dict:
    """Median prefill / decode-step seconds of the artifact in this process, and the seconds spent in collectives
    per call (the runtime's collective steps, timed around ``run_collective``)."""
    import torch

    from dayzero.runtime import dist as rdist
    from dayzero.runtime import load
    from dayzero.tools.bench import _median_time

    spent = [0.0]
    inner = rdist.run_collective

    def timed(*a):
        t0 = time.perf_counter()
        inner(*a)
        spent[0] += time.perf_counter() - t0
    rdist.run_collective = timed
    rt = load(art)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, rt.vocab_size or 256, (1, prefill), generator=g)
    out = {}

    def decode_step():  # one token after the 16-token prompt, the same position every call
        rt.lengths[0] = 16
        rt.decode(int(ids[0, 16]), 0)
    for case, fn in (("prefill", lambda: rt.prefill(ids)), ("decode", decode_step)):
        if case == "decode":
            rt.prefill(ids[:, :16])
        spent[0] = 0.0
        out[case] = _median_time(fn, repeat)
        out[case + "_collective_s"] = spent[0] / (repeat + 1)
    return out


def _rank(rank: int, art: str, port: int, prefill: int, repeat: int, threads: int, q) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TVM_NUM_THREADS=str(threads))
    import torch

    torch.set_num_threads(threads)
    q.put((rank, _measure(art, prefill, repeat)))


def _collective_bytes(art: Path, prefill: int) -> dict:
    """Bytes the collective steps of one prefill (``prefill`` tokens) and one decode step write, per rank."""
    pj = json.loads((art / "program.json").read_text())
    out = {}
    for name, tokens in (("prefill", prefill), ("decode", 1)):
        p = pj["programs"][name]
        total = 0
        for st in p["steps"]:
            if st.get("collective", {}).get("op") in ("all_reduce", "all_gather"):
                b = p["buffers"][st["args"][-1]]
                n = 1
                for d in b["shape"]:
                    n *= d if isinstance(d, int) else tokens  # the one symbol of these buffers is the token count
                total += n * 4
        out[name] = total
    return out


def _expert_flops(report: dict, ckpt: Path, tokens: int) -> int:
    cfg = json.loads((ckpt / "config.json").read_text())
    H, k = cfg["hidden_size"], cfg.get("num_experts_per_tok", 2)
    inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    layers = report["patterns"].get("moe.grouped_experts", 0)
    return 2 * tokens * k * (H * 2 * inter + inter * H) * layers


AXES = ("ep", "tp")


def bench_dist(models=MODELS, prefill: int = 64, repeat: int = 10, work: str | None = None, axes=AXES) -> dict:
    from dayzero.tools.bench import machine_info
    from dayzero.tools.driver import compile_model
    from dayzero.tools.make_tiny import make_tiny

    root = Path(work) if work else Path(tempfile.mkdtemp(prefix="dayzero-bench-dist-"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    results = []
    for model in models:
        ckpt, one = root / model / "ckpt", root / model / "one"
        if not (ckpt / "config.json").exists():
            make_tiny(model, ckpt, seed=0)
        if not (one / "report.json").exists():
            compile_model(str(ckpt), one, max_seq=max(128, prefill + 16), max_batch=1)
        single = _measure(str(one), prefill, repeat)  # this process: every core
        rep1 = json.loads((one / "report.json").read_text())
        for axis in axes:
            two = root / model / f"{axis}2"
            if not (two / "report.json").exists():
                compile_model(str(ckpt), two, max_seq=max(128, prefill + 16), max_batch=1, **{axis: 2})
            results += _two_ranks(model, axis, ckpt, two, single, rep1, prefill, repeat, cores)
    return {"suite": "dist", "machine": dict(machine_info(), ranks=2, backend="gloo"), "results": results}


def _two_ranks(model: str, axis: str, ckpt: Path, two: Path, single: dict, rep1: dict, prefill: int, repeat: int,
               cores: int) -> list[dict]:
    """The results of artifact ``two`` (split 2-way over ``axis``) on 2 ranks against the 1-rank ``single``."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, str(two), port, prefill, repeat, max(1, cores // 2), q))
             for r in range(2)]
    for p in procs:
        p.start()
    ranks = dict(q.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join(60)
    rep2 = json.loads((two / "report.json").read_text())
    moved = _collective_bytes(two, prefill)
    results = []
    for case, tokens in (("prefill", prefill), ("decode", 1)):
        t2 = max(ranks[r][case] for r in ranks)
        results.append({
            "case": f"{model}/{case}_{tokens}_{axis}2", "unit": "s", "dayzero": t2,
            "baselines": {"one_rank": single[case]}, "bound": single[case] / 2,
            "bound_name": "one rank / 2 (a perfect split)", "model": model, "axis": axis,
            "collective_s": ranks[0][case + "_collective_s"],
            "collective_bytes": moved[case], "expert_flops": _expert_flops(rep1, ckpt, tokens),
            "speedup": single[case] / t2,
        })
    m = rep2["mesh"]
    kv = [r["programs"]["prefill"]["memory"]["zones"] for r in (rep2, rep1)]
    kv = [z.get("kv_pages", 0) + z.get("kv_cache", 0) for z in kv]
    results.append({"case": f"{model}/weight_bytes_per_rank_{axis}2", "unit": "bytes",
                    "dayzero": m["weight_bytes_per_rank"], "baselines": {"one_rank": m["weight_bytes_total"]},
                    "bound": m["weight_bytes_total"] / 2, "bound_name": "half the one-rank weights",
                    "model": model, "axis": axis, "kv_bytes_per_rank": kv[0], "kv_bytes_one_rank": kv[1],
                    "arena_bytes_per_rank": rep2["programs"]["prefill"]["memory"]["arena_bytes"],
                    "arena_bytes_one_rank": rep1["programs"]["prefill"]["memory"]["arena_bytes"]})
    return results


@click.command("dist")
@click.option("--json", "as_json", is_flag=True, help="Print the bench JSON object.")
@click.option("--model", "models", multiple=True, type=click.Choice(MODELS), help="default: all")
@click.option("--axis", "axes", multiple=True, type=click.Choice(AXES), help="mesh axis split 2-way (default: both)")
@click.option("--prefill", default=64, show_default=True, help="prefill tokens")
@click.option("--repeat", default=10, show_default=True)
@click.option("--work", type=click.Path(file_okay=False), default=None,
              help="where checkpoints and artifacts go (reused when present); default a temp dir")
def dist_command(as_json, models, axes, prefill, repeat, work):
    """--ep 2 and --tp 2 on 2 gloo ranks vs 1 rank: prefill and decode step times, collective bytes vs the experts'
    arithmetic, per-rank weight and KV bytes vs half."""
    out = bench_dist(models or MODELS, prefill, repeat, work, axes or AXES)
    from dayzero.tools.bench import baselines_text, echo_bench

    echo_bench(out, as_json, lambda r: f"{r['case']:36s} {r['dayzero']:10.4g} {r['unit']:5s} "
                                       f"({baselines_text(r)}; bound {r['bound']:.4g})")
