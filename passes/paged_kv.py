"""paged_kv: KV caches as pools of fixed-size blocks, addressed through a per-request block table.

A request's cache is logically contiguous (row p holds position p) and physically sparse: position p lives in
row ``table[p // bs] * bs + p % bs`` of a pool shared by every request, so a request holds only the blocks its
tokens fill and a freed block serves the next request (runtime/kv_pages.py keeps the free list and the tables).

    %s = state "cache_0_keys" {kv_cache} [1,H,L,D]          %s = state "cache_0_keys" {kv_pages} [1,H,N*bs,D]
    %u = state_index_put(%s, %pos, %k) {indices: dim 2} ==> %u = paged_state_index_put(%s, %pos, %k, %table)
    cache_attention(%q, %u, %v, %qpos)                       cache_attention(%q, %u, %v, %qpos, %table) {paged=bs}

    %table = input "block_table" int32 [ceil(L / bs)]        (one table for every paged state of a window class)

A state is paged when the graph shows it is a per-token cache the kernels can address through a table: it is
written only by ``state_index_put`` along one dimension d of size L (the position), read only by the ops in
``READERS`` at an operand whose position dimension is d, and otherwise only returned. Anything else (the
fixed-size compressed caches of DeepSeek-V4, a cache some generic op reads) stays a per-request contiguous state.
Every paged state has its own pool; the states of one class have the same N blocks, so one table maps them all.

Pool size: ``blocks`` if given (``dayzero compile --kv-blocks``), else enough for ``max_batch`` requests of the
compiled maximum length, plus block 0: the scratch block that unallocated table entries point to (a padded
prefill's tail writes land there; nothing valid is ever read from it). Runs after sparse_attention (the readers
are its ops).

Per-token tables (``per_token``, the batched decode program): the graph's S tokens are S
requests' next tokens (passes/token_positions.py), so every table is ``int32 [S, ceil(L / bs)]``, row s the table
of token s's request; the write of token s and every read for query s go through row s (attr ``per_token``)::

    %u = paged_state_index_put(%s, %pos, %k, %table [S, NT]) {per_token}    row(s) = table[s, pos[s] // bs] * bs + ..
    cache_attention(%q, %u, %v, %pos, %table [S, NT]) {paged=bs, per_token}

Sliding windows: a cache whose every reader looks back at most W positions (gpt-oss's sliding layers, DeepSeek-V4's
K=V state) gets its own table ``block_table_w{W}`` and pool. The runtime hands its blocks behind the window back
after each call, so between calls a request holds ceil(W / bs) + 1 of them; during its prefill it holds the whole
prompt chunk (every row of a call is written before the attention reads it) and the W - 1 positions before it. The
pool: (max_batch - 1) windows + one prefill chunk with its window + the scratch block, so it is sized by the window
and ``cfg["chunk"]`` (the prefill chunk), never by the maximum length.
"""

from __future__ import annotations

from dayzero import InternalError
from dayzero.passes.ir.dayzero_ops import BLOCK_TABLE
from dayzero.passes.ir.node import Graph, Node, TensorType
from dayzero.passes.ir.reference_attention import READERS
from dayzero.passes.pipeline import Found, counted

TABLE = "block_table"
INDEXER = "dsa_indexer_topk"
ZONE = "kv_pages"
WRITE = "paged_state_index_put"

# op -> input index of its query positions (qpos [S])
READER_POSITION = {"cache_attention": 3, "sparse_attention": 3, "mla_sparse_attention": 4, "mla_attention": 4,
                   "dsa_indexer_topk": 3, "compressed_attention": 2}


def _position_read(n: Node, k: int) -> bool:
    """Input ``k`` of ``n`` is a cache read along its position dimension (``READERS``). An indexer with rate R > 1
    reads compressed keys, one per R positions (DeepSeek-V4's CSA entries): not a per-position cache."""
    return n.op in READERS and k in READERS[n.op] and not (n.op == INDEXER and n.attr.get("rate", 1) != 1)


def _cache_root(n: Node) -> Node:
    while n.op in ("state_index_put", WRITE):
        n = n.inputs[0]
    return n


