"""Reductions: sum / mean / amax / amin / any / all over dims, max.dim / argmax, softmax, log_softmax, logsumexp,
cumsum, topk, sort.
"""

from __future__ import annotations

from typing import Callable

import tvm
from tvm import te, topi

from dayzero import InternalError
from .common import MATERIALIZE, cast, const, dtype_of, fold, masked_value, norm_dim, reduce_axes, lowering_table

LOWERINGS: dict[str, Callable] = {}
lowering = lowering_table(LOWERINGS)


def _reduce(ctx, ins, attrs, outs, kind: str):
    x = ins[0]
    nd = len(x.shape)
    dims = attrs.get("dim")
    dims = list(range(nd)) if dims is None or dims == () else [norm_dim(d, nd) for d in
                                                               (dims if isinstance(dims, tuple) else (dims,))]
    keep = attrs.get("keepdim", False)
    out = outs[0]
    cd = out.dtype if kind in ("sum", "mean") else dtype_of(x)
    if kind in ("sum", "mean") and not cd.startswith("float"):
        cd = out.dtype
    axes, mask = reduce_axes({f"r{d}": x.shape[d] for d in dims})

    def body(*o):
        o = list(o)
        src, ai, oi = [], iter(axes), iter(o)
        for k in range(nd):
            if k in dims:
                src.append(next(ai))
                if keep:
                    next(oi)
            else:
                src.append(next(oi))
        v = cast(x[tuple(src)], cd)
        if kind in ("sum", "mean"):
            return te.sum(masked_value(mask, v, const(0, cd)), axis=axes)
        if kind == "amax":
            return te.max(masked_value(mask, v, tvm.tirx.min_value(cd)), axis=axes)
        if kind == "amin":
            return te.min(masked_value(mask, v, tvm.tirx.max_value(cd)), axis=axes)
        if kind == "any":
            return te.max(masked_value(mask, v.astype("int8"), const(0, "int8")), axis=axes)
        if kind == "all":
            return te.min(masked_value(mask, v.astype("int8"), const(1, "int8")), axis=axes)
        raise InternalError(kind)
    r = te.compute(ctx.shape(out.shape), body, name="R")
    if kind == "mean":
        count = fold(lambda a, b: a * b, [x.shape[d] for d in dims])
        return te.compute(r.shape, lambda *i: cast(r[i] / cast(count, cd), out.dtype), name="T")
    if dtype_of(r) != out.dtype:
        return te.compute(r.shape, lambda *i: cast(r[i], out.dtype), name="T")
    return r


for _n, _k in {"sum.dim_IntList": "sum", "sum": "sum", "mean.dim": "mean", "mean": "mean", "amax": "amax",
               "amin": "amin", "any.dim": "any", "any.dims": "any", "any": "any", "all.dim": "all",
               "all": "all"}.items():
    LOWERINGS[_n] = (lambda k: lambda ctx, ins, attrs, outs: _reduce(ctx, ins, attrs, outs, k))(_k)


@lowering("max.dim", "min.dim", "argmax", "argmin")
def _argreduce(ctx, ins, attrs, outs):
    name = attrs["__op__"]
    x = ins[0]
    nd = len(x.shape)
    dim = attrs.get("dim")
    if dim is None:
        raise InternalError(f"{name} over all dimensions is not lowered")
    dim = norm_dim(dim, nd)
    keep = attrs.get("keepdim", False)
    largest = name in ("max.dim", "argmax")
    r = te.reduce_axis((0, x.shape[dim]), name="r")

    def fcombine(a, b):
        better = (b[1] > a[1]) if largest else (b[1] < a[1])
        take_b = tvm.tirx.any(better, tvm.tirx.all(b[1] == a[1], b[0] < a[0]))
        return tvm.tirx.Select(take_b, b[0], a[0]), tvm.tirx.Select(take_b, b[1], a[1])

    def fidentity(t0, t1):
        init = tvm.tirx.min_value(t1) if largest else tvm.tirx.max_value(t1)
        return tvm.tirx.const(-1, t0), init

    reducer = te.comm_reducer(fcombine, fidentity, name="argbest")
    oshape = [x.shape[k] for k in range(nd) if k != dim]

    def body(*o):
        src = list(o[:dim]) + [r] + list(o[dim:])
        return reducer((r, x[tuple(src)]), axis=r)
    idx, val = te.compute(oshape, body, name="A")

    def keepd(t, dtype):
        if keep:
            return te.compute(ctx.shape(outs[0].shape), lambda *o: cast(t[tuple(o[:dim] + o[dim + 1:])], dtype),
                              name="K")
        return te.compute(t.shape, lambda *o: cast(t[o], dtype), name="K")
    if name in ("argmax", "argmin"):
        return keepd(idx, outs[0].dtype)
    return [keepd(val, outs[0].dtype), keepd(idx, outs[1].dtype)]


