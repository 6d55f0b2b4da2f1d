"""DeepSeek-V4 compressed attention that reads only the rows a query sees (op from passes/compressed_attention.py).

    compressed_attention(q [B,H,S,D], kv [B,Hkv,L,D], qpos [S], entries [B,Hkv,E,D], sinks [H],
                         [idx [B,S,K]], [epos [S]]) -> o [B,H,S,D]

query (b, h, s) with kv head g = h // (H/Hkv) and p = qpos[s] reads

* the sliding-window rows j in [max(0, p-W+1), min(p, L-1)] of ``kv`` (W = window; 0: from row 0),
* CSA (``idx``): the entry rows e = idx[b, s, t], t < K, kept where 0 <= e < E (the top-k indices are distinct, so
  each row counts once; upstream's -inf columns are never read),
* HCA (``epos``, rate R): the entry rows e < min((epos[s] + 1) // R, E), all of them (HCA is dense over its few
  valid entries by design),

and o = sum_r softmax_r(scale * q·x_r ; sink_h) x_r over those rows x_r (K = V: one tensor per branch), the
per-head sink logit in the denominator only (``per_row``, the row-batched decode step: S == 1, B symbolic, qpos and
epos [B], row b's query at qpos[b] and epos[b]). One pass of online softmax (running max m, denominator l, fp32
accumulator acc[D]), so a query costs O(W + K) rows (CSA) or O(W + p/R) rows (HCA), never O(L + E).

Variants, chosen from the shapes and the target:

* host CPU, decode (S == 1): parallel over (b, h), one query x its rows.
* host CPU, prefill (S symbolic or > 1): parallel over (b, head group, s); the heads of a group share the kv head
  (and, for CSA, the indices), so every row a query reads is loaded once for the whole group (``head_group``).
* CUDA: one thread per (b, h, s) query, 64 threads per block (compiles for sm_90; not tuned).

Written as TVMScript text, like ``attention.py`` (data-dependent loop bounds are plain TIR).
"""

from __future__ import annotations


import tvm

from dayzero.codegen.kernels import attention
from dayzero.codegen.tvmscript import from_source
from dayzero.passes.ir.node import Node

OP = "compressed_attention"
GROUP_MAX = 16  # heads per CPU prefill task at most (their accumulators live in the task's local buffers)
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
         "per_row": bool(n.attr.get("per_row"))}
    if n.attr.get("idx"):
        idx = rest.pop(0)
        p.update(K=int(idx.shape[-1]), idx_dtype=idx.dtype)
    if n.attr.get("epos"):
        p.update(epos_dtype=rest.pop(0).dtype)
    return attention.paged_params(n, p, kv.shape[2])  # a paged K=V state (passes/paged_kv.py): the table last


def head_group(H: int, Hkv: int, decode: bool, kind: str) -> int:
    """Heads per task: 1 for decode and CUDA; on the CPU prefill the largest power of two <= GROUP_MAX that divides
    the heads per kv head (those heads read the same rows)."""
    if decode or kind == "cuda":
        return 1
    rep, g = H // Hkv, 1
    while rep % (2 * g) == 0 and 2 * g <= GROUP_MAX:
        g *= 2
    return g


def _i(x) -> str:
    return f"T.int64({x})"


