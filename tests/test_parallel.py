"""codegen/parallel.py: a kernel's parallel loop stays parallel only where its work pays for the thread pool.

Every CPU kernel goes through the rule in ``schedule_kernel``: small static kernels run serial, large ones
parallel, and a kernel whose work depends on a symbol carries both loops behind a run-time size check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import tvm
import tvm_ffi
from tvm import te
from tvm.tirx import ForKind

from dayzero.codegen.parallel import MIN_TASK_WORK, parallel_by_work, work
from dayzero.codegen.program import Kernel
from dayzero.codegen.schedule import default_schedule, schedule_kernel

TARGET = tvm.target.Target({"kind": "llvm", "mcpu": "x86-64", "num-cores": 2})


def loop_kinds(func) -> list[ForKind]:
    kinds = []
    tvm_ffi.structural_walk(func.body, [(tvm.tirx.For, lambda f: kinds.append(f.kind))])
    return kinds


def exp2(rows, cols=64):
    """B[i, j] = exp(A[i, j]) * 2; A, B: (rows, cols) float32 (rows an int or a symbol)."""
    a = te.placeholder((rows, cols), "float32", name="A")
    b = te.compute((rows, cols), lambda i, j: te.exp(a[i, j]) * 2.0, name="B")
    return te.create_prim_func([a, b])


def scheduled(func, target=TARGET) -> tvm.tirx.PrimFunc:
    return schedule_kernel(Kernel("k", "exp", func, "key"), target, None)["main"]


def test_a_small_kernel_runs_serial_and_a_large_one_parallel():
    small = scheduled(exp2(16))  # 1024 elements: the fork/join costs more than the second core gives
    assert ForKind.PARALLEL in loop_kinds(default_schedule(exp2(16), TARGET)["main"])  # the schedule marks it
    assert ForKind.PARALLEL not in loop_kinds(small)
    large = scheduled(exp2(2 * MIN_TASK_WORK // 64))
    assert ForKind.PARALLEL in loop_kinds(large)


def test_one_core_target_never_parallel():
    one = tvm.target.Target({"kind": "llvm", "mcpu": "x86-64", "num-cores": 1})
    assert ForKind.PARALLEL not in loop_kinds(scheduled(exp2(4096), one))


def test_work_counts_innermost_iterations():
    x = te.placeholder((3, 5), "float32", name="x")
    w = te.placeholder((7, 5), "float32", name="w")
    k = te.reduce_axis((0, 5), "k")
    o = te.compute((3, 7), lambda i, j: te.sum(x[i, k] * w[j, k], axis=k), name="o")
    f = te.create_prim_func([x, w, o])
    # the reduction's multiply-adds (its block's init, one store per output, is not counted)
    assert int(tvm.sym.Analyzer().simplify(work(f.body))) == 3 * 7 * 5


def test_symbolic_work_chooses_at_run_time_and_both_variants_compute_the_op():
    n = te.var("n", "int64")
    func = scheduled(exp2(n))
    kinds = loop_kinds(func)
    assert ForKind.PARALLEL in kinds and ForKind.SERIAL in kinds
    assert "if" in func.script()
    lib = tvm.compile(tvm.IRModule({"main": func}), target=TARGET)["main"]
    for rows in (1, 7, 2 * MIN_TASK_WORK // 64 + 3):  # serial below the threshold, parallel above
        a = torch.randn(rows, 64)
        b = torch.empty_like(a)
        lib(a, b)
        torch.testing.assert_close(b, torch.exp(a) * 2)


def test_symbolic_work_that_pays_at_one_row_stays_parallel_with_no_branch():
    """Work growing with a symbol pays at every size when it pays at the symbol's least value (1): no run-time
    check and no serial copy of the loop nest (a 2880-wide projection already pays at one token)."""
    func = scheduled(exp2(te.var("n", "int64"), 2 * MIN_TASK_WORK))
    assert ForKind.PARALLEL in loop_kinds(func) and "if " not in func.script()
    lib = tvm.compile(tvm.IRModule({"main": func}), target=TARGET)["main"]
    x = torch.randn(3, 2 * MIN_TASK_WORK)
    y = torch.empty_like(x)
    lib(x, y)
    torch.testing.assert_close(y, torch.exp(x) * 2)


@pytest.mark.parametrize("cores", [1, 2])
def test_work_that_depends_on_an_enclosing_loop_keeps_the_schedules_choice(cores):
    """A triangular nest: the inner extent depends on the parallel loop's variable, so the work is not a function
    of the kernel's shapes; the rule leaves the loop as the schedule wrote it."""
    i, j = tvm.tirx.Var("i", "int64"), tvm.tirx.Var("j", "int64")
    buf = tvm.tirx.Var("B", tvm.ir.PointerType(tvm.ir.PrimType("float32")))
    store = tvm.tirx.Evaluate(tvm.tirx.call_extern("int32", "noop", buf, i, j))
    inner = tvm.tirx.For(j, 0, i + 1, ForKind.SERIAL, store)
    outer = tvm.tirx.For(i, 0, 8, ForKind.PARALLEL, inner)
    func = tvm.tirx.PrimFunc([buf], outer)
    assert work(outer) is not None
    assert parallel_by_work(func, cores).body.kind == ForKind.PARALLEL


