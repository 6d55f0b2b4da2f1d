"""The frontend's entry point: MODEL -> ``Frontend`` (the traced programs, the checkpoint and its recipes).

MODEL is a checkpoint directory (config.json + safetensors), ``module.path:factory`` (a callable returning
``(nn.Module, example_inputs)``), an ``(nn.Module, example_inputs)`` pair from Python, or a ``model.onnx`` path.
A checkpoint whose model has a static KV cache is traced twice (prefill, decode: ``_trace_with_cache``); a
multimodal one goes through frontend/vision.py, an ONNX file through frontend/onnx/.
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from dayzero import InternalError, UserError
from dayzero.frontend import hf
from dayzero.frontend.checkpoint import Checkpoint, check_coverage, learn_recipes_low_precision
from dayzero.frontend.lowprec import bf16_weights, bind_bf16, bind_low_precision
from dayzero.frontend.trace_cache import cache_root, cached, cached_graph
from dayzero.frontend.torch_export import Traced, export_module, symbol_names_from, to_graph
from dayzero.passes.ir.node import Graph, rewrite

DEFAULT_MAX_SEQ = 512

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
    # DeepSeek-V4's batched decode step (decode_export.RowDecodeStep): batch row b is request b, its states
    # passed in and returned (inputs / outputs named after the states); None for every other architecture
    decode_rows: Traced | None = None
    decode_rows_error: str = ""  # why it did not trace (the compile goes on without a batched decode program)



def trace_model(model: Any, max_seq: int = DEFAULT_MAX_SEQ, image_grids=None,
                prefill_chunk: int | None = None, trace_cache: str | None = None, max_batch: int = 0) -> Frontend:
    """``prefill_chunk``: the longest prefill call of a model with a KV cache (default ``max_seq``); its cache
    still holds ``max_seq`` positions and a longer prompt is prefilled in chunks (runtime ``prefill``).
    ``max_batch`` (> 1): also trace DeepSeek-V4's batched decode step for up to that many requests.
    ``trace_cache``: where a checkpoint's traces are kept (frontend/trace_cache.py; None: the default, "off").
    A checkpoint's bf16 matrices read as linear weights / embedding tables stay bf16 (``lowprec.bind_bf16``), on
    one rank or sharded (passes/shard.py slices them as stored)."""
    seq = torch.export.Dim("seq", min=1, max=max_seq)
    if isinstance(model, (str, os.PathLike)) and str(model).endswith(".onnx"):
        from dayzero.frontend.onnx.importer import trace_onnx

        return trace_onnx(model, max_seq)
    if isinstance(model, (str, os.PathLike)) and Path(model).is_dir():
        ckpt = Checkpoint(model)
        from dayzero.frontend import vision
        if vision.is_multimodal(ckpt.config):  # image + text (Qwen3-VL-MoE): frontend/vision.py
            return vision.trace_frontend(ckpt, max_seq, image_grids, Frontend, cache_root(trace_cache))
        # low-precision experts (quantization_config mxfp4 / fp8) stay in their stored form: see lowprec
        recipes, lowp, missing = learn_recipes_low_precision(ckpt, hf.load_for_recipes,
                                                               cache_root(trace_cache))
        for p in lowp.values():
            recipes[p.data_name], recipes[p.scale_name] = list(p.data_runs), list(p.scale_runs)
        check_coverage(ckpt, recipes, missing, hf.meta_model(ckpt)[0])  # before the (slow) trace
        chunk = prefill_chunk or max_seq
        traced, decode, cache_layout = cached(cache_root(trace_cache), ckpt.config,
                                              lambda: _trace_with_cache(ckpt, max_seq, chunk),
                                              max_seq=max_seq, prefill_chunk=chunk)
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
        rows, rows_error = None, ""
        if decode is not None and max_batch > 1 and _has_compressed_cache(ckpt):
            try:
                rows = cached_graph(cache_root(trace_cache), ckpt.config, "decode_rows",
                                    lambda: _trace_rows(ckpt, max_seq, max_batch), max_seq=max_seq,
                                    max_batch=max_batch)
            except UserError as e:  # the artifact still serves, one request per decode call
                rows_error = str(e)
            else:
                rows.weights = own
                if lowp:
                    bind_low_precision(rows, lowp)
        # bf16 projections / embeddings stay bf16 in the arena, as published (lowprec.bind_bf16)
        stored_bf16 = {name for name, runs in recipes.items() if name not in lowp and runs and
                       all(ckpt.tensors[key].dtype == "bfloat16" for _, key, _, _ in runs)}
        programs = [t for t in (traced, decode, rows) if t is not None]
        keep = bf16_weights([t.graph for t in programs], stored_bf16)
        for t in programs:
            bind_bf16(t, keep)
        return Frontend(traced, ckpt, recipes, str(ckpt.config.get("model_type", "")), decode=decode,
                        cache_layout=cache_layout, decode_rows=rows, decode_rows_error=rows_error)
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
    names = [p for p in inspect.signature(module.forward).parameters][:len(example)]
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
    from dayzero.frontend.decode_export import CacheStep, describe

    # on the meta device: no weight (or cache) is allocated, whatever the model's size; the tensors the
    # checkpoint does not hold are computed by _buffers_from_config
    model, _ = hf.meta_model(ckpt)
    try:
        step = CacheStep(model, max_cache_len=max_seq)
    except UserError:
        return None, None, []
    with torch.device("meta"):
        ep = export_seq_dynamic(step, "input_ids", prefill_chunk, with_positions=True,
                                bound_option="--prefill-chunk" if prefill_chunk < max_seq else "--max-seq")
    cache_layout = [asdict(c) for c in describe(ep, step, prefill_chunk).cache]
    names = symbol_names_from(ep, {"input_ids": {1: "seq"}, "cache_position": {0: "seq"}})
    prefill = to_graph(ep, names, strip_prefix="model.")
    with torch.no_grad(), torch.device("meta"):
        ep1 = export_module(step, (torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)), None)
    decode = to_graph(ep1, {}, strip_prefix="model.")
    for t in (prefill, decode):  # state names: the step's buffers, without the wrapper prefix
        t.graph = _rename_states(t.graph)
    return prefill, decode, cache_layout


def _has_compressed_cache(ckpt: Checkpoint) -> bool:
    from dayzero.frontend.v4_cache import is_compressed_cache_config

    module, _ = hf.meta_model(ckpt)
    return is_compressed_cache_config(module.config.get_text_config(decoder=True))


def _trace_rows(ckpt: Checkpoint, max_seq: int, max_batch: int) -> Traced:
    """DeepSeek-V4's batched decode step (``decode_export.RowDecodeStep``) for ``batch`` in [1, max_batch]
    requests: ``(input_ids [batch, 1], positions [batch], <state> [batch, ...]...) -> (logits, <state>...)``,
    the inputs after the first two and the outputs after the logits named after the states
    (``cache_{layer}_{attribute}``, the prefill's and decode's state names)."""
    from dayzero.frontend.decode_export import CacheStep, RowDecodeStep

    model, _ = hf.meta_model(ckpt)
    step = CacheStep(model, max_cache_len=max_seq)
    rows = RowDecodeStep(step)
    # torch.export (2.13) gives every input its own symbol for a Dim bounded [1, 2] with an example of 2, so the
    # states' batch dims stop being the tokens' and no pattern over them matches: export [1, 3], declare [1, 2]
    batch = torch.export.Dim("batch", min=1, max=max(max_batch, 3))
    with torch.device("meta"):
        states = tuple(torch.zeros((2, *shape[1:]), dtype=getattr(step, n).dtype)
                       for (_, _, n), shape in zip(step.names, rows.state_shapes))
        ep = export_module(rows, (torch.zeros(2, 1, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), *states),
                           ({0: batch}, {0: batch}, tuple({0: batch} for _ in states)))
    names = {f"states_{k}": n for k, (_, _, n) in enumerate(step.names)}
    t = to_graph(ep, symbol_names_from(ep, {"input_ids": {0: "batch"}}), strip_prefix="model.")
    t.graph = rewrite(t.graph, lambda n: n.replace(attrs=dict(n.attr, name=names[n.attr["name"]]))
                      if n.op == "input" and n.attr.get("name") in names else None)
    if t.graph.symbols != (("batch", 1, max(max_batch, 3)),):
        raise InternalError(f"the batched decode step traced with symbols {t.graph.symbols}, not one batch dim")
    t.graph = t.graph.replace(symbols=(("batch", 1, max_batch),))
    return t


def _rename_states(g: Graph) -> Graph:
    """State names without the traced wrapper's ``model.`` prefix (the step's own buffer names)."""
    return rewrite(g, lambda n: n.replace(attrs=dict(n.attr, name=n.attr["name"].removeprefix("model.")))
                   if n.op == "state" else None)


def _buffers_from_config(ckpt: Checkpoint, names: set[str]) -> dict[str, torch.Tensor]:
    """The tensors the model reads that no checkpoint tensor fills: only non-persistent buffers (rotary inv_freq)
    or what transformers lets a checkpoint omit get here (``check_coverage`` rejected the rest).

    Only their owning modules are materialised (on CPU, from the meta model) and initialised by the model's own
    ``_init_weights``, as transformers' loader does for what a checkpoint lacks: a full-size model is never
    built. A value that initialisation leaves unset (still NaN) is an error, never garbage."""
    model, _ = hf.meta_model(ckpt)
    known = dict(model.named_parameters())
    known.update(model.named_buffers())
    unknown = sorted(names - set(known))
    if unknown:
        raise UserError(f"{ckpt.dir}: the model reads {', '.join(unknown[:5])}, which neither the checkpoint "
                        "nor the model's own initialisation provides")
    with torch.no_grad(), hf._quiet():
        for owner in sorted({n.rpartition(".")[0] for n in names}):
            mod = model.get_submodule(owner)
            mod.to_empty(device="cpu", recurse=False)
            for t in [*mod.parameters(recurse=False), *mod.buffers(recurse=False)]:
                if t.is_floating_point():
                    t.fill_(float("nan"))
            model._init_weights(mod)
    out = {}
    for n in sorted(names):
        owner, _, leaf = n.rpartition(".")
        t = getattr(model.get_submodule(owner), leaf)
        if t.is_floating_point() and bool(torch.isnan(t).any()):
            raise UserError(f"{ckpt.dir}: the model reads {n}, which the checkpoint lacks and the model's own "
                            "initialisation does not compute")
        out[n] = t.detach().clone()
    return out


def batched_decode_input(prefill: Graph, max_batch: int) -> tuple[Graph | None, str]:
    """The batched decode step before its passes: the prefill graph whose S tokens are S requests' next tokens,
    with S at most ``max_batch`` beyond the prefill's shortest length (the compiler's ``decode_batch`` program).

    Returns (graph, "") or (None, why) when the prefill has not exactly one sequence-length symbol."""
    import sympy

    if len(prefill.symbols) != 1:
        return None, f"the prefill has symbols {[s for s, _, _ in prefill.symbols]}, not one sequence length"
    (name, lo, hi), = prefill.symbols
    length = sympy.sympify(prefill.inputs[0].shape[-1], strict=True)  # input_ids [1, seq] (or a linear form of it)
    top = lo  # the smallest bound whose length holds max_batch tokens
    while top < hi and int(length.subs({x: top for x in length.free_symbols})) < max_batch:
        top += 1
    return prefill.replace(symbols=((name, lo, top),)), ""
