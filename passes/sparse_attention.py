"""sparse_attention: attention over a KV cache that reads only the positions a query may (or is chosen to) see.

transformers writes every attention over its static cache densely: the scores of all ``max_len`` cache rows are
computed and a mask built from positions throws most of them away. Two shapes are recognised, by op identity,
attrs and shapes only (never names, never the model type):

(a) dense causal attention (Qwen3-MoE, gpt-oss full and sliding layers, any GQA/MQA)::

    arange(L) const [1,1,1,L] ─┬─ le ─────────────────────────────────┐
    qpos [S] ─ unsqueeze* ─────┴─ sub(., W) ─ gt(arange, .)  (window) ─ and ─ mask [.,.,S,L]
    q [B,Hq,S,D]                                                         │
    K/V state [B,Hkv,L,D] ─ unsqueeze(2) ─ expand ─ clone ─ view [B,Hq,L,D] (repeat_kv)
                 ─► scaled_dot_product_attention(q, K, V, mask)
                 or the eager form with attention sinks (gpt-oss):
                    bmm(q, Kᵀ)·scale + where(mask, 0, -big) ─ cat(sinks) ─ sub max ─ softmax ─ [..., :-1] ─ bmm(V)

        ==>  cache_attention(q, k_state, v_state, qpos, [sinks]) {scale, window}
             reads rows [max(0, qpos-W+1), qpos] of the cache for each query, GQA through h // (Hq/Hkv)

    One query per batch row, each row at its own position (DeepSeek-V4's row-batched decode step, S == 1): qpos
    [B] instead of [S], the mask [B, L] (unsqueezed to [B, 1, 1, L]) ==> the same op with ``per_row``.

(b) DeepSeek-V3.2 DSA: the indexer's top-k is scattered into a dense mask::

    indexer scores [B,S,L] ─ where(future, -inf) ─ topk(k) ─ getitem 1 ─ to int ─ idx [B,S,k]
    full(True) [B,S,L] ─ scatter(dim=-1, idx, False) ─ unsqueeze(1) ─ not ─ and(causal mask) ─ mask
                 ─► scaled_dot_product_attention(q, K, V, mask)

        ==>  sparse_attention(q, K, V, qpos, idx) {scale}
             reads only the k rows idx[b, s, :] (those <= qpos[s]) for each query

(c) DSA over an MLA latent cache (DeepSeek-V3.2): K and V of (b) are upstream's ``expand_kv`` of the whole
latent cache, i.e. kv_b_proj over all L rows every step (O(L) even though the top-k keeps k rows)::

    latent state [B,1,L,R] ─ linear(W [H*(n+Dv), R]) ─ view [B,L,H,n+Dv] ─ permute(0,2,1,3) ─ split [n, Dv]
        V = split[1];  K = slice_scatter(slice_scatter(_, copy(_, split[0]), 0:n), copy(_, expand(rope [B,1,L,Dr])), n:)
        (or K = cat(split[0], expand(rope)))

        ==>  mla_sparse_attention(q, latent, rope, W, qpos, idx) {scale, nope}
             weight absorption: per head, q_nope·(latent_j W_uk^T) = (q_nope W_uk)·latent_j, and the output
             sum_j p_j (latent_j W_uv^T) = (sum_j p_j latent_j) W_uv^T, so a query costs n*R (absorb) +
             k*(R+Dr) (selected rows) + Dv*R (up-project once): independent of L (upstream: L*H*(n+Dv)*R).
             The expansion nodes become dead and disappear.
        The same expansion under the dense causal mask of (a) (DeepSeek-V3, Kimi-K2: MLA without an indexer)
        ==>  mla_attention(q, latent, rope, W, qpos) {scale, nope}: the absorbed form over rows [0, qpos], so
             a decode step reads each latent row once per head group and never runs kv_b_proj over the cache
             (upstream: L*H*(n+Dv)*R per step). Prefill is absorbed too (every program reads the cache the same
             way, so the cache pages alike in both, passes/paged_kv.py).

(d) the DSA lightning indexer, traced as generic ops, in either of two spellings of its head sum::

    q [B,S,Hi,Di] ─ view [B*S,Hi,Di] ─┐
    keys state [B,L,Di] ─ permute(0,2,1) ─ unsqueeze(1) ─ expand ─ view [B*S,Di,L] ─ bmm ─ view [B,S,Hi,L] ─┐
      DeepSeek-V3.2:  mul(scale) ─ relu ─ bmm(w [B,S,Hi] ─ unsqueeze(-2) ─ view [B*S,1,Hi], ·) ─ view [B,S,L]
      DeepSeek-V4:    relu ─ mul(scale > 0) ─ mul(w [B,S,Hi] ─ unsqueeze(-1)) ─ sum(dim 2) [B,S,L]
    ─ where(future, -inf) ─ topk(k) ─ getitem 1
      future: ~(causal mask) (a key per position: rate 1), or
              ge(arange(L), (pos + 1) // R)  (DeepSeek-V4's compressed keys: key j pools positions [jR, jR + R))

        ==>  dsa_indexer_topk(q, w, keys, qpos) {scale, k, sorted, fill, rate}
             one kernel (codegen/kernels/indexer.py): only the visible key rows j < (qpos + 1) // rate are read,
             each once; scores never materialised per head, nor over the hidden rows; torch.topk's exact
             selection (ties included) on the score row (relu(x) * s = relu(x * s) exactly for s > 0).

The indexer is the linear part of a DSA step (O(L) per query by design) and is reported separately by
``dayzero bench attention``. Both ops have one kernel per target with a
decode variant (S == 1: one query x its rows) and a prefill variant (blocked over queries), see
``codegen/kernels/attention.py``. Ordering: after fold_constants (the arange, the window, the scale and the
fill values are read from its folded ``constants``) and after inplace_state (the cache operands are then the
in-place written states). Anything unrecognised stays dense and correct.
"""

