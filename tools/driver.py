"""``dayzero compile``: model -> trace -> passes -> program -> kernels -> memory plan -> artifact.

MODEL is a checkpoint directory (config.json + safetensors), ``module.path:factory`` (a callable returning
``(nn.Module, example_inputs)``), or an ``(nn.Module, example_inputs)`` pair from Python. Nothing is written
until every step before the artifact succeeded: an unsupported op or a broken checkpoint leaves no OUT.
"""

from __future__ import annotations

import importlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dayzero import UserError
from dayzero.codegen import artifact
from dayzero.codegen.build import build_library
from dayzero.codegen.program import Program, build_program, program_json
from dayzero.frontend import hf
from dayzero.frontend.checkpoint import Checkpoint, learn_recipes
from dayzero.frontend.torch_export import Traced, export_module, symbol_names_from, to_graph
from dayzero.passes.ir.node import Graph
from dayzero.passes.ir.text import print_graph
from dayzero.passes.memory_plan import Buffer, plan_zones
from dayzero.passes.pipeline import PassContext, run_pipeline
from dayzero.targets.host import host_target_dict

DEFAULT_MAX_SEQ = 512


@dataclass
class Frontend:
    traced: Traced
    checkpoint: Checkpoint | None = None
    recipes: dict[str, list] = field(default_factory=dict)
    model_type: str = ""


def resolve_target(target: str | dict) -> dict:
    if isinstance(target, dict):
        return target
    if target in ("host", "llvm", "cpu"):
        return host_target_dict()
    if target.startswith("cuda"):
        arch = target.partition(":")[2] or "sm_90"
        return {"kind": "cuda", "arch": arch}
    raise UserError(f"unknown target {target!r} (use host or cuda[:sm_90])")


def trace_model(model: Any, max_seq: int = DEFAULT_MAX_SEQ) -> Frontend:
    seq = torch.export.Dim("seq", min=1, max=max_seq)
    if isinstance(model, (str, os.PathLike)) and str(model).endswith(".onnx"):
        from dayzero.frontend.onnx_import import trace_onnx

        return trace_onnx(model, max_seq)
    if isinstance(model, (str, os.PathLike)) and Path(model).is_dir():
        ckpt = Checkpoint(model)
        module, _ = hf.meta_model(ckpt)
        wrapper = hf.CausalLMPrefill(module)
        example = (torch.zeros(1, min(8, max_seq), dtype=torch.int64, device="meta"),)
        ep = export_module(wrapper, example, {"input_ids": {1: seq}})
        traced = to_graph(ep, symbol_names_from(ep, {"input_ids": {1: "seq"}}), strip_prefix="upstream.")
        recipes, _ = learn_recipes(ckpt, hf.load_for_recipes)
        # tensors the checkpoint does not hold (non-persistent buffers such as rotary inverse frequencies) come
        # from a CPU model built from the config: only those are kept
        names = {n.attr["name"] for n in traced.graph.nodes() if n.op == "weight"}
        traced.weights = _buffers_from_config(ckpt, names - set(recipes)) if names - set(recipes) else {}
        return Frontend(traced, ckpt, recipes, str(ckpt.config.get("model_type", "")))
    if isinstance(model, str):
        if ":" not in model:
            raise UserError(f"{model}: neither a checkpoint directory nor module.path:factory")
        mod_name, _, attr = model.partition(":")
        try:
            factory = getattr(importlib.import_module(mod_name), attr)
        except (ImportError, AttributeError) as e:
            raise UserError(f"cannot load {model}: {e}") from None
        model = factory()
    if not (isinstance(model, tuple) and len(model) == 2 and isinstance(model[0], torch.nn.Module)):
        raise UserError("a model factory must return (nn.Module, example_inputs)")
    module, example = model
    example = tuple(example) if isinstance(example, (tuple, list)) else (example,)
    names = [p for p in __import__("inspect").signature(module.forward).parameters][:len(example)]
    dyn = {n: ({1: seq} if isinstance(x, torch.Tensor) and x.dim() >= 2 else None) for n, x in zip(names, example)}
    ep = export_module(module.eval(), example, dyn)
    dims = {n: {1: "seq"} for n, d in dyn.items() if d}
    traced = to_graph(ep, symbol_names_from(ep, dims))
    return Frontend(traced)


def _buffers_from_config(ckpt: Checkpoint, names: set[str]) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    cfg = hf._config(ckpt)
    with hf._quiet():
        m = AutoModelForCausalLM.from_config(cfg)
    sd = dict(m.named_parameters())
    sd.update(m.named_buffers())
    unknown = sorted(names - set(sd))
    if unknown:
        raise UserError(f"{ckpt.dir}: the model reads {', '.join(unknown[:5])}, which neither the checkpoint "
                        "nor the model's own initialisation provides")
    return {n: sd[n].detach().clone() for n in names}


def optimize(fe: Frontend, verify: bool = False, dump_dir=None) -> tuple[Graph, PassContext]:
    ctx = PassContext()
    g = run_pipeline(fe.traced.graph, ctx, verify=verify, dump_dir=dump_dir)
    return g, ctx


