"""``dayzero bench long``: long contexts on tiny DeepSeek-V4 and tiny DeepSeek-V3.2, compiled with ``--max-seq 1M``.

Per model: make-tiny (seed 0; ``--full-width-layers N``: make-full, the published width's first N layers, in the
directory ``bench full`` uses, so the two share a checkpoint), compile once with ``--max-seq`` (default 1M = 10^6
tokens, ``tools/capacity.py``'s count rule) and ``--prefill-chunk`` (default 32), then for each context C (default
4k, 64k, 256k, 1M):

* prefill: a random prompt of C - 1 tokens through ``Runtime.prefill`` (chunk by chunk); tokens/s. A context whose
  prefill would outlast ``--prefill-budget`` seconds is prefilled for that long only, then its remaining chunks are
  skipped: the request's length is set to C - 1 so that decode runs at position C - 1 over a cache whose rows past the
  prefilled ones are zero (a decode step's cost depends on the position, not on the values); the result says so
  (``prefilled_tokens`` < ``context`` - 1) and the prefill rate is the measured one.
* prefill at the end: the seconds of the prompt's last chunk, at positions [C - 1 - n, C - 1) (after a skipped
  tail: prefilled there over the zero rows, the same way). A chunk's cost grows with its position (the indexer and
  HCA read every visible key), so the whole prompt's prefill lies between C / n chunks at the first rate and at
  this one (about their mean for a cost linear in the position). ``cpu_s``: the chunk's CPU seconds (this
  process, all threads), which a loaded shared machine does not inflate as it does the wall clock.
* decode: ``--steps`` steps at position C - 1, the C-th token (after one warm-up), each timed kernel by kernel through the runtime's
  per-step hook (``Program.run(observe=...)``), classified by the step's op: ``indexer`` (``dsa_indexer_topk``: the
  lightning indexer's scan over its keys, V3.2's per position and V4's CSA over its compressed entries), ``attention``
  (the attention kernels: ``compressed_attention``, ``cache_attention``, ``sparse_attention``, ``mla_*``) and
  ``rest`` (everything else: projections, MoE, norms, mHC, V4's compressors including the indexer's own).
* KV: the request's resident cache bytes read off the compiled states (``dayzero report``'s kv_cache section:
  bytes per token x C + the per-sequence constant) beside ``tools/capacity.py``'s ``kv_bytes_per_sequence`` for
  the config at C (fp32 values and indexer keys, as the tiny artifacts store them); the ratio (target: within 1%).

* batched decode (``--batch B`` > 1, the artifacts compiled with ``--max-batch B``): one ``decode_batch`` step of
  B requests, each at position C - 1 (the other slots prefilled one chunk, then continued at C - 1 like a skipped
  tail), against B one-request decode steps (``decode_step`` x B): what serving B requests at once costs over
  stepping them one by one, so a per-request cost that grows with ``--max-seq`` instead of C shows up here.

``attention_vs_4k``: decode attention time at each C over its time at the smallest context (target at 1M: <= 1.5).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import click

MODELS = ("deepseek_v4", "deepseek_v32")
CONTEXTS = ("4k", "64k", "256k", "1M")
INDEXER_OP = "dsa_indexer_topk"
ATTENTION_OPS = ("compressed_attention", "cache_attention", "sparse_attention", "mla_sparse_attention",
                 "mla_attention")


def _kind(node: str) -> str:
    """A program step (its node: "<op> at <module path> (...)") -> indexer / attention / rest, by its op."""
    op = node.partition(" at ")[0]
    if op == INDEXER_OP:
        return "indexer"
    return "attention" if op in ATTENTION_OPS else "rest"


def _artifact(model: str, work: Path, max_seq: int, chunk: int, full_layers: int = 0, batch: int = 1) -> Path:
    """The model's artifact under ``work`` (made when missing): tiny (make-tiny, seed 0) at work/MODEL, or, with
    ``full_layers``, the published width's first N layers (make-full) at work/MODEL_LN, where ``bench full`` keeps
    the same checkpoint."""
    from dayzero.tools.compiler import CompileOptions, compile_artifact
    from dayzero.tools.make_full import make_full
    from dayzero.tools.make_tiny import make_tiny

    base = work / (f"{model}_L{full_layers}" if full_layers else model)
    ckpt, art = base / "ckpt", base / (f"art_{max_seq}_{chunk}" + (f"_b{batch}" if batch > 1 else ""))
    if not (ckpt / "config.json").exists():
        if full_layers:
            make_full(model, ckpt, layers=full_layers)
        else:
            make_tiny(model, ckpt, seed=0)
    if not (art / "artifact.json").exists():
        compile_artifact(str(ckpt), art, CompileOptions(max_seq=max_seq, max_batch=batch, prefill_chunk=chunk))
    return art


def _skip_to(rt, length: int, slot: int = 0) -> None:
    """Request ``slot`` continues at position ``length``: the rows it skips stay zero, and the window blocks behind
    that position go back to the pool (as after a call that ended there)."""
    rt.lengths[slot] = length
    if rt.kv is not None:
        rt.kv.trim(slot, length)


def _timed_decode(rt, token: int, steps: int) -> dict:
    """Mean seconds per decode step at the request's position (every step at the same one), split by step kind:
    the time from one step's end to the next step's end is that step's."""
    import torch

    kinds = [_kind(node) for _, _, _, node, _ in rt.programs["decode"].steps]
    split = dict.fromkeys(("indexer", "attention", "rest"), 0.0)
    total, length = 0.0, rt.lengths[0]
    ids = rt._token(token)
    for k in range(steps + 1):
        marks: list[tuple[int, float]] = []
        t0 = time.perf_counter()
        rt.run_program("decode", [ids, torch.tensor([length])], 0, length + 1,
                       observe=lambda i, node, outs: marks.append((i, time.perf_counter())))
        t1 = time.perf_counter()
        if k == 0:
            continue  # warm-up
        total += t1 - t0
        prev = t0
        for i, t in marks:
            split[kinds[i]] += t - prev
            prev = t
    return {"step_s": total / steps, **{k: v / steps for k, v in split.items()}}


