"""Lowering: one IR node -> a TE compute (TVM's op definition language), per op.

``LOWERINGS[op](ctx, ins, attrs, out_types)`` returns the output ``te.Tensor`` (or a list, for multi-output
ops). ``ins`` are placeholders shaped like the node's inputs; symbolic dimensions are ``int64`` TIR variables
named after the graph's symbols (``seq``), so one compiled kernel serves every sequence length.

Semantics are ATen's (the IR speaks ATen): broadcasting aligns trailing dimensions, type promotion follows
``torch.result_type``, every value is a contiguous row-major tensor. Where TOPI has the op (topk, cumsum) we use
it; the rest are short ``te.compute`` definitions. The default schedules live in ``codegen/schedule.py``.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import sympy
import torch
import tvm
from tvm import te, topi

from dayzero import InternalError
from dayzero.passes.ir import ops
from dayzero.passes.ir.node import TensorType

IDX = "int64"


class Ctx:
    """Per-kernel state: the TIR variable of each symbol."""

    def __init__(self, bind: dict[str, int] | None = None):
        self.vars: dict[str, tvm.tirx.Var] = {}
        self.bind = dict(bind or {})  # symbols specialised to a value (tuning at a size, decode at seq=1)

    def dim(self, d) -> Any:
        if isinstance(d, int):
            return tvm.tirx.const(d, IDX)
        return _sym_to_tir(d, self)

    def shape(self, shape) -> list:
        return [self.dim(d) for d in shape]


def _sym_to_tir(e, ctx: Ctx):
    if e.is_Integer:
        return tvm.tirx.const(int(e), IDX)
    if e.is_Symbol:
        if e.name in ctx.bind:
            return tvm.tirx.const(ctx.bind[e.name], IDX)
        if e.name not in ctx.vars:
            ctx.vars[e.name] = te.var(e.name, dtype=IDX)
        return ctx.vars[e.name]
    args = [_sym_to_tir(a, ctx) for a in e.args]
    if isinstance(e, sympy.Add):
        out = args[0]
        for a in args[1:]:
            out = out + a
        return out
    if isinstance(e, sympy.Mul):
        out = args[0]
        for a in args[1:]:
            out = out * a
        return out
    if isinstance(e, sympy.floor) and isinstance(e.args[0], sympy.Mul):
        # floor(a / b) as sympy writes it: Mul(a, Pow(b, -1))
        num, den = e.args[0].as_numer_denom()
        return tvm.tirx.floordiv(_sym_to_tir(num, ctx), _sym_to_tir(den, ctx))
    if isinstance(e, sympy.Mod):
        return tvm.tirx.floormod(args[0], args[1])
    if type(e).__name__ == "Max":  # sympy's or torch's own (torch.utils._sympy.functions)
        return tvm.tirx.max(*args) if len(args) == 2 else _fold(tvm.tirx.max, args)
    if type(e).__name__ == "Min":
        return tvm.tirx.min(*args) if len(args) == 2 else _fold(tvm.tirx.min, args)
    if type(e).__name__ in ("FloorDiv",):  # torch's sympy FloorDiv
        return tvm.tirx.floordiv(args[0], args[1])
    raise InternalError(f"symbolic dimension {e} has no TIR form")


def _fold(f, args):
    out = args[0]
    for a in args[1:]:
        out = f(out, a)
    return out


# ---- helpers ------------------------------------------------------------------------------------------------

def _const(v, dtype: str):
    if dtype == "bool":
        return tvm.tirx.const(bool(v), "bool")
    if isinstance(v, float) and math.isinf(v):
        return tvm.tirx.max_value(dtype) if v > 0 else tvm.tirx.min_value(dtype) if not dtype.startswith("float") \
            else tvm.tirx.infinity(dtype) if v > 0 else -tvm.tirx.infinity(dtype)
    return tvm.tirx.const(v, dtype)


def _dt(x) -> str:
    """The dtype of a TIR expression (``.ty`` in TVM 0.27) or of a tensor / tensor element."""
    if isinstance(x, (te.Tensor, te.TensorSlice)):
        return str(x.dtype)
    return str(x.ty)


def _cast(x, dtype: str):
    if hasattr(x, "tensor") and hasattr(x, "indices"):  # TensorSlice -> load expression
        x = x.tensor(*x.indices)
    if hasattr(x, "asobject") and not hasattr(x, "ty"):  # a == b / a != b: TVM's lazy EqualOp / NotEqualOp
        x = x.asobject()
    if isinstance(x, tvm.tirx.IterVar):  # a reduction axis used as a value
        x = x.var
    return x if _dt(x) == dtype else x.astype(dtype)


def _bcast_load(t: te.Tensor, idx: list, out_ndim: int):
    """Load t at the broadcast of output index idx (trailing dimensions aligned, size-1 dims pinned to 0)."""
    nd = len(t.shape)
    sub = []
    for j in range(nd):
        i = idx[out_ndim - nd + j]
        d = t.shape[j]
        sub.append(tvm.tirx.const(0, IDX) if isinstance(d, tvm.tirx.IntImm) and int(d) == 1 else i)
    return t(*sub)


def _norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _result_dtype(ins: list[te.Tensor], scalars=()) -> str:
    metas = [torch.empty([1] * len(t.shape) if len(t.shape) else [], dtype=ops.torch_dtype(_dt(t)), device="meta")
             for t in ins]
    args = metas + list(scalars)
    dt = args[0] if len(args) == 1 else torch.result_type(args[0], args[1])
    if isinstance(dt, torch.Tensor):
        dt = dt.dtype
    for a in args[2:]:
        dt = torch.promote_types(dt, a.dtype if isinstance(a, torch.Tensor) else torch.tensor(a).dtype)
    return ops.dtype_name(dt)


LOWERINGS: dict[str, Callable] = {}

# op -> fn(node) -> a complete, already scheduled PrimFunc (``tirx.is_scheduled``) or None to fall back to
# LOWERINGS: for kernels TE cannot express (data-dependent loop bounds: grouped expert GEMM, sparse attention)
PRIMFUNCS: dict[str, Callable] = {}


def lowering(*names):
    def deco(fn):
        for n in names:
            LOWERINGS[n] = fn
        return fn
    return deco


# ---- elementwise --------------------------------------------------------------------------------------------

def _elementwise(ctx, ins, out: TensorType, fn, compute_dtype: str | None = None):
    shape = ctx.shape(out.shape)
    nd = len(shape)
    cd = compute_dtype

    def body(*idx):
        vals = [_bcast_load(t, list(idx), nd) for t in ins]
        if cd is not None:
            vals = [_cast(v, cd) for v in vals]
        return _cast(fn(*vals), out.dtype)
    return te.compute(shape, body, name="T")


_BINARY = {
    "add.Tensor": lambda a, b: a + b, "sub.Tensor": lambda a, b: a - b, "mul.Tensor": lambda a, b: a * b,
    "maximum": lambda a, b: tvm.tirx.max(a, b), "minimum": lambda a, b: tvm.tirx.min(a, b),
    "bitwise_and.Tensor": lambda a, b: a & b, "bitwise_or.Tensor": lambda a, b: a | b,
    "logical_and": lambda a, b: tvm.tirx.all(a.astype("bool"), b.astype("bool")),
    "logical_or": lambda a, b: tvm.tirx.any(a.astype("bool"), b.astype("bool")),
    "eq.Tensor": lambda a, b: a == b, "ne.Tensor": lambda a, b: a != b, "lt.Tensor": lambda a, b: a < b,
    "le.Tensor": lambda a, b: a <= b, "gt.Tensor": lambda a, b: a > b, "ge.Tensor": lambda a, b: a >= b,
    "pow.Tensor_Tensor": lambda a, b: tvm.tirx.power(a, b),
}


def _make_binary(name, fn):
    def lower(ctx, ins, attrs, outs):
        cd = _result_dtype(ins)
        alpha = attrs.get("alpha", 1)
        f = fn
        if alpha != 1:
            f = lambda a, b: fn(a, b * _const(alpha, cd))  # noqa: E731
        return _elementwise(ctx, ins, outs[0], f, cd)
    return lower


for _n, _f in _BINARY.items():
    LOWERINGS[_n] = _make_binary(_n, _f)


@lowering("div.Tensor", "div.Tensor_mode")
def _div(ctx, ins, attrs, outs):
    mode = attrs.get("rounding_mode")
    cd = _result_dtype(ins)
    if mode is None:
        cd = outs[0].dtype  # true division computes in the (floating) result dtype
        return _elementwise(ctx, ins, outs[0], lambda a, b: a / b, cd)
    if mode == "floor":
        if cd.startswith("float"):
            return _elementwise(ctx, ins, outs[0], lambda a, b: tvm.tirx.floor(a / b), cd)
        return _elementwise(ctx, ins, outs[0], lambda a, b: tvm.tirx.floordiv(a, b), cd)
    if cd.startswith("float"):
        return _elementwise(ctx, ins, outs[0], lambda a, b: tvm.tirx.trunc(a / b), cd)
    return _elementwise(ctx, ins, outs[0], lambda a, b: tvm.tirx.truncdiv(a, b), cd)


@lowering("remainder.Tensor")
def _remainder(ctx, ins, attrs, outs):
    cd = _result_dtype(ins)
    if cd.startswith("float"):
        return _elementwise(ctx, ins, outs[0], lambda a, b: a - tvm.tirx.floor(a / b) * b, cd)
    return _elementwise(ctx, ins, outs[0], lambda a, b: tvm.tirx.floormod(a, b), cd)


_SCALAR = {
    "add.Scalar": lambda a, s: a + s, "sub.Scalar": lambda a, s: a - s, "mul.Scalar": lambda a, s: a * s,
    "div.Scalar": lambda a, s: a / s, "eq.Scalar": lambda a, s: a == s, "ne.Scalar": lambda a, s: a != s,
    "lt.Scalar": lambda a, s: a < s, "le.Scalar": lambda a, s: a <= s, "gt.Scalar": lambda a, s: a > s,
    "ge.Scalar": lambda a, s: a >= s, "pow.Tensor_Scalar": None, "remainder.Scalar": None,
}


def _make_scalar(name, fn):
    def lower(ctx, ins, attrs, outs):
        s = attrs.get("other", attrs.get("exponent"))
        cd = _result_dtype(ins, [s])
        if name.startswith("div"):
            cd = outs[0].dtype
        sc = _const(s, cd)
        if name == "pow.Tensor_Scalar":
            if s == 2:
                return _elementwise(ctx, ins, outs[0], lambda a: a * a, cd)
            if s == 0.5:
                return _elementwise(ctx, ins, outs[0], lambda a: tvm.tirx.sqrt(a), cd)
            return _elementwise(ctx, ins, outs[0], lambda a: tvm.tirx.power(a, sc), cd)
        if name == "remainder.Scalar":
            if cd.startswith("float"):
                return _elementwise(ctx, ins, outs[0], lambda a: a - tvm.tirx.floor(a / sc) * sc, cd)
            return _elementwise(ctx, ins, outs[0], lambda a: tvm.tirx.floormod(a, sc), cd)
        return _elementwise(ctx, ins, outs[0], lambda a: fn(a, sc), cd)
    return lower


for _n, _f in _SCALAR.items():
    LOWERINGS[_n] = _make_scalar(_n, _f)


def _gelu(a):
    return a * _const(0.5, _dt(a)) * (_const(1.0, _dt(a)) + tvm.tirx.erf(a * _const(1 / math.sqrt(2), _dt(a))))


def _gelu_tanh(a):
    c = _const(math.sqrt(2 / math.pi), _dt(a))
    return a * _const(0.5, _dt(a)) * (_const(1.0, _dt(a)) + tvm.tirx.tanh(c * (a + _const(0.044715, _dt(a)) * a * a * a)))


_UNARY = {
    "neg": lambda a: -a, "exp": tvm.tirx.exp, "log": tvm.tirx.log, "sqrt": tvm.tirx.sqrt, "rsqrt": tvm.tirx.rsqrt,
    "sin": tvm.tirx.sin, "cos": tvm.tirx.cos, "tanh": tvm.tirx.tanh, "sigmoid": tvm.tirx.sigmoid,
    "erf": tvm.tirx.erf, "log1p": tvm.tirx.log1p, "expm1": lambda a: tvm.tirx.exp(a) - _const(1.0, _dt(a)), "abs": tvm.tirx.abs, "floor": tvm.tirx.floor, "ceil": tvm.tirx.ceil,
    "reciprocal": lambda a: _const(1.0, _dt(a)) / a, "relu": lambda a: tvm.tirx.max(a, _const(0, _dt(a))),
    "silu": lambda a: a * tvm.tirx.sigmoid(a), "logical_not": lambda a: tvm.tirx.Not(a.astype("bool")),
    "bitwise_not": lambda a: tvm.tirx.Not(a) if _dt(a) == "bool" else ~a,
    "softplus": lambda a: tvm.tirx.log(_const(1.0, _dt(a)) + tvm.tirx.exp(a)),
    "isnan": tvm.tirx.isnan, "isinf": tvm.tirx.isinf, "sign": lambda a: tvm.tirx.Select(
        a > _const(0, _dt(a)), _const(1, _dt(a)), tvm.tirx.Select(a < _const(0, _dt(a)), _const(-1, _dt(a)),
                                                                     _const(0, _dt(a)))),
}


def _make_unary(fn):
    def lower(ctx, ins, attrs, outs):
        cd = _dt(ins[0]) if not outs[0].dtype.startswith("float") or outs[0].dtype == "bool" else outs[0].dtype
        if _dt(ins[0]) == "bool" or outs[0].dtype == "bool":
            cd = _dt(ins[0])
        return _elementwise(ctx, ins, outs[0], fn, cd)
    return lower


for _n, _f in _UNARY.items():
    LOWERINGS[_n] = _make_unary(_f)


@lowering("gelu")
def _gelu_op(ctx, ins, attrs, outs):
    fn = _gelu_tanh if attrs.get("approximate") == "tanh" else _gelu
    return _elementwise(ctx, ins, outs[0], fn, outs[0].dtype)


@lowering("clamp", "clamp.Tensor")
def _clamp(ctx, ins, attrs, outs):
    cd = outs[0].dtype
    lo, hi = attrs.get("min"), attrs.get("max")
    if "min" in attrs and isinstance(attrs["min"], bool):  # clamp.Tensor: presence flags, tensors are inputs
        tens = list(ins[1:])
        lo_t = tens.pop(0) if attrs["min"] else None
        hi_t = tens.pop(0) if attrs["max"] else None
        shape = ctx.shape(outs[0].shape)
        nd = len(shape)

        def body(*idx):
            v = _cast(_bcast_load(ins[0], list(idx), nd), cd)
            if lo_t is not None:
                v = tvm.tirx.max(v, _cast(_bcast_load(lo_t, list(idx), nd), cd))
            if hi_t is not None:
                v = tvm.tirx.min(v, _cast(_bcast_load(hi_t, list(idx), nd), cd))
            return v
        return te.compute(shape, body, name="T")

    def f(a):
        if lo is not None:
            a = tvm.tirx.max(a, _const(lo, cd))
        if hi is not None:
            a = tvm.tirx.min(a, _const(hi, cd))
        return a
    return _elementwise(ctx, ins, outs[0], f, cd)


@lowering("where.self")
def _where(ctx, ins, attrs, outs):
    cd = outs[0].dtype
    return _elementwise(ctx, ins, outs[0], lambda c, a, b: tvm.tirx.Select(c.astype("bool"), _cast(a, cd), _cast(b, cd)))


@lowering("masked_fill.Scalar")
def _masked_fill(ctx, ins, attrs, outs):
    cd = outs[0].dtype
    v = _const(attrs["value"], cd)
    return _elementwise(ctx, ins, outs[0], lambda a, m: tvm.tirx.Select(m.astype("bool"), v, _cast(a, cd)))


@lowering("_to_copy", "to.dtype", "type_as")
def _to_copy(ctx, ins, attrs, outs):
    return _elementwise(ctx, ins[:1], outs[0], lambda a: a)


@lowering("expand", "expand_copy", "broadcast_to")
def _expand(ctx, ins, attrs, outs):
    return _elementwise(ctx, ins[:1], outs[0], lambda a: a)


# ---- creation -----------------------------------------------------------------------------------------------

@lowering("scalar_tensor", "full", "full_like", "new_full", "zeros_like", "ones_like", "new_zeros", "new_ones",
          "zeros", "ones")
def _fill(ctx, ins, attrs, outs):
    out = outs[0]
    v = attrs.get("s", attrs.get("fill_value"))
    if v is None:
        v = 1 if "ones" in attrs["__op__"] else 0
    c = _cast(ctx.dim(v), out.dtype) if isinstance(v, sympy.Basic) else _const(v, out.dtype)  # SymInt fill
    return te.compute(ctx.shape(out.shape), lambda *i: c, name="T")


@lowering("arange.start_step", "arange", "arange.start")
def _arange(ctx, ins, attrs, outs):
    out = outs[0]
    start, step = attrs.get("start", 0) or 0, attrs.get("step", 1) or 1
    cd = "float32" if out.dtype.startswith("float") or isinstance(start, float) or isinstance(step, float) else IDX
    s0 = _const(start, cd) if not isinstance(start, sympy.Basic) else _cast(ctx.dim(start), cd)
    st = _const(step, cd)
    return te.compute(ctx.shape(out.shape), lambda i: _cast(s0 + _cast(i, cd) * st, out.dtype), name="T")


# ---- shape ops (copies; pure views are aliases in the runtime) ----------------------------------------------

@lowering("permute", "permute_copy")
def _permute(ctx, ins, attrs, outs):
    x = ins[0]
    dims = [_norm_dim(d, len(x.shape)) for d in attrs["dims"]]
    inv = [dims.index(i) for i in range(len(dims))]
    return te.compute(ctx.shape(outs[0].shape), lambda *i: x[tuple(i[inv[k]] for k in range(len(dims)))], name="T")


@lowering("transpose.int")
def _transpose(ctx, ins, attrs, outs):
    x = ins[0]
    nd = len(x.shape)
    d0, d1 = _norm_dim(attrs["dim0"], nd), _norm_dim(attrs["dim1"], nd)
    perm = list(range(nd))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return te.compute(ctx.shape(outs[0].shape), lambda *i: x[tuple(i[perm[k]] for k in range(nd))], name="T")


# Python slices with an open end reach ATen as end=INT64_MAX (``x[:, 1:]``). No tensor dimension comes near
# 2**31, so any index attribute at least that large means "to the end" (or "from the start" when negative) and
# is replaced by the size itself: a constant like INT64_MAX must never reach TIR, where the simplifier rewrites
# an index test through a fused loop (``fused // 32 < C`` into ``fused < 32*C``) and the product wraps around,
# turning the test false for every element (slice_scatter then copied nothing).
_OPEN = 1 << 31


def _normalize_start(ctx, start, size):
    if start is None or (isinstance(start, int) and start <= -_OPEN):
        return tvm.tirx.const(0, IDX)
    if isinstance(start, int) and start >= _OPEN:
        return size
    if isinstance(start, int):
        if start >= 0:
            return tvm.tirx.min(tvm.tirx.const(start, IDX), size)
        return tvm.tirx.max(size + tvm.tirx.const(start, IDX), tvm.tirx.const(0, IDX))
    return tvm.tirx.min(ctx.dim(start), size)


@lowering("slice.Tensor", "slice_copy.Tensor")
def _slice(ctx, ins, attrs, outs):
    x = ins[0]
    nd = len(x.shape)
    dim = _norm_dim(attrs["dim"], nd)
    start = _normalize_start(ctx, attrs.get("start"), x.shape[dim])
    step = attrs.get("step", 1) or 1

    def body(*i):
        idx = list(i)
        idx[dim] = start + i[dim] * tvm.tirx.const(step, IDX)
        return x[tuple(idx)]
    return te.compute(ctx.shape(outs[0].shape), body, name="T")


@lowering("select.int")
def _select(ctx, ins, attrs, outs):
    x = ins[0]
    nd = len(x.shape)
    dim = _norm_dim(attrs["dim"], nd)
    index = attrs["index"]
    ix = ctx.dim(index) if isinstance(index, sympy.Basic) else tvm.tirx.const(index, IDX)
    if isinstance(index, int) and index < 0:
        ix = x.shape[dim] + ix

    def body(*i):
        idx = list(i[:dim]) + [ix] + list(i[dim:])
        return x[tuple(idx)]
    return te.compute(ctx.shape(outs[0].shape), body, name="T")


@lowering("cat")
def _cat(ctx, ins, attrs, outs):
    out = outs[0]
    nd = len(out.shape)
    dim = _norm_dim(attrs.get("dim", 0), nd)
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
            v = _cast(t[tuple(idx)], out.dtype)
            val = v if val is None else tvm.tirx.if_then_else(i[dim] >= off, v, val)
        return val
    return te.compute(ctx.shape(out.shape), body, name="T")


@lowering("split_with_sizes", "split.Tensor")
def _split(ctx, ins, attrs, outs):
    x = ins[0]
    nd = len(x.shape)
    dim = _norm_dim(attrs.get("dim", 0), nd)
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


# ---- indexing -----------------------------------------------------------------------------------------------

def _wrap(i, size):
    return tvm.tirx.Select(i < tvm.tirx.const(0, _dt(i)), i + _cast(size, _dt(i)), i)


@lowering("embedding")
def _embedding(ctx, ins, attrs, outs):
    w, ids = ins
    ni = len(ids.shape)
    return te.compute(ctx.shape(outs[0].shape),
                      lambda *i: w[_cast(ids[tuple(i[:ni])], IDX), i[ni]], name="T")


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
                src.append(_wrap(_cast(_bcast_load(t, b, bnd), IDX), x.shape[k]))
            else:
                src.append(next(r))
        return x[tuple(src)]
    return te.compute(ctx.shape(outs[0].shape), body, name="T")


@lowering("gather")
def _gather(ctx, ins, attrs, outs):
    x, index = ins
    dim = _norm_dim(attrs["dim"], len(x.shape))

    def body(*i):
        src = list(i)
        src[dim] = _wrap(_cast(index[i], IDX), x.shape[dim])
        return x[tuple(src)]
    return te.compute(ctx.shape(outs[0].shape), body, name="T")


# ---- reductions ---------------------------------------------------------------------------------------------

def _reduce_axes(extents: dict):
    """Reduce axes ({name: extent}) whose loops run at least once, and the mask of their real iterations (None:
    every iteration is real).

    TVM writes a reduction's initial value inside its loop nest, at the first iteration, so a reduction over an
    extent that is 0 (statically, or at run: ``seq - 1`` at seq 1) never writes its output: sum of nothing gave
    whatever the arena held. An extent not provably >= 1 (symbols are >= 1) loops ``max(extent, 1)`` times, and
    the caller reduces the identity where the mask is false."""
    axes, masks = [], []
    for name, e in extents.items():
        ana = tvm.sym.Analyzer()
        for v in tvm.tirx.analysis.undefined_vars(e):
            ana.bind(v, tvm.ir.Range(1, 1 << 31))
        if ana.can_prove(e >= 1):
            axes.append(te.reduce_axis((0, e), name=name))
        else:
            axes.append(te.reduce_axis((0, tvm.tirx.max(e, tvm.tirx.const(1, IDX))), name=name))
            masks.append(axes[-1].var < e)
    return axes, (tvm.tirx.all(*masks) if masks else None)


def _masked(mask, v, identity):
    return v if mask is None else tvm.tirx.if_then_else(mask, v, identity)


def _reduce(ctx, ins, attrs, outs, kind: str):
    x = ins[0]
    nd = len(x.shape)
    dims = attrs.get("dim")
    dims = list(range(nd)) if dims is None or dims == () else [_norm_dim(d, nd) for d in
                                                               (dims if isinstance(dims, tuple) else (dims,))]
    keep = attrs.get("keepdim", False)
    out = outs[0]
    cd = out.dtype if kind in ("sum", "mean") else _dt(x)
    if kind in ("sum", "mean") and not cd.startswith("float"):
        cd = out.dtype
    axes, mask = _reduce_axes({f"r{d}": x.shape[d] for d in dims})

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
        v = _cast(x[tuple(src)], cd)
        if kind in ("sum", "mean"):
            return te.sum(_masked(mask, v, _const(0, cd)), axis=axes)
        if kind == "amax":
            return te.max(_masked(mask, v, tvm.tirx.min_value(cd)), axis=axes)
        if kind == "amin":
            return te.min(_masked(mask, v, tvm.tirx.max_value(cd)), axis=axes)
        if kind == "any":
            return te.max(_masked(mask, v.astype("int8"), _const(0, "int8")), axis=axes)
        if kind == "all":
            return te.min(_masked(mask, v.astype("int8"), _const(1, "int8")), axis=axes)
        raise InternalError(kind)
    r = te.compute(ctx.shape(out.shape), body, name="R")
    if kind == "mean":
        count = _fold(lambda a, b: a * b, [x.shape[d] for d in dims])
        return te.compute(r.shape, lambda *i: _cast(r[i] / _cast(count, cd), out.dtype), name="T")
    if _dt(r) != out.dtype:
        return te.compute(r.shape, lambda *i: _cast(r[i], out.dtype), name="T")
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
    dim = _norm_dim(dim, nd)
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
            return te.compute(ctx.shape(outs[0].shape), lambda *o: _cast(t[tuple(o[:dim] + o[dim + 1:])], dtype),
                              name="K")
        return te.compute(t.shape, lambda *o: _cast(t[o], dtype), name="K")
    if name in ("argmax", "argmin"):
        return keepd(idx, outs[0].dtype)
    return [keepd(val, outs[0].dtype), keepd(idx, outs[1].dtype)]


@lowering("softmax.int", "_softmax", "_log_softmax", "log_softmax.int")
def _softmax(ctx, ins, attrs, outs):
    name = attrs["__op__"]
    x = ins[0]
    nd = len(x.shape)
    dim = _norm_dim(attrs["dim"], nd)
    cd = outs[0].dtype
    red_shape = [x.shape[j] for j in range(nd) if j != dim]

    def full(i, j):
        return list(i[:dim]) + [j] + list(i[dim:])
    k1 = te.reduce_axis((0, x.shape[dim]), name="k1")
    mx = te.compute(red_shape, lambda *i: te.max(_cast(x[tuple(full(i, k1))], cd), axis=k1), name="mx")
    k2 = te.reduce_axis((0, x.shape[dim]), name="k2")
    se = te.compute(red_shape, lambda *i: te.sum(tvm.tirx.exp(_cast(x[tuple(full(i, k2))], cd) - mx[i]), axis=k2),
                    name="se")

    def body(*i):
        r = tuple(i[:dim] + i[dim + 1:])
        v = _cast(x[i], cd) - mx[r]
        if "log" in name:
            return v - tvm.tirx.log(se[r])
        return tvm.tirx.exp(v) / se[r]
    return te.compute(ctx.shape(outs[0].shape), body, name="T")


@lowering("cumsum")
def _cumsum(ctx, ins, attrs, outs):
    x = ins[0]
    dim = _norm_dim(attrs["dim"], len(x.shape))
    xc = te.compute(x.shape, lambda *i: _cast(x[i], outs[0].dtype), name="C") if _dt(x) != outs[0].dtype else x
    return topi.cumsum(xc, axis=dim, dtype=outs[0].dtype)


@lowering("topk")
def _topk(ctx, ins, attrs, outs):
    x = ins[0]
    nd = len(x.shape)
    dim = _norm_dim(attrs.get("dim", -1), nd)
    largest = attrs.get("largest", True)
    vals, idxs = topi.topk(x, k=attrs["k"], axis=dim, ret_type="both", is_ascend=not largest, dtype=outs[1].dtype)
    return [vals, idxs]


@lowering("sort")
def _sort(ctx, ins, attrs, outs):
    x = ins[0]
    dim = _norm_dim(attrs.get("dim", -1), len(x.shape))
    idx = topi.argsort(x, axis=dim, is_ascend=not attrs.get("descending", False), dtype=outs[1].dtype)
    vals = te.compute(x.shape, lambda *i: x[tuple(list(i[:dim]) + [idx[i]] + list(i[dim + 1:]))], name="V")
    return [vals, idx]


# ---- contractions -------------------------------------------------------------------------------------------

@lowering("linear")
def _linear(ctx, ins, attrs, outs):
    """out[..., n] = sum_k x[..., k] * w[n, k] (+ b[n]); x [..., K], w [N, K], b [N]."""
    x, w = ins[0], ins[1]
    b = ins[2] if attrs.get("bias") else None
    nd = len(x.shape)
    (k,), mask = _reduce_axes({"k": x.shape[nd - 1]})
    out = outs[0]
    cd = out.dtype if out.dtype.startswith("float") else "float32"
    acc = "float32" if cd in ("bfloat16", "float16") else cd

    def body(*i):
        return te.sum(_masked(mask, _cast(x[tuple(i[:-1]) + (k,)], acc) * _cast(w[i[-1], k], acc),
                              _const(0, acc)), axis=k)
    mm = te.compute(ctx.shape(out.shape), body, name="matmul")
    if b is None and acc == out.dtype:
        return mm
    return te.compute(mm.shape, lambda *i: _cast(mm[i] + (_cast(b[i[-1]], acc) if b is not None else 0), out.dtype),
                      name="T")


@lowering("mm", "bmm", "matmul")
def _mm(ctx, ins, attrs, outs):
    """out[..., m, n] = sum_k a[..., m, k] * b[..., k, n]; leading dims broadcast."""
    a, b = ins
    out = outs[0]
    nd = len(out.shape)
    (k,), mask = _reduce_axes({"k": a.shape[len(a.shape) - 1]})
    acc = "float32" if out.dtype in ("bfloat16", "float16") else out.dtype

    def body(*i):
        lead = list(i[:-2])
        ai = _bcast_load_lead(a, lead, nd - 2) + [i[-2], k]
        bi = _bcast_load_lead(b, lead, nd - 2) + [k, i[-1]]
        return te.sum(_masked(mask, _cast(a[tuple(ai)], acc) * _cast(b[tuple(bi)], acc), _const(0, acc)), axis=k)
    mm = te.compute(ctx.shape(out.shape), body, name="matmul")
    if acc == out.dtype:
        return mm
    return te.compute(mm.shape, lambda *i: _cast(mm[i], out.dtype), name="T")


def _bcast_load_lead(t, lead, nlead):
    tl = len(t.shape) - 2
    sub = []
    for j in range(tl):
        i = lead[nlead - tl + j]
        d = t.shape[j]
        sub.append(tvm.tirx.const(0, IDX) if isinstance(d, tvm.tirx.IntImm) and int(d) == 1 else i)
    return sub


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
    sc = _const(scale if scale is not None else 1.0 / math.sqrt(int(D)), cd)
    group = tvm.tirx.floordiv(H, Hk)
    causal = attrs.get("is_causal", False)
    d = te.reduce_axis((0, D), name="d")
    neg_inf = -tvm.tirx.infinity(cd)

    def score(b, h, i, j):
        return te.sum(_cast(q[b, h, i, d], cd) * _cast(k[b, tvm.tirx.floordiv(h, group), j, d], cd), axis=d)
    s = te.compute((q.shape[0], H, L, S), score, name="scores")

    def masked(b, h, i, j):
        val = s[b, h, i, j] * sc
        if mask is not None:
            m = _bcast_load(mask, [b, h, i, j], 4)
            val = tvm.tirx.Select(m.astype("bool"), val, neg_inf) if _dt(mask) == "bool" else val + _cast(m, cd)
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
        p[b, h, i, j3] * _cast(v[b, tvm.tirx.floordiv(h, group), j3, e], cd), axis=j3), name="pv")
    return te.compute(o.shape, lambda b, h, i, e: _cast(o[b, h, i, e] / den[b, h, i], out.dtype), name="T")


@lowering("rms_norm")
def _rms_norm(ctx, ins, attrs, outs):
    x = ins[0]
    w = ins[1] if attrs.get("weight") else None
    nshape = attrs["normalized_shape"]
    if len(nshape) != 1:
        raise InternalError("rms_norm over more than one dimension")
    nd = len(x.shape)
    eps = attrs.get("eps") or float(torch.finfo(ops.torch_dtype(_dt(x))).eps)
    k = te.reduce_axis((0, x.shape[nd - 1]), name="k")
    ss = te.compute(x.shape[:-1], lambda *i: te.sum(_cast(x[i + (k,)], "float32") * _cast(x[i + (k,)], "float32"), axis=k), name="ss")
    n = _cast(x.shape[nd - 1], "float32")

    def body(*i):
        y = _cast(x[i], "float32") * tvm.tirx.rsqrt(ss[i[:-1]] / n + _const(eps, "float32"))
        if w is not None:
            y = y * _cast(w[i[-1]], "float32")
        return _cast(y, outs[0].dtype)
    return te.compute(x.shape, body, name="T")


# ---- scatter family and in-place-style updates ---------------------------------------------------------------

@lowering("empty.memory_format", "empty_like", "new_empty")
def _empty(ctx, ins, attrs, outs):
    # contents are undefined in ATen; zeros keep runs reproducible (every reader overwrites them first)
    return te.compute(ctx.shape(outs[0].shape), lambda *i: _const(0, outs[0].dtype), name="T")


@lowering("copy", "fill.Tensor")
def _copy(ctx, ins, attrs, outs):
    """copy(self, src): src broadcast to self's shape, in self's dtype."""
    return _elementwise(ctx, ins[1:2], outs[0], lambda a: a)


@lowering("fill.Scalar")
def _fill_scalar(ctx, ins, attrs, outs):
    c = _const(attrs["value"], outs[0].dtype)
    return te.compute(ctx.shape(outs[0].shape), lambda *i: c, name="T")


def _slice_bounds(ctx, attrs, size):
    """ATen's slice normalisation: negative start/end count from the end, both clamp to [0, size]."""
    zero = tvm.tirx.const(0, IDX)

    def norm(v, default):
        if v is None or (isinstance(v, int) and v >= _OPEN):
            return default if v is None else size
        if isinstance(v, int) and v <= -_OPEN:
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
    dim = _norm_dim(attrs.get("dim", 0), nd)
    step = attrs.get("step", 1) or 1
    start, end = _slice_bounds(ctx, attrs, x.shape[dim])
    cd = outs[0].dtype
    st = tvm.tirx.const(step, IDX)

    def body(*i):
        j = i[dim]
        inside = tvm.tirx.all(j >= start, j < end, tvm.tirx.floormod(j - start, st) == 0)
        idx = list(i)
        idx[dim] = tvm.tirx.floordiv(j - start, st)
        return tvm.tirx.if_then_else(inside, _cast(src[tuple(idx)], cd), _cast(x[i], cd))
    return te.compute(ctx.shape(outs[0].shape), body, name="T")