@lowering("softmax.int", "_softmax", "_log_softmax", "log_softmax.int")
def _softmax(ctx, ins, attrs, outs):
    name = attrs["__op__"]
    x = ins[0]
    nd = len(x.shape)
    dim = norm_dim(attrs["dim"], nd)
    cd = outs[0].dtype
    red_shape = [x.shape[j] for j in range(nd) if j != dim]

    def full(i, j):
        return list(i[:dim]) + [j] + list(i[dim:])
    k1 = te.reduce_axis((0, x.shape[dim]), name="k1")
    mx = te.compute(red_shape, lambda *i: te.max(cast(x[tuple(full(i, k1))], cd), axis=k1), name="mx")
    k2 = te.reduce_axis((0, x.shape[dim]), name="k2")

    def row(i):
        return tuple(i[:dim] + i[dim + 1:])
    if "log" in name:
        se = te.compute(red_shape, lambda *i: te.sum(tvm.tirx.exp(cast(x[tuple(full(i, k2))], cd) - mx[i]),
                                                     axis=k2), name="se")
        return te.compute(ctx.shape(outs[0].shape), lambda *i: cast(x[i], cd) - mx[row(i)] - tvm.tirx.log(se[row(i)]),
                          name="T")
    # softmax: each exp computed once, kept (MATERIALIZE: fused kernels do not inline it back) and read by the
    # sum and the output; exp is the kernel's cost (a polynomial an element), the row a few KiB of L1 per row
    # under the row_reduction rule (bench ops, 2 cores, 512 x 4096: 0.84 -> 0.53-0.60 ms)
    e = te.compute(x.shape, lambda *i: tvm.tirx.exp(cast(x[i], cd) - mx[row(i)]), name="E",
                   attrs={MATERIALIZE: 1})
    se = te.compute(red_shape, lambda *i: te.sum(e[tuple(full(i, k2))], axis=k2), name="se")
    return te.compute(ctx.shape(outs[0].shape), lambda *i: e[i] * (const(1.0, cd) / se[row(i)]), name="T")


@lowering("cumsum")
def _cumsum(ctx, ins, attrs, outs):
    x = ins[0]
    dim = norm_dim(attrs["dim"], len(x.shape))
    xc = te.compute(x.shape, lambda *i: cast(x[i], outs[0].dtype), name="C") if dtype_of(x) != outs[0].dtype else x
    return topi.cumsum(xc, axis=dim, dtype=outs[0].dtype)


@lowering("topk")
def _topk(ctx, ins, attrs, outs):
    x = ins[0]
    nd = len(x.shape)
    dim = norm_dim(attrs.get("dim", -1), nd)
    largest = attrs.get("largest", True)
    vals, idxs = topi.topk(x, k=attrs["k"], axis=dim, ret_type="both", is_ascend=not largest, dtype=outs[1].dtype)
    return [vals, idxs]


@lowering("sort")
def _sort(ctx, ins, attrs, outs):
    x = ins[0]
    dim = norm_dim(attrs.get("dim", -1), len(x.shape))
    idx = topi.argsort(x, axis=dim, is_ascend=not attrs.get("descending", False), dtype=outs[1].dtype)
    vals = te.compute(x.shape, lambda *i: x[tuple(list(i[:dim]) + [idx[i]] + list(i[dim + 1:]))], name="V")
    return [vals, idx]


@lowering("logsumexp")
def _logsumexp(ctx, ins, attrs, outs):
    x = ins[0]
    nd = len(x.shape)
    dims = attrs.get("dim")
    dims = [norm_dim(d, nd) for d in (dims if isinstance(dims, tuple) else (dims,))] if dims not in (None, ()) \
        else list(range(nd))
    keep = attrs.get("keepdim", False)
    cd = outs[0].dtype
    red_shape = [x.shape[d] for d in range(nd) if d not in dims]

    def full(o, axes):
        src, ai, oi = [], iter(axes), iter(o)
        for d in range(nd):
            src.append(next(ai) if d in dims else next(oi))
        return tuple(src)
    a1 = [te.reduce_axis((0, x.shape[d]), name=f"a{d}") for d in dims]
    mx = te.compute(red_shape, lambda *o: te.max(cast(x[full(o, a1)], cd), axis=a1), name="mx")
    # an all -inf (or +inf) row: shift by 0 instead, as ATen does, so the result is -inf (inf), not nan
    safe = te.compute(red_shape, lambda *o: tvm.tirx.Select(tvm.tirx.isinf(mx[o]), const(0, cd), mx[o]), name="sh")
    a2 = [te.reduce_axis((0, x.shape[d]), name=f"b{d}") for d in dims]
    se = te.compute(red_shape, lambda *o: te.sum(tvm.tirx.exp(cast(x[full(o, a2)], cd) - safe[o]), axis=a2),
                    name="se")

    def body(*o):
        r = tuple(o[d] for d in range(nd) if d not in dims) if keep else o
        return tvm.tirx.log(se[r]) + safe[r]
    return te.compute(ctx.shape(outs[0].shape), body, name="T")