from __future__ import annotations

import math

import torch

from dayzero.passes.ir.node import Node, TensorType, view_node
from dayzero.passes.ir.pattern import (ALPHA1, Alt, Match, P, Pat, Rule, V, cast, const, filled, isin, last_dim, need,
                                       scalar_is, strip_views, with_scalar)
from dayzero.passes.pipeline import pattern_pass

DENSE = "cache_attention"
SPARSE = "sparse_attention"
MLA = "mla_sparse_attention"
MLA_DENSE = "mla_attention"
INDEXER = "dsa_indexer_topk"


# ---- the match -----------------------------------------------------------------------------------------------

LAST4 = isin(-1, 3)  # the last axis of a 4-D value
VIEW3 = {"view", "_unsafe_view", "reshape"}
_UPCAST = ("float32", "bfloat16", "float16")


def _int(dtype: str) -> bool:
    return dtype.startswith("int")


def arange_row(L: str = "L") -> Pat:
    """arange(m[L]) (leading unit axes allowed): a folded constant, or, when it is longer than fold_constants folds
    (a long ``--max-seq``), the ``arange.start_step(0, L, 1)`` node itself, plus a zero offset, under views."""
    def where(n: Node, m: Match) -> bool:
        t = m.value(n)
        return t is not None and t.shape[-1] == m[L] and t.numel() == m[L] and \
            torch.equal(t.reshape(-1), torch.arange(m[L], dtype=t.dtype))

    def unfolded(n: Node, m: Match) -> bool:
        a = n.attr
        return a.get("start") == 0 and a.get("step") == 1 and a.get("end") == m[L] and tuple(n.shape) == (m[L],) \
            and _int(n.dtype)
    arange = P("arange.start_step", where=unfolded)
    return Alt(P("weight", where=where),
               V(Alt(arange, P("add.Tensor", arange, scalar_is(lambda v: float(v) == 0), attrs=ALPHA1))))


def positions(name: str) -> Pat:
    """Int positions [m.S] read through unsqueezes, views and broadcasts (captured as ``name``); with one query
    per batch row (m.S == 1, ``m.B`` bound and not 1: the row-batched decode step, each row another request at its
    own position), positions [m.B], one per row (``per_row``; ``mask_terms`` checks the mask is laid out so)."""
    return V(P(name=name, ndim=1, dtype=_int, where=lambda n, m: n.shape[0] == m.S or (
        m.S == 1 and m.get("B") not in (None, 1) and n.shape[0] == m.B)), broadcast=True)


def per_row(pos: Node, S) -> bool:
    """True when positions ``pos`` (matched by ``positions``) are one per batch row rather than one per query."""
    return pos.shape[0] != S


def positive_int(name: str) -> Pat:
    """A folded one-element integer constant > 0 (captured as ``name``)."""
    return scalar_is(lambda v: not v.is_floating_point() and int(v) > 0, name)


