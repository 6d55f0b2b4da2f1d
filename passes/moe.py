"""moe: routed experts as traced from transformers' ``batched_mm`` experts -> one ``moe_experts`` node.

dayzero traces every model with ``experts_implementation="batched_mm"`` (the default ``grouped_mm`` exports as an
opaque custom op and the eager per-expert loop does not export at all: it iterates over ``nonzero()``). As traced,
that form gathers a per-assignment copy of the expert weights (S = T*k rows of [2I, H]) and runs ``bmm``::

    x [T,H] ─ unsqueeze(1) ─ expand [T,k,H] ─ clone ─ view [S,H] ─┐
    ids [T,k] ─ view [S] ─┬─ index(W_gu [E,..]) ─ bmm ─ squeeze ─ (+ index(b_gu [E,2I])) = G [S, 2I]
                          │                          G ─ split/slice ─ elementwise ops ─ A [S, I]   (the activation)
                          ├─ index(W_d [E,..]) ──── bmm(A) ─ squeeze ─ (+ index(b_d [E,H])) = D [S, H]
    w [T,k] ─ view [S] ─ unsqueeze(-1) ─────────────────────── mul(D, .) ─ view [T,k,H] ─ sum(dim=1)  = y [T,H]

                                          ==>   moe_experts(x, ids, w, W_gu, [b_gu], W_d, [b_d]) = y [T, H]

The match starts at the ``sum(dim=1)`` and walks up by op identity, attrs and shapes only (never names, never the
model type); reshapes that only add or drop unit dimensions are looked through. ``layout`` says how the experts
store their matrices: ``"nk"`` = [E, out, in] (``weight @ x``: Qwen3-MoE, DeepSeek), ``"kn"`` = [E, in, out]
(``x @ weight``: gpt-oss). The activation between the two GEMMs is recorded as an expression attr ``act`` over
columns of G, so every gating form is one pattern: ``("col", start, step)`` reads G[:, start + step*i];
``("const", v)``; unary ``(op, e)`` for silu/sigmoid/gelu/relu/tanh/exp/neg; binary ``(op, a, b)`` for
mul/add/sub/div; ``("clamp", e, lo, hi)`` (None = unbounded). E.g. SwiGLU = ``mul(silu(col 0 1), col I 1)``;
gpt-oss's clamped SwiGLU = ``mul(add(clamp(col 1 2, -7, 7), 1), mul(g, sigmoid(mul(g, 1.702))))``,
g = ``clamp(col 0 2, None, 7)``.

Routing (softmax / sigmoid / sqrt-softplus scores, group-limited top-k with correction bias, normalised weights,
routed scaling, hash routing by token id) stays as the generic ops it traces to: it is O(T*E) work next to the
experts' O(T*k*H*I), its forms differ per model far more than the expert computation does, and ids/weights [T,k]
are the clean interface between the two. Shared experts stay dense (``linear``). The node's reference runs the
routed experts with a per-expert loop over only the experts some token chose; its kernel
(the kernel table's ``moe_experts``) sorts assignments by expert and runs a grouped GEMM over the routed experts only.
Ordering: after fold_constants (constant scalars in the activation are read from ``ctx.constants``).
"""

from __future__ import annotations

from dayzero.passes.ir.node import Graph, Node, TensorType, rewrite
from dayzero.targets import capabilities

OP = "moe_experts"
_RESHAPES = {"view", "_unsafe_view", "reshape", "squeeze", "squeeze.dim", "squeeze.dims", "unsqueeze", "alias",
             "clone"}
_UNARY = {"silu", "sigmoid", "gelu", "relu", "tanh", "exp", "neg"}
_BINARY = {"mul.Tensor": "mul", "add.Tensor": "add", "sub.Tensor": "sub", "div.Tensor": "div"}
_SCALAR = {"mul.Scalar": "mul", "add.Scalar": "add", "sub.Scalar": "sub", "div.Scalar": "div"}


# ---- the match -----------------------------------------------------------------------------------------------

