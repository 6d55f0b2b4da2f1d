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

(d) the DSA lightning indexer (DeepSeek-V3.2), traced as generic ops::

    q [B,S,Hi,Di] ─ view [B*S,Hi,Di] ─┐
    keys state [B,L,Di] ─ permute(0,2,1) ─ unsqueeze(1) ─ expand ─ view [B*S,Di,L] ─ bmm ─ view ─ mul(scale) ─ relu
    w [B,S,Hi] ─ unsqueeze(-2) ─ view [B*S,1,Hi] ─ bmm(w, relu) ─ view/squeeze [B,S,L]
    ─ where(~causal mask, -inf) ─ topk(k) ─ getitem 1

        ==>  dsa_indexer_topk(q, w, keys, qpos) {scale, k, sorted, fill}
             one kernel (the kernel table's entry): each key row read once, scores never materialised per
             head, and torch.topk's exact selection (ties included) on the score row.

The indexer is the linear part of a DSA step (O(L) per query by design) and is reported separately by
``dayzero bench attention``. Both ops have one kernel per target with a
decode variant (S == 1: one query x its rows) and a prefill variant (blocked over queries), see
the kernel table's attention kernels. Ordering: after fold_constants (the arange, the window, the scale and the
fill values are read from ``ctx.constants``) and after inplace_state (the cache operands are then the in-place
written states). Anything unrecognised stays dense and correct.
"""

from __future__ import annotations

import math

import torch

from dayzero.passes.ir.node import Graph, Node, TensorType, rewrite

DENSE = "cache_attention"
SPARSE = "sparse_attention"
MLA = "mla_sparse_attention"
MLA_DENSE = "mla_attention"
INDEXER = "dsa_indexer_topk"


# ---- the match -----------------------------------------------------------------------------------------------

_RESHAPE = {"view", "_unsafe_view", "reshape", "unsqueeze", "squeeze.dim", "squeeze.dims", "squeeze", "alias"}


class _NoMatch(Exception):
    pass


def _need(cond) -> None:
    if not cond:
        raise _NoMatch


def _const(n: Node, constants) -> torch.Tensor:
    _need(n.op == "weight" and n.attr["name"] in constants)
    return constants[n.attr["name"]]


def _skip(n: Node, also=()) -> Node:
    """Through clones and expands/reshapes that keep the element count (no data movement in the math)."""
    while n.op in ({"clone", "alias", "expand"} | set(also)) and n.inputs and len(n.inputs[0].types) == 1:
        if n.op == "expand" and n.shape != n.inputs[0].shape:
            break
        n = n.inputs[0]
    return n


def _repeat_kv(n: Node) -> Node:
    """view(clone(expand(unsqueeze(x [B,Hkv,L,D], 2), [B,Hkv,r,L,D])), [B,Hkv*r,L,D]) -> x (else n itself)."""
    n = _skip(n)
    if n.op not in ("view", "_unsafe_view", "reshape") or n.type.ndim != 4:
        return n
    e = _skip(n.inputs[0], ("clone",))
    if e.op != "expand" or e.type.ndim != 5:
        return n
    u = e.inputs[0]
    if u.op != "unsqueeze" or u.attr.get("dim") != 2 or u.inputs[0].type.ndim != 4:
        return n
    x = u.inputs[0]
    B, Hkv, L, D = x.shape
    if tuple(e.shape) != (B, Hkv, e.shape[2], L, D) or tuple(n.shape) != (B, Hkv * e.shape[2], L, D):
        return n
    return x


def _qpos(n: Node, S) -> Node:
    """[..., S, 1] int positions -> the 1-D [S] node they are unsqueezed from."""
    while n.op == "unsqueeze" or (n.op in ("view", "expand", "clone") and n.inputs):
        n = n.inputs[0]
    _need(n.type.ndim == 1 and n.shape[0] == S and n.dtype.startswith("int"))
    return n


def _is_arange_row(n: Node, L: int, constants) -> bool:
    if n.op != "weight" or n.attr["name"] not in constants:
        return False
    t = constants[n.attr["name"]]
    return t.shape[-1] == L and t.numel() == L and torch.equal(t.reshape(-1), torch.arange(L, dtype=t.dtype))


def _all_true(n: Node, constants) -> bool:
    if n.op == "full" and n.attr.get("fill_value") in (True, 1):
        return True
    if n.op == "weight" and n.attr["name"] in constants:
        return bool(constants[n.attr["name"]].bool().all())
    return False


def _mask_terms(m: Node, S, L: int, constants) -> dict:
    """Decompose a bool mask [.., S, L] into {qpos, window, idx}; raises _NoMatch on any other term."""
    found = {"qpos": None, "window": 0, "idx": None, "wpos": None}

    def walk(n: Node):
        n = _skip(n)
        if n.op in ("bitwise_and.Tensor", "logical_and"):
            walk(n.inputs[0])
            walk(n.inputs[1])
        elif _all_true(n, constants):
            pass
        elif n.op == "le.Tensor" and _is_arange_row(n.inputs[0], L, constants):
            _need(found["qpos"] is None)
            found["qpos"] = _qpos(n.inputs[1], S)
        elif n.op == "gt.Tensor" and _is_arange_row(n.inputs[0], L, constants):
            d = n.inputs[1]
            _need(d.op == "sub.Tensor" and d.attr.get("alpha", 1) == 1)
            w = _const(d.inputs[1], constants)
            _need(w.numel() == 1 and not w.is_floating_point() and int(w) > 0)
            found["window"], found["wpos"] = int(w), _qpos(d.inputs[0], S)
        elif n.op == "bitwise_not":
            u = _skip(n.inputs[0], ("unsqueeze",))
            _need(u.op == "scatter.value" and u.attr.get("value") in (False, 0) and u.attr.get("dim") in (-1, 2))
            _need(_all_true(u.inputs[0], constants) and u.shape[-1] == L)
            _need(found["idx"] is None)
            found["idx"] = u.inputs[1]
        else:
            raise _NoMatch

    walk(m)
    _need(found["qpos"] is not None)
    _need(found["wpos"] is None or found["wpos"] is found["qpos"])
    _need(m.shape[-2:] == (S, L))
    return found


def _make(op: str, ins, attrs: dict, q: Node, v: Node, span) -> Node:
    B, H, S, _ = q.shape
    return Node.make(op, ins, attrs, (TensorType(q.dtype, (B, H, S, v.shape[-1])),), span)


def _cache_operands(q: Node, k: Node, v: Node) -> tuple[Node, Node]:
    k, v = _repeat_kv(k), _repeat_kv(v)
    B, H, S, D = q.shape
    _need(k.type.ndim == 4 and v.type.ndim == 4 and k.shape[2] == v.shape[2] and k.shape[1] == v.shape[1])
    _need(k.shape[0] == B and k.shape[3] == D and isinstance(H, int) and H % k.shape[1] == 0)
    _need(q.dtype == k.dtype == v.dtype)
    return k, v


def _copied(n: Node) -> Node:
    """copy(dst, src) with src of dst's shape is src (the traced form of ``dst.copy_(src)``)."""
    if n.op == "copy" and len(n.inputs) == 2 and tuple(n.inputs[1].shape) == tuple(n.shape):
        return n.inputs[1]
    return n


