"""The schedule-rule chain: every kernel gets the first schedule that applies.

    hand-scheduled (written scheduled, or a rule for this op)  ->  tuned (a record in the tuning database)
    ->  default (parallel loops on CPU, dlight on GPU)  ->  generic (the unscheduled TE loops: correct, slow)

A rule is ``fn(kernel, target) -> IRModule | None``; None means "not mine". The route a kernel took is recorded
for ``dayzero report``.

Tuning and symbolic shapes: MetaSchedule measures static shapes, so a kernel whose shape has symbols (``seq``) is
tuned as a copy specialised at ``tuning_size`` (the symbol's bound, capped), and the recorded trace is replayed on
the symbolic kernel (splits of a symbolic loop get predicates; a trace that does not replay falls back to the
default). The database is keyed by the specialised kernel, so every model with that kernel shares the record.
"""

from __future__ import annotations

import logging
from typing import Callable

import tvm

from dayzero import InternalError
from . import tuning
from .kernels.table import KERNELS
from .program import Kernel, make_prim_func

log = logging.getLogger(__name__)

Rule = Callable[[Kernel, tvm.target.Target], "tvm.IRModule | None"]

TUNING_SIZE_CAP = 128
# ops worth tuning: contractions and reductions (elementwise kernels are bandwidth-bound and gain little)
TUNABLE_OPS = ("linear", "mm", "bmm", "matmul", "scaled_dot_product_attention", "softmax.int", "_softmax",
               "mean.dim", "sum.dim_IntList", "rms_norm", "embedding")


def tuning_workload(k: Kernel, symbols: dict[str, tuple[int, int]]) -> tvm.tirx.PrimFunc:
    """The static-shape copy of a kernel that the tuner measures (the kernel itself when it has no symbols)."""
    if k.node is None:
        return k.func
    free = set()
    for t in list(k.node.types) + [i.type for i in k.node.inputs]:
        free |= t.free_symbols()
    if not free:
        return k.func
    bind = {s: min(symbols[s][1], TUNING_SIZE_CAP) for s in free}
    return make_prim_func(k.node, k.name, bind)


def is_hand_scheduled(k: Kernel) -> bool:
    return k.func.attrs is not None and "tirx.is_scheduled" in k.func.attrs


def _tuned(k: Kernel, target, db, symbols) -> tvm.IRModule | None:
    rec = db.get(tuning_workload(k, symbols), target)
    if rec is None or not rec.tuned_wins:
        return None
    try:
        mod = tuning.apply_trace(k.func, rec.trace)
    except Exception as e:  # noqa: BLE001 - a trace that does not replay on the symbolic kernel
        log.debug("tuned trace of %s does not replay on the symbolic kernel: %s", k.name, e)
        return None
    k.tuned = {"default_s": rec.default_s, "tuned_s": rec.tuned_s, "trials": rec.trials}
    return mod


def schedule_kernel(k: Kernel, target: tvm.target.Target, db: "tuning.TuningDatabase | None",
                    symbols: dict[str, tuple[int, int]] | None = None) -> tvm.IRModule:
    entry = KERNELS.get(k.op)
    if entry is not None and k.node is not None and not entry.supports(target.kind.name, k.node):
        raise InternalError(f"the {k.op} kernel does not take {k.name} on target kind {target.kind.name} (the "
                            f"pass that created it asks targets/capabilities.py first)")
    if is_hand_scheduled(k):  # written scheduled (a compute of codegen/kernels/table.py)
        k.route = "hand-scheduled"
        return tvm.IRModule({"main": k.func})
    rule = entry.schedule if entry is not None else None
    if rule is not None:
        mod = rule(k, target)
        if mod is not None:
            k.route = "hand-scheduled"
            return mod
    if db is not None:
        mod = _tuned(k, target, db, symbols or {})
        if mod is not None:
            k.route = "tuned"
            return mod
    try:
        mod = tuning.default_schedule(k.func, target)
        k.route = "default"
        return mod
    except Exception as e:  # noqa: BLE001 - a rule that breaks on an unusual kernel: keep the plain loops
        log.debug("default schedule failed for %s: %s", k.name, e)
        k.route = "generic"
        return tuning.normalize(k.func)


def tune_kernels(kernels: list[Kernel], target: tvm.target.Target, db: "tuning.TuningDatabase",
                 symbols: dict[str, tuple[int, int]], trials: int, minutes: float | None,
                 progress=None) -> dict:
    """Tune every tunable kernel that has no record yet, heaviest ops first, within the time budget.

    ``progress(kernel, trials_done, best_s)`` is called as trials complete. Returns {kernel: TuneResult note}."""
    import time

    deadline = time.monotonic() + minutes * 60 if minutes else None
    order = sorted((k for k in kernels if not is_hand_scheduled(k) and k.op in TUNABLE_OPS),
                   key=lambda k: TUNABLE_OPS.index(k.op))
    done = {}
    for k in order:
        work = tuning_workload(k, symbols)
        if db.get(work, target) is not None:
            continue
        left = None if deadline is None else (deadline - time.monotonic()) / 60
        if left is not None and left <= 0:
            break
        cb = (lambda name, n, best, kname=k.name: progress(kname, n, best)) if progress else None
        res = tuning.tune(work, target, trials=trials, minutes=left, db=db, progress=cb)
        done[k.name] = {"trials": res.trials_done, "default_s": res.default_s, "tuned_s": res.tuned_s}
    return done
