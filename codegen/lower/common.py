"""What every lowering shares: the per-kernel symbol context, symbolic dims -> TIR, constants, casts,
broadcast loads, ATen's type promotion, the elementwise compute, and the decorator that fills a family's table."""

from __future__ import annotations

import math
from typing import Any, Callable

import sympy
import torch
import tvm
from tvm import te

from dayzero import InternalError
from dayzero.passes.ir import ops
from dayzero.passes.ir.node import TensorType

IDX = "int64"
# a compute stage annotated with this key stays a buffer of its own: a fused kernel does not inline it into its
# readers (softmax's exp, read by the row sum and the output: inlined, each element's exp is computed twice)
MATERIALIZE = "dayzero.materialize"


class Ctx:
    """Per-kernel state: the TIR variable of each symbol."""

    def __init__(self, bind: dict[str, int] | None = None):
        self.vars: dict[str, tvm.tirx.Var] = {}
        self.bind = dict(bind or {})  # symbols specialised to a value (tuning at a size, decode at seq=1)

    def dim(self, d) -> Any:
        if isinstance(d, int):
            return tvm.tirx.const(d, IDX)
        return sym_to_tir(d, self)

    def shape(self, shape) -> list:
        return [self.dim(d) for d in shape]


def sym_to_tir(e, ctx: Ctx):
    if e.is_Integer:
        return tvm.tirx.const(int(e), IDX)
    if e.is_Symbol:
        if e.name in ctx.bind:
            return tvm.tirx.const(ctx.bind[e.name], IDX)
        if e.name not in ctx.vars:
            ctx.vars[e.name] = te.var(e.name, dtype=IDX)
        return ctx.vars[e.name]
    if isinstance(e, sympy.floor):
        # floor(a / b) as sympy writes it: Mul(a, Pow(b, -1)), or distributed (floor(seq/8 + 11/4))
        num, den = sympy.together(e.args[0]).as_numer_denom()
        return tvm.tirx.floordiv(sym_to_tir(num, ctx), sym_to_tir(den, ctx))
    args = [sym_to_tir(a, ctx) for a in e.args]
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
    if isinstance(e, sympy.Mod):
        return tvm.tirx.floormod(args[0], args[1])
    if type(e).__name__ == "Max":  # sympy's or torch's own (torch.utils._sympy.functions)
        return tvm.tirx.max(*args) if len(args) == 2 else fold(tvm.tirx.max, args)
    if type(e).__name__ == "Min":
        return tvm.tirx.min(*args) if len(args) == 2 else fold(tvm.tirx.min, args)
    if type(e).__name__ in ("FloorDiv",):  # torch's sympy FloorDiv
        return tvm.tirx.floordiv(args[0], args[1])
    raise InternalError(f"symbolic dimension {e} has no TIR form")


def fold(f, args):
    out = args[0]
    for a in args[1:]:
        out = f(out, a)
    return out


# ---- helpers ------------------------------------------------------------------------------------------------

def const(v, dtype: str):
    if dtype == "bool":
        return tvm.tirx.const(bool(v), "bool")
    if isinstance(v, float) and math.isinf(v):
        return tvm.tirx.max_value(dtype) if v > 0 else tvm.tirx.min_value(dtype) if not dtype.startswith("float") \
            else tvm.tirx.infinity(dtype) if v > 0 else -tvm.tirx.infinity(dtype)
    return tvm.tirx.const(v, dtype)


def dtype_of(x) -> str:
    """The dtype of a TIR expression (``.ty`` in TVM 0.27) or of a tensor / tensor element."""
    if isinstance(x, (te.Tensor, te.TensorSlice)):
        return str(x.dtype)
    return str(x.ty)


def cast(x, dtype: str):
    if hasattr(x, "tensor") and hasattr(x, "indices"):  # TensorSlice -> load expression
        x = x.tensor(*x.indices)
    if hasattr(x, "asobject") and not hasattr(x, "ty"):  # a == b / a != b: TVM's lazy EqualOp / NotEqualOp
        x = x.asobject()
    if isinstance(x, tvm.tirx.IterVar):  # a reduction axis used as a value
        x = x.var
    return x if dtype_of(x) == dtype else x.astype(dtype)


