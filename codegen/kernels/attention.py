"""Attention over a KV cache that reads only the rows a query sees (ops from passes/sparse_attention.py).

    cache_attention(q [B,Hq,S,D], k [B,Hkv,L,D], v [B,Hkv,L,Dv], qpos [S], [sinks [Hq]]) -> o [B,Hq,S,Dv]
        query (b, h, s) reads rows j in [max(0, qpos[s]-W+1), min(qpos[s], L-1)] (W = window, 0: from row 0)
        of kv head g = h // (Hq/Hkv); o = sum_j softmax_j(scale * q·k_j [, sink_h]) v_j
        per_row (the row-batched decode step, S == 1, B symbolic): qpos [B], query (b, h, 0) at qpos[b];
        ring (with per_row): k/v hold the window ending at the query, row j at position qpos[b] - (L-1) + j
    sparse_attention(q, k, v, qpos [S], idx [B,S,K]) -> o [B,Hq,S,Dv]
        query (b, h, s) reads rows j = idx[b, s, t], t < K, kept where 0 <= j <= qpos[s] (and j < L); the
        indices of one query are distinct (they come from a top-k), so each row is counted once
    mla_sparse_attention(q [B,H,S,n+Dr], latent [B,1,L,R], rope_k [B,1,L,Dr], W [H*(n+Dv),R], qpos, idx) -> o
        sparse_attention over the MLA expansion K = [latent W_uk^T | rope_k], V = latent W_uv^T, computed with
        the up-projection absorbed into the query and the output (``build_mla``): O(k) per query, never O(L)
    mla_attention(q, latent, rope_k, W, qpos) -> o     the dense causal form (MLA without an indexer): rows
        [0, qpos[s]], absorbed the same way, never expanding the cache

Both are one pass of online softmax per query (running max m, denominator l, fp32 accumulator acc[Dv]), so a
decode step costs O(rows read), never O(L). Variants, chosen from the shapes and the target:

* host CPU, decode (S == 1): parallel over (b, h); one query x its rows.
* host CPU, prefill (S symbolic or > 1): parallel over (b, h, block of QB queries). cache_attention walks the
  union of the block's row ranges once and updates every query of the block that sees the row, so a K/V row
  is read once per block (blocked over queries); sparse_attention reads each query's own K rows.
* MLA on the host CPU (``mla_cpu``): the up-projection applied per head once for a block of queries, each
  (query, head group) task scoring tiles of rows as vectors over its heads; CUDA keeps the row-by-row form
  (``build_mla_rows``).
* CUDA: one thread per (b, h, s) query, 64 threads per block (compiles for sm_90; not tuned).
* per-token block tables (the batched decode step, passes/paged_kv.py): query s reads its rows through table
  row s; cache_attention then runs one query per task (qb = 1), as its queries share no row.

Written as TVMScript text (like ``state.py``): data-dependent loop bounds (qpos, idx) are plain TIR here.
"""

from __future__ import annotations

import math

import tvm

from dayzero import InternalError
from dayzero.codegen.tvmscript import from_source
from dayzero.passes.ir.node import Node

QB = 16  # queries per block (prefill, host CPU)
CUDA_THREADS = 64
NEG = "T.float32(-3.0e38)"


def params(n: Node) -> dict:
    if n.op in ("mla_sparse_attention", "mla_attention"):
        return mla_params(n)
    q, k, v, qpos = n.inputs[:4]
    B, Hq, S, D = q.shape
    _, Hkv, L, _ = k.shape
    p = {"op": n.op, "B": B if isinstance(B, int) else None, "Hq": int(Hq), "Hkv": int(Hkv),
         "S": S if isinstance(S, int) else None,
         "L": int(L), "D": int(D), "Dv": int(v.shape[-1]), "dtype": q.dtype, "out_dtype": n.dtype,
         "pos_dtype": qpos.dtype, "scale": float(n.attr["scale"])}
    if n.op == "cache_attention":
        p.update(window=int(n.attr["window"]), sinks=bool(n.attr["sinks"]),
                 sink_dtype=n.inputs[4].dtype if n.attr["sinks"] else None, per_row=bool(n.attr.get("per_row")),
                 ring=bool(n.attr.get("ring")))
    else:
        idx = n.inputs[4]
        p.update(K=int(idx.shape[-1]), idx_dtype=idx.dtype, window=0, sinks=False)
    return paged_params(n, p, k.shape[2])


def paged_params(n: Node, p: dict, rows) -> dict:
    """A paged cache operand (passes/paged_kv.py): the logical length L, the pool's rows P, the block size and
    the table (the op's last input)."""
    if n.attr.get("paged"):
        table = n.inputs[-1]
        p.update(L=int(n.attr["length"]), P=int(rows), paged=int(n.attr["paged"]),
                 NT=int(table.shape[-1]), table_dtype=table.dtype, per_token=table.type.ndim == 2)
    return p


def cache_row(p: dict, pos: str, query: str | None = None) -> str:
    """The cache row holding logical position ``pos``: itself, or ``table[pos // bs] * bs + pos % bs`` when
    the cache is paged (the table buffer is ``bt``); a per-token table [S, NT] (the batched decode step) reads
    row ``query`` of it, ``table[query, pos // bs]``."""
    if not p.get("paged"):
        return pos
    bs = _i(p["paged"])
    entry = f"({pos}) // {bs}"
    if p.get("per_token"):
        if query is None:
            raise InternalError("a per-token block table needs the query each cache row is read for")
        entry = f"{query}, {entry}"
    return f'T.Cast("int64", bt[{entry}]) * {bs} + ({pos}) % {bs}'


