"""Indexing and the scatter family: embedding, index, gather, index_select, slice_scatter, scatter,
scatter_add / scatter_reduce, index_put. Out-of-range indices wrap as ATen's negative indices do.
"""

from __future__ import annotations

from typing import Callable

import sympy
import tvm
from tvm import te

from dayzero import InternalError
from .common import IDX, OPEN_END, bcast_load, cast, const, dtype_of, fold, norm_dim, wrap_index, lowering_table

LOWERINGS: dict[str, Callable] = {}
lowering = lowering_table(LOWERINGS)


@lowering("embedding")
def _embedding(ctx, ins, attrs, outs):
    w, ids = ins
    ni = len(ids.shape)
    return te.compute(ctx.shape(outs[0].shape),
                      lambda *i: w[cast(ids[tuple(i[:ni])], IDX), i[ni]], name="T")


@lowering("index.Tensor")
def _index(ctx, ins, attrs, outs):
    x, idx_ts = ins[0], list(ins[1:])
    present = list(attrs["indices"]) + [False] * (len(x.shape) - len(attrs["indices"]))
    pos = [k for k, p in enumerate(present) if p]
    bnd = max(len(t.shape) for t in idx_ts)
    consecutive = pos == list(range(pos[0], pos[0] + len(pos)))
    first = pos[0] if consecutive else 0

    def body(*o):
        o = list(o)
        b = o[first:first + bnd]
        rest = o[:first] + o[first + bnd:]
        src, it, r = [], iter(idx_ts), iter(rest)
        for k in range(len(x.shape)):
            if present[k]:
                t = next(it)
                src.append(wrap_index(cast(bcast_load(t, b, bnd), IDX), x.shape[k]))
            else:
                src.append(next(r))
        return x[tuple(src)]
    return te.compute(ctx.shape(outs[0].shape), body, name="T")


def _take(ctx, x, attrs, outs, index_at):
    """out[i] = x[i with i[dim] replaced by index_at(i)] (negative indices wrap), for gather and index_select."""
    dim = norm_dim(attrs["dim"], len(x.shape))

    def body(*i):
        src = list(i)
        src[dim] = wrap_index(cast(index_at(i, dim), IDX), x.shape[dim])
        return x[tuple(src)]
    return te.compute(ctx.shape(outs[0].shape), body, name="T")


@lowering("gather")
def _gather(ctx, ins, attrs, outs):
    x, index = ins
    return _take(ctx, x, attrs, outs, lambda i, dim: index[i])


def _slice_bounds(ctx, attrs, size):
    """ATen's slice normalisation: negative start/end count from the end, both clamp to [0, size]."""
    zero = tvm.tirx.const(0, IDX)

    def norm(v, default):
        if v is None or (isinstance(v, int) and v >= OPEN_END):
            return default if v is None else size
        if isinstance(v, int) and v <= -OPEN_END:
            return zero
        e = ctx.dim(v) if isinstance(v, sympy.Basic) else tvm.tirx.const(int(v), IDX)
        if isinstance(v, int) and v < 0:
            e = size + e
        return tvm.tirx.max(tvm.tirx.min(e, size), zero)
    start = norm(attrs.get("start"), zero)
    end = tvm.tirx.max(norm(attrs.get("end"), size), start)
    return start, end


@lowering("slice_scatter")
def _slice_scatter(ctx, ins, attrs, outs):
    x, src = ins
    nd = len(x.shape)
    dim = norm_dim(attrs.get("dim", 0), nd)
    step = attrs.get("step", 1) or 1
    start, end = _slice_bounds(ctx, attrs, x.shape[dim])
    cd = outs[0].dtype
    st = tvm.tirx.const(step, IDX)

    def body(*i):
        j = i[dim]
        inside = tvm.tirx.all(j >= start, j < end, tvm.tirx.floormod(j - start, st) == 0)
        idx = list(i)
        idx[dim] = tvm.tirx.floordiv(j - start, st)
        return tvm.tirx.if_then_else(inside, cast(src[tuple(idx)], cd), cast(x[i], cd))
    return te.compute(ctx.shape(outs[0].shape), body, name="T")


UNROLLED_WRITERS = 8  # scatter: at most this many index entries along dim are tested inline, per output element