def bcast_load(t: te.Tensor, idx: list, out_ndim: int):
    """Load t at the broadcast of output index idx (trailing dimensions aligned, size-1 dims pinned to 0)."""
    nd = len(t.shape)
    sub = []
    for j in range(nd):
        i = idx[out_ndim - nd + j]
        d = t.shape[j]
        sub.append(tvm.tirx.const(0, IDX) if isinstance(d, tvm.tirx.IntImm) and int(d) == 1 else i)
    return t(*sub)


def norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def result_dtype(ins: list[te.Tensor], scalars=()) -> str:
    metas = [torch.empty([1] * len(t.shape) if len(t.shape) else [], dtype=ops.torch_dtype(dtype_of(t)), device="meta")
             for t in ins]
    args = metas + list(scalars)
    dt = args[0] if len(args) == 1 else torch.result_type(args[0], args[1])
    if isinstance(dt, torch.Tensor):
        dt = dt.dtype
    for a in args[2:]:
        dt = torch.promote_types(dt, a.dtype if isinstance(a, torch.Tensor) else torch.tensor(a).dtype)
    return ops.dtype_name(dt)



def lowering_table(table: dict[str, Callable]):
    """The decorator that enters a lowering into a family's table: ``@lowering("add.Tensor", ...)``."""
    def lowering(*names):
        def deco(fn):
            for n in names:
                table[n] = fn
            return fn
        return deco
    return lowering


def elementwise_compute(ctx, ins, out: TensorType, fn, compute_dtype: str | None = None):
    shape = ctx.shape(out.shape)
    nd = len(shape)
    cd = compute_dtype

    def body(*idx):
        vals = [bcast_load(t, list(idx), nd) for t in ins]
        if cd is not None:
            vals = [cast(v, cd) for v in vals]
        return cast(fn(*vals), out.dtype)
    return te.compute(shape, body, name="T")



def wrap_index(i, size):
    return tvm.tirx.Select(i < tvm.tirx.const(0, dtype_of(i)), i + cast(size, dtype_of(i)), i)



# the shared index helpers of slicing (shape.py) and slice_scatter (index.py)
# Python slices with an open end reach ATen as end=INT64_MAX (``x[:, 1:]``). No tensor dimension comes near
# 2**31, so any index attribute at least that large means "to the end" (or "from the start" when negative) and
# is replaced by the size itself: a constant like INT64_MAX must never reach TIR, where the simplifier rewrites
# an index test through a fused loop (``fused // 32 < C`` into ``fused < 32*C``) and the product wraps around,
# turning the test false for every element (slice_scatter then copied nothing).
OPEN_END = 1 << 31


def normalize_start(ctx, start, size):
    if start is None or (isinstance(start, int) and start <= -OPEN_END):
        return tvm.tirx.const(0, IDX)
    if isinstance(start, int) and start >= OPEN_END:
        return size
    if isinstance(start, int):
        if start >= 0:
            return tvm.tirx.min(tvm.tirx.const(start, IDX), size)
        return tvm.tirx.max(size + tvm.tirx.const(start, IDX), tvm.tirx.const(0, IDX))
    return tvm.tirx.min(ctx.dim(start), size)


def in_bounds(idx, lo_hi) -> "tvm.tirx.PrimExpr":
    conds = [tvm.tirx.all(i >= tvm.tirx.const(0, IDX), i < size) for i, size in zip(idx, lo_hi)]
    return tvm.tirx.all(*conds) if len(conds) > 1 else conds[0]


# the reduction axes of a reduce compute (reduce.py, linear.py)
def reduce_axes(extents: dict):
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


def masked_value(mask, v, identity):
    return v if mask is None else tvm.tirx.if_then_else(mask, v, identity)
