"""`dayzero bench moe`: the routed-expert kernel vs transformers' expert implementations on the same weights.

run_bench(quick) -> {"suite": "moe", "machine": {...}, "results": [...]} (DESIGN.md's bench JSON).

One transformers Qwen3-MoE sparse block (64 experts, top-4, hidden 1024, expert width 512, fp32, random
weights) routes random hidden states once; then the experts alone run on the same (hidden, top-k ids, top-k
weights), switching ``config._experts_implementation`` between ``eager`` (the per-expert Python loop),
``grouped_mm`` and ``batched_mm``, against dayzero's ``moe_experts`` kernel (``codegen/kernels/moe.py``) compiled
for this host. Cases:
- prefill_T256: seconds per call; bound null (compute bound; ``gflops`` reported). batched_mm is skipped here: it
  would gather a (1024, 1024, 1024)+(1024, 1024, 512) fp32 copy of the weights (6 GiB).
- decode_T1 / decode_T8: seconds per call, each call with a fresh routing over the 64-expert pool (384 MiB, larger
  than the caches), so the routed experts come from memory. bound = routed experts' bytes / read bandwidth
  measured in this run; ``bytes_read`` = what the kernel reads per step (each routed expert's matrices once, by
  its loop structure, plus activations), ``routed_expert_bytes`` = distinct routed experts x bytes per expert.
MXFP4 routes (``mxfp4_*`` cases; ``--mxfp4-routes`` runs only these): the same expert shapes with random MXFP4
weights (every FP4 code, scales around 2^-6), the fused kernel (decodes in registers) vs the workspace route
(``codegen/kernels/expert_workspace.py``: converts each routed expert once into a slot, GEMMs from the slot), side
by side on the same inputs; ``dayzero`` is the workspace route, ``baselines.fused_in_register`` the fused one,
``workspace_over_fused`` their ratio (< 1: the workspace route is faster).
- mxfp4_prefill_T256: fp32 workspace (also bf16 and fp8_e4m3 workspaces, as ``compute_dtypes``).
- mxfp4_decode_T1: a fresh routing per call, one slot (every routed expert converted).
- mxfp4_decode_T1_lru_skewed: a decode sequence through 2 layers (their own weights) with a skewed routing (Zipf
  1.2 over each layer's experts), the workspace with a 96 MiB LRU cache shared by both layers (16 fp32 experts;
  32 bf16 ones under ``compute_dtypes``); ``hit_rate`` from the kernel's own counters (the cache state).
Full width (``full_width_cases``; ``--full-width`` runs only these): gpt-oss-20b's expert shapes (32 experts, top-4,
hidden 2880, expert width 2880, biases, random MXFP4 weights: 423 MB per layer, larger than the caches), decode at
T = 1 and 8 with a fresh routing per call: ``dayzero`` is the fused kernel on integer tiles (``int8``: what
``dayzero compile --int8-activations`` gives the decode programs), ``baselines.fused_fp32`` the fused kernel's fp32
tiles (the default), side by side in one run; bound = routed experts' MXFP4 bytes / read bandwidth measured in the
same run, ``share_of_bound`` = bound / time for each.
TVM's thread pool is set to the target's core count (``tvm_threads`` in the machine info), as torch uses every core;
each torch baseline is the better of torch on all its threads and on one (``baseline_threads``), see best_torch.
"""

from __future__ import annotations

import json

import click

from dayzero.tools.bench_dequant import best_time, best_torch_time

E, K_TOP, H, I = 64, 4, 1024, 512


def _block():
    import torch
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K_TOP,
                         norm_topk_prob=True)
    torch.manual_seed(0)
    blk = Qwen3MoeSparseMoeBlock(cfg).eval()
    with torch.no_grad():
        blk.experts.gate_up_proj.normal_(0, 0.02)
        blk.experts.down_proj.normal_(0, 0.02)
        blk.gate.weight.normal_(0, 0.02)
    return cfg, blk


def _kernel(target: dict):
    import tvm

    from dayzero.codegen.kernels.moe import moe_experts_func

    act = ("mul", ("silu", ("col", 0, 1, I)), ("col", I, 1, I))
    f = moe_experts_func(E, H, 2 * I, I, K_TOP, layout="nk", act=act, gate_up_bias=False, down_bias=False)
    return tvm.compile(tvm.IRModule({"main": f}), target=target)["main"]


