"""fuse: element-wise chains, reductions with their element-wise prologue / epilogue, and the views between them
-> one ``fused`` node per group, one kernel per group.

    x ─ pow ─ mean ─ add(eps) ─ rsqrt ─┐                       x ─┐
    └──────────────────────────────── mul ─ mul(w) ─ y   ==>   w ─┴─ fused{pow, mean, add, rsqrt, mul, mul} ─ y

The groups are found on graph shape, by op identity only (never names or model types), from the outputs up:
each kernel-producing node not yet in a group roots a new group (views never root one: they cost nothing alone),
and a producer joins its users' group when

* it is fusible: element-wise (``ELEMENTWISE``), an index remap (``INJECTIVE``), a view (``VIEWS``), or a row
  reduction (``REDUCTIONS``; at most one per group, so a kernel has one reduction for its schedule to tile),
* every one of its users is in that one group (a value read elsewhere is materialised: never duplicated), and
* it is not a graph output, and
* it was traced from the same repeated block (decoder layer, ``Span.layer``) as the group's root: a layer's
  output (its last residual add) stays a value of its own, which ``dayzero compare --streamed`` and the per-layer
  reports read, even where only the next layer or the final norm reads it.

A group built this way is convex (every member's users lie in the group, so no path leaves and re-enters it),
has one output (its root) and reads its external values as inputs. A group of one kernel op (with or without
views) stays as it was: fusing it saves no launch. The fused node's body lists the members in topological order,
each ``(op, args, attrs, dtype, shape)``: ``args`` index the node's inputs first (0 .. n-1), then earlier body
entries (n, n+1, ...); the last entry is the output. Its reference runs the members' references in that order
(``passes/ir/reference_fused.py``); codegen composes the members' TE computes into one PrimFunc.

Ordering: last of the graph steps: every pattern pass matches the unfused ops.
"""

from __future__ import annotations

from dayzero.passes.ir.node import Graph, Node, TensorType, rewrite, users
from dayzero.passes.pipeline import Found, counted

ELEMENTWISE = frozenset({
    "_to_copy", "to.dtype", "type_as", "abs", "neg", "sign", "ceil", "floor", "exp", "expm1", "log", "log1p",
    "sqrt", "rsqrt", "reciprocal", "sin", "cos", "tanh", "sigmoid", "silu", "gelu", "relu", "softplus", "erf",
    "add.Tensor", "add.Scalar", "sub.Tensor", "sub.Scalar", "rsub.Tensor", "rsub.Scalar", "mul.Tensor",
    "mul.Scalar", "div.Tensor", "div.Scalar", "div.Tensor_mode", "pow.Tensor_Scalar", "pow.Tensor_Tensor",
    "maximum", "minimum", "clamp", "clamp.Tensor", "clamp_min", "clamp_max", "where.self", "masked_fill.Scalar",
    "eq.Tensor", "eq.Scalar", "ne.Tensor", "ne.Scalar", "lt.Tensor", "lt.Scalar", "le.Tensor", "le.Scalar",
    "gt.Tensor", "gt.Scalar", "ge.Tensor", "ge.Scalar", "logical_and", "logical_or", "logical_not", "isnan",
    "isinf",
})
# each output element reads input elements at remapped indices (no arithmetic across elements)
INJECTIVE = frozenset({"permute", "transpose.int", "slice.Tensor", "select.int", "cat", "expand"})
# contiguous reshapes (no kernel alone): inside a group, an index remap of the value they view
VIEWS = frozenset({"view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "squeeze.dim", "squeeze.dims",
                   "alias", "clone"})
REDUCTIONS = frozenset({"mean.dim", "sum.dim_IntList", "amax", "amin", "softmax.int", "_softmax",
                        "log_softmax.int", "_log_softmax"})
FUSIBLE = ELEMENTWISE | INJECTIVE | VIEWS | REDUCTIONS

FUSED = "fused"


def _fusible(n: Node) -> bool:
    return n.op in FUSIBLE and len(n.types) == 1 and not n.type.is_empty


def fuse(g: Graph) -> tuple[Graph, Found]:
    """The graph with every group of two or more kernel ops replaced by one ``fused`` node; Found counts them."""
    nodes = g.nodes()
    use = users(g)
    outputs = {id(o) for o in g.outputs}
    group: dict[int, int] = {}  # node id -> its group's root id
    reductions: dict[int, int] = {}  # root id -> reductions in the group
    layer: dict[int, tuple | None] = {}  # root id -> the repeated block it was traced from
    for n in reversed(nodes):
        if not _fusible(n):
            continue
        us = use.get(id(n), [])
        roots = {group.get(id(u)) for u in us}
        red = n.op in REDUCTIONS
        root = next(iter(roots)) if len(roots) == 1 else None
        joins = (root is not None and id(n) not in outputs and not (red and reductions[root])
                 and n.span.layer == layer[root])
        if not joins:
            if n.op in VIEWS:
                continue  # a view alone is an alias of its source: no kernel
            root = id(n)
            reductions[root], layer[root] = 0, n.span.layer
        group[id(n)] = root
        reductions[root] += red
    members: dict[int, list[Node]] = {}
    for n in nodes:  # topological order within each group
        if id(n) in group:
            members.setdefault(group[id(n)], []).append(n)
    fused = {r: ms for r, ms in members.items() if sum(m.op not in VIEWS for m in ms) >= 2}
    return rewrite(g, _rewriter(fused, nodes)), counted("fused", len(fused))


def _rewriter(fused: dict[int, list[Node]], nodes: list[Node]):
    """``rewrite``'s callback: the root of each group becomes its ``fused`` node over the rebuilt inputs."""
    rebuilt: dict[int, Node] = {}
    order = iter(nodes)

    def fn(m: Node) -> Node | None:
        old = next(order)  # rewrite visits g.nodes() in this order: m is ``old`` over the rebuilt inputs
        ms = fused.get(id(old))
        rebuilt[id(old)] = m if ms is None else _fused_node(ms, rebuilt)
        return rebuilt[id(old)]
    return fn


def _fused_node(ms: list[Node], rebuilt: dict[int, Node]) -> Node:
    """The ``fused`` node of group ``ms`` (topological order, root last), reading the rebuilt external inputs."""
    inside = {id(m): k for k, m in enumerate(ms)}
    ext: list[Node] = []
    ext_at: dict[int, int] = {}
    for m in ms:
        for i in m.inputs:
            if id(i) not in inside and id(i) not in ext_at:
                ext_at[id(i)] = len(ext)
                ext.append(rebuilt[id(i)])
    n_in = len(ext)
    body = tuple((m.op, tuple(n_in + inside[id(i)] if id(i) in inside else ext_at[id(i)] for i in m.inputs),
                  m.attrs, m.dtype, m.shape) for m in ms)
    root = ms[-1]
    return Node.make(FUSED, ext, {"body": body}, [TensorType(root.dtype, root.shape)], root.span)
