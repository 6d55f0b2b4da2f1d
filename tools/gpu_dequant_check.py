"""GPU numerics + timing of the dequant kernels (CUDA); one script, prints one JSON object.

    python -m dayzero.tools.gpu_dequant_check [--quick]

Without a GPU (or without a CUDA torch) it prints {"gpu": false, ...} and exits 0. With one: for every kernel
(MXFP4 / FP8-block x GEMV / GEMM) on expert shapes it compiles for the device's arch, checks y against
torch (dequantise with lowprec, matmul in fp64 on the CPU) and times it with CUDA events, alongside the weight
bytes per second of the GEMV and the GFLOP/s of the GEMM, and torch's fp32 matmul on pre-dequantised weights.
"""

from __future__ import annotations

import json
import sys


def _tensor_dev(a, dev):
    import torch

    return torch.from_numpy(a.copy()).to(dev)


def main(quick: bool = False) -> dict:
    import numpy as np
    import torch

    out: dict = {"gpu": False, "results": []}
    if not torch.cuda.is_available():
        out["why"] = "torch.cuda.is_available() is False"
        return out
    import tvm

    from ..codegen.kernels import dequant as dq
    from ..frontend import lowprec

    dev = torch.device("cuda")
    major, minor = torch.cuda.get_device_capability()
    target = {"kind": "cuda", "arch": f"sm_{major}{minor}"}
    out.update(gpu=True, device=torch.cuda.get_device_name(), target=target)
    rng = np.random.default_rng(0)
    shapes = [(2880, 2880)] if quick else [(2880, 2880), (2048, 7168), (7168, 2048)]

    def timed(fn, iters=20):
        fn()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(iters):
            fn()
        e.record()
        torch.cuda.synchronize()
        return s.elapsed_time(e) / iters / 1e3

    for O, K in shapes:
        w = (rng.standard_normal((O, K)) * 0.05).astype(np.float32)
        packs = {"mxfp4": lowprec.quantize_mxfp4(w), "fp8_block": lowprec.quantize_fp8_block(w)}
        for fmt, (a, b) in packs.items():
            W = lowprec.dequant_mxfp4(a, b) if fmt == "mxfp4" else lowprec.dequant_fp8_block(a, b)
            a_np = np.ascontiguousarray(a).view(np.uint8)
            wa, wb = _tensor_dev(a_np, dev), _tensor_dev(np.asarray(b), dev)
            wbytes = a_np.nbytes + np.asarray(b).nbytes
            Wd = torch.from_numpy(W).to(dev)
            for kind, T in ((f"{fmt}_gemv", 1), (f"{fmt}_gemv", 4), (f"{fmt}_gemm", 128), (f"{fmt}_gemm", 1024)):
                rec = {"case": f"{kind}_{O}x{K}_T{T}", "unit": "s"}
                try:
                    args = (T, O, K) if kind.endswith("gemv") else (O, K)
                    func = getattr(dq, kind)(*args, target=target)
                    lib = tvm.compile(tvm.IRModule({"main": func}), target=target)
                    f = lib["main"]
                    x = torch.randn(T, K, device=dev)
                    y = torch.empty(T, O, device=dev)
                    f(x, wa, wb, y)
                    torch.cuda.synchronize()
                    ref = x.double().cpu() @ torch.from_numpy(W).double().T
                    rec["max_rel_err"] = float((y.double().cpu() - ref).abs().max() / ref.abs().max())
                    rec["ok"] = rec["max_rel_err"] < 1e-4
                    rec["dayzero"] = timed(lambda: f(x, wa, wb, y))
                    rec["baselines"] = {"torch_matmul_predequantised": timed(lambda: x @ Wd.T)}
                    if kind.endswith("gemv"):
                        rec["weight_GBps"] = wbytes / rec["dayzero"] / 1e9
                    else:
                        rec["gflops"] = 2 * T * O * K / rec["dayzero"] / 1e9
                except Exception as exc:  # noqa: BLE001 - report every kernel, keep going
                    rec["ok"] = False
                    rec["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"
                out["results"].append(rec)
    out["all_ok"] = all(r.get("ok") for r in out["results"])
    return out


if __name__ == "__main__":
    print(json.dumps(main(quick="--quick" in sys.argv), indent=1))