def window_rows(p: dict, pos: str) -> tuple[str, str]:
    """TIR (first, last) cache row a query at position ``pos`` (an int64 expression) reads: positions
    [max(0, pos-W+1), pos] (W = ``window``, 0: from position 0) at rows of the same index, up to row L-1; with
    ``ring`` (the row-batched decode step's window states, frontend/decode_export.py ``RowDecodeStep``) row j
    holds position pos - (L-1) + j, so the rows are [max(0, L-1-pos, L-W), L-1]."""
    L, W = p["L"], p["window"]
    if p.get("ring"):
        lo = f"T.max({_i(L - 1)} - {pos}, {_i(max(0, L - W) if W else 0)})"
        return lo, _i(L - 1)
    lo = f"T.max({pos} - {_i(W - 1)}, {_i(0)})" if W else _i(0)
    return lo, f"T.min({pos}, {_i(L - 1)})"


def task_loop(total: str, kind: str) -> list[str]:
    """The loop over ``total`` independent tasks ``t``: CPU threads (T.parallel) or CUDA threads, CUDA_THREADS
    per block; the kernel body goes two levels in."""
    if kind == "cuda":
        return [f'    bx = T.launch_thread("blockIdx.x", ({total} + {_i(CUDA_THREADS - 1)}) // {_i(CUDA_THREADS)})',
                f'    tx = T.launch_thread("threadIdx.x", {_i(CUDA_THREADS)})',
                f"    t = bx * {_i(CUDA_THREADS)} + tx",
                f"    if t < {total}:"]
    return [f"    for t in T.parallel({total}):"]


def table_decl(p: dict) -> list[str]:
    """The block table's match_buffer line (paged caches only)."""
    if not p.get("paged"):
        return []
    if p.get("per_token"):  # one table row per query: the query count is the kernel's S
        S = _i(p["S"]) if p["S"] is not None else "S"
        return [buffer("bt", "bt_", (S, _i(p["NT"])), p["table_dtype"])]
    return [buffer("bt", "bt_", (_i(p["NT"]),), p["table_dtype"])]


def _i(x) -> str:
    return f"T.int64({x})"


def header(p: dict, *symbolic: str) -> list[str]:
    """A kernel body's first lines: its buffers never alias, and each extent of ``symbolic`` (``S``: query rows,
    ``B``: batch rows) that ``p`` leaves open (None) is declared symbolic."""
    return ['    T.func_attr({"tirx.noalias": True})'] + [f"    {s} = T.int64()" for s in symbolic if p[s] is None]


def buffer(var: str, arg: str, shape: tuple, dtype: str) -> str:
    """One ``T.match_buffer`` line; ``shape`` holds TVMScript extents (``_i(n)``, or a symbolic name)."""
    return f'    {var} = T.match_buffer({arg}, ({", ".join(shape)}{"," if len(shape) == 1 else ""}), "{dtype}")'


