"""ONNX node converters: one handler per ONNX op type, emitting ATen-named IR ops through the importer.

A handler is ``(importer, input names, attrs, node) -> output values`` (IR nodes or ``Known`` values); ``HANDLERS``
holds the default domain's, ``CONTRIB`` the ``com.microsoft`` ones (``MatMulNBits``). A handler raises
``Unsupported`` for an attribute variant it does not map; the importer collects those with the unknown op types.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from onnx import numpy_helper

from dayzero.frontend.onnx.fold import constant_value
from dayzero.frontend.onnx.values import INT4_SIGNED, ONNX_DTYPES, Known, Unsupported
from dayzero.passes.ir.node import Node

_INT_MAX = 2 ** 31 - 1

HANDLERS: dict = {}
CONTRIB: dict = {}


def onnx_op(*names, table=None):
    def deco(fn):
        for n in names:
            (HANDLERS if table is None else table)[n] = fn
        return fn
    return deco


def _shape_value(imp, ins, attrs, n):
    x = imp.tensor(ins[0])
    shape = imp.shape(x)
    s, e = attrs.get("start", 0), attrs.get("end")
    return [Known(np.array(shape[s:e], dtype=object), n.output[0])]


HANDLERS["Shape"] = _shape_value
HANDLERS["Size"] = lambda imp, ins, attrs, n: [Known(np.array(math.prod(imp.shape(imp.tensor(ins[0]))),
                                                               dtype=object))]
HANDLERS["Identity"] = lambda imp, ins, attrs, n: [imp.vals[ins[0]]]
HANDLERS["Dropout"] = lambda imp, ins, attrs, n: [imp.vals[ins[0]]]
HANDLERS["Constant"] = lambda imp, ins, attrs, n: [Known(constant_value(attrs), n.output[0])]

_BIN = {"Add": "add.Tensor", "Sub": "sub.Tensor", "Mul": "mul.Tensor", "Equal": "eq.Tensor", "Less": "lt.Tensor",
        "LessOrEqual": "le.Tensor", "Greater": "gt.Tensor", "GreaterOrEqual": "ge.Tensor", "And": "logical_and",
        "Or": "logical_or", "Xor": "ne.Tensor", "BitwiseAnd": "bitwise_and.Tensor", "BitwiseOr": "bitwise_or.Tensor",
        "Pow": "pow.Tensor_Tensor"}


def _binary(op):
    def f(imp, ins, attrs, n):
        if op == "pow.Tensor_Tensor":
            k = imp.known(ins[1])
            if k is not None and k.value.size == 1 and not k.symbolic:
                return [imp.aten("pow.Tensor_Scalar", self=imp.tensor(ins[0]), exponent=float(k.value.item()))]
        return [imp.aten(op, self=imp.tensor(ins[0]), other=imp.tensor(ins[1]))]
    return f


for _k, _v in _BIN.items():
    HANDLERS[_k] = _binary(_v)


@onnx_op("Div")
def _div(imp, ins, attrs, n):
    a, b = imp.tensor(ins[0]), imp.tensor(ins[1])
    if a.dtype.startswith("float") or a.dtype == "bfloat16":
        return [imp.aten("div.Tensor", self=a, other=b)]
    return [imp.aten("div.Tensor_mode", self=a, other=b, rounding_mode="trunc")]


@onnx_op("Mod")
def _mod(imp, ins, attrs, n):
    if attrs.get("fmod", 0):
        raise Unsupported("fmod=1")
    return [imp.aten("remainder.Tensor", self=imp.tensor(ins[0]), other=imp.tensor(ins[1]))]


@onnx_op("Max", "Min", "Sum", "Mean")
def _variadic(imp, ins, attrs, n):
    op = {"Max": "maximum", "Min": "minimum", "Sum": "add.Tensor", "Mean": "add.Tensor"}[n.op_type]
    acc = imp.tensor(ins[0])
    for i in ins[1:]:
        acc = imp.aten(op, self=acc, other=imp.tensor(i))
    if n.op_type == "Mean":
        acc = imp.aten("div.Tensor", self=acc, other=imp.scalar(len(ins), acc.dtype))
    return [acc]


_UN = {"Neg": "neg", "Exp": "exp", "Log": "log", "Sqrt": "sqrt", "Reciprocal": "reciprocal", "Sin": "sin",
       "Cos": "cos", "Tanh": "tanh", "Sigmoid": "sigmoid", "Erf": "erf", "Abs": "abs", "Floor": "floor",
       "Ceil": "ceil", "Relu": "relu", "Not": "logical_not", "IsNaN": "isnan", "Sign": "sign",
       "Softplus": "softplus", "BitwiseNot": "bitwise_not"}


def _unary(op):
    return lambda imp, ins, attrs, n: [imp.aten(op, self=imp.tensor(ins[0]))]


for _k, _v in _UN.items():
    HANDLERS[_k] = _unary(_v)


@onnx_op("IsInf")
def _isinf(imp, ins, attrs, n):
    if attrs.get("detect_negative", 1) != 1 or attrs.get("detect_positive", 1) != 1:
        raise Unsupported("one-sided detection")
    return [imp.aten("isinf", self=imp.tensor(ins[0]))]


@onnx_op("Gelu")
def _gelu(imp, ins, attrs, n):
    approx = attrs.get("approximate", b"none")
    approx = approx.decode() if isinstance(approx, bytes) else approx
    return [imp.aten("gelu", self=imp.tensor(ins[0]), approximate=approx)]


@onnx_op("LeakyRelu", "Elu", "Selu", "HardSigmoid", "HardSwish", "PRelu", "Celu", "ThresholdedRelu", "Mish")
def _activation(imp, ins, attrs, n):
    x = imp.tensor(ins[0])
    op = n.op_type
    zero = imp.scalar(0.0, x.dtype)
    if op == "HardSigmoid" or op == "HardSwish":
        alpha, beta = (attrs.get("alpha", 0.2), attrs.get("beta", 0.5)) if op == "HardSigmoid" else (1 / 6, 0.5)
        y = imp.aten("add.Scalar", self=imp.aten("mul.Scalar", self=x, other=alpha), other=beta)
        y = imp.aten("clamp", self=y, min=0.0, max=1.0)
        return [y if op == "HardSigmoid" else imp.aten("mul.Tensor", self=x, other=y)]
    if op == "Mish":
        sp = imp.aten("softplus", self=x)
        return [imp.aten("mul.Tensor", self=x, other=imp.aten("tanh", self=sp))]
    if op == "ThresholdedRelu":
        pos = imp.aten("gt.Scalar", self=x, other=attrs.get("alpha", 1.0))
        return [imp.aten("where.self", condition=pos, self=x, other=zero)]
    pos = imp.aten("gt.Tensor", self=x, other=zero)
    if op == "LeakyRelu":
        neg = imp.aten("mul.Scalar", self=x, other=attrs.get("alpha", 0.01))
    elif op == "PRelu":
        neg = imp.aten("mul.Tensor", self=x, other=imp.tensor(ins[1]))
    else:
        alpha = attrs.get("alpha", {"Elu": 1.0, "Celu": 1.0, "Selu": 1.67326319217681884765625}[op])
        xs = imp.aten("div.Scalar", self=x, other=alpha) if op == "Celu" else x
        em1 = imp.aten("sub.Scalar", self=imp.aten("exp", self=xs), other=1.0)
        neg = imp.aten("mul.Scalar", self=em1, other=alpha)
    y = imp.aten("where.self", condition=pos, self=x, other=neg)
    if op == "Selu":
        y = imp.aten("mul.Scalar", self=y, other=attrs.get("gamma", 1.05070102214813232421875))
    return [y]


@onnx_op("Clip")
def _clip(imp, ins, attrs, n):
    x = imp.tensor(ins[0])
    if imp.opset < 11:
        lo, hi = attrs.get("min"), attrs.get("max")
    else:
        bounds = []
        for i in (1, 2):
            name = ins[i] if len(ins) > i else ""
            if not name:
                bounds.append(None)
                continue
            k = imp.known(name)
            if k is None:
                raise Unsupported("min/max computed at run time")
            bounds.append(k.value.item())
        lo, hi = bounds
    return [imp.aten("clamp", self=x, min=lo, max=hi)]


@onnx_op("Where")
def _where(imp, ins, attrs, n):
    return [imp.aten("where.self", condition=imp.tensor(ins[0]), self=imp.tensor(ins[1]), other=imp.tensor(ins[2]))]


@onnx_op("Cast", "CastLike")
def _cast(imp, ins, attrs, n):
    x = imp.tensor(ins[0])
    if n.op_type == "CastLike":
        dtype = imp.tensor(ins[1]).dtype
    else:
        dtype = ONNX_DTYPES.get(attrs["to"])
        if dtype is None:
            raise Unsupported(f"to={attrs['to']}")
    return [imp.cast(x, dtype)]


# ---- matmul family --------------------------------------------------------------------------------------------

@onnx_op("MatMul")
def _matmul(imp, ins, attrs, n):
    return [imp.aten("matmul", self=imp.tensor(ins[0]), other=imp.tensor(ins[1]))]


@onnx_op("Gemm")
def _gemm(imp, ins, attrs, n):
    a = imp.tensor(ins[0])
    if attrs.get("transA", 0):
        a = imp.aten("permute", self=a, dims=[1, 0])
    kb = imp.known(ins[1])
    if attrs.get("transB", 0):
        w = imp.tensor(ins[1])
    elif kb is not None:
        w = imp.const(Known(np.ascontiguousarray(kb.value.T), f"{kb.name}.T"))
    else:
        w = imp.aten("permute", self=imp.tensor(ins[1]), dims=[1, 0])
    alpha, beta = attrs.get("alpha", 1.0), attrs.get("beta", 1.0)
    c = imp.tensor(ins[2]) if len(ins) > 2 and ins[2] else None
    bias = None
    if c is not None and alpha == 1.0 and beta == 1.0 and len(c.shape) <= 2 and c.shape[-1:] == (w.shape[0],) \
            and math.prod(c.shape[:-1]) == 1:
        bias = c if len(c.shape) == 1 else imp.view(c, [w.shape[0]])
        c = None
    y = imp.aten("linear", input=a, weight=w, bias=bias)
    if alpha != 1.0:
        y = imp.aten("mul.Scalar", self=y, other=alpha)
    if c is not None:
        if beta != 1.0:
            c = imp.aten("mul.Scalar", self=c, other=beta)
        y = imp.aten("add.Tensor", self=y, other=c)
    return [y]


# ---- shape ops --------------------------------------------------------------------------------------------------

@onnx_op("Reshape")
def _reshape(imp, ins, attrs, n):
    x = imp.tensor(ins[0])
    shape = imp.ints(ins[1], "the target shape")
    xs = imp.shape(x)
    allowzero = attrs.get("allowzero", 0)
    shape = [xs[i] if (not isinstance(v, torch.SymInt) and v == 0 and not allowzero) else v
             for i, v in enumerate(shape)]
    return [imp.view(x, shape)]


@onnx_op("Flatten")
def _flatten(imp, ins, attrs, n):
    x = imp.tensor(ins[0])
    xs = imp.shape(x)
    axis = attrs.get("axis", 1) % (len(xs) + 1) if xs else 0
    return [imp.view(x, [math.prod(xs[:axis]), math.prod(xs[axis:])])]


@onnx_op("Unsqueeze")
def _unsqueeze(imp, ins, attrs, n):
    x = imp.tensor(ins[0])
    axes = imp.ints(ins[1], "axes") if len(ins) > 1 and ins[1] else list(attrs["axes"])
    shape = imp.shape(x)
    nd = len(shape) + len(axes)
    for a in sorted(a % nd for a in axes):
        shape.insert(a, 1)
    return [imp.view(x, shape)]


@onnx_op("Squeeze")
def _squeeze(imp, ins, attrs, n):
    x = imp.tensor(ins[0])
    shape = imp.shape(x)
    axes = imp.ints(ins[1], "axes") if len(ins) > 1 and ins[1] else attrs.get("axes")
    if axes is None:
        keep = [d for d in shape if isinstance(d, torch.SymInt) or d != 1]
    else:
        drop = {a % len(shape) for a in axes}
        keep = [d for i, d in enumerate(shape) if i not in drop]
    return [imp.view(x, keep)]


@onnx_op("Transpose")
def _transpose(imp, ins, attrs, n):
    x = imp.tensor(ins[0])
    perm = attrs.get("perm") or list(reversed(range(len(x.shape))))
    return [imp.aten("permute", self=x, dims=list(perm))]


@onnx_op("Expand")
def _expand(imp, ins, attrs, n):
    x = imp.tensor(ins[0])
    shape = imp.ints(ins[1], "the target shape")
    xs = imp.shape(x)
    nd = max(len(xs), len(shape))
    xs = [1] * (nd - len(xs)) + xs
    shape = [1] * (nd - len(shape)) + shape
    out = []
    for a, b in zip(xs, shape):
        if not isinstance(b, torch.SymInt) and b == 1:
            out.append(a)
        elif not isinstance(a, torch.SymInt) and a == 1:
            out.append(b)
        else:
            out.append(a)
    if len(imp.shape(x)) < nd:
        x = imp.view(x, xs)
    if all(not isinstance(a, torch.SymInt) and not isinstance(b, torch.SymInt) and a == b for a, b in zip(xs, out)):
        return [x]
    return [imp.aten("expand", self=x, size=out)]


@onnx_op("Concat")
def _concat(imp, ins, attrs, n):
    ts = [imp.tensor(i) for i in ins if i]
    ts = [t for t in ts if not (len(t.shape) == 1 and t.shape[0] == 0)] or ts[:1]
    return [imp.aten("cat", tensors=ts, dim=attrs["axis"])]


@onnx_op("Split")
def _split(imp, ins, attrs, n):
    x = imp.tensor(ins[0])
    axis = attrs.get("axis", 0)
    shape = imp.shape(x)
    if len(ins) > 1 and ins[1]:
        split = imp.ints(ins[1], "split")
    elif "split" in attrs:
        split = list(attrs["split"])
    else:
        parts = attrs.get("num_outputs", len(n.output))
        d = shape[axis]
        size = -(-d // parts)
        split = [size] * (parts - 1) + [d - size * (parts - 1)]
    return list(imp.aten("split_with_sizes", self=x, split_sizes=split, dim=axis))


@onnx_op("Slice")
def _slice(imp, ins, attrs, n):
    x = imp.tensor(ins[0])
    if imp.opset < 10:
        starts, ends, axes, steps = list(attrs["starts"]), list(attrs["ends"]), attrs.get("axes"), None
    else:
        starts, ends = imp.ints(ins[1], "starts"), imp.ints(ins[2], "ends")
        axes = imp.ints(ins[3], "axes") if len(ins) > 3 and ins[3] else None
        steps = imp.ints(ins[4], "steps") if len(ins) > 4 and ins[4] else None
    axes = list(axes) if axes is not None else list(range(len(starts)))
    steps = steps or [1] * len(starts)
    nd = len(x.shape)
    for s, e, a, st in zip(starts, ends, axes, steps):
        if not isinstance(st, torch.SymInt) and st < 0:
            raise Unsupported("negative step")
        if not isinstance(e, torch.SymInt) and e >= _INT_MAX:
            e = None
        if not isinstance(s, torch.SymInt) and s <= -_INT_MAX:
            s = 0
        x = imp.aten("slice.Tensor", self=x, dim=a % nd, start=s, end=e, step=st)
    return [x]


@onnx_op("Gather")
def _gather(imp, ins, attrs, n):
    axis = attrs.get("axis", 0)
    data = imp.tensor(ins[0])
    nd = len(data.shape)
    axis %= nd
    k = imp.known(ins[1])
    if k is not None and not k.symbolic:
        idx = np.where(k.value < 0, k.value + int(data.shape[axis]) if isinstance(data.shape[axis], int) else 0,
                       k.value)
        if k.value.ndim == 0:
            return [imp.aten("select.int", self=data, dim=axis, index=int(idx))]
        k = Known(idx.astype(np.int64), f"{k.name}.idx")
        indices = imp.const(k)
    else:
        indices = imp.tensor(ins[1])
    if axis == 0 and nd == 2 and data.op == "weight":
        return [imp.aten("embedding", weight=data, indices=indices)]
    return [imp.aten("index.Tensor", self=data, indices=[None] * axis + [indices])]


@onnx_op("GatherElements")
def _gather_elements(imp, ins, attrs, n):
    x = imp.tensor(ins[0])
    return [imp.aten("gather", self=x, dim=attrs.get("axis", 0) % len(x.shape), index=imp.tensor(ins[1]))]


@onnx_op("GatherND")
def _gather_nd(imp, ins, attrs, n):
    if attrs.get("batch_dims", 0):
        raise Unsupported("batch_dims")
    data, idx = imp.tensor(ins[0]), imp.tensor(ins[1])
    k = idx.shape[-1]
    if not isinstance(k, int):
        raise Unsupported("symbolic index depth")
    parts = [imp.aten("select.int", self=idx, dim=len(idx.shape) - 1, index=j) for j in range(k)]
    return [imp.aten("index.Tensor", self=data, indices=parts)]


@onnx_op("ConstantOfShape")
def _constant_of_shape(imp, ins, attrs, n):
    shape = imp.ints(ins[0], "the shape")
    v = attrs.get("value")
    fill = numpy_helper.to_array(v).reshape(-1) if v is not None else np.zeros(1, np.float32)
    dtype = str(fill.dtype) if str(fill.dtype) != "bool" else "bool"
    return [imp.aten("full", size=shape, fill_value=fill[0].item(), dtype=dtype)]


@onnx_op("Range")
def _range(imp, ins, attrs, n):
    vals = []
    for i in ins:
        k = imp.known(i)
        if k is None:
            raise Unsupported("bounds computed at run time")
        vals.append(k.value.reshape(-1)[0])
    dtype = str(imp.known(ins[0]).value.dtype)
    dtype = "int64" if dtype == "object" else dtype
    start, end, step = (v if isinstance(v, torch.SymInt) else v.item() for v in vals)
    return [imp.aten("arange.start_step", start=start, end=end, step=step, dtype=dtype)]


@onnx_op("Pad")
def _pad(imp, ins, attrs, n):
    x = imp.tensor(ins[0])
    mode = attrs.get("mode", b"constant")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if mode != "constant":
        raise Unsupported(f"mode={mode}")
    pads = imp.ints(ins[1], "pads") if imp.opset >= 11 else list(attrs["pads"])
    value = 0.0
    if imp.opset >= 11 and len(ins) > 2 and ins[2]:
        value = imp.known(ins[2]).value.item()
    elif imp.opset < 11:
        value = attrs.get("value", 0.0)
    nd = len(x.shape)
    axes = imp.ints(ins[3], "axes") if len(ins) > 3 and ins[3] else list(range(nd))
    begin, end = pads[:len(axes)], pads[len(axes):]
    full = [0] * (2 * nd)
    for a, b, e in zip(axes, begin, end):
        a %= nd
        full[2 * (nd - 1 - a)], full[2 * (nd - 1 - a) + 1] = b, e
    while len(full) > 2 and full[-2:] == [0, 0]:
        full = full[:-2]
    return [imp.aten("constant_pad_nd", self=x, pad=full, value=value)]


# ---- softmax, norms, attention ---------------------------------------------------------------------------------

@onnx_op("Softmax", "LogSoftmax")
def _softmax(imp, ins, attrs, n):
    x = imp.tensor(ins[0])
    nd = len(x.shape)
    op = "softmax.int" if n.op_type == "Softmax" else "log_softmax.int"
    if imp.opset >= 13:
        return [imp.aten(op, self=x, dim=attrs.get("axis", -1) % nd)]
    axis = attrs.get("axis", 1) % nd
    if axis == nd - 1:
        return [imp.aten(op, self=x, dim=axis)]
    shape = imp.shape(x)  # opset < 13: softmax over the flattened trailing dims
    y = imp.aten(op, self=imp.view(x, [math.prod(shape[:axis]), math.prod(shape[axis:])]), dim=1)
    return [imp.view(y, shape)]


def _channel_view(imp, t: Node, nd: int) -> Node:
    """A per-channel [C] tensor as [C, 1, ...] for an [N, C, spatial...] input."""
    return imp.view(t, [imp.shape(t)[0]] + [1] * (nd - 2))


@onnx_op("BatchNormalization")
def _batch_norm(imp, ins, attrs, n):
    if attrs.get("training_mode", 0):
        raise Unsupported("training_mode=1")
    x = imp.tensor(ins[0])
    nd = len(x.shape)
    eps = attrs.get("epsilon", 1e-5)
    ks = [imp.known(i) for i in ins[1:5]]
    if all(k is not None and not k.symbolic for k in ks):  # inference: fold to one scale and one shift
        scale, bias, mean, var = (k.value.astype(np.float64) for k in ks)
        a = scale / np.sqrt(var + eps)
        b = bias - mean * a
        dt = ks[0].value.dtype
        a_n = imp.const(Known(a.astype(dt).reshape([-1] + [1] * (nd - 2)), f"{n.name}.scale"))
        b_n = imp.const(Known(b.astype(dt).reshape([-1] + [1] * (nd - 2)), f"{n.name}.shift"))
        return [imp.aten("add.Tensor", self=imp.aten("mul.Tensor", self=x, other=a_n), other=b_n)]
    scale, bias, mean, var = (_channel_view(imp, imp.tensor(i), nd) for i in ins[1:5])
    inv = imp.aten("rsqrt", self=imp.aten("add.Scalar", self=var, other=eps))
    y = imp.aten("mul.Tensor", self=imp.aten("sub.Tensor", self=x, other=mean), other=inv)
    return [imp.aten("add.Tensor", self=imp.aten("mul.Tensor", self=y, other=scale), other=bias)]


@onnx_op("InstanceNormalization")
def _instance_norm(imp, ins, attrs, n):
    x = imp.tensor(ins[0])
    nd = len(x.shape)
    eps = attrs.get("epsilon", 1e-5)
    dims = list(range(2, nd))
    mean = imp.aten("mean.dim", self=x, dim=dims, keepdim=True)
    d = imp.aten("sub.Tensor", self=x, other=mean)
    var = imp.aten("mean.dim", self=imp.aten("mul.Tensor", self=d, other=d), dim=dims, keepdim=True)
    y = imp.aten("mul.Tensor", self=d, other=imp.aten("rsqrt", self=imp.aten("add.Scalar", self=var, other=eps)))
    scale, bias = (_channel_view(imp, imp.tensor(i), nd) for i in ins[1:3])
    return [imp.aten("add.Tensor", self=imp.aten("mul.Tensor", self=y, other=scale), other=bias)]


@onnx_op("LayerNormalization")
def _layer_norm(imp, ins, attrs, n):
    if len(n.output) > 1 and any(n.output[1:]):
        raise Unsupported("Mean / InvStdDev outputs")
    x = imp.tensor(ins[0])
    shape = imp.shape(x)
    axis = attrs.get("axis", -1) % len(shape)
    norm = shape[axis:]
    w = imp.tensor(ins[1])
    b = imp.tensor(ins[2]) if len(ins) > 2 and ins[2] else None
    if list(w.shape) != [imp.expr(d) for d in norm]:
        w = imp.aten("expand", self=w, size=norm)
    if b is not None and list(b.shape) != [imp.expr(d) for d in norm]:
        b = imp.aten("expand", self=b, size=norm)
    return [imp.aten("layer_norm", input=x, normalized_shape=norm, weight=w, bias=b, eps=attrs.get("epsilon", 1e-5))]


@onnx_op("RMSNormalization")
def _rms_norm(imp, ins, attrs, n):
    """x * rsqrt(mean(x^2 over axis..) + eps) * scale, in float32: the decomposition Llama-style exports carry,
    so the same later patterns see both (``lower.py``'s ``rms_norm`` lowering fails on float32 inputs today)."""
    x = imp.tensor(ins[0])
    nd = len(x.shape)
    axis = attrs.get("axis", -1) % nd
    xf = imp.cast(x, "float32")
    ms = imp.aten("mean.dim", self=imp.aten("mul.Tensor", self=xf, other=xf), dim=list(range(axis, nd)), keepdim=True)
    inv = imp.aten("rsqrt", self=imp.aten("add.Scalar", self=ms, other=attrs.get("epsilon", 1e-5)))
    y = imp.aten("mul.Tensor", self=imp.aten("mul.Tensor", self=xf, other=inv), other=imp.cast(imp.tensor(ins[1]),
                                                                                                  "float32"))
    return [imp.cast(y, x.dtype)]


@onnx_op("Attention")
def _attention(imp, ins, attrs, n):
    if attrs.get("softcap", 0.0):
        raise Unsupported("softcap")
    if len(ins) > 4 and any(ins[4:]):
        raise Unsupported("past_key / past_value")
    if len(n.output) > 3 and n.output[3]:
        raise Unsupported("qk_matmul_output")
    q, k, v = (imp.tensor(i) for i in ins[:3])
    mask = imp.tensor(ins[3]) if len(ins) > 3 and ins[3] else None
    three_d = len(q.shape) == 3
    if three_d:
        hq, hk = attrs["q_num_heads"], attrs["kv_num_heads"]

        def heads(t, h):
            b, s, hd = imp.shape(t)
            return imp.aten("permute", self=imp.view(t, [b, s, h, hd // h]), dims=[0, 2, 1, 3])
        q, k, v = heads(q, hq), heads(k, hk), heads(v, hk)
    gqa = q.shape[1] != k.shape[1]
    y = imp.aten("scaled_dot_product_attention", query=q, key=k, value=v, attn_mask=mask,
                 is_causal=bool(attrs.get("is_causal", 0)), scale=attrs.get("scale"), enable_gqa=gqa)
    if three_d:
        b, h, s, d = imp.shape(y)
        y = imp.view(imp.aten("permute", self=y, dims=[0, 2, 1, 3]), [b, s, h * d])
    outs = [y]
    if len(n.output) > 1:  # no past: the present key / value are this step's key / value
        outs += [imp.tensor(ins[1]), imp.tensor(ins[2])]
    return outs


# ---- reductions, pooling, convolution ------------------------------------------------------------------------

def _reduce_axes(imp, ins, attrs, n, nd):
    if len(ins) > 1 and ins[1]:
        axes = imp.ints(ins[1], "axes")
    else:
        axes = list(attrs.get("axes", []))
    if not axes:
        if attrs.get("noop_with_empty_axes", 0):
            return None
        axes = list(range(nd))
    return sorted(a % nd for a in axes)


@onnx_op("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceSumSquare", "ReduceL1", "ReduceL2",
         "ReduceLogSumExp")
def _reduce(imp, ins, attrs, n):
    x = imp.tensor(ins[0])
    axes = _reduce_axes(imp, ins, attrs, n, len(x.shape))
    if axes is None:
        return [x]
    keep = bool(attrs.get("keepdims", 1))
    op = n.op_type
    if op in ("ReduceSumSquare", "ReduceL2"):
        x = imp.aten("mul.Tensor", self=x, other=x)
    elif op == "ReduceL1":
        x = imp.aten("abs", self=x)
    if op == "ReduceMean":
        return [imp.aten("mean.dim", self=x, dim=axes, keepdim=keep)]
    if op in ("ReduceMax", "ReduceMin"):
        return [imp.aten("amax" if op == "ReduceMax" else "amin", self=x, dim=axes, keepdim=keep)]
    if op == "ReduceLogSumExp":
        m = imp.aten("amax", self=x, dim=axes, keepdim=True)
        s = imp.aten("sum.dim_IntList", self=imp.aten("exp", self=imp.aten("sub.Tensor", self=x, other=m)),
                     dim=axes, keepdim=keep)
        m = m if keep else imp.view(m, imp.shape(s))
        return [imp.aten("add.Tensor", self=imp.aten("log", self=s), other=m)]
    y = imp.aten("sum.dim_IntList", self=x, dim=axes, keepdim=keep)
    return [imp.aten("sqrt", self=y) if op == "ReduceL2" else y]


@onnx_op("ArgMax", "ArgMin")
def _argmax(imp, ins, attrs, n):
    if attrs.get("select_last_index", 0):
        raise Unsupported("select_last_index=1")
    x = imp.tensor(ins[0])
    return [imp.aten("argmax" if n.op_type == "ArgMax" else "argmin", self=x,
                     dim=attrs.get("axis", 0) % len(x.shape), keepdim=bool(attrs.get("keepdims", 1)))]


@onnx_op("CumSum")
def _cumsum(imp, ins, attrs, n):
    if attrs.get("exclusive", 0) or attrs.get("reverse", 0):
        raise Unsupported("exclusive / reverse")
    x = imp.tensor(ins[0])
    return [imp.aten("cumsum", self=x, dim=imp.ints(ins[1], "axis")[0] % len(x.shape))]


@onnx_op("TopK")
def _topk(imp, ins, attrs, n):
    x = imp.tensor(ins[0])
    k = imp.ints(ins[1], "k")[0] if imp.opset >= 10 else attrs["k"]
    vals, idx = imp.aten("topk", self=x, k=k, dim=attrs.get("axis", -1) % len(x.shape),
                         largest=bool(attrs.get("largest", 1)), sorted=bool(attrs.get("sorted", 1)))
    return [vals, idx]


def _pads(imp, x: Node, attrs, kernel, strides, dilations):
    """ONNX pads / auto_pad -> (symmetric ATen padding, or the explicit [begin..., end...] pads)."""
    nsp = len(kernel)
    auto = attrs.get("auto_pad", b"NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    if auto in ("NOTSET", ""):
        pads = list(attrs.get("pads", [0] * (2 * nsp)))
    elif auto == "VALID":
        pads = [0] * (2 * nsp)
    else:
        spatial = imp.shape(x)[2:]
        if any(isinstance(d, torch.SymInt) for d in spatial):
            raise Unsupported(f"auto_pad={auto} with symbolic spatial dims")
        begin, end = [], []
        for d, k, s, dl in zip(spatial, kernel, strides, dilations):
            total = max((-(-d // s) - 1) * s + (k - 1) * dl + 1 - d, 0)
            small = total // 2
            begin.append(small if auto == "SAME_UPPER" else total - small)
            end.append(total - begin[-1])
        pads = begin + end
    return pads[:nsp], pads[nsp:]


def _explicit_pad(imp, x, begin, end, value):
    full = []
    for b, e in zip(reversed(begin), reversed(end)):
        full += [b, e]
    return imp.aten("constant_pad_nd", self=x, pad=full, value=value)


@onnx_op("Conv")
def _conv(imp, ins, attrs, n):
    x, w = imp.tensor(ins[0]), imp.tensor(ins[1])
    b = imp.tensor(ins[2]) if len(ins) > 2 and ins[2] else None
    kernel = list(attrs.get("kernel_shape", w.shape[2:]))
    nsp = len(kernel)
    strides = list(attrs.get("strides", [1] * nsp))
    dil = list(attrs.get("dilations", [1] * nsp))
    begin, end = _pads(imp, x, attrs, kernel, strides, dil)
    if begin != end:
        x, begin = _explicit_pad(imp, x, begin, end, 0.0), [0] * nsp
    return [imp.aten("convolution", input=x, weight=w, bias=b, stride=strides, padding=begin, dilation=dil,
                     transposed=False, output_padding=[0] * nsp, groups=attrs.get("group", 1))]


@onnx_op("MaxPool", "AveragePool")
def _pool(imp, ins, attrs, n):
    if len(n.output) > 1 and n.output[1]:
        raise Unsupported("Indices output")
    x = imp.tensor(ins[0])
    kernel = list(attrs["kernel_shape"])
    nsp = len(kernel)
    if nsp not in (1, 2):
        raise Unsupported(f"{nsp}-d pooling")
    strides = list(attrs.get("strides", [1] * nsp))
    dil = list(attrs.get("dilations", [1] * nsp))
    begin, end = _pads(imp, x, attrs, kernel, strides, dil)
    ceil = bool(attrs.get("ceil_mode", 0))
    avg = n.op_type == "AveragePool"
    cip = bool(attrs.get("count_include_pad", 0))
    if begin != end:
        if avg and not cip:
            raise Unsupported("asymmetric pads without count_include_pad")
        x, begin = _explicit_pad(imp, x, begin, end, 0.0 if avg else -math.inf), [0] * nsp
    if avg and dil != [1] * nsp:
        raise Unsupported("dilations")
    one_d = nsp == 1
    if one_d:  # as 2-d pooling over [N, C, 1, L]
        x = imp.view(x, imp.shape(x)[:2] + [1] + imp.shape(x)[2:])
        kernel, strides, dil, begin = [1] + kernel, [1] + strides, [1] + dil, [0] + begin
    if avg:
        y = imp.aten("avg_pool2d", self=x, kernel_size=kernel, stride=strides, padding=begin, ceil_mode=ceil,
                     count_include_pad=cip)
    else:
        y = imp.aten("max_pool2d", self=x, kernel_size=kernel, stride=strides, padding=begin, dilation=dil,
                     ceil_mode=ceil)
    if one_d:
        s = imp.shape(y)
        y = imp.view(y, s[:2] + s[3:])
    return [y]


@onnx_op("LRN")
def _lrn(imp, ins, attrs, n):
    """Local response normalisation across channels: x / (bias + alpha / size * sum of x^2 over the channels
    [c - floor((size - 1) / 2), c + ceil((size - 1) / 2)])^beta. The window sum is a [size, 1] average pool (times
    size, folded into alpha) over x^2 viewed as [N, 1, C, spatial], zero-padded by ONNX's window (torch's
    local_response_norm pads the other way round for an even size)."""
    x = imp.tensor(ins[0])
    shape = imp.shape(x)
    if len(shape) < 3:
        raise Unsupported(f"a rank-{len(shape)} input (LRN wants [N, C, D1, ...])")
    size = int(attrs["size"])
    if size < 1:
        raise Unsupported(f"size={size}")
    sq = imp.view(imp.aten("mul.Tensor", self=x, other=x), [shape[0], 1, shape[1], math.prod(shape[2:])])
    sq = _explicit_pad(imp, sq, [(size - 1) // 2, 0], [size // 2, 0], 0.0)
    avg = imp.aten("avg_pool2d", self=sq, kernel_size=[size, 1], stride=[1, 1], padding=[0, 0], ceil_mode=False,
                   count_include_pad=True)
    den = imp.aten("add.Scalar", self=imp.aten("mul.Scalar", self=avg, other=attrs.get("alpha", 1e-4)),
                   other=attrs.get("bias", 1.0))
    den = imp.aten("pow.Tensor_Scalar", self=den, exponent=attrs.get("beta", 0.75))
    return [imp.aten("div.Tensor", self=x, other=imp.view(den, shape))]


@onnx_op("GlobalAveragePool", "GlobalMaxPool")
def _global_pool(imp, ins, attrs, n):
    x = imp.tensor(ins[0])
    dims = list(range(2, len(x.shape)))
    if n.op_type == "GlobalAveragePool":
        return [imp.aten("mean.dim", self=x, dim=dims, keepdim=True)]
    return [imp.aten("amax", self=x, dim=dims, keepdim=True)]


# ---- block-quantised weights ---------------------------------------------------------------------------------

def _unpack_nibbles(imp, packed: Node, shape: list, signed: bool) -> Node:
    """uint8 bytes [..., n/2] holding two 4-bit values each (low nibble first) -> float32 values [..., n]."""
    lo = imp.aten("bitwise_and.Tensor", self=packed, other=imp.scalar(15, "uint8"))
    hi = imp.aten("bitwise_right_shift.Tensor", self=packed, other=imp.scalar(4, "uint8"))
    ps = imp.shape(packed)
    both = imp.aten("cat", tensors=[imp.view(lo, ps + [1]), imp.view(hi, ps + [1])], dim=len(ps))
    vals = imp.view(both, ps[:-1] + [ps[-1] * 2])
    if signed:  # two's complement nibble: (v ^ 8) - 8
        vals = imp.aten("bitwise_xor.Tensor", self=vals, other=imp.scalar(8, "uint8"))
    f = imp.cast(vals, "float32")
    if signed:
        f = imp.aten("sub.Tensor", self=f, other=imp.scalar(8.0, "float32"))
    n = math.prod(shape)
    if ps[-1] * 2 != shape[-1] or len(ps) != len(shape):
        flat = imp.view(f, [-1])
        if math.prod(imp.shape(flat)) != n:
            flat = imp.aten("slice.Tensor", self=flat, dim=0, start=0, end=n)
        f = imp.view(flat, shape)
    return f


def _packed_weight(imp, k: Known) -> Node:
    """The int4 / uint4 initializer as stored: its packed bytes, one uint8 weight."""
    p = k.proto
    raw = p.raw_data if p.HasField("raw_data") else np.asarray(p.int32_data, dtype=np.uint8).tobytes()
    return imp.const(Known(np.frombuffer(raw, dtype=np.uint8).copy(), f"{k.name}.packed"))


@onnx_op("DequantizeLinear")
def _dequantize(imp, ins, attrs, n):
    xk = imp.known(ins[0])
    scale = imp.tensor(ins[1])
    out_dtype = scale.dtype
    if xk is not None and xk.proto is not None and xk.proto.data_type in INT4_SIGNED:
        shape = list(xk.value.shape)
        xf = _unpack_nibbles(imp, _packed_weight(imp, xk), shape, INT4_SIGNED[xk.proto.data_type])
    else:
        x = imp.tensor(ins[0])
        shape = imp.shape(x)
        xf = imp.cast(x, "float32")
    zp = None
    if len(ins) > 2 and ins[2]:
        zk = imp.known(ins[2])
        if zk is None:
            raise Unsupported("zero point computed at run time")
        if np.any(zk.value != 0):
            zp = imp.const(Known(zk.value.astype(np.float32), f"{zk.name}.f32"))
    nd = len(shape)
    axis = attrs.get("axis", 1) % max(nd, 1)
    block = attrs.get("block_size", 0)
    ss = list(scale.shape)
    if block:
        # [.., D, ..] -> [.., D/B, B, ..] times scale [.., D/B, 1, ..]: one scale per block, no repeat
        if shape[axis] % block:
            raise Unsupported(f"dimension {shape[axis]} not a multiple of block_size {block}")
        split = shape[:axis] + [shape[axis] // block, block] + shape[axis + 1:]
        sv = ss[:axis + 1] + [1] + ss[axis + 1:]
        y = imp.view(xf, split)
        if zp is not None:
            y = imp.aten("sub.Tensor", self=y, other=imp.view(zp, sv))
        y = imp.aten("mul.Tensor", self=y, other=imp.cast(imp.view(scale, sv), "float32"))
        y = imp.view(y, shape)
    else:
        if len(ss) == 1 and ss[0] != 1 and nd > 1:  # per-axis
            sv = [1] * nd
            sv[axis] = ss[0]
            scale = imp.view(scale, sv)
            zp = imp.view(zp, sv) if zp is not None else None
        y = xf if zp is None else imp.aten("sub.Tensor", self=xf, other=zp)
        y = imp.aten("mul.Tensor", self=y, other=imp.cast(scale, "float32"))
    return [imp.cast(y, out_dtype)]


@onnx_op("MatMulNBits", table=CONTRIB)
def _matmul_nbits(imp, ins, attrs, n):
    """A [..., K] x 4-bit B [N, K/bs, bs/2] (bytes, low nibble first) with scales [N * K/bs] -> [..., N]."""
    bits, bs = attrs.get("bits", 4), attrs["block_size"]
    K, N = attrs["K"], attrs["N"]
    if bits != 4:
        raise Unsupported(f"bits={bits}")
    if len(ins) > 4 and ins[4]:
        raise Unsupported("g_idx")
    a = imp.tensor(ins[0])
    nb = -(-K // bs)
    w = _unpack_nibbles(imp, imp.tensor(ins[1]), [N, nb, bs], signed=False)
    if len(ins) > 3 and ins[3]:
        zk = imp.known(ins[3])
        if zk is None:
            raise Unsupported("zero points computed at run time")
        z = zk.value
        if z.dtype == np.uint8:  # packed 4-bit zero points, [N, ceil(nb / 2)] bytes
            z = np.stack([z & 15, z >> 4], axis=-1).reshape(N, -1)[:, :nb]
        zp = imp.const(Known(z.astype(np.float32).reshape(N, nb, 1), f"{zk.name}.f32"))
    else:
        zp = imp.scalar(8.0, "float32")
    w = imp.aten("sub.Tensor", self=w, other=zp)
    s = imp.cast(imp.view(imp.tensor(ins[2]), [N, nb, 1]), "float32")
    w = imp.view(imp.aten("mul.Tensor", self=w, other=s), [N, nb * bs])
    if nb * bs != K:
        w = imp.aten("slice.Tensor", self=w, dim=1, start=0, end=K)
    w = imp.cast(w, a.dtype)
    bias = imp.tensor(ins[5]) if len(ins) > 5 and ins[5] else None
    return [imp.aten("linear", input=a, weight=w, bias=bias)]

