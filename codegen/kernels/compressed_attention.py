"""DeepSeek-V4 compressed attention that reads only the rows a query sees (op from passes/compressed_attention.py).

    compressed_attention(q [B,H,S,D], kv [B,Hkv,L,D], qpos [S], entries [B,Hkv,E,D], sinks [H],
                         [idx [B,S,K]], [epos [S]]) -> o [B,H,S,D]

query (b, h, s) with kv head g = h // (H/Hkv) and p = qpos[s] reads

* the sliding-window rows j in [max(0, p-W+1), min(p, L-1)] of ``kv`` (W = window; 0: from row 0); with
  ``ring`` (the row-batched decode step: ``kv`` holds the window ending at the query, row j at position
  p - (L-1) + j) the rows [max(0, L-1-p), L-1] (``attention.window_rows``),
* CSA (``idx``): the entry rows e = idx[b, s, t], t < K, kept where 0 <= e < E (the top-k indices are distinct, so
  each row counts once; upstream's -inf columns are never read),
* HCA (``epos``, rate R): the entry rows e < min((epos[s] + 1) // R, E), all of them (HCA is dense over its few
  valid entries by design),

and o = sum_r softmax_r(scale * q·x_r ; sink_h) x_r over those rows x_r (K = V: one tensor per branch), the
per-head sink logit in the denominator only (``per_row``, the row-batched decode step: S == 1, B symbolic, qpos and
epos [B], row b's query at qpos[b] and epos[b]). One pass of online softmax (running max m, denominator l, fp32
accumulator acc[D]), so a query costs O(W + K) rows (CSA) or O(W + p/R) rows (HCA), never O(L + E).

Variants, chosen from the shapes and the target:

* host CPU, decode (S == 1): parallel over (b, head group), one query x its rows.
* host CPU, prefill (S symbolic or > 1): parallel over (b, head group, block of queries); the heads of a group
  share the kv head (and, for CSA, the indices), so every row a query reads is loaded once for the whole group
  (``head_group``), and HCA's entries once for the block's queries (``query_block``).
* host CPU, the window rows and CSA's entries: per query, in tiles scored as vectors over the group's heads
  (``row_tiles``: one rescale per tile, every product register-blocked; the queries held heads-innermost, qT).
  Full-width DeepSeek-V4 (64 heads on one kv head, D 512), a decode step of 8 requests at position 3999, one
  CSA layer (128 window rows + 512 entries): 44.7 -> 8.4 ms; one HCA layer: 12.2 -> 4.35 ms (znver3, 2 threads;
  ``dayzero bench attention --full-width``, alternately against ``dayzero_rows``, the row-by-row form).
* host CPU, HCA (the only branch whose rows grow with the position, p / R of them): the entries go by tiles of
  JB, each transposed once per task and scored JB-wide by every query-head of the task, the tile folded into
  the online softmax at once (one rescale per tile, exponentials JB-wide through TOPI's vectorising fast_exp,
  cpu_rules.fast_exp, as every exp of the CPU kernel; the denominator kept per lane, summed at the end); a
  query still reads only its own valid entries into its accumulator. Tiny V4's HCA (rate 8, D 32, 4 heads) at
  position 256K, a 32-token chunk: 104 -> 14.5 ms of CPU.
* CUDA: one thread per (b, h, s) query, 64 threads per block (compiles for sm_90; not tuned).

Written as TVMScript text, like ``attention.py`` (data-dependent loop bounds are plain TIR).
"""

from __future__ import annotations


import tvm

from dayzero.codegen.cpu_rules import fast_exp
from dayzero.codegen.kernels import attention, row_tiles
from dayzero.codegen.tvmscript import from_source
from dayzero.passes.ir.node import Node

OP = "compressed_attention"
GROUP_MAX = 16  # heads per CPU prefill task at most (their accumulators live in the task's local buffers)
QH = 32  # query-heads per CPU prefill task (queries x heads of a group): an HCA tile serves them all
JB = 16  # HCA entries per tile (one AVX-512 fp32 vector)
NEG = "T.float32(-3.0e38)"


