"""``dayzero compare MODEL OUT``: the compiled artifact against the upstream model, and where they part.

    fixed-seed input ──► upstream, eager (checkpoint: transformers; module:factory: the module;
                                          *.onnx: onnx_reference.reference_outputs)
                     ──► reference interpreter on the re-traced IR, upstream's own weights   (the trace check)
                     ──► compiled program, observed after every step ─┐ in lockstep with the interpreter,
                                                                      └ step k <-> k-th compute node
    report: logits max abs / max rel error vs upstream; per decoder layer (nodes grouped by the ``...layers.N``
    prefix of their span's module path) its largest error and first bad node; the first divergence overall
    with its upstream source line; with ``--per-node`` every step.

Localising. The IR is re-traced with the artifact's bound (program.json's symbols) and run through the same
pipeline, so its compute nodes, in ``Graph.nodes()`` order, are the program's steps one for one (checked: each
step records "op at span"). The interpreter reads the *upstream* model's tensors (``state_dict()`` and
``named_buffers()``), not the artifact's, so a corrupted artifact weight shows up at the first node reading it;
tensors upstream does not hold (folded constants, the frontend's computed buffers) come from the frontend or the
artifact's own ``weights.safetensors``. First the interpreter's logits are checked against upstream: if they
differ, the trace itself is wrong and that is what is reported (stage ``trace``).

Top-k ties. With few heads or experts, a router or indexer can score two candidates exactly equally at the k-th
place; torch and a TVM kernel may then pick different ones, and every value downstream legitimately differs.
dayzero makes the comparison meaningful by checking, at each ``topk`` step whose compiled indices differ from
the reference's, whether the compiled choice scores the same under the *reference* scores (|ref score at compiled
index - ref top-k value| <= 1e-6 at every position; in particular the k-th and (k+1)-th reference scores are
equal). If so, it is reported as "tie at <node>", not as a bug, and the interpreter continues with the compiled
choice (indices, and values gathered from the reference scores), so everything after the tie is compared
against a reference that broke the tie the same way. ``ok`` is then true when the tie-aligned comparison is
within tolerance; ``max_abs_diff`` still states the raw difference from upstream.

Ops that allocate without initialising (``empty``...) are not compared: their bytes are garbage on both sides
until a later step writes them. In the lockstep reference their floating outputs are NaN, so every element
derived from uninitialised bytes is NaN there and skipped (only in graphs that have such ops).

Multimodal artifacts (Qwen3-VL-MoE, ``--image PATH``, repeatable). The fixed-seed prompt is one
``<vision_start> <image> <vision_end>`` per image, then ``seq_len`` text ids drawn below the special tokens; the
request is prepared as ``dayzero run --image`` prepares it (runtime/multimodal.py: upstream's image processor,
the compiled vision program, upstream's ``get_rope_index``). Upstream is
``AutoModelForImageTextToText.from_pretrained`` run eagerly on the same processor outputs (pixel values, grids,
expanded ids, mm_token_type_ids). The compiled vision features are first checked against upstream's encoder
(stage ``vision`` when they differ); the prefill is then compared in lockstep as above, fed the compiled features.
Without ``--image`` a multimodal artifact is compared on a text-only prompt the same way.

Tolerance: element-wise ``|compiled - ref| <= atol + rtol * |ref|`` (defaults 1e-4 and 0, i.e. absolute;
``--rtol`` states a relative bound where magnitudes are large). ``max_rel_diff`` is the largest
``|compiled - ref| / |ref|`` over elements with ``|ref| > atol``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import click
import torch

from dayzero import InternalError, UserError

ATOL = 1e-4
TIE_EPS = 1e-6
DEFAULT_SEQ = 16
MAX_OUTSIDE_GROUPS = 12
OUTSIDE = "(outside decoder layers)"
# ops whose output values are undefined (their consumers overwrite them): compared by shape only
UNDEFINED_OPS = {"empty", "empty_like", "new_empty", "empty_strided", "empty_permuted"}
_PLAIN = {torch.float16, torch.bfloat16, torch.float32, torch.float64}
_LAYER = re.compile(r"^(.*?\blayers\.\d+)(?:\.|$)")


# ---- numbers ---------------------------------------------------------------------------------------------------

def diff(out: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float, skip_ref_nan: bool = False) -> dict:
    """``{abs, rel, bad}`` of ``out`` against ``ref``: largest errors and how many elements are outside tolerance.
    A NaN on either side is a mismatch (error inf), even NaN against NaN: NaN weights must not pass as agreement.
    ``skip_ref_nan``: elements where the reference is NaN are undefined (derived from uninitialised memory)."""
    if tuple(out.shape) != tuple(ref.shape):
        return {"abs": float("inf"), "rel": float("inf"), "bad": max(out.numel(), ref.numel(), 1)}
    if out.numel() == 0:
        return {"abs": 0.0, "rel": 0.0, "bad": 0}
    a, b = out.detach().to(torch.float64), ref.detach().to(torch.float64)
    same = a == b  # equal infinities agree; NaN equals nothing
    if skip_ref_nan:
        same |= torch.isnan(b)
    d = torch.where(same, torch.zeros_like(a), (a - b).abs().nan_to_num(nan=float("inf")))
    big = b.abs() > atol
    rel = float((d[big] / b.abs()[big]).max()) if bool(big.any()) else 0.0
    bad = int((d > atol + rtol * b.abs().nan_to_num(nan=0.0, posinf=0.0)).sum())
    return {"abs": float(d.max()), "rel": rel, "bad": bad}


def topk_tie(scores: torch.Tensor, ref_idx: torch.Tensor, out_idx: torch.Tensor, k: int, dim: int,
             largest: bool = True, eps: float = TIE_EPS) -> dict | None:
    """Whether compiled top-k indices that differ from the reference's are only another way of breaking a tie.

    ``scores`` are the reference's top-k input. Returns None when the indices agree or when the compiled choice
    scores differently (a real divergence); else ``{rows, kth_tied}``: how many rows differ, and whether in all of
    them the k-th and (k+1)-th reference scores are equal within ``eps`` (the tie crosses the selection
    boundary; otherwise it is only the order among equally scored selected entries)."""
    if tuple(ref_idx.shape) != tuple(out_idx.shape) or torch.equal(ref_idx, out_idx):
        return None
    n = scores.shape[dim]
    if bool(((out_idx < 0) | (out_idx >= n)).any()):
        return None
    ref_val = scores.gather(dim, ref_idx)
    got = scores.gather(dim, out_idx)
    if not torch.allclose(got.to(torch.float64), ref_val.to(torch.float64), atol=eps, rtol=0.0):
        return None
    picked = out_idx.movedim(dim, -1).reshape(-1, out_idx.shape[dim]).sort(-1).values
    if bool((picked[:, 1:] == picked[:, :-1]).any()):
        return None  # choosing one candidate twice is no tie-break
    rows = (ref_idx != out_idx).movedim(dim, -1).reshape(-1, ref_idx.shape[dim]).any(-1)
    srt = scores.sort(dim, descending=largest).values.movedim(dim, -1).reshape(-1, n)
    kth_tied = bool(k < n and ((srt[rows, k - 1] - srt[rows, k]).abs() <= eps).all())
    return {"rows": int(rows.sum()), "kth_tied": kth_tied}


# ---- the model and its inputs -----------------------------------------------------------------------------------

def _is_batch(d) -> bool:
    return isinstance(d, str) and "batch" in d


def length_bound(pj: dict) -> int:
    """The longest input length the program accepts: its length dimensions at the symbols' upper bounds."""
    from dayzero.passes.ir.shape_expr import dim_at

    hi = {s: h for s, lo, h in pj["symbols"]}
    best = 0
    for bid in pj["inputs"]:
        for d in pj["buffers"][bid]["shape"]:
            if isinstance(d, str) and not _is_batch(d):
                best = max(best, dim_at(d, hi))
    return best or DEFAULT_SEQ


