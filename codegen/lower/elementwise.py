"""Elementwise ops: arithmetic, comparisons, unary math, casts, select, clamp, bit ops; broadcasting and
type promotion as ATen's.
"""

from __future__ import annotations

import math
from typing import Callable

import tvm
from tvm import te

from .common import bcast_load, cast, const, dtype_of, elementwise_compute, result_dtype, lowering_table

LOWERINGS: dict[str, Callable] = {}
lowering = lowering_table(LOWERINGS)


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
        cd = result_dtype(ins)
        alpha = attrs.get("alpha", 1)
        f = fn
        if alpha != 1:
            f = lambda a, b: fn(a, b * const(alpha, cd))  # noqa: E731
        return elementwise_compute(ctx, ins, outs[0], f, cd)
    return lower


for _n, _f in _BINARY.items():
    LOWERINGS[_n] = _make_binary(_n, _f)


@lowering("div.Tensor", "div.Tensor_mode")
def _div(ctx, ins, attrs, outs):
    mode = attrs.get("rounding_mode")
    cd = result_dtype(ins)
    if mode is None:
        cd = outs[0].dtype  # true division computes in the (floating) result dtype
        return elementwise_compute(ctx, ins, outs[0], lambda a, b: a / b, cd)
    if mode == "floor":
        if cd.startswith("float"):
            return elementwise_compute(ctx, ins, outs[0], lambda a, b: tvm.tirx.floor(a / b), cd)
        return elementwise_compute(ctx, ins, outs[0], lambda a, b: tvm.tirx.floordiv(a, b), cd)
    if cd.startswith("float"):
        return elementwise_compute(ctx, ins, outs[0], lambda a, b: tvm.tirx.trunc(a / b), cd)
    return elementwise_compute(ctx, ins, outs[0], lambda a, b: tvm.tirx.truncdiv(a, b), cd)


@lowering("remainder.Tensor")
def _remainder(ctx, ins, attrs, outs):
    cd = result_dtype(ins)
    if cd.startswith("float"):
        return elementwise_compute(ctx, ins, outs[0], lambda a, b: a - tvm.tirx.floor(a / b) * b, cd)
    return elementwise_compute(ctx, ins, outs[0], lambda a, b: tvm.tirx.floormod(a, b), cd)


_SCALAR = {
    "add.Scalar": lambda a, s: a + s, "sub.Scalar": lambda a, s: a - s, "mul.Scalar": lambda a, s: a * s,
    "div.Scalar": lambda a, s: a / s, "eq.Scalar": lambda a, s: a == s, "ne.Scalar": lambda a, s: a != s,
    "lt.Scalar": lambda a, s: a < s, "le.Scalar": lambda a, s: a <= s, "gt.Scalar": lambda a, s: a > s,
    "ge.Scalar": lambda a, s: a >= s, "pow.Tensor_Scalar": None, "remainder.Scalar": None,
}


def _make_scalar(name, fn):
    def lower(ctx, ins, attrs, outs):
        s = attrs.get("other", attrs.get("exponent"))
        cd = result_dtype(ins, [s])
        if name.startswith("div"):
            cd = outs[0].dtype
        sc = const(s, cd)
        if name == "pow.Tensor_Scalar":
            if s == 2:
                return elementwise_compute(ctx, ins, outs[0], lambda a: a * a, cd)
            if s == 0.5:
                return elementwise_compute(ctx, ins, outs[0], lambda a: tvm.tirx.sqrt(a), cd)
            return elementwise_compute(ctx, ins, outs[0], lambda a: tvm.tirx.power(a, sc), cd)
        if name == "remainder.Scalar":
            if cd.startswith("float"):
                return elementwise_compute(ctx, ins, outs[0], lambda a: a - tvm.tirx.floor(a / sc) * sc, cd)
            return elementwise_compute(ctx, ins, outs[0], lambda a: tvm.tirx.floormod(a, sc), cd)
        return elementwise_compute(ctx, ins, outs[0], lambda a: fn(a, sc), cd)
    return lower


for _n, _f in _SCALAR.items():
    LOWERINGS[_n] = _make_scalar(_n, _f)


def _gelu(a):
    return a * const(0.5, dtype_of(a)) * (const(1.0, dtype_of(a)) + tvm.tirx.erf(a * const(1 / math.sqrt(2), dtype_of(a))))


def _gelu_tanh(a):
    c = const(math.sqrt(2 / math.pi), dtype_of(a))
    return a * const(0.5, dtype_of(a)) * (const(1.0, dtype_of(a)) + tvm.tirx.tanh(c * (a + const(0.044715, dtype_of(a)) * a * a * a)))