_ALL_TRUE = filled(1.0)
# the terms a bool mask [.., S, L] is an and-tree of: j <= qpos, j > qpos - W, ~scatter(True, idx, False)
_MASK_TERMS = (
    _ALL_TRUE,
    P("le.Tensor", arange_row(), positions("qpos"), name="causal"),
    P("gt.Tensor", arange_row(), P("sub.Tensor", positions("qpos"), positive_int("window"), attrs=ALPHA1)),
    P("bitwise_not", V(P("scatter.value", _ALL_TRUE, P(name="idx"), attrs={"value": isin(False, 0),
                                                                             "dim": isin(-1, 2)},
                         where=lambda n, m: n.shape[-1] == m.L))),
    # the row-batched decode step's window states (frontend/decode_export.py RowDecodeStep): row j of request b
    # holds position qpos[b] - last + j (last = L - 1), visible when that is >= 0
    P("ge.Scalar", P("add.Tensor", arange_row(), V(P("sub.Tensor", positions("qpos"), positive_int("last"),
                                                     attrs=ALPHA1), broadcast=True), attrs=ALPHA1),
      attrs={"other": isin(0, 0.0)}, name="held"),
)


def mask_terms(mask: Node, S, L: int, constants, selection: bool = False, B=None) -> Match:
    """A bool mask [.., S, L] -> its terms: ``qpos`` (causal), ``W`` (window, 0 = none), ``idx`` (the DSA
    selection, present exactly when ``selection``); raises NoMatch on any other term. With the batch size ``B``
    and one query (S == 1), the positions may be one per batch row (``per_row``): the mask is then [B, (1, 1,) L],
    row b compared with qpos[b]; and then the rows may be the window ending at each row's query (``ring``: row j
    at position qpos[b] - (L-1) + j, the rows before position 0 masked; causal by construction)."""
    m = Match(constants)
    m.update(S=S, L=L, B=B)
    stack = [mask]
    while stack:
        n = strip_views(stack.pop())
        if n.op in ("bitwise_and.Tensor", "logical_and"):
            stack.extend(n.inputs)
        else:
            need(any(p.match(n, m) for p in _MASK_TERMS))
    need(("causal" in m or "held" in m) and ("idx" in m) == selection)
    if per_row(m.qpos, S):  # [B, 1.., L]: the positions run along the batch axis, one query per row
        need(mask.shape[0] == B and mask.shape[-1] == L and all(d == 1 for d in mask.shape[1:-1]))
    else:
        need(tuple(mask.shape[-2:]) == (S, L) and "held" not in m)
    m["ring"] = "held" in m
    need(not m.ring or int(m.value(m.last)) == L - 1)
    m["W"] = int(m.value(m.window)) if "window" in m else 0
    return m


# expand(unsqueeze(x [B,Hkv,L,D], 2), [B,Hkv,r,L,D]) under views: x's heads each repeated r times
_REPEAT_KV = V(P("expand", P("unsqueeze", P(name="x", ndim=4), attrs={"dim": 2}), name="e",
                 where=lambda e, m: tuple(e.shape) == (*m.x.shape[:2], e.shape[2], *m.x.shape[2:])))


def repeat_kv(n: Node) -> Node:
    """view(clone(expand(unsqueeze(x, 2))), [B,Hkv*r,L,D]) -> x; else n through views that keep its shape."""
    m = Match()
    if n.type.ndim == 4 and _REPEAT_KV.match(n, m):
        B, Hkv, r, L, D = m.e.shape
        if tuple(n.shape) == (B, Hkv * r, L, D):
            return m.x
    s = strip_views(n)
    return s if s.types == n.types else n


def _make(op: str, ins, attrs: dict, q: Node, v: Node, span) -> Node:
    B, H, S, _ = q.shape
    return Node.make(op, ins, attrs, (TensorType(q.dtype, (B, H, S, v.shape[-1])),), span)


def _cache_operands(q: Node, k: Node, v: Node) -> tuple[Node, Node]:
    k, v = repeat_kv(k), repeat_kv(v)
    B, H, S, D = q.shape
    need(k.type.ndim == 4 and v.type.ndim == 4 and k.shape[2] == v.shape[2] and k.shape[1] == v.shape[1])
    need(k.shape[0] == B and k.shape[3] == D and isinstance(H, int) and H % k.shape[1] == 0)
    need(q.dtype == k.dtype == v.dtype)
    return k, v


def _halves(hi: Node, m) -> bool:
    """slice_scatter(slice_scatter(_, a, 0:n), b, n:D) along the last axis, step 1."""
    lo, D, e = hi.inputs[0], hi.shape[-1], hi.inputs[0].attr.get("end")
    return (lo.attr.get("step") or 1) == 1 == (hi.attr.get("step") or 1) and (lo.attr.get("start") or 0) == 0 \
        and isinstance(e, int) and 0 < e < D and hi.attr.get("start") == e and isinstance(hi.attr.get("end"), int) \
        and hi.attr["end"] >= D


