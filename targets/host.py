"""The host CPU target: LLVM with the detected mcpu (never generic x86-64 by accident)."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def host_cpu() -> str:
    import tvm.target.codegen

    return str(tvm.target.codegen.llvm_get_system_cpu())


def host_target_dict() -> dict:
    """TVM 0.27 JSON-dict target for this machine, e.g. {"kind": "llvm", "mcpu": "znver4", "num-cores": 2}."""
    import os

    return {"kind": "llvm", "mcpu": host_cpu(), "num-cores": os.cpu_count() or 1}


def cuda_target_dict(arch: str = "sm_90") -> dict:
    return {"kind": "cuda", "arch": arch}


HOST_TARGET = "host"


def host_spec():
    """This machine's CPU as a capacity-planning target: dayzero's own runtime, which computes in fp32 and keeps
    every weight that is not stored low-precision in fp32 (``dayzero plan --target host``)."""
    import psutil

    from dayzero.targets.spec import TargetSpec

    return TargetSpec(HOST_TARGET, int(psutil.virtual_memory().total), ("fp32",), False, 0.0,
                      description=f"this machine's CPU ({host_cpu()}): dayzero's runtime, fp32", compute_dtype="fp32")