def _squeezed(shape) -> tuple:
    return tuple(d for d in shape if not (isinstance(d, int) and d == 1))


def _strip(n: Node) -> Node:
    """Look through reshapes that only add or remove unit dimensions (and clones)."""
    while n.op in _RESHAPES and len(n.types) == 1 and n.inputs and len(n.inputs[0].types) == 1 and \
            _squeezed(n.shape) == _squeezed(n.inputs[0].shape):
        n = n.inputs[0]
    return n


def _view_root(n: Node) -> Node:
    """Through any pure reshape (the S <-> [T, k] flattenings)."""
    while n.op in _RESHAPES and len(n.types) == 1 and n.inputs:
        n = n.inputs[0]
    return n


def _gathered(n: Node, ids_flat: list):
    """index.Tensor(W [E, a, b] or b [E, c], ids [S]) -> W; records the ids node."""
    if n.op != "index.Tensor" or n.attr.get("indices") != (True,) or len(n.inputs) != 2:
        return None
    ids_flat.append(_view_root(n.inputs[1]))
    return n.inputs[0]


def _linear(n: Node, ids_flat: list):
    """squeeze(bmm(index(W, ids), unsqueeze(x, -1))) [+ index(b, ids)] -> (W, layout, x, b)."""
    bias = None
    n = _strip(n)
    if n.op == "add.Tensor" and n.attr.get("alpha", 1) == 1:
        for a, b in (n.inputs, n.inputs[::-1]):
            bb = _gathered(_strip(b), ids_flat)
            if bb is not None and len(bb.shape) == 2:
                n, bias = _strip(a), bb
                break
        else:
            return None
    n = _strip(n)
    if n.op != "bmm":
        return None
    a, b = n.inputs
    w = _gathered(a, ids_flat)
    if w is not None and len(w.shape) == 3:
        return w, "nk", _strip(b), bias
    w = _gathered(b, ids_flat)
    if w is not None and len(w.shape) == 3:
        return w, "kn", _strip(a), bias
    return None


class _NoMatch(Exception):
    pass


def _scalar_const(n: Node, constants) -> float:
    if n.op == "weight" and n.shape == () and n.attr["name"] in constants:
        return float(constants[n.attr["name"]])
    raise _NoMatch


def _act_expr(n: Node, g: Node, constants, S):
    """The elementwise expression from G [S, GU] to n, as a nested tuple (see the module docstring)."""
    n = _strip(n)
    if n.op in ("getitem",) and n.inputs[0].op in ("split_with_sizes", "split.Tensor"):
        sp = n.inputs[0]
        if _strip(sp.inputs[0]) is not g or sp.attr.get("dim") not in (1, -1):
            raise _NoMatch
        idx = n.attr["index"]
        start = sum(int(t.shape[1]) for t in sp.types[:idx])
        return ("col", start, 1, int(n.shape[1]))
    if n.op == "slice.Tensor":
        if _strip(n.inputs[0]) is not g or n.attr.get("dim") not in (1, -1):
            raise _NoMatch
        return ("col", int(n.attr.get("start") or 0), int(n.attr.get("step") or 1), int(n.shape[1]))
    if n is g:
        return ("col", 0, 1, int(g.shape[1]))
    if len(n.types) == 1 and n.shape == ():
        return ("const", _scalar_const(n, constants))
    if len(n.types) != 1 or not n.dtype.startswith("float"):
        raise _NoMatch
    if tuple(n.shape[:1]) != (S,):
        raise _NoMatch
    if n.op in _UNARY and len(n.inputs) == 1:
        if n.op == "gelu" and n.attr.get("approximate", "none") != "none":
            raise _NoMatch
        return (n.op, _act_expr(n.inputs[0], g, constants, S))
    if n.op in ("clamp",) and len(n.inputs) == 1:
        return ("clamp", _act_expr(n.inputs[0], g, constants, S), n.attr.get("min"), n.attr.get("max"))
    if n.op in _BINARY and n.attr.get("alpha", 1) == 1 and len(n.inputs) == 2:
        return (_BINARY[n.op], _act_expr(n.inputs[0], g, constants, S), _act_expr(n.inputs[1], g, constants, S))
    if n.op in _SCALAR and len(n.inputs) == 1 and n.attr.get("alpha", 1) == 1:
        return (_SCALAR[n.op], _act_expr(n.inputs[0], g, constants, S), ("const", float(n.attr["other"])))
    raise _NoMatch


