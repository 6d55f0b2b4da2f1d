"""Schedule steps the dequant GEMV and GEMM kernels share: CUDA's rule chain, the lookup-lane check, marking a
PrimFunc scheduled."""

from __future__ import annotations

import tvm
from tvm import tirx

from dayzero import InternalError


def check_lookup_lanes(sch, loop, L: int):
    if int(sch.get(loop).extent) != L:
        raise InternalError(f"the vpermps lookup needs its loop vectorised by exactly {L} lanes")


def has_block(sch, name: str) -> bool:
    try:
        sch.get_sblock(name)
        return True
    except Exception:  # noqa: BLE001 - tvm raises a ScheduleError subclass
        return False


def cuda_rules(sch, target: dict) -> tirx.PrimFunc:
    """CUDA: the decode stages are inlined into the reduction, then dlight's GPU rules, first that applies:
    GEMV (thread-bound reduction), Matmul, Reduction, Fallback. Rule-based, not hand-tuned: numbers on a GPU come
    from tools/gpu_dequant_check.py."""
    from tvm.s_tir import dlight as dl

    func = sch.mod["main"]
    mod = tvm.IRModule({"main": func})
    with tvm.target.Target(target):
        mod = dl.ApplyDefaultSchedule(dl.gpu.GEMV(), dl.gpu.Matmul(), dl.gpu.Reduction(), dl.gpu.Fallback())(mod)
    return mod["main"].with_attr("tirx.is_scheduled", True)


def mark_scheduled(sch) -> tirx.PrimFunc:
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)