def fixed_inputs(pj: dict, seq_len: int, seed: int = 0) -> list[torch.Tensor]:
    """One tensor per program input, from a fixed seed: token ids uniform over the embedding's rows, floats
    standard normal; every length dimension ``seq_len`` long, a batch dimension at its lower bound."""
    from dayzero.passes.ir.ops import torch_dtype
    from dayzero.passes.ir.shape_expr import dim_at

    lo = {s: low for s, low, h in pj["symbols"]}
    gen = torch.Generator().manual_seed(seed)
    out = []
    for bid in pj["inputs"]:
        b = pj["buffers"][bid]
        shape = [d if isinstance(d, int) else dim_at(d, lo) if _is_batch(d) else seq_len
                 for d in b["shape"]]
        dt = torch_dtype(b["dtype"])
        if dt.is_floating_point:
            out.append(torch.randn(shape, generator=gen).to(dt))
        else:
            low, hi = pj.get("input_ranges", {}).get(b["name"], [0, 2])
            out.append(torch.randint(low, hi, shape, generator=gen).to(dt))
    return out


def _logits(out) -> torch.Tensor:
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)):
        return out[0]
    if isinstance(out, dict):
        return next(iter(out.values()))
    return out


def upstream(model, max_seq: int):
    """``(run(inputs) -> logits, tensors by name or {}, frontend)``; the frontend is the re-trace of MODEL."""
    from dayzero.tools.driver import trace_model

    if isinstance(model, (str, os.PathLike)) and str(model).endswith(".onnx"):
        from dayzero.tools.onnx_reference import reference_outputs

        fe = trace_model(model, max_seq)
        names = [n.attr["name"] for n in fe.traced.graph.inputs]

        def run_onnx(inputs):
            outs = reference_outputs(str(model), {k: v.numpy() for k, v in zip(names, inputs)})
            return torch.as_tensor(outs[0])
        return run_onnx, {}, fe
    if isinstance(model, (str, os.PathLike)) and Path(model).is_dir():
        from dayzero.frontend.hf import load_upstream

        try:
            module = load_upstream(model)
        except ImportError as e:  # e.g. transformers' FP8 loader wants accelerate
            raise UserError(f"{model}: transformers cannot load the upstream reference: {e}") from None
        fe = trace_model(model, max_seq)

        def run_hf(inputs):
            ids = inputs[0]
            return module(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
    else:
        if isinstance(model, str):
            import importlib

            if ":" not in model:
                raise UserError(f"{model}: neither a checkpoint directory, a .onnx file nor module.path:factory")
            mod_name, _, attr = model.partition(":")
            try:
                model = getattr(importlib.import_module(mod_name), attr)()
            except (ImportError, AttributeError) as e:
                raise UserError(f"cannot load {model}: {e}") from None
        if not (isinstance(model, tuple) and len(model) == 2 and isinstance(model[0], torch.nn.Module)):
            raise UserError("a model factory must return (nn.Module, example_inputs)")
        module = model[0].eval()
        fe = trace_model(model, max_seq)

        def run_hf(inputs):
            return _logits(module(*inputs))
    return run_hf, _tensors(module), fe


def _tensors(module) -> dict:
    tensors = dict(module.state_dict())
    tensors.update(module.named_buffers())
    return tensors


def multimodal_request(rt, seq: int, images, seed: int = 0) -> tuple[dict, dict, torch.Tensor]:
    """The fixed-seed request of a multimodal artifact (see the module docstring) -> (program inputs by name,
    upstream's keyword arguments, the compiled vision features at the image tokens [rows, tokens, hidden])."""
    mm = rt.multimodal
    info = mm.info
    special = [info.get(k) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                     "vision_end_token_id")]
    hi = min([int(t) for t in special if t is not None] + [rt.vocab_size or mm.image_token_id])
    text = torch.randint(0, hi, (seq,), generator=torch.Generator().manual_seed(seed)).tolist()
    wrap = [info.get("vision_start_token_id"), mm.image_token_id, info.get("vision_end_token_id")]
    prompt = [int(t) for _ in images for t in wrap if t is not None] + text
    ids, pos, visual, mask, _ = mm.prepare(prompt, images)
    n = ids.shape[1]
    program = {"input_ids": ids, "position_ids": pos, "cache_position": torch.arange(n), "visual": visual,
               "image_mask": mask}
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}
    if images:
        pre = [mm.preprocess(im) for im in images]
        kwargs.update(pixel_values=torch.cat([p for p, _ in pre]), image_grid_thw=torch.tensor([g for _, g in pre]),
                      mm_token_type_ids=mask.to(torch.int32))
    return program, kwargs, visual[:, mask[0] != 0]


