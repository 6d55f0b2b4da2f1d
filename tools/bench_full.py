"""``dayzero bench full``: a full-width model (published dimensions, first N layers, synthetic weights in the
published formats: ``dayzero make-full``) compiled and loaded, decode and prefill speed against the bytes bound.

Steps, each reused from ``--dir`` when already there (the checkpoint is GBs and takes minutes to write):
make-full MODEL --layers N -> DIR/MODEL_LN/ckpt; compile --max-seq (largest context + steps) --max-batch (largest
batch) --prefill-chunk (the largest prefill, at most PREFILL_CHUNK) -> DIR/MODEL_LN/art_<max_seq>_<batch>_<chunk>;
load. A longer prompt is prefilled chunk by chunk, as generation and the server run it (a 4000-token chunk's arena
held 4000 rows of every activation and of the full prefill's logits, 3.2 GB at gpt-oss's vocabulary: the 24-layer
gpt-oss run was killed for memory).

Cases (DESIGN.md's bench JSON; unit s, ``dayzero`` = seconds per step, ``bound`` = its lower bound):

* ``decode_b<B>_ctx<C>``: one decode step of B requests, each at context C (C - 1 tokens before it, at least 1). Each
  request has its own random prompt and steps with its own token, so the requests route to different experts as a real
  batch does (B identical requests reach the same k experts per layer: a fraction of the bytes the bound counts, and
  the B-token tiles of a prefill instead of B decode tiles). A prompt is prefilled for at most ``--prefill-budget``
  seconds; the rest of it is skipped and the request's length set to C - 1 (``bench_long.prefill_within``: a step's
  cost depends on the position, not on the cached values). Step time = the median of ``--steps`` steps after a warm-up
  (``decode`` at B = 1, ``decode_batch`` above). ``tokens_per_s`` = B / step. ``bound`` = bytes a step must read / the
  read bandwidth measured in this run, the bytes in the checkpoint's own storage (``step_bytes``): every weight but
  the embedding table (B rows of it), the routed experts that B tokens reach in expectation (E (1 - (1 - k/E)^B) per
  layer: top-k spread evenly), and the KV rows of B requests at C (bf16, sliding layers their window:
  ``capacity.kv_layout``). ``arena_step_bytes``: the same count in dayzero's own storage (``arena_step_bytes``: each
  weight buffer at its arena dtype, fp32 where the host converts at load, bf16 where it keeps a bf16 checkpoint's
  matrix as stored; KV in fp32), and ``fraction_of_arena_bound`` the step against that: how far the kernels are from
  their own layout's bound. ``flops_bound``: the step's weight FLOPs (``step_flops``) / the fp32 matmul rate
  measured in this run (``bench_ops.peak_flops``, machine ``matmul_peak_GFLOPs``); at 8 requests it is close to
  the bytes bound on two cores. ``bound`` is the larger of the two (``bytes_bound``, ``flops_bound``).
* ``prefill_<P>``: a prefill of P tokens from an empty cache (chunk by chunk past the chunk), the last position's
  logits (as generation and the server read them: the ``prefill_last`` program; eager with ``logits_to_keep=1``);
  ``tokens_per_s``; ``bound`` = ``flops_bound``: P tokens through every weight but the embedding table (the routed
  ones: k experts a token), the LM head for the last position only, at the measured matmul rate.

``step_flops`` counts 2 FLOPs per weight value a token multiplies (the checkpoint's values by part, MXFP4 two a
byte) and leaves out attention over the cache, so both bounds are lower bounds on the time.
* ``torch_eager`` baselines: upstream's modeling code on the same checkpoint, fp32 (as ``dayzero compare``
  builds it), when its estimated size fits in ``--eager-max-gb`` after dayzero's runtime is freed; otherwise the
  result says ``torch_eager_skipped`` with the size it needed.

``tuned_kernels``: the artifact's kernels that took a tuning record (route ``tuned``), by op. ``load_rss_bytes``:
what the process's resident memory grew by across ``load`` (freed heap returned first), against the plan for the
artifact (``plan_total_bytes``: ``dayzero report``'s plan line, weights + workspace + the KV of one request times
the artifact's request slots).
"""

from __future__ import annotations

import gc
import json
import math
import resource
import statistics
import time
from pathlib import Path

import click

MODELS = {"gpt_oss": "gpt_oss", "deepseek_v4": "deepseek_v4", "deepseek_v3_2": "deepseek_v32"}


