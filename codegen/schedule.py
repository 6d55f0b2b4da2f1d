"""The schedule-rule chain: every kernel gets the first schedule that applies.

    hand-scheduled (a rule for this op/shape)  ->  tuned (a record in the tuning database)  ->  default (dlight /
    parallel fallback)  ->  generic (the unscheduled TE loops: always correct, slow)

A rule is ``fn(kernel, target) -> IRModule | None``; None means "not mine". Later work adds hand-scheduled rules
to ``HAND_SCHEDULED`` (pattern kernels: dequant GEMM/GEMV, grouped expert GEMM, sparse attention); the route a
kernel took is recorded for ``dayzero report``.
"""

from __future__ import annotations

import logging
from typing import Callable

import tvm

from . import tuning
from .program import Kernel

log = logging.getLogger(__name__)

Rule = Callable[[Kernel, tvm.target.Target], "tvm.IRModule | None"]

# op name -> rule; filled by the modules that define hand-scheduled kernels
HAND_SCHEDULED: dict[str, Rule] = {}


def schedule_kernel(k: Kernel, target: tvm.target.Target, db: "tuning.TuningDatabase | None") -> tvm.IRModule:
    if k.func.attrs is not None and "tirx.is_scheduled" in k.func.attrs:  # written scheduled (lower.PRIMFUNCS)
        k.route = "hand-scheduled"
        return tvm.IRModule({"main": k.func})
    rule = HAND_SCHEDULED.get(k.op)
    if rule is not None:
        mod = rule(k, target)
        if mod is not None:
            k.route = "hand-scheduled"
            return mod
    if db is not None:
        mod = tuning.lookup(db, k.func, target)
        if mod is not None:
            k.route = "tuned"
            return mod
    try:
        if "cpu" in target.keys:
            # dlight's CPU GEMV rule vectorises across strided rows with a 256-step unroll: LLVM then spends
            # 10-40 s on one tiny bmm and the code is no faster than parallel loops. Parallel loops it is.
            mod = tuning._cpu_parallel_fallback(tuning.normalize(k.func))
        else:
            mod = tuning.default_schedule(k.func, target)
        k.route = "default"
        return mod
    except Exception as e:  # noqa: BLE001 - a rule that breaks on an unusual kernel: keep the plain loops
        log.debug("default schedule failed for %s: %s", k.name, e)
        k.route = "generic"
        return tuning.normalize(k.func)