def _last_dim(n: Node, dim) -> bool:
    return dim in (-1, n.type.ndim - 1)


def _key_parts(k: Node) -> tuple[Node, Node]:
    """K [.., D] written as two pieces along the last dim -> (first piece, second piece): ``cat(a, b)`` or
    upstream's ``new_empty`` + two slice copies, slice_scatter(slice_scatter(_, a, 0:n), b, n:D)."""
    D = k.shape[-1]
    if k.op == "cat":
        _need(_last_dim(k, k.attr.get("dim")) and len(k.inputs) == 2)
        return k.inputs[0], k.inputs[1]
    hi = k
    _need(hi.op == "slice_scatter" and _last_dim(hi, hi.attr.get("dim")) and (hi.attr.get("step") or 1) == 1)
    lo = hi.inputs[0]
    _need(lo.op == "slice_scatter" and _last_dim(lo, lo.attr.get("dim")) and (lo.attr.get("step") or 1) == 1)
    n = lo.attr.get("end")
    _need((lo.attr.get("start") or 0) == 0 and isinstance(n, int) and 0 < n < D)
    _need(hi.attr.get("start") == n and isinstance(hi.attr.get("end"), int) and hi.attr.get("end") >= D)
    return _copied(lo.inputs[1]), _copied(hi.inputs[1])


