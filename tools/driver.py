"""``dayzero compile``: model -> trace -> passes -> program -> kernels -> memory plan -> artifact.

MODEL is a checkpoint directory (config.json + safetensors), ``module.path:factory`` (a callable returning
``(nn.Module, example_inputs)``), or an ``(nn.Module, example_inputs)`` pair from Python. Nothing is written
until every step before the artifact succeeded: an unsupported op or a broken checkpoint leaves no OUT.
"""

from __future__ import annotations

import importlib
import math
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from dayzero import InternalError, UserError
from dayzero.codegen import artifact, tuning
from dayzero.codegen.build import build_library
from dayzero.codegen.memory import plan_programs
from dayzero.codegen.program import Program, build_program, program_json
from dayzero.codegen.tuner import tune_kernels
from dayzero.frontend import hf
from dayzero.frontend.checkpoint import (Checkpoint, bound_tensors, check_coverage, first_nonfinite,
                                         learn_recipes_low_precision)
from dayzero.frontend.lowprec import bind_low_precision
from dayzero.frontend.torch_export import Traced, export_module, symbol_names_from, to_graph
from dayzero.passes.ir.node import Graph
from dayzero.passes.ir.text import print_graph
from dayzero.passes.memory_plan import PER_REQUEST_ZONES
from dayzero.passes.pipeline import PassContext, run_pipeline
from dayzero.targets.host import host_target_dict

DEFAULT_MAX_SEQ = 512
DEFAULT_PREFILL_CHUNK = 512  # tokens per prefill call (capped at max_seq): the prefill arena is sized by it
DEFAULT_KV_BLOCK = 16  # tokens per KV-cache block (passes/paged_kv.py)


@dataclass
class Frontend:
    traced: Traced
    checkpoint: Checkpoint | None = None
    recipes: dict[str, list] = field(default_factory=dict)
    model_type: str = ""
    decode: Traced | None = None  # the decode step (seq = 1), when the model has a KV cache dayzero can own
    extra: dict[str, Traced] = field(default_factory=dict)  # more programs by name (vision_TxHxW: issue 9)
    multimodal: dict | None = None  # what the runtime needs to drive them (artifact multimodal.json)
    cache_layout: list = field(default_factory=list)  # per cache state: layer, layer type, position dim, rate


def resolve_target(target: str | dict) -> dict:
    if isinstance(target, dict):
        return target
    if target in ("host", "llvm", "cpu"):
        return host_target_dict()
    if target.startswith("cuda"):
        arch = target.partition(":")[2] or "sm_90"
        return {"kind": "cuda", "arch": arch}
    raise UserError(f"unknown target {target!r} (use host or cuda[:sm_90])")


def trace_model(model: Any, max_seq: int = DEFAULT_MAX_SEQ, image_grids=None,
                prefill_chunk: int | None = None) -> Frontend:
    """``prefill_chunk``: the longest prefill call of a model with a KV cache (default ``max_seq``); its cache
    still holds ``max_seq`` positions and a longer prompt is prefilled in chunks (runtime ``prefill``)."""
    seq = torch.export.Dim("seq", min=1, max=max_seq)
    if isinstance(model, (str, os.PathLike)) and str(model).endswith(".onnx"):
        from dayzero.frontend.onnx.importer import trace_onnx

        return trace_onnx(model, max_seq)
    if isinstance(model, (str, os.PathLike)) and Path(model).is_dir():
        ckpt = Checkpoint(model)
        from dayzero.frontend import vision
        if vision.is_multimodal(ckpt.config):  # image + text (Qwen3-VL-MoE): frontend/vision.py
            return vision.trace_frontend(ckpt, max_seq, image_grids, Frontend)
        # low-precision experts (quantization_config mxfp4 / fp8) stay in their stored form: see lowprec
        recipes, lowp, missing = learn_recipes_low_precision(ckpt, hf.load_for_recipes)
        for p in lowp.values():
            recipes[p.data_name], recipes[p.scale_name] = list(p.data_runs), list(p.scale_runs)
        check_coverage(ckpt, recipes, missing, hf.meta_model(ckpt)[0])  # before the (slow) trace
        traced, decode, cache_layout = _trace_with_cache(ckpt, max_seq, prefill_chunk or max_seq)
        if traced is None:  # no static cache for this architecture: a stateless prefill only
            module, _ = hf.meta_model(ckpt)
            ep = export_seq_dynamic(hf.CausalLMPrefill(module), "input_ids", max_seq)
            traced = to_graph(ep, symbol_names_from(ep, {"input_ids": {1: "seq"}}), strip_prefix="upstream.")
        # tensors the checkpoint does not hold (non-persistent buffers such as rotary inverse frequencies) come
        # from a CPU model built from the config: only those are kept
        names = {n.attr["name"] for t in (traced, decode) if t is not None for n in t.graph.nodes()
                 if n.op == "weight"}
        names -= set(lowp)
        own = _buffers_from_config(ckpt, names - set(recipes)) if names - set(recipes) else {}
        for t in (traced, decode):
            if t is not None and lowp:
                t.weights = own
                bind_low_precision(t, lowp)
        traced.weights = own
        if decode is not None:
            decode.weights = own
        return Frontend(traced, ckpt, recipes, str(ckpt.config.get("model_type", "")), decode=decode,
                        cache_layout=cache_layout)
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


