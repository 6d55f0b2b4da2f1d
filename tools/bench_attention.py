"""`dayzero bench attention`: a DSA (DeepSeek-V3.2) decode step's attention part and indexer part, each vs
torch, at 1K-64K context; prefill (time to first token) at 1K and 8K.

run_bench(quick) -> {"suite": "attention", "machine": {...}, "results": [...], "ratios": {...}} (DESIGN.md's
bench JSON).

What is measured: the KERNELS the compiled V3.2 programs run (passes/sparse_attention.py), at tiny V3.2's
dims (4 heads, qk head dim 24 = nope 16 + rope 8, v head dim 16, kv_lora_rank 32, index_topk 4, indexer 8 heads
x 16), fp32, batch 1, on this host; not a whole compiled model (a tiny model compiled for a 64K cache would be
dominated by its other O(L) buffers, which is not what this suite is about).
- decode_ctx{N} (the ATTENTION part of a decode step): one query at position N-1 over an N-row latent cache.
  dayzero = ``mla_sparse_attention`` decode kernel (weight-absorbed MLA over the k selected latent rows), reading
  the cache through a shuffled block table as compiled artifacts do (passes/paged_kv.py); dayzero_contiguous =
  the same kernel on a flat cache (the paging's cost: ratio paged_over_contiguous_*).
  Baselines: torch_sdpa_dense = torch SDPA over all N (already expanded) K/V rows with the causal mask;
  torch_upstream = what the traced upstream step computes: kv_b_proj expansion of the whole latent cache +
  SDPA with the causal & top-k mask; dayzero_dense = dayzero's ``cache_attention`` over rows [0, N-1].
  bound = bytes it must read (k selected latent+rope rows and kv_b_proj) / measured read bandwidth.
- indexer_ctx{N} (the INDEXER part, linear in N by design, reported separately): ``dsa_indexer_topk`` decode
  kernel (scores over the N index keys, ReLU, weighted head sum, mask, torch-exact top-k); baseline torch
  eager, upstream's ops (matmul, relu, matmul, masked_fill, topk). bound = index-key bytes / read bandwidth.
- prefill_ttft_{S}: the attention part of time to first token for an S-token prompt: ``mla_sparse_attention``
  prefill kernel (S queries x k rows) + ``dsa_indexer_topk`` prefill kernel (every query over its causal keys,
  blocked over queries) (also given apart: attention_s, indexer_s); baseline torch SDPA causal over S.
Each torch baseline is the better of torch on all its threads and on one (``baseline_threads``, as in bench
moe): on a shared host a core taken by another job stalls torch's OpenMP barriers by orders of magnitude.
Ratios: attention part 64K / 4K (target <= 1.5), torch dense SDPA / attention part at 64K (target >= 5), and
the indexer's 64K / 4K (linear: ~16 expected).

Full width (``full_width_cases``; ``--full-width`` runs only these): the MLA attention of one full-width
DeepSeek-V3.2 layer (128 heads, nope 128 + rope 64, v 128, latent 512, top-k 2048) at context 4096, for 1 and 8
queries (mla_full_b{N}: a decode step of N requests, each reading its own rows through its own table row of a
shuffled pool, as the batched decode program does). dayzero = the CPU kernel (codegen/kernels/mla_cpu.py);
baselines: dayzero_rows = the row-by-row form (``attention.build_mla_rows``: CUDA's, and the CPU's before the
tiles), torch_absorbed = torch eager computing the same absorbed attention over the gathered rows (einsum / bmm,
softmax). bound = the larger of FLOPs / fp32 matmul rate (``bench_ops.peak_flops``) and bytes (the selected
rows, W) / read bandwidth.
Also DeepSeek-V4-Flash's compressed attention in its batched decode step (v4_{csa,hca}_full_b{N}: 64 heads on one
kv head, head dim 512, each request's 128-row window ring at position 3999, CSA's 512 selected entries or HCA's 31
valid ones): dayzero (codegen/kernels/compressed_attention.py, window and entries in ``row_tiles``), dayzero_rows
(the row-by-row form), torch_eager (the rows each request sees gathered, bmm, sink, softmax, bmm).
"""

from __future__ import annotations


import click

HQ, NOPE, ROPE, DV, TOPK, IH, ID, RANK = 4, 16, 8, 16, 4, 8, 16, 32
DQK = NOPE + ROPE
SCALE = DQK ** -0.5


