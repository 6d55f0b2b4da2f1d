"""FP8-block routed experts: the fused ``moe_experts_fp8`` kernel vs torch, cases of ``dayzero bench dequant``.

Expert shape of a real model (Qwen3-30B-A3B: hidden 2048, expert width 768, top-8), DeepSeek's layout: each
expert's gate / up / down float8_e4m3fn with fp32 scales per 128x128 block (random bytes over every finite E4M3
code, scales around 2^-8). A pool of E_POOL experts (fp8 pool ~150 MB, larger than the caches). Cases (DESIGN.md's
bench JSON fields):
- decode_moe_fp8_<H>x<I>_top<k>_T1: one token, a fresh routing per call, so the routed experts come from memory.
  dayzero = the fused kernel (E4M3 x scale decoded in registers); bound = the routed experts' stored bytes (FP8 +
  scales) / read bandwidth measured in the same run; baselines.torch_eager = dequantise each routed expert
  (fp8 -> fp32 times the repeated block scales), then x @ W.T, activation, @ W_d.T (what a framework without FP8
  kernels does).
- prefill_moe_fp8_<H>x<I>_top<k>_T<T>: T tokens routed over the pool; baselines.torch_matmul_predequantised = the
  per-expert loop (gather the expert's tokens, matmul, SwiGLU, matmul, weighted index_add) on fp32 weights
  dequantised beforehand, i.e. torch with the dequantisation free; ``ratio_vs_torch_matmul`` = it / dayzero;
  baselines.dayzero_fp32_kernel = the same moe kernel on those fp32 weights (``ratio_vs_fp32_kernel``: what the
  in-kernel FP8 decode costs).
Both numbers of a case are taken in the same run, side by side; ``max_rel_err`` is the kernel vs the torch result.
"""

from __future__ import annotations

import json

from ..frontend import lowprec
from .bench_dequant import best_time, best_torch_time

H, I, K_TOP, E_POOL = 2048, 768, 8, 32
ACT = ("mul", ("silu", ("col", 0, 1, I)), ("col", I, 1, I))
BLOCK = lowprec.FP8_BLOCK