def _timed_decode_batch(rt, token: int, batch: int, length: int, steps: int) -> float:
    """Mean seconds of one ``decode_batch`` step of requests 0..batch-1, each at position ``length`` (slot 0
    prefilled by the caller, the others one chunk, then continued at ``length``), after one warm-up step."""
    import torch

    for s in range(1, batch):
        rt.prefill(torch.full((1, min(rt.prefill_chunk, length)), token), slot=s)
    total = 0.0
    for k in range(steps + 1):
        for s in range(batch):
            _skip_to(rt, length, s)
        t0 = time.perf_counter()
        rt.decode_batch([token] * batch, list(range(batch)))
        if k:
            total += time.perf_counter() - t0
    _skip_to(rt, length, 0)
    for s in range(1, batch):
        rt.reset(s)
    return total / steps


def _kv_figures(art: Path, ckpt: Path, context: int) -> dict:
    """The request's resident KV bytes at ``context`` (the artifact's states, as ``dayzero report``) and
    tools/capacity.py's arithmetic for the config."""
    from dayzero.tools.capacity import kv_bytes_per_sequence, kv_layout
    from dayzero.tools.report import build_report

    kv = build_report(str(art))["kv_cache"]
    cfg = json.loads((ckpt / "config.json").read_text())
    resident = int(kv["bytes_per_token"] * context + kv["fixed_bytes"])
    plan = kv_bytes_per_sequence(kv_layout(cfg, "fp32", index_dtype="fp32"), context)
    return {"resident": resident, "plan": plan}


def prefill_within(rt, prompt: list[int], budget: float, slot: int = 0) -> tuple[int, float, tuple]:
    """Prefill ``prompt`` into ``slot`` chunk by chunk for at most ``budget`` seconds (one chunk at least); a tail
    left then is skipped: the request's length is set to len(prompt) all the same, its rows past the prefilled ones
    zero (a decode step's cost depends on the position, not on the values). Returns (tokens prefilled, seconds,
    (tokens, seconds, CPU seconds) of the last chunk run)."""
    import torch

    rt.reset(slot)
    t0 = time.perf_counter()
    done, ids, n_all = 0, torch.tensor([prompt]), len(prompt)
    while done < n_all and (done == 0 or time.perf_counter() - t0 < budget):
        n = min(rt.prefill_chunk, n_all - done)
        t1, c1 = time.perf_counter(), time.process_time()
        rt.prefill(ids[:, done:done + n], slot=slot, append=done > 0)
        last = (n, time.perf_counter() - t1, time.process_time() - c1)
        done += n
    seconds = time.perf_counter() - t0
    _skip_to(rt, n_all, slot)
    return done, seconds, last


