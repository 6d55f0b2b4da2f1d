"""Shape folding for the ONNX importer: ONNX nodes whose inputs are all known at import, computed in numpy.

``FOLD`` maps an op type to ``(importer, known inputs, attrs) -> output values`` (or ``None`` to leave the node to
its converter). Object-typed arrays hold symbolic sizes (``torch.SymInt``): ``Shape`` of a tensor with a
``dim_param``, and sums / products of those, fold too, so reshape targets built from shapes become attrs.
"""

from __future__ import annotations

import numpy as np
from onnx import numpy_helper

from dayzero.frontend.onnx.values import NUMPY_DTYPES, ONNX_DTYPES, Unsupported

def _np_dtype(elem: int):
    dt = ONNX_DTYPES.get(elem)
    if dt is None or dt not in NUMPY_DTYPES:
        raise Unsupported(f"to={elem}")
    return NUMPY_DTYPES[dt]


def _axes_arg(imp, ins, attrs, idx=1):
    if len(ins) > idx and ins[idx] is not None:
        return [int(a) for a in ins[idx].value.reshape(-1)]
    return list(attrs["axes"]) if "axes" in attrs else None


def _binary_fold(fn):
    def f(imp, ins, attrs):
        a, b = ins[0].value, ins[1].value
        out = fn(a, b)
        if a.dtype != object and b.dtype != object:
            out = np.asarray(out).astype(np.result_type(a, b) if out.dtype != bool else bool)
        return [out]
    return f


def _int_div(a, b):
    if a.dtype.kind in "fc" or b.dtype.kind in "fc":
        return a / b
    if a.dtype == object or b.dtype == object:
        return a // b  # sizes are non-negative: floor == trunc
    return np.trunc(a / b).astype(np.result_type(a, b))


def _fold_slice(imp, ins, attrs):
    x = ins[0].value
    if imp.opset < 10:
        starts, ends, axes, steps = attrs["starts"], attrs["ends"], attrs.get("axes"), None
    else:
        starts, ends = [int(v) for v in ins[1].value], [int(v) for v in ins[2].value]
        axes = [int(v) for v in ins[3].value] if len(ins) > 3 and ins[3] is not None else None
        steps = [int(v) for v in ins[4].value] if len(ins) > 4 and ins[4] is not None else None
    axes = axes if axes is not None else list(range(len(starts)))
    steps = steps or [1] * len(starts)
    sl = [slice(None)] * x.ndim
    for s, e, a, st in zip(starts, ends, axes, steps):
        sl[a] = slice(s, e, st)
    return [x[tuple(sl)]]


def _fold_shape(imp, ins, attrs):
    x = ins[0].value
    shape = list(x.shape)
    s, e = attrs.get("start", 0), attrs.get("end")
    return [np.array(shape[s:e], dtype=np.int64)]


def _fold_range(imp, ins, attrs):
    if any(k.symbolic for k in ins):
        return None
    s, l, d = (k.value.item() for k in ins)
    return [np.arange(s, l, d).astype(ins[0].value.dtype)]


def _fold_cast(imp, ins, attrs):
    x = ins[0].value
    dt = _np_dtype(attrs["to"])
    if x.dtype == object:
        if np.issubdtype(dt, np.integer):
            return [x]
        return None
    return [x.astype(dt)]


def _fold_reshape(imp, ins, attrs):
    x = ins[0].value
    shape = [int(v) for v in ins[1].value]
    shape = [x.shape[i] if v == 0 and not attrs.get("allowzero", 0) else v for i, v in enumerate(shape)]
    return [x.reshape(shape)]


def _fold_unsqueeze(imp, ins, attrs):
    x = ins[0].value
    axes = _axes_arg(imp, ins, attrs)
    nd = x.ndim + len(axes)
    for a in sorted(a % nd for a in axes):
        x = np.expand_dims(x, a)
    return [x]


def _fold_squeeze(imp, ins, attrs):
    x = ins[0].value
    axes = _axes_arg(imp, ins, attrs)
    return [np.squeeze(x, axis=tuple(axes) if axes else None)]


def _fold_gather(imp, ins, attrs):
    x, idx = ins[0].value, ins[1].value
    if idx.dtype == object:
        return None
    axis = attrs.get("axis", 0)
    idx = np.where(idx < 0, idx + x.shape[axis], idx)
    return [np.take(x, idx, axis=axis)]


def _fold_expand(imp, ins, attrs):
    if ins[1].symbolic:
        return None
    x = ins[0].value
    shape = np.broadcast_shapes(x.shape, tuple(int(v) for v in ins[1].value))
    return [np.broadcast_to(x, shape).copy()]


