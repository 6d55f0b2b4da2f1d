"""The DSA lightning indexer as one kernel: scores over the index-key cache, ReLU, weighted head sum, causal mask
and torch.topk's exact selection (op ``dsa_indexer_topk`` from passes/sparse_attention.py).

    dsa_indexer_topk(q [B,S,Hi,Di], w [B,S,Hi], keys [B,L,Di], qpos [S]) {scale, k, sorted, fill, rate}
        -> idx [B,S,k]
        score[b,s,j] = sum_h w[b,s,h] * relu(scale * q[b,s,h]·keys[b,j])   for j < (qpos[s] + 1) // rate
                     = fill (-inf)                                           otherwise
        idx[b,s]     = torch.topk(score[b,s], k, sorted=sorted).indices     (ties resolved as torch does)
    rate 1: a key per position (DeepSeek-V3.2, j <= qpos); rate R: DeepSeek-V4's compressed keys, one per R
    positions, L = max_seq / R + 1.

Only the visible key rows are read, each once. On torch's partial_sort path (k * 64 <= L, fill -inf) the top-k
reads the first max(visible, k) entries of the row only (``topk_exact.program``'s ``scan``: a -inf tail never
enters its heap), so a query costs O(its visible rows), not O(L): a decode step early in a long context, or a
prefill chunk, touches no row past its position.

Why one kernel: upstream materialises [B,S,Hi,L] per-head scores, a weighted [B,S,L] sum, a masked copy and a
generic top-k. Here each key row is read once and turned into its final score in registers, and the top-k runs on
the score row in place. The top-k is ``topk_exact``: the same libstdc++ algorithms torch.topk runs on CPU, so
the indexer keeps exactly the rows upstream keeps, ties (ReLU zeros, -inf rows) included.

Variants:
* host CPU, decode (S == 1): phase 1, parallel over (b, chunk of CHUNK key rows): a tile of JB rows is
  transposed into registers ([Di, JB]) and every head's dot products run as JB-wide vector FMAs, then ReLU and
  the weighted head sum, also JB-wide; the scores go to a workspace row (chunks past the visible rows do
  nothing). Phase 2, per (b): top-k on that row. The visible keys are streamed once.
* host CPU, prefill (S symbolic or > 1): parallel over (b, block of QB queries): each JB-row key tile is
  transposed once and used by all QB queries of the block (blocked over queries), scores into a per-block
  [QB, L] workspace, then each query's top-k. Tiles past the block's last visible row are neither read nor
  written: a causal prefill reads about half the key tiles, a chunk deep in a long context only its prefix.
* per-token block tables (the batched decode step, passes/paged_kv.py): the prefill variant with one query per
  block, its key rows read through its own table row.
* CUDA: phase 1 one thread per (b, s, j) score; phase 2 one thread per (b, s) row running the top-k
  (compiles for sm_90; not tuned: a warp-parallel radix select would be the next step).
"""

from __future__ import annotations

import math

import tvm

from dayzero.codegen.tvmscript import from_source
from dayzero.passes.ir.node import Node

from . import attention, topk_exact

OP = "dsa_indexer_topk"
JB = 16  # key rows per tile (one AVX-512 fp32 vector)
QB_PREFILL = 8  # queries per block (prefill)
CHUNK = 1024  # key rows per parallel task (decode)
CUDA_THREADS = 64


def params(n: Node) -> dict:
    q, w, keys, qpos = n.inputs[:4]
    B, S, Hi, Di = q.shape
    return attention.paged_params(n, {
            "op": OP, "B": B if isinstance(B, int) else None, "S": S if isinstance(S, int) else None,
            "per_row": bool(n.attr.get("per_row")), "Hi": int(Hi), "Di": int(Di),
            "L": int(keys.shape[1]), "K": int(n.attr["k"]), "sorted": bool(n.attr["sorted"]),
            "scale": float(n.attr["scale"]), "fill": float(n.attr["fill"]), "rate": int(n.attr.get("rate", 1)),
            "q_dtype": q.dtype, "w_dtype": w.dtype, "k_dtype": keys.dtype, "pos_dtype": qpos.dtype}, keys.shape[1])


def _i(x) -> str:
    return f"T.int64({x})"


def _f(x: float) -> str:
    if math.isinf(x) or math.isnan(x):
        return f'T.float32("{x}")'
    return f"T.float32({x!r})"


