"""`dayzero bench attention`: sparse (DSA) decode/prefill attention vs dense SDPA over the full context.

run_bench(quick) -> {"suite": "attention", "machine": {...}, "results": [...]} (DESIGN.md's bench JSON).

What is measured: the attention KERNELS directly, at each context size, with tiny DeepSeek-V3.2's head dims
(4 heads, qk head dim 24 = nope 16 + rope 8, v head dim 16, index_topk 4, indexer 8 heads x 16), fp32, batch 1,
on this host (not a whole compiled model: a tiny model compiled with --max-seq 64K would spend its step in the
O(L) parts listed below, and an 8K prefill of the traced graph materialises [S, L] indexer scores).
- decode_ctx{N}: one query at position N-1 over an N-row cache. dayzero = ``sparse_attention`` decode kernel
  (reads the k selected rows through the index); baselines: torch_sdpa_dense = torch SDPA over all N rows with
  the causal mask (what upstream runs), dayzero_dense = dayzero's ``cache_attention`` over rows [0, N-1].
  bound = bytes of the k selected K/V rows / measured read bandwidth.
- indexer_ctx{N}: the DSA step's linear part, reported separately: indexer scores over the N cached indexer
  keys (dayzero ``indexer_scores`` kernel) + torch.topk; baseline torch eager (bmm, relu, weighted sum, topk).
  bound = indexer key bytes / read bandwidth.
- mla_expand_ctx{N}: NOT removed yet: the traced V3.2 decode graph expands the whole latent cache through
  kv_b_proj every step (linear [N, 32] x [32, 128], O(N)); timed with torch to show its size next to the rest.
- prefill_ttft_{S}: the attention part of time to first token for an S-token prompt: the ``sparse_attention``
  prefill kernel (S queries x k rows) + indexer scores for every query; baseline torch SDPA causal over S.
Ratios (in "ratios"): sparse decode 64K / 4K (target <= 1.5) and torch dense SDPA / sparse at 64K (target >= 5).
"""

from __future__ import annotations

import json

import click

HQ, DQK, DV, TOPK, IH, ID, KV_RANK = 4, 24, 16, 4, 8, 16, 32
SCALE = DQK ** -0.5


def _time(fn, repeat: int) -> float:
    from dayzero.tools.bench import _median_time

    return _median_time(fn, repeat)


def _compile(f, target):
    import tvm

    return tvm.compile(tvm.IRModule({"main": f}), target=target)["main"]


def _params(op: str, L: int, S: int | None) -> dict:
    p = dict(op=op, B=1, Hq=HQ, Hkv=HQ, S=S, L=L, D=DQK, Dv=DV, dtype="float32", out_dtype="float32",
             pos_dtype="int64", scale=SCALE, window=0, sinks=False)
    if op == "sparse_attention":
        p.update(K=TOPK, idx_dtype="int64")
    return p


