"""codegen/tuner.py and codegen/tuning.py: in-process MetaSchedule tuning and the persistent tuning database.

One real tuning run (a 128^3 fp32 matmul, 8 trials, replay-trace) is shared by the module; the other tests read,
corrupt, copy and rewrite its record. Total run time is dominated by MetaSchedule's one-time
``import tvm.s_tir.tensor_intrin`` (17-30 s on the 2-core CI machines).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import tvm
from tvm import te

from dayzero import UserError
from dayzero.codegen import tuner, tuning
from dayzero.codegen.program import Kernel
from dayzero.codegen.schedule import default_schedule, schedule_kernel
from dayzero.codegen.trace_check import TraceRefused, check_trace
from dayzero.targets.host import cuda_target_dict, host_target_dict

FAST_TIMER = tuner.TimerConfig(repeat=1, min_repeat_ms=5)


def matmul(n=128, names=("A", "B", "C"), symbol=None):
    """C[i, j] = sum_k A[k, i] * B[k, j] (C = A^T B); A, B, C: (n, n) float32. A read by columns is a shape no
    CPU default rule takes (the generic parallel loop around a naive k loop schedules it), so tuning has something
    to beat: the plain A @ B goes to the register-tiled matmul rule, which 8 trials do not reliably beat."""
    a = te.placeholder((n, n), "float32", name=names[0])
    b = te.placeholder((n, n), "float32", name=names[1])
    k = te.reduce_axis((0, n), "k")
    c = te.compute((n, n), lambda i, j: te.sum(a[k, i] * b[k, j], axis=k), name=names[2])
    f = te.create_prim_func([a, b, c])
    return f.with_attr("global_symbol", symbol) if symbol else f


@pytest.fixture(scope="module")
def target():
    return tvm.target.Target(host_target_dict())


@pytest.fixture(scope="module")
def tuned(tmp_path_factory, target):
    """(db, result, progress calls) of one real tuning run."""
    db = tuning.TuningDatabase(tmp_path_factory.mktemp("tuning-db"))
    calls = []
    res = tuner.tune(matmul(symbol="mm128"), target, trials=8, minutes=None, db=db,
                      progress=lambda *a: calls.append(a), strategy="replay-trace", trials_per_iter=4,
                      timer=FAST_TIMER)
    return db, res, calls


def run(mod, target, *arrays):
    lib = tvm.compile(mod, target=target)
    args = [tvm.runtime.tensor(a) for a in arrays]
    lib["main"](*args)
    return args[-1].numpy()


def check_matmul(mod, target, n=128):
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal((n, n)).astype("float32") for _ in range(2))
    out = run(mod, target, a, b, np.zeros((n, n), "float32"))
    np.testing.assert_allclose(out, a.T @ b, rtol=1e-4, atol=1e-4)


# -- tuning -------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_tuning_runs_real_trials_and_stores_one_record(tuned, target):
    db, res, calls = tuned
    assert res.trials_done == 8 and res.valid_trials > 0
    assert res.tuned_s is not None and res.default_s is not None and res.tuned_s > 0
    assert res.record_path.is_file() and res.record_path.parent.name == tuning.target_key(target)
    rec = json.loads(res.record_path.read_text())
    assert rec["workload_hash"] == tuning.workload_hash(matmul()) == res.record_path.stem
    assert rec["target"] == str(target) and rec["trials"] == 8 and rec["kernel"] == "mm128"
    assert isinstance(rec["trace"], list) and rec["default_s"] == res.default_s and rec["tuned_s"] == res.tuned_s


@pytest.mark.slow
def test_progress_reports_kernel_trials_and_best_time(tuned):
    _, res, calls = tuned
    assert [c[1] for c in calls] == [4, 8]  # one call per measured batch
    assert all(c[0] == "mm128" for c in calls)
    assert calls[-1][2] is not None and calls[-1][2] > 0


@pytest.mark.slow
def test_tuned_schedule_beats_naive_default_and_is_correct(tuned, target):
    _, res, _ = tuned
    assert res.tuned and res.tuned_s < res.default_s  # default: a parallel loop around a naive k loop
    check_matmul(res.mod, target)


@pytest.mark.slow
def test_second_lookup_uses_the_record_without_tuning(tuned, target, monkeypatch):
    db, _, _ = tuned
    calls = []
    monkeypatch.setattr(tuner.ms, "tune_tir", lambda *a, **k: calls.append(a))
    mod = tuning.lookup(db, matmul(), target)
    assert mod is not None and calls == []
    check_matmul(mod, target)


@pytest.mark.slow
def test_separately_built_kernel_with_other_names_hits_the_same_record(tuned, target):
    db, res, _ = tuned
    again = matmul(names=("X", "W", "Y"), symbol="another_model_kernel")
    assert tuning.workload_hash(again) == res.record_path.stem
    assert tuning.lookup(db, again, target) is not None
    assert tuning.lookup(db, matmul(n=64), target) is None  # another shape is another workload


@pytest.mark.slow
def test_workload_hash_is_stable_across_processes():
    code = "from tests.test_tuning import matmul; from dayzero.codegen import tuning; " \
           "print(tuning.workload_hash(matmul()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.stdout.strip() == tuning.workload_hash(matmul())


@pytest.mark.slow
def test_record_from_another_target_is_not_used(tuned, target, tmp_path):
    db, res, _ = tuned
    other = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512" if target.attrs.get("mcpu") != "skylake-avx512"
                               else "znver4", "num-cores": 2})
    assert tuning.lookup(db, matmul(), other) is None
    # even a record file copied under the other target's directory is rejected (it names its target)
    moved = tuning.TuningDatabase(tmp_path)
    dest = moved.record_path(matmul(), other)
    dest.parent.mkdir(parents=True)
    dest.write_text(res.record_path.read_text())
    assert moved.get(matmul(), other) is None and tuning.lookup(moved, matmul(), other) is None


# -- the database on disk -----------------------------------------------------------------------------------------


def copy_db(tuned, tmp_path, target):
    _, res, _ = tuned
    db = tuning.TuningDatabase(tmp_path)
    path = db.record_path(matmul(), target)
    path.parent.mkdir(parents=True)
    path.write_text(res.record_path.read_text())
    return db, path


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated", "garbage", "not-a-record", "empty"])
def test_corrupt_record_is_skipped_with_a_warning(tuned, target, tmp_path, damage):
    db, path = copy_db(tuned, tmp_path, target)
    text = path.read_text()
    path.write_text({"truncated": text[: len(text) // 2], "garbage": "\x00\xff not json",
                     "not-a-record": json.dumps({"hello": 1}), "empty": ""}[damage])
    with pytest.warns(tuning.TuningDatabaseWarning, match="corrupt"):
        assert tuning.lookup(db, matmul(), target) is None
    with pytest.warns(tuning.TuningDatabaseWarning):
        assert list(db.records()) == []


@pytest.mark.slow
def test_trace_that_no_longer_applies_is_skipped_with_a_warning(tuned, target, tmp_path):
    db, path = copy_db(tuned, tmp_path, target)
    rec = json.loads(path.read_text())
    rec["trace"] = [[["GetSBlock", [], ["no_such_block", "main"], ["b0"]]], []]
    path.write_text(json.dumps(rec))
    with pytest.warns(tuning.TuningDatabaseWarning, match="does not apply"):
        assert tuning.lookup(db, matmul(), target) is None


@pytest.mark.slow
def test_real_records_pass_the_trace_allowlist(tuned):
    _, res, _ = tuned
    trace = json.loads(res.record_path.read_text())["trace"]
    assert trace is not None and any(i[0] == "Annotate" for i in trace[0])
    check_trace(trace)  # raises if the allowlist misses what MetaSchedule emits


def _softmax(n=64, m=256):
    from tvm import topi

    x = te.placeholder((n, m), "float32", name="X")
    return te.create_prim_func([x, topi.nn.softmax(x)])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llvm", "cuda"])
def test_metaschedule_design_spaces_pass_the_trace_allowlist(kind):
    """Every trace MetaSchedule's default design spaces and postprocessors make (matmul: tiling, caches, unroll,
    binding; softmax: rfactor / cross-thread reduction, inlining) is accepted, on CPU and GPU targets."""
    target = tvm.target.Target(host_target_dict() if kind == "llvm" else {
        **cuda_target_dict(), "max_threads_per_block": 1024, "max_shared_memory_per_block": 49152,
        "thread_warp_size": 32, "max_num_threads": 1024})
    kinds = set()
    for func in (matmul(64), _softmax()):
        mod = tuning.normalize(func)
        ctx = tuner.ms.TuneContext(mod=mod, target=target, space_generator="post-order-apply", task_name="t",
                                    rand_state=0)
        for sch in ctx.generate_design_space():
            sch.enter_postproc()
            for pp in ctx.space_generator.postprocs:
                if not pp.apply(sch):
                    break
            trace = tuning.trace_to_json(sch.trace)
            check_trace(trace)
            kinds |= {i[0] for i in trace[0]}
    assert {"SamplePerfectTile", "Split", "Annotate", "Fuse"} <= kinds
    assert ("Bind" in kinds) == (kind == "cuda")


_LLVM_IR = '"; ModuleID = \'x\'\ndefine void @f() { call i32 @system(i8* null) ret void }"'
_REFUSED = {  # name in the warning -> what is appended to the real trace
    "pragma_import_llvm": [["GetSBlock", [], ["root", "main"], ["b900"]],
                           ["Annotate", ["b900", _LLVM_IR], ["pragma_import_llvm"], []]],
    "pragma_import_c": [["GetSBlock", [], ["root", "main"], ["b900"]],
                        ["Annotate", ["b900", '"int f(){return system(0);}"'], ["pragma_import_c"], []]],
    "TransformLayout": [["GetSBlock", [], ["C", "main"], ["b900"]],
                        ["TransformLayout", ["b900", 0, 1, "index_map:{}", "None"], [], []]],
    "meta_schedule.tiling_structure": [["GetSBlock", [], ["C", "main"], ["b900"]],
                                       ["Annotate", ["b900", '"__import__(\'os\')"'],
                                        ["meta_schedule.tiling_structure"], []]],
    "pragma_auto_unroll_max_step": [["GetSBlock", [], ["C", "main"], ["b900"]],
                                    ["Annotate", ["b900", '"x"'], ["pragma_auto_unroll_max_step"], []]],
    "index_map": [["GetSBlock", [], ["C", "main"], ["b900"]],
                  ["GetLoops", ["b900", "index_map:{}"], [], ["l901"]]],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(_REFUSED))
def test_record_with_a_disallowed_instruction_or_annotation_is_refused(tuned, target, tmp_path, name):
    db, path = copy_db(tuned, tmp_path, target)
    rec = json.loads(path.read_text())
    rec["trace"][0] += _REFUSED[name]
    path.write_text(json.dumps(rec))
    with pytest.warns(tuning.TuningDatabaseWarning, match=f"refused.*{name}"):
        assert tuning.lookup(db, matmul(), target) is None
    with pytest.raises(TraceRefused, match=name):  # replaying it directly is refused too, before any step
        tuning.apply_trace(matmul(), rec["trace"])
    # the compile's path: the kernel keeps its default schedule, and that schedule computes the matmul
    k = Kernel("mm128", "matmul", matmul(symbol="mm128"), "k")
    with pytest.warns(tuning.TuningDatabaseWarning, match=name):
        mod = schedule_kernel(k, target, db)
    assert k.route == "default" and k.tuned is None
    check_matmul(mod, target)


@pytest.mark.slow
def test_leftover_temp_file_of_a_killed_writer_is_ignored(tuned, target, tmp_path):
    db, path = copy_db(tuned, tmp_path, target)
    (path.parent / f".{path.stem}.abc123.tmp").write_text('{"format": "dayzero-tun')  # killed mid-write
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(list(db.records())) == 1 and tuning.lookup(db, matmul(), target) is not None


@pytest.mark.slow
def test_concurrent_writers_leave_a_valid_record(tuned, target, tmp_path):
    db, path = copy_db(tuned, tmp_path, target)
    base = json.loads(path.read_text())
    writer = textwrap.dedent(f"""
        import json, sys
        from dayzero.codegen import tuning
        db = tuning.TuningDatabase({str(tmp_path)!r})
        base = json.loads({json.dumps(json.dumps(base))})
        for i in range(40):
            base["tuned_s"] = 1e-3 * (1 + (i * 7 + int(sys.argv[1])) % 11)  # the slower ones must not win
            base["trials"] = int(sys.argv[1]) * 1000 + i
            db.put(tuning.TuningRecord.from_json(base), json.loads(base["target"]))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", writer, str(k)]) for k in (1, 2)]
    seen = 0
    while any(p.poll() is None for p in procs):  # a reader never sees a partial file
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            seen += db.get(matmul(), target) is not None
    assert [p.wait() for p in procs] == [0, 0] and seen > 0
    final = db.get(matmul(), target)
    assert final is not None and final.tuned_s <= min(base["tuned_s"], 1e-3)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp files left behind
    assert tuning.lookup(db, matmul(), target) is not None


