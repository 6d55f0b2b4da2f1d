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

from dayzero.passes.ir.node import Graph, Node, TensorType
from dayzero.passes.ir.pattern import Alt, Match, P, Pat, Rule, V, add_counts, isin, need, rewrite, strip_views
from dayzero.targets import capabilities

OP = "moe_experts"
_UNARY = {"silu", "sigmoid", "gelu", "relu", "tanh", "exp", "neg"}
_BINARY = {"mul.Tensor": "mul", "add.Tensor": "add", "sub.Tensor": "sub", "div.Tensor": "div"}
_SCALAR = {"mul.Scalar": "mul", "add.Scalar": "add", "sub.Scalar": "sub", "div.Scalar": "div"}


# ---- the match -----------------------------------------------------------------------------------------------

def _gather(w: str, ndim: int) -> Pat:
    """index.Tensor(W [E, ..], ids [S]): W captured as ``w``; every gather reads the same ``ids``."""
    return V(P("index.Tensor", P(name=w, ndim=ndim), V(P(name="ids")), attrs={"indices": (True,)}))


def _expert_linear(w: str, b: str, x: str) -> Pat:
    """bmm(index(W, ids), x) (layout nk) or bmm(x, index(W, ids)) (kn) [+ index(b, ids)]; one layout per block."""
    mm = V(Alt(P("bmm", _gather(w, 3), V(P(name=x)), where=lambda n, m: m.bind("layout", "nk")),
               P("bmm", V(P(name=x)), _gather(w, 3), where=lambda n, m: m.bind("layout", "kn"))))
    return Alt(V(P("add.Tensor", mm, _gather(b, 2), attrs={"alpha": isin(1, None)}, commute=True)), mm)


# y = sum(view(mul(down(A), view(w [T,k]) [S,1])), dim=1): the routed experts, matched from their sum
_EXPERTS = P("sum.dim_IntList", V(P("mul.Tensor", _expert_linear("wd", "bd", "a"), P(name="wcol", shape=lambda s:
                                                                                     s[1:] == (1,)),
                                    commute=True, name="mul")),
             attrs={"dim": isin((1,), (-2,)), "keepdim": isin(False, None), "dtype": None},
             where=lambda n, m: len(n.inputs[0].shape) == 3)
# x repeated k times: expand [T,k,H] (unsqueeze(x, 1)), read through view [S,H] (captured without the views)
_REPEATED_X = P({"expand", "expand_copy"}, P("unsqueeze", P(name="x"), attrs={"dim": 1}))


def _act_expr(n: Node, g: Node, constants, S):
    """The elementwise expression from G [S, GU] to n, as a nested tuple (see the module docstring)."""
    n = strip_views(n)
    if n.op == "getitem" and n.inputs[0].op in ("split_with_sizes", "split.Tensor"):
        sp = n.inputs[0]
        need(strip_views(sp.inputs[0]) is g and sp.attr.get("dim") in (1, -1))
        start = sum(int(t.shape[1]) for t in sp.types[:n.attr["index"]])
        return ("col", start, 1, int(n.shape[1]))
    if n.op == "slice.Tensor":
        need(strip_views(n.inputs[0]) is g and n.attr.get("dim") in (1, -1))
        return ("col", int(n.attr.get("start") or 0), int(n.attr.get("step") or 1), int(n.shape[1]))
    if n is g:
        return ("col", 0, 1, int(g.shape[1]))
    if len(n.types) == 1 and n.shape == ():
        need(n.op == "weight" and n.attr["name"] in constants)
        return ("const", float(constants[n.attr["name"]]))
    need(len(n.types) == 1 and n.dtype.startswith("float") and tuple(n.shape[:1]) == (S,))
    if n.op in _UNARY and len(n.inputs) == 1:
        need(n.op != "gelu" or n.attr.get("approximate", "none") == "none")
        return (n.op, _act_expr(n.inputs[0], g, constants, S))
    if n.op == "clamp" and len(n.inputs) == 1:
        return ("clamp", _act_expr(n.inputs[0], g, constants, S), n.attr.get("min"), n.attr.get("max"))
    need(n.attr.get("alpha", 1) == 1)
    if n.op in _BINARY and len(n.inputs) == 2:
        return (_BINARY[n.op], _act_expr(n.inputs[0], g, constants, S), _act_expr(n.inputs[1], g, constants, S))
    need(n.op in _SCALAR and len(n.inputs) == 1)
    return (_SCALAR[n.op], _act_expr(n.inputs[0], g, constants, S), ("const", float(n.attr["other"])))


def _find_gate_up(a: Node) -> Node | None:
    """The G [S, GU] the activation reads: the first bmm(-plus-bias) reached walking up from A."""
    stack, seen = [a], set()
    while stack:
        n = strip_views(stack.pop())
        if id(n) in seen:
            continue
        seen.add(id(n))
        if n.op == "bmm" or (n.op == "add.Tensor" and any(strip_views(i).op == "bmm" for i in n.inputs)):
            return n
        stack.extend(n.inputs)
    return None


def _grouped_experts(n: Node, m: Match) -> Node | None:
    T, k, H = n.inputs[0].shape
    S, a, topw = m.mul.shape[0], m.a, strip_views(m.wcol)
    need(m.wcol.shape[0] == S and tuple(topw.shape) == (T, k))
    g = _find_gate_up(a)
    need(g is not None and _expert_linear("wgu", "bgu", "xrep").match(g, m) and _REPEATED_X.match(m.xrep, m))
    act = _act_expr(a, g, m.constants, S)
    x, ids, wgu, wd, layout = m.x, m.ids, m.wgu, m.wd, m.layout
    bgu, bd = m.get("bgu"), m.get("bd")
    need(tuple(m.xrep.shape) == (T, k, H) and tuple(ids.shape) == (T, k) and tuple(x.shape) == (T, H))
    need(wd.shape[0] == wgu.shape[0] and ids.dtype.startswith("int"))
    inter = int(a.shape[1])
    gu = int(wgu.shape[1] if layout == "nk" else wgu.shape[2])
    need(all(isinstance(d, int) for d in (*wgu.shape, *wd.shape, H)) and
         capabilities.moe_experts(int(H), gu, inter, wgu.dtype, wd.dtype))
    ins = [x, ids, topw, wgu] + ([bgu] if bgu is not None else []) + [wd] + ([bd] if bd is not None else [])
    attrs = {"layout": layout, "act": act, "inter": inter, "gate_up_bias": bgu is not None,
             "down_bias": bd is not None}
    return Node.make(OP, ins, attrs, [TensorType(n.dtype, n.shape)], n.span)


RULES = (Rule("moe.grouped_experts", _EXPERTS, _grouped_experts),)


def moe(g: Graph, ctx) -> Graph:
    """Rewrite every batched_mm routed-expert block; counts matches in ``ctx.patterns["moe.grouped_experts"]``."""
    g, counts = rewrite(g, RULES, ctx.constants)
    add_counts(ctx.patterns, counts)
    return g