def _fp8_pool(gen, shape):
    import torch

    b = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    b[(b & 0x7F) == 0x7F] ^= 1  # no NaN codes
    s = torch.exp2(torch.randint(-10, -6, (shape[0], shape[1] // BLOCK[0], shape[2] // BLOCK[1]), generator=gen)
                   .float())
    return b.view(torch.float8_e4m3fn), s


def _dequant(wq, s):
    from ..passes.ir.reference_dequant import fp8_blocks_dequant_ref

    return fp8_blocks_dequant_ref(wq, s, BLOCK)


def _torch_experts(x, ids, w, wgu, wd, dequant_each):
    """transformers' eager expert loop over the routed experts; weights dequantised per call or given fp32."""
    import torch

    y = torch.zeros_like(x)
    flat = ids.reshape(-1)
    for e in torch.unique(flat).tolist():
        a = (flat == e).nonzero(as_tuple=True)[0]
        tok = a // ids.shape[1]
        gu = _dequant(*wgu(e)) if dequant_each else wgu(e)
        dn = _dequant(*wd(e)) if dequant_each else wd(e)
        g = x[tok] @ gu.T
        h = torch.nn.functional.silu(g[:, :I]) * g[:, I:]
        y.index_add_(0, tok, (h @ dn.T) * w.reshape(-1)[a, None])
    return y


def _routing(gen, T):
    import torch

    ids = torch.stack([torch.randperm(E_POOL, generator=gen)[:K_TOP] for _ in range(T)])
    return ids, torch.rand(T, K_TOP, generator=gen)


def fp8_expert_cases(bw: float, quick: bool = False) -> list[dict]:
    """The FP8 expert cases at read bandwidth BW (bytes/s, measured by the caller in the same run)."""
    import torch
    import tvm

    from ..codegen.kernels import moe as km
    from ..runtime.executor import use_all_cores
    from ..targets.host import host_target_dict

    threads = use_all_cores()  # TVM's pool on every core, as the runtime runs it
    gen = torch.Generator().manual_seed(0)
    gq, gs = _fp8_pool(gen, (E_POOL, 2 * I, H))
    dq_, ds = _fp8_pool(gen, (E_POOL, H, I))
    f = km.moe_experts_func(E_POOL, H, 2 * I, I, K_TOP, layout="nk", act=ACT, gate_up_bias=False, down_bias=False,
                            wfmt="fp8", gate_up_block=BLOCK, down_block=BLOCK)
    kern = tvm.compile(tvm.IRModule({"main": f}), target=host_target_dict())["main"]
    per_expert = 3 * H * I + 4 * (gs[0].numel() + ds[0].numel())
    out = []

    x = torch.randn(1, H, generator=gen)
    y = torch.empty(1, H)
    routes = [_routing(gen, 1) for _ in range(16)]
    kern(x, routes[0][0], routes[0][1], gq, gs, dq_, ds, y)
    ref = _torch_experts(x, *routes[0], lambda e: (gq[e], gs[e]), lambda e: (dq_[e], ds[e]), True)
    err = float((y - ref).abs().max() / ref.abs().max())

    def dz():
        for ids, w in routes:
            kern(x, ids, w, gq, gs, dq_, ds, y)

    def eager():
        for ids, w in routes[:4]:
            _torch_experts(x, ids, w, lambda e: (gq[e], gs[e]), lambda e: (dq_[e], ds[e]), True)

    t_dz = best_time(dz, 3 if quick else 5) / len(routes)
    t_eager, th = best_torch_time(eager, 2)
    t_eager /= 4
    routed = K_TOP * per_expert
    out.append({
        "case": f"decode_moe_fp8_{H}x{I}_top{K_TOP}_T1", "unit": "s", "dayzero": t_dz,
        "baselines": {"torch_eager": t_eager}, "bound": routed / bw, "bound_name": "routed_expert_bytes/read_bandwidth",
        "weight_bytes": routed, "achieved_GBps": routed / t_dz / 1e9, "fraction_of_bandwidth": routed / bw / t_dz,
        "speedup_vs_torch_eager": t_eager / t_dz, "max_rel_err": err, "tvm_threads": threads,
        "baseline_threads": th,
    })

    gu32 = [_dequant(gq[e], gs[e]) for e in range(E_POOL)]
    d32 = [_dequant(dq_[e], ds[e]) for e in range(E_POOL)]
    wgu32, wd32 = torch.stack(gu32), torch.stack(d32)
    fd = km.moe_experts_func(E_POOL, H, 2 * I, I, K_TOP, layout="nk", act=ACT, gate_up_bias=False, down_bias=False)
    dense = tvm.compile(tvm.IRModule({"main": fd}), target=host_target_dict())["main"]
    for T in (128,) if quick else (128, 512):
        x = torch.randn(T, H, generator=gen)
        ids, w = _routing(gen, T)
        y = torch.empty(T, H)
        kern(x, ids, w, gq, gs, dq_, ds, y)
        ref = _torch_experts(x, ids, w, gu32.__getitem__, d32.__getitem__, False)
        err = float((y - ref).abs().max() / ref.abs().max())
        t_dz = best_time(lambda: kern(x, ids, w, gq, gs, dq_, ds, y), 3)
        t_mm, th = best_torch_time(lambda: _torch_experts(x, ids, w, gu32.__getitem__, d32.__getitem__, False), 3)
        t_dense = best_time(lambda: dense(x, ids, w, wgu32, wd32, y), 3)
        flops = 2 * T * K_TOP * 3 * H * I
        out.append({
            "case": f"prefill_moe_fp8_{H}x{I}_top{K_TOP}_T{T}", "unit": "s", "dayzero": t_dz,
            "baselines": {"torch_matmul_predequantised": t_mm, "dayzero_fp32_kernel": t_dense}, "bound": None,
            "bound_name": None, "gflops": flops / t_dz / 1e9, "ratio_vs_torch_matmul": t_mm / t_dz,
            "ratio_vs_fp32_kernel": t_dense / t_dz, "max_rel_err": err,
            "tvm_threads": threads, "baseline_threads": th,
        })
    return out


if __name__ == "__main__":  # the FP8 expert cases alone: python -m dayzero.tools.bench_fp8_experts [--quick]
    import sys

    from ..runtime.executor import use_all_cores
    from .bench_dequant import _machine, read_bandwidth

    q = "--quick" in sys.argv
    bw = read_bandwidth((256 if q else 1024) << 20)
    res = fp8_expert_cases(bw, q)
    print(json.dumps({"suite": "dequant", "machine": _machine(bw, use_all_cores()), "results": res}, indent=1))