def _time(fn, repeat: int) -> float:
    from dayzero.tools.bench import _median_time

    return _median_time(fn, repeat)


def _torch_time(fn, repeat: int, picked: dict, name: str) -> float:
    """Median time of a torch baseline on all torch threads and on one; the better one (its thread count goes
    to ``picked[name]``)."""
    from dayzero.tools.bench_dequant import best_torch_time

    t, picked[name] = best_torch_time(fn, repeat, timer=_time)
    return t


def _compile(f, target):
    import tvm

    return tvm.compile(tvm.IRModule({"main": f}), target=target)["main"]


def _mla_params(L: int, S: int | None) -> dict:
    return dict(op="mla_sparse_attention", B=1, H=HQ, S=S, L=L, R=RANK, Dn=NOPE, Dr=ROPE, Dv=DV, K=TOPK,
                dtype="float32", lat_dtype="float32", w_dtype="float32", out_dtype="float32", pos_dtype="int64",
                idx_dtype="int64", scale=SCALE)


def _dense_params(L: int) -> dict:
    return dict(op="cache_attention", B=1, Hq=HQ, Hkv=HQ, S=1, L=L, D=DQK, Dv=DV, dtype="float32",
                out_dtype="float32", pos_dtype="int64", scale=SCALE, window=0, sinks=False)


def _indexer_params(L: int, S: int | None) -> dict:
    return dict(op="dsa_indexer_topk", B=1, S=S, Hi=IH, Di=ID, L=L, K=TOPK, sorted=True, scale=ID ** -0.5,
                fill=float("-inf"), q_dtype="float32", w_dtype="float32", k_dtype="float32", pos_dtype="int64")


BLOCK = 16  # the compiled artifacts' KV block size (passes/paged_kv.py)