def test_database_root_from_argument_env_var_or_home(monkeypatch, tmp_path, target):
    monkeypatch.setenv("DAYZERO_TUNING_DIR", str(tmp_path / "env"))
    assert tuning.TuningDatabase().root == tmp_path / "env"
    assert tuning.TuningDatabase(tmp_path / "arg").root == tmp_path / "arg"
    monkeypatch.delenv("DAYZERO_TUNING_DIR")
    assert str(tuning.TuningDatabase().root).endswith(os.path.join(".cache", "dayzero", "tuning"))
    key = tuning.target_key(target)
    assert key.startswith("llvm-") and key != tuning.target_key(cuda_target_dict())


# -- budgets, failures, odd inputs --------------------------------------------------------------------------------


@pytest.mark.slow
def test_time_budget_stops_tuning_early(target, tmp_path):
    res = tuner.tune(matmul(n=64), target, trials=10_000, minutes=0.03, db=tuning.TuningDatabase(tmp_path),
                      strategy="replay-trace", trials_per_iter=4, timer=FAST_TIMER)
    assert 0 < res.trials_done < 200
    assert res.record_path.is_file()


def test_failed_builds_and_runs_are_error_results_not_crashes(target, monkeypatch):
    from tvm.s_tir.meta_schedule.builder import BuilderInput

    def broken_build(mod, tgt):
        raise RuntimeError("LLVM says no")

    store = tuner._ArtifactStore()
    mod = tuning.normalize(matmul(n=16))
    builder = tuner._InProcessBuilder(store, None)
    monkeypatch.setattr(tuner, "_build", broken_build)
    (bad,) = builder.build([BuilderInput(mod, target)])
    assert bad.artifact_path is None and "LLVM says no" in bad.error_msg
    monkeypatch.undo()
    (good,) = builder.build([BuilderInput(mod, target)])
    assert good.error_msg is None and good.artifact_path.startswith("dayzero-inproc/")
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo
    from tvm.s_tir.meta_schedule.runner import RunnerInput

    runner = tuner._InProcessRunner(store, FAST_TIMER)
    args_info = ArgInfo.from_prim_func(mod["main"])
    (fut,) = runner.run([RunnerInput("dayzero-inproc/404", "cpu", args_info)])
    assert fut.result().run_secs is None and "no built module" in fut.result().error_msg
    (ok,) = runner.run([RunnerInput(good.artifact_path, "cpu", args_info)])
    assert ok.result().error_msg is None and ok.result().run_secs[0] > 0