def _scatter_hit(ctx, x, index, dim, mode):
    """For every position of x: the position k along ``dim`` of the index entry that writes it.

    mode "last": the largest such k (ATen leaves duplicates unspecified; the CPU kernel's serial loop makes the
    last writer win, and so do we), -1 when none; the other coordinates must lie inside index's extent.
    """
    k = te.reduce_axis((0, index.shape[dim]), name="k")

    def body(*i):
        hit, _ = _writes(x, index, dim, i, k)
        return te.max(tvm.tirx.Select(hit, cast(k, IDX), tvm.tirx.const(-1, IDX)), axis=k)
    return te.compute(x.shape, body, name="hit")


def _writes(x, index, dim, i, k):
    """(whether index entry k along ``dim``, at i's other coordinates, writes position i of x; that entry's
    coordinates). An entry outside index's extent writes nothing; negative indices wrap."""
    nd = len(x.shape)
    at = list(i)
    at[dim] = k
    inb = tvm.tirx.all(*[i[d] < index.shape[d] for d in range(nd) if d != dim]) if nd > 1 else \
        tvm.tirx.const(True, "bool")
    hit = tvm.tirx.if_then_else(
        inb, wrap_index(cast(index[tuple(at)], IDX), x.shape[dim]) == i[dim], tvm.tirx.const(False, "bool"))
    return hit, tuple(at)


@lowering("scatter.value", "scatter.src", "scatter.value_reduce", "scatter.reduce")
def _scatter(ctx, ins, attrs, outs):
    """out = self; out[..., index[..., k, ...], ...] = src[..., k, ...] (or value) along dim."""
    x, index = ins[0], ins[1]
    src = ins[2] if len(ins) > 2 else None
    if attrs.get("reduce") is not None:
        raise InternalError("scatter with reduce= is not lowered (use scatter_add / scatter_reduce)")
    nd = len(x.shape)
    dim = norm_dim(attrs["dim"], nd)
    cd = outs[0].dtype
    val = None if src is not None else const(attrs["value"], cd)
    n = index.shape[dim]
    if isinstance(n, tvm.tirx.IntImm) and int(n) <= UNROLLED_WRITERS:
        # a few writers per slice (a decode step's one row): each output element tests them in order, the last
        # hit wins; no [x]-sized table of hits written and read back (3 such scatters, one per layer, were
        # 1 ms of a batch-8 DeepSeek-V4 decode step)
        def unrolled(*i):
            out = cast(x[i], cd)
            for k in range(int(n)):
                hit, at = _writes(x, index, dim, i, tvm.tirx.const(k, IDX))
                out = tvm.tirx.if_then_else(hit, val if src is None else cast(src[at], cd), out)
            return out
        return te.compute(ctx.shape(outs[0].shape), unrolled, name="T")
    hit = _scatter_hit(ctx, x, index, dim, "last")

    def body(*i):
        h = hit[i]
        if src is None:
            return tvm.tirx.Select(h >= 0, val, cast(x[i], cd))
        s_idx = list(i)
        s_idx[dim] = tvm.tirx.max(h, tvm.tirx.const(0, IDX))
        return tvm.tirx.if_then_else(h >= 0, cast(src[tuple(s_idx)], cd), cast(x[i], cd))
    return te.compute(ctx.shape(outs[0].shape), body, name="T")


@lowering("scatter_add", "scatter_reduce.two")
def _scatter_add(ctx, ins, attrs, outs):
    x, index, src = ins
    reduce = attrs.get("reduce", "sum")
    if reduce not in ("sum", "amax", "amin") or not attrs.get("include_self", True):
        raise InternalError(f"scatter_reduce {reduce} (include_self={attrs.get('include_self')}) is not lowered")
    nd = len(x.shape)
    dim = norm_dim(attrs["dim"], nd)
    cd = outs[0].dtype
    k = te.reduce_axis((0, index.shape[dim]), name="k")
    ident = {"sum": const(0, cd), "amax": tvm.tirx.min_value(cd), "amin": tvm.tirx.max_value(cd)}[reduce]

    def body(*i):
        hit, at = _writes(x, index, dim, i, k)
        v = tvm.tirx.if_then_else(hit, cast(src[at], cd), ident)
        return {"sum": te.sum, "amax": te.max, "amin": te.min}[reduce](v, axis=k)
    acc = te.compute(x.shape, body, name="acc")
    comb = {"sum": lambda a, b: a + b, "amax": tvm.tirx.max, "amin": tvm.tirx.min}[reduce]
    return te.compute(ctx.shape(outs[0].shape), lambda *i: comb(cast(x[i], cd), acc[i]), name="T")