def visible(p: dict, s: str) -> str:
    """The number of key rows query ``s`` sees: (qpos[s] + 1) // rate, at most L (rows [0, visible) count); with
    ``per_row`` (one query a batch row, at qpos[b]) the row's."""
    at = "b" if p.get("per_row") else s
    return f'T.min(T.floordiv(T.Cast("int64", pp[{at}]) + T.int64(1), {_i(p.get("rate", 1))}), {_i(p["L"])})'


def prefix_only(p: dict) -> bool:
    """The top-k reads only a prefix of the row: torch's partial_sort path (k * 64 <= L) over a row whose hidden
    rows are -inf (topk_exact.program's ``scan``): max(visible, k) rows, so a query costs O(its visible rows)."""
    return p["K"] * 64 <= p["L"] and p["fill"] == float("-inf")


def _tail(p: dict, V: str, I: str, vrow: str, written: str, nv: str, scan: str) -> list[str]:
    """The rows [written, end) of row ``vrow`` hold the fill value (index j), where ``end`` is what the top-k
    reads: ``scan`` = min(L, max(nv, K)) on the prefix path (at most K rows, set here), else L."""
    L, K = p["L"], p["K"]
    fill = [f"        {V}[{vrow} * {_i(L)} + j] = {_f(p['fill'])}",
            f"        {I}[{vrow} * {_i(L)} + j] = j"]
    if prefix_only(p):
        return [f"{scan} = T.min({_i(L)}, T.max({nv}, {_i(K)}))",
                f"for t in range({_i(K)}):",
                f"    j = {written} + t",
                f"    if j < {scan}:"] + fill
    return [f"{scan} = {_i(L)}",
            f"for j in range({_i(L)}):",
            f"    if j >= {written}:"] + fill


def _topk_row(p: dict, row: str, V: str, I: str, scope: str, scan: str | None = None) -> list[str]:
    """Top-k of row ``row`` of the flat score/index workspaces ``V``/``I`` (``row * L`` offset), into o; only its
    first ``scan`` entries are read on the prefix path (``prefix_only``)."""
    L, K = p["L"], p["K"]
    text, nreg = topk_exact.tir_text(_i(L), K, p["sorted"], "", scan if prefix_only(p) else None)
    return ([f'V = T.decl_buffer(({_i(L)},), "float32", data={V}.data, elem_offset={row} * {_i(L)})',
             f'I = T.decl_buffer(({_i(L)},), "int64", data={I}.data, elem_offset={row} * {_i(L)})',
             f'r = T.decl_buffer(({_i(nreg)},), "int64"{scope})',
             f'hv = T.decl_buffer(({_i(1)},), "float32"{scope})',
             f'hv2 = T.decl_buffer(({_i(1)},), "float32"{scope})',
             f'stk = T.decl_buffer(({_i(3 * topk_exact.STACK)},), "int64"{scope})']
            + text.rstrip("\n").split("\n")
            + [f"for tk in range({_i(K)}):",
               "    o[b, s, tk] = I[tk]"])


def _tile(p: dict, S: str, qs: list[str], V: str, I: str, vrow: list[str]) -> list[str]:
    """Scores of key rows [j0, j0 + JB) for the queries (b, qs[i]) (each guarded by qs[i] < S), written to
    V[vrow[i] * L + j] / I[...] = j (the fill value past the query's visible rows). The tile is transposed into
    kt [Di, JB] once for all the queries."""
    L, Hi, Di = p["L"], p["Hi"], p["Di"]
    row = f"T.min(j0 + jj, {_i(L - 1)})" if L % JB else "j0 + jj"  # a partial last tile only when L % JB
    # a per-token table (the batched decode step) maps each query's rows differently: one query per tile then
    query = qs[0] if len(qs) == 1 else None
    out = [f"for jj in range({_i(JB)}):",
           f"    row = {attention.cache_row(p, row, query)}",
           f"    for d in range({_i(Di)}):",
           '        kt[d, jj] = T.Cast("float32", keys[b, row, d])']
    for s, vr in zip(qs, vrow):
        out += [f"if {s} < {S}:",
                f"    for jj in T.vectorized({_i(JB)}):",
                "        tot[jj] = T.float32(0)",
                f"    for h in range({_i(Hi)}):",
                f"        for jj in T.vectorized({_i(JB)}):",
                "            acc[jj] = T.float32(0)",
                f"        for d in range({_i(Di)}):",
                f'            qd = T.Cast("float32", q[b, {s}, h, d])',
                f"            for jj in T.vectorized({_i(JB)}):",
                "                acc[jj] = acc[jj] + qd * kt[d, jj]",
                f'        wh = T.Cast("float32", w[b, {s}, h])',
                f"        for jj in T.vectorized({_i(JB)}):",
                f"            tot[jj] = tot[jj] + wh * T.max(acc[jj] * {_f(p['scale'])}, T.float32(0))",
                f"    for jj in {'range' if L % JB else 'T.vectorized'}({_i(JB)}):",
                f"        if {'j0 + jj < ' + _i(L) if L % JB else 'True'}:",
                f'            {V}[{vr} * {_i(L)} + j0 + jj] = T.if_then_else(j0 + jj < {visible(p, s)}, '
                f"tot[jj], {_f(p['fill'])})",
                f"            {I}[{vr} * {_i(L)} + j0 + jj] = j0 + jj"]
    return out