def _scatter_hit(ctx, x, index, dim, mode):
    """For every position of x: the position k along ``dim`` of the index entry that writes it.

    mode "last": the largest such k (ATen leaves duplicates unspecified; the CPU kernel's serial loop makes the
    last writer win, and so do we), -1 when none; the other coordinates must lie inside index's extent.
    """
    nd = len(x.shape)
    k = te.reduce_axis((0, index.shape[dim]), name="k")

    def body(*i):
        src = list(i)
        src[dim] = k
        inb = tvm.tirx.all(*[i[d] < index.shape[d] for d in range(nd) if d != dim]) if nd > 1 else \
            tvm.tirx.const(True, "bool")
        hit = tvm.tirx.if_then_else(
            inb, _wrap(_cast(index[tuple(src)], IDX), x.shape[dim]) == i[dim], tvm.tirx.const(False, "bool"))
        return te.max(tvm.tirx.Select(hit, _cast(k, IDX), tvm.tirx.const(-1, IDX)), axis=k)
    return te.compute(x.shape, body, name="hit")


@lowering("scatter.value", "scatter.src", "scatter.value_reduce", "scatter.reduce")
def _scatter(ctx, ins, attrs, outs):
    """out = self; out[..., index[..., k, ...], ...] = src[..., k, ...] (or value) along dim."""
    x, index = ins[0], ins[1]
    src = ins[2] if len(ins) > 2 else None
    if attrs.get("reduce") is not None:
        raise InternalError("scatter with reduce= is not lowered (use scatter_add / scatter_reduce)")
    nd = len(x.shape)
    dim = _norm_dim(attrs["dim"], nd)
    cd = outs[0].dtype
    hit = _scatter_hit(ctx, x, index, dim, "last")
    val = None if src is not None else _const(attrs["value"], cd)

    def body(*i):
        h = hit[i]
        if src is None:
            return tvm.tirx.Select(h >= 0, val, _cast(x[i], cd))
        s_idx = list(i)
        s_idx[dim] = tvm.tirx.max(h, tvm.tirx.const(0, IDX))
        return tvm.tirx.if_then_else(h >= 0, _cast(src[tuple(s_idx)], cd), _cast(x[i], cd))
    return te.compute(ctx.shape(outs[0].shape), body, name="T")


