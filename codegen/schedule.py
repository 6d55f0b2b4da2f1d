"""The schedule-rule chain: every kernel gets the first schedule that applies.

    hand-scheduled (written scheduled, or a rule for this op)  ->  tuned (a record in the tuning database)
    ->  default (cpu_rules.py's tier on CPU, dlight on GPU)  ->  generic (the unscheduled TE loops: correct, slow)

A rule returns a scheduled ``IRModule`` or None, meaning "not mine" (an op's hand-scheduled rule in the kernel
table, ``codegen/kernels/table.py``, is ``fn(kernel, target)``). The route a kernel took is recorded
for ``dayzero report``. ``SCHEDULE_RULES`` is that chain, in order; the default rule (dlight's GPU rules; on CPU
``cpu_rules.py``'s ordered tier: dense GEMM / GEMV, row reductions, parallel loops last) is defined here, the tuned
rule reads the database (``tuning.py``) that the tuner (``tuner.py``) fills. On CPU, whether each parallel loop
really runs in parallel is decided last, from the kernel's work (``parallel.py``).

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
from .cpu_rules import RULE_ERRORS, cpu_default
from .kernels.table import KERNELS
from .parallel import cores_of, parallel_by_work
from .program import Kernel, make_prim_func
from .tuning import TuningDatabase, apply_trace, as_target, kernel_name, normalize

logger = logging.getLogger(__name__)

Rule = Callable[[Kernel, tvm.target.Target], "tvm.IRModule | None"]

TUNING_SIZE_CAP = 128
# ops worth tuning: contractions and reductions (elementwise kernels are bandwidth-bound and gain little)
TUNABLE_OPS = ("linear", "mm", "bmm", "matmul", "scaled_dot_product_attention", "softmax.int", "_softmax",
               "mean.dim", "sum.dim_IntList", "rms_norm", "embedding")


def tunable_rank(k: Kernel) -> int | None:
    """Where ``k`` stands in the tuning order (TUNABLE_OPS), None when it is not worth tuning. A fused kernel
    (passes/fuse.py) ranks as its first tunable member: fusion puts softmax and the norms, with their element-wise
    prologue and epilogue, into ``fused`` kernels; one of element-wise members only is not tuned."""
    if k.op in TUNABLE_OPS:
        return TUNABLE_OPS.index(k.op)
    if k.op == "fused" and k.node is not None:
        ranks = [TUNABLE_OPS.index(op) for op, *_ in k.node.attr["body"] if op in TUNABLE_OPS]
        return min(ranks) if ranks else None
    return None


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


def default_schedule(prim_func, target) -> tvm.IRModule:
    """The rule-based default: dlight's ``dl.gpu`` rules for GPU targets; on CPU the first of
    ``cpu_rules.CPU_DEFAULT_RULES`` that takes the kernel (dense GEMM / GEMV, dlight's row reduction, then
    parallel loops)."""
    from tvm.s_tir import dlight as dl

    t = as_target(target)
    mod = normalize(prim_func)
    if "gpu" not in t.keys:
        return cpu_default(mod, t)
    try:  # dl.gpu.Fallback applies to everything it can; what is left will not build
        with t:
            return dl.ApplyDefaultSchedule(dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(),
                                           dl.gpu.GeneralReduction(), dl.gpu.Fallback())(mod)
    except RULE_ERRORS as err:  # a rule that trips on this kernel
        logger.debug("dlight rules failed on %s: %s", kernel_name(prim_func), err)
        return normalize(prim_func)


# ---- the rules: (kernel, target, database or None, symbol bounds) -> scheduled module, or None: not mine ----------

def _written_scheduled(k: Kernel, target, db, symbols) -> tvm.IRModule | None:
    """A kernel written scheduled (a compute of the kernel table marked it ``tirx.is_scheduled``)."""
    return tvm.IRModule({"main": k.func}) if is_hand_scheduled(k) else None


def _hand_rule(k: Kernel, target, db, symbols) -> tvm.IRModule | None:
    """The kernel table's schedule rule for the kernel's op, when it takes this kernel."""
    entry = KERNELS.get(k.op)
    rule = entry.schedule if entry is not None else None
    return rule(k, target, symbols) if rule is not None else None


def _tuned(k: Kernel, target, db, symbols) -> tvm.IRModule | None:
    """The trace of the tuning database's record for the kernel, when the tuned schedule won and replays."""
    if db is None:
        return None
    rec = db.get(tuning_workload(k, symbols), target)
    if rec is None or not rec.tuned_wins:
        return None
    try:
        mod = apply_trace(k.func, rec.trace)
    except Exception as e:  # noqa: BLE001 - a trace that does not replay on the symbolic kernel
        logger.debug("tuned trace of %s does not replay on the symbolic kernel: %s", k.name, e)
        return None
    k.tuned = {"default_s": rec.default_s, "tuned_s": rec.tuned_s, "trials": rec.trials}
    return mod


def _default(k: Kernel, target, db, symbols) -> tvm.IRModule | None:
    """``default_schedule``; None when a rule breaks on an unusual kernel."""
    try:
        return default_schedule(k.func, target)
    except Exception as e:  # noqa: BLE001 - a rule that breaks on an unusual kernel: keep the plain loops
        logger.debug("default schedule failed for %s: %s", k.name, e)
        return None


def _generic(k: Kernel, target, db, symbols) -> tvm.IRModule:
    """The unscheduled TE loops: correct, slow; always applies."""
    return normalize(k.func)


# (route recorded on the kernel, rule), first that returns a module wins
SCHEDULE_RULES = (
    ("hand-scheduled", _written_scheduled),
    ("hand-scheduled", _hand_rule),
    ("tuned", _tuned),
    ("default", _default),
    ("generic", _generic),
)


def schedule_kernel(k: Kernel, target: tvm.target.Target, db: TuningDatabase | None,
                    symbols: dict[str, tuple[int, int]] | None = None) -> tvm.IRModule:
    """The first of ``SCHEDULE_RULES`` that takes the kernel; its route goes into ``k.route``. On CPU its parallel
    loops then stay parallel only where their work pays for the thread pool (``parallel.parallel_by_work``). A
    kernel of the kernel table on a target its ``supports`` refuses is a dayzero bug (the pass that created it
    asks targets/capabilities.py first)."""
    entry = KERNELS.get(k.op)
    if entry is not None and k.node is not None and not entry.supports(target.kind.name, k.node):
        raise InternalError(f"the {k.op} kernel does not take {k.name} on target kind {target.kind.name} (the "
                            f"pass that created it asks targets/capabilities.py first)")
    for route, rule in SCHEDULE_RULES:
        mod = rule(k, target, db, symbols or {})
        if mod is not None:
            k.route = route
            if target.kind.name == "llvm":  # whether each parallel loop pays for the pool: one rule, parallel.py
                mod = tvm.IRModule({"main": parallel_by_work(mod["main"], cores_of(target))})
            return mod
    raise InternalError(f"no schedule rule took kernel {k.name} (the generic rule takes every kernel)")