def upstream_multimodal(model, max_seq: int, grids):
    """``(module, tensors by name, frontend)`` of a multimodal checkpoint: transformers'
    ``AutoModelForImageTextToText`` (eager) and the re-trace with the artifact's image grids."""
    from transformers import AutoModelForImageTextToText

    from dayzero.frontend.hf import _quiet
    from dayzero.tools.driver import trace_model

    try:
        with _quiet():
            module = AutoModelForImageTextToText.from_pretrained(str(model)).eval()
    except (ImportError, ValueError, OSError) as e:
        raise UserError(f"{model}: transformers cannot load the upstream image-text model: "
                        f"{str(e).splitlines()[0]}") from None
    fe = trace_model(model, max_seq, image_grids=grids)
    return module, _tensors(module), fe


def _upstream_features(module, kwargs: dict) -> torch.Tensor:
    """Upstream's vision encoder on the request's pixel values -> [1 + deepstack, tokens, hidden]."""
    out = module.model.visual(kwargs["pixel_values"], grid_thw=kwargs["image_grid_thw"], return_dict=True)
    return torch.stack([out.pooler_output, *out.deepstack_features])


# ---- the comparison ---------------------------------------------------------------------------------------------

def _where(n) -> dict:
    m = _LAYER.match(n.span.module or "")
    return {"op": n.op, "layer": m.group(1) if m else None, "module": n.span.module, "source": n.span.source}


