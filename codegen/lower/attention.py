"""scaled_dot_product_attention as one TE compute (the generic form; fused attention over a KV cache is a
hand-written kernel, codegen/kernels/table.py).
"""

from __future__ import annotations

import math
from typing import Callable

import tvm
from tvm import te

from .common import bcast_load, cast, const, dtype_of, lowering_table

LOWERINGS: dict[str, Callable] = {}
lowering = lowering_table(LOWERINGS)


@lowering("scaled_dot_product_attention")
def _sdpa(ctx, ins, attrs, outs):
    """out[b, h, i, :] = softmax_j(q[b,h,i]·k[b,g(h),j] * scale + mask[b,h,i,j]) @ v[b,g(h),j,:]

    q [B, H, L, D], k [B, Hk, S, D], v [B, Hk, S, Dv], mask broadcastable to [B, H, L, S] (bool: keep where
    true; float: added), g(h) = h // (H / Hk) (GQA), is_causal keeps j <= i (ATen's top-left alignment).
    """
    it = iter(ins)
    q, k, v = next(it), next(it), next(it)
    mask = next(it) if attrs.get("attn_mask") else None
    out = outs[0]
    cd = "float32"
    H, Hk = q.shape[1], k.shape[1]
    D = q.shape[3]
    L, S = q.shape[2], k.shape[2]
    scale = attrs.get("scale")
    sc = const(scale if scale is not None else 1.0 / math.sqrt(int(D)), cd)
    group = tvm.tirx.floordiv(H, Hk)
    causal = attrs.get("is_causal", False)
    d = te.reduce_axis((0, D), name="d")
    neg_inf = -tvm.tirx.infinity(cd)

    def score(b, h, i, j):
        return te.sum(cast(q[b, h, i, d], cd) * cast(k[b, tvm.tirx.floordiv(h, group), j, d], cd), axis=d)
    s = te.compute((q.shape[0], H, L, S), score, name="scores")

    def masked(b, h, i, j):
        val = s[b, h, i, j] * sc
        if mask is not None:
            m = bcast_load(mask, [b, h, i, j], 4)
            val = tvm.tirx.Select(m.astype("bool"), val, neg_inf) if dtype_of(mask) == "bool" else val + cast(m, cd)
        if causal:
            val = tvm.tirx.Select(j <= i, val, neg_inf)  # ATen aligns is_causal top-left (tril of [L, S])
        return val
    sm = te.compute(s.shape, masked, name="masked")
    j1 = te.reduce_axis((0, S), name="j1")
    mx = te.compute((q.shape[0], H, L), lambda b, h, i: te.max(sm[b, h, i, j1], axis=j1), name="mx")
    p = te.compute(s.shape, lambda b, h, i, j: tvm.tirx.exp(sm[b, h, i, j] - mx[b, h, i]), name="p")
    j2 = te.reduce_axis((0, S), name="j2")
    den = te.compute(mx.shape, lambda b, h, i: te.sum(p[b, h, i, j2], axis=j2), name="den")
    j3 = te.reduce_axis((0, S), name="j3")
    o = te.compute(ctx.shape(out.shape), lambda b, h, i, e: te.sum(
        p[b, h, i, j3] * cast(v[b, tvm.tirx.floordiv(h, group), j3, e], cd), axis=j3), name="pv")
    return te.compute(o.shape, lambda b, h, i, e: cast(o[b, h, i, e] / den[b, h, i], out.dtype), name="T")