def bench_long(models, contexts: list[int], max_seq: int, chunk: int, steps: int, prefill_budget: float,
               work: str | None = None, full_layers: int = 0, batch: int = 1) -> dict:
    import torch

    from dayzero.runtime import load
    from dayzero.tools.bench import machine_info

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(work or tmp)
        for model in models:
            t0 = time.perf_counter()
            art = _artifact(model, root, max_seq, chunk, full_layers, batch)
            compile_s = time.perf_counter() - t0
            rt = load(art)
            smallest = None
            for c in sorted(contexts):
                # a prompt of c - 1 tokens, then the decode step that makes the context c tokens
                prompt = torch.randint(0, 256, (c - 1,), generator=torch.Generator().manual_seed(c)).tolist()
                done, prefill_s, last = prefill_within(rt, prompt, prefill_budget)
                if done < c - 1:  # a skipped tail: its last chunk at its own position (see the module docstring)
                    n = min(rt.prefill_chunk, c - 1 - done)
                    _skip_to(rt, c - 1 - n)
                    t1, c1 = time.perf_counter(), time.process_time()
                    rt.prefill(torch.tensor([prompt[c - 1 - n:]]), append=True)
                    last = (n, time.perf_counter() - t1, time.process_time() - c1)
                _skip_to(rt, c - 1)  # decode at position c - 1 (rows past the prefilled ones stay zero)
                d = _timed_decode(rt, prompt[-1], steps)
                batched = _timed_decode_batch(rt, prompt[-1], batch, c - 1, steps) if batch > 1 else None
                kv = _kv_figures(art, art.parent / "ckpt", c)
                smallest = smallest or d
                common = {"model": model, "context": c, "max_seq": max_seq, "prefill_chunk": chunk,
                          "full_width_layers": full_layers, "bound": None, "bound_name": None}
                results += [
                    {"case": f"{model}/{c}/prefill_tokens_per_s", "unit": "tok/s", "dayzero": done / prefill_s,
                     "baselines": {}, "prefilled_tokens": done, "prefill_s": prefill_s, **common},
                    {"case": f"{model}/{c}/prefill_last_chunk", "unit": "s", "dayzero": last[1], "baselines": {},
                     "tokens": last[0], "tokens_per_s": last[0] / last[1], "end_position": c - 1,
                     "cpu_s": last[2], **common},
                    {"case": f"{model}/{c}/decode_step", "unit": "s", "dayzero": d["step_s"], "baselines": {},
                     "split_s": {k: d[k] for k in ("indexer", "attention", "rest")}, **common},
                    *([{"case": f"{model}/{c}/decode_batch_step", "unit": "s", "dayzero": batched,
                        "baselines": {"one_request_steps": batch * d["step_s"]}, "batch": batch, **common}]
                      if batched is not None else []),
                    {"case": f"{model}/{c}/decode_attention_vs_smallest", "unit": "x",
                     "dayzero": d["attention"] / smallest["attention"], "baselines": {}, "target": 1.5,
                     "smallest_context": min(contexts), **common},
                    {"case": f"{model}/{c}/kv_bytes", "unit": "B", "dayzero": kv["resident"],
                     "baselines": {"capacity_arithmetic": kv["plan"]},
                     "resident_over_arithmetic": kv["resident"] / kv["plan"], "target": 1.01, **common},
                ]
            results.append({"case": f"{model}/compile_s", "unit": "s", "dayzero": compile_s, "baselines": {},
                            "model": model, "bound": None, "bound_name": None})
    return {"suite": "long", "machine": machine_info(), "results": results}


@click.command("long")
@click.option("--json", "as_json", is_flag=True, help="Print the bench JSON object.")
@click.option("--model", "models", multiple=True, type=click.Choice(MODELS), help="default: both")
@click.option("--contexts", default=",".join(CONTEXTS), show_default=True,
              help="comma-separated context lengths (4k = 4000, 1M = 10^6)")
@click.option("--max-seq", default="1M", show_default=True, help="the artifacts' --max-seq")
@click.option("--prefill-chunk", default=32, show_default=True, help="the artifacts' --prefill-chunk")
@click.option("--steps", default=3, show_default=True, help="timed decode steps per context")
@click.option("--prefill-budget", default=120.0, show_default=True,
              help="seconds of prefill per context at most (the rest of a longer prompt is skipped, see --help)")
@click.option("--work", type=click.Path(file_okay=False), default=None,
              help="where checkpoints and artifacts go (reused when present); default a temp dir")
@click.option("--full-width-layers", default=0, show_default=True,
              help="N > 0: the published width's first N layers (make-full; WORK/MODEL_LN, shared with bench full)"
                   " instead of the tiny model")
@click.option("--batch", default=2, show_default=True,
              help="requests of the batched decode step (decode_batch_step; 1: no batched step)")
def long_command(as_json, models, contexts, max_seq, prefill_chunk, steps, prefill_budget, work, full_width_layers,
                 batch):
    """Long contexts (tiny DeepSeek-V4, tiny DeepSeek-V3.2 compiled with --max-seq 1M): prefill tokens/s, decode
    step time split into indexer / attention / rest, resident KV bytes against the config's arithmetic."""
    from dayzero import UserError
    from dayzero.tools.capacity import parse_count

    ctx = [parse_count(x, "--contexts") for x in contexts.split(",") if x.strip()]
    top = parse_count(max_seq, "--max-seq")
    if not ctx or max(ctx) > top or min(ctx) < 2:
        raise UserError(f"--contexts must be non-empty, each in [2, --max-seq {top}]")
    if steps < 1 or prefill_chunk < 1 or prefill_budget <= 0 or full_width_layers < 0 or batch < 1:
        raise UserError("--steps, --prefill-chunk, --prefill-budget and --batch must be positive, "
                        "--full-width-layers not negative")
    out = bench_long(models or MODELS, ctx, top, prefill_chunk, steps, prefill_budget, work=work,
                     full_layers=full_width_layers, batch=batch)
    from dayzero.tools.bench import baselines_text, echo_bench

    def line(r):
        base = baselines_text(r)
        extra = " ".join(f"{k} {v * 1e3:.2f} ms" for k, v in r.get("split_s", {}).items())
        return f"{r['case']:48s} {r['dayzero']:12.4g} {r['unit']:5s} {extra} {('(' + base + ')') if base else ''}"
    echo_bench(out, as_json, line)