def build(p: dict, kind: str = "llvm") -> tvm.tirx.PrimFunc:
    """The kernel for params ``p`` (see ``params``) on ``kind`` = "llvm" | "cuda"."""
    H, Hkv, L, E, D, W = (p[x] for x in ("H", "Hkv", "L", "E", "D", "window"))
    csa, hca = "K" in p, "epos_dtype" in p
    S = _i(p["S"]) if p["S"] is not None else "S"
    B = _i(p["B"]) if p["B"] is not None else "B"  # symbolic: the row-batched decode step's requests
    P = B if p.get("per_row") else S  # positions: one per query, or one per batch row (S == 1)
    HG = head_group(H, Hkv, p["S"] == 1, kind)
    NG, rep = H // HG, H // Hkv
    f32 = "T.float32"
    scope = ', scope="local"' if kind == "cuda" else ""
    args = (["q_", "kv_", "p_", "en_", "sk_"] + (["x_"] if csa else []) + (["ep_"] if hca else [])
            + (["bt_"] if p.get("paged") else []) + ["o_"])
    lines = ['    T.func_attr({"tirx.noalias": True})']
    if p["S"] is None:
        lines.append("    S = T.int64()")
    if p["B"] is None:
        lines.append("    B = T.int64()")
    lines += [f'    q = T.match_buffer(q_, ({B}, {_i(H)}, {S}, {_i(D)}), "{p["dtype"]}")',
              f'    kv = T.match_buffer(kv_, ({B}, {_i(Hkv)}, {_i(p.get("P", L))}, {_i(D)}), "{p["kv_dtype"]}")',
              f'    p = T.match_buffer(p_, ({P},), "{p["pos_dtype"]}")',
              f'    en = T.match_buffer(en_, ({B}, {_i(Hkv)}, {_i(E)}, {_i(D)}), "{p["ent_dtype"]}")',
              f'    sk = T.match_buffer(sk_, ({_i(H)},), "{p["sink_dtype"]}")']
    if csa:
        lines.append(f'    x = T.match_buffer(x_, ({B}, {S}, {_i(p["K"])}), "{p["idx_dtype"]}")')
    if hca:
        lines.append(f'    ep = T.match_buffer(ep_, ({P},), "{p["epos_dtype"]}")')
    lines += attention.table_decl(p)
    lines.append(f'    o = T.match_buffer(o_, ({B}, {_i(H)}, {S}, {_i(D)}), "{p["out_dtype"]}")')
    total = f"{B} * {_i(NG)} * {S}"
    at = "b" if p.get("per_row") else "s"  # the index of a query's position
    lines += attention.task_loop(total, kind)
    body = [f"b = t // {_i(NG)} // {S}", f"h0 = t // {S} % {_i(NG)} * {_i(HG)}", f"s = t % {S}",
            f"g = h0 // {_i(rep)}",
            f'm = T.decl_buffer(({_i(HG)},), "float32"{scope})',
            f'den = T.decl_buffer(({_i(HG)},), "float32"{scope})',
            f'acc = T.decl_buffer(({_i(HG)}, {_i(D)}), "float32"{scope})',
            f'qf = T.decl_buffer(({_i(HG)}, {_i(D)}), "float32"{scope})',
            f'sc = T.decl_buffer(({_i(1)},), "float32"{scope})',
            f"for hh in range({_i(HG)}):",
            f"    m[hh] = {NEG}",
            f"    den[hh] = {f32}(0)",
            f"    for d in range({_i(D)}):",
            f"        acc[hh, d] = {f32}(0)",
            f'        qf[hh, d] = T.Cast("float32", q[b, h0 + hh, s, d]) * {f32}({p["scale"]!r})']

    def update(buf: str, row: str, ind: str) -> list[str]:
        """Online-softmax step of every head of the task with the row ``buf[b, g, row, :]`` (K = V); the K=V
        state's row through the block table when it is paged."""
        return [ind + f"r = {attention.cache_row(p, row) if buf == 'kv' else row}",
                ind + f"for hh in range({_i(HG)}):",
                ind + f"    sc[0] = {f32}(0)",
                ind + f"    for d in range({_i(D)}):",
                ind + f'        sc[0] = sc[0] + qf[hh, d] * T.Cast("float32", {buf}[b, g, r, d])',
                ind + "    mn = T.max(m[hh], sc[0])",
                ind + "    corr = T.exp(m[hh] - mn)",
                ind + "    ex = T.exp(sc[0] - mn)",
                ind + "    den[hh] = den[hh] * corr + ex",
                ind + f"    for d in range({_i(D)}):",
                ind + f'        acc[hh, d] = acc[hh, d] * corr + ex * T.Cast("float32", {buf}[b, g, r, d])',
                ind + "    m[hh] = mn"]

    pos = f'T.Cast("int64", p[{at}])'
    lo = f"T.max({pos} - {_i(W - 1)}, {_i(0)})" if W else _i(0)
    hi = f"T.min({pos}, {_i(L - 1)})"
    # the sliding-window branch: rows [lo, hi] of the K=V state
    body += [f"for j in range(T.max({hi} - {lo} + {_i(1)}, {_i(0)})):"]
    body += update("kv", f"{lo} + j", "    ")
    if csa:  # the indexer's selected entries, nothing else
        body += [f"for tk in range({_i(p['K'])}):",
                 '    e = T.Cast("int64", x[b, s, tk])',
                 f"    if e >= {_i(0)} and e < {_i(E)}:"]
        body += update("en", "e", "        ")
    if hca:  # every causally valid entry: e < (epos + 1) // R
        nvalid = f'T.min(T.max((T.Cast("int64", ep[{at}]) + {_i(1)}) // {_i(p["rate"])}, {_i(0)}), {_i(E)})'
        body += [f"for e in range({nvalid}):"]
        body += update("en", "e", "    ")
    body += [f"for hh in range({_i(HG)}):",
             '    snk = T.Cast("float32", sk[h0 + hh])',
             "    mn = T.max(m[hh], snk)",
             "    corr = T.exp(m[hh] - mn)",
             "    dn = den[hh] * corr + T.exp(snk - mn)",
             f"    for d in range({_i(D)}):",
             f'        o[b, h0 + hh, s, d] = T.Cast("{p["out_dtype"]}", acc[hh, d] * corr / dn)']
    ind = "        " + ("    " if kind == "cuda" else "")
    src = ("@T.prim_func\ndef main(" + ", ".join(a + ": T.handle" for a in args) + "):\n"
           + "\n".join(lines) + "\n" + "\n".join(ind + b for b in body) + "\n")
    return from_source(src)

