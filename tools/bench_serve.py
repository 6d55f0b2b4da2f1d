"""``dayzero bench serve``: HTTP clients against ``dayzero serve`` at several concurrencies, tiny Qwen3-MoE and
tiny DeepSeek-V4.

Per model: make-tiny (seed 0), compile (``--max-batch`` request slots), start ``dayzero serve`` in a subprocess
(the server's engine thread does not share a GIL with the clients) and wait for /health. The same ``requests``
streaming completions (token-id prompts of 8 to 40 tokens, ``max_tokens`` each, greedy, ``ignore_eos``) are sent
by ``c`` client threads at once, for each c in ``concurrency``; c = 1 is the requests run one after another.
Measured at the client from the server-sent events (one token per event): output tokens/s over the whole run,
time to first token and inter-token latency p50 / p99. Baselines beside each figure: the same requests one after
another over HTTP (c = 1), and in-process ``Runtime.generate`` one after another (no HTTP, no engine).
``throughput_c8_over_c1`` is the issue's target (>= 4); ``decode_step_8_over_1`` times the engine's decode step
for 8 running requests against 1 (target <= 2): ``Runtime.decode_batch`` when the artifact has a batched decode
program, else the per-request loop the engine falls back to.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import click

MODELS = ("qwen3_moe", "deepseek_v4")
CONCURRENCY = (1, 4, 8, 16)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def _prompts(n: int, vocab: int = 256) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (8 + (k * 11) % 33,), generator=g).tolist() for k in range(n)]


def _stream(port: int, prompt: list[int], max_tokens: int) -> dict:
    """One streaming completion; arrival times of its tokens (perf_counter), from the request's start."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                                     "ignore_eos": True, "stream": True}),
              {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise click.ClickException(f"bench request failed: HTTP {r.status} {r.read()[:200]!r}")
    times = []
    while True:
        line = r.readline()
        if not line or line.strip() == b"data: [DONE]":
            break
        if line.startswith(b"data: ") and b'"token_ids"' in line:
            times.append(time.perf_counter() - t0)
    c.close()
    return {"start": t0, "times": times}


def run_load(port: int, prompts: list[list[int]], max_tokens: int, concurrency: int) -> dict:
    """Send every prompt with ``concurrency`` client threads; tokens/s, TTFT and ITL percentiles."""
    todo = list(enumerate(prompts))
    lock = threading.Lock()
    out: list[dict] = []
    errors: list[BaseException] = []

    def client():
        while True:
            with lock:
                if not todo:
                    return
                _, p = todo.pop(0)
            try:
                res = _stream(port, p, max_tokens)
            except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
                errors.append(e)
                return
            with lock:
                out.append(res)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    tokens = sum(len(r["times"]) for r in out)
    ttft = [r["times"][0] for r in out if r["times"]]
    itl = [b - a for r in out for a, b in zip(r["times"], r["times"][1:])]
    return {"tokens_per_s": tokens / wall, "tokens": tokens, "wall_s": wall, "ttft_p50": _pct(ttft, .5),
            "ttft_p99": _pct(ttft, .99), "itl_p50": _pct(itl, .5), "itl_p99": _pct(itl, .99)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, path: str) -> int:
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        c.request("GET", path)
        status = c.getresponse().status
        c.close()
        return status
    except OSError:
        return 0


def _artifact(model: str, work: Path, max_batch: int, max_seq: int) -> Path:
    from dayzero.tools.driver import compile_model
    from dayzero.tools.make_tiny import make_tiny

    art = work / f"{model}_b{max_batch}_s{max_seq}"
    if not (art / "program.json").is_file():
        ckpt = make_tiny(model, work / f"{model}_ckpt", seed=0)
        compile_model(str(ckpt), art, max_seq=max_seq, max_batch=max_batch)
    return art


def _offline_tokens_per_s(art: Path, prompts, max_tokens: int) -> float:
    from dayzero.runtime import load

    rt = load(art)
    rt.generate(prompts[0], 2)
    t0 = time.perf_counter()
    n = sum(len(rt.generate(p, max_tokens)) for p in prompts)
    return n / (time.perf_counter() - t0)


def _decode_step_ratio(art: Path, batch: int = 8, repeat: int = 25) -> dict:
    """Median time of one engine decode step for ``batch`` running requests and for 1 through the same program;
    ``lone`` is the step the engine takes for a request running alone (the decode program)."""
    from dayzero.runtime import load
    from dayzero.runtime.engine import batched_decode

    rt = load(art)
    batched = batched_decode(rt)
    slots = list(range(min(batch, rt.max_batch)))
    for k in slots:
        rt.prefill([1 + k, 2, 3, 4, 5, 6, 7, 8], slot=k)

    def step(ss):
        if batched is not None:
            batched([7] * len(ss), ss)
        else:
            for k in ss:
                rt.decode(7, slot=k)
    def lone(ss):
        rt.decode(7, slot=ss[0])
    times = {}
    for name, fn, ss in (("lone", lone, slots[:1]), ("one", step, slots[:1]), ("batch", step, slots)):
        ts = []
        for _ in range(repeat):
            for k in ss:  # every repeat at the same positions
                rt.lengths[k] = 8
            t0 = time.perf_counter()
            fn(ss)
            ts.append(time.perf_counter() - t0)
        times[name] = statistics.median(ts)
    return {**times, "batch_size": len(slots),
            "program": "decode_batch" if batched is not None else "decode per request"}


def bench_serve(models=MODELS, concurrency=CONCURRENCY, requests: int = 16, max_tokens: int = 32,
                max_batch: int = 16, max_seq: int = 128, work: str | None = None) -> dict:
    from dayzero.tools.bench import machine_info

    work = Path(work or tempfile.mkdtemp(prefix="dayzero-bench-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    for model in models:
        art = _artifact(model, work, max_batch, max_seq)
        prompts = _prompts(requests)
        port = _free_port()
        env = dict(os.environ)
        proc = subprocess.Popen([sys.executable, "-m", "dayzero.tools.cli", "serve", str(art), "--port", str(port),
                                 "--max-queue", str(max(64, requests))], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 600
            while _get(port, "/health") != 200:
                if proc.poll() is not None:
                    raise click.ClickException(f"dayzero serve {art} exited: {proc.stderr.read()[-500:]}")
                if time.monotonic() > deadline:
                    raise click.ClickException(f"dayzero serve {art} did not become ready in 600 s")
                time.sleep(0.2)
            run_load(port, prompts[:2], 4, 1)  # warm-up
            runs = {c: run_load(port, prompts, max_tokens, c) for c in sorted(set((1,) + tuple(concurrency)))}
        finally:
            proc.terminate()
            proc.wait(60)
        offline = _offline_tokens_per_s(art, prompts, max_tokens)
        seq = runs[1]
        for c in concurrency:
            r = runs[c]
            common = {"model": model, "concurrency": c, "requests": requests, "max_tokens": max_tokens,
                      "bound": None, "bound_name": None}
            results.append({"case": f"{model}/c{c}/output_tokens_per_s", "unit": "tok/s", "dayzero": r["tokens_per_s"],
                            "baselines": {"sequential_http": seq["tokens_per_s"], "offline_generate": offline},
                            **common})
            for key in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99"):
                results.append({"case": f"{model}/c{c}/{key}", "unit": "s", "dayzero": r[key],
                                "baselines": {"sequential_http": seq[key]}, **common})
        if 8 in runs:
            results.append({"case": f"{model}/throughput_c8_over_c1", "unit": "x",
                            "dayzero": runs[8]["tokens_per_s"] / seq["tokens_per_s"], "baselines": {},
                            "target": 4.0, "bound": None, "bound_name": None, "model": model})
        d = _decode_step_ratio(art)
        results.append({"case": f"{model}/decode_step_{d['batch_size']}_over_1", "unit": "x",
                        "dayzero": d["batch"] / d["one"], "baselines": {}, "target": 2.0, "bound": None,
                        "bound_name": None, "model": model, "step_1_s": d["one"], "step_batch_s": d["batch"],
                        "program": d["program"], "lone_decode_s": d["lone"],
                        "batch_over_lone_decode": d["batch"] / d["lone"]})
    return {"suite": "serve", "machine": machine_info(), "results": results}


@click.command("serve")
@click.option("--json", "as_json", is_flag=True, help="Print the bench JSON object.")
@click.option("--model", "models", multiple=True, type=click.Choice(MODELS), help="default: both")
@click.option("--concurrency", default="1,4,8,16", show_default=True, help="comma-separated client counts")
@click.option("--requests", default=16, show_default=True, help="requests per concurrency level")
@click.option("--max-tokens", default=32, show_default=True, help="tokens generated per request")
@click.option("--max-batch", default=16, show_default=True, help="request slots of the compiled artifacts")
@click.option("--work", type=click.Path(file_okay=False), default=None,
              help="where checkpoints and artifacts go (reused when present); default a temp dir")
def serve_command(as_json, models, concurrency, requests, max_tokens, max_batch, work):
    """HTTP clients at several concurrencies against `dayzero serve` (tiny Qwen3-MoE, tiny DeepSeek-V4): output
    tokens/s, TTFT and inter-token latency p50/p99, beside the same requests run one after another."""
    from dayzero import UserError

    try:
        levels = tuple(int(x) for x in concurrency.split(",") if x.strip())
    except ValueError:
        raise UserError(f"--concurrency must be comma-separated integers, got {concurrency!r}") from None
    if not levels or min(levels) < 1 or requests < 1 or max_tokens < 1:
        raise UserError("--concurrency levels, --requests and --max-tokens must be at least 1")
    out = bench_serve(models or MODELS, levels, requests, max_tokens, max_batch, work=work)
    from dayzero.tools.bench import baselines_text, echo_bench

    def line(r):
        base = baselines_text(r)
        return (f"{r['case']:40s} {r['dayzero']:10.4g} {r['unit']:5s} {('(' + base + ')') if base else ''}"
                + (f" target {r['target']:g}" if "target" in r else ""))
    echo_bench(out, as_json, line)