@lowering("scatter_add", "scatter_reduce.two")
def _scatter_add(ctx, ins, attrs, outs):
    x, index, src = ins
    reduce = attrs.get("reduce", "sum")
    if reduce not in ("sum", "amax", "amin") or not attrs.get("include_self", True):
        raise InternalError(f"scatter_reduce {reduce} (include_self={attrs.get('include_self')}) is not lowered")
    nd = len(x.shape)
    dim = _norm_dim(attrs["dim"], nd)
    cd = outs[0].dtype
    k = te.reduce_axis((0, index.shape[dim]), name="k")
    ident = {"sum": _const(0, cd), "amax": tvm.tirx.min_value(cd), "amin": tvm.tirx.max_value(cd)}[reduce]

    def body(*i):
        si = list(i)
        si[dim] = k
        inb = tvm.tirx.all(*[i[d] < index.shape[d] for d in range(nd) if d != dim]) if nd > 1 else \
            tvm.tirx.const(True, "bool")
        hit = tvm.tirx.if_then_else(
            inb, _wrap(_cast(index[tuple(si)], IDX), x.shape[dim]) == i[dim], tvm.tirx.const(False, "bool"))
        v = tvm.tirx.if_then_else(hit, _cast(src[tuple(si)], cd), ident)
        return {"sum": te.sum, "amax": te.max, "amin": te.min}[reduce](v, axis=k)
    acc = te.compute(x.shape, body, name="acc")
    comb = {"sum": lambda a, b: a + b, "amax": tvm.tirx.max, "amin": tvm.tirx.min}[reduce]
    return te.compute(ctx.shape(outs[0].shape), lambda *i: comb(_cast(x[i], cd), acc[i]), name="T")