def _mla_operands(q: Node, k: Node, v: Node) -> tuple[Node, Node, Node, int]:
    """K/V that are the MLA expansion of a latent cache (shape (c) in the module docstring) ->
    (latent [B,1,L,R], rope [B,1,L,Dr], W [H*(n+Dv), R], n); raises _NoMatch otherwise."""
    B, H, L, Dk = k.shape
    _need(v.op == "getitem" and v.attr["index"] == 1)
    sp = v.inputs[0]
    _need(sp.op == "split_with_sizes" and _last_dim(sp.inputs[0], sp.attr.get("dim"))
          and len(sp.attr["split_sizes"]) == 2)
    nope, dv = sp.attr["split_sizes"]
    pm = sp.inputs[0]
    _need(pm.op == "permute" and tuple(pm.attr["dims"]) == (0, 2, 1, 3))
    vw = pm.inputs[0]
    _need(vw.op in ("view", "_unsafe_view", "reshape") and tuple(vw.shape) == (B, L, H, nope + dv))
    lin = vw.inputs[0]
    _need(lin.op == "linear" and len(lin.inputs) == 2 and not lin.attr.get("bias"))
    lat, w = lin.inputs
    _need(lat.type.ndim == 4 and tuple(lat.shape[:3]) == (B, 1, L) and w.type.ndim == 2)
    R = lat.shape[3]
    _need(tuple(w.shape) == (H * (nope + dv), R) and v.shape[-1] == dv)
    kn, kr = _key_parts(k)
    _need(kn.op == "getitem" and kn.attr["index"] == 0 and kn.inputs[0] is sp)
    _need(kr.op == "expand")
    rope = kr.inputs[0]
    Dr = Dk - nope
    _need(tuple(rope.shape) == (B, 1, L, Dr) and tuple(kr.shape) == (B, H, L, Dr) and q.shape[-1] == Dk)
    _need(lat.dtype == rope.dtype == q.dtype)
    return lat, rope, w, int(nope)


def _sdpa(n: Node, constants, counts) -> Node | None:
    a = n.attr
    _need(a.get("attn_mask") and not a.get("is_causal") and float(a.get("dropout_p") or 0.0) == 0.0)
    q, k, v, mask = n.inputs
    _need(q.type.ndim == 4)
    k, v = _cache_operands(q, k, v)
    L = k.shape[2]
    _need(isinstance(L, int))
    terms = _mask_terms(mask, q.shape[2], L, constants)
    scale = a.get("scale")
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(int(q.shape[-1]))
    if terms["idx"] is not None:
        _need(terms["window"] == 0)
        idx = terms["idx"]
        _need(idx.type.ndim == 3 and idx.shape[1] == q.shape[2] and idx.dtype.startswith("int"))
        try:
            lat, rope, w, nope = _mla_operands(q, k, v)
        except _NoMatch:
            counts[SPARSE] += 1
            return _make(SPARSE, (q, k, v, terms["qpos"], idx), {"scale": scale}, q, v, n.span)
        counts[MLA] += 1
        return _make(MLA, (q, lat, rope, w, terms["qpos"], idx), {"scale": scale, "nope": nope}, q, v, n.span)
    if terms["window"] == 0:
        try:
            lat, rope, w, nope = _mla_operands(q, k, v)
            counts[MLA_DENSE] += 1
            return _make(MLA_DENSE, (q, lat, rope, w, terms["qpos"]), {"scale": scale, "nope": nope}, q, v, n.span)
        except _NoMatch:
            pass
    counts[DENSE] += 1
    return _make(DENSE, (q, k, v, terms["qpos"]), {"scale": scale, "window": terms["window"], "sinks": False},
                 q, v, n.span)


def _flat_heads(n: Node, ndim4: int = 4) -> Node:
    """view(expand(x [B,H,a,b]), [B*H,a,b]) -> x."""
    _need(n.op in ("view", "_unsafe_view", "reshape") and n.type.ndim == 3)
    x = _skip(n.inputs[0])
    _need(x.type.ndim == ndim4)
    return x


