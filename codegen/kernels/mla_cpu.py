"""MLA attention (``mla_sparse_attention``, ``mla_attention``: attention.py's module docstring) on the host CPU:
the up-projection applied once per head for a block of queries, the rows in tiles (``row_tiles``).

Per block of SB queries (the batched decode step's requests, or a prefill chunk's queries SB at a time), three
parallel phases:

1. absorb, per head h:  qt[s, h, c] = scale * [sum_d q[s, h, d] W[h(Dn+Dv) + d, c]  |  q[s, h, Dn + c - R]]
   (c < R + Dr), stored heads-innermost within each group of HG heads;
2. attend, per query s and group of HG heads (``attention.mla_head_group``; a query's groups are consecutive
   tasks, so the rows it selected are read from the caches by the groups after the first): ``row_tiles.tiles``
   over its selected rows (or every row up to its position, ``mla_attention``), scores over [latent | rope_k]
   against qt, values the latent rows, into acc[s, h, :] and its denominator;
3. project, per head h:  o[s, h, d] = sum_r W[h(Dn+Dv) + Dn + d, r] acc[s, h, r] / den[s, h]

so W is read once per block of queries. The row-by-row form (``attention.build_mla_rows``, CUDA's) absorbed and
projected inside each (query, head group) task, so at 8 queries it read W 8 times, besides its per-row softmax.

Measured (``dayzero bench attention --full-width``: one full-width DeepSeek-V3.2 layer, 128 heads, latent 512,
top-k 2048, context 4096, each query its own request's rows through a shuffled table; znver3, 2 threads, AVX2;
two runs): 8 queries 61.8-65.5 ms against the row-by-row form's 255-263 ms (3.9-4.3x) and torch's absorbed
attention (bmm) 96-143 ms, 70-73% of the FLOP bound at torch's matmul rate; 1 query 11.7-11.9 ms against 35-39
ms and 17-19 ms. On the way: prefetching the next tile's rows changed nothing measurable; tiles of 16 and 32
rows were 5% slower than 8; a query's groups as consecutive tasks (rather than its neighbours' groups) took a
quarter off when the 8 queries' rows exceed the L3 cache.
"""

from __future__ import annotations

import tvm

from dayzero.codegen.cpu_rules import fast_exp
from dayzero.codegen.kernels import attention, row_tiles
from dayzero.codegen.tvmscript import from_source

SB = 16  # queries per block (phases 1-3); the workspaces hold SB x H rows of R + Dr and R floats
NEG = attention.NEG


def _i(x) -> str:
    return f"T.int64({x})"


