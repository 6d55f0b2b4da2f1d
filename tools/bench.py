"""``dayzero bench e2e``: the tiny architectures (``E2E_MODELS``: Qwen3-MoE, gpt-oss, DeepSeek-V3.2, DeepSeek-V4),
compiled vs torch eager vs torch.compile vs stock TVM Relax (``relax_baseline``: the same export through Relax's
importer and default pipeline, one static length per case; ``compile_s`` compares the compile times), in one run; and
``dayzero bench decode-batch``: one batched decode step of B requests vs B sequential steps (``bench_decode_batch``).

Cases: prefill at 64 tokens, a one-token forward without a cache, and a real decode step (one token after a
32-token prompt, reading the KV cache).
Each figure is the median of ``repeat`` runs after a warm-up; the contenders run one after another in the same
process, case by case, so the machine's noise of a period hits them alike. Peak RSS is the process's high-water mark (``resource``).
"""

from __future__ import annotations

import math
import os
import platform
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch

BENCH_MODEL = "qwen3_moe"  # the tuning bench's model and e2e's first (the demo's until it moved to DeepSeek-V4)
E2E_MODELS = ("qwen3_moe", "gpt_oss", "deepseek_v32", "deepseek_v4")


def echo_bench(out: dict, as_json: bool, line, header: str | None = None) -> None:
    """A bench's output: its JSON object (``--json``), else ``header`` and ``line(result)`` for each result."""
    import json

    import click

    if as_json:
        click.echo(json.dumps(out, indent=1))
        return
    if header:
        click.echo(header)
    for r in out["results"]:
        click.echo(line(r))


def baselines_text(r: dict, scale: float = 1.0, spec: str = ".4g", unit: str = "") -> str:
    """A result's baselines as ``name value[ unit], ...`` (values times ``scale``, formatted by ``spec``)."""
    return ", ".join(f"{k} {v * scale:{spec}}{' ' + unit if unit else ''}" for k, v in r["baselines"].items())


