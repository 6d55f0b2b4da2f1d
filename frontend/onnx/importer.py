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

import os
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import sympy
import torch
from onnx import numpy_helper

from dayzero import InternalError, UnsupportedOpsError, UserError
from dayzero.frontend.onnx.converters import CONTRIB, HANDLERS
from dayzero.frontend.onnx.fold import FOLD
from dayzero.frontend.onnx.values import INT4_SIGNED, ONNX_DTYPES, Known, Unsupported
from dayzero.passes.ir import ops
from dayzero.passes.ir.node import Graph, Node, Span, TensorType, repeated_block
from dayzero.passes.ir.text import make_symbol

DEFAULT_MAX_BATCH = 8


def _is_batch(name: str) -> bool:
    return "batch" in name.lower() or name.lower() in ("b", "n", "bs")



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
            if name == "constant_pad_nd":  # torch's meta guards every symbolic size of its input to its hint
                out = args[0].new_empty(_padded_shape(list(args[0].shape), attrs["pad"]))
            else:
                out = od.aten(*args, **kwargs)
            # every IR value is contiguous row-major (expand and permute copy), so are the fakes
            out = type(out)(o.contiguous() for o in out) if isinstance(out, (tuple, list)) else out.contiguous()
        fixed = [s for s in self.sym_map if s in self.shape_env.replacements]
        if fixed:  # a shape function that guards a symbol to its hint would make every later size wrong
            raise InternalError(f"ONNX import: {name}'s shape function fixed the symbolic size(s) "
                                f"{', '.join(str(self.sym_map[s]) for s in fixed)} to a constant")
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
            dtype = ONNX_DTYPES.get(tt.elem_type)
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
        if init.data_type in INT4_SIGNED:
            arr = numpy_helper.to_array(init).astype(np.int8)  # for folding; the dequant reads the packed bytes
            return Known(arr, init.name, init)
        if init.data_type not in ONNX_DTYPES:
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
        handler = (HANDLERS if domain == "" else CONTRIB if domain == "com.microsoft" else {}).get(n.op_type)
        if handler is None:
            self.unsupported.append((n.op_type, str(self.span)))
            return
        ins = list(n.input)
        if any(i and i not in self.vals for i in ins):  # an input of an unsupported node upstream
            return
        kin = [self.known(i) if i else None for i in ins]
        try:
            if n.op_type in FOLD and all(k is not None for k, i in zip(kin, ins) if i):
                outs = FOLD[n.op_type](self, kin, attrs)
                if outs is not None:
                    for name, v in zip(n.output, outs):
                        self.vals[name] = Known(np.asarray(v), name)
                    return
            outs = handler(self, ins, attrs, n)
        except Unsupported as e:
            self.unsupported.append((f"{n.op_type} ({e})" if str(e) else n.op_type, str(self.span)))
            return
        for name, v in zip(n.output, outs):
            if name:
                self.vals[name] = v


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


def _padded_shape(shape: list, pad: list) -> list:
    """``constant_pad_nd``'s output sizes: ``pad`` holds (before, after) pairs from the last dimension back."""
    for i in range(len(pad) // 2):
        shape[-1 - i] = shape[-1 - i] + pad[2 * i] + pad[2 * i + 1]
    return shape
