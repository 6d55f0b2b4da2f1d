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

        ==>  compressed_attention(q, kv, qpos, entries, sinks, [idx], [epos]) {scale, window, rate, per_row}

The row-batched decode step (``decode_batch`` of DeepSeek-V4, frontend/decode_export.py ``RowDecodeStep``) has
the same shape with one query per batch row, each row another request at its own position: positions [B] instead
of [S] (S == 1), the window bias [B, 1, 1, L] (built as [B, L] and unsqueezed) and the HCA bias [B, 1, 1, E];
then ``per_row`` is set and query (b, 0) is at qpos[b] (and epos[b]). Its K=V states hold only the window that
ends at each row's query (row j at position qpos[b] - (L-1) + j), the window bias ``held + (qpos - (L-1)) >= 0``:
then ``ring`` is set too.

The kernel (``codegen/kernels/compressed_attention.py``) reads per query only the window rows
[max(0, qpos-W+1), qpos] of ``kv`` and then either the entry rows idx[b, s, :] that lie in [0, E) (CSA: the
indexer's top-k; the -inf columns are never read) or every entry e < (epos + 1) // R (HCA: dense over its few valid
entries by design; R = ``rate``). The HCA block bias is upstream's own in prefill and the decode pre-hook's
(``frontend/v4_cache.py``) in decode: the same graph shape. The indexer's scores and top-k are sparse_attention's
``dsa_indexer_topk`` (rate R) by then; the idx above is its output or a generic topk's.

Ordering: after sparse_attention (it shares its helpers; the sliding-only layers are already ``cache_attention``
there) and after fold_constants (arange rows, the window, the scale and the fills are read from
its folded ``constants``). Anything unrecognised stays dense and correct. The cache operands are the plain
contiguous states (paged_kv leaves states read by this op alone).
"""

from __future__ import annotations

from dayzero.passes.ir.node import Node, TensorType, view_node
from dayzero.passes.ir.pattern import ALPHA1, Alt, Match, P, Rule, V, filled, isin, many, need, strip_views, with_scalar
from dayzero.passes.pipeline import pattern_pass
from dayzero.passes.sparse_attention import (INDEXER, LAST4, MASK_BIAS, SCALED_QK, _cache_operands, _int, arange_row,
                                             mask_terms, per_row, positions, positive_int, sink_attention)

OP = "compressed_attention"


# ---- the match -----------------------------------------------------------------------------------------------

_INF = float("-inf")
# top-k indices (a generic topk, or the indexer op sparse_attention made of it), some replaced by out-of-range fills
# (upstream's where(ge(i, thr), -1, i) and where(i >= 0, i, E)): the in-range values are distinct per query, so a
# row is never counted twice
_OUT = filled(lambda v, m: v < 0 or v >= m.E)
_TOPK_IDX = many(lambda p: Alt(P("where.self", P(), _OUT, p), P("where.self", P(), p, _OUT)),
                 Alt(P("getitem", P("topk"), attrs={"index": 1}), P(INDEXER)))
# CSA: slice(scatter(full(-inf) [.,1,S,E'], unsqueeze(idx [B,S,K], 1), dim=-1, value=0), dim=-1, 0:E)
_SCATTER = P("scatter.value", filled(_INF), P("unsqueeze", Alt(_TOPK_IDX, name="idx"), attrs={"dim": 1}),
             attrs={"dim": LAST4, "value": isin(0, 0.0)},
             where=lambda n, m: n.shape[-1] >= m.E and n.shape[-2] == m.S and m.idx.type.ndim == 3 and
             _int(m.idx.dtype) and m.idx.shape[1] == m.S)
_CSA = Alt(P("slice.Tensor", _SCATTER, attrs={"dim": LAST4, "start": isin(0, None), "step": isin(1, None)},
             where=lambda n, m: n.attr.get("end") == m.E), _SCATTER)
# HCA: where(ge(arange(E), (pos + 1) // R), -inf, 0)
_HCA = P("where.self", P("ge.Tensor", arange_row("E"), V(P(
    "div.Tensor_mode", with_scalar("add", positions("epos"), 1), positive_int("rate"),
    attrs={"rounding_mode": "floor"}), broadcast=True)), filled(_INF), filled(0.0))
_EAGER = sink_attention(P("add.Tensor", SCALED_QK, P("cat", MASK_BIAS, P(name="block"), attrs={"dim": LAST4}),
                          attrs=ALPHA1))


def _compressed(n: Node, m: Match, kind: str) -> Node:
    """bmm(P [B*H,S,L+E], V [B*H,L+E,D]) of the eager sink attention over cat([kv, entries]) ->
    view(compressed_attention [B,H,S,D]) when the block bias is ``kind``'s (csa / hca)."""
    q, sinks = m.q, m.sinks
    kvc, v = _cache_operands(q, m.k, m.v)
    # K = V = cat([sliding state, entries]) along the rows
    need(kvc is v and kvc.op == "cat" and kvc.attr.get("dim") in (2, -2) and len(kvc.inputs) == 2)
    kv, ent = kvc.inputs
    B, H, S, D = q.shape
    L, E = kv.shape[2], ent.shape[2]
    need(isinstance(L, int) and isinstance(E, int) and sinks.shape[0] == H and q.dtype == kv.dtype == ent.dtype)
    t = mask_terms(m.mask, S, L, m.constants, B=B)
    rows = per_row(t.qpos, S)
    m.update(S=S, E=E, B=B)
    b = strip_views(m.block)
    need(b.type.ndim == 4 and b.shape[-1] == E and b.shape[-2] == S and b.shape[1] == 1)
    need(_CSA.match(b, m) and m.idx.shape[0] == B if kind == "csa" else _HCA.match(b, m))
    # HCA's entry positions are per row exactly when the window's are (and then its bias is [B, 1, 1, E])
    need(kind == "csa" or (per_row(m.epos, S) == rows and (not rows or b.shape[0] == B)))
    sel = m.idx if kind == "csa" else m.epos
    attrs = {"scale": float(m.value(m.scale)), "window": t.W, "rate": int(m.value(m.rate)) if kind == "hca" else 0,
             "idx": kind == "csa", "epos": kind == "hca", **({"per_row": True} if rows else {}),
             **({"ring": True} if t.ring else {})}
    att = Node.make(OP, (q, kv, t.qpos, ent, sinks, sel), attrs, (TensorType(q.dtype, (B, H, S, D)),), n.span)
    return view_node(att, n.shape, n.span)


# V4's compressed attention; counts ``compressed_attention.csa`` / ``.hca``
compressed_attention = pattern_pass("compressed_attention", (
    Rule(f"compressed_attention.{k}", _EAGER, lambda n, m, k=k: _compressed(n, m, k)) for k in ("csa", "hca")))