def _artifact(artifact):
    from dayzero.runtime import load

    art = Path(artifact)
    if not (art / "program.json").is_file():
        raise UserError(f"{artifact}: not a dayzero artifact (no program.json)")
    return art, load(art)


def _prefill_program(rt, seq_len: int | None):
    """(name, program, its program.json, longest input, compared length): a stateful artifact (prefill + decode
    sharing a KV cache) is compared on its prefill."""
    pname = "prefill" if "prefill" in rt.programs else next(iter(rt.programs))
    pj = rt.program_json["programs"][pname]
    max_seq = length_bound(pj)
    if seq_len is not None and not 1 <= seq_len <= max_seq:
        raise UserError(f"--seq-len {seq_len} is outside the artifact's range [1, {max_seq}]")
    return pname, rt.programs[pname], pj, max_seq, min(seq_len or DEFAULT_SEQ, max_seq)


def _from_empty_cache(rt, prog, pj, inputs: list) -> list:
    """The program's inputs for a prefill from an empty cache: padded where the program pads, paged caches given
    blocks 1, 2, ... in order, positions from 0."""
    if hasattr(prog, "pad"):  # a length the program does not take (seq = 8*k, seq >= 4) runs padded, on all sides
        inputs, _ = prog.pad(inputs)
    if rt.kv is not None:
        rt.kv.ensure(0, inputs[0].shape[-1])
    for k, bid in enumerate(pj["inputs"]):
        if pj["buffers"][bid]["name"] == "cache_position":
            inputs[k] = torch.arange(inputs[k].shape[0], dtype=inputs[k].dtype)
        if pj["buffers"][bid]["name"] in prog.table_inputs:
            inputs[k] = rt.kv.table(pj["buffers"][bid]["name"], 0).clone()
    return inputs