@lowering("index_put")
def _index_put(ctx, ins, attrs, outs):
    """out = self; out[indices] = values (accumulate: +=). Bool masks select where true; integer index tensors
    broadcast together and address the leading indexed dimensions (last writer wins on duplicates)."""
    x, idx_ts, values = ins[0], list(ins[1:-1]), ins[-1]
    present = list(attrs["indices"]) + [False] * (len(x.shape) - len(attrs["indices"]))
    nd = len(x.shape)
    cd = outs[0].dtype
    acc = attrs.get("accumulate", False)
    if len(idx_ts) == 1 and _dt(idx_ts[0]) in ("bool", "uint8"):
        m = idx_ts[0]
        first = present.index(True)
        mnd = len(m.shape)
        if mnd == nd - first and not acc:
            # values broadcast against the (masked) result: only the 0-d / trailing-dims-broadcast form is
            # well defined without knowing how many entries are true
            vnd = len(values.shape)
            if all(isinstance(d, tvm.tirx.IntImm) and int(d) == 1 for d in values.shape):
                def body(*i):
                    mv = _bcast_load(m, list(i[first:]), mnd) if mnd else m()
                    v = values(*[tvm.tirx.const(0, IDX)] * vnd)
                    return tvm.tirx.Select(mv.astype("bool"), _cast(v, cd), _cast(x[i], cd))
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
            conds.append(_wrap(_cast(_bcast_load(t, raxes, bnd), IDX), x.shape[pos[j]]) == i[j])
        return tvm.tirx.all(*conds) if len(conds) > 1 else conds[0]

    def vload(i):
        # values broadcast to [*bshape, *x.shape[npos:]]
        return _cast(_bcast_load(values, list(raxes) + list(i[npos:]), bnd + rest), cd)
    if acc:
        s = te.compute(x.shape, lambda *i: te.sum(tvm.tirx.if_then_else(match(i), vload(i), _const(0, cd)),
                                                 axis=raxes), name="acc")
        return te.compute(ctx.shape(outs[0].shape), lambda *i: _cast(x[i], cd) + s[i], name="T")
    strides = []
    acc_s = tvm.tirx.const(1, IDX)
    for d in reversed(bshape):
        strides.insert(0, acc_s)
        acc_s = acc_s * d
    flat = _fold(lambda a, b: a + b, [_cast(r, IDX) * st for r, st in zip(raxes, strides)])
    hit = te.compute(x.shape, lambda *i: te.max(tvm.tirx.Select(match(i), flat, tvm.tirx.const(-1, IDX)),
                                                 axis=raxes), name="hit")

    def body(*i):
        h = hit[i]
        hc = tvm.tirx.max(h, tvm.tirx.const(0, IDX))
        bidx, r = [], hc
        for d in reversed(bshape):
            bidx.insert(0, tvm.tirx.floormod(r, d))
            r = tvm.tirx.floordiv(r, d)
        v = _cast(_bcast_load(values, bidx + list(i[npos:]), bnd + rest), cd)
        return tvm.tirx.if_then_else(h >= 0, v, _cast(x[i], cd))
    return te.compute(ctx.shape(outs[0].shape), body, name="T")