def build(p: dict, kind: str = "llvm") -> tvm.tirx.PrimFunc:
    """The kernel for params ``p`` (see ``params``) on ``kind`` = "llvm" | "cuda"."""
    if p["op"] in ("mla_sparse_attention", "mla_attention"):
        return build_mla(p, kind)
    sparse = p["op"] == "sparse_attention"
    if kind != "cuda" and not sparse:
        return build_decode(p) if p["S"] == 1 or p.get("per_token") else build_prefill(p)
    Hq, Hkv, L, D, Dv = p["Hq"], p["Hkv"], p["L"], p["D"], p["Dv"]
    rep = Hq // Hkv
    S = _i(p["S"]) if p["S"] is not None else "S"
    B = _i(p["B"]) if p["B"] is not None else "B"  # symbolic: the row-batched decode step's requests
    decode = p["S"] == 1
    # per-token tables: each query reads its own request's rows, so no K/V row is shared by a block of queries
    qb = 1 if (decode or sparse or kind == "cuda" or p.get("per_token")) else QB
    f32 = "T.float32"
    params_ = (["q_", "k_", "v_", "p_"] + (["x_"] if sparse else []) + (["sk_"] if p["sinks"] else [])
               + (["bt_"] if p.get("paged") else []) + ["o_"])
    rows = p.get("P", L)  # the cache buffers' rows: L, or the pool's when paged
    lines = header(p, "S", "B") + [
        buffer("q", "q_", (B, _i(Hq), S, _i(D)), p["dtype"]),
        buffer("k", "k_", (B, _i(Hkv), _i(rows), _i(D)), p["dtype"]),
        buffer("v", "v_", (B, _i(Hkv), _i(rows), _i(Dv)), p["dtype"]),
        buffer("p", "p_", (B if p.get("per_row") else S,), p["pos_dtype"])] + table_decl(p)
    if sparse:
        lines.append(buffer("x", "x_", (B, S, _i(p["K"])), p["idx_dtype"]))
    if p["sinks"]:
        lines.append(buffer("sk", "sk_", (_i(Hq),), p["sink_dtype"]))
    lines.append(buffer("o", "o_", (B, _i(Hq), S, _i(Dv)), p["out_dtype"]))
    nqb = f"({S} + {_i(qb - 1)}) // {_i(qb)}" if qb > 1 else S
    total = f"{B} * {_i(Hq)} * ({nqb})"
    scope = ', scope="local"' if kind == "cuda" else ""
    lines += task_loop(total, kind)
    I = "        "
    body = [f"b = t // {_i(Hq)} // ({nqb})", f"h = t // ({nqb}) % {_i(Hq)}", f"s0 = t % ({nqb}) * {_i(qb)}",
            f"g = h // {_i(rep)}",
            f'm = T.decl_buffer(({_i(qb)},), "float32"{scope})',
            f'den = T.decl_buffer(({_i(qb)},), "float32"{scope})',
            f'acc = T.decl_buffer(({_i(qb)}, {_i(Dv)}), "float32"{scope})',
            f'qf = T.decl_buffer(({_i(qb)}, {_i(D)}), "float32"{scope})',
            f'sc = T.decl_buffer(({_i(1)},), "float32"{scope})',
            f'rng = T.decl_buffer(({_i(2)},), "int64"{scope})',
            f"for i in range({_i(qb)}):",
            f"    m[i] = {NEG}",
            f"    den[i] = {f32}(0)",
            f"    for d in range({_i(Dv)}):",
            f"        acc[i, d] = {f32}(0)",
            f"    for d in range({_i(D)}):",
            f'        qf[i, d] = T.if_then_else(s0 + i < {S}, T.Cast("float32", q[b, h, T.min(s0 + i, {S} - {_i(1)}), d]) * {f32}({p["scale"]!r}), {f32}(0))']

    def update(pos: str, i: str, ind: str) -> list[str]:
        return [ind + f"row = {cache_row(p, pos, 's0 + ' + i)}",
                ind + f"sc[0] = {f32}(0)",
                ind + f"for d in range({_i(D)}):",
                ind + f'    sc[0] = sc[0] + qf[{i}, d] * T.Cast("float32", k[b, g, row, d])',
                ind + f"mn = T.max(m[{i}], sc[0])",
                ind + f"corr = T.exp(m[{i}] - mn)",
                ind + "e = T.exp(sc[0] - mn)",
                ind + f"den[{i}] = den[{i}] * corr + e",
                ind + f"for d in range({_i(Dv)}):",
                ind + f'    acc[{i}, d] = acc[{i}, d] * corr + e * T.Cast("float32", v[b, g, row, d])',
                ind + f"m[{i}] = mn"]

    if sparse:
        body += [f"if s0 < {S}:",
                 f"    for tk in range({_i(p['K'])}):",
                 '        pos = T.Cast("int64", x[b, s0, tk])',
                 f'        if pos >= {_i(0)} and pos <= T.Cast("int64", p[s0]) and pos < {_i(L)}:']
        body += update("pos", "0", "            ")
    else:
        # a query's position: per query, or per batch row (per_row: one query a row)
        at = "b" if p.get("per_row") else f"T.min(s0 + i, {S} - {_i(1)})"
        lo_q, hi_q = window_rows(p, f'T.Cast("int64", p[{at}])')
        body += [f"rng[0] = {_i(L)}", f"rng[1] = {_i(-1)}",
                 f"for i in range({_i(qb)}):",
                 f"    if s0 + i < {S}:",
                 f"        rng[0] = T.min(rng[0], {lo_q})",
                 f"        rng[1] = T.max(rng[1], {hi_q})",
                 f"for j in range(T.max(rng[1] - rng[0] + {_i(1)}, {_i(0)})):",
                 "    pos = rng[0] + j"]
        if qb == 1:
            cond = f'pos >= {lo_q} and pos <= {hi_q}'.replace("s0 + i", "s0")
            body += [f"    if {cond}:"]
            body += update("pos", "0", "        ")
        else:
            body += [f"    for i in range({_i(qb)}):",
                     f"        if s0 + i < {S} and pos >= {lo_q} and pos <= {hi_q}:"]
            body += update("pos", "i", "            ")
    body += [f"for i in range({_i(qb)}):",
             f"    if s0 + i < {S}:"]
    if p["sinks"]:
        body += ['        snk = T.Cast("float32", sk[h])',
                 "        mn = T.max(m[i], snk)",
                 "        corr = T.exp(m[i] - mn)",
                 "        den[i] = den[i] * corr + T.exp(snk - mn)",
                 f"        for d in range({_i(Dv)}):",
                 "            acc[i, d] = acc[i, d] * corr"]
    body += [f"        for d in range({_i(Dv)}):",
             f'            o[b, h, s0 + i, d] = T.Cast("{p["out_dtype"]}", acc[i, d] / den[i])']
    ind = I + ("    " if kind == "cuda" else "")
    src = ("@T.prim_func\ndef main(" + ", ".join(x + ": T.handle" for x in params_) + "):\n"
           + "\n".join(lines) + "\n" + "\n".join(ind + b for b in body) + "\n")
    return from_source(src)


DECODE_ROWS = 16  # cache rows per block of the decode kernel (one vector of scores per head)


def lanes_of(n: int) -> int:
    """The widest vector (16, 8, 4, 2 or 1 fp32 lanes) dividing ``n``."""
    return next(v for v in (16, 8, 4, 2, 1) if n % v == 0)