def test_symbolic_shapes_keep_the_default_untuned(target, tmp_path):
    n = te.var("n")
    a = te.placeholder((n, 64), "float32", name="A")
    b = te.compute((n, 64), lambda i, j: a[i, j] * 2.0, name="B")
    res = tuner.tune(te.create_prim_func([a, b]), target, trials=4, minutes=None,
                      db=tuning.TuningDatabase(tmp_path))
    assert res.trials_done == 0 and res.tuned_s is None and "symbolic" in res.note
    assert list(tmp_path.iterdir()) == []


def test_bad_budgets_are_user_errors(target, tmp_path):
    with pytest.raises(UserError):
        tuner.tune(matmul(), target, trials=0, minutes=None, db=tuning.TuningDatabase(tmp_path))
    with pytest.raises(UserError):
        tuner.tune(matmul(), target, trials=4, minutes=0, db=tuning.TuningDatabase(tmp_path))


# -- the rule-based default ---------------------------------------------------------------------------------------


def test_default_schedule_of_matmul_is_correct(target):
    check_matmul(default_schedule(matmul(), target), target)


def test_default_schedule_parallelizes_and_vectorizes_elementwise(target):
    a = te.placeholder((64, 256), "float32", name="A")
    b = te.compute((64, 256), lambda i, j: a[i, j] * 2.0 + 1.0, name="B")
    mod = default_schedule(te.create_prim_func([a, b]), target)
    text = mod.script()
    assert "T.parallel" in text and "T.vectorized" in text
    x = np.random.default_rng(0).standard_normal((64, 256)).astype("float32")
    np.testing.assert_allclose(run(mod, target, x, np.zeros_like(x)), x * 2 + 1, rtol=1e-6)


