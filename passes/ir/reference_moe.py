"""Torch references of dayzero's routed-expert ops (declared in ``dayzero_ops.py``): a per-expert loop over only
the experts some token chose, in fp32; the low-precision forms decode their expert matrices first.

The activation between the two GEMMs is an expression over columns of G (passes/moe.py documents the form):
``("col", start, step, width)``, ``("const", v)``, a unary ``(op, e)``, a binary ``(op, a, b)``,
``("clamp", e, lo, hi)``.
"""

from __future__ import annotations

import torch

from .reference_dequant import fp8_blocks_dequant_ref, mxfp4_dequant_ref

# the unary activations of an act expression
ACT_UNARY = {"silu": torch.nn.functional.silu, "sigmoid": torch.sigmoid, "relu": torch.relu, "tanh": torch.tanh,
             "exp": torch.exp, "neg": torch.neg, "gelu": torch.nn.functional.gelu}


def eval_act(expr, g: torch.Tensor) -> torch.Tensor:
    """The activation expression on G [S, GU] (torch): the reference semantics of ``act``."""
    kind = expr[0]
    if kind == "col":
        _, start, step, width = expr
        return g[:, start: start + step * (width - 1) + 1: step]
    if kind == "const":
        return torch.tensor(expr[1], dtype=g.dtype)
    if kind == "clamp":
        return torch.clamp(eval_act(expr[1], g), min=expr[2], max=expr[3])
    if kind in ACT_UNARY:
        return ACT_UNARY[kind](eval_act(expr[1], g))
    a, b = eval_act(expr[1], g), eval_act(expr[2], g)
    return {"mul": torch.mul, "add": torch.add, "sub": torch.sub, "div": torch.div}[kind](a, b)


def _split_inputs(ins, attrs):
    it = iter(ins)
    x, ids, w, wgu = next(it), next(it), next(it), next(it)
    bgu = next(it) if attrs["gate_up_bias"] else None
    wd = next(it)
    bd = next(it) if attrs["down_bias"] else None
    return x, ids, w, wgu, bgu, wd, bd


def int8_blocks_ref(x: torch.Tensor) -> torch.Tensor:
    """x [R, K] as the integer expert tiles see it: each 32-block rounded to int8 steps of sx = max|x| / 127,
    q = round_half_even(x * fp32(127 / max|x|)) in fp32, value q * fp32(max|x| * fp32(1/127)) (0 for an all-zero
    block); codegen/kernels/dequant/gemv_int8.py's quantiser, rule for rule."""
    R, K = x.shape
    xb = x.float().reshape(R, K // 32, 32)
    am = xb.abs().amax(-1, keepdim=True)
    one = torch.ones_like(am)
    inv = torch.where(am > 0, torch.full_like(am, 127.0) / torch.where(am > 0, am, one), torch.zeros_like(am))
    sx = am * torch.tensor(1.0 / 127, dtype=torch.float32)
    return (torch.round(xb * inv).double() * sx.double()).reshape(R, K)


def moe_reference(ins, attrs, quant=None):
    """y[t] = sum_j w[t,j] * (down_e(act(gate_up_e(x[t]) + b_gu[e])) + b_d[e]),  e = ids[t, j].

    Loops over the experts some token chose (each read once), accumulating in fp32; an id outside [0, E) is
    another rank's expert (passes/shard.py) and adds nothing. ``quant``: applied to each GEMM's activation rows
    (x and act(...)) first, the GEMMs then in float64 (the integer route: ``int8_blocks_ref``)."""
    x, ids, w, wgu, bgu, wd, bd = _split_inputs(ins, attrs)
    out_dtype = torch.promote_types(torch.promote_types(x.dtype, wd.dtype), w.dtype)
    T, H = x.shape
    if x.device.type == "meta":
        return torch.empty(T, H, dtype=out_dtype, device="meta")
    nk = attrs["layout"] == "nk"
    y = torch.zeros(T, H, dtype=torch.float32)
    flat = ids.reshape(-1)
    k = ids.shape[1]
    for e in torch.unique(flat).tolist():
        if not 0 <= e < wgu.shape[0]:  # another rank's expert (expert parallel): adds nothing here
            continue
        a = (flat == e).nonzero(as_tuple=True)[0]
        tok = a // k
        xe = x[tok].float()
        if quant is not None:
            xe = quant(xe)
        g = (xe @ (wgu[e].to(xe.dtype).T if nk else wgu[e].to(xe.dtype))).float()
        if bgu is not None:
            g = g + bgu[e].float()
        h = eval_act(attrs["act"], g)
        if quant is not None:
            h = quant(h)
        d = (h @ (wd[e].to(h.dtype).T if nk else wd[e].to(h.dtype))).float()
        if bd is not None:
            d = d + bd[e].float()
        y.index_add_(0, tok, d * w.reshape(-1)[a].float()[:, None])
    return y.to(out_dtype)


def _stored_experts(ins, attrs):
    """(x, ids, w, gate/up data, gate/up scales, b_gu, down data, down scales, b_d) of a low-precision moe op;
    absent biases are None."""
    it = iter(ins)
    x, ids, w, gq, gs = (next(it) for _ in range(5))
    bgu = next(it) if attrs["gate_up_bias"] else None
    dq, ds = next(it), next(it)
    bd = next(it) if attrs["down_bias"] else None
    return x, ids, w, gq, gs, bgu, dq, ds, bd


def _meta_out(x, w):
    return torch.empty(x.shape, dtype=torch.promote_types(x.dtype, w.dtype), device="meta")


def moe_mxfp4_reference(ins, attrs):
    x, ids, w, gb, gs, bgu, db, ds, bd = _stored_experts(ins, attrs)
    if x.device.type == "meta":
        return _meta_out(x, w)
    dense = [x, ids, w, mxfp4_dequant_ref(gb, gs)] + ([bgu] if bgu is not None else []) + \
        [mxfp4_dequant_ref(db, ds)] + ([bd] if bd is not None else [])
    return moe_reference(dense, dict(attrs, layout="nk"), int8_blocks_ref if attrs.get("int8") else None)


def moe_fp8_reference(ins, attrs):
    x, ids, w, gq, gs, bgu, dq_, ds, bd = _stored_experts(ins, attrs)
    if x.device.type == "meta":
        return _meta_out(x, w)
    dense = [x, ids, w, fp8_blocks_dequant_ref(gq, gs, attrs["gate_up_block"])] + ([bgu] if bgu is not None else []) \
        + [fp8_blocks_dequant_ref(dq_, ds, attrs["down_block"])] + ([bd] if bd is not None else [])
    return moe_reference(dense, attrs)


def moe_workspace_reference(ins, attrs):
    """The moe_experts_mxfp4 reference on x as the compute dtype sees it (bf16: rounded; fp8: weights only, exact
    for E2M1 values; fp32: unchanged). The workspace and cache are an implementation detail: not read here."""
    x = ins[0]
    if attrs["compute_dtype"] == "bfloat16" and x.device.type != "meta":
        x = x.to(torch.bfloat16).to(x.dtype)
    return moe_mxfp4_reference([x, *ins[1:-3]], attrs)
