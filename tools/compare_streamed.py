"""``dayzero compare --streamed``: layer by layer against an upstream model that does not fit in memory.

gpt-oss-20b in fp32 is ~84 GB: the upstream reference cannot be built whole. The streamed comparison

    compiled prefill, observed ──► hidden state after the embedding and after every decoder layer, logits
    (then the runtime is released)
    upstream on ``meta`` ──► its own forward, each streamed module (embedding, one decoder layer, lm_head)
                             materialised from the checkpoint only while it runs (frontend/reference.py)
        decoder layer i runs twice: (a) on the hidden state the *compiled* layer i-1 produced -> layer i's own
        error ("local"), (b) on upstream's own hidden state -> the accumulated error ("chain")
        lm_head runs on upstream's final norm of the compiled last hidden state (local) and of its own (chain)

reports each layer's local and chain errors, the first layer whose local error is outside tolerance (the first
divergence), and the logits. The compiled hidden state after a layer is the output of the last step traced from
that layer (its residual add): the steps carry the upstream module path they were traced from. A model whose
compiled layer output does not have the shape upstream's decoder layer returns is refused (one line naming both),
as is DeepSeek-V4 up front: its layers carry ``hc_mult`` residual streams (hyper-connections) that only the head
collapses.

Peak memory: the largest streamed module in fp32 (gpt-oss-20b: a decoder layer, ~3.2 GB; the 201088-row
embedding, ~2.3 GB) plus upstream's small modules (norms, rotary), never the model.
"""

from __future__ import annotations

import contextlib
import gc
import re

import torch

from dayzero import UserError
from dayzero.tools.compare import (ATOL, _LAYER, _artifact, _from_empty_cache, _prefill_program, diff,
                                   fixed_inputs)

FP32_BYTES = 4
LOADER_OVERHEAD = 1.5  # transformers' loader holds transient copies while it converts (dequantises, fuses)
_NODE = re.compile(r"^(?P<op>\S+) at (?P<module>[^ ]*)")


def reference_bytes(model_dir) -> int:
    """Estimated peak memory of the whole upstream reference in fp32, from config.json alone: its parameters
    (the model built on ``meta``) x 4 bytes x the loader's overhead."""
    from transformers import AutoModelForCausalLM

    from dayzero.frontend import hf

    cfg = hf.config_at(model_dir)
    try:
        with hf._quiet(), torch.device("meta"):
            module = AutoModelForCausalLM.from_config(cfg)
    except (ValueError, KeyError) as e:
        raise UserError(f"{model_dir}: transformers cannot build its model: {str(e).splitlines()[0]}") from None
    return int(sum(p.numel() for p in module.parameters()) * FP32_BYTES * LOADER_OVERHEAD)


def needs_streaming(model_dir, available: int | None = None) -> bool:
    """Whether the upstream fp32 reference would not fit in the memory available now."""
    import psutil

    avail = psutil.virtual_memory().available if available is None else available
    return reference_bytes(model_dir) > avail


def _observed_states(steps) -> tuple[int, dict[str, int]]:
    """(step of the embedding's output, {decoder layer path: step of its output}) from the steps' module paths:
    the last step traced from each ``...layers.N`` itself with an output (the layer's own residual arithmetic: a
    submodule's step may come later, such as DeepSeek-V4's compressor writing its state to the cache at the end of
    the program), else the last step traced from inside it; and the last embedding step before layer 0."""
    inside: dict[str, int] = {}
    own: dict[str, int] = {}
    first_layer, embed = None, None
    for k, st in enumerate(steps):
        m = _NODE.match(st["node"])
        if m is None or not st["outputs"]:
            continue
        lm = _LAYER.match(m.group("module"))
        if lm:
            inside[lm.group(1)] = k
            if m.group("module") == lm.group(1):
                own[lm.group(1)] = k
            first_layer = k if first_layer is None else first_layer
        elif m.group("op") == "embedding" and first_layer is None:
            embed = k
    layers = {name: own.get(name, k) for name, k in inside.items()}
    if embed is None or not layers:
        raise UserError("streamed compare needs a decoder-layer model: the program has no embedding step followed "
                        "by steps traced from model layers (...layers.N)")
    return embed, layers


