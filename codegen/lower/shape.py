"""Shape ops (copies: pure views alias their source in the runtime), creation ops and padding: expand, permute,
transpose, slice, select, cat, split, full / arange / empty, copy, constant_pad_nd.
"""

from __future__ import annotations

from typing import Callable

import sympy
import tvm
from tvm import te

from .common import IDX, cast, const, elementwise_compute, in_bounds, norm_dim, normalize_start, lowering_table

LOWERINGS: dict[str, Callable] = {}
lowering = lowering_table(LOWERINGS)


@lowering("expand", "expand_copy", "broadcast_to")
def _expand(ctx, ins, attrs, outs):
    return elementwise_compute(ctx, ins[:1], outs[0], lambda a: a)


# ---- creation -----------------------------------------------------------------------------------------------

@lowering("scalar_tensor", "full", "full_like", "new_full", "zeros_like", "ones_like", "new_zeros", "new_ones",
          "zeros", "ones")
def _fill(ctx, ins, attrs, outs):
    out = outs[0]
    v = attrs.get("s", attrs.get("fill_value"))
    if v is None:
        v = 1 if "ones" in attrs["__op__"] else 0
    c = cast(ctx.dim(v), out.dtype) if isinstance(v, sympy.Basic) else const(v, out.dtype)  # SymInt fill
    return te.compute(ctx.shape(out.shape), lambda *i: c, name="T")


@lowering("arange.start_step", "arange", "arange.start")
def _arange(ctx, ins, attrs, outs):
    out = outs[0]
    start, step = attrs.get("start", 0) or 0, attrs.get("step", 1) or 1
    cd = "float32" if out.dtype.startswith("float") or isinstance(start, float) or isinstance(step, float) else IDX
    s0 = const(start, cd) if not isinstance(start, sympy.Basic) else cast(ctx.dim(start), cd)
    st = const(step, cd)
    return te.compute(ctx.shape(out.shape), lambda i: cast(s0 + cast(i, cd) * st, out.dtype), name="T")


# ---- shape ops (copies; pure views are aliases in the runtime) ----------------------------------------------

@lowering("permute", "permute_copy")
def _permute(ctx, ins, attrs, outs):
    x = ins[0]
    dims = [norm_dim(d, len(x.shape)) for d in attrs["dims"]]
    inv = [dims.index(i) for i in range(len(dims))]
    return te.compute(ctx.shape(outs[0].shape), lambda *i: x[tuple(i[inv[k]] for k in range(len(dims)))], name="T")


@lowering("transpose.int")
def _transpose(ctx, ins, attrs, outs):
    x = ins[0]
    nd = len(x.shape)
    d0, d1 = norm_dim(attrs["dim0"], nd), norm_dim(attrs["dim1"], nd)
    perm = list(range(nd))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return te.compute(ctx.shape(outs[0].shape), lambda *i: x[tuple(i[perm[k]] for k in range(nd))], name="T")


def _reindexed(ctx, x, out, index):
    """out[i] = x[index(i)] (``index``: the output index as a list -> x's index as a list)."""
    return te.compute(ctx.shape(out.shape), lambda *i: x[tuple(index(list(i)))], name="T")


@lowering("slice.Tensor", "slice_copy.Tensor")
def _slice(ctx, ins, attrs, outs):
    x = ins[0]
    nd = len(x.shape)
    dim = norm_dim(attrs["dim"], nd)
    start = normalize_start(ctx, attrs.get("start"), x.shape[dim])
    step = tvm.tirx.const(attrs.get("step", 1) or 1, IDX)
    return _reindexed(ctx, x, outs[0], lambda i: i[:dim] + [start + i[dim] * step] + i[dim + 1:])


@lowering("select.int")
def _select(ctx, ins, attrs, outs):
    x = ins[0]
    nd = len(x.shape)
    dim = norm_dim(attrs["dim"], nd)
    index = attrs["index"]
    ix = ctx.dim(index) if isinstance(index, sympy.Basic) else tvm.tirx.const(index, IDX)
    if isinstance(index, int) and index < 0:
        ix = x.shape[dim] + ix
    return _reindexed(ctx, x, outs[0], lambda i: i[:dim] + [ix] + i[dim:])


@lowering("cat")
def _cat(ctx, ins, attrs, outs):
    out = outs[0]
    nd = len(out.shape)
    dim = norm_dim(attrs.get("dim", 0), nd)
    parts = [t for t in ins if not (len(t.shape) == 1 and isinstance(t.shape[0], tvm.tirx.IntImm)
                                    and int(t.shape[0]) == 0 and nd > 1)]
    offsets = []
    acc = tvm.tirx.const(0, IDX)
    for t in parts:
        offsets.append(acc)
        acc = acc + t.shape[dim]

    def body(*i):
        val = None
        for t, off in zip(parts, offsets):  # later parts win from their offset on; reads stay in bounds
            idx = list(i)
            idx[dim] = i[dim] - off
            v = cast(t[tuple(idx)], out.dtype)
            val = v if val is None else tvm.tirx.if_then_else(i[dim] >= off, v, val)
        return val
    return te.compute(ctx.shape(out.shape), body, name="T")


@lowering("split_with_sizes", "split.Tensor")
def _split(ctx, ins, attrs, outs):
    x = ins[0]
    nd = len(x.shape)
    dim = norm_dim(attrs.get("dim", 0), nd)
    res = []
    off = tvm.tirx.const(0, IDX)
    for k, ty in enumerate(outs):
        shape = ctx.shape(ty.shape)

        def make_body(off):
            def body(*i):
                idx = list(i)
                idx[dim] = i[dim] + off
                return x[tuple(idx)]
            return body
        res.append(te.compute(shape, make_body(off), name=f"T{k}"))
        off = off + shape[dim]
    return res


@lowering("empty.memory_format", "empty_like", "new_empty")
def _empty(ctx, ins, attrs, outs):
    # contents are undefined in ATen; zeros keep runs reproducible (every reader overwrites them first)
    return te.compute(ctx.shape(outs[0].shape), lambda *i: const(0, outs[0].dtype), name="T")


@lowering("copy", "fill.Tensor")
def _copy(ctx, ins, attrs, outs):
    """copy(self, src): src broadcast to self's shape, in self's dtype."""
    return elementwise_compute(ctx, ins[1:2], outs[0], lambda a: a)


@lowering("fill.Scalar")
def _fill_scalar(ctx, ins, attrs, outs):
    c = const(attrs["value"], outs[0].dtype)
    return te.compute(ctx.shape(outs[0].shape), lambda *i: c, name="T")


@lowering("constant_pad_nd")
def _constant_pad_nd(ctx, ins, attrs, outs):
    x = ins[0]
    out = outs[0]
    nd = len(x.shape)
    pad = list(attrs["pad"])
    before = [0] * nd
    for j in range(len(pad) // 2):
        before[nd - 1 - j] = pad[2 * j]
    value = attrs.get("value", 0)
    value = 0 if value is None else value
    fill = const(float(value) if out.dtype.startswith("float") else value, out.dtype)

    def body(*i):
        src = [i[d] - before[d] for d in range(nd)]
        padded = [d for d in range(nd) if before[d] or pad]
        if not padded:
            return x[tuple(src)]
        return tvm.tirx.if_then_else(in_bounds([src[d] for d in padded], [x.shape[d] for d in padded]),
                                     x[tuple(src)], fill)
    return te.compute(ctx.shape(out.shape), body, name="T")