def test_an_intermediate_shared_by_two_loops_stays_one_buffer_in_both_variants():
    """B = exp(A) then C = B * 2 with symbolic rows: each stage's loop gets its own serial variant; B, written by
    the first and read by the second, must stay the one buffer (a private copy per variant would leave C reading
    what no variant wrote)."""
    n = te.var("n", "int64")
    a = te.placeholder((n, 64), "float32", name="A")
    b = te.compute((n, 64), lambda i, j: te.exp(a[i, j]), name="B")
    c = te.compute((n, 64), lambda i, j: b[i, j] * 2.0, name="C")
    func = scheduled(te.create_prim_func([a, c]))
    assert func.script().count("if ") == 2
    lib = tvm.compile(tvm.IRModule({"main": func}), target=TARGET)["main"]
    for rows in (3, 2 * MIN_TASK_WORK // 64 + 1):
        x = torch.randn(rows, 64)
        y = torch.empty_like(x)
        lib(x, y)
        torch.testing.assert_close(y, torch.exp(x) * 2)


_FRESH_CHILD = """
import json, os, sys
import torch
from dayzero.runtime import load
import tvm
before = sorted(os.sched_getaffinity(0))
rt = load(sys.argv[1])
rt.prefill(torch.tensor([[1, 2, 3]]))
print(json.dumps([before, sorted(os.sched_getaffinity(0)), tvm.get_global_func("runtime.NumThreads")()]))
"""


@pytest.fixture(scope="module")
def fresh_process(compiled_factory):
    """[CPUs before, CPUs after, TVM's pool threads] of a fresh process that loads and runs an artifact with no
    thread setting of the user's: no pool has started before dayzero's import."""
    art, _, _ = compiled_factory("tiny_dense")
    env = {k: v for k, v in os.environ.items() if k not in ("TVM_BIND_THREADS", "TVM_NUM_THREADS", "OMP_NUM_THREADS")}
    r = subprocess.run([sys.executable, "-c", _FRESH_CHILD, str(art)], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


two_cpus = pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                              reason="needs a process allowed on two or more CPUs")


@two_cpus
def test_running_kernels_leaves_the_process_on_every_cpu_it_had(fresh_process):
    """TVM's pool pinned the thread that started it to one core; torch's threads, an eager reference and every
    process started afterwards inherited that core (a torch matmul ran at half speed beside a loaded artifact, and
    three test workers shared one of two cores)."""
    before, after, _ = fresh_process
    assert after == before and len(before) >= 2


@two_cpus
def test_kernels_run_on_every_cpu_of_the_process(fresh_process):
    """TVM sizes its pool once, at start, to half the CPUs on x86 (it assumes SMT), and ``config_threadpool``
    cannot grow it afterwards: on a 2-core host every kernel ran on one core."""
    before, _, threads = fresh_process
    assert threads == len(before)
