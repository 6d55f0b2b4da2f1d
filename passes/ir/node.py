"""The IR: one small immutable node type and the graph that holds a program.

    Node(op, inputs, attrs, types, span)

* ``op``     -- a name in the op registry (``passes/ir/ops.py``).
* ``inputs`` -- the nodes it reads, in order (tensors only; everything else is an attr).
* ``attrs``  -- typed attributes, a sorted tuple of (name, value) pairs; values are int, float, bool, str,
               None, a symbolic dimension (``sympy.Expr``) or tuples of those.
* ``types``  -- one ``TensorType(dtype, shape)`` per output; most ops have one output. A shape entry is an
               int or a ``sympy.Expr`` over the graph's symbols (``seq``, ``batch``), which have declared
               bounds in ``Graph.symbols``.
* ``span``   -- where it came from: the upstream module path and ``file:line``, and the repeated block (decoder
               layer) it belongs to, as the frontend that traced it knows it.

Nodes are immutable and compared by identity; ``structurally_equal`` compares two graphs. A ``Graph`` is its
input nodes, output nodes and symbols; the node list is always derived from the outputs (so dead code is
never in it).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping

import sympy

Dim = int | sympy.Expr


# the first ``<name>.<int>`` component of a module path: an entry of a repeated stack (a ModuleList entry such as
# ``model.layers.3``, or ``/model/layers.3/`` in an ONNX node name)
_BLOCK = re.compile(r"([A-Za-z_]\w*)\.(\d+)(?=[./\s(]|$)")


def repeated_block(module_path: str) -> tuple[str, int] | None:
    """(stack, index) of the outermost repeated block in an upstream module path (``"model.layers.3.mlp"`` ->
    ``("layers", 3)``), or None outside any stack (embedding, final norm, head). For the frontends, which
    write it into the ``Span`` of every node they trace."""
    m = _BLOCK.search(module_path)
    return (m.group(1), int(m.group(2))) if m else None


@dataclass(frozen=True)
class Span:
    module: str = ""  # upstream module path, e.g. "model.layers.0.mlp.experts"
    source: str = ""  # "modeling_qwen3_moe.py:123"
    # (stack, index) of the repeated block the node was traced from ("layers", 0): set by the frontend (the
    # module hierarchy is its knowledge), read by the memory plan (cross-layer state); None outside a stack
    layer: tuple[str, int] | None = None

    def __str__(self) -> str:
        return f"{self.module} ({self.source})" if self.source else self.module


@dataclass(frozen=True)
class TensorType:
    dtype: str  # numpy-style name: float32, bfloat16, int64, bool, uint8, float8_e4m3fn, ...
    shape: tuple[Dim, ...]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def is_empty(self) -> bool:
        """Statically empty: some dimension is the integer 0 (no elements at any binding of the symbols)."""
        return any(isinstance(d, int) and d == 0 for d in self.shape)

    def free_symbols(self) -> set[str]:
        out: set[str] = set()
        for d in self.shape:
            if isinstance(d, sympy.Expr):
                out |= {s.name for s in d.free_symbols}
        return out


def norm_dim(d: Any) -> Dim:
    """An int for every concrete dimension, a simplified sympy expression otherwise."""
    if isinstance(d, bool):
        raise TypeError("a dimension is not a bool")
    if isinstance(d, int):
        return d
    if isinstance(d, str):  # text is parsed where it is read (passes/ir/shape_expr.py), never sympified here
        raise TypeError(f"a dimension is an int or a sympy expression, not the text {d[:80]!r}")
    e = sympy.sympify(d, strict=True)  # strict: sympy objects and numbers only, no parsing of str(d)
    if e.is_Integer:
        return int(e)
    return _simplified(e)


@functools.lru_cache(maxsize=65536)
def _simplified(e: sympy.Expr) -> Dim:
    """``sympy.simplify`` (slow: ms per call) once per distinct expression; a graph repeats few of them."""
    return sympy.simplify(e)


def norm_attr(v: Any) -> Any:
    """Attrs are hashable and canonical: lists become tuples, sympy integers become ints."""
    if isinstance(v, (list, tuple)):
        return tuple(norm_attr(x) for x in v)
    if isinstance(v, sympy.Basic):
        return norm_dim(v)
    return v


@dataclass(frozen=True, eq=False)
class Node:
    op: str
    inputs: tuple["Node", ...]
    attrs: tuple[tuple[str, Any], ...]
    types: tuple[TensorType, ...]
    span: Span = field(default_factory=Span)

    @staticmethod
    def make(op: str, inputs: Iterable["Node"] = (), attrs: Mapping[str, Any] | None = None,
             types: Iterable[TensorType] = (), span: Span | None = None) -> "Node":
        a = tuple(sorted((k, norm_attr(v)) for k, v in (attrs or {}).items()))
        t = tuple(TensorType(ty.dtype, tuple(norm_dim(d) for d in ty.shape)) for ty in types)
        return Node(op, tuple(inputs), a, t, span or Span())

    # single-output conveniences
    @property
    def type(self) -> TensorType:
        if len(self.types) != 1:
            raise ValueError(f"{self.op} has {len(self.types)} outputs")
        return self.types[0]

    @property
    def dtype(self) -> str:
        return self.type.dtype

    @property
    def shape(self) -> tuple[Dim, ...]:
        return self.type.shape

    @property
    def attr(self) -> dict[str, Any]:
        return dict(self.attrs)

    def replace(self, **changes) -> "Node":
        if "attrs" in changes and isinstance(changes["attrs"], Mapping):
            changes["attrs"] = tuple(sorted((k, norm_attr(v)) for k, v in changes["attrs"].items()))
        return dataclasses.replace(self, **changes)

    def __repr__(self) -> str:  # short: the text form prints whole graphs
        return f"<{self.op} {' '.join(map(_type_str, self.types))}>"


def view_node(x: Node, shape, span: Span | None = None) -> Node:
    """``x`` viewed as ``shape`` (a ``view`` node), or ``x`` itself when it has that shape already."""
    shape = tuple(shape)
    if tuple(x.shape) == shape:
        return x
    return Node.make("view", (x,), {"size": shape}, [TensorType(x.dtype, shape)], span)


def _type_str(t: TensorType) -> str:
    return f"{t.dtype}[{', '.join(str(d) for d in t.shape)}]"


@dataclass(frozen=True)
class Graph:
    """A program: inputs (op ``input``), outputs, and the symbols of its shapes with inclusive bounds."""

    name: str
    inputs: tuple[Node, ...]
    outputs: tuple[Node, ...]
    symbols: tuple[tuple[str, int, int], ...] = ()  # (name, lower, upper)

    @property
    def symbol_bounds(self) -> dict[str, tuple[int, int]]:
        return {n: (lo, hi) for n, lo, hi in self.symbols}

    def nodes(self) -> list[Node]:
        """Every node reachable from the outputs (and every input), in a topological order."""
        return toposort(list(self.inputs) + list(self.outputs))

    def replace(self, **changes) -> "Graph":
        return dataclasses.replace(self, **changes)

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes())


def toposort(roots: list[Node]) -> list[Node]:
    """Post-order DFS without recursion (graphs of DeepSeek-V4 are thousands deep)."""
    order: list[Node] = []
    seen: set[int] = set()
    for root in roots:
        if id(root) in seen:
            continue
        stack: list[tuple[Node, int]] = [(root, 0)]
        while stack:
            node, i = stack.pop()
            if i == 0 and id(node) in seen:
                continue
            if i < len(node.inputs):
                stack.append((node, i + 1))
                child = node.inputs[i]
                if id(child) not in seen:
                    stack.append((child, 0))
            else:
                if id(node) not in seen:
                    seen.add(id(node))
                    order.append(node)
    return order


def users(graph: Graph) -> dict[int, list[Node]]:
    out: dict[int, list[Node]] = {}
    for n in graph.nodes():
        for i in n.inputs:
            out.setdefault(id(i), []).append(n)
    return out


def structurally_equal(a: Graph, b: Graph) -> bool:
    """Same inputs, outputs, symbols, and node-for-node the same ops, attrs, types and wiring."""
    if (a.name, a.symbols) != (b.name, b.symbols) or len(a.outputs) != len(b.outputs):
        return False
    na, nb = a.nodes(), b.nodes()
    if len(na) != len(nb):
        return False
    ia = {id(n): k for k, n in enumerate(na)}
    ib = {id(n): k for k, n in enumerate(nb)}
    for x, y in zip(na, nb):
        if (x.op, x.attrs, x.types, x.span) != (y.op, y.attrs, y.types, y.span):
            return False
        if [ia[id(i)] for i in x.inputs] != [ib[id(i)] for i in y.inputs]:
            return False
    return [ia[id(o)] for o in a.outputs] == [ib[id(o)] for o in b.outputs] and \
        [ia[id(o)] for o in a.inputs] == [ib[id(o)] for o in b.inputs]


def rewrite(graph: Graph, fn, with_original: bool = False) -> Graph:
    """Rebuild the graph bottom-up; ``fn(node) -> Node | None`` sees a node whose inputs are already rewritten
    and returns its replacement (or None to keep it). Identity of unchanged nodes is preserved. ``with_original``:
    ``fn(node, original)`` also gets the node of ``graph`` it stands for (a pass that matched on ``graph``)."""
    new: dict[int, Node] = {}
    for n in graph.nodes():
        ins = tuple(new[id(i)] for i in n.inputs)
        m = n if all(a is b for a, b in zip(ins, n.inputs)) else n.replace(inputs=ins)
        r = fn(m, n) if with_original else fn(m)
        new[id(n)] = m if r is None else r
    return graph.replace(inputs=tuple(new[id(i)] for i in graph.inputs),
                         outputs=tuple(new[id(o)] for o in graph.outputs))