def _mxfp4_weights(gen):
    import torch

    def mx(O, K):
        return (torch.randint(0, 256, (E, O, K // 32, 16), dtype=torch.uint8, generator=gen),
                torch.randint(119, 123, (E, O, K // 32), dtype=torch.uint8, generator=gen))
    return (*mx(2 * I, H), *mx(H, I))


def _zipf_routes(gen, steps: int, s: float = 1.2):
    """Top-K distinct experts per decode step, drawn from one Zipf(s) popularity over a random order of experts
    (the order fixed for the whole sequence: a layer's hot experts stay hot)."""
    import torch

    rank = torch.arange(1, E + 1, dtype=torch.float64)
    p = rank ** -s
    perm = torch.randperm(E, generator=gen)
    return [perm[torch.multinomial(p, K_TOP, replacement=False, generator=gen)][None] for _ in range(steps)]


def mxfp4_route_cases(target: dict, quick: bool = False) -> list[dict]:
    """Fused-in-register vs workspace route on MXFP4 experts, side by side (see the module docstring)."""
    import torch
    import tvm

    from dayzero.codegen.kernels import expert_workspace as kw
    from dayzero.codegen.kernels.moe import moe_experts_func
    from dayzero.passes.ir.dayzero_ops import workspace_slot_bytes

    act = ("mul", ("silu", ("col", 0, 1, I)), ("col", I, 1, I))

    def build(f):
        return tvm.compile(tvm.IRModule({"main": f}), target=target)["main"]
    fused = build(moe_experts_func(E, H, 2 * I, I, K_TOP, layout="nk", act=act, gate_up_bias=False,
                                   down_bias=False, wfmt="mxfp4"))
    storage = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float8_e4m3fn": torch.uint8}

    def workspace(cd, slots, cache):
        lib = build(kw.workspace_func(E, H, 2 * I, I, K_TOP, act=act, gate_up_bias=False, down_bias=False,
                                      compute_dtype=cd, slots=slots, cache=cache))
        ws = torch.zeros(slots, kw.slot_elems(H, 2 * I, I), dtype=storage[cd])
        meta = torch.zeros(kw.meta_len(slots), dtype=torch.int64)
        return lib, ws, meta

    gen = torch.Generator().manual_seed(2)
    layers = [_mxfp4_weights(gen) for _ in range(2)]
    w0 = layers[0]
    r = 2 if quick else 3
    out = []
    # prefill
    T = 64 if quick else 256
    x = torch.randn(T, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K_TOP] for _ in range(T)])
    w = torch.rand(T, K_TOP, generator=gen)
    y_f, y_w = torch.empty(T, H), torch.empty(T, H)
    fused(x, ids, w, *w0, y_f)
    t_f = best_time(lambda: fused(x, ids, w, *w0, y_f), r)
    times, errs = {}, {}
    layer0 = torch.tensor([0], dtype=torch.int32)
    for cd in ("float32", "bfloat16", "float8_e4m3fn"):
        lib, ws, meta = workspace(cd, 1, False)
        lib(x, ids, w, *w0, layer0, ws, meta, y_w)
        errs[cd] = float((y_w - y_f).abs().max() / y_f.abs().max())
        times[cd] = best_time(lambda: lib(x, ids, w, *w0, layer0, ws, meta, y_w), r)
    out.append({"case": f"mxfp4_prefill_T{T}", "unit": "s", "dayzero": times["float32"],
                "baselines": {"fused_in_register": t_f}, "bound": None, "bound_name": None,
                "workspace_over_fused": times["float32"] / t_f,
                "compute_dtypes": {cd: {"s": t, "over_fused": t / t_f, "max_rel_err_vs_fused": errs[cd]}
                                   for cd, t in times.items()},
                "gflops": 2 * T * K_TOP * 3 * H * I / times["float32"] / 1e9})
    # decode, fresh routing each call, one slot
    n_calls = 8 if quick else 16
    xs = [torch.randn(1, H, generator=gen) for _ in range(n_calls)]
    rs = [torch.randperm(E, generator=gen)[:K_TOP][None] for _ in range(n_calls)]
    w1 = torch.rand(1, K_TOP, generator=gen)
    y1 = torch.empty(1, H)
    lib, ws, meta = workspace("float32", 1, False)

    def run_f():
        for a, b in zip(xs, rs):
            fused(a, b, w1, *w0, y1)

    def run_w():
        for a, b in zip(xs, rs):
            lib(a, b, w1, *w0, layer0, ws, meta, y1)
    run_f(), run_w()
    t_f, t_w = best_time(run_f, r) / n_calls, best_time(run_w, r) / n_calls
    out.append({"case": "mxfp4_decode_T1", "unit": "s", "dayzero": t_w, "baselines": {"fused_in_register": t_f},
                "bound": None, "bound_name": None, "workspace_over_fused": t_w / t_f})
    # decode sequence, 2 layers, skewed routing, an LRU cache of 96 MiB (16 fp32 experts, 32 bf16 ones)
    steps = 32 if quick else 64
    routes = [_zipf_routes(gen, steps) for _ in layers]  # each layer its own popularity order
    seq = [(torch.randn(1, H, generator=gen), [routes[li][t] for li in range(len(layers))]) for t in range(steps)]
    budget = 16 * workspace_slot_bytes(H, 2 * I, I, "float32")
    lids = [torch.tensor([li], dtype=torch.int32) for li in range(2)]

    def seq_f():
        for a, bs in seq:
            for b, wl in zip(bs, layers):
                fused(a, b, w1, *wl, y1)
    seq_f()
    t_f = best_time(seq_f, r) / (2 * steps)
    per = {}
    for cd in ("float32", "bfloat16"):
        slots = budget // workspace_slot_bytes(H, 2 * I, I, cd)
        lib, ws, meta = workspace(cd, slots, True)

        def seq_w():
            for a, bs in seq:
                for li, (b, wl) in enumerate(zip(bs, layers)):
                    lib(a, b, w1, *wl, lids[li], ws, meta, y1)
        seq_w()  # first pass from an empty cache
        cold = int(meta[1]) / int(meta[0])
        before = meta[:3].clone()
        t_w = best_time(seq_w, r) / (2 * steps)
        d = meta[:3] - before  # the timed passes: the sequence again with the cache warm from the pass before
        per[cd] = {"s": t_w, "over_fused": t_w / t_f, "slots": slots, "hit_rate_cold": cold,
                   "hit_rate": int(d[1]) / int(d[0])}
    out.append({"case": "mxfp4_decode_T1_lru_skewed", "unit": "s", "dayzero": per["float32"]["s"],
                "baselines": {"fused_in_register": t_f}, "bound": None, "bound_name": None,
                "workspace_over_fused": per["float32"]["over_fused"], "hit_rate": per["float32"]["hit_rate"],
                "cache_bytes": budget, "compute_dtypes": per,
                "note": "seconds per layer-call; 2 layers, Zipf(1.2) routing, cache shared by both layers; "
                        "hit_rate over the timed passes, hit_rate_cold over the first pass from an empty cache"})
    return out


def full_width_cases(target: dict, bw: float, quick: bool = False) -> list[dict]:
    """gpt-oss-20b expert width, decode T = 1 / 8: integer tiles vs fp32 tiles (module docstring)."""
    import torch
    import tvm

    from dayzero.codegen.kernels.moe import moe_experts_func
    from dayzero.codegen.kernels.dequant.gemv_int8 import int8_mode

    E_, k_, H_, I_ = 32, 4, 2880, 2880
    act = ("mul", ("silu", ("col", 0, 2, I_)), ("col", 1, 2, I_))
    gen = torch.Generator().manual_seed(3)

    def mx(O, K):
        return (torch.randint(0, 256, (E_, O, K // 32, 16), dtype=torch.uint8, generator=gen),
                torch.randint(119, 123, (E_, O, K // 32), dtype=torch.uint8, generator=gen))
    gub, gus = mx(2 * I_, H_)
    db, ds = mx(H_, I_)
    bgu, bd = torch.randn(E_, 2 * I_, generator=gen) * 0.01, torch.randn(E_, H_, generator=gen) * 0.01
    kerns = {}
    for name, q in (("int8", True), ("fp32", False)):
        if q and int8_mode(target) is None:
            return []
        f = moe_experts_func(E_, H_, 2 * I_, I_, k_, layout="nk", act=act, gate_up_bias=True, down_bias=True,
                             wfmt="mxfp4", int8=q)
        kerns[name] = tvm.compile(tvm.IRModule({"main": f}), target=target)["main"]
    per_expert = (2 * I_ * H_ + H_ * I_) * 17 // 32  # 4 bits per code + 1 scale byte per 32
    r = 2 if quick else 3
    out = []
    for T in (1, 8):
        n_calls = 4 if quick else 8
        xs = [torch.randn(T, H_, generator=gen) for _ in range(n_calls)]
        rs = [torch.stack([torch.randperm(E_, generator=gen)[:k_] for _ in range(T)]) for _ in range(n_calls)]
        w = torch.rand(T, k_, generator=gen)
        y = torch.empty(T, H_)
        routed = sum(int(torch.unique(b).numel()) for b in rs) / n_calls * per_expert
        times = {}
        for name, kern in kerns.items():
            def run(kern=kern):
                for a, b in zip(xs, rs):
                    kern(a, b, w, gub, gus, bgu, db, ds, bd, y)
            run()
            times[name] = best_time(run, r) / n_calls
        bound = routed / bw
        out.append({"case": f"mxfp4_full_decode_T{T}", "unit": "s", "dayzero": times["int8"],
                    "baselines": {"fused_fp32": times["fp32"]}, "bound": bound,
                    "bound_name": "routed experts' MXFP4 bytes / measured read bandwidth",
                    "routed_expert_bytes": routed, "achieved_GBps": routed / times["int8"] / 1e9,
                    "share_of_bound": bound / times["int8"], "fp32_share_of_bound": bound / times["fp32"],
                    "speedup_vs_fp32": times["fp32"] / times["int8"],
                    "note": "gpt-oss-20b experts (32, top-4, 2880 x 2880), fresh routing per call; dayzero: integer "
                            "tiles (--int8-activations), fused_fp32: the default fp32 tiles"})
    return out


def run_bench(quick: bool = False, mxfp4_routes_only: bool = False, full_width_only: bool = False) -> dict:
    import torch

    from dayzero.runtime.executor import use_all_cores
    from dayzero.targets.host import host_target_dict
    from dayzero.tools.bench import machine_info
    from dayzero.tools.bench_dequant import read_bandwidth

    target = host_target_dict()
    tvm_threads = use_all_cores()
    if full_width_only:
        bw = read_bandwidth(256 << 20)
        m = machine_info()
        m.update({"read_bandwidth_GBps": bw / 1e9, "target": target, "tvm_threads": tvm_threads})
        return {"suite": "moe", "machine": m, "results": full_width_cases(target, bw, quick)}
    if mxfp4_routes_only:
        m = machine_info()
        m.update({"target": target, "tvm_threads": tvm_threads})
        return {"suite": "moe", "machine": m, "results": mxfp4_route_cases(target, quick)}
    cfg, blk = _block()
    kern = _kernel(target)
    ex = blk.experts
    expert_bytes = (ex.gate_up_proj[0].numel() + ex.down_proj[0].numel()) * 4
    bw = read_bandwidth(256 << 20)
    gen = torch.Generator().manual_seed(1)
    results = []

    def route(x):
        with torch.no_grad():
            _, w, ids = blk.gate(x)
        return ids, w

    def upstream(impl, x, ids, w):
        cfg._experts_implementation = impl
        with torch.no_grad():
            return ex(x, ids, w)

    picked = {}

    def best_torch(name, fn, repeats):
        """``best_torch_time``, the thread count it used kept in ``picked`` (reported as ``baseline_threads``)."""
        t, picked[name] = best_torch_time(fn, repeats)
        return t

    # prefill
    T = 64 if quick else 256
    x = torch.randn(T, H, generator=gen)
    ids, w = route(x)
    y = torch.empty(T, H)
    kern(x, ids, w, ex.gate_up_proj.data, ex.down_proj.data, y)
    ref = upstream("eager", x, ids, w)
    err = float((y - ref).abs().max() / ref.abs().max())
    r = 2 if quick else 3
    t_dz = best_time(lambda: kern(x, ids, w, ex.gate_up_proj.data, ex.down_proj.data, y), r)
    base = {f"transformers_{impl}": best_torch(f"transformers_{impl}", lambda impl=impl: upstream(impl, x, ids, w), r)
            for impl in ("eager", "grouped_mm")}
    flops = 2 * T * K_TOP * 3 * H * I
    results.append({"case": f"prefill_T{T}", "unit": "s", "dayzero": t_dz, "baselines": base,
                    "baseline_threads": dict(picked), "bound": None,
                    "bound_name": None, "gflops": flops / t_dz / 1e9, "max_rel_err": err,
                    "speedup_vs_eager": base["transformers_eager"] / t_dz,
                    "note": "batched_mm skipped at prefill: it materialises T*k per-token weight copies (6 GiB)"})
    # decode: a fresh routing each call over the whole pool
    for T in (1, 8):
        n_calls = 4 if quick else 8
        xs = [torch.randn(T, H, generator=gen) for _ in range(n_calls)]
        routes = [route(xx) for xx in xs]
        y = torch.empty(T, H)
        uniq = [int(torch.unique(ids).numel()) for ids, _ in routes]

        def run_dz():
            for xx, (ids, w) in zip(xs, routes):
                kern(xx, ids, w, ex.gate_up_proj.data, ex.down_proj.data, y)

        def run_up(impl):
            for xx, (ids, w) in zip(xs, routes):
                upstream(impl, xx, ids, w)
        kern(xs[0], *routes[0], ex.gate_up_proj.data, ex.down_proj.data, y)
        errs = float((y - upstream("eager", xs[0], *routes[0])).abs().max())
        t_dz = best_time(run_dz, r) / n_calls
        base = {f"transformers_{impl}": best_torch(f"transformers_{impl}", lambda impl=impl: run_up(impl), r) / n_calls
                for impl in ("eager", "grouped_mm", "batched_mm")}
        routed = sum(uniq) / n_calls * expert_bytes
        act_bytes = T * K_TOP * (H + 2 * I + I + H) * 4 * 2 + T * H * 4  # x, G, A, D written+read, y
        read = routed + act_bytes
        results.append({"case": f"decode_T{T}", "unit": "s", "dayzero": t_dz, "baselines": base,
                        "baseline_threads": {k: picked[k] for k in base},
                        "bound": routed / bw, "bound_name": "routed expert bytes / measured read bandwidth",
                        "bytes_read": read, "routed_expert_bytes": routed, "bytes_ratio": read / routed,
                        "achieved_GBps": routed / t_dz / 1e9, "ratio_to_bound": t_dz / (routed / bw),
                        "max_abs_err": errs, "speedup_vs_eager": base["transformers_eager"] / t_dz})
    results += mxfp4_route_cases(target, quick)
    results += full_width_cases(target, bw, quick)
    m = machine_info()
    m.update({"read_bandwidth_GBps": bw / 1e9, "target": target, "tvm_threads": tvm_threads})
    return {"suite": "moe", "machine": m, "results": results}


@click.command("moe")
@click.option("--json", "as_json", is_flag=True, help="Print the bench JSON object.")
@click.option("--quick", is_flag=True, help="Prefill at 64 tokens, fewer repeats.")
@click.option("--mxfp4-routes", is_flag=True, help="Only the MXFP4 cases: fused-in-register vs workspace route.")
@click.option("--full-width", is_flag=True, help="Only the gpt-oss-20b width decode cases: integer vs fp32 tiles.")
def moe_command(as_json: bool, quick: bool, mxfp4_routes: bool, full_width: bool):
    """Routed experts (64 experts, top-4, 1024 x 512): dayzero vs transformers eager / grouped_mm / batched_mm, and
    MXFP4 experts decoded in registers vs converted into a reused workspace (+ LRU cache)."""
    out = run_bench(quick=quick, mxfp4_routes_only=mxfp4_routes, full_width_only=full_width)
    if as_json:
        click.echo(json.dumps(out, indent=1))
        return
    if "read_bandwidth_GBps" in out["machine"]:
        click.echo(f"read bandwidth {out['machine']['read_bandwidth_GBps']:.1f} GB/s, "
                   f"torch threads {out['machine']['threads']}, tvm threads {out['machine']['tvm_threads']}")
    for r in out["results"]:
        if "share_of_bound" in r:
            click.echo(f"{r['case']:28s} int8 {r['dayzero'] * 1e3:8.2f} ms ({r['share_of_bound']:.0%} of bound, "
                       f"{r['achieved_GBps']:.2f} GB/s)  fp32 {r['baselines']['fused_fp32'] * 1e3:8.2f} ms "
                       f"({r['fp32_share_of_bound']:.0%})  {r['speedup_vs_fp32']:.2f}x")
            continue
        if "workspace_over_fused" in r:
            extra = f", hit rate {r['hit_rate']:.2f}" if "hit_rate" in r else ""
            click.echo(f"{r['case']:28s} workspace {r['dayzero'] * 1e3:8.2f} ms  fused "
                       f"{r['baselines']['fused_in_register'] * 1e3:8.2f} ms  ({r['workspace_over_fused']:.2f}x)"
                       f"{extra}")
            continue
        base = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in r["baselines"].items())
        extra = f"{r['speedup_vs_eager']:.1f}x eager"
        if r["bound"] is not None:
            extra += f", {r['ratio_to_bound']:.2f}x bound, bytes {r['bytes_ratio']:.3f}x routed"
        click.echo(f"{r['case']:14s} {r['dayzero'] * 1e3:8.2f} ms  ({base})  {extra}")


if __name__ == "__main__":
    moe_command()