def machine_info() -> dict:
    from dayzero.targets.host import host_cpu

    return {"cpu": host_cpu(), "cores": os.cpu_count(), "platform": platform.platform(),
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def _times(fn, repeat: int) -> list[float]:
    """Seconds of ``repeat`` calls of fn, after one warm-up call."""
    fn()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return ts


def _median_time(fn, repeat: int) -> float:
    return statistics.median(_times(fn, repeat))


def relax_baseline(upstream: torch.nn.Module, ids: torch.Tensor) -> tuple:
    """Stock TVM Relax on the same model (issue 21's baseline): ``torch.export`` of the upstream prefill
    (``input_ids -> logits``, all-ones mask) at ``ids``' length, ``tvm.relax.frontend.torch.
    from_exported_program`` and ``tvm.compile`` with its default pipeline for the host target, nothing tuned.
    (A call ``() -> logits`` on ``ids``, its seconds of export + import + compile.) ``upstream`` must export:
    experts as ``batched_mm`` (UPSTREAM_NOTES)."""
    import tvm
    from tvm import relax
    from tvm.relax.frontend.torch import from_exported_program

    from dayzero.frontend.hf import CausalLMPrefill
    from dayzero.targets.host import host_target_dict

    t0 = time.perf_counter()
    with torch.no_grad():
        ep = torch.export.export(CausalLMPrefill(upstream), (ids,), strict=False)
    mod = from_exported_program(ep, custom_convert_map=_relax_import_fixes())
    ex = tvm.compile(mod, target=tvm.target.Target(host_target_dict()))
    seconds = time.perf_counter() - t0
    vm = relax.VirtualMachine(ex, tvm.cpu())
    arg = tvm.runtime.tensor(ids.numpy())
    main = vm["main"]
    return (lambda: main(arg)[0]), seconds


def _relax_import_fixes() -> dict:
    """The two converters Relax's torch importer lacks for DeepSeek-V3.2 / V4 (the issue's "small import
    workarounds"): ``topk(sorted=False)`` (it refuses it; a sorted top-k is a valid unsorted one), a floor or
    trunc division of an int64 tensor by a Python int (it makes the int an int32 constant, then refuses the mixed
    dtypes), and ``full`` with an infinite fill (its legalization fails)."""
    from tvm import relax

    def topk(node, imp):
        args = imp.retrieve_args(node)
        arg = lambda i, name, default: args[i] if len(args) > i else node.kwargs.get(name, default)  # noqa: E731
        return imp.block_builder.emit(relax.op.topk(args[0], k=arg(1, "k", 1), axis=arg(2, "dim", -1),
                                                    largest=arg(3, "largest", True), ret_type="both",
                                                    dtype="int64"))

    def div_mode(node, imp):
        args = imp.retrieve_args(node)
        mode = args[2] if len(node.args) > 2 else node.kwargs.get("rounding_mode")
        x, y = args[0], args[1]
        if mode is None or not isinstance(y, int | float) or not isinstance(x, relax.Expr):
            return imp._div(node)
        out = (relax.op.floor_divide if mode == "floor" else relax.op.divide)(x, relax.const(y, x.ty.dtype))
        out = imp.block_builder.emit(out)
        return out if mode == "floor" else imp.block_builder.emit(relax.op.trunc(out))

    def full(node, imp):  # full(-inf) fails Relax's legalization (it asks a PrimType dtype for "float"): 0 + fill
        args = imp.retrieve_args(node)
        if not (isinstance(args[1], float) and math.isinf(args[1])):
            return imp._full(node)
        dtype = imp._convert_data_type(node.kwargs.get("dtype") or torch.get_default_dtype(), imp.env)
        zeros = imp.block_builder.emit(relax.op.zeros(relax.ShapeExpr(args[0]), dtype))
        return imp.block_builder.emit(relax.op.add(zeros, relax.const(args[1], dtype)))

    return {"topk.default": topk, "div.Tensor_mode": div_mode, "full.default": full}


def bench_e2e(repeat: int = 20, models=E2E_MODELS) -> dict:
    """Every model of ``models`` (tiny, seed 0), side by side with its baselines; ``compile_s`` and ``launches``
    per model."""
    work = Path(tempfile.mkdtemp(prefix="dayzero-bench-"))
    results, compile_s, launches = [], {}, {}
    for model in models:
        rows, compile_s[model], launches[model] = _e2e_model(model, work / model, repeat)
        results += rows
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"suite": "e2e", "machine": machine_info(), "results": results, "peak_rss_bytes": peak,
            "models": list(models), "launches": launches, "compile_s": compile_s}


def _e2e_model(model: str, work: Path, repeat: int) -> tuple[list, dict, dict]:
    from dayzero.frontend.hf import load_upstream
    from dayzero.runtime import load
    from dayzero.tools.driver import compile_model
    from dayzero.tools.make_tiny import make_tiny

    make_tiny(model, work / "ckpt", seed=0)
    t0 = time.perf_counter()
    compile_model(str(work / "ckpt"), str(work / "art"), max_seq=128)
    compile_s = {"dayzero": time.perf_counter() - t0}  # prefill + decode programs, every length up to 128
    rt = load(work / "art")
    eager = load_upstream(work / "ckpt")
    exportable = load_upstream(work / "ckpt", experts="batched_mm")
    compiled = torch.compile(eager)
    results = []
    for case, seq in (("prefill_64", 64), ("step_1_token", 1)):
        ids = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(seq))
        mask = torch.ones_like(ids)

        def run_eager(m=eager):
            with torch.no_grad():
                return m(input_ids=ids, attention_mask=mask, use_cache=False).logits

        try:  # one static length each
            run_relax, compile_s[f"tvm_relax_{case}"] = relax_baseline(exportable, ids)
        except Exception as e:  # noqa: BLE001 - stock Relax cannot import this model: say why, time the rest
            run_relax, relax_error = None, f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"

        def ours():
            if rt.stateful:
                rt.reset()
            rt.prefill(ids)
        t_ours = _median_time(ours, repeat)
        t_eager = _median_time(run_eager, repeat)
        t_compiled = _median_time(lambda: run_eager(compiled), repeat)
        row = {"case": f"{model}/{case}", "unit": "s", "dayzero": t_ours,
               "baselines": {"torch_eager": t_eager, "torch_compile": t_compiled}, "bound": None,
               "bound_name": None, "tokens": seq}
        if run_relax is not None:
            row["baselines"]["tvm_relax"] = _median_time(run_relax, repeat)
        else:
            row["tvm_relax_error"] = relax_error
        results.append(row)
    # a real decode step: one token appended to a 32-token request, read from the KV cache (torch eager: the
    # same model with transformers' DynamicCache; torch.compile would recompile as the cache grows: left out)
    prompt = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(32))
    with torch.no_grad():
        past = eager(input_ids=prompt, attention_mask=torch.ones_like(prompt), use_cache=True).past_key_values
    tok = torch.tensor([[7]])

    def eager_step():
        with torch.no_grad():
            eager(input_ids=tok, cache=past, use_cache=True)

    def ours_step():  # every step at position 32 (the cost depends on the position, not on the values)
        rt.lengths[0] = 32
        rt.decode(tok)
    if rt.stateful:
        rt.reset()
    rt.prefill(prompt)
    results.append({"case": f"{model}/decode_step_after_32", "unit": "s", "dayzero": _median_time(ours_step, repeat),
                    "baselines": {"torch_eager": _median_time(eager_step, repeat)}, "bound": None,
                    "bound_name": None, "tokens": 1})
    # kernel launches per run of each program (steps), and the distinct kernels they call
    launches = {name: {"steps": len(p.steps), "kernels": len({s[0] for s in p.steps})}
                for name, p in rt.programs.items()}
    return results, compile_s, launches