def params(n: Node) -> dict:
    """The kernel's parameters from the op node (shapes, dtypes, attrs)."""
    q, kv, qpos, ent, sinks = n.inputs[:5]
    rest = list(n.inputs[5:])
    B, H, S, D = q.shape
    p = {"op": n.op, "B": B if isinstance(B, int) else None, "H": int(H), "Hkv": int(kv.shape[1]),
         "S": S if isinstance(S, int) else None,
         "L": int(kv.shape[2]), "E": int(ent.shape[2]), "D": int(D), "dtype": q.dtype, "kv_dtype": kv.dtype,
         "ent_dtype": ent.dtype, "out_dtype": n.dtype, "pos_dtype": qpos.dtype, "sink_dtype": sinks.dtype,
         "scale": float(n.attr["scale"]), "window": int(n.attr["window"]), "rate": int(n.attr["rate"]),
         "per_row": bool(n.attr.get("per_row")), "ring": bool(n.attr.get("ring"))}
    if n.attr.get("idx"):
        idx = rest.pop(0)
        p.update(K=int(idx.shape[-1]), idx_dtype=idx.dtype)
    if n.attr.get("epos"):
        p.update(epos_dtype=rest.pop(0).dtype)
    return attention.paged_params(n, p, kv.shape[2])  # a paged K=V state (passes/paged_kv.py): the table last


def head_group(H: int, Hkv: int, kind: str) -> int:
    """Heads per task: 1 for CUDA; on the CPU the largest power of two <= GROUP_MAX that divides the heads per kv
    head (those heads read the same rows). Decode too: its HCA tiles are then transposed once for the group, not
    once per head (tiny V4 at 1M, one step's HCA: 7.4 ms of CPU per head apiece -> 3.0 ms for the group of 4)."""
    if kind == "cuda":
        return 1
    rep, g = H // Hkv, 1
    while rep % (2 * g) == 0 and 2 * g <= GROUP_MAX:
        g *= 2
    return g