def test_default_schedule_for_cuda_builds_without_a_gpu():
    cuda = tvm.target.Target(cuda_target_dict())
    mod = default_schedule(matmul(n=64), cuda)
    assert mod["main"].attrs["tirx.is_scheduled"]
    src = tvm.compile(mod, target=cuda).mod.imports[0].inspect_source()
    assert "__global__" in src


@pytest.mark.slow
def test_tuning_works_beside_unnamed_handlers_on_metaschedules_logger(target, tmp_path):
    """pytest >= 9 (and any application) may attach handlers without a name to MetaSchedule's non-propagating
    logger; MetaSchedule's create_loggers re-lists handlers by name and failed on them ('NoneType' object has no
    attribute 'format'), which broke the fresh-clone test run. Tuning works, and the handler stays attached."""
    import logging

    log = logging.getLogger("tvm.s_tir.meta_schedule")
    foreign = logging.Handler()
    log.addHandler(foreign)
    try:
        res = tuner.tune(matmul(n=32), target, trials=2, minutes=None, db=tuning.TuningDatabase(tmp_path),
                          strategy="replay-trace", trials_per_iter=2, timer=FAST_TIMER)
        assert res.trials_done > 0 and res.record_path.is_file()
        assert foreign in log.handlers
    finally:
        log.removeHandler(foreign)


