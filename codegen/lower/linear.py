"""Contractions: linear, mm / bmm / matmul (batch dimensions broadcast as ATen's).
"""

from __future__ import annotations

from typing import Callable

import tvm
from tvm import te

from .common import IDX, cast, const, masked_value, reduce_axes, lowering_table

LOWERINGS: dict[str, Callable] = {}
lowering = lowering_table(LOWERINGS)


@lowering("linear")
def _linear(ctx, ins, attrs, outs):
    """out[..., n] = sum_k x[..., k] * w[n, k] (+ b[n]); x [..., K], w [N, K], b [N]."""
    x, w = ins[0], ins[1]
    b = ins[2] if attrs.get("bias") else None
    nd = len(x.shape)
    (k,), mask = reduce_axes({"k": x.shape[nd - 1]})
    out = outs[0]
    cd = out.dtype if out.dtype.startswith("float") else "float32"
    acc = "float32" if cd in ("bfloat16", "float16") else cd

    def body(*i):
        return te.sum(masked_value(mask, cast(x[tuple(i[:-1]) + (k,)], acc) * cast(w[i[-1], k], acc),
                              const(0, acc)), axis=k)
    mm = te.compute(ctx.shape(out.shape), body, name="matmul")
    if b is None and acc == out.dtype:
        return mm
    return te.compute(mm.shape, lambda *i: cast(mm[i] + (cast(b[i[-1]], acc) if b is not None else 0), out.dtype),
                      name="T")


@lowering("mm", "bmm", "matmul")
def _mm(ctx, ins, attrs, outs):
    """out[..., m, n] = sum_k a[..., m, k] * b[..., k, n]; leading dims broadcast."""
    a, b = ins
    out = outs[0]
    nd = len(out.shape)
    (k,), mask = reduce_axes({"k": a.shape[len(a.shape) - 1]})
    acc = "float32" if out.dtype in ("bfloat16", "float16") else out.dtype

    def body(*i):
        lead = list(i[:-2])
        ai = _bcast_load_lead(a, lead, nd - 2) + [i[-2], k]
        bi = _bcast_load_lead(b, lead, nd - 2) + [k, i[-1]]
        return te.sum(masked_value(mask, cast(a[tuple(ai)], acc) * cast(b[tuple(bi)], acc), const(0, acc)), axis=k)
    mm = te.compute(ctx.shape(out.shape), body, name="matmul")
    if acc == out.dtype:
        return mm
    return te.compute(mm.shape, lambda *i: cast(mm[i], out.dtype), name="T")


def _bcast_load_lead(t, lead, nlead):
    tl = len(t.shape) - 2
    sub = []
    for j in range(tl):
        i = lead[nlead - tl + j]
        d = t.shape[j]
        sub.append(tvm.tirx.const(0, IDX) if isinstance(d, tvm.tirx.IntImm) and int(d) == 1 else i)
    return sub
