"""Network layers: normalisation (rms_norm, layer_norm), convolution and pooling, as vision and ONNX exports
bring them.

Shapes (N batch, C channels, spatial dims last; every value contiguous row-major):

    convolution     x [N, Cin, *S], w [Cout, Cin/groups, *K], bias [Cout]?  -> [N, Cout, *O]
                    out[n, oc, o] = sum_{c, k} x[n, g*Cin/groups + c, o*stride - pad + k*dilation] * w[oc, c, k]
                    (g = oc // (Cout/groups); reads outside x are zero: a padded copy of x, ``pad``, is
                    read, so the reduction has no predicate for a schedule to carry; a strided 1x1 reads
                    ``sample``, x at its sampled positions, and runs at stride 1; a row stride s > 1 reads
                    the padded rows split into their s phases: contiguous vector reads either way)
    max_pool2d      x [N, C, H, W] -> [N, C, OH, OW]; max over the window, padding reads -inf
    avg_pool2d      same windows; sum / count, count = the window clipped to the padded input
                    (count_include_pad) or to the input itself
    constant_pad_nd pad = (before_last, after_last, before_prev, ...); out[i] = x[i - before] or value

Accumulation is in float32 for floating inputs (as the ATen CPU kernels do for these sizes).
"""

from __future__ import annotations

from typing import Callable

import torch
import tvm
from tvm import te

from dayzero import InternalError
from dayzero.passes.ir import ops
from .common import IDX, cast, const, dtype_of, in_bounds, lowering_table

LOWERINGS: dict[str, Callable] = {}
lowering = lowering_table(LOWERINGS)


@lowering("rms_norm")
def _rms_norm(ctx, ins, attrs, outs):
    x = ins[0]
    w = ins[1] if attrs.get("weight") else None
    nshape = attrs["normalized_shape"]
    if len(nshape) != 1:
        raise InternalError("rms_norm over more than one dimension")
    nd = len(x.shape)
    eps = attrs.get("eps") or float(torch.finfo(ops.torch_dtype(dtype_of(x))).eps)
    k = te.reduce_axis((0, x.shape[nd - 1]), name="k")
    ss = te.compute(x.shape[:-1], lambda *i: te.sum(cast(x[i + (k,)], "float32") * cast(x[i + (k,)], "float32"), axis=k), name="ss")
    n = cast(x.shape[nd - 1], "float32")

    def body(*i):
        y = cast(x[i], "float32") * tvm.tirx.rsqrt(ss[i[:-1]] / n + const(eps, "float32"))
        if w is not None:
            y = y * cast(w[i[-1]], "float32")
        return cast(y, outs[0].dtype)
    return te.compute(x.shape, body, name="T")


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
    n = cast(x.shape[nd - 1], "float32")
    k = te.reduce_axis((0, x.shape[nd - 1]), name="k")
    mean = te.compute(x.shape[:-1], lambda *i: te.sum(cast(x[i + (k,)], "float32"), axis=k), name="s1")
    k2 = te.reduce_axis((0, x.shape[nd - 1]), name="k2")
    var = te.compute(x.shape[:-1], lambda *i: te.sum(
        (cast(x[i + (k2,)], "float32") - mean[i] / n) * (cast(x[i + (k2,)], "float32") - mean[i] / n), axis=k2),
        name="s2")

    def body(*i):
        y = (cast(x[i], "float32") - mean[i[:-1]] / n) * tvm.tirx.rsqrt(var[i[:-1]] / n + const(eps, "float32"))
        if w is not None:
            y = y * cast(w[i[-1]], "float32")
        if b is not None:
            y = y + cast(b[i[-1]], "float32")
        return cast(y, outs[0].dtype)
    return te.compute(x.shape, body, name="T")


def _tuple(v, n: int) -> list[int]:
    v = list(v) if isinstance(v, (list, tuple)) else [v]
    return v * n if len(v) == 1 else v


