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
Ordering: after fold_constants (constant scalars in the activation are read from the folded ``constants``).
"""

from __future__ import annotations

from dayzero.passes.ir.node import Node, TensorType
from dayzero.passes.ir.pattern import ALPHA1, Alt, Match, P, Pat, Rule, V, isin, need, strip_views
from dayzero.passes.pipeline import pattern_pass
from dayzero.targets import capabilities

OP = "moe_experts"
_UNARY = {"silu", "sigmoid", "gelu", "relu", "tanh", "exp", "neg"}
_BINARY = {f"{op}.{form}": op for op in ("mul", "add", "sub", "div") for form in ("Tensor", "Scalar")}


# ---- the match -----------------------------------------------------------------------------------------------

def _gather(w: str, ndim: int) -> Pat:
    """index.Tensor(W [E, ..], ids [S]): W captured as ``w``; every gather reads the same ``ids``."""
    return V(P("index.Tensor", P(name=w, ndim=ndim), V(P(name="ids")), attrs={"indices": (True,)}))


def _expert_linear(w: str, b: str, x: str) -> Pat:
    """bmm(index(W, ids), x) (layout nk) or bmm(x, index(W, ids)) (kn) [+ index(b, ids)]; one layout per block."""
    mm = V(Alt(P("bmm", _gather(w, 3), V(P(name=x)), where=lambda n, m: m.bind("layout", "nk")),
               P("bmm", V(P(name=x)), _gather(w, 3), where=lambda n, m: m.bind("layout", "kn"))))
    return Alt(V(P("add.Tensor", mm, _gather(b, 2), attrs=ALPHA1, commute=True)), mm)


# y = sum(view(mul(down(A), view(w [T,k]) [S,1])), dim=1): the routed experts, matched from their sum
_WEIGHTED = P("mul.Tensor", _expert_linear("wd", "bd", "a"), P(name="wcol", shape=lambda s: s[1:] == (1,)),
              commute=True, name="mul")
_EXPERTS = P("sum.dim_IntList", V(_WEIGHTED), attrs={"dim": isin((1,), (-2,)), "keepdim": isin(False, None),
                                                     "dtype": None}, where=lambda n, m: len(n.inputs[0].shape) == 3)
# x repeated k times: expand [T,k,H] (unsqueeze(x, 1)), read through view [S,H] (captured without the views)
_REPEATED_X = P({"expand", "expand_copy"}, P("unsqueeze", P(name="x"), attrs={"dim": 1}))
# G [S, GU] (the gate/up GEMM, captured as ``g``) read by the activation: whole, or columns of it (split / slice)
_GATE_UP = _expert_linear("wgu", "bgu", "xrep")
_COLUMNS = Alt(P("getitem", P({"split_with_sizes", "split.Tensor"}, V(P(name="g")), attrs={"dim": isin(1, -1)})),
               P("slice.Tensor", V(P(name="g")), attrs={"dim": isin(1, -1)}), Alt(_GATE_UP, name="g"))


def _act_expr(n: Node, m: Match, S):
    """The elementwise expression from G [S, GU] to n, as a nested tuple (see the module docstring)."""
    n = strip_views(n)
    if _COLUMNS.match(n, m):
        if n.op == "getitem":
            return ("col", sum(int(t.shape[1]) for t in n.inputs[0].types[:n.attr["index"]]), 1, int(n.shape[1]))
        a = n.attr if n.op == "slice.Tensor" else {}
        return ("col", int(a.get("start") or 0), int(a.get("step") or 1), int(n.shape[1]))
    if len(n.types) == 1 and n.shape == ():
        need(m.value(n) is not None)
        return ("const", float(m.value(n)))
    need(len(n.types) == 1 and n.dtype.startswith("float") and tuple(n.shape[:1]) == (S,))
    if n.op in _UNARY and len(n.inputs) == 1:
        need(n.op != "gelu" or n.attr.get("approximate", "none") == "none")
        return (n.op, _act_expr(n.inputs[0], m, S))
    if n.op == "clamp" and len(n.inputs) == 1:
        return ("clamp", _act_expr(n.inputs[0], m, S), n.attr.get("min"), n.attr.get("max"))
    scalar = n.op.endswith(".Scalar")
    need(n.attr.get("alpha", 1) == 1 and n.op in _BINARY and len(n.inputs) == (1 if scalar else 2))
    b = ("const", float(n.attr["other"])) if scalar else _act_expr(n.inputs[1], m, S)
    return (_BINARY[n.op], _act_expr(n.inputs[0], m, S), b)


def _grouped_experts(n: Node, m: Match) -> Node | None:
    T, k, H = n.inputs[0].shape
    S, a, topw = m.mul.shape[0], m.a, strip_views(m.wcol)
    need(m.wcol.shape[0] == S and tuple(topw.shape) == (T, k))
    act = _act_expr(a, m, S)
    need("g" in m and _GATE_UP.match(m.g, m) and _REPEATED_X.match(m.xrep, m))
    x, ids, wgu, wd, layout = m.x, m.ids, m.wgu, m.wd, m.layout
    bgu, bd = m.get("bgu"), m.get("bd")
    need(tuple(m.xrep.shape) == (T, k, H) and tuple(ids.shape) == (T, k) and tuple(x.shape) == (T, H))
    need(wd.shape[0] == wgu.shape[0] and ids.dtype.startswith("int"))
    inter = int(a.shape[1])
    gu = int(wgu.shape[1] if layout == "nk" else wgu.shape[2])
    need(all(isinstance(d, int) for d in (*wgu.shape, *wd.shape, H)) and
         capabilities.moe_experts(int(H), gu, inter, wgu.dtype, wd.dtype))
    ins = [i for i in (x, ids, topw, wgu, bgu, wd, bd) if i is not None]
    attrs = {"layout": layout, "act": act, "inter": inter, "gate_up_bias": bgu is not None,
             "down_bias": bd is not None}
    return Node.make(OP, ins, attrs, [TensorType(n.dtype, n.shape)], n.span)


# every batched_mm routed-expert block; counts ``moe.grouped_experts``
moe = pattern_pass("moe", (Rule("moe.grouped_experts", _EXPERTS, _grouped_experts),))