@lowering("index_select")
def _index_select(ctx, ins, attrs, outs):
    x, index = ins
    dim = _norm_dim(attrs["dim"], len(x.shape))

    def body(*i):
        src = list(i)
        src[dim] = _wrap(_cast(index[i[dim]] if len(index.shape) else index(), IDX), x.shape[dim])
        return x[tuple(src)]
    return te.compute(ctx.shape(outs[0].shape), body, name="T")


@lowering("layer_norm")
def _layer_norm(ctx, ins, attrs, outs):
    it = iter(ins)
    x = next(it)
    w = next(it) if attrs.get("weight") else None
    b = next(it) if attrs.get("bias") else None
    nshape = attrs["normalized_shape"]
    if len(nshape) != 1:
        raise InternalError("layer_norm over more than one dimension")
    nd = len(x.shape)
    eps = attrs.get("eps", 1e-5)
    n = _cast(x.shape[nd - 1], "float32")
    k = te.reduce_axis((0, x.shape[nd - 1]), name="k")
    mean = te.compute(x.shape[:-1], lambda *i: te.sum(_cast(x[i + (k,)], "float32"), axis=k), name="s1")
    k2 = te.reduce_axis((0, x.shape[nd - 1]), name="k2")
    var = te.compute(x.shape[:-1], lambda *i: te.sum(
        (_cast(x[i + (k2,)], "float32") - mean[i] / n) * (_cast(x[i + (k2,)], "float32") - mean[i] / n), axis=k2),
        name="s2")

    def body(*i):
        y = (_cast(x[i], "float32") - mean[i[:-1]] / n) * tvm.tirx.rsqrt(var[i[:-1]] / n + _const(eps, "float32"))
        if w is not None:
            y = y * _cast(w[i[-1]], "float32")
        if b is not None:
            y = y + _cast(b[i[-1]], "float32")
        return _cast(y, outs[0].dtype)
    return te.compute(x.shape, body, name="T")