def _paged(p: dict, n: int) -> dict:
    """``p`` reading an ``n``-row cache through a block table from a pool of n/16 + 1 blocks, as compiled."""
    return dict(p, paged=BLOCK, P=n + BLOCK, NT=n // BLOCK, table_dtype="int32")


def _to_pool(x, dim: int, perm):
    """The rows of ``x`` along ``dim`` scattered blockwise to pool blocks ``perm`` (block 0: scratch)."""
    import torch

    x = x.movedim(dim, 0)
    pool = torch.zeros((len(perm) + 1) * BLOCK, *x.shape[1:])
    pool.view(len(perm) + 1, BLOCK, -1)[perm.long()] = x.reshape(len(perm), BLOCK, -1)
    return pool.movedim(0, dim).contiguous()


def _torch_indexer(iq, iw, ik, valid):
    import torch

    scores = torch.relu(torch.matmul(iq, ik.transpose(-1, -2).unsqueeze(1)) * ID ** -0.5)
    x = torch.matmul(iw.unsqueeze(-2), scores).squeeze(-2).masked_fill(~valid, float("-inf"))
    return x.topk(TOPK, dim=-1).indices


def _side_by_side(case: str, fns: dict, args: list, o, got, want, quick: bool) -> dict:
    """Median seconds of each kernel in ``fns`` (called ``f(*args, o)``), called alternately (a shared host's load
    falls on them alike), after checking each one's output (``got()``, a view of o) against torch's ``want``."""
    from dayzero import InternalError

    for name, f in fns.items():
        o.fill_(float("nan"))
        f(*args, o)
        err = float((got() - want).abs().max() / want.abs().max())
        if not err < 1e-4:
            raise InternalError(f"{case}: {name} differs from torch by {err:.2e} of the largest output")
    times = {name: [] for name in fns}
    for _ in range(3 if quick else 7):
        for name, f in fns.items():
            times[name].append(_time(lambda: f(*args, o), 1))
    return {name: sorted(v)[len(v) // 2] for name, v in times.items()}


FULL = dict(H=128, Dn=128, Dr=64, Dv=128, R=512, K=2048, L=4096)


def full_width_cases(target: dict, bw: float, quick: bool = False) -> list[dict]:
    """The full-width MLA cases (module docstring), each kernel and torch timed alternately in one loop."""
    import torch

    from dayzero.codegen.kernels.attention import build, build_mla_rows
    from dayzero.tools.bench_ops import peak_flops

    H, Dn, Dr, Dv, R, K, L = (FULL[k] for k in ("H", "Dn", "Dr", "Dv", "R", "K", "L"))
    rate = peak_flops()
    g = torch.Generator().manual_seed(0)
    scale = (Dn + Dr) ** -0.5
    w = torch.randn(H * (Dn + Dv), R, generator=g) * R ** -0.5
    out = []
    for n in (1, 8):
        p = dict(op="mla_sparse_attention", B=1, H=H, S=None, L=L, R=R, Dn=Dn, Dr=Dr, Dv=Dv, K=K, dtype="float32",
                 lat_dtype="float32", w_dtype="float32", out_dtype="float32", pos_dtype="int64", idx_dtype="int64",
                 scale=scale, paged=BLOCK, P=(n * L // BLOCK + 1) * BLOCK, NT=L // BLOCK, table_dtype="int32",
                 per_token=True)
        q = torch.randn(1, H, n, Dn + Dr, generator=g)
        lat = torch.randn(1, 1, p["P"], R, generator=g)
        rope = torch.randn(1, 1, p["P"], Dr, generator=g)
        pos = torch.full((n,), L - 96) - torch.arange(n)
        idx = torch.stack([torch.randperm(L - 96, generator=g)[:K] for _ in range(n)]).view(1, n, K)
        table = (torch.randperm(n * L // BLOCK, generator=g) + 1).view(n, L // BLOCK).to(torch.int32)
        o = torch.empty(1, H, n, Dv)
        wk = w.view(H, Dn + Dv, R)

        def torch_absorbed():
            rows = table.long().gather(1, idx[0] // BLOCK) * BLOCK + idx[0] % BLOCK  # [n, K]
            la, ro = lat[0, 0][rows], rope[0, 0][rows]  # [n, K, R], [n, K, Dr]
            qs = q[0].transpose(0, 1)  # [n, H, Dn + Dr]
            qa = torch.einsum("nhd,hdr->nhr", qs[..., :Dn], wk[:, :Dn])
            sc = (torch.bmm(qa, la.transpose(1, 2)) + torch.bmm(qs[..., Dn:], ro.transpose(1, 2))) * scale
            sc = sc.masked_fill((idx[0] > pos.view(-1, 1)).unsqueeze(1), float("-inf"))
            return torch.einsum("nhr,hdr->nhd", torch.bmm(torch.softmax(sc, -1), la), wk[:, Dn:])

        # torch first, in one block (TVM's pool threads keep spinning after a parallel call and would take the
        # cores from torch), on all threads or one, the better
        picked: dict = {}
        t_torch = _torch_time(torch_absorbed, 3 if quick else 7, picked, "torch_absorbed")
        want = torch_absorbed()
        fns = {"dayzero": _compile(build(p, "llvm"), target),
               "dayzero_rows": _compile(build_mla_rows(p, "llvm"), target)}
        med = _side_by_side(f"mla_full_b{n}", fns, [q, lat, rope, w, pos, idx, table], o,
                            lambda: o[0].transpose(0, 1), want, quick)
        med["torch_absorbed"] = t_torch
        flops = 2 * n * H * (K * (2 * R + Dr) + (Dn + Dv) * R)
        nbytes = (n * K * (R + Dr) + w.numel()) * 4
        bound = max(flops / rate, nbytes / bw)
        out.append({"case": f"mla_full_b{n}", "unit": "s", "part": "attention", "dayzero": med["dayzero"],
                    "baselines": {"dayzero_rows": med["dayzero_rows"], "torch_absorbed": med["torch_absorbed"]},
                    "baseline_threads": picked, "bound": bound,
                    "bound_name": "max(FLOPs / fp32 matmul rate, rows + W bytes / read bandwidth)",
                    "flops": flops, "matmul_flops_per_s": rate, "fraction_of_bound": bound / med["dayzero"],
                    "queries": n, "context": L})
    return out + _v4_cases(target, bw, rate, quick)


V4 = dict(H=64, D=512, W=128, K=512, E=1001, pos=3999)  # DeepSeek-V4-Flash: 64 heads on one kv head


def _v4_cases(target: dict, bw: float, rate: float, quick: bool) -> list[dict]:
    """Full-width DeepSeek-V4's compressed attention in the batched decode step (per_row, each request's window
    ring): one CSA layer at 1 and 8 requests, one HCA layer at 8 (module docstring)."""
    import torch

    from dayzero.codegen.kernels import compressed_attention as ca

    H, D, W, K, E, pos = (V4[k] for k in ("H", "D", "W", "K", "E", "pos"))
    g = torch.Generator().manual_seed(1)
    out = []
    for kind, n in (("csa", 1), ("csa", 8), ("hca", 8)):
        cr = 4 if kind == "csa" else 128  # the compression rate
        ents = E if kind == "csa" else (pos + 1) // cr + 1
        p = dict(op=ca.OP, B=None, H=H, Hkv=1, S=1, L=W, E=ents, D=D, dtype="float32", kv_dtype="float32",
                 ent_dtype="float32", out_dtype="float32", pos_dtype="int64", sink_dtype="float32", scale=D ** -0.5,
                 window=W, rate=cr, per_row=True, ring=True)
        p.update(K=K, idx_dtype="int64") if kind == "csa" else p.update(epos_dtype="int64")
        q, kv = torch.randn(n, H, 1, D, generator=g), torch.randn(n, 1, W, D, generator=g)
        en, sk = torch.randn(n, 1, ents, D, generator=g), torch.randn(H, generator=g)
        at = torch.full((n,), pos)
        sel = torch.stack([torch.randperm(ents, generator=g)[:K] for _ in range(n)]).view(n, 1, K) \
            if kind == "csa" else None
        args = [q, kv, at, en, sk, sel if kind == "csa" else at.clone()]
        o = torch.empty(n, H, 1, D)

        def torch_eager():  # the rows each request sees (its window, its selected or valid entries), sink, softmax
            ent = en[:, 0].gather(1, sel[:, 0, :, None].expand(-1, -1, D)) if kind == "csa" else \
                en[:, 0, :(pos + 1) // cr]
            keys = torch.cat([kv[:, 0], ent], 1)
            sc = torch.bmm(q[:, :, 0], keys.transpose(1, 2)) * p["scale"]
            pr = torch.softmax(torch.cat([sc, sk.view(1, H, 1).expand(n, H, 1)], -1), -1)[..., :-1]
            return torch.bmm(pr, keys)

        picked: dict = {}
        t_torch = _torch_time(torch_eager, 3 if quick else 7, picked, "torch_eager")
        want = torch_eager()
        fns = {"dayzero": _compile(ca.build(p, "llvm"), target),
               "dayzero_rows": _compile(ca.build(p, "llvm", row_by_row=True), target)}
        med = _side_by_side(f"v4_{kind}_full_b{n}", fns, args, o, lambda: o[:, :, 0], want, quick)
        rows = W + (K if kind == "csa" else (pos + 1) // cr)
        flops, nbytes = 4 * n * H * rows * D, 4 * n * rows * D
        bound = max(flops / rate, nbytes / bw)
        out.append({"case": f"v4_{kind}_full_b{n}", "unit": "s", "part": "attention", "dayzero": med["dayzero"],
                    "baselines": {"dayzero_rows": med["dayzero_rows"], "torch_eager": t_torch},
                    "baseline_threads": picked, "bound": bound,
                    "bound_name": "max(FLOPs / fp32 matmul rate, rows' bytes / read bandwidth)",
                    "flops": flops, "fraction_of_bound": bound / med["dayzero"], "queries": n, "rows": rows})
    return out


def run_bench(quick: bool = False, full_width_only: bool = False) -> dict:
    import torch

    from dayzero.codegen.kernels.attention import build
    from dayzero.codegen.kernels.indexer import build as build_indexer
    from dayzero.passes.ir.reference_attention import mla_expand
    from dayzero.targets.host import host_target_dict
    from dayzero.tools.bench import machine_info
    from dayzero.tools.bench_dequant import read_bandwidth

    target = host_target_dict()
    bw = read_bandwidth(256 << 20)
    if full_width_only:
        m = machine_info()
        m.update({"read_bandwidth_GBps": bw / 1e9, "target": target,
                  "what": "one full-width DeepSeek-V3.2 layer's MLA attention (128 heads, latent 512, top-k 2048) "
                          "at context 4096 through per-request shuffled block tables, fp32"})
        return {"suite": "attention", "machine": m, "results": full_width_cases(target, bw, quick)}
    repeat = 5 if quick else 20
    g = torch.Generator().manual_seed(0)
    results = []
    sizes, prefills = (1024, 4096, 16384, 65536), (1024, 8192)
    w_kv = torch.randn(HQ * (NOPE + DV), RANK, generator=g) * RANK ** -0.5
    # torch baselines first, in one block: TVM's pool threads keep spinning after a parallel call and would take
    # the cores from torch
    dec = {}
    for n in sizes:
        q = torch.randn(1, HQ, 1, DQK, generator=g)
        lat, rope = torch.randn(1, 1, n, RANK, generator=g), torch.randn(1, 1, n, ROPE, generator=g)
        k, v = (t.contiguous() for t in mla_expand(lat, rope, w_kv, NOPE, HQ))
        idx = torch.randperm(n - 1, generator=g)[:TOPK - 1]
        idx = torch.cat([idx, torch.tensor([n - 1])]).reshape(1, 1, TOPK)
        sel = torch.zeros(1, 1, 1, n, dtype=torch.bool)
        sel[..., idx.reshape(-1)] = True
        causal = torch.ones(1, 1, 1, n, dtype=torch.bool)
        iq, iw, ik = torch.randn(1, 1, IH, ID, generator=g), torch.randn(1, 1, IH, generator=g), torch.randn(
            1, n, ID, generator=g)
        d = dec[n] = dict(q=q, lat=lat, rope=rope, k=k, v=v, idx=idx, qpos=torch.tensor([n - 1]), iq=iq, iw=iw, ik=ik,
                          threads={})
        d["sdpa"] = _torch_time(lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=causal, scale=SCALE), repeat, d["threads"], "torch_sdpa_dense")

        def upstream_step():
            kk, vv = mla_expand(lat, rope, w_kv, NOPE, HQ)
            return torch.nn.functional.scaled_dot_product_attention(q, kk, vv, attn_mask=causal & sel, scale=SCALE)
        d["upstream"] = _torch_time(upstream_step, repeat, d["threads"], "torch_upstream")
        d["ix_torch"] = _torch_time(lambda: _torch_indexer(iq, iw, ik, causal[0]), repeat, d["threads"],
                                    "torch_eager")
    pre = {}
    for s in prefills:
        q = torch.randn(1, HQ, s, DQK, generator=g)
        k, v = torch.randn(1, HQ, s, DQK, generator=g), torch.randn(1, HQ, s, DV, generator=g)
        qpos = torch.arange(s)
        # distinct rows <= qpos for every query (the first TOPK queries repeat row 0: timing only)
        idx = (qpos.reshape(s, 1) - torch.arange(TOPK) * 7).clamp(min=0).reshape(1, s, TOPK)
        pre[s] = dict(q=q, qpos=qpos, idx=idx, lat=torch.randn(1, 1, s, RANK, generator=g),
                      rope=torch.randn(1, 1, s, ROPE, generator=g), ik=torch.randn(1, s, ID, generator=g),
                      iq=torch.randn(1, s, IH, ID, generator=g), iw=torch.randn(1, s, IH, generator=g), threads={})
        pre[s]["sdpa"] = _torch_time(lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=SCALE), 3, pre[s]["threads"], "torch_sdpa_dense")

    decode_times, ix_times, flat_times = {}, {}, {}  # dayzero = the paged kernels the artifacts run
    for n in sizes:
        d = dec[n]
        o = torch.empty(1, HQ, 1, DV)
        mla = _compile(build(_mla_params(n, 1), "llvm"), target)
        mla_p = _compile(build(_paged(_mla_params(n, 1), n), "llvm"), target)
        dense = _compile(build(_dense_params(n), "llvm"), target)
        table = (torch.randperm(n // BLOCK, generator=g) + 1).to(torch.int32)  # shuffled blocks, as served
        plat, prope, pik = _to_pool(d["lat"], 2, table), _to_pool(d["rope"], 2, table), _to_pool(d["ik"], 1, table)
        t_dz = _time(lambda: mla_p(d["q"], plat, prope, w_kv, d["qpos"], d["idx"], table, o), repeat * 5)
        t_flat = _time(lambda: mla(d["q"], d["lat"], d["rope"], w_kv, d["qpos"], d["idx"], o), repeat * 5)
        t_dzd = _time(lambda: dense(d["q"], d["k"], d["v"], d["qpos"], o), repeat)
        decode_times[n] = (t_dz, d["sdpa"])
        need = (TOPK * (RANK + ROPE) + w_kv.numel()) * 4
        results.append({"case": f"decode_ctx{n}", "unit": "s", "part": "attention", "dayzero": t_dz,
                        "baselines": {"torch_sdpa_dense": d["sdpa"], "torch_upstream": d["upstream"],
                                      "dayzero_dense": t_dzd, "dayzero_contiguous": t_flat},
                        "baseline_threads": {k: v for k, v in d["threads"].items() if k != "torch_eager"},
                        "bound": need / bw,
                        "bound_name": "selected latent+rope rows and kv_b_proj bytes / measured read bandwidth",
                        "rows_read": TOPK, "context": n})
        out = torch.empty(1, 1, TOPK, dtype=torch.int64)
        ix = _compile(build_indexer(_paged(_indexer_params(n, 1), n), "llvm"), target)
        ix_flat = _compile(build_indexer(_indexer_params(n, 1), "llvm"), target)
        t_ix = _time(lambda: ix(d["iq"], d["iw"], pik, d["qpos"], table, out), repeat)
        t_ix_flat = _time(lambda: ix_flat(d["iq"], d["iw"], d["ik"], d["qpos"], out), repeat)
        ix_times[n] = t_ix
        flat_times[n] = (t_flat, t_ix_flat)
        results.append({"case": f"indexer_ctx{n}", "unit": "s", "part": "indexer", "dayzero": t_ix,
                        "baselines": {"torch_eager": d["ix_torch"], "dayzero_contiguous": t_ix_flat},
                        "bound": n * ID * 4 / bw,
                        "baseline_threads": {"torch_eager": d["threads"]["torch_eager"]},
                        "bound_name": "index-key bytes / measured read bandwidth", "context": n})
    for s in prefills:
        d = pre[s]
        o = torch.empty(1, HQ, s, DV)
        mla = _compile(build(_mla_params(s, None), "llvm"), target)
        ix = _compile(build_indexer(_indexer_params(s, None), "llvm"), target)
        out = torch.empty(1, s, TOPK, dtype=torch.int64)
        t_att = _time(lambda: mla(d["q"], d["lat"], d["rope"], w_kv, d["qpos"], d["idx"], o), 3)
        t_ix = _time(lambda: ix(d["iq"], d["iw"], d["ik"], d["qpos"], out), 3)
        results.append({"case": f"prefill_ttft_{s}", "unit": "s", "part": "attention+indexer",
                        "dayzero": t_att + t_ix, "baselines": {"torch_sdpa_dense": d["sdpa"]}, "bound": None,
                        "baseline_threads": d["threads"],
                        "bound_name": None, "attention_s": t_att, "indexer_s": t_ix, "context": s})
    m = machine_info()
    m.update({"read_bandwidth_GBps": bw / 1e9, "target": target,
              "what": "kernels at tiny DeepSeek-V3.2 dims (4 heads, qk 24, v 16, latent 32, top-k 4, indexer "
                      "8x16), fp32, batch 1; decode reads the caches through a shuffled block table (16-row "
                      "blocks), as compiled artifacts do; dayzero_contiguous: the same kernels on a flat cache"})
    ratios = {"attention_decode_64K_over_4K": decode_times[65536][0] / decode_times[4096][0],
              "dense_sdpa_over_attention_at_64K": decode_times[65536][1] / decode_times[65536][0],
              "indexer_decode_64K_over_4K": ix_times[65536] / ix_times[4096],
              "paged_over_contiguous_attention_64K": decode_times[65536][0] / flat_times[65536][0],
              "paged_over_contiguous_indexer_64K": ix_times[65536] / flat_times[65536][1]}
    return {"suite": "attention", "machine": m, "results": results, "ratios": ratios}


@click.command("attention")
@click.option("--json", "as_json", is_flag=True, help="Print the bench JSON object.")
@click.option("--quick", is_flag=True, help="Fewer repeats.")
@click.option("--full-width", is_flag=True, help="Only one full-width DeepSeek-V3.2 layer's MLA, 1 and 8 queries.")
def attention_command(as_json: bool, quick: bool, full_width: bool):
    """DSA decode at 1K-64K context (attention part and indexer part apart) and prefill at 1K/8K vs torch."""
    out = run_bench(quick, full_width_only=full_width)
    from dayzero.tools.bench import baselines_text, echo_bench

    echo_bench(out, as_json, lambda r: f"{r['case']:20s} {r['part']:18s} {r['dayzero'] * 1e6:10.1f} us  "
                                       f"({baselines_text(r, 1e6, '.1f', 'us')})",
               f"read bandwidth {out['machine']['read_bandwidth_GBps']:.1f} GB/s; {out['machine']['what']}")
    for k, v in ({} if as_json else out.get("ratios", {})).items():
        click.echo(f"{k}: {v:.2f}")