def sink_softmax_parts(p: Node) -> tuple[Node, Node]:
    """The probabilities of eager attention with sinks (gpt-oss, DeepSeek-V4), flattened [B*H, S, L]::

        view(softmax(cat(logits, sinks) [- max]) [..., :-1]) -> (logits [B,H,S,L], sinks column [B,H,S,1])"""
    sl = _skip(_flat_heads(p), ("clone",))
    _need(sl.op == "slice.Tensor" and sl.attr.get("dim") in (-1, 3) and (sl.attr.get("start") or 0) == 0
          and sl.attr.get("end") == -1 and (sl.attr.get("step") or 1) == 1)
    sm = sl.inputs[0]
    _need(sm.op in ("softmax.int", "_softmax") and sm.attr.get("dim") in (-1, 3))
    c = sm.inputs[0]
    if c.op == "sub.Tensor":
        mx = c.inputs[1]
        _need(mx.op == "getitem" and mx.attr["index"] == 0 and mx.inputs[0].op == "max.dim"
              and mx.inputs[0].inputs[0] is c.inputs[0] and c.attr.get("alpha", 1) == 1)
        c = c.inputs[0]
    _need(c.op == "cat" and c.attr.get("dim") in (-1, 3) and len(c.inputs) == 2)
    return c.inputs[0], c.inputs[1]


def scaled_qk(scaled: Node, constants) -> tuple[torch.Tensor, Node, Node]:
    """view(bmm(q, kᵀ)) * scale of eager attention, heads flattened -> (scale, q [B,H,S,D], k [B,Hk,L,D] as fed
    to the transpose: repeat_kv'd where the heads were repeated)."""
    _need(scaled.op == "mul.Tensor")
    scale = _const(scaled.inputs[1], constants)
    _need(scale.numel() == 1)
    s4 = scaled.inputs[0]
    _need(s4.op in ("view", "_unsafe_view", "reshape") and s4.type.ndim == 4)
    qk = s4.inputs[0]
    _need(qk.op == "bmm")
    q = _flat_heads(qk.inputs[0])
    kt = _flat_heads(qk.inputs[1])
    _need(kt.op == "permute" and tuple(kt.attr["dims"]) == (0, 1, 3, 2))
    return scale, q, kt.inputs[0]


def _eager_with_sinks(n: Node, constants, counts) -> Node | None:
    """bmm(P [B*H,S,L], V [B*H,L,Dv]) of the eager sink attention -> view(cache_attention [B,H,S,Dv])."""
    p, vf = n.inputs
    v = _flat_heads(vf)
    logits, sk = sink_softmax_parts(p)
    sinks = sk
    while sinks.op in _RESHAPE | {"expand", "clone"}:
        sinks = sinks.inputs[0]
    _need(sinks.type.ndim == 1 and sk.shape[-1] == 1)
    _need(logits.op == "add.Tensor" and logits.attr.get("alpha", 1) == 1)
    scaled, bias = logits.inputs
    _need(bias.op == "where.self")
    mask, zero, neg = bias.inputs
    _need(float(_const(zero, constants)) == 0.0 and float(_const(neg, constants)) <= -1e30)
    scale, q, k = scaled_qk(scaled, constants)
    k, v = _cache_operands(q, k, v)
    L = k.shape[2]
    _need(isinstance(L, int) and sinks.shape[0] == q.shape[1])
    terms = _mask_terms(mask, q.shape[2], L, constants)
    _need(terms["idx"] is None)
    counts[DENSE] += 1
    att = _make(DENSE, (q, k, v, terms["qpos"], sinks),
                {"scale": float(scale), "window": terms["window"], "sinks": True}, q, v, n.span)
    return Node.make("view", (att,), {"size": tuple(n.shape)}, n.types, n.span)


def _strip(n: Node, ops_=("view", "_unsafe_view", "reshape", "clone", "alias")) -> Node:
    """Through reshapes/clones, expands that keep the shape, and upcasts to float32 (exact)."""
    while n.inputs and len(n.inputs[0].types) == 1 and (
            n.op in ops_ or (n.op == "expand" and tuple(n.shape) == tuple(n.inputs[0].shape))
            or (n.op == "_to_copy" and n.attr.get("dtype") == "float32" and n.inputs[0].dtype in _UPCAST)):
        n = n.inputs[0]
    return n


_UPCAST = ("float32", "bfloat16", "float16")


