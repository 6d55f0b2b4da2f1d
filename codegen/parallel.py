"""Parallelism by work size: the one place that decides whether a kernel's parallel loop runs on the thread pool.

Schedules (the default rule, the hand-scheduled kernels, replayed tuning traces) mark the loop that *may* run in
parallel with ``parallel``; this rule, applied to every CPU kernel after its schedule (``schedule.schedule_kernel``),
keeps it parallel only where the work under it pays for the pool's fork/join:

    work(loop)  = extent x work(body)          (the number of innermost iterations: elements, or multiply-adds)
    parallel   <=>  work >= MIN_TASK_WORK x 2  (each of at least two tasks gets MIN_TASK_WORK), on a target of 2+ cores

A launch on TVM's pool costs ~7-10 us here (wake the workers, static split, join); an untuned scalar iteration
~1 ns, so below ~2 x 32K iterations the second core saves less than the launch costs (measured on znver4, 2 cores:
a 64x64 exp 1.4 us serial vs 8.6 us parallel, a 16x64x64 matmul 35 vs 45 us; the crossover lies near 64K
iterations). A work count that depends on a symbol (``seq``) gives both variants, chosen at run time:

    if work(seq) >= threshold:  for i in T.parallel(n): body
    else:                       for i in T.serial(n): body

so a 16-token prefill runs serial and a 4K-token one parallel, from one compiled kernel; a loop whose work pays
at every symbol's least value (1) stays parallel, with no branch (a 2880-wide projection pays at one token). Work
whose count is not a function of the kernel's parameters and shapes (a loop whose extent depends on an enclosing
loop, a ``while``) keeps the parallel loop the schedule wrote. Only whether to parallelise is decided here: TVM's
launch always wakes every worker of the pool (num_task = 0), so capping the task count below the core count would
not save the fork/join.
"""

from __future__ import annotations

import tvm
import tvm.sym
import tvm_ffi
from tvm.tirx import ForKind

from dayzero import InternalError

# innermost iterations each parallel task should get at least (see the module docstring for the measurement)
MIN_TASK_WORK = 32768


def cores_of(target: tvm.target.Target) -> int:
    """The target's core count (``num-cores``; 1 when the target does not say)."""
    n = target.attrs.get("num-cores") if target.attrs is not None else None
    return int(n) if n is not None else 1


def work(stmt) -> tvm.tirx.PrimExpr | None:
    """Innermost iterations of ``stmt`` as an int64 expression, or None where it cannot be counted."""
    from tvm.s_tir.stmt import SBlock, SBlockRealize
    from tvm.tirx import stmt as s

    if isinstance(stmt, s.For):
        inner = work(stmt.body)
        return None if inner is None else tvm.tirx.Cast("int64", stmt.extent) * inner
    if isinstance(stmt, s.SeqStmt):
        parts = [work(c) for c in stmt.seq]
        if any(p is None for p in parts):
            return None
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        return total
    if isinstance(stmt, SBlockRealize):
        return work(stmt.block)
    if isinstance(stmt, SBlock):
        return work(stmt.body)
    if isinstance(stmt, s.IfThenElse):
        a = work(stmt.then_case)
        b = work(stmt.else_case) if stmt.else_case is not None else tvm.tirx.const(0, "int64")
        return None if a is None or b is None else tvm.tirx.max(a, b)
    if isinstance(stmt, s.AttrStmt):
        return work(stmt.body)
    if isinstance(stmt, (s.BufferStore, s.Evaluate, s.Bind, s.AssertStmt, s.DeclBuffer, s.AllocBuffer)):
        return tvm.tirx.const(1, "int64")
    return None  # a while loop, a break, an unknown statement: not countable