_UNARY = {
    "neg": lambda a: -a, "exp": tvm.tirx.exp, "log": tvm.tirx.log, "sqrt": tvm.tirx.sqrt, "rsqrt": tvm.tirx.rsqrt,
    "sin": tvm.tirx.sin, "cos": tvm.tirx.cos, "tanh": tvm.tirx.tanh, "sigmoid": tvm.tirx.sigmoid,
    "erf": tvm.tirx.erf, "log1p": tvm.tirx.log1p, "expm1": lambda a: tvm.tirx.exp(a) - const(1.0, dtype_of(a)), "abs": tvm.tirx.abs, "floor": tvm.tirx.floor, "ceil": tvm.tirx.ceil,
    "reciprocal": lambda a: const(1.0, dtype_of(a)) / a, "relu": lambda a: tvm.tirx.max(a, const(0, dtype_of(a))),
    "silu": lambda a: a * tvm.tirx.sigmoid(a), "logical_not": lambda a: tvm.tirx.Not(a.astype("bool")),
    "bitwise_not": lambda a: tvm.tirx.Not(a) if dtype_of(a) == "bool" else ~a,
    "softplus": lambda a: tvm.tirx.log(const(1.0, dtype_of(a)) + tvm.tirx.exp(a)),
    "isnan": tvm.tirx.isnan, "isinf": tvm.tirx.isinf, "sign": lambda a: tvm.tirx.Select(
        a > const(0, dtype_of(a)), const(1, dtype_of(a)), tvm.tirx.Select(a < const(0, dtype_of(a)), const(-1, dtype_of(a)),
                                                                     const(0, dtype_of(a)))),
}


def _make_unary(fn):
    def lower(ctx, ins, attrs, outs):
        cd = dtype_of(ins[0]) if not outs[0].dtype.startswith("float") or outs[0].dtype == "bool" else outs[0].dtype
        if dtype_of(ins[0]) == "bool" or outs[0].dtype == "bool":
            cd = dtype_of(ins[0])
        return elementwise_compute(ctx, ins, outs[0], fn, cd)
    return lower


for _n, _f in _UNARY.items():
    LOWERINGS[_n] = _make_unary(_f)


@lowering("gelu")
def _gelu_op(ctx, ins, attrs, outs):
    fn = _gelu_tanh if attrs.get("approximate") == "tanh" else _gelu
    return elementwise_compute(ctx, ins, outs[0], fn, outs[0].dtype)


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
            v = cast(bcast_load(ins[0], list(idx), nd), cd)
            if lo_t is not None:
                v = tvm.tirx.max(v, cast(bcast_load(lo_t, list(idx), nd), cd))
            if hi_t is not None:
                v = tvm.tirx.min(v, cast(bcast_load(hi_t, list(idx), nd), cd))
            return v
        return te.compute(shape, body, name="T")

    def f(a):
        if lo is not None:
            a = tvm.tirx.max(a, const(lo, cd))
        if hi is not None:
            a = tvm.tirx.min(a, const(hi, cd))
        return a
    return elementwise_compute(ctx, ins, outs[0], f, cd)


@lowering("where.self")
def _where(ctx, ins, attrs, outs):
    cd = outs[0].dtype
    return elementwise_compute(ctx, ins, outs[0], lambda c, a, b: tvm.tirx.Select(c.astype("bool"), cast(a, cd), cast(b, cd)))


@lowering("masked_fill.Scalar")
def _masked_fill(ctx, ins, attrs, outs):
    cd = outs[0].dtype
    v = const(attrs["value"], cd)
    return elementwise_compute(ctx, ins, outs[0], lambda a, m: tvm.tirx.Select(m.astype("bool"), v, cast(a, cd)))


@lowering("_to_copy", "to.dtype", "type_as")
def _to_copy(ctx, ins, attrs, outs):
    return elementwise_compute(ctx, ins[:1], outs[0], lambda a: a)


@lowering("rsub.Scalar", "rsub.Tensor")
def _rsub(ctx, ins, attrs, outs):
    cd = outs[0].dtype
    alpha = attrs.get("alpha", 1)
    if len(ins) == 2:
        return elementwise_compute(ctx, ins, outs[0], lambda a, b: b - a * const(alpha, cd), cd)
    s = const(attrs["other"], cd)
    return elementwise_compute(ctx, ins, outs[0], lambda a: s - a * const(alpha, cd), cd)


@lowering("clamp_min", "clamp_max")
def _clamp_1(ctx, ins, attrs, outs):
    cd = outs[0].dtype
    if attrs["__op__"] == "clamp_min":
        c = const(attrs["min"], cd)
        return elementwise_compute(ctx, ins, outs[0], lambda a: tvm.tirx.max(a, c), cd)
    c = const(attrs["max"], cd)
    return elementwise_compute(ctx, ins, outs[0], lambda a: tvm.tirx.min(a, c), cd)


@lowering("bitwise_right_shift.Tensor")
def _shift_right(ctx, ins, attrs, outs):
    return elementwise_compute(ctx, ins, outs[0], lambda a, b: a >> b, result_dtype(ins))


@lowering("bitwise_xor.Tensor")
def _xor(ctx, ins, attrs, outs):
    return elementwise_compute(ctx, ins, outs[0], lambda a, b: a ^ b, result_dtype(ins))