def run_bench(quick: bool = False) -> dict:
    import torch

    from dayzero.codegen.kernels.attention import build, indexer_scores
    from dayzero.targets.host import host_target_dict
    from dayzero.tools.bench import machine_info
    from dayzero.tools.bench_dequant import read_bandwidth

    target = host_target_dict()
    bw = read_bandwidth(256 << 20)
    repeat = 5 if quick else 20
    g = torch.Generator().manual_seed(0)
    results = []
    sizes, prefills = (1024, 4096, 16384, 65536), (1024, 8192)
    # torch baselines first, in one block: TVM's pool threads keep spinning after a parallel call and would take
    # the cores from torch
    dec = {}
    for n in sizes:
        q = torch.randn(1, HQ, 1, DQK, generator=g)
        k, v = torch.randn(1, HQ, n, DQK, generator=g), torch.randn(1, HQ, n, DV, generator=g)
        ik, iq, iw = torch.randn(n, ID, generator=g), torch.randn(IH, ID, generator=g), torch.randn(IH, generator=g)
        lat, wkv = torch.randn(n, KV_RANK, generator=g), torch.randn(HQ * (16 + DV), KV_RANK, generator=g)
        mask = torch.ones(1, 1, 1, n, dtype=torch.bool)
        dec[n] = dict(q=q, k=k, v=v, ik=ik, iq=iq, iw=iw, qpos=torch.tensor([n - 1]),
                      idx=torch.randperm(n, generator=g)[:TOPK].reshape(1, 1, TOPK))
        dec[n]["sdpa"] = _time(lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=SCALE), repeat)
        dec[n]["ix_torch"] = _time(lambda: torch.topk((torch.relu((ik @ iq.T) * ID ** -0.5) * iw).sum(-1), TOPK),
                                   repeat)
        dec[n]["mla"] = _time(lambda: torch.nn.functional.linear(lat, wkv), repeat)
    pre = {}
    for s in prefills:
        q = torch.randn(1, HQ, s, DQK, generator=g)
        k, v = torch.randn(1, HQ, s, DQK, generator=g), torch.randn(1, HQ, s, DV, generator=g)
        qpos = torch.arange(s)
        # distinct rows <= qpos for every query (the first TOPK queries repeat row 0: timing only)
        idx = (qpos.reshape(s, 1) - torch.arange(TOPK) * 7).clamp(min=0).reshape(1, s, TOPK)
        pre[s] = dict(q=q, k=k, v=v, qpos=qpos, idx=idx, ik=torch.randn(s, ID, generator=g),
                      iq=torch.randn(IH, ID, generator=g), iw=torch.randn(IH, generator=g))
        pre[s]["sdpa"] = _time(lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=SCALE), 3)

    decode_times = {}
    for n in sizes:
        d = dec[n]
        o = torch.empty(1, HQ, 1, DV)
        sparse = _compile(build(_params("sparse_attention", n, 1), "llvm"), target)
        dense = _compile(build(_params("cache_attention", n, 1), "llvm"), target)
        t_dz = _time(lambda: sparse(d["q"], d["k"], d["v"], d["qpos"], d["idx"], o), repeat * 5)
        t_dzd = _time(lambda: dense(d["q"], d["k"], d["v"], d["qpos"], o), repeat)
        decode_times[n] = (t_dz, d["sdpa"])
        rows = TOPK * HQ * (DQK + DV) * 4
        results.append({"case": f"decode_ctx{n}", "unit": "s", "dayzero": t_dz,
                        "baselines": {"torch_sdpa_dense": d["sdpa"], "dayzero_dense": t_dzd},
                        "bound": rows / bw, "bound_name": "selected K/V row bytes / measured read bandwidth",
                        "rows_read": TOPK, "context": n})
        cnt, sc = torch.tensor([n]), torch.empty(n)
        scorer = _compile(indexer_scores(IH, ID, n, ID ** -0.5), target)
        t_ix = _time(lambda: (scorer(d["iq"], d["iw"], d["ik"], cnt, sc), torch.topk(sc, TOPK)), repeat)
        results.append({"case": f"indexer_ctx{n}", "unit": "s", "dayzero": t_ix,
                        "baselines": {"torch_eager": d["ix_torch"]}, "bound": n * ID * 4 / bw,
                        "bound_name": "indexer key bytes / measured read bandwidth", "context": n})
        results.append({"case": f"mla_expand_ctx{n}", "unit": "s", "dayzero": d["mla"], "baselines": {},
                        "bound": n * KV_RANK * 4 / bw, "bound_name": "latent cache bytes / measured read bandwidth",
                        "context": n, "note": "torch linear; still in the traced decode graph (O(context))"})
    for s in prefills:
        d = pre[s]
        o = torch.empty(1, HQ, s, DV)
        sparse = _compile(build(_params("sparse_attention", s, None), "llvm"), target)
        sc = torch.empty(s)
        scorer = _compile(indexer_scores(IH, ID, s, ID ** -0.5), target)
        t_att = _time(lambda: sparse(d["q"], d["k"], d["v"], d["qpos"], d["idx"], o), 3)
        n_ix = 32  # indexer scores of 32 evenly spaced queries (query j scores its j+1 rows), scaled to s queries
        cnts = [torch.tensor([(j * s) // n_ix + 1]) for j in range(n_ix)]
        t_ix = _time(lambda: [scorer(d["iq"], d["iw"], d["ik"], c, sc) for c in cnts], 3) * s / n_ix
        results.append({"case": f"prefill_ttft_{s}", "unit": "s", "dayzero": t_att + t_ix,
                        "baselines": {"torch_sdpa_dense": d["sdpa"]}, "bound": None, "bound_name": None,
                        "attention_s": t_att, "indexer_s": t_ix, "context": s})
    m = machine_info()
    m.update({"read_bandwidth_GBps": bw / 1e9, "target": target,
              "what": "kernels at tiny DeepSeek-V3.2 head dims (4 heads, qk 24, v 16, top-k 4), fp32, batch 1"})
    ratios = {"sparse_decode_64K_over_4K": decode_times[65536][0] / decode_times[4096][0],
              "dense_sdpa_over_sparse_at_64K": decode_times[65536][1] / decode_times[65536][0]}
    return {"suite": "attention", "machine": m, "results": results, "ratios": ratios}


@click.command("attention")
@click.option("--json", "as_json", is_flag=True, help="Print the bench JSON object.")
@click.option("--quick", is_flag=True, help="Fewer repeats.")
def attention_command(as_json: bool, quick: bool):
    """Sparse (DSA) attention decode at 1K-64K context and prefill at 1K/8K vs dense SDPA."""
    out = run_bench(quick)
    if as_json:
        click.echo(json.dumps(out, indent=1))
        return
    click.echo(f"read bandwidth {out['machine']['read_bandwidth_GBps']:.1f} GB/s; {out['machine']['what']}")
    for r in out["results"]:
        base = ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in r["baselines"].items())
        click.echo(f"{r['case']:20s} {r['dayzero'] * 1e6:10.1f} us  ({base})")
    for k, v in out["ratios"].items():
        click.echo(f"{k}: {v:.2f}")