def _acc(dtype: str) -> str:
    return "float32" if dtype in ("float16", "bfloat16", "float32") else dtype


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

    pointwise = all(int(w.shape[2 + i]) == 1 for i in range(nsp))
    if pointwise and any(v != 1 for v in stride):  # a strided 1x1: x's sampled positions gathered once, stride 1
        osh = ctx.shape(out.shape)[2:]

        def sample(n, c, *o):
            at = [o[i] * stride[i] - pad[i] for i in range(nsp)]
            v = x[(n, c, *at)]
            return tvm.tirx.if_then_else(in_bounds(at, x.shape[2:]), v, const(0.0, dtype_of(x))) if any(pad) else v
        xp = te.compute((*x.shape[:2], *osh), sample, name="sample")
        stride, pad, s_w = [1] * nsp, [0] * nsp, 1
    elif any(pad) or stride[-1] > 1:
        # a padded copy of x (zeros around), so the reduction reads without a predicate; a row stride s > 1
        # splits the row into its s phases, xp[.., h, phase, q] = x_padded[.., h, q*s + phase], so the columns
        # one kernel tap reads for a run of outputs (x[(ow + j)*s + kw]) are contiguous: xp[.., kw % s, ow + j +
        # kw // s], not a strided gather
        s_w = stride[-1]
        rows = [x.shape[2 + i] + 2 * pad[i] for i in range(nsp)]
        lead_shape, wq = rows[:-1], (rows[-1] + s_w - 1) // s_w

        def padded(n, c, *p):
            at = [p[i] - pad[i] for i in range(nsp - 1)] + [p[-1] * s_w + p[-2] - pad[-1]]
            return tvm.tirx.if_then_else(in_bounds(at, x.shape[2:]), x[(n, c, *at)], const(0.0, dtype_of(x)))
        if s_w > 1:
            xp = te.compute((*x.shape[:2], *lead_shape, s_w, wq), lambda n, c, *p: padded(n, c, *p), name="pad")
        else:
            xp = te.compute((*x.shape[:2], *rows), lambda n, c, *p: padded(n, c, *p[:-1], 0, p[-1]), name="pad")
    else:
        xp, s_w = x, 1

    def body(n, oc, *o):
        c = tvm.tirx.floordiv(oc, cout_g) * cin_g + rc if groups > 1 else rc
        sp = [o[i] * stride[i] + rk[i] * dil[i] for i in range(nsp)]
        if s_w > 1:
            tap = rk[-1] * dil[-1]
            sp = sp[:-1] + [tvm.tirx.floormod(tap, s_w), o[-1] + tvm.tirx.floordiv(tap, s_w)]
        return te.sum(cast(xp[(n, c, *sp)], cd) * cast(w[(oc, rc, *rk)], cd), axis=[rc] + rk)
    acc = te.compute(ctx.shape(out.shape), body, name="conv")
    if b is None:
        return te.compute(acc.shape, lambda *i: cast(acc[i], out.dtype), name="T")
    return te.compute(acc.shape, lambda *i: cast(acc[i] + cast(b[i[1]], cd), out.dtype), name="T")


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
    dt = dtype_of(x)
    lowest = -tvm.tirx.infinity(dt) if dt.startswith("float") else tvm.tirx.min_value(dt)

    def body(*i):
        lead, oh, ow = i[:-2], i[-2], i[-1]
        h, w_ = oh * s[0] - p[0] + rh * d[0], ow * s[1] - p[1] + rw * d[1]
        v = tvm.tirx.if_then_else(in_bounds([h, w_], x.shape[-2:]), x[(*lead, h, w_)], lowest)
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
        v = tvm.tirx.if_then_else(in_bounds([h, w_], [H, W]), cast(x[(*lead, h, w_)], cd), const(0.0, cd))
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
        return cast(acc[i] / cast(n, cd), out.dtype)
    return te.compute(acc.shape, body, name="T")
