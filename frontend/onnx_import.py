"""ONNX -> dayzero IR: a model that arrives as ``model.onnx`` goes through the same passes, codegen and runtime.

The ``onnx`` package loads the model (external data files too). Every ONNX node maps onto ATen-named IR ops, so
the existing lowerings, reference interpreter and verifier apply unchanged:

    MatMul -> matmul            Gemm -> linear (+ mul / add)     Conv -> convolution (+ constant_pad_nd)
    Softmax -> softmax.int      Reshape/Flatten/(Un)Squeeze -> view       Transpose -> permute
    Gather -> embedding / select.int / index.Tensor    GatherND -> index.Tensor    Slice -> slice.Tensor
    LayerNormalization -> layer_norm    RMSNormalization -> its decomposition (mean.dim, rsqrt, mul)
    Attention (opset 23) -> scaled_dot_product_attention
    BatchNormalization, InstanceNormalization -> their elementwise decomposition
    MaxPool / AveragePool -> max_pool2d / avg_pool2d     GlobalAveragePool -> mean.dim
    TopK -> topk    Where -> where.self    Cast -> _to_copy    reductions -> mean.dim / sum.dim_IntList / amax ...

Values are either IR nodes or *known* values: initializers, ``Constant`` outputs and everything computed from them
and from shapes alone (``Shape``, ``Gather`` on a shape, ``Concat`` of sizes, ``Range`` with constant bounds).
Known values are numpy arrays folded at import; a shape entry that depends on a symbolic input dimension is a
``torch.SymInt`` (from a ``FakeTensorMode`` whose ``ShapeEnv`` holds one symbol per ``dim_param``) and becomes a
sympy expression over the graph's symbols in attrs and shapes, as in the torch.export frontend. Every emitted
node's output type comes from running its ATen op on fake tensors with those symbolic shapes.

Block-quantised weights stay as stored: ``DequantizeLinear`` with ``block_size`` and the ``MatMulNBits`` contrib op
become an explicit dequant subgraph of ATen ops on the packed bytes (nibble unpack with ``bitwise_and`` /
``bitwise_right_shift``, ``_to_copy`` to float, minus the zero point, times the per-block scale broadcast over a
``[..., blocks, block_size]`` view) feeding a ``linear`` / ``matmul``. That subgraph is the one the dequant
pattern pass matches for PyTorch checkpoints (packed storage -> unpack -> scale -> GEMM), so ONNX exports reach the
same fused kernels once that pass runs; where it does not match, the generic lowerings run the subgraph as is.

Symbolic input dimensions (``dim_param``) stay symbolic, bounded by ``max_batch`` for batch-like names and
``max_seq`` otherwise. Spans name the ONNX node and its op: ``Span(module=node.name, source="Conv (opset 20)")``.
Every unsupported operator is reported at once in one ``UnsupportedOpsError``.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import sympy
import torch
from onnx import numpy_helper

from dayzero import UnsupportedOpsError, UserError
from dayzero.passes.ir import ops
from dayzero.passes.ir.node import Graph, Node, Span, TensorType, repeated_block
from dayzero.passes.ir.text import make_symbol

DEFAULT_MAX_BATCH = 8
_INT_MAX = 2 ** 31 - 1

# ONNX TensorProto elem type -> IR dtype name
_DTYPES = {1: "float32", 2: "uint8", 3: "int8", 5: "int16", 6: "int32", 7: "int64", 9: "bool", 10: "float16",
           11: "float64", 16: "bfloat16", 17: "float8_e4m3fn", 19: "float8_e5m2"}
_NP = {"float32": np.float32, "uint8": np.uint8, "int8": np.int8, "int16": np.int16, "int32": np.int32,
       "int64": np.int64, "bool": np.bool_, "float16": np.float16, "float64": np.float64}
_INT4 = {onnx.TensorProto.INT4: True, onnx.TensorProto.UINT4: False}  # -> signed


def _is_batch(name: str) -> bool:
    return "batch" in name.lower() or name.lower() in ("b", "n", "bs")


class Known:
    """A value known at import: a numpy array, object-typed when entries are symbolic sizes (``torch.SymInt``)."""

    def __init__(self, value: np.ndarray, name: str = "", proto: onnx.TensorProto | None = None):
        self.value = value
        self.name = name
        self.proto = proto  # the initializer, when packed sub-byte storage must be read as stored

    @property
    def symbolic(self) -> bool:
        return self.value.dtype == object and any(not isinstance(v, (int, np.integer)) for v in self.value.flat)


def _torch_from_numpy(a: np.ndarray) -> torch.Tensor:
    if a.dtype == object:
        a = a.astype(np.int64)
    if str(a.dtype) == "bfloat16":
        return torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a).copy())


class _Importer:
    def __init__(self, model: onnx.ModelProto, max_seq: int, max_batch: int):
        from torch._dynamo.source import ConstantSource
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

        self.model = model
        self.opsets = {o.domain or "": o.version for o in model.opset_import}
        self.shape_env = ShapeEnv(duck_shape=False)
        self.mode = FakeTensorMode(shape_env=self.shape_env, allow_non_fake_inputs=True)
        self._src, self._dyn = ConstantSource, DimDynamic
        self.symints: dict[str, Any] = {}
        self.sym_map: dict[sympy.Symbol, sympy.Symbol] = {}
        self.symbols: list[tuple[str, int, int]] = []
        self.max_seq, self.max_batch = max_seq, max_batch
        self.vals: dict[str, Node | Known] = {}
        self.fake: dict[int, torch.Tensor] = {}
        self.weights: dict[str, torch.Tensor] = {}
        self._const_nodes: dict[str, Node] = {}
        self.unsupported: list[tuple[str, str]] = []
        self.span = Span()
        self._hint = 5

    # -- symbols ---------------------------------------------------------------------------------------------
    def symbol(self, name: str):
        if name not in self.symints:
            hi = self.max_batch if _is_batch(name) else self.max_seq
            self._hint += 2  # distinct hints: guards evaluated on hints never equate two symbols
            hint = min(self._hint, hi) if hi > 1 else 1
            src = self._src(name)
            s = self.shape_env.create_symbol(hint, src, dynamic_dim=self._dyn.DYNAMIC)
            self.shape_env.constrain_symbol_range(s, compiler_min=1, compiler_max=hi)
            self.symints[name] = self.shape_env.create_symintnode(s, hint=hint, source=src)
            self.sym_map[s] = make_symbol(name)
            self.symbols.append((name, 1, hi))
        return self.symints[name]

    def expr(self, v) -> Any:
        """A python int for a concrete size, a sympy expression over the graph's symbols otherwise."""
        if isinstance(v, torch.SymInt):
            e = v.node.expr
            return int(e) if e.is_Integer else e.xreplace(self.sym_map)
        if isinstance(v, (list, tuple)):
            return tuple(self.expr(x) for x in v)
        if isinstance(v, np.integer):
            return int(v)
        if isinstance(v, np.floating):
            return float(v)
        return v

    # -- values ----------------------------------------------------------------------------------------------
    def shape(self, n: Node) -> list:
        return list(self.fake[id(n)].shape)

    def tensor(self, name: str) -> Node:
        v = self.vals[name]
        return v if isinstance(v, Node) else self.const(v)

    def const(self, k: Known) -> Node:
        key = k.name or f"anon{id(k)}"
        if key in self._const_nodes:
            return self._const_nodes[key]
        if k.symbolic:
            raise UserError(f"{self.span.module}: a shape value ({k.name}) is used as a tensor; dayzero folds shapes "
                            "into attrs and cannot materialise a symbolic one")
        t = _torch_from_numpy(k.value)
        wname = k.name if k.name else f"onnx_const.{len(self._const_nodes)}"
        self.weights[wname] = t
        n = Node.make("weight", (), {"name": wname}, [TensorType(ops.dtype_name(t.dtype), tuple(t.shape))])
        with self.mode:
            self.fake[id(n)] = torch.empty(t.shape, dtype=t.dtype)
        self._const_nodes[key] = n
        return n

    def scalar(self, value, dtype: str) -> Node:
        """A literal [1] tensor as a ``full`` node (not a weight): fold_constants folds it into the pass context's
        constants, so passes can check it by value (the dequant pattern reads the nibble mask, shift and offset)."""
        return self.aten("full", size=[1], fill_value=value, dtype=dtype)

    def known(self, name: str) -> Known | None:
        v = self.vals.get(name) if name else None
        return v if isinstance(v, Known) else None

    def ints(self, name: str, what: str) -> list:
        k = self.known(name)
        if k is None:
            raise UserError(f"{self.span.module}: {what} ({name}) must be known at import (a constant or a shape)")
        return [x if isinstance(x, torch.SymInt) else int(x) for x in k.value.reshape(-1)]

    # -- emitting ATen ops -----------------------------------------------------------------------------------
    def aten(self, name: str, /, **kw) -> Node:
        """One IR node of ATen op NAME; tensor args are Nodes, the rest python values / SymInts; output types
        from the op's meta function on fake tensors with symbolic shapes."""
        od = ops.get(name)
        schema = {a.name: a for a in od.aten._schema.arguments}
        inputs, attrs = [], {}
        for aname, kind in od.args:
            if aname in kw:
                v = kw[aname]
            else:
                a = schema[aname]
                v = a.default_value if a.has_default_value() else None
            if kind == ops.TENSOR:
                inputs.append(v)
            elif kind == ops.OPT_TENSOR:
                attrs[aname] = v is not None
                if v is not None:
                    inputs.append(v)
            elif kind == ops.TENSOR_LIST:
                attrs[aname] = len(v)
                inputs += list(v)
            elif kind == ops.OPT_TENSOR_LIST:
                attrs[aname] = tuple(x is not None for x in v)
                inputs += [x for x in v if x is not None]
            else:
                if isinstance(v, torch.dtype):
                    v = ops.dtype_name(v)
                attrs[aname] = v
        args, kwargs = od.unflatten([self.fake[id(i)] for i in inputs], attrs)
        with self.mode:
            out = od.aten(*args, **kwargs)
            # every IR value is contiguous row-major (expand and permute copy), so are the fakes
            out = type(out)(o.contiguous() for o in out) if isinstance(out, (tuple, list)) else out.contiguous()
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        types = [TensorType(ops.dtype_name(o.dtype), tuple(self.expr(d) for d in o.shape)) for o in outs]
        node = Node.make(name, inputs, {k: self.expr(v) for k, v in attrs.items()}, types, self.span)
        if isinstance(out, (tuple, list)):
            items = []
            for i, (ty, o) in enumerate(zip(types, outs)):
                g = Node.make("getitem", (node,), {"index": i}, [ty], self.span)
                self.fake[id(g)] = o
                items.append(g)
            return tuple(items)
        self.fake[id(node)] = out
        return node

    def view(self, x: Node, shape: list) -> Node:
        out = self.aten("view", self=x, size=list(shape))
        size = list(self.fake[id(out)].shape)
        if any(not isinstance(d, torch.SymInt) and d == -1 for d in shape):  # record the inferred size, not -1
            out = self.aten("view", self=x, size=size)
        return out

    def cast(self, x: Node, dtype: str) -> Node:
        return x if x.dtype == dtype else self.aten("_to_copy", self=x, dtype=dtype)

    # -- the graph -------------------------------------------------------------------------------------------
    def run(self) -> Graph:
        g = self.model.graph
        for init in g.initializer:
            self.vals[init.name] = self._initializer(init)
        inputs = []
        for vi in g.input:
            if vi.name in self.vals:  # an initializer listed as an input (old exporters): a weight
                continue
            tt = vi.type.tensor_type
            dtype = _DTYPES.get(tt.elem_type)
            if dtype is None:
                raise UserError(f"input {vi.name}: element type {tt.elem_type} is not supported")
            dims = []
            for k, d in enumerate(tt.shape.dim):
                if d.HasField("dim_value"):
                    dims.append(d.dim_value)
                else:
                    dims.append(self.symbol(d.dim_param or f"{vi.name}_{k}"))
            node = Node.make("input", (), {"name": vi.name},
                             [TensorType(dtype, tuple(self.expr(d) for d in dims))])
            with self.mode:
                self.fake[id(node)] = torch.empty(dims, dtype=ops.torch_dtype(dtype))
            self.vals[vi.name] = node
            inputs.append(node)
        for n in g.node:
            self.node(n)
        if self.unsupported:
            raise UnsupportedOpsError(self.unsupported)
        outputs = []
        for vo in g.output:
            v = self.vals[vo.name]
            outputs.append(v if isinstance(v, Node) else self.const(v))
        return Graph(g.name or "main", tuple(inputs), tuple(outputs), tuple(self.symbols))

    def _initializer(self, init: onnx.TensorProto) -> Known:
        if init.data_type in _INT4:
            arr = numpy_helper.to_array(init).astype(np.int8)  # for folding; the dequant reads the packed bytes
            return Known(arr, init.name, init)
        if init.data_type not in _DTYPES:
            raise UserError(f"initializer {init.name}: element type {init.data_type} is not supported")
        return Known(numpy_helper.to_array(init), init.name, init)

    def node(self, n: onnx.NodeProto) -> None:
        domain = n.domain or ""
        if domain == "ai.onnx":
            domain = ""
        opset = self.opsets.get(domain, self.opsets.get("", 0))
        module = n.name or (n.output[0] if n.output else n.op_type)
        self.span = Span(module=module, source=f"{(domain + '.') if domain else ''}{n.op_type} (opset {opset})",
                         layer=repeated_block(module))
        self.opset = opset
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        handler = (_HANDLERS if domain == "" else _CONTRIB if domain == "com.microsoft" else {}).get(n.op_type)
        if handler is None:
            self.unsupported.append((n.op_type, str(self.span)))
            return
        ins = list(n.input)
        if any(i and i not in self.vals for i in ins):  # an input of an unsupported node upstream
            return
        kin = [self.known(i) if i else None for i in ins]
        try:
            if n.op_type in _FOLD and all(k is not None for k, i in zip(kin, ins) if i):
                outs = _FOLD[n.op_type](self, kin, attrs)
                if outs is not None:
                    for name, v in zip(n.output, outs):
                        self.vals[name] = Known(np.asarray(v), name)
                    return
            outs = handler(self, ins, attrs, n)
        except _Unsupported as e:
            self.unsupported.append((f"{n.op_type} ({e})" if str(e) else n.op_type, str(self.span)))
            return
        for name, v in zip(n.output, outs):
            if name:
                self.vals[name] = v