def query_block(HG: int, decode: bool, kind: str) -> int:
    """Queries per task: 1 for decode and CUDA; on the CPU prefill as many as keep QH query-heads per task (an
    HCA entry tile is transposed once for all of them)."""
    return 1 if decode or kind == "cuda" else max(1, QH // HG)


def _i(x) -> str:
    return f"T.int64({x})"


def _vec(D: int, line: str) -> list[str]:
    """``line`` (feature index ``{d}``) over the D features, vectorised JB lanes at a time (serial when D does
    not split). The index is spelled out, not let-bound: a let inside a vectorised loop came out wrong."""
    if D % JB:
        return [f"for d in range({_i(D)}):", "    " + line.format(d="d")]
    return [f"for d0 in range({_i(D // JB)}):",
            f"    for d1 in T.vectorized({_i(JB)}):",
            "        " + line.format(d=f"d0 * {_i(JB)} + d1")]


def build(p: dict, kind: str = "llvm", row_by_row: bool = False) -> tvm.tirx.PrimFunc:
    """The kernel for params ``p`` (see ``params``) on ``kind`` = "llvm" | "cuda"; ``row_by_row``: the window rows
    and CSA entries one at a time on the CPU too (CUDA's form, the CPU's before ``row_tiles``: a bench baseline)."""
    H, Hkv, L, E, D = (p[x] for x in ("H", "Hkv", "L", "E", "D"))
    csa, hca = "K" in p, "epos_dtype" in p
    S = _i(p["S"]) if p["S"] is not None else "S"
    B = _i(p["B"]) if p["B"] is not None else "B"  # symbolic: the row-batched decode step's requests
    P = B if p.get("per_row") else S  # positions: one per query, or one per batch row (S == 1)
    HG = head_group(H, Hkv, kind)
    QB = query_block(HG, p["S"] == 1, kind)
    NG, rep = H // HG, H // Hkv
    NQ = f"(({S} + {_i(QB - 1)}) // {_i(QB)})"  # query blocks
    f32 = "T.float32"
    scope = ', scope="local"' if kind == "cuda" else ""
    lanes = 1 if kind == "cuda" else attention.lanes_of(D)  # a row's score: D in vector partial sums
    args = (["q_", "kv_", "p_", "en_", "sk_"] + (["x_"] if csa else []) + (["ep_"] if hca else [])
            + (["bt_"] if p.get("paged") else []) + ["o_"])
    buf = attention.buffer
    lines = attention.header(p, "S", "B") + [
        buf("q", "q_", (B, _i(H), S, _i(D)), p["dtype"]),
        buf("kv", "kv_", (B, _i(Hkv), _i(p.get("P", L)), _i(D)), p["kv_dtype"]),
        buf("p", "p_", (P,), p["pos_dtype"]),
        buf("en", "en_", (B, _i(Hkv), _i(E), _i(D)), p["ent_dtype"]),
        buf("sk", "sk_", (_i(H),), p["sink_dtype"])]
    if csa:
        lines.append(buf("x", "x_", (B, S, _i(p["K"])), p["idx_dtype"]))
    if hca:
        lines.append(buf("ep", "ep_", (P,), p["epos_dtype"]))
    lines += attention.table_decl(p)
    lines.append(buf("o", "o_", (B, _i(H), S, _i(D)), p["out_dtype"]))
    total = f"{B} * {_i(NG)} * {NQ}"
    at = "b" if p.get("per_row") else "s"  # the index of a query's position
    lines += attention.task_loop(total, kind)
    QH_ = QB * HG
    body = [f"b = t // {_i(NG)} // {NQ}", f"h0 = t // {NQ} % {_i(NG)} * {_i(HG)}", f"s0 = t % {NQ} * {_i(QB)}",
            f"g = h0 // {_i(rep)}",
            f'm = T.decl_buffer(({_i(QH_)},), "float32"{scope})',
            f'den = T.decl_buffer(({_i(QH_)},), "float32"{scope})',
            f'acc = T.decl_buffer(({_i(QH_)}, {_i(D)}), "float32"{scope})',
            f'qf = T.decl_buffer(({_i(QH_)}, {_i(D)}), "float32"{scope})',
            f'sc = T.decl_buffer(({_i(1)},), "float32"{scope})',
            f'part = T.decl_buffer(({_i(lanes)},), "float32"{scope})',
            f"for qi in range({_i(QB)}):",
            f"    for hh in range({_i(HG)}):",
            f"        m[qi * {_i(HG)} + hh] = {NEG}",
            f"        den[qi * {_i(HG)} + hh] = {f32}(0)",
            f"        for d in range({_i(D)}):",
            f"            acc[qi * {_i(HG)} + hh, d] = {f32}(0)",
            f"            qf[qi * {_i(HG)} + hh, d] = {f32}(0)",
            f"            if s0 + qi < {S}:",
            f'                qf[qi * {_i(HG)} + hh, d] = T.Cast("float32", q[b, h0 + hh, s0 + qi, d]) * '
            f'{f32}({p["scale"]!r})']

    def update(buf: str, row: str, ind: str) -> list[str]:
        """Online-softmax step of every head of query qi with the row ``buf[b, g, row, :]`` (K = V); the K=V
        state's row through the block table when it is paged."""
        i = f"qi * {_i(HG)} + hh"
        return [ind + f"r = {attention.cache_row(p, row) if buf == 'kv' else row}",
                ind + f"for hh in range({_i(HG)}):",
                ] + attention.vector_dot("sc[0]", [(f"qf[{i}, {{}}]", f'T.Cast("float32", {buf}[b, g, r, {{}}])',
                                                    D)], lanes, ind + "    ") + [
                ind + f"    mn = T.max(m[{i}], sc[0])",
                ind + f"    corr = T.exp(m[{i}] - mn)",
                ind + "    ex = T.exp(sc[0] - mn)",
                ind + f"    den[{i}] = den[{i}] * corr + ex",
                ind + f"    for d in {'range' if kind == 'cuda' else 'T.vectorized'}({_i(D)}):",
                ind + f'        acc[{i}, d] = acc[{i}, d] * corr + ex * T.Cast("float32", {buf}[b, g, r, d])',
                ind + f"    m[{i}] = mn"]

    pos = f'T.Cast("int64", p[{at}])'
    lo, hi = attention.window_rows(p, pos)
    nvalid = f'T.min(T.max((T.Cast("int64", ep[{at}]) + {_i(1)}) // {_i(p["rate"])}, {_i(0)}), {_i(E)})' \
        if hca else None
    # each query of the block: the sliding-window rows [lo, hi] of the K=V state, then CSA's selected entries
    if kind == "cuda" or row_by_row:
        rows = [f"for j in range(T.max({hi} - {lo} + {_i(1)}, {_i(0)})):"]
        rows += update("kv", f"{lo} + j", "    ")
        if csa:  # the indexer's selected entries, nothing else
            rows += [f"for tk in range({_i(p['K'])}):",
                     '    e = T.Cast("int64", x[b, s, tk])',
                     f"    if e >= {_i(0)} and e < {_i(E)}:"]
            rows += update("en", "e", "        ")
        if hca and kind == "cuda":  # every causally valid entry, one at a time
            rows += [f"for e in range({nvalid}):"]
            rows += update("en", "e", "    ")
    else:  # in tiles, the group's heads at once (row_tiles), against qT: the queries heads-innermost
        body += [f'qT = T.decl_buffer(({_i(QB)}, {_i(D)}, {_i(HG)}), "float32")'] + row_tiles.scratch(HG) + [
            f"for qi in range({_i(QB)}):",
            f"    for hh in range({_i(HG)}):",
            f"        for d in range({_i(D)}):",
            f"            qT[qi, d, hh] = qf[qi * {_i(HG)} + hh, d]"]
        state = dict(acc=f"acc[qi * {_i(HG)} + {{h}}, {{c}}]", m=f"m[qi * {_i(HG)} + {{h}}]",
                     den=f"den[qi * {_i(HG)} + {{h}}]", HG=HG)

        def src(buf: str) -> str:
            return f'T.Cast("float32", {buf}[b, g, {{r}}, {{c}}])'
        rows = row_tiles.tiles(count=f"T.max({hi} - {lo} + {_i(1)}, {_i(0)})", pick=[f"pos = {lo} + tk", "if True:"],
                               row=attention.cache_row(p, "pos"), scores=[(src("kv"), "qT[qi, {c}, hv]", D)],
                               value=(src("kv"), D), **state)
        if csa:
            rows += row_tiles.tiles(count=_i(p["K"]), pick=['pos = T.Cast("int64", x[b, s, tk])',
                                                           f"if pos >= {_i(0)} and pos < {_i(E)}:"],
                                    row="pos", scores=[(src("en"), "qT[qi, {c}, hv]", D)], value=(src("en"), D),
                                    **state)
    body += [f"for qi in range({_i(QB)}):",
             f"    if s0 + qi < {S}:",
             "        s = s0 + qi"] + ["        " + ln for ln in rows]
    if hca and kind != "cuda":
        body += _hca_tiles(p, S, QB, HG, D, at, nvalid)
    body += [f"for qi in range({_i(QB)}):",
             f"    if s0 + qi < {S}:",
             f"        for hh in range({_i(HG)}):",
             '            snk = T.Cast("float32", sk[h0 + hh])',
             f"            mn = T.max(m[qi * {_i(HG)} + hh], snk)",
             f"            corr = T.exp(m[qi * {_i(HG)} + hh] - mn)",
             f"            dn = den[qi * {_i(HG)} + hh] * corr + T.exp(snk - mn)",
             f"            for d in range({_i(D)}):",
             f'                o[b, h0 + hh, s0 + qi, d] = T.Cast("{p["out_dtype"]}", '
             f"acc[qi * {_i(HG)} + hh, d] * corr / dn)"]
    ind = "        " + ("    " if kind == "cuda" else "")
    src = ("@T.prim_func\ndef main(" + ", ".join(a + ": T.handle" for a in args) + "):\n"
           + "\n".join(lines) + "\n" + "\n".join(ind + b for b in body) + "\n")
    f = from_source(src)
    return f if kind == "cuda" else fast_exp(f)


def _hca_tiles(p: dict, S: str, QB: int, HG: int, D: int, at: str, nvalid: str) -> list[str]:
    """HCA on the CPU: the entries every query of the block sees ([0, the block's most valid)), JB at a time.
    A tile is transposed once (kt [D, JB]) for the block's QB x HG query-heads; each scores it with JB-wide
    FMAs, takes the tile's max, exponentiates JB-wide and folds the tile into its online softmax (a rescale per
    tile, not per row); rows past a query's own valid entries are masked, never read for its accumulator."""
    f32, neg = "T.float32", NEG
    i = f"qi * {_i(HG)} + hh"
    out = ['kt = T.decl_buffer((%s, %s), "float32")' % (_i(D), _i(JB)),
           f'st = T.decl_buffer(({_i(JB)},), "float32")',
           f'mx = T.decl_buffer(({_i(JB)},), "float32")',
           f'dl = T.decl_buffer(({_i(QB * HG)}, {_i(JB)}), "float32")',  # denominators per lane
           'hv = T.decl_buffer((T.int64(3),), "float32")',  # the new max, (unused), the rescale
           'hi = T.decl_buffer((T.int64(1),), "int64")',
           "hi[0] = T.int64(0)",
           f"for qi in range({_i(QB * HG)}):",
           f"    for jj in T.vectorized({_i(JB)}):",
           f"        dl[qi, jj] = {f32}(0)",
           f"for qi in range({_i(QB)}):",
           f"    if s0 + qi < {S}:",
           "        s = s0 + qi",
           f"        hi[0] = T.max(hi[0], {nvalid})",
           f"for et in range((hi[0] + {_i(JB - 1)}) // {_i(JB)}):",
           f"    e0 = et * {_i(JB)}",
           f"    for jj in range(T.min({_i(JB)}, hi[0] - e0)):",
           f"        for d in range({_i(D)}):",
           '            kt[d, jj] = T.Cast("float32", en[b, g, e0 + jj, d])',
           f"    for qi in range({_i(QB)}):",
           f"        if s0 + qi < {S}:",
           "            s = s0 + qi",
           f"            nv = {nvalid}",
           "            if e0 < nv:",
           f"                for hh in range({_i(HG)}):",
           f"                    for jj in T.vectorized({_i(JB)}):",
           f"                        st[jj] = {f32}(0)",
           f"                    for d in {'T.unroll' if D <= 64 else 'range'}({_i(D)}):",  # st stays in registers
           f"                        qd = qf[{i}, d]",
           f"                        for jj in T.vectorized({_i(JB)}):",
           "                            st[jj] = st[jj] + qd * kt[d, jj]",
           f"                    for jj in T.vectorized({_i(JB)}):",
           f"                        st[jj] = T.Select(e0 + jj < nv, st[jj], {neg})",
           f"                        mx[jj] = st[jj]"]
    w = JB // 2
    while w:  # the tile's max as a tree over the lanes
        out += [f"                    for jj in T.vectorized({_i(w)}):",
                f"                        mx[jj] = T.max(mx[jj], mx[jj + {_i(w)}])"]
        w //= 2
    out += [f"                    hv[0] = T.max(m[{i}], mx[0])",
            f"                    hv[2] = T.exp(m[{i}] - hv[0])",
            f"                    den[{i}] = den[{i}] * hv[2]",  # the rows before (window, CSA) rescaled
            f"                    for jj in T.vectorized({_i(JB)}):",
            f"                        st[jj] = T.Select(e0 + jj < nv, T.exp(st[jj] - hv[0]), {f32}(0))",
            f"                        dl[{i}, jj] = dl[{i}, jj] * hv[2] + st[jj]"]  # per lane, summed at the end
    out += ["                    " + ln for ln in _vec(D, f"acc[{i}, {{d}}] = acc[{i}, {{d}}] * hv[2]")]
    out += [f"                    for jj in range(T.min({_i(JB)}, nv - e0)):"]
    out += ["                        " + ln for ln in _vec(
        D, f'acc[{i}, {{d}}] = acc[{i}, {{d}}] + st[jj] * T.Cast("float32", en[b, g, e0 + jj, {{d}}])')]
    out += [f"                    m[{i}] = hv[0]",
            f"for qi in range({_i(QB * HG)}):",
            f"    for jj in range({_i(JB)}):",
            "        den[qi] = den[qi] + dl[qi, jj]"]
    return out
