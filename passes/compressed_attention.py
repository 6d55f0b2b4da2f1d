"""compressed_attention: DeepSeek-V4's compressed sparse (CSA) and heavily compressed (HCA) attention, computed
over the rows a query sees instead of densely over the sliding cache and every compressed entry.

Upstream (``DeepseekV4Attention`` + ``eager_attention_forward``) attends over ``cat([sliding K=V, entries])`` with
the additive mask ``cat([sliding-window mask, block bias])`` and a per-head sink logit, computing all L + E scores
per query and masking most of them away. Recognised by op identity, attrs and shapes only::

    K=V state [B,Hkv,L,D] ─┐
    entries [B,Hkv,E,D] ───┴─ cat(dim 2) ─ repeat_kv ─┬─ permute(0,1,3,2) ─ bmm(q, ·) ─ mul(scale) ─┐
                                                      │                                             │
    window bias:  where(mask(qpos, W), 0, -big) [.,.,S,L] ─┐                                        │
    block bias [.,.,S,E]:                                  ├─ cat(-1) ─────────────────────────── add ─┐
      CSA:  slice(scatter(full(-inf) [.,.,S,E'], unsqueeze(idx, 1), 0), :E)     (E' >= E; idx: top-k   │
            indices, some replaced by out-of-range fills through where: distinct in [0, E))           │
      HCA:  where(ge(arange(E), (pos + 1) // R), -inf, 0)                                             │
                                                      │     sinks [H] ─ view ─ expand ─ cat(-1) ──────┘
                                                      │        ─ sub(max) ─ softmax ─ [..., :-1] ─ bmm(P, V)
                                                      └──────────────────────────────────────────────┘

        ==>  compressed_attention(q, kv, qpos, entries, sinks, [idx], [epos]) {scale, window, rate}

The kernel (``codegen/kernels/compressed_attention.py``) reads per query only the window rows
[max(0, qpos-W+1), qpos] of ``kv`` and then either the entry rows idx[b, s, :] that lie in [0, E) (CSA: the
indexer's top-k; the -inf columns are never read) or every entry e < (epos + 1) // R (HCA: dense over its few valid
entries by design; R = ``rate``). The HCA block bias is upstream's own in prefill and the decode pre-hook's
(``frontend/v4_cache.py``) in decode: the same graph shape. The indexer itself stays as it is.

Ordering: after sparse_attention (it shares its helpers; the sliding-only layers are already ``cache_attention``
there) and after fold_constants (arange rows, the window, the scale and the fills are read from
``ctx.constants``). Anything unrecognised stays dense and correct. The cache operands are the plain contiguous
states (paged_kv leaves states read by this op alone).
"""

from __future__ import annotations

from dayzero.passes.ir.node import Graph, Node, TensorType
from dayzero.passes.ir.pattern import (ALPHA1, Alt, Match, P, Pat, Rule, V, add_counts, isin, need, rewrite, scalar_is,
                                       strip_views)
from dayzero.passes.sparse_attention import (LAST4, NEG_BIG, SCALED_QK, ZERO, _int, arange_row, mask_terms,
                                             positions, repeat_kv, sink_attention)

OP = "compressed_attention"


# ---- the match -----------------------------------------------------------------------------------------------

def _fill(n: Node, m: Match) -> float | None:
    """The value every element of n holds (a full, or a folded constant), else None."""
    if n.op in ("full", "full_like") and isinstance(n.attr.get("fill_value"), (int, float)):
        return float(n.attr["fill_value"])
    t = m.value(n)
    if t is not None and t.numel() and bool((t == t.reshape(-1)[0]).all()):
        return float(t.reshape(-1)[0])
    return None


def _filled(v: float) -> Pat:
    return P(where=lambda n, m: _fill(n, m) == v)


_INF = float("-inf")
# CSA: slice(scatter(full(-inf) [.,1,S,E'], unsqueeze(idx [B,S,K], 1), dim=-1, value=0), dim=-1, 0:E)
_SCATTER = P("scatter.value", _filled(_INF), P("unsqueeze", P(name="idx", ndim=3, dtype=_int), attrs={"dim": 1}),
             attrs={"dim": LAST4, "value": isin(0, 0.0)},
             where=lambda n, m: n.shape[-1] >= m.E and n.shape[-2] == m.S and m.idx.shape[1] == m.S)