@lowering("logsumexp")
def _logsumexp(ctx, ins, attrs, outs):
    x = ins[0]
    nd = len(x.shape)
    dims = attrs.get("dim")
    dims = [_norm_dim(d, nd) for d in (dims if isinstance(dims, tuple) else (dims,))] if dims not in (None, ()) \
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
    mx = te.compute(red_shape, lambda *o: te.max(_cast(x[full(o, a1)], cd), axis=a1), name="mx")
    # an all -inf (or +inf) row: shift by 0 instead, as ATen does, so the result is -inf (inf), not nan
    safe = te.compute(red_shape, lambda *o: tvm.tirx.Select(tvm.tirx.isinf(mx[o]), _const(0, cd), mx[o]), name="sh")
    a2 = [te.reduce_axis((0, x.shape[d]), name=f"b{d}") for d in dims]
    se = te.compute(red_shape, lambda *o: te.sum(tvm.tirx.exp(_cast(x[full(o, a2)], cd) - safe[o]), axis=a2),
                    name="se")

    def body(*o):
        r = tuple(o[d] for d in range(nd) if d not in dims) if keep else o
        return tvm.tirx.log(se[r]) + safe[r]
    return te.compute(ctx.shape(outs[0].shape), body, name="T")


@lowering("rsub.Scalar", "rsub.Tensor")
def _rsub(ctx, ins, attrs, outs):
    cd = outs[0].dtype
    alpha = attrs.get("alpha", 1)
    if len(ins) == 2:
        return _elementwise(ctx, ins, outs[0], lambda a, b: b - a * _const(alpha, cd), cd)
    s = _const(attrs["other"], cd)
    return _elementwise(ctx, ins, outs[0], lambda a: s - a * _const(alpha, cd), cd)