def _indexer(n: Node, constants, counts) -> Node | None:
    """getitem(topk(where(~mask, -inf, Σ_h w·relu(scale·q·kᵀ)), k), 1) -> dsa_indexer_topk (shape (d))."""
    _need(n.attr.get("index") == 1)
    tk = n.inputs[0]
    _need(tk.op == "topk" and tk.attr.get("largest", True) and _last_dim(tk.inputs[0], tk.attr.get("dim", -1)))
    x = tk.inputs[0]
    _need(x.op == "where.self" and x.type.ndim == 3)
    B, S, L = x.shape
    K = tk.attr["k"]
    _need(isinstance(L, int) and isinstance(K, int) and 0 < K <= L)
    cond, fill, sc = x.inputs
    fv = _const(fill, constants)
    _need(fv.numel() == 1 and float(fv) == float("-inf"))
    _need(cond.op == "bitwise_not")
    m = cond.inputs[0]
    if m.op == "select.int":
        _need(m.attr.get("dim") == 1 and m.attr.get("index") == 0 and m.inputs[0].shape[1] == 1)
        m = m.inputs[0]
    terms = _mask_terms(m, S, L, constants)
    _need(terms["idx"] is None and terms["window"] == 0)
    # weighted head sum: bmm(w [B*S,1,Hi], relu [B*S,Hi,L]) viewed back to [B,S,L]
    hs = _strip(sc, ("view", "_unsafe_view", "reshape", "squeeze.dim", "squeeze.dims", "clone"))
    _need(hs.op == "bmm" and tuple(hs.shape) == (B * S, 1, L))
    wv, rv = hs.inputs
    w = _strip(wv, ("view", "_unsafe_view", "reshape", "unsqueeze", "clone"))
    r = _strip(rv)
    _need(w.type.ndim == 3 and tuple(w.shape[:2]) == (B, S) and r.op == "relu" and r.type.ndim == 4)
    Hi = w.shape[2]
    _need(tuple(r.shape) == (B, S, Hi, L) and tuple(wv.shape) == (B * S, 1, Hi))
    mul = r.inputs[0]
    _need(mul.op == "mul.Tensor")
    scale = _const(mul.inputs[1], constants)
    _need(scale.numel() == 1)
    qk = _strip(mul.inputs[0])
    _need(qk.op == "bmm" and tuple(qk.shape) == (B * S, Hi, L))
    q = _strip(qk.inputs[0])
    _need(q.type.ndim == 4 and tuple(q.shape[:3]) == (B, S, Hi))
    Di = q.shape[3]
    # keys: view(expand(unsqueeze(permute(keys [B,L,Di], (0,2,1)), 1), [B,S,Di,L]), [B*S,Di,L])
    kv = qk.inputs[1]
    _need(tuple(kv.shape) == (B * S, Di, L))
    kn = kv
    while kn.op in ("view", "_unsafe_view", "reshape", "expand", "clone", "alias"):
        kn = kn.inputs[0]
    _need(kn.op == "unsqueeze" and kn.attr.get("dim") == 1)
    pm = kn.inputs[0]
    _need(pm.op == "permute" and tuple(pm.attr["dims"]) == (0, 2, 1))
    keys = _strip(pm.inputs[0])
    _need(tuple(keys.shape) == (B, L, Di) and keys.dtype in _UPCAST and q.dtype in _UPCAST and w.dtype in _UPCAST)
    counts[INDEXER] += 1
    return Node.make(INDEXER, (q, w, keys, terms["qpos"]),
                     {"scale": float(scale), "k": K, "sorted": bool(tk.attr.get("sorted", True)),
                      "fill": float("-inf")}, n.types, n.span)


def sparse_attention(g: Graph, ctx) -> Graph:
    counts = {DENSE: 0, SPARSE: 0, MLA: 0, MLA_DENSE: 0, INDEXER: 0}

    def fn(n: Node) -> Node | None:
        try:
            if n.op == "getitem" and n.inputs[0].op == "topk":
                return _indexer(n, ctx.constants, counts)
            if n.op == "scaled_dot_product_attention" and len(n.inputs) == 4:
                return _sdpa(n, ctx.constants, counts)
            if n.op == "bmm" and n.inputs[0].op in ("view", "_unsafe_view", "reshape"):
                return _eager_with_sinks(n, ctx.constants, counts)
        except _NoMatch:
            return None
        return None

    g = rewrite(g, fn)
    for name, c in counts.items():
        if c:
            ctx.patterns[name] = ctx.patterns.get(name, 0) + c
    return g