_CSA = Alt(P("slice.Tensor", _SCATTER, attrs={"dim": LAST4, "start": isin(0, None), "step": isin(1, None)},
             where=lambda n, m: n.attr.get("end") == m.E), _SCATTER)
# HCA: where(ge(arange(E), (pos + 1) // R), -inf, 0)
_INT_SCALAR = lambda pred, name=None: scalar_is(lambda v: not v.is_floating_point() and pred(int(v)), name)  # noqa
_HCA = P("where.self", P("ge.Tensor", arange_row("E"), V(P(
    "div.Tensor_mode", P("add.Tensor", positions("epos"), _INT_SCALAR(lambda v: v == 1), attrs=ALPHA1),
    _INT_SCALAR(lambda v: v > 0, "rate"), attrs={"rounding_mode": "floor"}), broadcast=True)),
    _filled(_INF), _filled(0.0))
_EAGER = sink_attention(P("add.Tensor", SCALED_QK, P("cat", P("where.self", P(name="mask"), ZERO, NEG_BIG),
                                                     P(name="block"), attrs={"dim": LAST4}), attrs=ALPHA1))


def _distinct(idx: Node, E: int, m: Match) -> bool:
    """The in-range values of ``idx`` are distinct per query: top-k indices, possibly replaced by out-of-range
    fills (upstream's ``where(ge(i, thr), -1, i)`` and ``where(i >= 0, i, E)``), so a row is never counted twice."""
    out = lambda f: f is not None and (f < 0 or f >= E)  # noqa: E731
    while idx.op == "where.self":
        _, a, b = idx.inputs
        if out(_fill(a, m)):
            idx = b
        elif out(_fill(b, m)):
            idx = a
        else:
            return False
    return idx.op == "getitem" and idx.attr["index"] == 1 and idx.inputs[0].op == "topk"


def _compressed(n: Node, m: Match, kind: str) -> Node:
    """bmm(P [B*H,S,L+E], V [B*H,L+E,D]) of the eager sink attention over cat([kv, entries]) ->
    view(compressed_attention [B,H,S,D]) when the block bias is ``kind``'s (csa / hca)."""
    q, sinks, kvc = m.q, m.sinks, repeat_kv(m.k)
    # K = V = cat([sliding state, entries]) along the rows
    need(kvc is repeat_kv(m.v) and kvc.op == "cat" and kvc.attr.get("dim") in (2, -2) and len(kvc.inputs) == 2)
    kv, ent = kvc.inputs
    B, H, S, D = q.shape
    need(kv.type.ndim == 4 and ent.type.ndim == 4 and isinstance(H, int))
    need(kv.shape[0] == ent.shape[0] == B and kv.shape[1] == ent.shape[1] and H % kv.shape[1] == 0)
    need(kv.shape[3] == ent.shape[3] == D and q.dtype == kv.dtype == ent.dtype)
    L, E = kv.shape[2], ent.shape[2]
    need(isinstance(L, int) and isinstance(E, int) and sinks.shape[0] == H)
    t = mask_terms(m.mask, S, L, m.constants)
    need("idx" not in t)
    m.update(S=S, E=E)
    b = strip_views(m.block)
    need(b.type.ndim == 4 and b.shape[-1] == E and b.shape[-2] == S and b.shape[1] == 1)
    if kind == "csa":
        need(_CSA.match(b, m) and _distinct(m.idx, E, m) and m.idx.shape[0] == B)
    else:
        need(_HCA.match(b, m))
    sel = m.idx if kind == "csa" else m.epos
    attrs = {"scale": float(m.value(m.scale)), "window": t.W, "rate": int(m.value(m.rate)) if kind == "hca" else 0,
             "idx": kind == "csa", "epos": kind == "hca"}
    att = Node.make(OP, (q, kv, t.qpos, ent, sinks, sel), attrs, (TensorType(q.dtype, (B, H, S, D)),), n.span)
    return Node.make("view", (att,), {"size": tuple(n.shape)}, n.types, n.span)


RULES = tuple(Rule(f"compressed_attention.{k}", _EAGER, lambda n, m, k=k: _compressed(n, m, k))
              for k in ("csa", "hca"))


def compressed_attention(g: Graph, ctx) -> Graph:
    """Rewrite V4's compressed attention; counts ``compressed_attention.csa`` / ``.hca`` in ``ctx.patterns``."""
    g, counts = rewrite(g, RULES, ctx.constants)
    add_counts(ctx.patterns, counts)
    return g