def _dense_signature(p: dict) -> tuple[str, str, list[str], list[str]]:
    """(S, B, parameter names, their declaration lines) of the blocked cache_attention kernels (``build_decode``,
    ``build_prefill``): q, k, v, the positions (one a query, or one a batch row: per_row), [sinks], [the block
    table], o; S and B their TVMScript extents (symbolic names where ``p`` leaves them open)."""
    Hq, Hkv, D, Dv = p["Hq"], p["Hkv"], p["D"], p["Dv"]
    S = _i(p["S"]) if p["S"] is not None else "S"
    B = _i(p["B"]) if p["B"] is not None else "B"
    rows = p.get("P", p["L"])
    names = ["q_", "k_", "v_", "p_"] + (["sk_"] if p["sinks"] else []) + (["bt_"] if p.get("paged") else []) + ["o_"]
    lines = header(p, "S", "B") + [
        buffer("q", "q_", (B, _i(Hq), S, _i(D)), p["dtype"]),
        buffer("k", "k_", (B, _i(Hkv), _i(rows), _i(D)), p["dtype"]),
        buffer("v", "v_", (B, _i(Hkv), _i(rows), _i(Dv)), p["dtype"]),
        buffer("p", "p_", (B if p.get("per_row") else S,), p["pos_dtype"])] + table_decl(p)
    if p["sinks"]:
        lines.append(buffer("sk", "sk_", (_i(Hq),), p["sink_dtype"]))
    return S, B, names, lines + [buffer("o", "o_", (B, _i(Hq), S, _i(Dv)), p["out_dtype"])]


def _finish(p: dict, u: str, s: str, ind: str) -> list[str]:
    """The blocked kernels' last lines for query head ``u`` (head h, query row ``s``): the sink logit folded into
    the denominator (sinks), then o = acc / den."""
    Dv = _i(p["Dv"])
    out = []
    if p["sinks"]:
        out += ['snk = T.Cast("float32", sk[h])', f"mn = T.max(m[{u}], snk)", f"corr = T.exp(m[{u}] - mn)",
                f"den[{u}] = den[{u}] * corr + T.exp(snk - mn)", f"for d in T.vectorized({Dv}):",
                f"    acc[{u}, d] = acc[{u}, d] * corr"]
    out += [f"for d in range({Dv}):", f'    o[b, h, {s}, d] = T.Cast("{p["out_dtype"]}", acc[{u}, d] / den[{u}])']
    return [ind + x for x in out]


def _blocked_kernel(p: dict, params_: list[str], lines: list[str], body: list[str]) -> tvm.tirx.PrimFunc:
    """The PrimFunc of a blocked kernel's declaration ``lines`` and task ``body``, every exp as fast_exp."""
    from dayzero.codegen.cpu_rules import fast_exp

    src = ("@T.prim_func\ndef main(" + ", ".join(x + ": T.handle" for x in params_) + "):\n"
           + "\n".join(lines) + "\n" + "\n".join("        " + x for x in body) + "\n")
    return fast_exp(from_source(src))