def _ceil_tile(rows: str) -> str:
    """``rows`` rounded up to whole JB-row tiles: the rows the tile loops write."""
    return f"({rows} + {_i(JB - 1)}) // {_i(JB)} * {_i(JB)}"


def build(p: dict, kind: str = "llvm") -> tvm.tirx.PrimFunc:
    """The kernel for params ``p`` (see ``params``) on ``kind`` = "llvm" | "cuda"."""
    Hi, Di, L, K = p["Hi"], p["Di"], p["L"], p["K"]
    S = _i(p["S"]) if p["S"] is not None else "S"
    Bx = _i(p["B"]) if p["B"] is not None else "B"  # symbolic: the row-batched decode step's requests
    # decode's (b, chunk) tasks share one [B, L] workspace; per_row (B symbolic) takes the blocked variant, one
    # query a task with its own [L] workspace
    decode = p["S"] == 1 and not p.get("per_row")
    buf = attention.buffer
    head = attention.header(p, "S", "B") + [
        buf("q", "q_", (Bx, S, _i(Hi), _i(Di)), p["q_dtype"]),
        buf("w", "w_", (Bx, S, _i(Hi)), p["w_dtype"]),
        buf("keys", "k_", (Bx, _i(p.get("P", L)), _i(Di)), p["k_dtype"]),
        buf("pp", "p_", (Bx if p.get("per_row") else S,), p["pos_dtype"]),
        buf("o", "o_", (Bx, S, _i(K)), "int64")] + attention.table_decl(p)
    nj = (L + JB - 1) // JB
    body: list[str] = []
    if kind == "cuda":
        rows = f"{Bx} * {S}"
        body += [f'gV = T.alloc_buffer(({rows} * {_i(L)},), "float32")',
                 f'gI = T.alloc_buffer(({rows} * {_i(L)},), "int64")',
                 f"for bx in T.thread_binding(({rows} * {_i(L)} + {_i(CUDA_THREADS - 1)}) // {_i(CUDA_THREADS)}, "
                 'thread="blockIdx.x"):',
                 f'    for tx in T.thread_binding({_i(CUDA_THREADS)}, thread="threadIdx.x"):',
                 f"        t = bx * {_i(CUDA_THREADS)} + tx",
                 f"        if t < {rows} * {_i(L)}:",
                 f"            b = t // {_i(L)} // {S}",
                 f"            s = t // {_i(L)} % {S}",
                 f"            j = t % {_i(L)}",
                 '            acc = T.decl_buffer((T.int64(2),), "float32", scope="local")',
                 f"            row = {attention.cache_row(p, 'j', 's')}",
                 "            acc[0] = T.float32(0)",
                 f"            for h in range({_i(Hi)}):",
                 "                acc[1] = T.float32(0)",
                 f"                for d in range({_i(Di)}):",
                 '                    acc[1] = acc[1] + T.Cast("float32", q[b, s, h, d]) * T.Cast("float32", keys[b, row, d])',
                 f'                acc[0] = acc[0] + T.Cast("float32", w[b, s, h]) * T.max(acc[1] * {_f(p["scale"])}, '
                 "T.float32(0))",
                 f'            gV[t] = T.if_then_else(j < {visible(p, "s")}, acc[0], {_f(p["fill"])})',
                 "            gI[t] = j",
                 f"for bx in T.thread_binding(({rows} + {_i(CUDA_THREADS - 1)}) // {_i(CUDA_THREADS)}, "
                 'thread="blockIdx.x"):',
                 f'    for tx in T.thread_binding({_i(CUDA_THREADS)}, thread="threadIdx.x"):',
                 f"        row = bx * {_i(CUDA_THREADS)} + tx",
                 f"        if row < {rows}:",
                 f"            b = row // {S}",
                 f"            s = row % {S}"]
        body += ["            " + ln for ln in _topk_row(p, "row", "gV", "gI", ', scope="local"')]
    elif decode:
        B, nch = p["B"], (L + CHUNK - 1) // CHUNK
        body += [f'gV = T.alloc_buffer(({_i(B * L)},), "float32")',
                 f'gI = T.alloc_buffer(({_i(B * L)},), "int64")',
                 f"for c in T.parallel({_i(B * nch)}):",
                 f"    b = c // {_i(nch)}",
                 f'    kt = T.decl_buffer(({_i(Di)}, {_i(JB)}), "float32")',
                 f'    acc = T.decl_buffer(({_i(JB)},), "float32")',
                 f'    tot = T.decl_buffer(({_i(JB)},), "float32")',
                 f"    for jt in range({_i(min(CHUNK, nj * JB) // JB)}):",
                 f"        j0 = c % {_i(nch)} * {_i(CHUNK)} + jt * {_i(JB)}",
                 f"        if j0 < {visible(p, 'T.int64(0)')}:"]  # tiles of visible rows only
        body += ["            " + ln for ln in _tile(p, S, ["T.int64(0)"], "gV", "gI", ["b"])]
        nv = visible(p, "T.int64(0)")
        body += [f"for b in T.parallel({_i(B)}):",
                 "    s = T.int64(0)",
                 '    scan = T.decl_buffer((T.int64(1),), "int64")']
        body += ["    " + ln for ln in _tail(p, "gV", "gI", "b", f"T.min({_ceil_tile(nv)}, {_i(L)})", nv, "scan[0]")]
        body += ["    " + ln for ln in _topk_row(p, "b", "gV", "gI", "", "scan[0]")]
    else:
        # per-token tables: a key tile serves one query only; per_row: one query a row
        qb = 1 if p.get("per_token") or p.get("per_row") else QB_PREFILL
        nqb = f"({S} + {_i(qb - 1)}) // {_i(qb)}"
        body += [f"for t in T.parallel({Bx} * ({nqb})):",
                 f"    b = t // ({nqb})",
                 f"    s0 = t % ({nqb}) * {_i(qb)}",
                 f'    bV = T.decl_buffer(({_i(qb * L)},), "float32")',
                 f'    bI = T.decl_buffer(({_i(qb * L)},), "int64")',
                 f'    kt = T.decl_buffer(({_i(Di)}, {_i(JB)}), "float32")',
                 f'    acc = T.decl_buffer(({_i(JB)},), "float32")',
                 f'    tot = T.decl_buffer(({_i(JB)},), "float32")',
                 '    hi = T.decl_buffer((T.int64(1),), "int64")',  # the block's visible rows (the most)
                 '    scan = T.decl_buffer((T.int64(1),), "int64")',
                 "    hi[0] = T.int64(0)",
                 f"    for i in range({_i(qb)}):",
                 f"        if s0 + i < {S}:",
                 f"            hi[0] = T.max(hi[0], {visible(p, 's0 + i')})",
                 f"    for jt in range({_i(nj)}):",
                 f"        j0 = jt * {_i(JB)}",
                 "        if j0 < hi[0]:"]  # tiles past every query's visible rows are not read
        body += ["            " + ln for ln in _tile(p, S, [f"s0 + {_i(i)}" for i in range(qb)], "bV", "bI",
                                                   [_i(i) for i in range(qb)])]
        body += [f"    for i in range({_i(qb)}):",
                 f"        if s0 + i < {S}:",
                 "            s = s0 + i"]
        body += ["            " + ln for ln in _tail(p, "bV", "bI", "i", f"T.min({_ceil_tile('hi[0]')}, {_i(L)})",
                                                   visible(p, "s"), "scan[0]")]
        body += ["            " + ln for ln in _topk_row(p, "i", "bV", "bI", "", "scan[0]")]
    table = "bt_: T.handle, " if p.get("paged") else ""
    src = (f"@T.prim_func\ndef main(q_: T.handle, w_: T.handle, k_: T.handle, p_: T.handle, {table}o_: T.handle):\n"
           + "\n".join(head) + "\n" + "\n".join("    " + ln for ln in body) + "\n")
    return from_source(src)