def _fold_constant_of_shape(imp, ins, attrs):
    if ins[0].symbolic:
        return None
    v = attrs.get("value")
    fill = numpy_helper.to_array(v).reshape(-1) if v is not None else np.zeros(1, np.float32)
    return [np.full(tuple(int(d) for d in ins[0].value), fill[0], dtype=fill.dtype)]


def _fold_split(imp, ins, attrs):
    x = ins[0].value
    axis = attrs.get("axis", 0)
    split = [int(v) for v in ins[1].value] if len(ins) > 1 and ins[1] is not None else attrs.get("split")
    if split is None:
        return None
    idx = np.cumsum(split)[:-1]
    return np.split(x, idx, axis=axis)


def _concrete(fn):
    def f(imp, ins, attrs):
        if any(k is not None and k.value.dtype == object for k in ins):
            return None
        return fn(imp, ins, attrs)
    return f


FOLD = {
    "Constant": lambda imp, ins, attrs: [constant_value(attrs)],
    "Identity": lambda imp, ins, attrs: [ins[0].value],
    "Shape": _fold_shape,
    "Size": lambda imp, ins, attrs: [np.array(int(np.prod(ins[0].value.shape)), dtype=np.int64)],
    "Gather": _fold_gather,
    "Concat": lambda imp, ins, attrs: [np.concatenate([k.value.reshape(k.value.shape or (1,)) if k.value.ndim == 0
                                                       else k.value for k in ins], axis=attrs["axis"])],
    "Unsqueeze": _fold_unsqueeze,
    "Squeeze": _fold_squeeze,
    "Slice": _fold_slice,
    "Reshape": _fold_reshape,
    "Transpose": lambda imp, ins, attrs: [np.transpose(ins[0].value, attrs.get("perm"))],
    "Cast": _fold_cast,
    "Add": _binary_fold(lambda a, b: a + b),
    "Sub": _binary_fold(lambda a, b: a - b),
    "Mul": _binary_fold(lambda a, b: a * b),
    "Div": _binary_fold(_int_div),
    "Neg": lambda imp, ins, attrs: [-ins[0].value],
    "Equal": _concrete(_binary_fold(lambda a, b: a == b)),
    "Less": _concrete(_binary_fold(lambda a, b: a < b)),
    "Greater": _concrete(_binary_fold(lambda a, b: a > b)),
    "LessOrEqual": _concrete(_binary_fold(lambda a, b: a <= b)),
    "GreaterOrEqual": _concrete(_binary_fold(lambda a, b: a >= b)),
    "Not": _concrete(lambda imp, ins, attrs: [np.logical_not(ins[0].value)]),
    "And": _concrete(_binary_fold(np.logical_and)),
    "Or": _concrete(_binary_fold(np.logical_or)),
    "Where": _concrete(lambda imp, ins, attrs: [np.where(ins[0].value, ins[1].value, ins[2].value)]),
    "Max": _concrete(lambda imp, ins, attrs: [np.maximum.reduce([k.value for k in ins])]),
    "Min": _concrete(lambda imp, ins, attrs: [np.minimum.reduce([k.value for k in ins])]),
    "Abs": _concrete(lambda imp, ins, attrs: [np.abs(ins[0].value)]),
    "Sqrt": _concrete(lambda imp, ins, attrs: [np.sqrt(ins[0].value)]),
    "Reciprocal": _concrete(lambda imp, ins, attrs: [(1 / ins[0].value).astype(ins[0].value.dtype)]),
    "Pow": _concrete(lambda imp, ins, attrs: [np.power(ins[0].value, ins[1].value).astype(ins[0].value.dtype)]),
    "Range": _fold_range,
    "ConstantOfShape": _fold_constant_of_shape,
    "Expand": _fold_expand,
    "Split": _fold_split,
    "Flatten": _concrete(lambda imp, ins, attrs: [ins[0].value.reshape(
        int(np.prod(ins[0].value.shape[:attrs.get("axis", 1)])), -1)]),
}


def constant_value(attrs) -> np.ndarray:
    if "value" in attrs:
        return numpy_helper.to_array(attrs["value"])
    for k, dt in (("value_float", np.float32), ("value_int", np.int64)):
        if k in attrs:
            return np.array(attrs[k], dtype=dt)
    for k, dt in (("value_floats", np.float32), ("value_ints", np.int64)):
        if k in attrs:
            return np.array(list(attrs[k]), dtype=dt)
    raise Unsupported("sparse or string value")