def plan_memory(prog: Program) -> dict:
    """Lifetimes over program steps -> zoned arena offsets, sized at the symbols' upper bounds.

    ``buffers`` keeps every planned buffer as ``[offset, bytes, first_step, last_step, zone]`` (lifetimes
    inclusive; weights and program I/O span [0, steps]) so ``dayzero report --plot`` can draw the arena
    from report.json alone."""
    bounds = {s: hi for s, lo, hi in prog.symbols}
    n = len(prog.steps)
    first: dict[int, int] = {}
    last: dict[int, int] = {}

    def root(b: int) -> int:
        a = prog.buffers[b].alias_of
        return b if a is None else a

    for i, st in enumerate(prog.steps):
        for b in st.args:
            r = root(b)
            first.setdefault(r, i)
            last[r] = i
    for b in prog.inputs + prog.outputs:
        r = root(b)
        first[r], last[r] = 0, n
    bufs = []
    for b in prog.buffers:
        if b.alias_of is not None:
            continue
        if b.zone == "weights":
            start, end = 0, n
        else:
            start, end = first.get(b.id, 0), last.get(b.id, 0)
        zone = b.zone if b.zone != "io" or b.id in prog.inputs or root(b.id) in map(root, prog.outputs) \
            else "activations"
        bufs.append(Buffer(b.id, b.max_bytes(bounds), start, end, zone))
    zp = plan_zones(bufs)
    offsets = {b.id: zp.offsets[root(b.id)] for b in prog.buffers}
    return {
        "arena_bytes": zp.total_bytes,
        "offsets": offsets,
        "zones": zp.summary(),
        "peak_live_bytes": {z: p.peak_live_bytes for z, p in zp.plans.items()},
        "planned_bytes": {z: p.arena_bytes for z, p in zp.plans.items()},
        "algorithm": {z: p.algorithm for z, p in zp.plans.items()},
        "bounds": bounds,
        "steps": n,
        "buffers": [[zp.offsets[b.id], b.size, b.start, b.end, b.zone] for b in sorted(bufs, key=lambda b: b.id)],
    }


def weights_manifest(fe: Frontend, g: Graph, ctx: PassContext) -> tuple[dict, dict[str, torch.Tensor]]:
    """name -> where its bytes come from; plus the tensors the artifact must carry itself."""
    entries, own = {}, {}
    for n in g.nodes():
        if n.op != "weight":
            continue
        name = n.attr["name"]
        meta = {"dtype": n.dtype, "shape": list(n.shape)}
        if name in fe.recipes:
            entries[name] = dict(meta, source="checkpoint", runs=[list(r) for r in fe.recipes[name]])
        elif name in ctx.constants or name in fe.traced.weights:
            t = ctx.constants.get(name, fe.traced.weights.get(name))
            own[name] = t.to(getattr(torch, n.dtype)) if str(t.dtype).removeprefix("torch.") != n.dtype else t
            entries[name] = dict(meta, source="artifact")
        else:
            raise UserError(f"weight {name} is neither in the checkpoint nor computable from the config")
    manifest = {"format": artifact.FORMAT, "tensors": entries}
    if fe.checkpoint is not None:
        ck = fe.checkpoint
        manifest["checkpoint"] = {"dir": str(ck.dir), "files": ck.fingerprints(),
                                  "keys": {k: v.file for k, v in sorted(ck.tensors.items())}}
    return manifest, own


def compile_model(model, out, target: str | dict = "host", max_seq: int = DEFAULT_MAX_SEQ,
                  verify: bool = False, tune: int | None = None, tune_minutes: float | None = None,
                  tuning_dir: str | None = None) -> dict:
    """Compile MODEL into the artifact directory OUT; returns the report."""
    times = {}
    t0 = time.perf_counter()
    fe = trace_model(model, max_seq)
    times["trace_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    g, ctx = optimize(fe, verify=verify)
    prog = build_program(g, "prefill")  # raises UnsupportedOpsError before anything is written
    times["passes_s"] = time.perf_counter() - t0
    tgt = resolve_target(target)
    t0 = time.perf_counter()
    lib, build_stats = build_library([prog], tgt)
    times["codegen_s"] = time.perf_counter() - t0
    memory = plan_memory(prog)
    manifest, own = weights_manifest(fe, g, ctx)
    report = {
        "format": artifact.FORMAT,
        "model_type": fe.model_type,
        "target": tgt,
        "programs": {"prefill": {"steps": len(prog.steps), "kernels": len(prog.kernels),
                                 "memory": {k: v for k, v in memory.items() if k != "offsets"}}},
        "routes": {k.name: k.route for k in prog.kernels.values()},
        "kernel_ops": {k.name: k.op for k in prog.kernels.values()},
        "patterns": dict(ctx.patterns),
        "unsupported": [],
        "build": build_stats,
    }
    pj = program_json(prog)
    pj["memory"] = {"arena_bytes": memory["arena_bytes"], "offsets": {str(k): v for k, v in memory["offsets"].items()},
                    "zones": memory["zones"]}
    with artifact.ArtifactWriter(out) as d:
        lib.export_library(str(d / "kernels.so"))
        artifact.write_json(d / "program.json", {"format": artifact.FORMAT, "target": tgt, "programs": {"prefill": pj}})
        artifact.write_json(d / "weights.json", manifest)
        artifact.save_tensors(d / "weights.safetensors", own)
        (d / "final.ir").write_text(print_graph(g))
        artifact.write_json(d / "report.json", report)
    report["seconds"] = times
    return report
