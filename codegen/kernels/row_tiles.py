"""Online softmax over a query's cache rows in tiles, HG heads at once, on the host CPU: the inner part of the
attention kernels whose heads share the rows they read (MLA's latent rows: ``mla_cpu``; DeepSeek-V4's K=V
window and compressed entries: ``compressed_attention``).

Per CW candidates, the cache rows of those kept (visible) are gathered first, so a tile holds kept rows only (a
query at position 63 among 2048 top-k candidates scores 64 rows, not 2048); per tile of JT of them:

    sc[j, :] = sum_c row_j[c] * q[c, :]           RB rows x HG heads of accumulators, a vector over the heads per
                                                  row, each row element broadcast (no reduction across lanes)
    m' = max(m, max_j sc[j, :]); cr = exp(m - m'); P[j, :] = exp(sc[j, :] - m') (0 for a row not kept)
    den = den * cr + sum_j P[j, :]                HG heads wide, one rescale per tile
    acc[h, c] = acc[h, c] cr[h] + sum_j P[j, h] value_j[c]     HB heads x CH features of accumulators: a chunk
                                                  of a value row is read once for HB heads

The row-by-row form it replaces (still CUDA's) ran two scalar ``exp`` calls and a rescale of the whole accumulator
per row and head, each score a dot product reduced across lanes. The register blocks are default-scope buffers
under 1 KiB, which TVM puts on the stack, so LLVM keeps them in registers (a ``local`` buffer in a parallel loop is
a workspace pointer); ACC_FLOATS sizes them for AVX2's 16 vector registers. The kernels apply
``cpu_rules.fast_exp``, so the exponentials run HG wide.
"""

from __future__ import annotations

from dayzero.codegen.kernels.attention import NEG

CW = 256  # candidates whose kept rows are gathered at a time (a tile holds kept rows only)
JT = 8  # kept rows per tile (16 and 32 measured 5% slower on MLA at full width)
ACC_FLOATS = 64  # floats of one accumulator block: 8 AVX2 ymm registers of 16


def _i(x) -> str:
    return f"T.int64({x})"


