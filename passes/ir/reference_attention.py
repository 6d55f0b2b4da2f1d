"""Torch references of dayzero's attention ops and of their paged forms (declared in ``dayzero_ops.py``).

Paged caches (passes/paged_kv.py): a reader's cache operand is a pool of blocks read through a block table
(last input); ``unpage`` gathers it back to the logical contiguous cache, so each op's contiguous reference applies
unchanged. ``by_token`` runs a reader's per-token form (the batched decode step: query s through table row s).
"""

from __future__ import annotations

import torch

# op -> {input index of a cache operand: its position dimension}
READERS: dict[str, dict[int, int]] = {
    "cache_attention": {1: 2, 2: 2},
    "sparse_attention": {1: 2, 2: 2},
    "mla_sparse_attention": {1: 2, 2: 2},
    "mla_attention": {1: 2, 2: 2},
    "dsa_indexer_topk": {2: 1},
    "compressed_attention": {1: 2},  # DeepSeek-V4: the K=V state; its compressed entries stay per request
}


def table_rows(table: torch.Tensor, block_size: int, positions: torch.Tensor) -> torch.Tensor:
    """Pool row of each logical position p: table[p // bs] * bs + p % bs; a per-token table [S, NT] maps
    position s through its row s."""
    p = positions.long()
    if table.dim() == 2:
        return table.long()[torch.arange(p.shape[0], device=p.device), p // block_size] * block_size + p % block_size
    return table.long()[p // block_size] * block_size + p % block_size


def gather(pool: torch.Tensor, table: torch.Tensor, dim: int, block_size: int, length: int) -> torch.Tensor:
    """The logically contiguous cache [.., length, ..] of one request, read through its table."""
    return pool.index_select(dim, table_rows(table, block_size, torch.arange(length, device=table.device)))


def unpage(ins: list, attrs: dict, op: str) -> list:
    """A paged op's inputs with each cache operand gathered back to its logical [.., length, ..] form and the table
    dropped: the contiguous op's reference then applies unchanged."""
    if not attrs.get("paged"):
        return ins
    *ins, table = ins
    if ins[0].device.type == "meta":
        return ins
    for k, dim in READERS[op].items():
        ins[k] = gather(ins[k], table, dim, attrs["paged"], attrs["length"])
    return ins


# op -> ({input index: its query dimension}, the output's query dimension): how a per-token reader splits by query
QUERY_DIMS: dict[str, tuple[dict[int, int], int]] = {
    "cache_attention": ({0: 2, 3: 0}, 2),
    "sparse_attention": ({0: 2, 3: 0, 4: 1}, 2),
    "mla_sparse_attention": ({0: 2, 4: 0, 5: 1}, 2),
    "mla_attention": ({0: 2, 4: 0}, 2),
    "dsa_indexer_topk": ({0: 1, 1: 1, 3: 0}, 1),
}


def by_token(op: str, reference):
    """A reader's reference that also runs its per-token form: query s alone, through table row s, each
    (the op's one-table reference per query, outputs joined along the query dimension)."""
    def run(ins, attrs):
        if not attrs.get("per_token") or ins[0].device.type == "meta":
            return reference(ins, attrs)
        dims, out_dim = QUERY_DIMS[op]
        *args, table = ins
        one = {k: v for k, v in attrs.items() if k != "per_token"}
        outs = [reference([a.narrow(dims[k], s, 1) if k in dims else a for k, a in enumerate(args)] + [table[s]],
                          one) for s in range(table.shape[0])]
        return torch.cat(outs, dim=out_dim)
    return run


def by_row(reference, pos: tuple[int, ...]):
    """A reader's reference that also runs its per-row form (attr ``per_row``: one query per batch row, row b at
    positions[b], the row-batched decode step): each row alone with its own positions, joined along the batch.
    Inputs with a batch dim (q, caches, entries, idx) are split by row; sinks and the block table are shared.
    ``pos``: the inputs that are positions [B] (cache_attention's and the indexer's qpos (3); compressed_attention's
    qpos (2) and HCA's epos (5: the optional idx and epos are exclusive, an absent one is no input))."""
    def run(ins, attrs):
        if not attrs.get("per_row") or ins[0].device.type == "meta":
            return reference(ins, attrs)
        B = ins[0].shape[0]
        one = {k: v for k, v in attrs.items() if k != "per_row"}

        def row(k, a, b):
            if a is None or (attrs.get("paged") and k == len(ins) - 1):
                return a
            if k in pos or (a.dim() >= 3 and a.shape[0] == B):
                return a[b:b + 1]
            return a
        return torch.cat([reference([row(k, a, b) for k, a in enumerate(ins)], one) for b in range(B)], dim=0)
    return run


def paged_write_reference(ins, attrs):
    state, idx, values, table = ins
    index = [None] * state.dim()
    index[attrs["dim"]] = table_rows(table, attrs["block_size"], idx)
    return torch.ops.aten.index_put_(state, index, values)


# ---- attention over a KV cache (passes/sparse_attention.py) ----------------------------------------------

def valid_positions(L: int, qpos: torch.Tensor, window: int, ring: bool = False) -> torch.Tensor:
    """[S, L] bool: key j is visible from query s iff j <= qpos[s] (and j > qpos[s] - window when window > 0).
    ``ring``: row j holds position qpos[s] - (L-1) + j (the window ending at the query), the same rule on it."""
    j = torch.arange(L, device=qpos.device)
    if ring:
        j = j[None, :] + (qpos[:, None] - (L - 1))
        m = (j >= 0) & (j <= qpos[:, None])
        return m & (j > (qpos[:, None] - window)) if window else m
    m = j[None, :] <= qpos[:, None]
    if window:
        m &= j[None, :] > (qpos[:, None] - window)
    return m


def _expand_heads(x: torch.Tensor, hq: int) -> torch.Tensor:
    return x.repeat_interleave(hq // x.shape[1], dim=1) if x.shape[1] != hq else x


def _attend(q, k, v, mask, scale, sinks=None):
    """Softmax attention with a bool mask [.., S, L] (and per-head sink logits), fp32 inside."""
    k, v = _expand_heads(k, q.shape[1]), _expand_heads(v, q.shape[1])
    if sinks is None:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    w = torch.matmul(q, k.transpose(-1, -2)) * scale
    w = w.masked_fill(~mask, float("-inf"))
    s = sinks.reshape(1, -1, 1, 1).expand(w.shape[0], -1, w.shape[2], 1).to(w.dtype)
    c = torch.cat([w, s], dim=-1)
    p = torch.softmax(c - c.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]
    return torch.matmul(p.to(v.dtype), v)


def _out(q, v):
    B, H, S, _ = q.shape
    return torch.empty(B, H, S, v.shape[-1], dtype=q.dtype, device=q.device)


def dense_reference(ins, attrs):
    """out[b,h,s] = softmax_j(q[b,h,s]·k[b,h//r,j]·scale [, sink_h]) v[b,h//r,j] over visible j (valid_positions)."""
    ins = unpage(ins, attrs, "cache_attention")
    q, k, v, qpos = ins[:4]
    if q.device.type == "meta":
        return _out(q, v)
    sinks = ins[4] if attrs["sinks"] else None
    mask = valid_positions(k.shape[2], qpos.reshape(-1), attrs["window"], bool(attrs.get("ring")))[None, None]
    return _attend(q, k, v, mask, attrs["scale"], sinks).contiguous()


def sparse_reference(ins, attrs):
    """As dense_reference (window 0), over visible j that are also in idx[b, s, :]."""
    q, k, v, qpos, idx = unpage(ins, attrs, "sparse_attention")
    if q.device.type == "meta":
        return _out(q, v)
    S, L = q.shape[2], k.shape[2]
    sel = torch.zeros(idx.shape[0], S, L, dtype=torch.bool).scatter_(-1, idx.long(), True)
    mask = (sel & valid_positions(L, qpos.reshape(-1), 0)[None]).unsqueeze(1)
    return _attend(q, k, v, mask, attrs["scale"]).contiguous()


def mla_expand(lat, rope, w, nope: int, H: int):
    """Upstream's ``expand_kv``: per head, K = [latent · W_uk^T | rope_k] and V = latent · W_uv^T, where
    W = kv_b_proj.weight [H*(nope+Dv), R] holds (W_uk, W_uv) per head (in the latent's dtype, or bf16 as a
    checkpoint stores it: upcast exactly). lat [B,1,L,R], rope [B,1,L,Dr]."""
    B, _, L, _ = lat.shape
    kv = torch.nn.functional.linear(lat, w.to(lat.dtype)).view(B, L, H, -1).transpose(1, 2)
    k = torch.cat([kv[..., :nope], rope.expand(B, H, L, rope.shape[-1])], dim=-1)
    return k, kv[..., nope:]


def mla_sparse_reference(ins, attrs):
    """sparse_reference over upstream's expansion of the latent cache (mla_expand): the unfused semantics."""
    q, lat, rope, w, qpos, idx = unpage(ins, attrs, "mla_sparse_attention")
    H = q.shape[1]
    if q.device.type == "meta":
        return torch.empty(q.shape[0], H, q.shape[2], w.shape[0] // H - attrs["nope"], dtype=q.dtype,
                           device="meta")
    k, v = mla_expand(lat, rope, w, attrs["nope"], H)
    # k, v are already the logical cache (unpaged above): sparse_reference must not read a table again
    return sparse_reference([q, k, v, qpos, idx], {**attrs, "paged": None})


def mla_dense_reference(ins, attrs):
    """dense_reference (causal, window 0) over upstream's expansion of the latent cache (mla_expand)."""
    q, lat, rope, w, qpos = unpage(ins, attrs, "mla_attention")
    H = q.shape[1]
    if q.device.type == "meta":
        return torch.empty(q.shape[0], H, q.shape[2], w.shape[0] // H - attrs["nope"], dtype=q.dtype,
                           device="meta")
    k, v = mla_expand(lat, rope, w, attrs["nope"], H)
    return dense_reference([q, k, v, qpos], {"scale": attrs["scale"], "window": 0, "sinks": False})


def indexed_rows(L: int, qpos: torch.Tensor, rate: int) -> torch.Tensor:
    """[S, L] bool: index-key row j is visible from query s iff j < (qpos[s] + 1) // rate. Rate 1 (a key per
    position, DeepSeek-V3.2) is j <= qpos[s]; rate R (DeepSeek-V4's CSA: key j pools positions [jR, jR + R)) is
    upstream's ``future_mask``: a key counts once its window is complete."""
    thr = torch.div(qpos.long() + 1, rate, rounding_mode="floor")
    return torch.arange(L, device=qpos.device)[None, :] < thr[:, None]


def indexer_reference(ins, attrs):
    """Upstream's lightning indexer, op for op (DeepseekV32Indexer.forward / DeepseekV4IndexerScorer after the
    projections): per-head scores, ReLU, weighted head sum, causal mask (``indexed_rows``) with ``fill``,
    torch.topk."""
    q, w, keys, qpos = unpage(ins, attrs, "dsa_indexer_topk")
    B, S = q.shape[:2]
    if q.device.type == "meta":
        return torch.empty(B, S, attrs["k"], dtype=torch.int64, device="meta")
    scores = torch.relu(torch.matmul(q.float(), keys.transpose(-1, -2).float().unsqueeze(1)) * attrs["scale"])
    x = torch.matmul(w.float().unsqueeze(-2), scores).squeeze(-2)
    x = x.masked_fill(~indexed_rows(keys.shape[1], qpos.reshape(-1), attrs.get("rate", 1))[None], attrs["fill"])
    return x.topk(attrs["k"], dim=-1, sorted=attrs["sorted"]).indices


# ---- DeepSeek-V4 compressed attention (passes/compressed_attention.py) -------------------------------------

def entry_selection(attrs: dict, B: int, S: int, E: int, idx=None, epos=None) -> torch.Tensor:
    """[B, S, E] bool: the entries query (b, s) attends to. CSA: e in idx[b, s, :] and 0 <= e < E (upstream's
    scatter of 0 into a -inf row, sliced to E). HCA: e < (epos[s] + 1) // rate (upstream's causal block bias)."""
    if idx is not None:
        i = idx.long()
        ok = (i >= 0) & (i < E)
        sel = torch.zeros(B, S, E + 1, dtype=torch.bool, device=idx.device)
        return sel.scatter_(-1, torch.where(ok, i, E), True)[..., :E]
    thr = torch.div(epos.reshape(-1).long() + 1, attrs["rate"], rounding_mode="floor")
    return (torch.arange(E, device=epos.device)[None, :] < thr[:, None])[None].expand(B, S, E)


def compressed_reference(ins, attrs):
    """Upstream's dense form: softmax(scale q·[kv; entries]ᵀ + mask ; sink_h) [kv; entries] over the rows of
    ``valid_positions(L, qpos, window)`` and ``entry_selection``."""
    q, kv, qpos, ent, sinks, *rest = unpage(ins, attrs, "compressed_attention")
    if q.device.type == "meta":
        return torch.empty(q.shape, dtype=q.dtype, device="meta")
    idx = rest.pop(0) if attrs.get("idx") else None
    epos = rest.pop(0) if attrs.get("epos") else None
    B, _, S, _ = q.shape
    win = valid_positions(kv.shape[2], qpos.reshape(-1), attrs["window"], bool(attrs.get("ring")))[None].expand(
        B, S, -1)
    sel = entry_selection(attrs, B, S, ent.shape[2], idx, epos)
    mask = torch.cat([win, sel], dim=-1).unsqueeze(1)
    x = torch.cat([kv, ent], dim=2)
    return _attend(q, x, x, mask, attrs["scale"], sinks).contiguous()