def compare(model, artifact, seq_len: int | None = None, atol: float = ATOL, rtol: float = 0.0,
            per_node: bool = False, images=()) -> dict:
    """Compare MODEL's upstream forward with the compiled ARTIFACT; see the module docstring. ``images`` (paths,
    PIL images, arrays) join the prompt of a multimodal artifact."""
    from dayzero.passes.ir import ops
    from dayzero.passes.ir.interp import infer_env, run_graph
    from dayzero.passes.ir.ops import torch_dtype
    from dayzero.tools.driver import optimize

    art, rt = _artifact(artifact)
    images = list(images or ())
    mm = getattr(rt, "multimodal", None)
    if images and mm is None:
        raise UserError(f"{artifact}: no vision program, so --image cannot be compared (compile a multimodal "
                        f"checkpoint, e.g. Qwen3-VL-MoE, to compare images)")
    pname, prog, pj, max_seq, seq = _prefill_program(rt, seq_len)
    inputs = fixed_inputs(pj, seq)
    if mm is not None:  # the request as the runtime prepares it (image tokens, 3D positions, vision features)
        request, up_kwargs, features = multimodal_request(rt, seq, images)
        inputs = [request.get(pj["buffers"][bid]["name"], t) for bid, t in zip(pj["inputs"], inputs)]
    inputs = _from_empty_cache(rt, prog, pj, inputs)
    pages = rt.program_json.get("kv_pages")

    if mm is not None:
        module, tensors, fe = upstream_multimodal(model, max_seq, mm.info["grids"])

        def run_upstream(_inputs):  # upstream takes its own arguments (pixel values, grids), not the program's
            return module(**up_kwargs)
    else:
        run_upstream, tensors, fe = upstream(model, max_seq)
    tensors.update(fe.traced.weights)
    g, _ = optimize(fe, kv_pages=dict(pages) if pages else None)
    compute = [n for n in g.nodes() if n.op not in ("input", "weight", "state") and not ops.get(n.op).view]
    steps = pj["steps"]
    for k, (n, st) in enumerate(zip(compute, steps)):
        if st["node"] != f"{n.op} at {n.span}":
            raise UserError(f"{artifact} was not compiled from this model by this dayzero: step {k} is "
                            f"{st['node']!r}, the re-trace gives '{n.op} at {n.span}' (recompile it)")
    if len(compute) != len(steps):
        raise UserError(f"{artifact}: {len(steps)} steps, the re-trace of the model gives {len(compute)} (recompile)")

    # weights: upstream's own tensors first, the artifact's bound copy only for what upstream does not hold
    wbid = {b["weight"]: b["id"] for b in pj["buffers"] if b.get("weight") and b.get("alias_of") is None}
    wnode = {n.attr["name"]: n for n in g.nodes() if n.op == "weight"}
    snode = {n.attr["name"]: n for n in g.nodes() if n.op == "state"}  # a KV cache: empty (zeros) at the start
    source = {"upstream": 0, "artifact": 0}

    def weight(name: str) -> torch.Tensor:
        if name in snode:  # a fresh empty cache for each run (the interpreter writes it in place)
            return torch.zeros(snode[name].shape, dtype=torch_dtype(snode[name].dtype))
        n = wnode[name]
        t = tensors.get(name)
        # upstream's tensor only where it holds the same numbers: a loader that dequantised an FP8/MXFP4 weight
        # has the same name and shape but not the stored values the IR dequantises itself
        want = torch_dtype(n.dtype)
        if t is not None and t.numel() == _numel(n.shape) and (t.dtype == want or {t.dtype, want} <= _PLAIN):
            source["upstream"] += 1
            return t.detach().to(want).reshape(n.shape)
        if name not in wbid:
            raise InternalError(f"weight {name} is neither upstream's nor bound in the artifact")
        source["artifact"] += 1
        return prog.view(wbid[name], ()).clone()

    names = [n.attr["name"] for n in g.inputs]
    feed = dict(zip(names, inputs))
    with torch.no_grad():
        expected = _logits(run_upstream(inputs)).detach()
        interp = run_graph(g, feed, weight)[0]
        # the compiled program in lockstep with the interpreter: step k is compute[k]
        env = infer_env(g, feed)
        vals: dict[int, object] = {}
        pending = iter(g.nodes())
        rows, ties = [], []
        wcache: dict[str, torch.Tensor] = {}

        def advance_to(target):
            for n in pending:
                if n.op == "input":
                    v = feed[n.attr["name"]]
                elif n.op in ("weight", "state"):
                    v = wcache.setdefault(n.attr["name"], weight(n.attr["name"]))
                else:
                    v = ops.get(n.op).call([vals[id(i)] for i in n.inputs], n.attr, env)
                    if n.op.split(".")[0] in UNDEFINED_OPS and isinstance(v, torch.Tensor) and v.is_floating_point():
                        v = torch.full_like(v, float("nan"))  # marks every element derived from it as undefined
                vals[id(n)] = v
                if n is target:
                    return v
            raise InternalError("the interpreter ran past the program")

        def observe(k, node, views):
            n = compute[k]
            ref = advance_to(n)
            refs = list(ref) if isinstance(ref, (tuple, list)) else [ref]
            row = dict(step=k, node=f"%{index[id(n)]}", **_where(n))
            if n.op == "topk" and len(views) == 2:
                a = n.attr
                tie = topk_tie(vals[id(n.inputs[0])], refs[1], views[1], int(a["k"]), int(a.get("dim", -1)),
                               bool(a.get("largest", True)))
                if tie is not None:
                    scores = vals[id(n.inputs[0])]
                    idx = views[1].clone()
                    refs = [scores.gather(int(a.get("dim", -1)), idx), idx]
                    vals[id(n)] = tuple(refs)  # downstream follows the compiled tie-break
                    ties.append(dict(row, **tie))
                    row["tie"] = True
            if n.op.split(".")[0] in UNDEFINED_OPS:  # uninitialised memory on both sides: nothing to compare
                row.update(abs_diff=0.0, rel_diff=0.0, bad=0, undefined=True)
                rows.append(row)
                return
            if not views:  # an in-place cache write (no output of its own): its readers are compared
                row.update(abs_diff=0.0, rel_diff=0.0, bad=0)
                rows.append(row)
                return
            ds = [diff(v, r, atol, rtol, skip_ref_nan=has_undefined) for v, r in zip(views, refs)]
            row.update(abs_diff=max(d["abs"] for d in ds), rel_diff=max(d["rel"] for d in ds),
                       bad=sum(d["bad"] for d in ds))
            rows.append(row)

        index = {id(n): i for i, n in enumerate(g.nodes())}
        has_undefined = any(n.op.split(".")[0] in UNDEFINED_OPS for n in compute)
        got = prog.run(inputs, observe=observe)[0]
        vision = None
        if images:
            vision = diff(features, _upstream_features(module, up_kwargs), atol, rtol)

    res = {"model": str(model) if isinstance(model, (str, os.PathLike)) else type(model[0]).__name__,
           "artifact": str(art.resolve()), "program": pname, "seq_len": seq, "atol": atol, "rtol": rtol,
           "input_shapes": [list(t.shape) for t in inputs]}
    if mm is not None:
        res["images"] = [str(im) if isinstance(im, (str, os.PathLike)) else type(im).__name__ for im in images]
        res["prompt_tokens"] = int(inputs[0].shape[-1])
    if vision is not None:
        res["vision"] = {"max_abs_diff": vision["abs"], "max_rel_diff": vision["rel"], "ok": vision["bad"] == 0}
    head = diff(got, expected, atol, rtol)
    trace = diff(interp, expected, atol, rtol)
    res.update(max_abs_diff=head["abs"], max_rel_diff=head["rel"], logits_ok=head["bad"] == 0,
               trace_max_abs_diff=trace["abs"], trace_ok=trace["bad"] == 0, weights=source)
    first = next((r for r in rows if r["bad"]), None)
    res["ties"] = [f"tie at {t['node']} ({t['op']} at {t['module'] or '-'} {t['source']}): {t['rows']} row(s)"
                   + (", k-th and (k+1)-th scores equal" if t["kth_tied"] else ", order among equal scores")
                   for t in ties]
    if vision is not None and vision["bad"]:
        res["stage"] = "vision"
        res["first_divergence"] = {"node": None, "op": None, "layer": None, "source": "vision",
                                   "abs_diff": vision["abs"],
                                   "message": "the compiled vision program's image features differ from upstream's "
                                              "encoder (Qwen3VLMoeVisionModel) on the same pixel values"}
    elif not res["trace_ok"]:
        res["stage"] = "trace"
        res["first_divergence"] = {"node": None, "op": None, "layer": None, "source": "trace",
                                   "abs_diff": trace["abs"],
                                   "message": "the reference interpreter on the traced IR already differs from "
                                              "upstream: the divergence is in tracing, not in compilation"}
    elif first is not None:
        res["stage"] = "compile"
        res["first_divergence"] = {k: first[k] for k in ("node", "op", "layer", "module", "source", "abs_diff",
                                                         "rel_diff", "step")}
    else:
        res["stage"] = None
        res["first_divergence"] = None
    # explained by ties: every step agrees once the reference follows the compiled tie-break
    res["ok"] = res["trace_ok"] and (head["bad"] == 0 or (bool(ties) and first is None)) \
        and (vision is None or vision["bad"] == 0)
    # groups: decoder layers, and the modules outside them (embedding, final norm, head); a graph whose spans name
    # no small set of modules (an ONNX graph names every node) keeps those in one group: --per-node shows them
    outside = {r["module"] for r in rows if not r["layer"]}
    layers: dict[str, dict] = {}
    for r in rows:
        key = r["layer"] or (r["module"] if len(outside) <= MAX_OUTSIDE_GROUPS and r["module"] else OUTSIDE)
        e = layers.setdefault(key, {"layer": key, "steps": 0, "max_abs_diff": 0.0, "first_divergence": None})
        e["steps"] += 1
        e["max_abs_diff"] = max(e["max_abs_diff"], r["abs_diff"])
        if r["bad"] and e["first_divergence"] is None:
            e["first_divergence"] = {k: r[k] for k in ("node", "op", "source", "abs_diff")}
    res["layers"] = list(layers.values())
    if per_node:
        res["nodes"] = rows
    return res


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