def _copied(p: Pat) -> Pat:
    """``p``, or copy(dst, p) of dst's shape (the traced ``dst.copy_(src)``)."""
    return Alt(P("copy", P(), p, where=lambda n, m: tuple(n.inputs[1].shape) == tuple(n.shape)), p)


# MLA: V = split(permute(view(linear(latent, W)), (0,2,1,3)))[1]; K = [split[0] | expand(rope)] (cat or two slices).
# A checkpoint's bf16 W arrives as passes/dequant_bf16.py's rewrite of that linear, which reads W as stored (the MLA
# kernel casts each element it reads: w_dtype); it had hidden the MLA from this pass, and a full-width V3.2 decode
# step expanded its whole latent cache through W (4 x 1 s at 4005 rows).
_LATENT_UP = Alt(P("linear", P(name="lat", ndim=4), P(name="w", ndim=2), attrs={"bias": isin(False, None)}),
                 P(VIEW3, P("dequant_linear_bf16", P(VIEW3, P(name="lat", ndim=4)), P(name="w", ndim=2),
                            attrs={"groups": isin(1, None)})))
_MLA_V = P("getitem", P("split_with_sizes", P("permute", P(VIEW3, _LATENT_UP, name="vw"),
                                               attrs={"dims": (0, 2, 1, 3)}),
                        name="sp", where=lambda n, m: last_dim(n) and len(n.attr["split_sizes"]) == 2),
           attrs={"index": 1})
_NOPE, _ROPE = P("getitem", P(name="sp"), attrs={"index": 0}), P("expand", P(name="rope"), name="kr")
_MLA_K = Alt(P("cat", _NOPE, _ROPE, where=last_dim),
             P("slice_scatter", P("slice_scatter", P(), _copied(_NOPE), where=last_dim), _copied(_ROPE),
               where=lambda n, m: last_dim(n) and _halves(n, m)))


def _mla_operands(q: Node, k: Node, v: Node) -> tuple[Node, Node, Node, int]:
    """K/V that are the MLA expansion of a latent cache (shape (c) in the module docstring) ->
    (latent [B,1,L,R], rope [B,1,L,Dr], W [H*(n+Dv), R], n); raises NoMatch otherwise."""
    m = Match()
    need(_MLA_V.match(v, m) and _MLA_K.match(k, m))
    B, H, L, Dk = k.shape
    nope, dv = m.sp.attr["split_sizes"]
    lat, w, rope = m.lat, m.w, m.rope
    need(tuple(m.vw.shape) == (B, L, H, nope + dv) and tuple(lat.shape[:3]) == (B, 1, L) and v.shape[-1] == dv)
    need(tuple(w.shape) == (H * (nope + dv), lat.shape[3]) and q.shape[-1] == Dk)
    need(tuple(rope.shape) == (B, 1, L, Dk - nope) and tuple(m.kr.shape) == (B, H, L, Dk - nope))
    need(lat.dtype == rope.dtype == q.dtype)
    return lat, rope, w, int(nope)


_SDPA = P("scaled_dot_product_attention", P(name="q", ndim=4), P(name="k"), P(name="v"), P(name="mask"),
          attrs={"attn_mask": bool, "is_causal": lambda v: not v, "dropout_p": lambda v: not v})


def _sdpa(n: Node, m: Match, want: str) -> Node:
    """scaled_dot_product_attention(q, K, V, mask) -> ``want`` when the operands and mask terms are its shape."""
    q = m.q
    k, v = _cache_operands(q, m.k, m.v)
    L = k.shape[2]
    need(isinstance(L, int))
    t = mask_terms(m.mask, q.shape[2], L, m.constants, selection=want in (SPARSE, MLA))
    scale = n.attr.get("scale")
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(int(q.shape[-1]))
    idx = t.get("idx")
    need(want == DENSE or t.W == 0)
    need(idx is None or (idx.type.ndim == 3 and idx.shape[1] == q.shape[2] and _int(idx.dtype)))
    if want in (MLA, MLA_DENSE):
        lat, rope, w, nope = _mla_operands(q, k, v)
        return _make(want, (q, lat, rope, w, t.qpos) + ((idx,) if idx is not None else ()),
                     {"scale": scale, "nope": nope}, q, v, n.span)
    return _make(want, (q, k, v, t.qpos) + ((idx,) if idx is not None else ()),
                 {"scale": scale} if want == SPARSE else {"scale": scale, "window": t.W, "sinks": False}, q, v, n.span)


