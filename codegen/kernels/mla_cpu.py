"""MLA attention (``mla_sparse_attention``, ``mla_attention``: attention.py's module docstring) on the host CPU:
the up-projection applied once per head for a block of queries, the rows in tiles, every product register-blocked.

Per block of SB queries (the batched decode step's requests, or a prefill chunk's queries SB at a time), three
parallel phases:

1. absorb, per head h:  qt[s, h, c] = scale * [sum_d q[s, h, d] W[h(Dn+Dv) + d, c]  |  q[s, h, Dn + c - R]]
   (c < R + Dr), stored heads-innermost within each group of HG heads;
2. attend, per query s and group of HG heads (``attention.mla_head_group``; a query's groups are consecutive
   tasks, so the rows it selected are read from the caches by the groups after the first), per tile of JT
   selected rows (their cache rows first: table lookup, visibility):
       sc[j, :]  = sum_c [latent | rope_k][j, c] * qt[s, :, c]    RB rows x HG heads of accumulators (a vector
                                                                  of heads per row), each row element broadcast
       m' = max(m, max_j sc[j, :]); cr = exp(m - m'); P[j, :] = exp(sc[j, :] - m') (0 for a row not seen)
       l = l * cr + sum_j P[j, :]                                 HG heads wide, one rescale per tile
       acc[s, h, r] = acc[s, h, r] cr[h] + sum_j P[j, h] latent[j, r]   HB heads x CH features of
                                                                  accumulators, a latent chunk read once for HB heads
3. project, per head h:  o[s, h, d] = sum_r W[h(Dn+Dv) + Dn + d, r] acc[s, h, r] / l[s, h]

so W is read once per block of queries, not once per query and head group. The per-row form
(``attention.build_mla_rows``, CUDA's) absorbed and projected inside each (query, head group) task, so at 8
queries it read W 8 times, and updated its online softmax row by row: two scalar ``exp`` calls and a rescale of the
512-wide accumulator per row and head, and each score a dot product reduced across lanes. Here a tile's scores
come out as vectors over the heads (no lane reduction), the exponentials run HG-wide through
``cpu_rules.fast_exp``, and the accumulator is rescaled once a tile. The register blocks are default-scope
buffers under 1 KiB, which TVM puts on the stack, so LLVM keeps them in registers (a ``local`` buffer in a
parallel loop is a workspace pointer); ACC_FLOATS sizes them for AVX2's 16 vector registers.

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
from dayzero.codegen.kernels import attention
from dayzero.codegen.tvmscript import from_source

JT = 8  # selected rows per tile
SB = 16  # queries per block (phases 1-3); the workspaces hold SB x H rows of R + Dr and R floats
ACC_FLOATS = 64  # floats of one accumulator block: 8 AVX2 ymm registers of 16
NEG = attention.NEG


def _i(x) -> str:
    return f"T.int64({x})"


def blocks(HG: int, R: int) -> tuple[int, int, int]:
    """(RB, HB, CH): a score block's rows (RB x HG accumulators, RB dividing JT) and a value block's heads and
    features (HB x CH accumulators, HB dividing HG, CH dividing R, at least two heads where HG allows, so a
    latent chunk serves two)."""
    rb = max(1, min(8, JT, ACC_FLOATS // HG))
    while JT % rb:
        rb //= 2
    ch = next(c for c in (64, 32, 16, 8, 4, 2, 1) if R % c == 0 and c <= max(1, ACC_FLOATS // min(2, HG)))
    hb = max(1, min(HG, ACC_FLOATS // ch))
    while HG % hb:
        hb //= 2
    return rb, hb, ch


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
    RB, HB, CH = blocks(HG, R)
    lanes = attention.lanes_of(R)
    scale = f32 + f"({p['scale']!r})"
    if p.get("dense"):  # every row up to the query's position (and the cache's end)
        count = f'T.max(T.min(T.Cast("int64", p[s]), {_i(L - 1)}) + {_i(1)}, {_i(0)})'
        pick = ["pos = tk", "if True:"]
    else:  # the selected rows that are visible
        count = _i(K)
        pick = ['pos = T.Cast("int64", x[b, s, tk])',
                f'if pos >= {_i(0)} and pos <= T.Cast("int64", p[s]) and pos < {_i(L)}:']
    qt = f"qt[si, h0 // {_i(HG)}, {{c}}, hv]"  # a score block's query vector (heads hv of the task's group)
    attend = [
        f"si = t // {_i(NG)}", f"s = s0 + si", f"h0 = t % {_i(NG)} * {_i(HG)}",
        f'sc = T.decl_buffer(({_i(JT)}, {_i(HG)}), "float32")',  # a tile's scores, then probabilities
        f'ml = T.decl_buffer(({_i(4)}, {_i(HG)}), "float32")',  # max, denominator, tile max, rescale
        f'rw = T.decl_buffer(({_i(JT)},), "int64")',  # a tile's cache rows (-1: not seen)
        f"for hh in range({_i(HG)}):",
        f"    for r in T.vectorized({_i(R)}):",
        f"        acc[si, h0 + hh, r] = {f32}(0)",
        f"for hv in T.vectorized({_i(HG)}):",
        f"    ml[0, hv] = {NEG}",
        f"    ml[1, hv] = {f32}(0)",
        f"n = {count}",
        f"for tile in range((n + {_i(JT - 1)}) // {_i(JT)}):",
        f"    for jj in range({_i(JT)}):",
        f"        tk = tile * {_i(JT)} + jj",
        f"        rw[jj] = {_i(-1)}",
        "        if tk < n:",
        ] + ["            " + ln for ln in pick] + [
        f"                rw[jj] = {attention.cache_row(p, 'pos', 's')}",
        # scores: RB rows x HG heads a block
        f"    for jb in range({_i(JT // RB)}):",
        f'        sa = T.decl_buffer(({_i(RB)}, {_i(HG)}), "float32")',
        f"        for jj in T.unroll({_i(RB)}):",
        f"            for hv in T.vectorized({_i(HG)}):",
        f"                sa[jj, hv] = {f32}(0)"]
    for src, n_, off in (("lat", R, ""), ("rk", Dr, f"{_i(R)} + ")):
        attend += [
            f"        for c in range({_i(n_)}):",
            f"            for jj in T.unroll({_i(RB)}):",
            f"                for hv in T.vectorized({_i(HG)}):",
            f'                    sa[jj, hv] = sa[jj, hv] + T.Cast("float32", {src}[b, 0, '
            f'T.max(rw[jb * {_i(RB)} + jj], {_i(0)}), c]) * {qt.format(c=off + "c")}']
    attend += [
        f"        for jj in T.unroll({_i(RB)}):",
        f"            for hv in T.vectorized({_i(HG)}):",
        f"                sc[jb * {_i(RB)} + jj, hv] = T.Select(rw[jb * {_i(RB)} + jj] >= {_i(0)}, sa[jj, hv], {NEG})",
        # the tile folded into the online softmax, HG heads wide
        f"    for hv in T.vectorized({_i(HG)}):",
        "        ml[2, hv] = ml[0, hv]",
        f"    for jj in range({_i(JT)}):",
        f"        for hv in T.vectorized({_i(HG)}):",
        "            ml[2, hv] = T.max(ml[2, hv], sc[jj, hv])",
        f"    for hv in T.vectorized({_i(HG)}):",
        "        ml[3, hv] = T.exp(ml[0, hv] - ml[2, hv])",
        "        ml[1, hv] = ml[1, hv] * ml[3, hv]",
        "        ml[0, hv] = ml[2, hv]",
        f"    for jj in range({_i(JT)}):",
        f"        for hv in T.vectorized({_i(HG)}):",
        f"            sc[jj, hv] = T.Select(rw[jj] >= {_i(0)}, T.exp(sc[jj, hv] - ml[2, hv]), {f32}(0))",
        "            ml[1, hv] = ml[1, hv] + sc[jj, hv]",
        # values: HB heads x CH features a block, the latent chunk read once for the HB heads
        f"    for hb in range({_i(HG // HB)}):",
        f"        for rc in range({_i(R // CH)}):",
        f'            va = T.decl_buffer(({_i(HB)}, {_i(CH)}), "float32")',
        f"            for hi in T.unroll({_i(HB)}):",
        f"                for l in T.vectorized({_i(CH)}):",
        f"                    va[hi, l] = acc[si, h0 + hb * {_i(HB)} + hi, rc * {_i(CH)} + l] * "
        f"ml[3, hb * {_i(HB)} + hi]",
        f"            for jj in range({_i(JT)}):",
        f"                if rw[jj] >= {_i(0)}:",
        f"                    for hi in T.unroll({_i(HB)}):",
        f"                        for l in T.vectorized({_i(CH)}):",
        f"                            va[hi, l] = va[hi, l] + sc[jj, hb * {_i(HB)} + hi] * "
        f'T.Cast("float32", lat[b, 0, rw[jj], rc * {_i(CH)} + l])',
        f"            for hi in T.unroll({_i(HB)}):",
        f"                for l in T.vectorized({_i(CH)}):",
        f"                    acc[si, h0 + hb * {_i(HB)} + hi, rc * {_i(CH)} + l] = va[hi, l]",
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