def _defined_inside(loop) -> dict:
    """The variables bound inside ``loop`` (its own, inner loops', block iterators' and
    buffers, ``Bind``'s, allocated and declared buffers), by handle."""
    from tvm.s_tir.stmt import SBlock
    from tvm.tirx import stmt as s

    found = []

    def on_for(f):
        found.append(f.loop_var)

    def on_block(b):
        found.extend(iv.var for iv in b.iter_vars)
        found.extend(b.alloc_buffers)

    def on_bind(b):
        found.append(b.var)

    def on_buffer(b):
        found.append(b.buffer)

    tvm_ffi.structural_walk(loop, [(s.For, on_for), (SBlock, on_block), (s.Bind, on_bind),
                                   ((s.AllocBuffer, s.DeclBuffer), on_buffer)])
    return {v.__chandle__(): v for v in found}


def _free_vars(expr) -> list:
    found = []
    tvm_ffi.structural_walk(expr, [(tvm.tirx.Var, found.append)])
    return found


def _serial(loop):
    return tvm.tirx.For(loop.loop_var, loop.min, loop.extent, ForKind.SERIAL, loop.body, None, loop.annotations,
                        loop.step, loop.span)


def _serial_copy(loop, defined: dict, shared: dict) -> tuple:
    """A serial copy of ``loop`` with fresh variables (the two variants of one kernel may not share a binding),
    and the fresh copies of the ``shared`` buffers (root allocations only this loop uses) it uses: each variant
    gets its own, so a buffer's accesses stay under one loop nest and lowering compacts it there (one shared by
    both branches stays a root allocation of the full, possibly symbolic, shape)."""
    return _fresh_copy(_serial(loop), defined, shared)


def _fresh_copy(stmt, defined: dict, shared: dict) -> tuple:
    """(``stmt`` with fresh copies of the variables ``defined`` in it and of the ``shared`` buffers, the fresh
    copies of the shared buffers it uses)."""
    fresh = {h: tvm.tirx.Var(v.name, v.ty) for h, v in {**defined, **shared}.items()}
    used = {}

    def on_var(v, mutator):
        h = v.__chandle__()
        if h in shared:
            used[h] = fresh[h]
        return fresh.get(h, v)

    return tvm_ffi.structural_mutate(stmt, [(tvm.tirx.Var, on_var)]), list(used.values())


def _renamed(b: tvm.tirx.PrimFunc, a: tvm.tirx.PrimFunc):
    """``b``'s body over ``a``'s parameters: each parameter of ``b`` and each symbol of its shape replaced by
    ``a``'s at the same position (two computes of one op, e.g. tiled for few tokens and for many, each with its
    own ``T``), and every buffer whose shape names one of those symbols retyped over ``a``'s."""
    from tvm.tirx.buffer import BufferType

    if len(a.params) != len(b.params):
        raise InternalError(f"either: {len(a.params)} and {len(b.params)} parameters")
    to = {}
    for pa, pb in zip(a.params, b.params):
        to[pb.__chandle__()] = pa
        for da, db in zip(getattr(pa, "shape", ()), getattr(pb, "shape", ())):
            if isinstance(db, tvm.tirx.Var):
                to[db.__chandle__()] = da

    def on_var(v, mutator):
        h = v.__chandle__()
        if h not in to and isinstance(getattr(v, "ty", None), BufferType):
            ty = tvm_ffi.structural_mutate(v.ty, [(tvm.tirx.Var, on_var)])
            to[h] = v if ty.same_as(v.ty) else tvm.tirx.Var(v.name, ty)
        return to.get(h, v)

    return tvm_ffi.structural_mutate(b.body, [(tvm.tirx.Var, on_var)])


