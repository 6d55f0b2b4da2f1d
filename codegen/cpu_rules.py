"""The rule-based default tier for CPU: ordered schedule rules, each returning None where it does not apply.

    dense_linear (GEMM / GEMV, x[..., k] . w[n, k])  ->  dlight_reduction  ->  parallel_loops (the generic, last)

A rule takes the normalised kernel (an ``IRModule`` with ``main``) and the target and returns a scheduled module,
or None: "not mine". Whether a loop a rule marks parallel really runs on the thread pool is decided afterwards,
from the kernel's work, by ``parallel.py``.

``dense_linear`` takes the ``linear`` lowering (``codegen/lower/linear.py``): a block ``C[m.., n] += cast(X[m.., k])
* cast(W[n, k])`` with float32 or bfloat16 inputs and a float32 accumulator, optionally followed by an elementwise
epilogue (bias, cast). Both operands are contiguous along k, so the reduction is vectorised along k: each output
keeps ``LANES`` partial sums (an rfactor over the inner k lanes) and sums them once at the end. A tile of ``NR``
rows of w (NR accumulators, every loaded x vector shared by NR FMAs) is the parallel loop, and every row of x
(T, a symbol in prefill) runs through it while the tile stays in cache:

    for no in parallel(N / NR):
        for m in range(M):                                       # no tail, no predicate: any T, one kernel
            acc[LANES, NR] = 0                                   # local: registers
            for ko in range(K / LANES):
                for ni (unrolled):  acc[:, ni] += X[m, ko*LANES : +LANES] * W[no*NR + ni, ko*LANES : +LANES]
            C[m, no*NR + ni] = sum(acc[:, ni])

LANES is the widest of 16 / 8 / 4 dividing K (K not a multiple of 4: the rule does not apply), NR the widest of
8 / 4 / 2 / 1 dividing N, so no loop has a tail. Not done yet: several x rows per tile (register reuse of the w
vectors in GEMM), k blocking for L1, packing.
"""

from __future__ import annotations

import logging

import tvm
from tvm.ir.expr import Call, TensorLoad

logger = logging.getLogger(__name__)

NR_CHOICES = (8, 4, 2, 1)  # w rows per tile: NR accumulators of LANES floats (the widest dividing N)
LANE_CHOICES = (16, 8, 4)
INPUT_DTYPES = ("float32", "bfloat16")


def _strip_cast(e):
    while isinstance(e, tvm.tirx.Cast):
        e = e.value
    return e


def _var_of(e):
    """The block iterator an index is (None for any other expression)."""
    return e if isinstance(e, tvm.tirx.Var) else None


def _same(a, b) -> bool:
    return a is not None and b is not None and a.same_as(b)


def _dense_block(sch, block_rv):
    """(N, K) when the block is ``C[lead.., n] += cast(X[lead.., k]) * cast(W[n, k])`` with fp32/bf16 inputs
    and a fp32 accumulator and static N and K; else None."""
    block = sch.get(block_rv)
    iters = list(block.iter_vars)
    kinds = [iv.iter_type for iv in iters]
    if len(iters) < 3 or kinds[-1] != tvm.tirx.IterVar.CommReduce or any(
            k != tvm.tirx.IterVar.DataPar for k in kinds[:-1]):
        return None
    body = block.body
    if not isinstance(body, tvm.tirx.BufferStore) or block.init is None:
        return None
    out = body.buffer
    if out.dtype != "float32" or not isinstance(body.value, tvm.tirx.Add):
        return None
    acc, prod = body.value.a, body.value.b
    if not (isinstance(acc, TensorLoad) and acc.source.same_as(out)):
        return None
    if isinstance(prod, Call) and prod.op.name == "tirx.if_then_else":  # a masked reduction (extent 0)
        return None
    if not isinstance(prod, tvm.tirx.Mul):
        return None
    x, w = _strip_cast(prod.a), _strip_cast(prod.b)
    if not (isinstance(x, TensorLoad) and isinstance(w, TensorLoad)):
        return None
    if x.source.dtype not in INPUT_DTYPES or w.source.dtype not in INPUT_DTYPES:
        return None
    lead, n, k = [iv.var for iv in iters[:-2]], iters[-2].var, iters[-1].var
    xi, wi = [_var_of(i) for i in x.indices], [_var_of(i) for i in w.indices]
    if len(wi) != 2 or not (_same(wi[0], n) and _same(wi[1], k)):
        return None
    if len(xi) != len(lead) + 1 or not _same(xi[-1], k) or not all(_same(a, b) for a, b in zip(xi, lead)):
        return None
    if not all(isinstance(iv.dom.extent, tvm.tirx.IntImm) for iv in iters[-2:]):
        return None
    return int(iters[-2].dom.extent), int(iters[-1].dom.extent)


