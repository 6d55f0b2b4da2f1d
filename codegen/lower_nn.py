"""Lowerings for the network ops vision and ONNX exports bring: convolution, pooling, padding, and the
bit ops of 4-bit weight unpacking. Registered into ``lower.LOWERINGS`` like every other lowering.

Shapes (N batch, C channels, spatial dims last; every value contiguous row-major):

    convolution     x [N, Cin, *S], w [Cout, Cin/groups, *K], bias [Cout]?  -> [N, Cout, *O]
                    out[n, oc, o] = sum_{c, k} x[n, g*Cin/groups + c, o*stride - pad + k*dilation] * w[oc, c, k]
                    (g = oc // (Cout/groups); reads outside x are zero)
    max_pool2d      x [N, C, H, W] -> [N, C, OH, OW]; max over the window, padding reads -inf
    avg_pool2d      same windows; sum / count, count = the window clipped to the padded input
                    (count_include_pad) or to the input itself
    constant_pad_nd pad = (before_last, after_last, before_prev, ...); out[i] = x[i - before] or value

Accumulation is in float32 for floating inputs (as the ATen CPU kernels do for these sizes).
"""

from __future__ import annotations

import tvm
from tvm import te

from dayzero import InternalError
from .lower import IDX, _cast, _const, _dt, _elementwise, _result_dtype, lowering


def _tuple(v, n: int) -> list[int]:
    v = list(v) if isinstance(v, (list, tuple)) else [v]
    return v * n if len(v) == 1 else v


def _acc(dtype: str) -> str:
    return "float32" if dtype in ("float16", "bfloat16", "float32") else dtype


def _inside(idx, lo_hi) -> "tvm.tirx.PrimExpr":
    conds = [tvm.tirx.all(i >= tvm.tirx.const(0, IDX), i < size) for i, size in zip(idx, lo_hi)]
    return tvm.tirx.all(*conds) if len(conds) > 1 else conds[0]


@lowering("convolution")
def _convolution(ctx, ins, attrs, outs):
    if attrs.get("transposed"):
        raise InternalError("transposed convolution has no lowering")
    x, w = ins[0], ins[1]
    b = ins[2] if attrs.get("bias") else None
    out = outs[0]
    nsp = len(x.shape) - 2
    stride, pad, dil = (_tuple(attrs[k], nsp) for k in ("stride", "padding", "dilation"))
    groups = int(attrs.get("groups", 1))
    cin_g = w.shape[1]
    cout_g = int(w.shape[0]) // groups
    cd = _acc(out.dtype)
    rc = te.reduce_axis((0, cin_g), name="rc")
    rk = [te.reduce_axis((0, w.shape[2 + i]), name=f"rk{i}") for i in range(nsp)]

    def body(n, oc, *o):
        c = tvm.tirx.floordiv(oc, cout_g) * cin_g + rc if groups > 1 else rc
        sp = [o[i] * stride[i] - pad[i] + rk[i] * dil[i] for i in range(nsp)]
        if any(pad):
            v = tvm.tirx.if_then_else(_inside(sp, x.shape[2:]), _cast(x[(n, c, *sp)], cd), _const(0.0, cd))
        else:
            v = _cast(x[(n, c, *sp)], cd)
        return te.sum(v * _cast(w[(oc, rc, *rk)], cd), axis=[rc] + rk)
    acc = te.compute(ctx.shape(out.shape), body, name="conv")
    if b is None:
        return te.compute(acc.shape, lambda *i: _cast(acc[i], out.dtype), name="T")
    return te.compute(acc.shape, lambda *i: _cast(acc[i] + _cast(b[i[1]], cd), out.dtype), name="T")


def _pool_geometry(attrs, nsp=2):
    k = _tuple(attrs["kernel_size"], nsp)
    s = _tuple(attrs.get("stride") or k, nsp)
    p = _tuple(attrs.get("padding", 0), nsp)
    return k, s, p


@lowering("max_pool2d")
def _max_pool2d(ctx, ins, attrs, outs):
    x = ins[0]
    out = outs[0]
    k, s, p = _pool_geometry(attrs)
    d = _tuple(attrs.get("dilation", 1), 2)
    rh, rw = te.reduce_axis((0, k[0]), name="rh"), te.reduce_axis((0, k[1]), name="rw")
    dt = _dt(x)
    lowest = -tvm.tirx.infinity(dt) if dt.startswith("float") else tvm.tirx.min_value(dt)

    def body(*i):
        lead, oh, ow = i[:-2], i[-2], i[-1]
        h, w_ = oh * s[0] - p[0] + rh * d[0], ow * s[1] - p[1] + rw * d[1]
        v = tvm.tirx.if_then_else(_inside([h, w_], x.shape[-2:]), x[(*lead, h, w_)], lowest)
        return te.max(v, axis=[rh, rw])
    return te.compute(ctx.shape(out.shape), body, name="T")


@lowering("avg_pool2d")
def _avg_pool2d(ctx, ins, attrs, outs):
    x = ins[0]
    out = outs[0]
    k, s, p = _pool_geometry(attrs)
    cip = attrs.get("count_include_pad", True)
    if attrs.get("divisor_override") is not None:
        raise InternalError("avg_pool2d divisor_override has no lowering")
    cd = _acc(out.dtype)
    rh, rw = te.reduce_axis((0, k[0]), name="rh"), te.reduce_axis((0, k[1]), name="rw")
    H, W = x.shape[-2], x.shape[-1]

    def total(*i):
        lead, oh, ow = i[:-2], i[-2], i[-1]
        h, w_ = oh * s[0] - p[0] + rh, ow * s[1] - p[1] + rw
        v = tvm.tirx.if_then_else(_inside([h, w_], [H, W]), _cast(x[(*lead, h, w_)], cd), _const(0.0, cd))
        return te.sum(v, axis=[rh, rw])
    acc = te.compute(ctx.shape(out.shape), total, name="sum")

    def count(o, size, kk, ss, pp):
        start = o * ss - pp
        end = tvm.tirx.min(start + kk, size + pp)
        n_pad = end - start
        n_in = tvm.tirx.min(end, size) - tvm.tirx.max(start, tvm.tirx.const(0, IDX))
        return n_pad if cip else n_in

    def body(*i):
        n = count(i[-2], H, k[0], s[0], p[0]) * count(i[-1], W, k[1], s[1], p[1])
        return _cast(acc[i] / _cast(n, cd), out.dtype)
    return te.compute(acc.shape, body, name="T")


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
    fill = _const(float(value) if out.dtype.startswith("float") else value, out.dtype)

    def body(*i):
        src = [i[d] - before[d] for d in range(nd)]
        padded = [d for d in range(nd) if before[d] or pad]
        if not padded:
            return x[tuple(src)]
        return tvm.tirx.if_then_else(_inside([src[d] for d in padded], [x.shape[d] for d in padded]),
                                     x[tuple(src)], fill)
    return te.compute(ctx.shape(out.shape), body, name="T")


@lowering("bitwise_right_shift.Tensor")
def _shift_right(ctx, ins, attrs, outs):
    return _elementwise(ctx, ins, outs[0], lambda a, b: a >> b, _result_dtype(ins))


@lowering("bitwise_xor.Tensor")
def _xor(ctx, ins, attrs, outs):
    return _elementwise(ctx, ins, outs[0], lambda a, b: a ^ b, _result_dtype(ins))
