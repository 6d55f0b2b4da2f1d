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

The kernel (the kernel table's ``compressed_attention``) reads per query only the window rows
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

from dayzero.passes.ir.node import Graph, Node, TensorType, rewrite
from dayzero.passes.sparse_attention import (_NoMatch, _const, _flat_heads, _is_arange_row, _mask_terms,
                                             _need, _qpos, _repeat_kv, _RESHAPE, _skip, scaled_qk,
                                             sink_softmax_parts)

OP = "compressed_attention"


# ---- the match -----------------------------------------------------------------------------------------------

def _through(n: Node, names=_RESHAPE | {"expand", "clone"}) -> Node:
    while n.op in names and n.inputs:
        n = n.inputs[0]
    return n


def _fill(n: Node, constants) -> float | None:
    """The value every element of n holds (a full, or a folded constant), else None."""
    if n.op in ("full", "full_like") and isinstance(n.attr.get("fill_value"), (int, float)):
        return float(n.attr["fill_value"])
    if n.op == "weight" and n.attr["name"] in constants:
        t = constants[n.attr["name"]]
        if t.numel() and bool((t == t.reshape(-1)[0]).all()):
            return float(t.reshape(-1)[0])
    return None


def _csa_block(b: Node, S, E: int) -> Node:
    """slice(scatter(full(-inf) [.,1,S,E'], unsqueeze(idx [B,S,K], 1), dim=-1, value=0), dim=-1, 0:E) -> idx."""
    if b.op == "slice.Tensor":
        _need(b.attr.get("dim") in (-1, 3) and (b.attr.get("start") or 0) == 0 and b.attr.get("end") == E
              and (b.attr.get("step") or 1) == 1)
        b = b.inputs[0]
    _need(b.op == "scatter.value" and b.attr.get("dim") in (-1, 3) and b.attr.get("value") in (0, 0.0))
    _need(b.shape[-1] >= E and b.shape[-2] == S)
    return b


def _distinct(idx: Node, E: int, constants) -> bool:
    """The in-range values of ``idx`` are distinct per query: top-k indices, possibly replaced by out-of-range
    fills (upstream's ``where(ge(i, thr), -1, i)`` and ``where(i >= 0, i, E)``), so a row is never counted twice."""
    while idx.op == "where.self":
        _, a, b = idx.inputs
        fa, fb = _fill(a, constants), _fill(b, constants)
        out = lambda f: f is not None and (f < 0 or f >= E)  # noqa: E731
        if out(fa):
            idx = b
        elif out(fb):
            idx = a
        else:
            return False
    return idx.op == "getitem" and idx.attr["index"] == 1 and idx.inputs[0].op == "topk"


def _block_terms(b: Node, S, E: int, constants) -> dict:
    """The block bias [., 1, S, E] -> {"idx": node} (CSA) or {"epos": node, "rate": R} (HCA); _NoMatch otherwise."""
    b = _skip(b)
    _need(b.type.ndim == 4 and b.shape[-1] == E and b.shape[-2] == S and b.shape[1] == 1)
    if b.op in ("slice.Tensor", "scatter.value"):
        sc = _csa_block(b, S, E)
        _need(_fill(sc.inputs[0], constants) == float("-inf"))
        u = sc.inputs[1]
        _need(u.op == "unsqueeze" and u.attr.get("dim") == 1)
        idx = u.inputs[0]
        _need(idx.type.ndim == 3 and idx.shape[1] == S and idx.dtype.startswith("int"))
        _need(_distinct(idx, E, constants))
        return {"idx": idx}
    # HCA: where(ge(arange(E), (pos + 1) // R), -inf, 0)
    _need(b.op == "where.self")
    cond, neg, zero = b.inputs
    _need(_fill(neg, constants) == float("-inf") and _fill(zero, constants) == 0.0)
    _need(cond.op == "ge.Tensor" and _is_arange_row(cond.inputs[0], E, constants))
    d = _through(cond.inputs[1])
    _need(d.op == "div.Tensor_mode" and d.attr.get("rounding_mode") == "floor")
    r = _const(d.inputs[1], constants)
    _need(r.numel() == 1 and not r.is_floating_point() and int(r) > 0)
    a = d.inputs[0]
    _need(a.op == "add.Tensor" and a.attr.get("alpha", 1) == 1)
    one = _const(a.inputs[1], constants)
    _need(one.numel() == 1 and int(one) == 1 and not one.is_floating_point())
    return {"epos": _qpos(a.inputs[0], S), "rate": int(r)}


def _match(n: Node, constants, counts) -> Node:
    """bmm(P [B*H,S,L+E], V [B*H,L+E,D]) of the eager sink attention over cat([kv, entries]) ->
    view(compressed_attention [B,H,S,D])."""
    p, vf = n.inputs
    v = _repeat_kv(_flat_heads(vf))
    logits, sk = sink_softmax_parts(p)
    sinks = _through(sk)
    _need(sinks.type.ndim == 1 and sk.shape[-1] == 1)
    _need(logits.op == "add.Tensor" and logits.attr.get("alpha", 1) == 1)
    scaled, bias = logits.inputs
    scale, q, k = scaled_qk(scaled, constants)
    kvc = _repeat_kv(k)
    # K = V = cat([sliding state, entries]) along the rows
    _need(kvc is v and kvc.op == "cat" and kvc.attr.get("dim") in (2, -2) and len(kvc.inputs) == 2)
    kv, ent = kvc.inputs
    B, H, S, D = q.shape
    _need(kv.type.ndim == 4 and ent.type.ndim == 4 and isinstance(H, int))
    _need(kv.shape[0] == ent.shape[0] == B and kv.shape[1] == ent.shape[1] and H % kv.shape[1] == 0)
    _need(kv.shape[3] == ent.shape[3] == D and q.dtype == kv.dtype == ent.dtype)
    L, E = kv.shape[2], ent.shape[2]
    _need(isinstance(L, int) and isinstance(E, int) and sinks.shape[0] == H)
    # the mask: cat([where(window mask, 0, -big), block bias])
    _need(bias.op == "cat" and bias.attr.get("dim") in (-1, 3) and len(bias.inputs) == 2)
    wb, bb = bias.inputs
    _need(wb.op == "where.self")
    mask, zero, neg = wb.inputs
    z, big = _const(zero, constants), _const(neg, constants)
    _need(z.numel() == 1 and big.numel() == 1 and float(z) == 0.0 and float(big) <= -1e30)
    terms = _mask_terms(mask, S, L, constants)
    _need(terms["idx"] is None)
    block = _block_terms(bb, S, E, constants)
    ins = [q, kv, terms["qpos"], ent, sinks]
    attrs = {"scale": float(scale), "window": terms["window"], "rate": block.get("rate", 0),
             "idx": "idx" in block, "epos": "epos" in block}
    if "idx" in block:
        _need(block["idx"].shape[0] == B)
        ins.append(block["idx"])
    else:
        ins.append(block["epos"])
    counts["csa" if "idx" in block else "hca"] += 1
    att = Node.make(OP, tuple(ins), attrs, (TensorType(q.dtype, (B, H, S, D)),), n.span)
    return Node.make("view", (att,), {"size": tuple(n.shape)}, n.types, n.span)


def compressed_attention(g: Graph, ctx) -> Graph:
    counts = {"csa": 0, "hca": 0}

    def fn(n: Node) -> Node | None:
        if n.op != "bmm" or n.inputs[0].op not in ("view", "_unsafe_view", "reshape"):
            return None
        try:
            return _match(n, ctx.constants, counts)
        except _NoMatch:
            return None

    g = rewrite(g, fn)
    for kind, c in counts.items():
        if c:
            name = f"{OP}_{kind}"
            ctx.patterns[name] = ctx.patterns.get(name, 0) + c
    return g