# ---- the command --------------------------------------------------------------------------------------------------

def _human(r: dict) -> None:
    click.echo(f"{r['model']} vs {r['artifact']} ({r['program']}, seq {r['seq_len']}, atol {r['atol']:g}"
               + (f", rtol {r['rtol']:g}" if r["rtol"] else "") + ")")
    click.echo(f"logits: max abs diff {r['max_abs_diff']:.3g}, max rel diff {r['max_rel_diff']:.3g}  "
               f"({'ok' if r['logits_ok'] else 'OUTSIDE TOLERANCE'})")
    if "vision" in r:
        v = r["vision"]
        click.echo(f"images {', '.join(r['images'])} ({r['prompt_tokens']} prompt tokens): vision features max abs "
                   f"diff {v['max_abs_diff']:.3g}  ({'ok' if v['ok'] else 'OUTSIDE TOLERANCE'})")
    click.echo(f"trace (interpreter vs upstream): max abs diff {r['trace_max_abs_diff']:.3g}  "
               f"({'ok' if r['trace_ok'] else 'DIFFERS: the divergence is in tracing'})")
    for t in r["ties"]:
        click.echo(t + ": downstream differences are tie-breaking, not a numerical bug")
    for e in r["layers"]:
        fd = e["first_divergence"]
        tail = f"first bad {fd['node']} {fd['op']} ({fd['source']}) {fd['abs_diff']:.3g}" if fd else "ok"
        click.echo(f"  {e['layer']:<32} {e['steps']:4d} steps  max abs {e['max_abs_diff']:9.3g}  {tail}")
    for n in r.get("nodes", []):
        click.echo(f"    {n['step']:4d} {n['node']:>6} {n['op']:<28} {n['abs_diff']:9.3g} "
                   f"{'BAD' if n['bad'] else ('tie' if n.get('tie') else 'ok '):4} {n['module']} {n['source']}")
    fd = r["first_divergence"]
    if fd is None:
        click.echo("first divergence: none" + (" (after aligning ties)" if r["ties"] else ""))
    elif r["stage"] in ("trace", "vision"):
        click.echo(f"first divergence: {fd['message']}")
    else:
        click.echo(f"first divergence: {fd['node']} {fd['op']} in {fd['layer'] or fd['module']} at {fd['source']}, "
                   f"abs diff {fd['abs_diff']:.3g}")
    click.echo("ok" if r["ok"] else "MISMATCH")