PREFILL_CHUNK = 512  # the most prompt tokens one prefill call takes (compile's default --prefill-chunk)


def _artifact(model_type: str, layers: int, root: Path, max_seq: int, batch: int, chunk: int,
              overrides: dict | None = None, int8: bool = False) -> tuple:
    """(ckpt, art, seconds spent making each) under root, reused when present (``overrides``: make_full's, for
    tests: a narrow width; ``int8``: compiled with --int8-activations, its own artifact beside the default's)."""
    from dayzero.tools.compiler import CompileOptions, compile_artifact
    from dayzero.tools.make_full import make_full

    base = root / f"{model_type}_L{layers}"
    ckpt, art = base / "ckpt", base / f"art_{max_seq}_{batch}_{chunk}{'_int8' if int8 else ''}"
    times = {}
    if not (ckpt / "config.json").exists():
        t0 = time.perf_counter()
        make_full(model_type, ckpt, layers=layers, overrides=overrides)
        times["make_full_s"] = time.perf_counter() - t0
    if not (art / "artifact.json").exists():
        t0 = time.perf_counter()
        compile_artifact(str(ckpt), art, CompileOptions(max_seq=max_seq, max_batch=batch, prefill_chunk=chunk,
                                                        int8_activations=int8))
        times["compile_s"] = time.perf_counter() - t0
    return ckpt, art, times