@lowering("clamp_min", "clamp_max")
def _clamp_1(ctx, ins, attrs, outs):
    cd = outs[0].dtype
    if attrs["__op__"] == "clamp_min":
        c = _const(attrs["min"], cd)
        return _elementwise(ctx, ins, outs[0], lambda a: tvm.tirx.max(a, c), cd)
    c = _const(attrs["max"], cd)
    return _elementwise(ctx, ins, outs[0], lambda a: tvm.tirx.min(a, c), cd)


# ---- the typed dequant (passes/dequant.py) where no consumer fused it ---------------------------------------

@lowering("dequant")
def _dequant(ctx, ins, attrs, outs):
    from dayzero.codegen.kernels.dequant import e2m1_value, e8m0_value

    data, scale = ins
    u8 = lambda v: tvm.tirx.const(v, "uint8")  # noqa: E731

    def w(*i):
        *lead, r, c = i[:-2] + (i[-1], i[-2]) if attrs["transposed"] else i
        if attrs["format"] == "mxfp4":
            byte = data[(*lead, r, c // 32, (c % 32) // 2)]
            code = tvm.tirx.Select(c % 2 == 0, byte & u8(15), byte >> u8(4))
            return e2m1_value(code) * e8m0_value(scale[(*lead, r, c // 32)])
        br, bc = attrs["block"]
        return _cast(data[(*lead, r, c)], "float32") * scale[(*lead, r // br, c // bc)]
    return te.compute(ctx.shape(outs[0].shape), w, name="dequant")


def lower_node(ctx: Ctx, op: str, ins: list[te.Tensor], attrs: dict, out_types) -> list[te.Tensor]:
    fn = LOWERINGS.get(op)
    if fn is None:
        raise InternalError(f"no lowering for {op}")
    res = fn(ctx, ins, dict(attrs, __op__=op), list(out_types))
    return list(res) if isinstance(res, (list, tuple)) else [res]


def can_lower(op: str) -> bool:
    return op in LOWERINGS or op in PRIMFUNCS