def run_compiled(artifact, seq_len: int | None):
    """The compiled prefill on compare's fixed-seed input -> (token ids, embedding output, {layer: hidden},
    logits, facts about the run)."""
    art, rt = _artifact(artifact)
    if getattr(rt, "multimodal", None) is not None:
        raise UserError(f"{artifact}: streamed compare covers text decoder models; compare a multimodal artifact "
                        "without --streamed")
    pname, prog, pj, _, seq = _prefill_program(rt, seq_len)
    inputs = _from_empty_cache(rt, prog, pj, fixed_inputs(pj, seq))
    embed, layers = _observed_states(pj["steps"])
    want = {embed: "embedding", **{k: name for name, k in layers.items()}}
    seen: dict[str, torch.Tensor] = {}

    def observe(k, node, views):
        if k in want:  # in fp32, as upstream's modules take it (a bf16 table's embedding gathers bf16 rows)
            seen[want[k]] = views[0].to(torch.float32, copy=True)
    with torch.no_grad():
        logits = prog.run(inputs, observe=observe)[0].clone()
    facts = {"artifact": str(art.resolve()), "program": pname, "seq_len": seq,
             "input_shapes": [list(t.shape) for t in inputs]}
    ids = inputs[0].clone()
    del rt, prog
    gc.collect()
    return ids, seen.pop("embedding"), {n: seen[n] for n in layers}, logits, facts


class _Stream:
    """Hooks that materialise a module for its forward and put it back on ``meta`` after."""

    def __init__(self, up):
        self.up = up
        self.open: dict[str, contextlib.AbstractContextManager] = {}
        self.handles = []

    def add(self, name: str, after=None):
        mod = self.up.model.get_submodule(name)

        def pre(_m, _args):
            ctx = self.up.materialised(name)
            ctx.__enter__()
            self.open[name] = ctx

        def post(m, args, kwargs, output):
            try:
                if after is not None:
                    after(m, args, kwargs, output)
            finally:
                self.open.pop(name).__exit__(None, None, None)
        self.handles.append(mod.register_forward_pre_hook(pre))
        self.handles.append(mod.register_forward_hook(post, with_kwargs=True))

    def close(self):
        for h in self.handles:
            h.remove()
        for ctx in self.open.values():
            ctx.__exit__(None, None, None)