@lowering("index_put")
def _index_put(ctx, ins, attrs, outs):
    """out = self; out[indices] = values (accumulate: +=). Bool masks select where true; integer index tensors
    broadcast together and address the leading indexed dimensions (last writer wins on duplicates)."""
    x, idx_ts, values = ins[0], list(ins[1:-1]), ins[-1]
    present = list(attrs["indices"]) + [False] * (len(x.shape) - len(attrs["indices"]))
    nd = len(x.shape)
    cd = outs[0].dtype
    acc = attrs.get("accumulate", False)
    if len(idx_ts) == 1 and dtype_of(idx_ts[0]) in ("bool", "uint8"):
        m = idx_ts[0]
        first = present.index(True)
        mnd = len(m.shape)
        if mnd == nd - first and not acc:
            # values broadcast against the (masked) result: only the 0-d / trailing-dims-broadcast form is
            # well defined without knowing how many entries are true
            vnd = len(values.shape)
            if all(isinstance(d, tvm.tirx.IntImm) and int(d) == 1 for d in values.shape):
                def body(*i):
                    mv = bcast_load(m, list(i[first:]), mnd) if mnd else m()
                    v = values(*[tvm.tirx.const(0, IDX)] * vnd)
                    return tvm.tirx.Select(mv.astype("bool"), cast(v, cd), cast(x[i], cd))
                return te.compute(ctx.shape(outs[0].shape), body, name="T")
        raise InternalError("index_put with a boolean mask is lowered only for mask over trailing dims and a "
                            "broadcast value")
    pos = [k for k, p in enumerate(present) if p]
    if pos != list(range(len(pos))):
        raise InternalError("index_put is lowered for leading index tensors only")
    bshape = list(idx_ts[0].shape)
    for t in idx_ts[1:]:
        if len(t.shape) > len(bshape):
            bshape = list(t.shape)
    bnd = len(bshape)
    # one flat reduction over the broadcast index positions
    raxes = [te.reduce_axis((0, d), name=f"k{j}") for j, d in enumerate(bshape)]
    npos = len(pos)
    rest = nd - npos

    def match(i):
        conds = []
        for j, t in enumerate(idx_ts):
            conds.append(wrap_index(cast(bcast_load(t, raxes, bnd), IDX), x.shape[pos[j]]) == i[j])
        return tvm.tirx.all(*conds) if len(conds) > 1 else conds[0]

    def vload(i):
        # values broadcast to [*bshape, *x.shape[npos:]]
        return cast(bcast_load(values, list(raxes) + list(i[npos:]), bnd + rest), cd)
    if acc:
        s = te.compute(x.shape, lambda *i: te.sum(tvm.tirx.if_then_else(match(i), vload(i), const(0, cd)),
                                                 axis=raxes), name="acc")
        return te.compute(ctx.shape(outs[0].shape), lambda *i: cast(x[i], cd) + s[i], name="T")
    strides = []
    acc_s = tvm.tirx.const(1, IDX)
    for d in reversed(bshape):
        strides.insert(0, acc_s)
        acc_s = acc_s * d
    flat = fold(lambda a, b: a + b, [cast(r, IDX) * st for r, st in zip(raxes, strides)])
    hit = te.compute(x.shape, lambda *i: te.max(tvm.tirx.Select(match(i), flat, tvm.tirx.const(-1, IDX)),
                                                 axis=raxes), name="hit")

    def body(*i):
        h = hit[i]
        hc = tvm.tirx.max(h, tvm.tirx.const(0, IDX))
        bidx, r = [], hc
        for d in reversed(bshape):
            bidx.insert(0, tvm.tirx.floormod(r, d))
            r = tvm.tirx.floordiv(r, d)
        v = cast(bcast_load(values, bidx + list(i[npos:]), bnd + rest), cd)
        return tvm.tirx.if_then_else(h >= 0, v, cast(x[i], cd))
    return te.compute(ctx.shape(outs[0].shape), body, name="T")


@lowering("index_select")
def _index_select(ctx, ins, attrs, outs):
    x, index = ins
    return _take(ctx, x, attrs, outs, lambda i, dim: index[i[dim]] if len(index.shape) else index())