def either(cond: tvm.tirx.PrimExpr, a: tvm.tirx.PrimFunc, b: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc:
    """One kernel from two schedules of one op: ``a`` where ``cond`` (over ``a``'s parameters) holds at run
    time, else ``b`` (a schedule for many rows and one for few, with a symbolic row count). ``b`` may be its own
    function of the same signature: its parameters are renamed to ``a``'s (``_renamed``). ``b``'s own variables
    and root allocations are copied fresh (the two branches may not share a binding)."""
    from tvm.s_tir.stmt import SBlock, SBlockRealize

    ra, rb = a.body.block, _renamed(b, a).block
    allocs = {x.__chandle__(): x for x in rb.alloc_buffers}
    b_body, fresh = _fresh_copy(rb.body, _defined_inside(rb.body), allocs)
    root = SBlock(ra.iter_vars, ra.reads, ra.writes, ra.name_hint, tvm.tirx.IfThenElse(cond, ra.body, b_body),
                  ra.init, list(ra.alloc_buffers) + fresh, ra.match_buffers, ra.annotations, ra.span)
    return a.with_body(SBlockRealize(a.body.iter_values, a.body.predicate, root, a.body.span))


def _uses(stmt, buffers: dict) -> dict:
    """How often each of ``buffers`` (by handle) occurs in ``stmt``."""
    count = {}

    def on_var(v):
        h = v.__chandle__()
        if h in buffers:
            count[h] = count.get(h, 0) + 1

    tvm_ffi.structural_walk(stmt, [(tvm.tirx.Var, on_var)])
    return count


def _with_allocs(body, extra: list):
    """The root block ``body`` with ``extra`` buffers allocated beside its own."""
    from tvm.s_tir.stmt import SBlock, SBlockRealize

    b = body.block
    block = SBlock(b.iter_vars, b.reads, b.writes, b.name_hint, b.body, b.init, list(b.alloc_buffers) + extra,
                   b.match_buffers, b.annotations, b.span)
    return SBlockRealize(body.iter_values, body.predicate, block, body.span)


def work_at(w: tvm.tirx.PrimExpr, size: int) -> int | None:
    """``w`` (a work count: sums and products of extents, so growing with each symbol) with every symbol at
    ``size``; None where that does not fold to a number."""
    w = tvm.sym.Analyzer().simplify(tvm_ffi.structural_mutate(
        w, [(tvm.tirx.Var, lambda v, mutator: tvm.tirx.const(size, v.ty.dtype))]))
    return w.value if isinstance(w, tvm.tirx.IntImm) else None


def parallel_by_work(func: tvm.tirx.PrimFunc, cores: int, min_task_work: int = MIN_TASK_WORK) -> tvm.tirx.PrimFunc:
    """Every parallel loop of ``func`` kept parallel, made serial, or both behind a run-time size check."""
    analyzer = tvm.sym.Analyzer()
    threshold = tvm.tirx.const(min_task_work * 2, "int64")
    from tvm.s_tir.stmt import SBlockRealize

    changed = [False]
    rooted = isinstance(func.body, SBlockRealize)
    root_allocs = {b.__chandle__(): b for b in func.body.block.alloc_buffers} if rooted else {}
    uses = _uses(func.body, root_allocs)
    extra = []

    def on_for(loop, mutator):
        if loop.kind != ForKind.PARALLEL:
            return mutator.default_mutate(loop)
        # a nested parallel loop under a parallel one is the schedule's business: left as written
        w = work(loop)
        defined = _defined_inside(loop)
        if w is None or any(v.__chandle__() in defined for v in _free_vars(w)):
            return loop
        w = analyzer.simplify(w)
        changed[0] = True
        if cores < 2:
            return _serial(loop)
        if isinstance(w, tvm.tirx.IntImm):
            return loop if w.value >= min_task_work * 2 else _serial(loop)
        least = work_at(w, 1)
        if least is not None and least >= min_task_work * 2:  # pays at the symbols' least (1): at every size
            return loop
        inside = _uses(loop, root_allocs)
        # a root allocation used only by this loop (all its uses but the declaration) is private to the loop
        private = {h: b for h, b in root_allocs.items() if inside.get(h, 0) and inside[h] == uses[h] - 1}
        serial, fresh = _serial_copy(loop, defined, private)
        extra.extend(fresh)
        return tvm.tirx.IfThenElse(w >= threshold, loop, serial)

    new_body = tvm_ffi.structural_mutate(func.body, [(tvm.tirx.For, on_for)])
    if not changed[0]:
        return func
    return func.with_body(_with_allocs(new_body, extra) if extra else new_body)