def _match(n: Node, constants) -> Node | None:
    if n.op != "sum.dim_IntList" or n.attr.get("dim") not in ((1,), (-2,)) or n.attr.get("keepdim") or \
            n.attr.get("dtype") is not None or len(n.inputs[0].shape) != 3:
        return None
    T, k, H = n.inputs[0].shape
    mul = _view_root(n.inputs[0])
    if mul.op != "mul.Tensor" or len(mul.inputs) != 2:
        return None
    S = mul.shape[0]
    ids_flat: list[Node] = []
    for d_node, w_node in (mul.inputs, mul.inputs[::-1]):
        if tuple(w_node.shape) == (S, 1):
            down = _linear(d_node, ids_flat)
            if down is not None:
                break
    else:
        return None
    wd, layout, a, bd = down
    topw = _view_root(w_node)
    if tuple(topw.shape) != (T, k):
        return None
    # the activation and the gate/up GEMM that feeds it
    g = _find_gate_up(a)
    if g is None:
        return None
    up = _linear(g, ids_flat)
    if up is None:
        return None
    wgu, layout2, xrep, bgu = up
    if layout2 != layout:
        return None
    try:
        act = _act_expr(a, g, constants, S)
    except _NoMatch:
        return None
    # x repeated k times: view [S,H] <- clone <- expand [T,k,H] <- unsqueeze(x, 1)
    e = xrep
    while e.op in ("view", "_unsafe_view", "reshape", "clone"):
        e = e.inputs[0]
    if e.op not in ("expand", "expand_copy") or tuple(e.shape) != (T, k, H):
        return None
    u = e.inputs[0]
    if u.op != "unsqueeze" or u.attr.get("dim") != 1:
        return None
    x = u.inputs[0]
    ids = ids_flat[0]
    if any(i is not ids for i in ids_flat) or tuple(ids.shape) != (T, k) or tuple(x.shape) != (T, H):
        return None
    E = wgu.shape[0]
    if wd.shape[0] != E or not ids.dtype.startswith("int"):
        return None
    inter = int(a.shape[1])
    gu = int(wgu.shape[1] if layout == "nk" else wgu.shape[2])
    if not all(isinstance(d, int) for d in (*wgu.shape, *wd.shape, H)) or \
            not capabilities.moe_experts(int(H), gu, inter, wgu.dtype, wd.dtype):
        return None
    ins = [x, ids, topw, wgu] + ([bgu] if bgu is not None else []) + [wd] + ([bd] if bd is not None else [])
    attrs = {"layout": layout, "act": act, "inter": inter, "gate_up_bias": bgu is not None,
             "down_bias": bd is not None}
    return Node.make(OP, ins, attrs, [TensorType(n.dtype, n.shape)], n.span)


def _find_gate_up(a: Node) -> Node | None:
    """The G [S, GU] the activation reads: the first bmm(-plus-bias) reached walking up from A."""
    stack, seen = [a], set()
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        m = _strip(n)
        if m.op == "bmm" or (m.op == "add.Tensor" and any(_strip(i).op == "bmm" for i in m.inputs)):
            return m
        stack.extend(m.inputs)
    return None


def moe(g: Graph, ctx) -> Graph:
    """Rewrite every batched_mm routed-expert block; counts matches in ``ctx.patterns["moe"]``."""
    count = 0

    def fn(n: Node):
        nonlocal count
        r = _match(n, ctx.constants)
        if r is not None:
            count += 1
        return r

    out = rewrite(g, fn)
    ctx.patterns["moe"] = ctx.patterns.get("moe", 0) + count
    return out