def blocks(HG: int, D: int) -> tuple[int, int, int]:
    """(RB, HB, CH): a score block's rows (RB x HG accumulators, RB dividing JT) and a value block's heads and
    features (HB x CH accumulators, HB dividing HG, CH dividing D, at least two heads where HG allows, so a value
    chunk serves two)."""
    rb = max(1, min(8, JT, ACC_FLOATS // HG))
    while JT % rb:
        rb //= 2
    ch = next(c for c in (64, 32, 16, 8, 4, 2, 1) if D % c == 0 and c <= max(1, ACC_FLOATS // min(2, HG)))
    hb = max(1, min(HG, ACC_FLOATS // ch))
    while HG % hb:
        hb //= 2
    return rb, hb, ch


def scratch(HG: int) -> list[str]:
    """The buffers ``tiles`` uses (declare once per task, before the first ``tiles``): a tile's scores, then
    probabilities; its max and rescale; its cache rows; a window's kept rows and their count."""
    return [f'tsc = T.decl_buffer(({_i(JT)}, {_i(HG)}), "float32")',
            f'ttw = T.decl_buffer(({_i(2)}, {_i(HG)}), "float32")',
            f'trw = T.decl_buffer(({_i(JT)},), "int64")',
            f'tkr = T.decl_buffer(({_i(CW)},), "int64")',
            'tnk = T.decl_buffer((T.int64(1),), "int64")']


def tiles(*, count: str, pick: list[str], row: str, scores: list[tuple[str, str, int]], value: tuple[str, int],
          acc: str, m: str, den: str, HG: int) -> list[str]:
    """TVMScript lines folding up to ``count`` candidate rows into the online softmax state of HG heads (its
    buffers and loop variables start with t: tsc, ttw, trw, tkr, tnk from ``scratch``, tsa, tva; tcw, tj, tk,
    tile, tjb, thb, trc, thi, jj, c, hv, l).

    ``pick``: lines run for candidate ``tk`` (< count), the last an ``if <kept>:`` line, under which the row's
    cache row ``row`` is taken. ``scores``: the score's terms (src, q, n): sum over c < n of src (format of
    ``{r}`` the cache row and ``{c}``, a float32 element) times q (format of ``{c}``, the query element of head
    lane ``hv``). ``value``: (src, n), the value row's elements (format of ``{r}``, ``{c}``). ``acc`` (format of
    ``{h}`` the head in the group and ``{c}``), ``m`` and ``den`` (format of ``{h}``): the state, float32 buffer
    elements, contiguous over the heads."""
    RB, HB, CH = blocks(HG, value[1])
    vsrc, D = value
    head = [f"for tcw in range(({count} + {_i(CW - 1)}) // {_i(CW)}):",  # the kept rows of CW candidates
            "    tnk[0] = T.int64(0)",
            f"    for tj in range({_i(CW)}):",
            f"        tk = tcw * {_i(CW)} + tj",
            f"        if tk < {count}:",
            ] + ["            " + ln for ln in pick] + [
            f"                tkr[tnk[0]] = {row}",
            "                tnk[0] = tnk[0] + T.int64(1)"]
    lines = [f"for tile in range((tnk[0] + {_i(JT - 1)}) // {_i(JT)}):",  # then JT of them a tile
             f"    for jj in range({_i(JT)}):",
             f"        trw[jj] = {_i(-1)}",
             f"        if tile * {_i(JT)} + jj < tnk[0]:",
             f"            trw[jj] = tkr[tile * {_i(JT)} + jj]",
             f"    for tjb in range({_i(JT // RB)}):",
             f'        tsa = T.decl_buffer(({_i(RB)}, {_i(HG)}), "float32")',
             f"        for jj in T.unroll({_i(RB)}):",
             f"            for hv in T.vectorized({_i(HG)}):",
             "                tsa[jj, hv] = T.float32(0)"]
    r = f"T.max(trw[tjb * {_i(RB)} + jj], {_i(0)})"  # a row not kept reads row 0, its score discarded
    for src, q, n in scores:
        lines += [f"        for c in range({_i(n)}):",
                  f"            for jj in T.unroll({_i(RB)}):",
                  f"                for hv in T.vectorized({_i(HG)}):",
                  f"                    tsa[jj, hv] = tsa[jj, hv] + {src.format(r=r, c='c')} * {q.format(c='c')}"]
    mv, dv = m.format(h="hv"), den.format(h="hv")
    lines += [f"        for jj in T.unroll({_i(RB)}):",
              f"            for hv in T.vectorized({_i(HG)}):",
              f"                tsc[tjb * {_i(RB)} + jj, hv] = T.Select(trw[tjb * {_i(RB)} + jj] >= {_i(0)}, "
              f"tsa[jj, hv], {NEG})",
              f"    for hv in T.vectorized({_i(HG)}):",
              f"        ttw[0, hv] = {mv}",
              f"    for jj in range({_i(JT)}):",
              f"        for hv in T.vectorized({_i(HG)}):",
              "            ttw[0, hv] = T.max(ttw[0, hv], tsc[jj, hv])",
              f"    for hv in T.vectorized({_i(HG)}):",
              f"        ttw[1, hv] = T.exp({mv} - ttw[0, hv])",
              f"        {dv} = {dv} * ttw[1, hv]",
              f"        {mv} = ttw[0, hv]",
              f"    for jj in range({_i(JT)}):",
              f"        for hv in T.vectorized({_i(HG)}):",
              f"            tsc[jj, hv] = T.Select(trw[jj] >= {_i(0)}, T.exp(tsc[jj, hv] - ttw[0, hv]), T.float32(0))",
              f"            {dv} = {dv} + tsc[jj, hv]"]
    h = f"thb * {_i(HB)} + thi"
    a = acc.format(h=h, c=f"trc * {_i(CH)} + l")
    lines += [f"    for thb in range({_i(HG // HB)}):",
              f"        for trc in range({_i(D // CH)}):",
              f'            tva = T.decl_buffer(({_i(HB)}, {_i(CH)}), "float32")',
              f"            for thi in T.unroll({_i(HB)}):",
              f"                for l in T.vectorized({_i(CH)}):",
              f"                    tva[thi, l] = {a} * ttw[1, {h}]",
              f"            for jj in range({_i(JT)}):",
              f"                if trw[jj] >= {_i(0)}:",
              f"                    for thi in T.unroll({_i(HB)}):",
              f"                        for l in T.vectorized({_i(CH)}):",
              f"                            tva[thi, l] = tva[thi, l] + tsc[jj, {h}] * "
              f"{vsrc.format(r='trw[jj]', c=f'trc * {_i(CH)} + l')}",
              f"            for thi in T.unroll({_i(HB)}):",
              f"                for l in T.vectorized({_i(CH)}):",
              f"                    {a} = tva[thi, l]"]
    return head + ["    " + ln for ln in lines]