def _hidden(out) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def _as_layer_input(name: str, mine: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor:
    """The compiled state MINE as layer NAME's input, shaped as upstream gave it THEIRS: the same, or (the first
    layer of a model with hyper-connections) the embedding copied into each of the residual streams upstream's model
    makes of it (DeepSeek-V4: ``inputs_embeds.unsqueeze(2).expand(-1, -1, hc_mult, -1)``). The stream axis is the one
    along which THEIRS holds copies: the shapes alone are ambiguous when the sequence is as long as the streams are
    many ([1, 4, 4, H] from [1, 4, H])."""
    if mine.shape == theirs.shape:
        return mine
    for d in range(theirs.dim()):
        if (mine.dim() + 1 == theirs.dim() and tuple(mine.shape) == theirs.shape[:d] + theirs.shape[d + 1:]
                and torch.equal(theirs, theirs.narrow(d, 0, 1).expand(theirs.shape))):
            return mine.unsqueeze(d).expand(theirs.shape).contiguous()
    raise UserError(f"{name}: the compiled state before it is {list(mine.shape)}, upstream's decoder layer takes "
                    f"{list(theirs.shape)}; compare without --streamed")


def _path(model, module) -> str:
    return next(n for n, m in model.named_modules() if m is module)


def compare_streamed(model, artifact, seq_len: int | None = None, atol: float = ATOL, rtol: float = 0.0) -> dict:
    """See the module docstring. MODEL is the checkpoint directory the artifact was compiled from."""
    from dayzero.frontend import hf
    from dayzero.frontend.reference import StreamedUpstream

    ids, dz_embed, dz_layers, dz_logits, facts = run_compiled(artifact, seq_len)
    up = StreamedUpstream(model)
    um = up.model
    emb_name = _path(um, um.get_input_embeddings())
    head_name = _path(um, um.get_output_embeddings())
    names = list(dz_layers)
    missing = [n for n in names if n not in dict(um.named_modules())]
    if missing:
        raise UserError(f"{artifact}: steps traced from {missing[0]}, which upstream's model does not have "
                        f"(recompile from {model})")
    streamed = [emb_name, head_name, *names]
    # every other module owning tensors (final norm, rotary embedding) stays materialised for the whole run
    rest = sorted({n.rpartition(".")[0] for n, _ in [*um.named_parameters(), *um.named_buffers()]
                   if not any(n.startswith(s + ".") for s in streamed)})
    prev = dict(zip(names, [dz_embed, *dz_layers.values()]))
    got: dict[str, dict] = {}
    norm = um.base_model.norm if hasattr(um.base_model, "norm") else None
    collapse = getattr(um.base_model, "hc_head", None)  # hyper-connections: the streams -> one, before the norm

    def on_embed(_m, _args, _kwargs, out):
        got[emb_name] = {"chain": out.detach().clone()}

    def on_layer(name):
        def after(m, args, kwargs, out):
            own = _hidden(out)
            if tuple(dz_layers[name].shape) != tuple(own.shape):
                raise UserError(f"{name}: the compiled layer's output is {list(dz_layers[name].shape)}, upstream's "
                                f"decoder layer returns {list(own.shape)}; compare without --streamed")
            mine = _as_layer_input(name, prev[name], args[0] if args else kwargs["hidden_states"])
            if args:
                local = m.forward(mine, *args[1:], **kwargs)
            else:
                local = m.forward(**dict(kwargs, hidden_states=mine))
            got[name] = {"chain": own.detach().clone(), "local": _hidden(local).detach().clone()}
        return after

    def on_head(m, args, _kwargs, out):
        last = dz_layers[names[-1]]
        x = collapse(last) if collapse is not None else last
        x = norm(x) if norm is not None else x
        got[head_name] = {"chain": out.detach().clone(), "local": m.forward(x).detach().clone()}

    stream = _Stream(up)
    stream.add(emb_name, on_embed)
    for n in names:
        stream.add(n, on_layer(n))
    stream.add(head_name, on_head)
    try:
        with torch.no_grad(), up.materialised(*rest):
            um(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    finally:
        stream.close()
    if set(got) != {emb_name, head_name, *names}:
        raise UserError(f"{model}: upstream's forward did not run {sorted(set(streamed) - set(got))[:3]}")

    rows = []
    e = diff(dz_embed, got[emb_name]["chain"], atol, rtol)
    rows.append({"layer": emb_name, "max_abs_diff": e["abs"], "max_rel_diff": e["rel"], "bad": e["bad"],
                 "chain_max_abs_diff": e["abs"], "chain_bad": e["bad"]})
    for n in names:
        loc = diff(dz_layers[n], got[n]["local"], atol, rtol)
        ch = diff(dz_layers[n], got[n]["chain"], atol, rtol)
        rows.append({"layer": n, "max_abs_diff": loc["abs"], "max_rel_diff": loc["rel"], "bad": loc["bad"],
                     "chain_max_abs_diff": ch["abs"], "chain_bad": ch["bad"]})
    loc = diff(dz_logits, got[head_name]["local"], atol, rtol)
    ch = diff(dz_logits, got[head_name]["chain"], atol, rtol)
    rows.append({"layer": head_name, "max_abs_diff": loc["abs"], "max_rel_diff": loc["rel"], "bad": loc["bad"],
                 "chain_max_abs_diff": ch["abs"], "chain_bad": ch["bad"]})
    for r in rows:
        r["ok"] = r.pop("bad") == 0
        r["chain_ok"] = r.pop("chain_bad") == 0
    first = next((r for r in rows if not r["ok"]), None)
    top1 = float((dz_logits.argmax(-1) == got[head_name]["chain"].argmax(-1)).float().mean())
    res = {"model": str(model), **facts, "mode": "streamed", "atol": atol, "rtol": rtol,
           "params": up.param_count(), "max_abs_diff": ch["abs"], "max_rel_diff": ch["rel"],
           "logits_ok": ch["bad"] == 0, "top1_agreement": top1, "layers": rows,
           "first_divergence": None if first is None else {"layer": first["layer"],
                                                           "abs_diff": first["max_abs_diff"],
                                                           "rel_diff": first["max_rel_diff"]}}
    res["ok"] = first is None and res["logits_ok"]
    return res


def human(r: dict, echo) -> None:
    echo(f"{r['model']} vs {r['artifact']} ({r['program']}, seq {r['seq_len']}, streamed: upstream one module at a "
         f"time, {r['params'] / 1e9:.2f} B params, atol {r['atol']:g}" + (f", rtol {r['rtol']:g}" if r["rtol"] else "")
         + ")")
    echo(f"logits (upstream end to end): max abs diff {r['max_abs_diff']:.3g}, max rel diff {r['max_rel_diff']:.3g}, "
         f"top-1 agreement {r['top1_agreement']:.0%}  ({'ok' if r['logits_ok'] else 'OUTSIDE TOLERANCE'})")
    echo(f"  {'module':<32} {'own input: max abs':>19} {'rel':>9}   {'upstream chain: max abs':>23}")
    for e in r["layers"]:
        echo(f"  {e['layer']:<32} {e['max_abs_diff']:19.3g} {e['max_rel_diff']:9.3g} "
             f"{'ok ' if e['ok'] else 'BAD'}  {e['chain_max_abs_diff']:21.3g} {'ok' if e['chain_ok'] else 'BAD'}")
    fd = r["first_divergence"]
    echo("first divergence: none" if fd is None else
         f"first divergence: {fd['layer']} on the compiled previous layer's output, abs diff {fd['abs_diff']:.3g}")
    echo("ok" if r["ok"] else "MISMATCH")