def checkpoint_bytes(ckpt: Path) -> dict:
    """Stored bytes of the checkpoint by part, read from the safetensors headers (no tensor data):
    ``{"embedding_row": bytes of one row, "expert": bytes per (layer, expert), "other": bytes of the rest,
    "values": every value the upstream model holds, "layers", "experts_per_layer"}``."""
    from dayzero.tools.capacity import _category, num_experts

    cfg = json.loads((ckpt / "config.json").read_text())
    model_name = _model_key(str(cfg.get("model_type", "")))
    E = num_experts(cfg)[1]
    out = {"embedding_row": 0, "expert": 0, "other": 0, "values": 0, "experts_per_layer": E,
           "layers": int(cfg["num_hidden_layers"]), "values_by": {}}
    expert_total = 0
    for shard in sorted(ckpt.glob("*.safetensors")):
        with open(shard, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n < 1 << 30:
                raise ValueError(f"{shard.name}: bad safetensors header length {n}")
            header = json.loads(f.read(n))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            a, b = meta["data_offsets"]
            cat = _category(model_name(name))
            # values the upstream model holds (an MXFP4 block byte is 2 values, its scales none)
            values = 0 if name.endswith("_scales") else 2 * (b - a) if name.endswith("_blocks") else \
                math.prod(meta["shape"])
            out["values"] += values
            out["values_by"][cat] = out["values_by"].get(cat, 0) + values
            if cat == "embeddings":
                out["embedding_row"] += (b - a) // int(meta["shape"][0])
            elif cat == "routed_experts":
                expert_total += b - a
            else:
                out["other"] += b - a
    out["expert"] = expert_total // max(1, E * out["layers"])
    return out


def _model_key(model_type: str):
    """Checkpoint key -> the model's parameter name, by transformers' own renamings for ``model_type`` (DeepSeek-V4
    publishes its LM head as ``head.weight``: categorised by that name it counted as "other", every token's)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    mapping = get_checkpoint_conversion_mapping(model_type) or []
    renames = [t for t in mapping if isinstance(t, WeightRenaming)]
    converts = [t for t in mapping if isinstance(t, WeightConverter)]
    return lambda key: rename_source_key(key, renames, converts)[0]


def step_bytes(cb: dict, cfg: dict, batch: int, context: int) -> int:
    """Bytes one decode step of ``batch`` requests at ``context`` must read, as the checkpoint stores them (module
    docstring)."""
    return int(cb["other"] + batch * cb["embedding_row"] + expert_step_bytes(cb, cfg, batch)
               + batch * kv_step_bytes(cfg, context, "bf16"))


def step_flops(cb: dict, cfg: dict, tokens: int, head_rows: int) -> float:
    """Multiply-add FLOPs of a step of ``tokens`` tokens through the weights: 2 per value, every part but the
    embedding table (a lookup) and the LM head for each token, k of the routed experts a token, the LM head for
    ``head_rows`` rows (its own tensor, or the embedding table when tied). Attention over the cache is not
    counted: a lower bound."""
    by = cb["values_by"]
    k = int(cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 1)
    experts = by.get("routed_experts", 0) / max(1, cb["experts_per_layer"]) * k if cb["experts_per_layer"] else 0
    dense = sum(v for c, v in by.items() if c not in ("embeddings", "lm_head", "routed_experts"))
    head = by.get("lm_head") or by.get("embeddings", 0)
    return 2.0 * (tokens * (dense + experts) + head_rows * head)


def expert_step_bytes(cb: dict, cfg: dict, batch: int) -> float:
    """Bytes of the routed experts ``batch`` tokens reach in expectation (top-k spread evenly), as stored."""
    E, k = cb["experts_per_layer"], int(cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 1)
    reached = E * (1 - (1 - k / E) ** batch) if E else 0.0
    return cb["layers"] * reached * cb["expert"]


def kv_step_bytes(cfg: dict, context: int, dtype: str) -> int:
    """KV bytes one request reads at ``context`` (``capacity.kv_layout``: sliding layers their window)."""
    from dayzero.tools.capacity import kv_bytes_per_sequence, kv_layout

    return kv_bytes_per_sequence(kv_layout(cfg, dtype), context)


def arena_step_bytes(art: Path, cb: dict, cfg: dict, batch: int, context: int) -> int:
    """``step_bytes`` in dayzero's own storage: every weight buffer of the compiled programs (zone weights) at its
    arena dtype (fp32 where the host converts at load, bf16 where it keeps a bf16 checkpoint's matrix as stored),
    the embedding table ``batch`` rows of it, the routed experts as stored (resident as published), the KV cache
    in fp32."""
    from dayzero.passes.ir.ops import DTYPE_BYTES
    from dayzero.tools.capacity import _category

    programs = json.loads((art / "program.json").read_text()).get("programs", {})
    held = {b["weight"]: b for p in programs.values() for b in p["buffers"]
            if b.get("weight") and b.get("zone") == "weights"}
    dense = 0
    for name, b in held.items():
        cat = _category(name)
        if cat == "routed_experts":  # counted as stored by expert_step_bytes
            continue
        rows = batch if cat == "embeddings" and len(b["shape"]) == 2 else math.prod(b["shape"][:-1])
        dense += rows * b["shape"][-1] * DTYPE_BYTES[b["dtype"]] if b["shape"] else DTYPE_BYTES[b["dtype"]]
    return int(dense + expert_step_bytes(cb, cfg, batch) + batch * kv_step_bytes(cfg, context, "fp32"))


def _decode_step(rt, batch: int, steps: int) -> float:
    """Median seconds of ``steps`` decode steps of requests in slots [0, batch), after a warm-up step: one run of
    the batched decode program (each request one token), or B runs of ``decode`` where the artifact has none."""
    slots = list(range(batch))
    tokens = [7 + 11 * s for s in slots]  # each request its own token (module docstring)
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        if batch > 1 and rt.has_batched_decode:
            rt.decode_batch(tokens, slots)
        else:
            for s, tok in zip(slots, tokens):
                rt.decode(tok, slot=s)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _eager_baselines(ckpt: Path, values: int, cases: list, max_gb: float, ids_below: int) -> dict:
    """Seconds of upstream's modeling code, fp32, on the checkpoint (``values`` parameters) per case: a prefill,
    or a batch-1 decode step at a context (the median of 3 steps; each grows the cache by one), or why not
    (``{"skipped": reason}``)."""
    import torch

    need = values * 4
    if need > max_gb * 1e9:
        return {"skipped": f"fp32 upstream needs {need / 1e9:.1f} GB > --eager-max-gb {max_gb}"}
    from dayzero.frontend.hf import load_upstream

    model = load_upstream(ckpt)
    out = {}
    with torch.no_grad():
        for case in cases:
            if case["kind"] == "prefill":
                ids = torch.randint(0, ids_below, (1, case["tokens"]), generator=torch.Generator().manual_seed(0))
                t0 = time.perf_counter()
                model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, logits_to_keep=1)
                out[case["case"]] = time.perf_counter() - t0
            else:  # one request at the context: its prompt through upstream's cache, then timed steps
                ids = torch.randint(0, ids_below, (1, max(1, case["context"] - 1)),
                                    generator=torch.Generator().manual_seed(case["context"]))
                past = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True).past_key_values
                tok, ts = torch.tensor([[7]]), []
                for _ in range(3):
                    t0 = time.perf_counter()
                    model(input_ids=tok, past_key_values=past, use_cache=True)
                    ts.append(time.perf_counter() - t0)
                out[case["case"]] = statistics.median(ts)
    del model
    gc.collect()
    return out


def bench_full(model: str, layers: int, root: Path, contexts: list[int], batches: list[int], prefills: list[int],
               steps: int, prefill_budget: float, eager_max_gb: float, overrides: dict | None = None,
               int8: bool = False) -> dict:
    """The suite (module docstring); ``overrides``: make_full's test-only config overrides (a narrow width)."""
    import torch

    import psutil

    from dayzero.runtime import load
    from dayzero.runtime.executor import return_freed_heap
    from dayzero.tools.bench import machine_info
    from dayzero.tools.bench_dequant import read_bandwidth
    from dayzero.tools.bench_ops import peak_flops
    from dayzero.tools.bench_long import prefill_within
    from dayzero.tools.report import build_report

    model_type = MODELS[model]
    max_seq = max(max(contexts) + steps + 2, max(prefills))
    ckpt, art, made = _artifact(model_type, layers, root, max_seq, max(batches), min(max(prefills), PREFILL_CHUNK),
                                overrides, int8)
    cfg = json.loads((ckpt / "config.json").read_text())
    cb = checkpoint_bytes(ckpt)
    ids_below = min(1000, int(cfg["vocab_size"]))  # prompt token ids: random below this
    gc.collect()
    return_freed_heap()  # what compiling freed, so that only the load's own bytes count
    rss = psutil.Process().memory_info().rss
    t0 = time.perf_counter()
    rt = load(art)
    load_s = time.perf_counter() - t0
    load_rss = psutil.Process().memory_info().rss - rss
    plan = build_report(str(art)).get("plan") or {}  # dayzero report's plan line (one request's KV)
    plan_total = plan["weights"]["plan"] + rt.max_batch * plan["kv_bytes_per_sequence"]["plan"] + \
        plan["workspace"]["plan"] if "weights" in plan else None
    bw, peak = read_bandwidth(512 << 20), peak_flops()
    program = json.loads((art / "program.json").read_text()) if (art / "program.json").exists() else {}
    tuned = sorted({k.get("op") for p in program.get("programs", [program]) if isinstance(p, dict)
                    for k in (p.get("kernels") or {}).values() if isinstance(k, dict) and k.get("route") == "tuned"})
    common = {"model": model, "layers": layers}
    results = []
    for c in contexts:
        for b in batches:
            rt.reset()
            prefilled = [prefill_within(rt, torch.randint(0, ids_below, (max(1, c - 1),), generator=torch.Generator()
                                                          .manual_seed(c + 7919 * s)).tolist(), prefill_budget,
                                        slot=s)[0] for s in range(b)]
            t = _decode_step(rt, b, steps)
            need, arena = step_bytes(cb, cfg, b, c), arena_step_bytes(art, cb, cfg, b, c)
            flops = step_flops(cb, cfg, b, b)
            bound = max(need / bw, flops / peak)
            results.append({
                "case": f"decode_b{b}_ctx{c}", "unit": "s", "dayzero": t, "baselines": {},
                "bound": bound, "bound_name": "max(step_bytes/read_bandwidth, step_flops/matmul_peak)", "batch": b,
                "context": c, "tokens_per_s": b / t, "bound_tokens_per_s": b / bound, "fraction_of_bound": bound / t,
                "bytes_bound": need / bw, "flops_bound": flops / peak, "step_flops": flops,
                "step_bytes": need, "arena_step_bytes": arena, "fraction_of_arena_bound": arena / bw / t,
                "prefilled_tokens": prefilled, "batched_program": b == 1 or rt.has_batched_decode, **common})
    for p in prefills:
        ids = torch.randint(0, ids_below, (1, p), generator=torch.Generator().manual_seed(p))
        ts = []
        for _ in range(2):
            rt.reset()
            t0 = time.perf_counter()
            rt.prefill(ids, last=True)  # as generation and the server prefill: the last position's logits
            ts.append(time.perf_counter() - t0)
        flops = step_flops(cb, cfg, p, 1)
        results.append({"case": f"prefill_{p}", "unit": "s", "dayzero": min(ts), "baselines": {},
                        "bound": flops / peak, "bound_name": "step_flops/matmul_peak", "flops_bound": flops / peak,
                        "step_flops": flops, "fraction_of_bound": flops / peak / min(ts), "tokens": p,
                        "tokens_per_s": p / min(ts), "logits": "last position", **common})
    del rt
    gc.collect()
    smallest = min(contexts)
    cases = [{"kind": "prefill", "tokens": p, "case": f"prefill_{p}"} for p in prefills]
    cases.append({"kind": "decode", "batch": 1, "context": smallest, "case": f"decode_b1_ctx{smallest}"})
    eager = _eager_baselines(ckpt, cb["values"], cases, eager_max_gb, ids_below)
    for r in results:
        if r["case"] in eager:
            r["baselines"]["torch_eager"] = eager[r["case"]]
        elif "skipped" in eager:
            r["torch_eager_skipped"] = eager["skipped"]
    machine = dict(machine_info(), read_bandwidth_GBps=round(bw / 1e9, 2), matmul_peak_GFLOPs=round(peak / 1e9, 1))
    return {"suite": "full", "machine": machine, "results": results, "model": model, "layers": layers,
            "int8_activations": int8,
            "checkpoint_bytes": sum(f.stat().st_size for f in ckpt.glob("*.safetensors")),
            "load_s": load_s, "load_rss_bytes": load_rss, "plan_total_bytes": plan_total,
            "load_rss_over_plan": load_rss / plan_total if plan_total else None, **made, "tuned_kernels": tuned,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


@click.command("full")
@click.option("--json", "as_json", is_flag=True, help="Print the bench JSON object.")
@click.option("--model", type=click.Choice(sorted(MODELS)), default="gpt_oss", show_default=True)
@click.option("--layers", type=int, default=2, show_default=True, help="the first N layers of the published model")
@click.option("--dir", "work", type=click.Path(file_okay=False), required=True,
              help="where the checkpoint and artifact go (reused when present: the checkpoint is GBs)")
@click.option("--contexts", default="1,4k", show_default=True, help="decode contexts (4k = 4000)")
@click.option("--batches", default="1,8", show_default=True, help="decode batch sizes")
@click.option("--prefill", "prefills", default="512", show_default=True, help="prefill lengths")
@click.option("--steps", default=5, show_default=True, help="timed decode steps per case")
@click.option("--prefill-budget", default=60.0, show_default=True,
              help="seconds of prefill per request at most before a decode case (the rest is skipped, see --help)")
@click.option("--eager-max-gb", default=5.0, show_default=True,
              help="run torch eager (fp32 upstream) only when its parameters fit in this many GB")
@click.option("--int8-activations", "int8", is_flag=True,
              help="compile with --int8-activations (decode experts on integer tiles; its own artifact in --dir)")
def full_command(as_json, model, layers, work, contexts, batches, prefills, steps, prefill_budget, eager_max_gb,
                 int8):
    """A full-width model (make-full, first N layers) compiled and loaded: decode tokens/s at each batch and
    context against the bytes-per-step bound at this run's read bandwidth, prefill tokens/s, torch eager where it
    fits."""
    from dayzero import UserError
    from dayzero.tools.capacity import parse_count

    def counts(s, what, low=1):
        v = [parse_count(x, what) for x in s.split(",") if x.strip()]
        if not v or min(v) < low:
            raise UserError(f"{what} must be a non-empty list of counts >= {low}, got {s!r}")
        return sorted(set(v))
    if layers < 1 or steps < 1 or prefill_budget <= 0 or eager_max_gb < 0:
        raise UserError("--layers and --steps must be >= 1, --prefill-budget > 0, --eager-max-gb >= 0")
    out = bench_full(model, layers, Path(work), counts(contexts, "--contexts"), counts(batches, "--batches"),
                     counts(prefills, "--prefill"), steps, prefill_budget, eager_max_gb, int8=int8)
    from dayzero.tools.bench import baselines_text, echo_bench

    def line(r):
        bound = f", {r['fraction_of_bound']:.0%} of the bound" if r.get("bound") else ""
        return (f"{r['case']:24s} {r['dayzero'] * 1e3:9.1f} ms  {r['tokens_per_s']:9.1f} tok/s{bound} "
                f"{baselines_text(r, 1e3, '.1f', 'ms')}")
    echo_bench(out, as_json, line,
               f"{model} x{layers} layers, read bandwidth {out['machine']['read_bandwidth_GBps']} GB/s, fp32 matmul "
               f"{out['machine']['matmul_peak_GFLOPs']} GFLOP/s")