def build(p: dict) -> tvm.tirx.PrimFunc:
    """The kernel for ``attention.mla_params`` ``p`` on the host CPU."""
    B, H, L, R, Dn, Dr, Dv, K = (p[x] for x in ("B", "H", "L", "R", "Dn", "Dr", "Dv", "K"))
    S = _i(p["S"]) if p["S"] is not None else "S"
    f32 = "T.float32"
    buf = attention.buffer
    lines = attention.header(p, "S") + [
        buf("q", "q_", (_i(B), _i(H), S, _i(Dn + Dr)), p["dtype"]),
        buf("lat", "l_", (_i(B), _i(1), _i(p.get("P", L)), _i(R)), p["lat_dtype"]),
        buf("rk", "r_", (_i(B), _i(1), _i(p.get("P", L)), _i(Dr)), p["lat_dtype"]),
        buf("w", "w_", (_i(H * (Dn + Dv)), _i(R)), p["w_dtype"]),
        buf("p", "p_", (S,), p["pos_dtype"])]
    if not p.get("dense"):
        lines.append(buf("x", "x_", (_i(B), S, _i(K)), p["idx_dtype"]))
    lines += [buf("o", "o_", (_i(B), _i(H), S, _i(Dv)), p["out_dtype"])] + attention.table_decl(p)
    HG = attention.mla_head_group(H, "llvm")
    NG = H // HG
    sb = SB if p["S"] is None else max(1, min(SB, p["S"]))
    lanes = attention.lanes_of(R)
    scale = f32 + f"({p['scale']!r})"
    if p.get("dense"):  # every row up to the query's position (and the cache's end)
        count = f'T.max(T.min(T.Cast("int64", p[s]), {_i(L - 1)}) + {_i(1)}, {_i(0)})'
        pick = ["pos = tk", "if True:"]
    else:  # the selected rows that are visible
        count = _i(K)
        pick = ['pos = T.Cast("int64", x[b, s, tk])',
                f'if pos >= {_i(0)} and pos <= T.Cast("int64", p[s]) and pos < {_i(L)}:']
    attend = [
        f"si = t // {_i(NG)}", "s = s0 + si", f"h0 = t % {_i(NG)} * {_i(HG)}",
        f'ml = T.decl_buffer(({_i(2)}, {_i(HG)}), "float32")',  # running max, denominator
        ] + row_tiles.scratch(HG) + [
        f"for hh in range({_i(HG)}):",
        f"    for r in T.vectorized({_i(R)}):",
        f"        acc[si, h0 + hh, r] = {f32}(0)",
        f"for hv in T.vectorized({_i(HG)}):",
        f"    ml[0, hv] = {NEG}",
        f"    ml[1, hv] = {f32}(0)",
        ] + row_tiles.tiles(
            count=count, pick=pick, row=attention.cache_row(p, "pos", "s"),
            scores=[('T.Cast("float32", lat[b, 0, {r}, {c}])', f"qt[si, h0 // {_i(HG)}, {{c}}, hv]", R),
                    ('T.Cast("float32", rk[b, 0, {r}, {c}])', f"qt[si, h0 // {_i(HG)}, {_i(R)} + {{c}}, hv]", Dr)],
            value=('T.Cast("float32", lat[b, 0, {r}, {c}])', R), acc="acc[si, h0 + {h}, {c}]", m="ml[0, {h}]",
            den="ml[1, {h}]", HG=HG) + [
        f"for hh in range({_i(HG)}):",
        "    den[si, h0 + hh] = ml[1, hh]"]
    absorb = [
        f'qrow = T.decl_buffer(({_i(R)},), "float32")',
        f"w0 = h * {_i(Dn + Dv)}",
        "for si in range(ns):",
        f"    for r in T.vectorized({_i(R)}):",
        f"        qrow[r] = {f32}(0)",
        f"    for d in range({_i(Dn)}):",
        f'        qd = T.Cast("float32", q[b, h, s0 + si, d]) * {scale}',
        f"        for r in T.vectorized({_i(R)}):",
        '            qrow[r] = qrow[r] + qd * T.Cast("float32", w[w0 + d, r])',
        f"    for r in range({_i(R)}):",
        f"        qt[si, h // {_i(HG)}, r, h % {_i(HG)}] = qrow[r]",
        f"    for e in range({_i(Dr)}):",
        f'        qt[si, h // {_i(HG)}, {_i(R)} + e, h % {_i(HG)}] = T.Cast("float32", q[b, h, s0 + si, {_i(Dn)} + e]) '
        f"* {scale}"]
    project = [
        f'part = T.decl_buffer(({_i(lanes)},), "float32")',
        'ov = T.decl_buffer((T.int64(1),), "float32")',
        f"w0 = h * {_i(Dn + Dv)} + {_i(Dn)}",
        "for si in range(ns):",
        f"    for d in range({_i(Dv)}):",
        ] + attention.vector_dot("ov[0]", [('T.Cast("float32", w[w0 + d, {}])', "acc[si, h, {}]", R)], lanes,
                                 "        ") + [
        f'        o[b, h, s0 + si, d] = T.Cast("{p["out_dtype"]}", ov[0] / den[si, h])']
    nsb = f"({S} + {_i(sb - 1)}) // {_i(sb)}"
    body = [f'qt = T.decl_buffer(({_i(sb)}, {_i(NG)}, {_i(R + Dr)}, {_i(HG)}), "float32")',
            f'acc = T.decl_buffer(({_i(sb)}, {_i(H)}, {_i(R)}), "float32")',
            f'den = T.decl_buffer(({_i(sb)}, {_i(H)}), "float32")',
            f"for b in range({_i(B)}):",
            f"    for sb in range({nsb}):",
            f"        s0 = sb * {_i(sb)}",
            f"        ns = T.min({_i(sb)}, {S} - s0)",
            f"        for h in T.parallel({_i(H)}):"] + ["            " + ln for ln in absorb] + [
            f"        for t in T.parallel(ns * {_i(NG)}):"] + ["            " + ln for ln in attend] + [
            f"        for h in T.parallel({_i(H)}):"] + ["            " + ln for ln in project]
    table = "bt_: T.handle, " if p.get("paged") else ""
    idx = "" if p.get("dense") else "x_: T.handle, "
    src = ("@T.prim_func\ndef main(q_: T.handle, l_: T.handle, r_: T.handle, w_: T.handle, p_: T.handle, "
           f"{idx}{table}o_: T.handle):\n" + "\n".join(lines) + "\n" + "\n".join("    " + b for b in body) + "\n")
    return fast_exp(from_source(src))