def paged_kv(g: Graph, cfg: dict | None, per_token: bool = False) -> tuple[Graph, Found]:
    """Page the KV caches by ``cfg`` ({"block_size", "blocks", "max_batch"}; None or block size 0: leave them
    contiguous), with one table row per token when ``per_token``; ``Found.kv_pages`` is the layout chosen and
    ``paged_kv_write`` counts the paged writes."""
    if not cfg or not cfg.get("block_size"):
        return g, Found()
    bs = int(cfg["block_size"])
    chains: dict[int, tuple[Node, int]] = {}  # kv_cache state id -> (state, position dim; -1: none seen)
    rejected: set[int] = set()

    def claim(state: Node, dim: int) -> None:
        seen = chains[id(state)][1]
        if seen not in (-1, dim):
            rejected.add(id(state))
        chains[id(state)] = (state, dim)

    for n in g.nodes():
        if n.op == "state" and n.attr.get("zone", "kv_cache") == "kv_cache":
            chains.setdefault(id(n), (n, -1))
    for n in g.nodes():
        for k, x in enumerate(n.inputs):
            root = _cache_root(x)
            if id(root) not in chains:
                continue
            if n.op == "state_index_put" and k == 0:
                present = list(n.attr["indices"])
                if present.count(True) != 1:
                    rejected.add(id(root))
                else:
                    claim(root, present.index(True))
            elif _position_read(n, k):
                claim(root, READERS[n.op][k])
            else:
                rejected.add(id(root))
    paged = {}
    for sid, (state, dim) in chains.items():
        if sid in rejected or dim < 0 or state.shape[0] != 1 or not isinstance(state.shape[dim], int):
            continue
        paged[sid] = (state, dim)
    if not paged:
        return g, Found()
    lengths = {int(s.shape[d]) for s, d in paged.values()}
    length = max(lengths)
    paged = {k: v for k, v in paged.items() if int(v[0].shape[v[1]]) == length}
    readers = [n for n in g.nodes() if n.op in READERS]
    while True:  # a reader pages all of its cache operands or none
        mixed = [n for n in readers if len({id(_cache_root(n.inputs[k])) in paged for k in READERS[n.op]}) > 1]
        if not mixed:
            break
        for n in mixed:
            for k in READERS[n.op]:
                paged.pop(id(_cache_root(n.inputs[k])), None)
    if not paged:
        return g, Found()
    nt = -(-length // bs)
    rows: tuple = ()  # a per-token table's leading dim: the token count S
    if per_token:
        qlens = {n.inputs[READER_POSITION[n.op]].shape[0] for n in readers}
        qlens |= {n.inputs[1].shape[0] for n in g.nodes()
                  if n.op == "state_index_put" and id(_cache_root(n.inputs[0])) in paged}
        if len(qlens) != 1:
            raise InternalError("paged_kv: per-token tables, but the cache ops see token counts "
                                f"{sorted(map(str, qlens))}")
        rows = (qlens.pop(),)
    # window class of each paged state: W > 0 when every reader looks back at most W positions (sliding-window
    # attention), so blocks behind the window can be handed back while the request goes on
    windows: dict[int, set] = {sid: set() for sid in paged}
    for n in readers:
        for k in READERS[n.op]:
            sid = id(_cache_root(n.inputs[k]))
            if sid in windows:
                windows[sid].add(int(n.attr.get("window") or 0))
    cls_of = {}
    for sid, ws in windows.items():
        w = ws.pop() if len(ws) == 1 else 0
        # a window that spans (almost) the whole cache gains nothing from its own table
        cls_of[sid] = w if w and -(-w // bs) + 1 < nt else 0
    changed = True
    while changed:  # a reader takes one table: its caches share a class (the full one where they differ)
        changed = False
        for n in readers:
            sids = [id(_cache_root(n.inputs[k])) for k in READERS[n.op] if id(_cache_root(n.inputs[k])) in cls_of]
            if len({cls_of[s] for s in sids}) > 1:
                cls_of.update({s: 0 for s in sids})
                changed = True
    batch = int(cfg.get("max_batch", 1))
    full = int(cfg.get("blocks") or batch * nt + 1)
    tables, classes = {}, []
    chunk = int(cfg.get("chunk") or length)  # the most tokens one call writes (the prefill chunk)
    for w in sorted(set(cls_of.values())):
        # a windowed request holds ceil(W / bs) + 1 blocks between calls, and during a call of n <= chunk tokens
        # the W - 1 positions before it plus its own, ceil((W - 1 + chunk) / bs) + 1 (one prefill at a time; the
        # runtime trims after every chunk): (batch - 1) windows + one call's + the scratch block
        in_call = min(nt, -(-(w - 1 + chunk) // bs) + 1)
        blocks = full if w == 0 else min(full, (batch - 1) * (-(-w // bs) + 1) + in_call + 1)
        name = TABLE if w == 0 else f"{TABLE}_w{w}"
        tables[w] = (Node.make("input", (), {"name": name, "kind": BLOCK_TABLE}, (TensorType("int32", rows + (nt,)),)),
                    blocks)
        classes.append({"name": name, "window": w, "blocks": blocks,
                        "states": sorted(paged[sid][0].attr["name"] for sid, c in cls_of.items() if c == w)})
    layout = {"block_size": bs, "table_len": nt, "length": length, "tables": classes}
    tag = {"per_token": True} if per_token else {}

    new_state: dict[int, Node] = {}
    for sid, (s, d) in paged.items():
        shape = list(s.shape)
        shape[d] = tables[cls_of[sid]][1] * bs
        new_state[sid] = s.replace(attrs={**s.attr, "zone": ZONE}, types=(TensorType(s.dtype, tuple(shape)),))

    new: dict[int, Node] = {}
    count = 0
    for n in g.nodes():
        if id(n) in new_state:
            new[id(n)] = new_state[id(n)]
            continue
        ins = tuple(new[id(i)] for i in n.inputs)
        root = _cache_root(n.inputs[0]) if n.inputs else None
        if n.op == "state_index_put" and root is not None and id(root) in paged:
            _, d = paged[id(root)]
            state, idx, values = ins
            table = tables[cls_of[id(root)]][0]
            m = Node.make(WRITE, (state, idx, values, table), {"dim": d, "block_size": bs, **tag}, state.types,
                          n.span)
            count += 1
        elif n.op in READERS and any(id(_cache_root(n.inputs[k])) in paged for k in READERS[n.op]):
            table = tables[cls_of[id(_cache_root(n.inputs[next(iter(READERS[n.op]))]))]][0]
            m = n.replace(inputs=ins + (table,), attrs={**n.attr, "paged": bs, "length": length, **tag})
        else:
            m = n if all(a is b for a, b in zip(ins, n.inputs)) else n.replace(inputs=ins)
        new[id(n)] = m
    found = counted("paged_kv_write", count)
    found.kv_pages = layout
    return g.replace(inputs=tuple(new[id(i)] for i in g.inputs) + tuple(t for t, _ in tables.values()),
                     outputs=tuple(new[id(o)] for o in g.outputs)), found