class _Unsupported(Exception):
    """This node's attributes ask for a variant dayzero does not map (named in the message)."""


# ---- folding of known values (numpy; object arrays hold symbolic sizes) -------------------------------------

def _np_dtype(elem: int):
    dt = _DTYPES.get(elem)
    if dt is None or dt not in _NP:
        raise _Unsupported(f"to={elem}")
    return _NP[dt]


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


_FOLD = {
    "Constant": lambda imp, ins, attrs: [_constant_value(attrs)],
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


def _constant_value(attrs) -> np.ndarray:
    if "value" in attrs:
        return numpy_helper.to_array(attrs["value"])
    for k, dt in (("value_float", np.float32), ("value_int", np.int64)):
        if k in attrs:
            return np.array(attrs[k], dtype=dt)
    for k, dt in (("value_floats", np.float32), ("value_ints", np.int64)):
        if k in attrs:
            return np.array(list(attrs[k]), dtype=dt)
    raise _Unsupported("sparse or string value")


# ---- node handlers: (importer, input names, attrs, node) -> output values ------------------------------------

_HANDLERS: dict = {}
_CONTRIB: dict = {}


def onnx_op(*names, table=None):
    def deco(fn):
        for n in names:
            (_HANDLERS if table is None else table)[n] = fn
        return fn
    return deco


def _shape_value(imp, ins, attrs, n):
    x = imp.tensor(ins[0])
    shape = imp.shape(x)
    s, e = attrs.get("start", 0), attrs.get("end")
    return [Known(np.array(shape[s:e], dtype=object), n.output[0])]


_HANDLERS["Shape"] = _shape_value
_HANDLERS["Size"] = lambda imp, ins, attrs, n: [Known(np.array(math.prod(imp.shape(imp.tensor(ins[0]))),
                                                               dtype=object))]
_HANDLERS["Identity"] = lambda imp, ins, attrs, n: [imp.vals[ins[0]]]
_HANDLERS["Dropout"] = lambda imp, ins, attrs, n: [imp.vals[ins[0]]]
_HANDLERS["Constant"] = lambda imp, ins, attrs, n: [Known(_constant_value(attrs), n.output[0])]

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
    _HANDLERS[_k] = _binary(_v)


@onnx_op("Div")
def _div(imp, ins, attrs, n):
    a, b = imp.tensor(ins[0]), imp.tensor(ins[1])
    if a.dtype.startswith("float") or a.dtype == "bfloat16":
        return [imp.aten("div.Tensor", self=a, other=b)]
    return [imp.aten("div.Tensor_mode", self=a, other=b, rounding_mode="trunc")]


@onnx_op("Mod")
def _mod(imp, ins, attrs, n):
    if attrs.get("fmod", 0):
        raise _Unsupported("fmod=1")
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
    _HANDLERS[_k] = _unary(_v)


@onnx_op("IsInf")
def _isinf(imp, ins, attrs, n):
    if attrs.get("detect_negative", 1) != 1 or attrs.get("detect_positive", 1) != 1:
        raise _Unsupported("one-sided detection")
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
                raise _Unsupported("min/max computed at run time")
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
        dtype = _DTYPES.get(attrs["to"])
        if dtype is None:
            raise _Unsupported(f"to={attrs['to']}")
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
            raise _Unsupported("negative step")
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
        raise _Unsupported("batch_dims")
    data, idx = imp.tensor(ins[0]), imp.tensor(ins[1])
    k = idx.shape[-1]
    if not isinstance(k, int):
        raise _Unsupported("symbolic index depth")
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
            raise _Unsupported("bounds computed at run time")
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
        raise _Unsupported(f"mode={mode}")
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
        raise _Unsupported("training_mode=1")
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
        raise _Unsupported("Mean / InvStdDev outputs")
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
        raise _Unsupported("softcap")
    if len(ins) > 4 and any(ins[4:]):
        raise _Unsupported("past_key / past_value")
    if len(n.output) > 3 and n.output[3]:
        raise _Unsupported("qk_matmul_output")
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
        raise _Unsupported("select_last_index=1")
    x = imp.tensor(ins[0])
    return [imp.aten("argmax" if n.op_type == "ArgMax" else "argmin", self=x,
                     dim=attrs.get("axis", 0) % len(x.shape), keepdim=bool(attrs.get("keepdims", 1)))]


@onnx_op("CumSum")
def _cumsum(imp, ins, attrs, n):
    if attrs.get("exclusive", 0) or attrs.get("reverse", 0):
        raise _Unsupported("exclusive / reverse")
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
            raise _Unsupported(f"auto_pad={auto} with symbolic spatial dims")
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
        raise _Unsupported("Indices output")
    x = imp.tensor(ins[0])
    kernel = list(attrs["kernel_shape"])
    nsp = len(kernel)
    if nsp not in (1, 2):
        raise _Unsupported(f"{nsp}-d pooling")
    strides = list(attrs.get("strides", [1] * nsp))
    dil = list(attrs.get("dilations", [1] * nsp))
    begin, end = _pads(imp, x, attrs, kernel, strides, dil)
    ceil = bool(attrs.get("ceil_mode", 0))
    avg = n.op_type == "AveragePool"
    cip = bool(attrs.get("count_include_pad", 0))
    if begin != end:
        if avg and not cip:
            raise _Unsupported("asymmetric pads without count_include_pad")
        x, begin = _explicit_pad(imp, x, begin, end, 0.0 if avg else -math.inf), [0] * nsp
    if avg and dil != [1] * nsp:
        raise _Unsupported("dilations")
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
    if xk is not None and xk.proto is not None and xk.proto.data_type in _INT4:
        shape = list(xk.value.shape)
        xf = _unpack_nibbles(imp, _packed_weight(imp, xk), shape, _INT4[xk.proto.data_type])
    else:
        x = imp.tensor(ins[0])
        shape = imp.shape(x)
        xf = imp.cast(x, "float32")
    zp = None
    if len(ins) > 2 and ins[2]:
        zk = imp.known(ins[2])
        if zk is None:
            raise _Unsupported("zero point computed at run time")
        if np.any(zk.value != 0):
            zp = imp.const(Known(zk.value.astype(np.float32), f"{zk.name}.f32"))
    nd = len(shape)
    axis = attrs.get("axis", 1) % max(nd, 1)
    block = attrs.get("block_size", 0)
    ss = list(scale.shape)
    if block:
        # [.., D, ..] -> [.., D/B, B, ..] times scale [.., D/B, 1, ..]: one scale per block, no repeat
        if shape[axis] % block:
            raise _Unsupported(f"dimension {shape[axis]} not a multiple of block_size {block}")
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


@onnx_op("MatMulNBits", table=_CONTRIB)
def _matmul_nbits(imp, ins, attrs, n):
    """A [..., K] x 4-bit B [N, K/bs, bs/2] (bytes, low nibble first) with scales [N * K/bs] -> [..., N]."""
    bits, bs = attrs.get("bits", 4), attrs["block_size"]
    K, N = attrs["K"], attrs["N"]
    if bits != 4:
        raise _Unsupported(f"bits={bits}")
    if len(ins) > 4 and ins[4]:
        raise _Unsupported("g_idx")
    a = imp.tensor(ins[0])
    nb = -(-K // bs)
    w = _unpack_nibbles(imp, imp.tensor(ins[1]), [N, nb, bs], signed=False)
    if len(ins) > 3 and ins[3]:
        zk = imp.known(ins[3])
        if zk is None:
            raise _Unsupported("zero points computed at run time")
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


# ---- entry points --------------------------------------------------------------------------------------------

def load_model(path: str | os.PathLike) -> onnx.ModelProto:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{path}: no such ONNX file")
    try:
        return onnx.load(str(p), load_external_data=True)
    except Exception as e:  # protobuf / external-data errors come in many types
        raise UserError(f"{path}: cannot load ONNX model: {type(e).__name__}: {str(e).splitlines()[0]}") from None


def import_onnx(model: onnx.ModelProto, max_seq: int, max_batch: int = DEFAULT_MAX_BATCH):
    """ONNX model -> ``Traced`` (graph + the tensors its ``weight`` nodes name)."""
    from dayzero.frontend.torch_export import Traced

    imp = _Importer(model, max_seq, max_batch)
    g = imp.run()
    return Traced(g, imp.weights)


def trace_onnx(path, max_seq: int, max_batch: int = DEFAULT_MAX_BATCH):
    """The driver's hook for MODEL paths ending in ``.onnx``."""
    from dayzero.frontend.trace import Frontend

    return Frontend(traced=import_onnx(load_model(path), max_seq, max_batch), model_type="onnx")


def reference_outputs(path, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The reference for ``dayzero compare model.onnx OUT``: onnxruntime on the model, in graph output order.

    When ``inputs`` is empty and the model directory has ``test_data_set_*/{input,output}_*.pb`` (the ONNX model
    zoo's layout), the first data set's outputs are returned; ``test_data_inputs(path)`` gives its inputs."""
    p = Path(path)
    if not inputs:
        sets = sorted(p.parent.glob("test_data_set_*"))
        if sets:
            return [numpy_helper.to_array(_read_tensor(f)) for f in sorted(sets[0].glob("output_*.pb"),
                                                                            key=_pb_index)]
    try:
        import onnxruntime as ort
    except ImportError:
        raise UserError("the ONNX reference needs onnxruntime: pip install 'dayzero[onnx]'") from None
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(p), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, {k: np.asarray(v) for k, v in inputs.items()})


def _pb_index(f: Path) -> int:
    return int(f.stem.rsplit("_", 1)[-1])


def _read_tensor(f: Path) -> onnx.TensorProto:
    t = onnx.TensorProto()
    t.ParseFromString(f.read_bytes())
    return t


def test_data_inputs(path) -> dict[str, np.ndarray] | None:
    """The inputs of the model's first ``test_data_set_*`` directory, keyed by graph input name (or None)."""
    p = Path(path)
    sets = sorted(p.parent.glob("test_data_set_*"))
    if not sets:
        return None
    model = onnx.load(str(p), load_external_data=False)
    inits = {i.name for i in model.graph.initializer}
    names = [i.name for i in model.graph.input if i.name not in inits]
    files = sorted(sets[0].glob("input_*.pb"), key=_pb_index)
    out = {}
    for k, f in enumerate(files):
        t = _read_tensor(f)
        out[t.name or names[k]] = numpy_helper.to_array(t)
    return out


test_data_inputs.__test__ = False  # not a pytest test despite its name