def build_decode(p: dict) -> tvm.tirx.PrimFunc:
    """cache_attention for one query a task, host CPU (decode: S == 1, the row-batched step's per-row queries,
    or the batched step's per-token tables): a task is a (b, kv head g, query s) and runs the query of each of
    the group's rep = Hq / Hkv heads, so every K/V row is read once for all of them; the rows go in blocks of
    DECODE_ROWS (flash-decoding's blocked online softmax)::

        for each block of rows j0 .. j0 + 15 in [lo, hi]:
            sc[hh, jj] = q_hh . k[row(j0 + jj)]           D-vectors, one halving tree of adds per score
            mn = max(m[hh], max_jj sc[hh, jj]);  corr = exp(m[hh] - mn)       once per block and head
            pr[hh, :] = exp(sc[hh, :] - mn)               one 16-lane fast_exp per block and head
            den[hh] = den[hh] corr + sum pr[hh, :];  acc[hh, :] = acc[hh, :] corr + sum_jj pr[hh, jj] v[row]

    Rows past the block's end are never read (their scores are set to the lowest float). The one-row-at-a-time
    form it replaces ran a scalar chain of D dependent FMAs and two scalar ``expf`` per row and head: at
    gpt-oss-20b width (64 heads of 64, 8 KV heads) a full-attention layer at 4000 tokens took 7.9 ms."""
    Hq, Hkv, L, D, Dv = p["Hq"], p["Hkv"], p["L"], p["D"], p["Dv"]
    rep, RB, DL = Hq // Hkv, DECODE_ROWS, lanes_of(D)
    S, B, params_, lines = _dense_signature(p)
    f32 = "T.float32"
    lines += task_loop(f"{B} * {_i(Hkv)} * {S}", "llvm")
    at = "b" if p.get("per_row") else "s"
    lo, hi = window_rows(p, f'T.Cast("int64", p[{at}])')
    row = cache_row(p, "j0 + jj", "s")
    body = [f"b = t // {_i(Hkv)} // {S}", f"g = t // {S} % {_i(Hkv)}", f"s = t % {S}",
            f'm = T.decl_buffer(({_i(rep)},), "float32")',
            f'den = T.decl_buffer(({_i(rep)},), "float32")',
            f'acc = T.decl_buffer(({_i(rep)}, {_i(Dv)}), "float32")',
            f'qf = T.decl_buffer(({_i(rep)}, {_i(D)}), "float32")',
            f'sc = T.decl_buffer(({_i(rep)}, {_i(RB)}), "float32")',
            f'part = T.decl_buffer(({_i(DL)},), "float32")',
            f'lo = T.decl_buffer(({_i(2)},), "int64")',
            f"lo[0] = {lo}",
            f"lo[1] = T.max({hi} - lo[0] + {_i(1)}, {_i(0)})",  # rows to read
            f"for hh in range({_i(rep)}):",
            f"    m[hh] = {NEG}",
            f"    den[hh] = {f32}(0)",
            f"    for d in T.vectorized({_i(Dv)}):",
            f"        acc[hh, d] = {f32}(0)",
            f"    for d in T.vectorized({_i(D)}):",
            f'        qf[hh, d] = T.Cast("float32", q[b, g * {_i(rep)} + hh, s, d]) * {f32}({p["scale"]!r})',
            f"for jb in range((lo[1] + {_i(RB - 1)}) // {_i(RB)}):",
            f"    j0 = lo[0] + jb * {_i(RB)}",
            f"    for jj in range({_i(RB)}):",
            f"        if jb * {_i(RB)} + jj < lo[1]:",
            f"            row = {row}",
            f"            for hh in range({_i(rep)}):",
            ] + vector_dot("sc[hh, jj]", [("qf[hh, {}]", 'T.Cast("float32", k[b, g, row, {}])', D)], DL,
                           "                ") + [
             "        else:",
             f"            for hh in range({_i(rep)}):",
             f"                sc[hh, jj] = {NEG}",
             f"    for hh in range({_i(rep)}):",
             "        mx = T.decl_buffer((1,), \"float32\")",
             "        mx[0] = m[hh]",
             f"        for jj in range({_i(RB)}):",
             "            mx[0] = T.max(mx[0], sc[hh, jj])",
             "        corr = T.exp(m[hh] - mx[0])",
             "        m[hh] = mx[0]",
             f"        for jj in T.vectorized({_i(RB)}):",
             "            sc[hh, jj] = T.exp(sc[hh, jj] - mx[0])",
             "        den[hh] = den[hh] * corr",
             f"        for jj in range({_i(RB)}):",
             "            den[hh] = den[hh] + sc[hh, jj]",
             f"        for d in T.vectorized({_i(Dv)}):",
             "            acc[hh, d] = acc[hh, d] * corr",
             f"    for jj in range({_i(RB)}):",
             f"        if jb * {_i(RB)} + jj < lo[1]:",
             f"            row = {row}",
             f"            for hh in range({_i(rep)}):",
             f"                for d in T.vectorized({_i(Dv)}):",
             '                    acc[hh, d] = acc[hh, d] + sc[hh, jj] * T.Cast("float32", v[b, g, row, d])',
             f"for hh in range({_i(rep)}):",
             f"    h = g * {_i(rep)} + hh"]
    return _blocked_kernel(p, params_, lines, body + _finish(p, "hh", "s", "    "))


PREFILL_QUERY_HEADS = 32  # query heads x queries per task of the prefill kernel (its tiles stay in L1)