BATCH_SIZES = (1, 2, 4, 8)


def bench_decode_batch(repeat: int = 20, model_type: str = "qwen3_moe", prompt_len: int = 16) -> dict:
    """One batched decode step of B requests (``Runtime.decode_batch``) vs the same B requests stepped one after
    another with ``decode`` (baseline ``sequential_decode``), B in BATCH_SIZES, on tiny ``model_type`` compiled
    with --max-batch 8. Each request holds a ``prompt_len``-token prompt; each timed call advances every request by
    one token (the cache budget covers every call). ``ratio_to_step1`` = step(B) / step(1): issue 16's target is
    step(8) <= 2 x step(1), as MoE layers read each routed expert once per step for all the requests."""
    from dayzero.runtime import load
    from dayzero.tools.driver import compile_model
    from dayzero.tools.make_tiny import make_tiny

    work = Path(tempfile.mkdtemp(prefix="dayzero-bench-"))
    make_tiny(model_type, work / "ckpt", seed=0)
    max_seq = prompt_len + 2 * (repeat + 2) + 16
    compile_model(str(work / "ckpt"), str(work / "art"), max_seq=max_seq, max_batch=max(BATCH_SIZES))
    rt = load(work / "art")

    def start(b: int) -> list[int]:
        rt.reset()
        for s in range(b):
            rt.prefill(torch.randint(0, 256, (prompt_len,), generator=torch.Generator().manual_seed(s)), slot=s)
        return list(range(b))

    results, step1 = [], None
    for b in BATCH_SIZES:
        slots = start(b)
        batched = _times(lambda: rt.decode_batch([7] * b, slots), repeat)
        slots = start(b)
        sequential = _times(lambda: [rt.decode(7, slot=s) for s in slots], repeat)
        step1 = step1 or (statistics.median(batched), min(batched))
        results.append({"case": f"decode_step_B{b}", "unit": "s", "dayzero": statistics.median(batched),
                        "baselines": {"sequential_decode": statistics.median(sequential)}, "bound": None,
                        "bound_name": None, "batch": b, "tokens": b,
                        "ratio_to_step1": statistics.median(batched) / step1[0],
                        # the fastest run of each: on a shared machine the median carries other processes' load
                        "dayzero_min": min(batched), "sequential_decode_min": min(sequential),
                        "ratio_to_step1_min": min(batched) / step1[1]})
    rt.reset()
    return {"suite": "decode_batch", "machine": dict(machine_info(), tvm_threads=rt.threads), "results": results,
            "model": model_type, "step8_over_step1": results[-1]["ratio_to_step1"],
            "step8_over_step1_min": results[-1]["ratio_to_step1_min"]}
