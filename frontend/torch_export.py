"""torch.export -> dayzero IR.

The module is exported with symbolic dimensions (``torch.export.Dim``), decomposed to core ATen except for the
few ops whose identity the pattern passes want to see whole (``linear``, ``scaled_dot_product_attention``, the
activations), and translated node by node:

* parameters, buffers and lifted constants -> ``weight`` nodes (the tensors stay where they are: a checkpoint
  file or the module; the graph only names them);
* user inputs -> ``input`` nodes;
* ATen calls -> nodes of the same op (tensor args are inputs, the rest typed attrs; see ``passes/ir/ops.py``);
  a Python number passed where ATen takes a Tensor becomes a ``scalar_tensor`` node;
* SymInt arithmetic (``sym_size``, ``mul`` on sizes) folds into sympy expressions inside attrs and shapes;
* runtime assertions (``_assert_tensor_metadata``, ``_assert_scalar``) are dropped: shapes are checked by the
  IR verifier and the runtime instead.

Every node keeps a span: the upstream module path (``nn_module_stack``) and the innermost source line outside
torch itself and outside generated code.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from dayzero import InternalError, UserError
from dayzero.passes.ir import ops
from dayzero.passes.ir.node import Graph, Node, Span, TensorType, repeated_block
from dayzero.passes.ir.text import make_symbol

# ops kept whole through decomposition: the pattern passes and kernels want to see them
KEEP_OPS = (
    torch.ops.aten.linear.default,
    torch.ops.aten.scaled_dot_product_attention.default,
    torch.ops.aten.silu.default,
    torch.ops.aten.gelu.default,
    torch.ops.aten.softmax.int,
    torch.ops.aten.rms_norm.default,
    torch.ops.aten.layer_norm.default,
)

_SKIPPED = {"_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range_for_size", "sym_constrain_range",
            "_assert_async", "_print"}


@dataclass
class Traced:
    """What the frontend hands to the passes: the graph and where its weights live."""

    graph: Graph
    weights: dict[str, torch.Tensor] = field(default_factory=dict)  # weight name -> tensor (may be meta)


def decompose(ep: ExportedProgram) -> ExportedProgram:
    table = torch.export.default_decompositions()
    for op in KEEP_OPS:
        table.pop(op, None)
    return ep.run_decompositions(table)


def export_module(module: torch.nn.Module, example_inputs: tuple, dynamic_shapes=None) -> ExportedProgram:
    try:
        ep = torch.export.export(module, example_inputs, dynamic_shapes=dynamic_shapes, strict=False)
    except Exception as e:  # torch.export raises many types; the user needs the first line
        raise UserError(f"torch.export failed: {type(e).__name__}: {str(e).splitlines()[0]}") from e
    return decompose(ep)


def _span(fx_node, strip_prefix: str) -> Span:
    stack = fx_node.meta.get("nn_module_stack") or {}
    module = ""
    if stack:
        module = list(stack.values())[-1][0]
        module = re.sub(r"^L\['self'\]\.?", "", module)
        if strip_prefix and module.startswith(strip_prefix):
            module = module[len(strip_prefix):]
    source = ""
    trace = fx_node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+)', trace)
    for path, line in reversed(frames):
        # generated code (torch.fx's "<eval_with_key>.N", "<string>") is no upstream line, and its name counts the
        # graphs this process generated: a span naming it would differ between two traces of the same model
        if "/torch/" not in path and not path.startswith("<"):
            m = re.search(r"(?:site-packages|dist-packages)/(.+)$", path)
            source = f"{m.group(1) if m else path.rsplit('/', 1)[-1]}:{line}"
            break
    return Span(module, source, repeated_block(module))


class _Translator:
    def __init__(self, ep: ExportedProgram, symbol_names: dict[str, str], strip_prefix: str):
        self.ep = ep
        self.strip = strip_prefix
        self.env: dict[str, Any] = {}  # fx node name -> Node | tuple[Node] | sympy expr
        self.sym_map: dict[sympy.Symbol, sympy.Symbol] = {}
        self.symbols: list[tuple[str, int, int]] = []
        for sym, vr in ep.range_constraints.items():
            if not getattr(sym, "is_Symbol", False):
                continue  # a derived dimension's range (8*s11 for seq = 8*_seq): implied by its symbol's
            name = symbol_names.get(str(sym), str(sym))
            hi = int(vr.upper) if vr.upper.is_finite else None
            if hi is None:
                raise UserError(f"dimension {name} has no upper bound: declare max= on its torch.export.Dim")
            self.sym_map[sym] = make_symbol(name)
            self.symbols.append((name, int(vr.lower), hi))
        self.unsupported: list[tuple[str, str]] = []

    # -- values ------------------------------------------------------------------------------------------------
    def dim(self, d) -> Any:
        if isinstance(d, int):
            return d
        if isinstance(d, torch.SymInt):
            e = d.node.expr
            return self._simplify(e.xreplace(self.sym_map)) if not e.is_Integer else int(e)
        if isinstance(d, sympy.Expr):
            return self._simplify(d.xreplace(self.sym_map))
        raise InternalError(f"not a dimension: {d!r}")

    def _simplify(self, e):
        """torch's own FloorDiv/Min/Max become sympy's, then Min/Max are decided over the symbols' declared ranges: with seq >= 4,
        ``min(4, seq)`` is 4 (each symbol s >= lo is written lo - 1 + p, p a positive integer, and back)."""
        from torch.utils._sympy import functions as tf

        if not isinstance(e, sympy.Basic) or e.is_Integer:
            return int(e) if isinstance(e, sympy.Basic) and e.is_Integer else e
        if e.has(tf.FloorDiv):  # as the text form reads ``a//b`` back (passes/ir/shape_expr.py): one spelling
            e = e.replace(lambda x: isinstance(x, tf.FloorDiv), lambda x: sympy.floor(x.args[0] / x.args[1]))
        if e.has(tf.Min) or e.has(tf.Max):
            e = e.replace(lambda x: isinstance(x, tf.Min), lambda x: sympy.Min(*x.args))
            e = e.replace(lambda x: isinstance(x, tf.Max), lambda x: sympy.Max(*x.args))
        if e.has(sympy.Min) or e.has(sympy.Max):
            lows = {name: lo for name, lo, _ in self.symbols}
            fwd, back = {}, {}
            for s in e.free_symbols:
                lo = lows.get(s.name, 1)
                if lo > 1:
                    p = sympy.Symbol(f"_p_{s.name}", integer=True, positive=True)
                    fwd[s], back[p] = p + (lo - 1), s - (lo - 1)
            if fwd:
                e = sympy.simplify(e.xreplace(fwd)).xreplace(back)
                e = sympy.expand(e) if not (e.has(sympy.Min) or e.has(sympy.Max)) else e
        return int(e) if e.is_Integer else e

    def ttype(self, val) -> TensorType:
        return TensorType(ops.dtype_name(val.dtype), tuple(self.dim(d) for d in val.shape))

    def attr(self, v) -> Any:
        if isinstance(v, torch.fx.Node):
            got = self.env[v.name]
            if isinstance(got, Node):
                raise InternalError(f"tensor {v.name} used as an attribute")
            return got
        if isinstance(v, (list, tuple)):
            return tuple(self.attr(x) for x in v)
        if isinstance(v, torch.dtype):
            return ops.dtype_name(v)
        if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return self.dim(v)
        if isinstance(v, (torch.device, torch.layout, torch.memory_format)):
            return None
        return v

    def tensor(self, v, span: Span, like: Any = None) -> Node:
        if isinstance(v, torch.fx.Node):
            got = self.env[v.name]
            if not isinstance(got, Node):
                raise InternalError(f"{v.name} is not a tensor")
            return got
        if isinstance(v, (bool, int, float)):
            dtype = "bool" if isinstance(v, bool) else "int64" if isinstance(v, int) else "float32"
            return Node.make("scalar_tensor", (), {"s": v, "dtype": dtype}, [TensorType(dtype, ())], span)
        raise InternalError(f"cannot use {v!r} as a tensor")

    # -- nodes -------------------------------------------------------------------------------------------------
    def run(self) -> Graph:
        sig = self.ep.graph_signature
        kinds = {s.arg.name: s for s in sig.input_specs}
        mutated = {s.target for s in sig.output_specs if s.kind == OutputKind.BUFFER_MUTATION}
        inputs, outputs, updates = [], [], []
        for n in self.ep.graph.nodes:
            if n.op == "placeholder":
                spec = kinds[n.name]
                ty = self.ttype(n.meta["val"])
                if spec.kind == InputKind.USER_INPUT:
                    node = Node.make("input", (), {"name": n.name}, [ty])
                    inputs.append(node)
                else:
                    name = spec.target
                    if self.strip and name.startswith(self.strip):
                        name = name[len(self.strip):]
                    if spec.target in mutated:  # a buffer the program writes: persistent state (a KV cache)
                        node = Node.make("state", (), {"name": name, "zone": "kv_cache"}, [ty])
                    else:
                        node = Node.make("weight", (), {"name": name}, [ty])
                self.env[n.name] = node
            elif n.op == "call_function":
                self.call(n)
            elif n.op == "output":
                for o, spec in zip(n.args[0], sig.output_specs):
                    if spec.kind == OutputKind.BUFFER_MUTATION:
                        name = spec.target[len(self.strip):] if self.strip and spec.target.startswith(self.strip) \
                            else spec.target
                        updates.append((name, self.tensor(o, Span())))
                    else:
                        outputs.append(self.tensor(o, Span()))
        if self.unsupported:
            from dayzero import UnsupportedOpsError
            raise UnsupportedOpsError(self.unsupported)
        # state updates follow the user outputs, as `assign(state, new value)`: the new value becomes the state's
        # contents when the program ends (passes/inplace_state.py turns most into in-place writes)
        states = {n.attr["name"]: n for n in self.env.values() if isinstance(n, Node) and n.op == "state"}
        for name, value in updates:
            outputs.append(Node.make("assign", (states[name], value), {}, [states[name].type], value.span))
        return Graph("main", tuple(inputs), tuple(outputs), tuple(self.symbols))

    def call(self, n) -> None:
        t = n.target
        span = _span(n, self.strip)
        val = n.meta.get("val")
        if t is operator.getitem:
            src = self.env[n.args[0].name]
            if isinstance(src, tuple):  # a list-returning op (split): one node per element
                self.env[n.name] = src[n.args[1]]
            else:
                self.env[n.name] = Node.make("getitem", (src,), {"index": n.args[1]}, [src.types[n.args[1]]], span)
            return
        if not isinstance(t, torch._ops.OpOverload):
            # python-level SymInt arithmetic (operator.mul, sym_size, ...): fold into an expression
            if isinstance(val, (torch.SymInt, int)):
                self.env[n.name] = self.dim(val)
                return
            self.unsupported.append((getattr(t, "__name__", str(t)), str(span)))
            return
        name = ops.aten_name(t)
        if name in _SKIPPED:
            return
        if isinstance(val, (torch.SymInt, int)) and not isinstance(val, bool):
            self.env[n.name] = self.dim(val)  # sym_size.int and friends
            return
        od = ops.aten_op(t)
        schema = t._schema.arguments
        bound = {}
        for i, a in enumerate(schema):
            if i < len(n.args):
                bound[a.name] = n.args[i]
            elif a.name in n.kwargs:
                bound[a.name] = n.kwargs[a.name]
            else:
                bound[a.name] = a.default_value if a.has_default_value() else None
        inputs, attrs = [], {}
        for aname, kind in od.args:
            v = bound[aname]
            if kind == ops.TENSOR:
                inputs.append(self.tensor(v, span))
            elif kind == ops.OPT_TENSOR:
                attrs[aname] = v is not None
                if v is not None:
                    inputs.append(self.tensor(v, span))
            elif kind == ops.TENSOR_LIST:
                attrs[aname] = len(v)
                inputs += [self.tensor(x, span) for x in v]
            elif kind == ops.OPT_TENSOR_LIST:
                attrs[aname] = tuple(x is not None for x in v)
                inputs += [self.tensor(x, span) for x in v if x is not None]
            else:
                attrs[aname] = self.attr(v)
        vals = list(val) if isinstance(val, (list, tuple)) else [val]
        if not all(isinstance(x, torch.Tensor) for x in vals):
            self.unsupported.append((name, str(span)))
            return
        types = [self.ttype(x) for x in vals]
        node = Node.make(name, inputs, attrs, types, span)
        if isinstance(val, list):  # List[Tensor] return: expose elements through getitem
            self.env[n.name] = tuple(Node.make("getitem", (node,), {"index": i}, [ty], span)
                                     for i, ty in enumerate(types))
        else:
            self.env[n.name] = node


def to_graph(ep: ExportedProgram, symbol_names: dict[str, str] | None = None, strip_prefix: str = "") -> Traced:
    g = _Translator(ep, symbol_names or {}, strip_prefix).run()
    weights = {}
    sd = dict(ep.state_dict)
    sd.update(ep.constants)
    for spec in ep.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            continue
        name = spec.target[len(strip_prefix):] if strip_prefix and spec.target.startswith(strip_prefix) else spec.target
        tensor = sd.get(spec.target)
        if isinstance(tensor, torch.Tensor):
            weights[name] = tensor
    return Traced(g, weights)


def symbol_names_from(ep: ExportedProgram, dims: dict[str, dict[int, str]]) -> dict[str, str]:
    """Map torch's internal symbol names (s70) to the user's Dim names (seq), through the inputs' shapes."""
    out = {}
    for n in ep.graph.nodes:
        if n.op == "placeholder" and n.name in dims:
            for axis, name in dims[n.name].items():
                d = n.meta["val"].shape[axis]
                if isinstance(d, torch.SymInt) and d.node.expr.is_Symbol:
                    out[str(d.node.expr)] = name
                elif isinstance(d, torch.SymInt):  # seq = 8*_seq: the block count
                    coeff, rest = d.node.expr.as_coeff_Mul()
                    if rest.is_Symbol and coeff.is_Integer:
                        out[str(rest)] = f"{name}_blocks"
    return out