def flat_heads(p: Pat) -> Pat:
    """view(x [B,H,a,b], [B*H,a,b]) (through clones and rank-keeping views) -> ``p`` on x."""
    return P(VIEW3, V(Pat(**{**p.__dict__, "ndim": 4}), keep_rank=True), ndim=3)


_SINK_COL = P(where=lambda n, m: n.shape[-1] == 1 and m.bind("sinks", strip_views(n, broadcast=True)) and
              m.sinks.type.ndim == 1)


def sink_attention(logits: Pat) -> Pat:
    """bmm(P, V) of eager attention with a sink logit per head (gpt-oss, DeepSeek-V4), heads flattened, with
    P = view(softmax(cat(logits, sinks) [- max]) [..., :-1]): captures v [B,H,L,Dv] as fed and sinks [H]."""
    cat = P("cat", logits, _SINK_COL, attrs={"dim": LAST4}, name="cat")
    sm = P({"softmax.int", "_softmax"}, Alt(P("sub.Tensor", cat, P("getitem", P("max.dim", P(name="cat")),
                                                                    attrs={"index": 0}), attrs=ALPHA1), cat),
           attrs={"dim": LAST4})
    probs = P("slice.Tensor", sm, attrs={"dim": LAST4, "start": isin(0, None), "end": -1, "step": isin(1, None)})
    return P("bmm", flat_heads(probs), flat_heads(P(name="v")))


# view(bmm(q, kᵀ)) * scale, heads flattened: captures q [B,H,S,D], k [B,Hk,L,D] (as fed to the transpose), scale
SCALED_QK = P("mul.Tensor", P(VIEW3, P("bmm", flat_heads(P(name="q")),
                                       flat_heads(P("permute", P(name="k"), attrs={"dims": (0, 1, 3, 2)}))), ndim=4),
              const(lambda t: t.numel() == 1, name="scale"))
# where(mask, 0, -big): a bool mask as an additive bias
MASK_BIAS = V(P("where.self", P(name="mask"), scalar_is(lambda v: float(v) == 0.0),
                scalar_is(lambda v: float(v) <= -1e30)))
_EAGER = sink_attention(P("add.Tensor", SCALED_QK, MASK_BIAS, attrs=ALPHA1))


def _eager_with_sinks(n: Node, m: Match) -> Node:
    """bmm(P [B*H,S,L], V [B*H,L,Dv]) of the eager sink attention -> view(cache_attention [B,H,S,Dv])."""
    q, sinks = m.q, m.sinks
    k, v = _cache_operands(q, m.k, m.v)
    L = k.shape[2]
    need(isinstance(L, int) and sinks.shape[0] == q.shape[1])
    t = mask_terms(m.mask, q.shape[2], L, m.constants, B=q.shape[0])
    rows = {"per_row": True, **({"ring": True} if t.ring else {})} if per_row(t.qpos, q.shape[2]) else {}
    att = _make(DENSE, (q, k, v, t.qpos, sinks), {"scale": float(m.value(m.scale)), "window": t.W, "sinks": True,
                                                  **rows}, q, v, n.span)
    return view_node(att, n.shape, n.span)


def _up(p: Pat) -> Pat:
    """``p`` through views and an exact upcast to float32."""
    return cast(p, "float32", _UPCAST)


# the per-head scores bmm(q, keys) [B*S,Hi,L] (heads flattened), and the scale
_QK = _up(P("bmm", _up(P(name="iq", ndim=4)), P(name="kv"), name="qk"))
_SCALE = const(lambda t: t.numel() == 1, name="scale")
# DeepSeek-V3.2's head sum: bmm(w, relu(qk * scale)) [B*S,1,L]
_HEADS_BMM = P("bmm", _up(P(name="w", ndim=3)), _up(P("relu", P("mul.Tensor", _QK, _SCALE), ndim=4, name="r")),
               name="hs")
# DeepSeek-V4's: sum(relu(qk) * scale * unsqueeze(w, -1), dim 2) [B,S,L]
_HEADS_SUM = P("sum.dim_IntList", P("mul.Tensor", P("mul.Tensor", P("relu", _QK, ndim=4, name="r"), _SCALE),
                                    P("unsqueeze", _up(P(name="w", ndim=3)), attrs={"dim": isin(-1, 3)}),
                                    commute=True, name="hw"),
               attrs={"dim": lambda v: v is not None and tuple(v) in ((2,), (-2,)), "keepdim": lambda v: not v,
                      "dtype": None}, name="hsum")