def build_prefill(p: dict) -> tvm.tirx.PrimFunc:
    """cache_attention for blocks of queries, host CPU (prefill: S symbolic or > 1, one block table): a task is a
    (b, kv head g, block of QB queries) and runs the QB x rep query heads that read the group's rows (QB =
    PREFILL_QUERY_HEADS / rep), over the union of their row ranges in blocks of DECODE_ROWS rows::

        for each block of 16 rows j0 .. j0 + 15:
            kt[d, jj] = k[row(j0 + jj), d]                      the block's keys, transposed once for every query
            sc[u, :] = sum_d qf[u, d] * kt[d, :]                16 scores of query head u a vector: D FMAs
            sc[u, jj] = lowest float where row j0 + jj is not visible to u's query (causal, window)
            blocked online softmax as in ``build_decode``; pr = 0 for rows u may not see
            acc[u, :] += sum_jj pr[u, jj] v[row(j0 + jj), :]    acc[u] in registers across the block's rows

    The query-at-a-time form it replaces ran a scalar chain of D FMAs and two scalar ``expf`` per row, query and
    head: gpt-oss-20b dims (64 heads, 8 KV heads, D 64), 512 queries from position 0: 275 ms a full-attention
    layer (7.8 GFLOP/s)."""
    Hq, Hkv, L, D, Dv = p["Hq"], p["Hkv"], p["L"], p["D"], p["Dv"]
    rep, RB = Hq // Hkv, DECODE_ROWS
    QB = max(1, PREFILL_QUERY_HEADS // rep)
    U = QB * rep  # query heads a task: u = i * rep + hh
    UB = next(v for v in (8, 4, 2, 1) if U % v == 0)
    S, B, params_, lines = _dense_signature(p)
    f32 = "T.float32"
    nqb = f"({S} + {_i(QB - 1)}) // {_i(QB)}"
    lines += task_loop(f"{B} * {_i(Hkv)} * ({nqb})", "llvm")
    W = p["window"]
    if p.get("ring"):
        raise InternalError("cache_attention: window-ring rows (ring) are the row-batched decode step's, one query")

    def lo(i):
        return f'T.max(T.Cast("int64", p[T.min(s0 + {i}, {S} - {_i(1)})]) - {_i(W - 1)}, {_i(0)})' if W else _i(0)

    def hi(i):
        return f'T.min(T.Cast("int64", p[T.min(s0 + {i}, {S} - {_i(1)})]), {_i(L - 1)})'

    body = [f"b = t // {_i(Hkv)} // ({nqb})", f"g = t // ({nqb}) % {_i(Hkv)}", f"s0 = t % ({nqb}) * {_i(QB)}",
            f'm = T.decl_buffer(({_i(U)},), "float32")',
            f'den = T.decl_buffer(({_i(U)},), "float32")',
            f'acc = T.decl_buffer(({_i(U)}, {_i(Dv)}), "float32")',
            f'qf = T.decl_buffer(({_i(U)}, {_i(D)}), "float32")',
            f'sc = T.decl_buffer(({_i(U)}, {_i(RB)}), "float32")',
            f'kt = T.decl_buffer(({_i(D)}, {_i(RB)}), "float32")',
            f'ri = T.decl_buffer(({_i(RB)},), "int64")',
            f'qr = T.decl_buffer(({_i(QB)}, {_i(2)}), "int64")',  # each query's rows [lo, hi]
            f'rng = T.decl_buffer(({_i(3)},), "int64")',  # the task's first row, its row count, a block's rows
            f"rng[0] = {_i(L)}",
            f"rng[1] = {_i(-1)}",
            f"for i in range({_i(QB)}):",
            f"    qr[i, 0] = {lo('i')}",
            f"    qr[i, 1] = T.if_then_else(s0 + i < {S}, {hi('i')}, {_i(-1)})",
            f"    if s0 + i < {S}:",
            "        rng[0] = T.min(rng[0], qr[i, 0])",
            "        rng[1] = T.max(rng[1], qr[i, 1])",
            f"    for hh in range({_i(rep)}):",
            f"        m[i * {_i(rep)} + hh] = {NEG}",
            f"        den[i * {_i(rep)} + hh] = {f32}(0)",
            f"        for d in T.vectorized({_i(Dv)}):",
            f"            acc[i * {_i(rep)} + hh, d] = {f32}(0)",
            f"        for d in T.vectorized({_i(D)}):",
            f"            qf[i * {_i(rep)} + hh, d] = T.if_then_else(s0 + i < {S}, T.Cast(\"float32\", "
            f"q[b, g * {_i(rep)} + hh, T.min(s0 + i, {S} - {_i(1)}), d]) * {f32}({p['scale']!r}), {f32}(0))",
            f"rng[1] = T.max(rng[1] - rng[0] + {_i(1)}, {_i(0)})",
            f"for jb in range((rng[1] + {_i(RB - 1)}) // {_i(RB)}):",
            f"    j0 = rng[0] + jb * {_i(RB)}",
            f"    rng[2] = T.min(rng[1] - jb * {_i(RB)}, {_i(RB)})",
            f"    for jj in range({_i(RB)}):",
            f"        ri[jj] = T.if_then_else(jj < rng[2], {cache_row(p, 'j0 + jj')}, {_i(0)})",
            f"        for d in range({_i(D)}):",
            f'            kt[d, jj] = T.if_then_else(jj < rng[2], T.Cast("float32", k[b, g, ri[jj], d]), {f32}(0))',
            f"    for ub in range({_i(U // UB)}):",  # UB query heads' score vectors at once: independent FMA chains
            f"        for uu, jj in T.grid({_i(UB)}, {_i(RB)}):",
            f"            sc[ub * {_i(UB)} + uu, jj] = {f32}(0)",
            f"        for d in range({_i(D)}):",
            f"            for uu in T.unroll({_i(UB)}):",
            f"                for jj in T.vectorized({_i(RB)}):",
            f"                    sc[ub * {_i(UB)} + uu, jj] = sc[ub * {_i(UB)} + uu, jj]"
            f" + qf[ub * {_i(UB)} + uu, d] * kt[d, jj]",
            f"    for u in range({_i(U)}):",
            f"        i = u // {_i(rep)}",
            f"        for jj in T.vectorized({_i(RB)}):",
            f"            sc[u, jj] = T.if_then_else(j0 + jj >= qr[i, 0] and j0 + jj <= qr[i, 1], sc[u, jj], {NEG})",
            '        mx = T.decl_buffer((1,), "float32")',
            "        mx[0] = m[u]",
            f"        for jj in range({_i(RB)}):",
            "            mx[0] = T.max(mx[0], sc[u, jj])",
            "        corr = T.exp(m[u] - mx[0])",
            "        m[u] = mx[0]",
            f"        for jj in T.vectorized({_i(RB)}):",
            f"            sc[u, jj] = T.if_then_else(j0 + jj >= qr[i, 0] and j0 + jj <= qr[i, 1],"
            f" T.exp(sc[u, jj] - mx[0]), {f32}(0))",
            "        den[u] = den[u] * corr",
            f"        for jj in range({_i(RB)}):",
            "            den[u] = den[u] + sc[u, jj]",
            f"        for d in T.vectorized({_i(Dv)}):",
            "            acc[u, d] = acc[u, d] * corr",
            f"        for jj in range(rng[2]):",
            f"            for d in T.vectorized({_i(Dv)}):",
            '                acc[u, d] = acc[u, d] + sc[u, jj] * T.Cast("float32", v[b, g, ri[jj], d])',
            f"for i in range({_i(QB)}):",
            f"    if s0 + i < {S}:",
            f"        for hh in range({_i(rep)}):",
            f"            u = i * {_i(rep)} + hh",
            f"            h = g * {_i(rep)} + hh"]
    return _blocked_kernel(p, params_, lines, body + _finish(p, "u", "s0 + i", "            "))


def vector_dot(out: str, terms: list, lanes: int, ind: str) -> list[str]:
    """TVMScript lines setting ``out`` to sum over ``terms`` (a, b, n) of sum_{i < n} a(i) * b(i) (a, b format strings
    taking the index) in ``lanes`` partial sums (a vector) over i, summed at the end by a halving tree of vector adds:
    a scalar loop would run n dependent FMAs. Needs the buffer ``part`` of ``lanes`` floats (``lanes`` divides
    every n; 1: the plain scalar loop, CUDA)."""
    if lanes == 1:
        lines = [ind + f"{out} = T.float32(0)"]
        for a, b, n in terms:
            lines += [ind + f"for ii in range({_i(n)}):",
                      ind + f"    {out} = {out} + {a.format('ii')} * {b.format('ii')}"]
        return lines
    lines = [ind + f"for l in T.vectorized({_i(lanes)}):", ind + "    part[l] = T.float32(0)"]
    for a, b, n in terms:
        i = f"io * {_i(lanes)} + l"
        lines += [ind + f"for io in range({_i(n // lanes)}):",
                  ind + f"    for l in T.vectorized({_i(lanes)}):",
                  ind + f"        part[l] = part[l] + {a.format(i)} * {b.format(i)}"]
    w = lanes
    while w > 2:
        w //= 2
        lines += [ind + f"for l in T.vectorized({_i(w)}):", ind + f"    part[l] = part[l] + part[l + {_i(w)}]"]
    return lines + [ind + f"{out} = part[0] + part[1]"]


def mla_params(n: Node) -> dict:
    """mla_sparse_attention (rows idx[b, s, :]) or mla_attention (dense: every row <= qpos[s])."""
    dense = n.op == "mla_attention"
    q, lat, rope, w, qpos = n.inputs[:5]
    idx = None if dense else n.inputs[5]
    B, H, S, Dqk = q.shape
    L, R = lat.shape[2], lat.shape[3]
    nope = int(n.attr["nope"])
    return paged_params(n, {
        "op": n.op, "B": int(B), "H": int(H), "S": S if isinstance(S, int) else None, "L": int(L), "R": int(R),
        "Dn": nope, "Dr": int(Dqk) - nope, "Dv": int(w.shape[0]) // int(H) - nope, "dense": dense,
        "K": 0 if dense else int(idx.shape[-1]), "dtype": q.dtype, "lat_dtype": lat.dtype, "w_dtype": w.dtype,
        "out_dtype": n.dtype, "pos_dtype": qpos.dtype, "idx_dtype": None if dense else idx.dtype,
        "scale": float(n.attr["scale"])}, L)


MLA_TASKS = 8  # parallel tasks a decode query's heads are split into (head groups), CPU


def mla_head_group(H: int, kind: str) -> int:
    """Heads per task: every head of a DSA query reads the same selected latent rows, so a task handles a group
    of heads and reads each row once for all of them (as FlashMLA batches heads); groups are powers of two that
    divide H, leaving at least MLA_TASKS tasks per query on the CPU. CUDA: one thread per head."""
    g = 1
    while kind != "cuda" and H % (2 * g) == 0 and H // (2 * g) >= MLA_TASKS:
        g *= 2
    return g


def build_mla(p: dict, kind: str = "llvm") -> tvm.tirx.PrimFunc:
    """MLA attention: in row tiles on the host CPU (``mla_cpu``), row by row on CUDA (``build_mla_rows``)."""
    if kind != "cuda":
        from dayzero.codegen.kernels import mla_cpu

        return mla_cpu.build(p)
    return build_mla_rows(p, kind)


def build_mla_rows(p: dict, kind: str = "llvm") -> tvm.tirx.PrimFunc:
    """MLA sparse attention with the up-projection absorbed (see the module docstring): per query (b, h, s)

        qa[r]  = scale * sum_d q[d] W[h(Dn+Dv) + d, r]               (d < Dn: the no-rope part, absorbed)
        s_j    = qa · latent[j] + scale * q[Dn:] · rope_k[j]          for the selected rows j
        acc[r] = sum_j softmax_j(s_j) latent[j, r]                    (online softmax, one pass over the rows)
        o[d]   = sum_r W[h(Dn+Dv) + Dn + d, r] acc[r]                 (the value up-projection, once)

    CPU: parallel over (b, head group, s), each selected row read once per group (mla_head_group); CUDA: one
    thread per (b, h, s)."""
    B, H, L, R, Dn, Dr, Dv, K = (p[x] for x in ("B", "H", "L", "R", "Dn", "Dr", "Dv", "K"))
    rows = p.get("P", L)
    S = _i(p["S"]) if p["S"] is not None else "S"
    f32 = "T.float32"
    scope = ', scope="local"' if kind == "cuda" else ""
    lines = header(p, "S") + [
        buffer("q", "q_", (_i(B), _i(H), S, _i(Dn + Dr)), p["dtype"]),
        buffer("lat", "l_", (_i(B), _i(1), _i(rows), _i(R)), p["lat_dtype"]),
        buffer("rk", "r_", (_i(B), _i(1), _i(rows), _i(Dr)), p["lat_dtype"]),
        buffer("w", "w_", (_i(H * (Dn + Dv)), _i(R)), p["w_dtype"]),
        buffer("p", "p_", (S,), p["pos_dtype"])]
    if not p.get("dense"):
        lines.append(buffer("x", "x_", (_i(B), S, _i(K)), p["idx_dtype"]))
    lines += [buffer("o", "o_", (_i(B), _i(H), S, _i(Dv)), p["out_dtype"])] + table_decl(p)
    HG = mla_head_group(H, kind)
    DL = lanes_of(math.gcd(R, Dr)) if kind != "cuda" else 1  # the score's lanes (one width for latent and rope)
    NG = H // HG
    total = f"{_i(B * NG)} * {S}"
    lines += task_loop(total, kind)
    sc = p["scale"]
    if p.get("dense"):  # mla_attention: every row up to the query's position
        select = [f'for tk in range(T.max(T.min(T.Cast("int64", p[s]), {_i(L - 1)}) + {_i(1)}, {_i(0)})):',
                  "    pos = tk",
                  f"    if pos >= {_i(0)}:"]
    else:  # mla_sparse_attention: the selected rows that are visible
        select = [f"for tk in range({_i(K)}):",
                  '    pos = T.Cast("int64", x[b, s, tk])',
                  f'    if pos >= {_i(0)} and pos <= T.Cast("int64", p[s]) and pos < {_i(L)}:']
    body = [f"b = t // {_i(NG)} // {S}", f"h0 = t // {S} % {_i(NG)} * {_i(HG)}", f"s = t % {S}",
            f'qa = T.decl_buffer(({_i(HG)}, {_i(R)}), "float32"{scope})',
            f'qr = T.decl_buffer(({_i(HG)}, {_i(Dr)}), "float32"{scope})',
            f'acc = T.decl_buffer(({_i(HG)}, {_i(R)}), "float32"{scope})',
            f'st = T.decl_buffer(({_i(HG)}, {_i(3)}), "float32"{scope})',  # running max, denominator, score
            f'part = T.decl_buffer(({_i(max(DL, lanes_of(R)) if kind != "cuda" else 1)},), "float32"{scope})',
            f"for hh in range({_i(HG)}):",
            f"    w0 = (h0 + hh) * {_i(Dn + Dv)}",
            f"    for r in range({_i(R)}):",
            f"        qa[hh, r] = {f32}(0)",
            f"        acc[hh, r] = {f32}(0)",
            f"    for d in range({_i(Dn)}):",
            f'        qd = T.Cast("float32", q[b, h0 + hh, s, d]) * {f32}({sc!r})',
            f"        for r in range({_i(R)}):",
            '            qa[hh, r] = qa[hh, r] + qd * T.Cast("float32", w[w0 + d, r])',
            f"    for e in range({_i(Dr)}):",
            f'        qr[hh, e] = T.Cast("float32", q[b, h0 + hh, s, {_i(Dn)} + e]) * {f32}({sc!r})',
            f"    st[hh, 0] = {NEG}",
            f"    st[hh, 1] = {f32}(0)",
            ] + select + [
            f"        row = {cache_row(p, 'pos', 's')}",
            f"        for hh in range({_i(HG)}):",  # the row is read from memory once for the group
            ] + vector_dot("st[hh, 2]", [("qa[hh, {}]", 'T.Cast("float32", lat[b, 0, row, {}])', R),
                                          ("qr[hh, {}]", 'T.Cast("float32", rk[b, 0, row, {}])', Dr)],
                            DL, "            ") + [
            "            mn = T.max(st[hh, 0], st[hh, 2])",
            "            corr = T.exp(st[hh, 0] - mn)",
            "            ex = T.exp(st[hh, 2] - mn)",
            "            st[hh, 1] = st[hh, 1] * corr + ex",
            f"            for r in {'range' if kind == 'cuda' else 'T.vectorized'}({_i(R)}):",
            '                acc[hh, r] = acc[hh, r] * corr + ex * T.Cast("float32", lat[b, 0, row, r])',
            "            st[hh, 0] = mn",
            f"for hh in range({_i(HG)}):",
            f"    w0 = (h0 + hh) * {_i(Dn + Dv)}",
            f"    for d in range({_i(Dv)}):",
            ] + vector_dot("st[hh, 2]", [(f'T.Cast("float32", w[w0 + {_i(Dn)} + d, {{}}])', "acc[hh, {}]", R)],
                            lanes_of(R) if kind != "cuda" else 1, "        ") + [
            f'        o[b, h0 + hh, s, d] = T.Cast("{p["out_dtype"]}", st[hh, 2] / st[hh, 1])']
    ind = "        " + ("    " if kind == "cuda" else "")
    table = "bt_: T.handle, " if p.get("paged") else ""
    idx = "" if p.get("dense") else "x_: T.handle, "
    src = ("@T.prim_func\ndef main(q_: T.handle, l_: T.handle, r_: T.handle, w_: T.handle, p_: T.handle, "
           f"{idx}{table}o_: T.handle):\n" + "\n".join(lines) + "\n" + "\n".join(ind + b for b in body) + "\n")
    return from_source(src)