@click.command("compare")
@click.argument("model")
@click.argument("out", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@click.option("--seq-len", type=int, default=None, help=f"input length (default {DEFAULT_SEQ}, capped at the bound)")
@click.option("--per-node", is_flag=True, help="report every compiled step, not only every layer")
@click.option("--atol", type=float, default=ATOL, show_default=True, help="absolute tolerance")
@click.option("--rtol", type=float, default=0.0, show_default=True, help="relative tolerance (large magnitudes)")
@click.option("--image", "images", multiple=True, type=click.Path(dir_okay=False),
              help="multimodal artifacts: an image file joining the prompt (repeat for several)")
@click.option("--streamed", is_flag=True,
              help="run upstream one decoder layer at a time (chosen by itself when the fp32 reference would not "
                   "fit in the memory available)")
def compare_cmd(model, out, as_json, seq_len, per_node, atol, rtol, images, streamed):
    """Compare the artifact OUT with MODEL run eagerly upstream on the same fixed-seed input; localise the first
    divergence layer by layer (exit 1 when outside tolerance)."""
    from dayzero.tools import compare_streamed as cs

    if atol < 0 or rtol < 0:
        raise UserError("--atol and --rtol must be non-negative")
    is_ckpt = Path(model).is_dir()
    if streamed and not is_ckpt:
        raise UserError(f"{model}: --streamed compares against a checkpoint directory")
    if is_ckpt and not images and not streamed and cs.needs_streaming(model):
        streamed = True
        click.echo(f"{model}: the fp32 reference (~{cs.reference_bytes(model) / 1e9:.1f} GB) would not fit in the "
                   "memory available: comparing layer by layer (streamed)", err=True)
    if streamed and (per_node or images):
        raise UserError("--per-node and --image compare the whole upstream model: not with --streamed")
    if streamed:
        r = cs.compare_streamed(model, out, seq_len=seq_len, atol=atol, rtol=rtol)
    else:
        r = compare(model, out, seq_len=seq_len, atol=atol, rtol=rtol, per_node=per_node, images=images)
    if as_json:
        click.echo(json.dumps(r, indent=1, sort_keys=True, default=str))
    elif streamed:
        cs.human(r, click.echo)
    else:
        _human(r)
    if not r["ok"]:
        raise SystemExit(1)