# getitem(topk(where(future, -inf, scores), k), 1): the DSA lightning indexer
_INDEXER = P("getitem", P("topk", P(
    "where.self", P(name="future"), scalar_is(lambda v: float(v) == float("-inf")), _up(Alt(_HEADS_BMM, _HEADS_SUM)),
    ndim=3, name="x"),
    attrs={"largest": lambda v: v is None or v}, name="tk",
    where=lambda n, m: n.attr.get("dim", -1) in (-1, len(n.inputs[0].shape) - 1)), attrs={"index": 1})
_KEYS = V(P("permute", _up(P(name="index_keys")), attrs={"dims": (0, 2, 1)}), broadcast=True)
# where a key is hidden: ~(causal mask) (rate 1), or ge(arange(L), (pos + 1) // R) (key j pools R positions)
_FUTURE_MASK = P("bitwise_not", Alt(
    P("select.int", P(name="imask"), attrs={"dim": 1, "index": 0}, where=lambda n, m: n.inputs[0].shape[1] == 1),
    P(name="imask")))
_FUTURE_RATE = P("ge.Tensor", arange_row(), V(P(
    "div.Tensor_mode", with_scalar("add", positions("qpos"), 1), positive_int("rate"),
    attrs={"rounding_mode": "floor"}), broadcast=True))


def _future(mask: Node, S, L: int, constants, B=None) -> tuple[Node, int]:
    """The where's hidden-key condition -> (qpos, rate); raises NoMatch on any other condition. With the batch
    size ``B`` and one query, DeepSeek-V4's rate-R positions may be one per batch row (``per_row``)."""
    m = Match(constants)
    m.update(S=S, L=L, B=B)
    if _FUTURE_MASK.match(mask, m):
        t = mask_terms(m.imask, S, L, constants)
        need(t.W == 0)
        return t.qpos, 1
    need(_FUTURE_RATE.match(mask, m))
    return m.qpos, int(m.value(m.rate))


def _indexer(n: Node, m: Match) -> Node:
    (B, S, L), K = m.x.shape, m.tk.attr["k"]
    need(isinstance(L, int) and isinstance(K, int) and 0 < K <= L)
    qpos, rate = _future(m.future, S, L, m.constants, B)
    w, q, Hi = m.w, m.iq, m.w.shape[2]
    if "hs" in m:
        need(tuple(m.hs.shape) == (B * S, 1, L) and tuple(m.hs.inputs[0].shape) == (B * S, 1, Hi))
    else:  # relu(x) * s == relu(x * s) (the kernel's order) needs s > 0
        need(tuple(m.hsum.shape) == (B, S, L) and tuple(m.hw.shape) == (B, S, Hi, L)
             and float(m.value(m.scale)) > 0)
    need(tuple(w.shape[:2]) == (B, S) and tuple(m.r.shape) == (B, S, Hi, L))
    need(tuple(m.qk.shape) == (B * S, Hi, L) and tuple(q.shape[:3]) == (B, S, Hi))
    need(tuple(m.kv.shape) == (B * S, q.shape[3], L) and _KEYS.match(m.kv, m))
    need(tuple(m.index_keys.shape) == (B, L, q.shape[3]) and m.index_keys.dtype in _UPCAST and q.dtype in _UPCAST
         and w.dtype in _UPCAST)
    rows = {"per_row": True} if per_row(qpos, S) else {}
    need(not rows or tuple(m.future.shape) == (B, 1, L))  # row b's hidden keys are its own
    return Node.make(INDEXER, (q, w, m.index_keys, qpos), {"scale": float(m.value(m.scale)), "k": K,
                     "sorted": bool(m.tk.attr.get("sorted", True)), "fill": float("-inf"), "rate": rate, **rows},
                     n.types, n.span)


# attention over a cache -> the ops above; counts ``sparse_attention.<op>``
sparse_attention = pattern_pass("sparse_attention", (
    Rule(f"sparse_attention.{INDEXER}", _INDEXER, _indexer),
    *(Rule(f"sparse_attention.{op}", _SDPA, lambda n, m, op=op: _sdpa(n, m, op))
      for op in (MLA, SPARSE, MLA_DENSE, DENSE)),
    Rule(f"sparse_attention.{DENSE}", _EAGER, _eager_with_sinks),
))