def test_fused_reductions_are_tuned_and_elementwise_chains_are_not():
    """Fusion makes softmax and the norms ``fused`` kernels: ``--tune`` still takes them (ranked as their first
    tunable member), not a fused chain of element-wise ops only; the tuner's static copy of a fused kernel has no
    symbol left."""
    from dayzero.codegen.program import make_prim_func
    from dayzero.codegen.schedule import tunable_rank, tuning_workload, TUNABLE_OPS
    from dayzero.passes.fuse import fuse
    from tests.passes.ir_spec import ir

    g, _ = fuse(ir("""graph main symbols(seq in [1, 64]) {
      %0 = input {name="h"} : float32[seq, 64]
      %1 = weight {name="w"} : float32[64]
      %10 = weight {name="wl"} : float32[8, 64]
      %2 = pow.Tensor_Scalar(%0) {exponent=2} : float32[seq, 64]
      %3 = mean.dim(%2) {dim=[-1], dtype=null, keepdim=true} : float32[seq, 1]
      %4 = rsqrt(%3) : float32[seq, 1]
      %5 = mul.Tensor(%0, %4) : float32[seq, 64]
      %6 = mul.Tensor(%1, %5) : float32[seq, 64]
      %7 = linear(%6, %10) {bias=false} : float32[seq, 8]
      %8 = exp(%6) : float32[seq, 64]
      %9 = neg(%8) : float32[seq, 64]
      return %7, %9
    }
    """))
    kernels = {n.op if n.op != "fused" else ("norm" if any(op == "mean.dim" for op, *_ in n.attr["body"])
                                             else "chain"): Kernel(n.op, n.op, make_prim_func(n, "k"), "", node=n)
               for n in g.nodes() if n.op in ("fused", "linear")}
    assert set(kernels) == {"norm", "chain", "linear"}, set(kernels)
    assert tunable_rank(kernels["linear"]) == 0
    assert tunable_rank(kernels["norm"]) == TUNABLE_OPS.index("mean.dim")
    assert tunable_rank(kernels["chain"]) is None
    work = tuning_workload(kernels["norm"], {"seq": (1, 64)})
    assert "seq" not in work.script()