def dense_linear(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule | None:
    """GEMM / GEMV of the ``linear`` form, register-tiled and vectorised along k (module docstring); None when
    the kernel is not one block of that form plus elementwise epilogues."""
    sch = tvm.s_tir.Schedule(mod)
    blocks = sch.get_child_blocks(sch.get_sblock("root")) if _has_root(sch) else []
    dense = [(b, _dense_block(sch, b)) for b in blocks]
    dense = [(b, d) for b, d in dense if d is not None]
    if len(dense) != 1:
        return None
    block, (n_extent, k_extent) = dense[0]
    lanes = next((v for v in LANE_CHOICES if k_extent % v == 0), None)
    if lanes is None:
        return None
    others = [b for b in blocks if not b.same_as(block)]
    if any(sch.get(b).init is not None for b in others):  # only elementwise epilogues
        return None
    k = sch.get_loops(block)[-1]
    ko, ki = sch.split(k, [None, lanes])
    rf = sch.rfactor(ki, factor_axis=0)
    *_, m, n, ko, ki = sch.get_loops(rf)
    nr = next(v for v in NR_CHOICES if n_extent % v == 0)
    no, ni = sch.split(n, [None, nr])
    sch.reorder(no, m, ko, ni, ki)
    sch.vectorize(ki)
    sch.unroll(ni)
    sch.reverse_compute_at(block, m)
    lanes_loop, *outputs = _below(sch, block, m)
    sch.reorder(*outputs, lanes_loop)  # each output sums its lanes at once
    sch.set_scope(rf, 0, "local")
    sch.parallel(no)
    sch.decompose_reduction(rf, ko)  # the accumulators' zeroing, before the k loop
    for epi in others:
        ls = sch.get_loops(epi)
        sch.parallel(sch.fuse(*ls) if len(ls) > 1 else ls[0])
    return sch.mod


def dlight_reduction(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule | None:
    """dlight's CPU reduction rule (row reductions: softmax, norms). Not ``dl.cpu.GEMV``: it vectorises across
    strided rows with a 256-step unroll, LLVM then spends 10-40 s on one small expert bmm, and the code is no
    faster than parallel loops."""
    from tvm.s_tir import dlight as dl

    with target:
        out = dl.ApplyDefaultSchedule(dl.cpu.Reduction())(mod)
    attrs = out["main"].attrs
    return out if attrs is not None and "tirx.is_scheduled" in attrs else None


def parallel_loops(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
    """The generic rule, last: the leading spatial loops of every block fused and parallel; a pure elementwise
    block's inner loop vectorised. Always applies (a function it cannot analyse stays as it is)."""
    from tvm.s_tir.dlight.analysis import normalize_prim_func

    sch = tvm.s_tir.Schedule(mod)
    try:
        infos = normalize_prim_func(sch)
    except Exception:  # noqa: BLE001 - an unusual function: leave it unscheduled (still correct on CPU)
        infos = None
    if not infos:
        return mod
    for info in infos:
        kinds = info.dom_kind()
        n_s = len(kinds) - len(kinds.lstrip("S"))
        if n_s == 0:
            continue
        try:
            loops = sch.get_loops(info.block_rv)[:n_s]
            fused = sch.fuse(*loops) if n_s > 1 else loops[0]
            extent = sch.get(fused).extent
            if kinds == "S" * len(kinds) and isinstance(extent, tvm.tirx.IntImm) and extent.value % 16 == 0:
                outer, inner = sch.split(fused, [None, 16])
                sch.parallel(outer)
                sch.vectorize(inner)
            else:
                sch.parallel(fused)
        except Exception as err:  # noqa: BLE001 - best effort; the block stays serial
            logger.debug("cpu fallback left block %s serial: %s", info.name, err)
    return sch.mod


# the CPU default tier, in order: the first that returns a module schedules the kernel
CPU_DEFAULT_RULES = (dense_linear, dlight_reduction, parallel_loops)


def cpu_default(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
    """The first of ``CPU_DEFAULT_RULES`` that takes the (normalised) kernel; a rule that trips on an unusual
    kernel counts as not applying."""
    for rule in CPU_DEFAULT_RULES:
        try:
            out = rule(mod, target)
        except (tvm.error.InternalError, tvm.s_tir.schedule.ScheduleError) as err:
            logger.debug("cpu rule %s failed: %s", rule.__name__, err)
            continue
        if out is not None:
            return out
    return mod


def _has_root(sch) -> bool:
    try:
        sch.get_sblock("root")
        return True
    except Exception:  # noqa: BLE001 - a function without a root block (written scheduled): not this rule's
        return False


def _below(sch, block, loop) -> list:
    """The loops of ``block`` inside ``loop``."""
    loops = sch.get_loops(block)
    at = next(i for i, lp in enumerate(loops) if sch.get(lp).same_as(sch.get(loop)))
    return loops[at + 1:]