_SUGGEST_MULT = re.compile(r"^\s*(\w+)\s*=\s*(\d+)\s*\*\s*(\w+)\s*$", re.M)
_SUGGEST_DIM = re.compile(r"^\s*(\w+)\s*=\s*Dim\('\w+'(.*?)\)\s*$", re.M)
_GUARD = re.compile(r"satisfy the generated guard (.*?)\.?$", re.M)


def export_seq_dynamic(module: torch.nn.Module, input_name: str, max_seq: int, attempts: int = 5,
                       with_positions: bool = False, bound_option: str = "--max-seq"):
    """Export ``module(input_ids [1, seq])`` with the widest symbolic ``seq`` torch.export accepts.

    ``with_positions``: the module takes ``(input_ids [1, seq], cache_position [seq])`` (a stateful step).
    ``bound_option``: the CLI option that set ``max_seq``, named in the error when it is too small.

    Some graphs constrain the sequence length: a ``min(topk, seq)`` guard (it holds, but only once seq >= topk
    torch can prove it), or block-compressed attention that needs seq a multiple of its block sizes. What the
    constraint is gets learned from torch.export's constraint-violation report, never from the model's type:
    its suggested fixes (``seq = 8*_seq``, ``Dim('seq', min=16)``), lower bounds in the violated guards
    (``16 <= seq``) and, when a guard gives neither, the integer constants it compares seq with, tried as lower
    bounds one at a time. The compiled program then accepts seq = multiple * k >= lo, and the runtime pads shorter
    or unaligned prompts on the right (a causal LM's earlier logits do not see later tokens) and slices back.
    """
    mult, lo = 1, 1
    tried_consts: set[int] = set()
    last = None
    for _ in range(attempts):
        if mult > 1:
            kmin = max(1, -(-lo // mult))
            if max_seq // mult < kmin:
                raise UserError(f"{bound_option} {max_seq} is below the shortest sequence this model exports at "
                                f"({mult * kmin})")
            seq = mult * torch.export.Dim("seq_blocks", min=kmin, max=max_seq // mult)
            n = mult * max(kmin, min(max_seq // mult, -(-max(lo, 32) // mult)))
        else:
            if lo > max_seq:
                raise UserError(f"{bound_option} {max_seq} is below the shortest sequence this model exports at "
                                f"({lo})")
            seq = torch.export.Dim("seq", min=lo, max=max_seq)
            n = min(max(lo, 32), max_seq)  # well inside the range: short examples take special paths
        if with_positions:
            example = (torch.zeros(1, n, dtype=torch.int64), torch.arange(n))
            dynamic = {input_name: {1: seq}, "cache_position": {0: seq}}
        else:
            example = (torch.zeros(1, n, dtype=torch.int64, device="meta"),)
            dynamic = {input_name: {1: seq}}
        try:
            return export_module(module, example, dynamic)
        except UserError as e:
            cause = e.__cause__
            msg = str(cause) if cause is not None else str(e)
            if "Constraints violated" not in msg:
                raise
            last = e
        new_mult, new_lo = mult, lo
        for _, k, _ in _SUGGEST_MULT.findall(msg):
            new_mult = math.lcm(new_mult, int(k))
        for _, kw in _SUGGEST_DIM.findall(msg):
            m = re.search(r"min\s*=\s*(\d+)", kw)
            if m:
                new_lo = max(new_lo, int(m.group(1)))
        for g in _GUARD.findall(msg):
            m = re.match(r"^\s*(\d+)\s*<=\s*L\[", g)
            if m:
                new_lo = max(new_lo, int(m.group(1)))
        if (new_mult, new_lo) == (mult, lo):
            consts = sorted({int(c) for g in _GUARD.findall(msg) for c in re.findall(r"(?<![\w\[])(\d+)(?![\w\]])", g)
                             if lo < int(c) <= max_seq} - tried_consts)
            if not consts:
                break
            tried_consts.add(consts[0])
            new_lo = consts[0]
        mult, lo = new_mult, new_lo
    raise last if last is not None else UserError("torch.export failed")


def _trace_with_cache(ckpt: Checkpoint, max_seq: int, prefill_chunk: int
                      ) -> tuple[Traced | None, Traced | None, list[dict]]:
    """Prefill and decode as two traces of one stateful step that writes transformers' own static KV cache.

    The cache holds ``max_seq`` positions; the prefill's ``seq`` ranges up to ``prefill_chunk`` only (a longer
    prompt is several prefill calls at increasing positions, each reading the cache the earlier ones wrote), so
    its activations, and the arena, are sized by the chunk.

    The cache tensors become ``state`` nodes (zone kv_cache) shared by both programs; the third value describes
    each (``decode_export.CacheTensor``: layer, layer type, token-position dim, compression rate), which
    ``dayzero report`` turns into KV bytes per token per layer type. Architectures whose cache has no static form
    get (None, None, []): prefill only, see README."""
    from transformers import AutoModelForCausalLM

    from dayzero.frontend.decode_export import CacheStep, describe

    cfg = hf._config(ckpt)
    with hf._quiet():
        cpu = AutoModelForCausalLM.from_config(cfg, experts_implementation=hf.EXPORT_EXPERTS).eval()
    try:
        step = CacheStep(cpu, max_cache_len=max_seq)
    except UserError:
        return None, None, []
    ep = export_seq_dynamic(step, "input_ids", prefill_chunk, with_positions=True,
                            bound_option="--prefill-chunk" if prefill_chunk < max_seq else "--max-seq")
    cache_layout = [asdict(c) for c in describe(ep, step, prefill_chunk).cache]
    names = symbol_names_from(ep, {"input_ids": {1: "seq"}, "cache_position": {0: "seq"}})
    prefill = to_graph(ep, names, strip_prefix="model.")
    with torch.no_grad():
        ep1 = export_module(step, (torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)), None)
    decode = to_graph(ep1, {}, strip_prefix="model.")
    for t in (prefill, decode):  # state names: the step's buffers, without the wrapper prefix
        t.graph = _rename_states(t.graph)
    return prefill, decode, cache_layout


def per_request_states(g: Graph) -> str:
    """Why ``g`` cannot serve several requests in one run: the states it keeps per request slot ("" if none)."""
    names = sorted(n.attr["name"] for n in g.nodes()
                   if n.op == "state" and n.attr.get("zone", "kv_cache") in PER_REQUEST_ZONES)
    return f"states kept per request slot, not paged: {', '.join(names[:4])}" if names else ""


def batched_decode_graph(prefill: Graph, constants: dict, kv_pages: dict, max_batch: int, verify: bool = False
                         ) -> tuple[Graph | None, str]:
    """The batched decode step: one token of each of up to ``max_batch`` requests, as the prefill graph whose S
    tokens are S requests' next tokens (S symbolic, at most ``max_batch`` beyond the prefill's shortest length):
    token s is at its own position (passes/token_positions.py) and reads and writes its own request's KV blocks
    through row s of every block table [S, NT] (passes/paged_kv.py, per-token tables). Every token-wise op (the
    projections, the MoE experts, norms, RoPE) then reads each weight once per step for all the requests.

    Returns (graph, "") or (None, why) when the model's step is not per-token: a state kept per request slot
    (DeepSeek-V4's compressed entries, pending ring and overlap; a cache that did not page), or a read of the
    first position other than through the cache."""
    import sympy

    from dayzero.passes.token_positions import first_position_reads

    if len(prefill.symbols) != 1:
        return None, f"the prefill has symbols {[s for s, _, _ in prefill.symbols]}, not one sequence length"
    (name, lo, hi), = prefill.symbols
    length = sympy.sympify(prefill.inputs[0].shape[-1], strict=True)  # input_ids [1, seq] (or a linear form of it)
    top = lo  # the smallest bound whose length holds max_batch tokens
    while top < hi and int(length.subs({x: top for x in length.free_symbols})) < max_batch:
        top += 1
    g = prefill.replace(symbols=((name, lo, top),))
    ctx = PassContext(constants=constants, kv_pages=dict(kv_pages), token_positions=True)
    g = run_pipeline(g, ctx, verify=verify)
    why = per_request_states(g)
    if why:
        return None, why
    if first_position_reads(g):
        return None, "the step reads the first token's position outside the cache ops"
    if not any(n.op == "input" and n.attr["name"].startswith("block_table") for n in g.inputs):
        return None, "no paged KV cache"
    return g, ""


def _rename_states(g: Graph) -> Graph:
    from dayzero.passes.ir.node import rewrite

    return rewrite(g, lambda n: n.replace(attrs=dict(n.attr, name=n.attr["name"].removeprefix("model.")))
                   if n.op == "state" else None)


def _buffers_from_config(ckpt: Checkpoint, names: set[str]) -> dict[str, torch.Tensor]:
    """The tensors the model reads that no checkpoint tensor fills: only non-persistent buffers (rotary inv_freq)
    or what transformers lets a checkpoint omit get here (``check_coverage`` rejected the rest)."""
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


def optimize(fe: Frontend, verify: bool = False, dump_dir=None, kv_pages: dict | None = None
             ) -> tuple[Graph, PassContext]:
    ctx = PassContext(kv_pages=kv_pages)
    g = run_pipeline(fe.traced.graph, ctx, verify=verify, dump_dir=dump_dir)
    return g, ctx


def plan_memory(prog: Program) -> dict:
    """The memory plan of a single program (see ``codegen/memory.py`` for the layout of several)."""
    return plan_programs([prog])["programs"][prog.name]


def weights_manifest(fe: Frontend, graphs: list[Graph], ctx: PassContext) -> tuple[dict, dict[str, torch.Tensor]]:
    """name -> where its bytes come from; plus the tensors the artifact must carry itself."""
    entries, own = {}, {}
    for n in (n for g in graphs for n in g.nodes()):
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
                                  "keys": {k: v.file for k, v in sorted(ck.tensors.items())},
                                  "tensors": bound_tensors(ck, fe.recipes)}
    return manifest, own


def tune_program(prog: Program, target: dict, db, trials: int, minutes: float | None) -> int:
    """Tune the program's tunable kernels that have no record, with a rich progress bar on stderr."""
    import logging

    import tvm
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if trials < 1:
        raise UserError("--tune needs at least 1 trial")
    logging.getLogger("tvm.s_tir.meta_schedule").setLevel(logging.WARNING)
    symbols = {s: (lo, hi) for s, lo, hi in prog.symbols}
    with Progress(TextColumn("tuning {task.fields[kernel]}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("best {task.fields[best]}"), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("tune", total=trials, kernel="", best="-")

        def progress(kernel, n, best):
            bar.update(task, completed=min(n, trials), kernel=kernel,
                       best=f"{best * 1e6:.1f} us" if best else "-")
        done = tune_kernels(list(prog.kernels.values()), tvm.target.Target(target), db, symbols, trials, minutes,
                            progress)
    return len(done)


def resolve_compute_dtype(compute_dtype: str | None, target: dict) -> str:
    """The dtype low-precision experts are computed in: given (fp32 | bf16 | fp8_e4m3, or a target spec name /
    path whose ``compute_dtype`` is taken), else the compile target's own (the host CPU: fp32)."""
    from dayzero.targets.spec import COMPUTE_DTYPES, HOST_COMPUTE_DTYPE, load_target_spec

    if compute_dtype is None:
        return HOST_COMPUTE_DTYPE
    if compute_dtype in COMPUTE_DTYPES:
        return compute_dtype
    try:
        return load_target_spec(compute_dtype).compute_dtype
    except UserError as e:
        raise UserError(f"--compute-dtype {compute_dtype!r} is neither one of {', '.join(COMPUTE_DTYPES)} nor a "
                        f"usable target spec ({e})") from None


def route_experts(g: Graph, ctx: PassContext, route: str, experts: dict, verify: bool = False) -> Graph:
    """A program's MXFP4 experts on ``route`` (passes/expert_workspace.route_for): the workspace or the fused one."""
    from dayzero.passes import expert_workspace as ew

    if route != "workspace":
        return g
    g = ew.expert_workspace(g, ctx, compute_dtype=ew.compute_dtype_of(experts["compute_dtype"]),
                            cache_bytes=experts["cache_bytes"])
    if verify:
        from dayzero.passes.ir.verify import verify as verify_graph
        verify_graph(g)
    return g


def compile_model(model, out, target: str | dict = "host", max_seq: int = DEFAULT_MAX_SEQ,
                  verify: bool = False, tune: int | None = None, tune_minutes: float | None = None,
                  tuning_dir: str | None = None, max_batch: int = 4, image_grids=None,
                  compute_dtype: str | None = None, expert_route: str = "auto", expert_cache_bytes: int = 0,
                  kv_block_size: int = DEFAULT_KV_BLOCK, kv_blocks: int | None = None,
                  allow_nonfinite: bool = False, prefill_chunk: int | None = None) -> dict:
    """Compile MODEL into the artifact directory OUT; returns the report.

    ``prefill_chunk`` tokens at most per prefill call (default ``min(max_seq, 512)``) of a model whose KV cache
    dayzero owns: the runtime prefills a longer prompt chunk by chunk, and the arena is sized by the chunk.

    ``kv_block_size`` tokens per KV-cache block (0: one contiguous cache per request slot) and ``kv_blocks``
    blocks per pool (default: ``max_batch`` requests of ``max_seq`` tokens, plus the scratch block); see
    passes/paged_kv.py.

    ``compute_dtype`` (fp32 | bf16 | fp8_e4m3 | a target spec), ``expert_route`` (auto | fused | workspace) and
    ``expert_cache_bytes`` (LRU budget of converted experts) choose how MXFP4 experts run (expert_workspace).

    A checkpoint float weight holding NaN/Inf is an error unless ``allow_nonfinite`` (recorded in the artifact:
    the runtime then skips its own finiteness check of the bound weights)."""
    times = {}
    tgt = resolve_target(target)
    experts = {"compute_dtype": resolve_compute_dtype(compute_dtype, tgt), "route": expert_route,
               "cache_bytes": int(expert_cache_bytes)}
    from dayzero.passes import expert_workspace as ew
    route = ew.route_for(compute_dtype=ew.compute_dtype_of(experts["compute_dtype"]),
                         cache_bytes=experts["cache_bytes"], route=expert_route, target_kind=tgt.get("kind", "llvm"))
    if max_batch < 1:
        raise UserError("--max-batch must be at least 1")
    if kv_block_size < 0:
        raise UserError("--kv-block-size must be >= 0 (0: contiguous caches)")
    if kv_blocks is not None and kv_blocks < 2:
        raise UserError("--kv-blocks must be at least 2 (block 0 is the scratch block)")
    if prefill_chunk is not None and not 1 <= prefill_chunk <= max_seq:
        raise UserError(f"--prefill-chunk must be in [1, --max-seq={max_seq}], got {prefill_chunk}")
    prefill_chunk = prefill_chunk or min(max_seq, DEFAULT_PREFILL_CHUNK)
    writer = artifact.ArtifactWriter(out)  # refuses an OUT that is not a previous artifact before any work
    t0 = time.perf_counter()
    fe = trace_model(model, max_seq, image_grids=image_grids, prefill_chunk=prefill_chunk)
    if fe.checkpoint is not None and not allow_nonfinite:
        bad = first_nonfinite(fe.checkpoint, {k for runs in fe.recipes.values() for _, k, _, _ in runs})
        if bad is not None:
            raise UserError(bad)
    times["trace_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    kv_pages = ({"block_size": kv_block_size, "blocks": kv_blocks, "max_batch": max_batch}
                if fe.decode is not None and kv_block_size else None)
    g, ctx = optimize(fe, verify=verify, kv_pages=kv_pages)
    g = route_experts(g, ctx, route, experts, verify)
    shared: dict = {}
    prog = build_program(g, "prefill", shared)  # raises UnsupportedOpsError before anything is written
    progs = [prog]
    graphs = [g]
    if fe.decode is not None:
        dctx = PassContext(constants=ctx.constants, kv_pages=kv_pages)
        gd = route_experts(run_pipeline(fe.decode.graph, dctx, verify=verify), dctx, route, experts, verify)
        progs.append(build_program(gd, "decode", shared))
        graphs.append(gd)
    batched = None
    if fe.decode is not None and kv_pages and fe.multimodal is None:
        why = per_request_states(gd)  # the decode step's own states already tell (DeepSeek-V4): no second pipeline
        gb, why = (None, why) if why else batched_decode_graph(fe.traced.graph, ctx.constants, kv_pages,
                                                                max_batch, verify)
        if gb is not None:
            gb = route_experts(gb, PassContext(constants=ctx.constants), route, experts, verify)
            progs.append(build_program(gb, "decode_batch", shared))
            graphs.append(gb)
        batched = {"built": gb is not None, "reason": why or None}
    for name, t in fe.extra.items():  # vision programs of a multimodal checkpoint, one per image grid
        gx = run_pipeline(t.graph, PassContext(constants=ctx.constants), verify=verify)
        progs.append(build_program(gx, name, shared))
        graphs.append(gx)
    times["passes_s"] = time.perf_counter() - t0
    states: dict[str, tuple] = {}  # a state is one tensor shared by the programs: the same zone and shape in each
    for p in progs:
        for b in p.buffers:
            if b.state is not None and b.alias_of is None:
                seen = states.setdefault(b.state, (b.zone, tuple(b.shape), p.name))
                if seen[:2] != (b.zone, tuple(b.shape)):
                    raise InternalError(f"state {b.state} is {seen[0]}{list(seen[1])} in {seen[2]} but "
                                        f"{b.zone}{list(b.shape)} in {p.name}")
    db = tuning.TuningDatabase(tuning_dir)
    if tune:
        t0 = time.perf_counter()
        times["tuned_kernels"] = tune_program(prog, tgt, db, tune, tune_minutes)
        times["tune_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    lib, build_stats = build_library(progs, tgt, db)
    times["codegen_s"] = time.perf_counter() - t0
    layout = plan_programs(progs, slots=max_batch if fe.decode is not None else 1)
    manifest, own = weights_manifest(fe, graphs, ctx)
    manifest["allow_nonfinite"] = bool(allow_nonfinite)
    report = {
        "format": artifact.FORMAT,
        "model_type": fe.model_type,
        "target": tgt,
        "programs": {p.name: {"steps": len(p.steps), "kernels": len(p.kernels),
                              "memory": {k: v for k, v in layout["programs"][p.name].items() if k != "offsets"}}
                     for p in progs},
        "routes": {k.name: k.route for p in progs for k in p.kernels.values()},
        "tuned": {k.name: k.tuned for p in progs for k in p.kernels.values() if k.tuned},
        "kernel_ops": {k.name: k.op for p in progs for k in p.kernels.values()},
        "patterns": dict(ctx.patterns),
        "experts": dict(experts, routes={p.name: sorted({k.op for k in p.kernels.values()
                                                         if k.op.startswith("moe_experts_mxfp4")}) for p in progs}),
        "unsupported": [],
        "build": build_stats,
        "kv_cache_layout": fe.cache_layout,
        "kv_pages": (kv_pages or {}).get("resolved"),
        "allow_nonfinite": bool(allow_nonfinite),
        "decode_batch": batched,
    }
    pjs = {}
    for p in progs:
        mem = layout["programs"][p.name]
        pjs[p.name] = program_json(p)
        pjs[p.name]["memory"] = {"arena_bytes": layout["arena_bytes"], "zones": mem["zones"],
                                 "offsets": {str(k): v for k, v in mem["offsets"].items()},
                                 "state_slots": layout["state_slots"], "state_stride": layout["state_stride"]}
    with writer as d:
        lib.export_library(str(d / "kernels.so"))
        artifact.write_json(d / "program.json", {"format": artifact.FORMAT, "target": tgt, "programs": pjs,
                                                 "kv_pages": report["kv_pages"],
                                                 "max_seq": max_seq if fe.decode is not None else None})
        artifact.write_json(d / "weights.json", manifest)
        artifact.save_tensors(d / "weights.safetensors", own)
        (d / "final.ir").write_text(print_graph(g))
        if fe.checkpoint is not None:  # text in, text out: the checkpoint's tokenizer (runtime/text.py)
            from dayzero.runtime.text import TOKENIZER_DIR, carry_tokenizer

            report["tokenizer"] = carry_tokenizer(fe.checkpoint.dir, d / TOKENIZER_DIR)
        artifact.write_json(d / "report.json", report)
        if fe.multimodal is not None:
            artifact.write_json(d / "multimodal.json", fe.multimodal)
    report["seconds"] = times
    return report
