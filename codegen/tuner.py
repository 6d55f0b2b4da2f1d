"""The tuner: MetaSchedule with an in-process builder and runner; its records go to the tuning database.

    kernel PrimFunc ──► tuning.lookup(db, f, target) ──► record? ──yes──► apply its trace to a fresh schedule
                                                    │ no
                                                    ▼
                        tune(f, target, trials, minutes, db)   (only under `dayzero compile --tune`)
                          MetaSchedule search ─► _InProcessBuilder (tvm.compile in this process)
                                              ─► _InProcessRunner  (time_evaluator on random inputs)
                          best trace + default/tuned times ──► one JSON record, written atomically

Why in process: the stock ``LocalBuilder`` builds every candidate in a fresh popen worker pool whose
``default_build`` starts with ``import tvm.s_tir.tensor_intrin`` (17-26 s here), so with the default 30 s build
timeout nearly every candidate timed out. ``tvm.compile`` of one candidate in this process takes ~0.02 s.
The price: a candidate that segfaults takes the process with it (MetaSchedule's postprocessors verify every
candidate before it is built, and integer inputs are zero-filled so index tensors stay in bounds).

Measured on this machine (2 cores shared with other jobs, LLVM mcpu=rocketlake, "random" cost model as xgboost
is not installed, the one-time tensor_intrin import excluded; reproduce with
``python tools/bench_tuning_probe.py --mode default|inproc --kernel matmul|reduction --trials N
[--per-iter K] [--strategy evolutionary|replay-trace]``). Valid trials per minute:

    kernel                         stock LocalBuilder/Runner           in-process (this module)
    matmul 256^3 fp32              2.7  (16 tried in 179 s, 8 valid)   94 evolutionary (64 in 41 s), 263 replay-trace
    row sum 1024x4096 fp32         0    (16 tried in 318 s, 0 valid)   106 evolutionary (60 in 34 s)

    default (rule-based) vs tuned: matmul 16.4 ms -> 0.18 ms (dl.cpu has no matmul rule: parallel naive loop);
                                   row sum 4.3-4.6 ms -> 0.6-1.8 ms (noisy under the shared load)

In process, one batch of 16 candidates costs ~1 s to build and ~2 s to time; the rest is the evolutionary search
(~3 s per batch with the random cost model). The first ``tune`` in a process also pays MetaSchedule's one-time
``import tvm.s_tir.tensor_intrin`` (17-30 s, done by its TuneContext; not avoidable from outside).

The records it writes are described in ``tuning.py`` (the database); ``tune_kernels`` tunes a program's tunable
kernels, and ``schedule.py`` replays their records.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import tvm
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from .. import InternalError, UserError
from .program import Kernel
from .schedule import default_schedule, is_hand_scheduled, tunable_rank, tuning_workload
from .tuning import (
    TuningDatabase,
    TuningRecord,
    apply_trace,
    as_target,
    kernel_name,
    normalize,
    target_str,
    trace_to_json,
    workload_hash,
)
from .tvmscript import shallow_frames

logger = logging.getLogger(__name__)

ProgressFn = Callable[[str, int, "float | None"], None]
"""progress(kernel name, trials done, best time so far in seconds or None)."""


# ---------------------------------------------------------------------------------------------------------------
# measuring


def _alloc_args(args_info: list, device) -> list:
    """Random floats in [-1, 1); integer and bool tensors zero-filled, so index inputs stay in bounds."""
    rng = np.random.default_rng(0)
    out = []
    for info in args_info:
        if info[0] != "TENSOR":
            raise InternalError(f"cannot allocate a tuning argument of kind {info[0]!r}")
        _, dtype, shape = info
        shape = [int(s) for s in shape]
        dt = str(dtype)
        arr = tvm.runtime.empty(shape, dt, device)
        if dt.startswith(("float", "bfloat")):
            try:
                arr.copyfrom(rng.uniform(-1.0, 1.0, size=shape).astype(dt))
            except (TypeError, ValueError):  # numpy has no such dtype (bf16, fp8): TVM's own random fill
                filler = tvm.get_global_func("tvm.contrib.random.random_fill", allow_missing=True)
                if filler is not None:
                    filler(arr)
        else:
            arr.copyfrom(np.zeros(shape, dtype=dt if dt != "bool" else np.bool_))
        out.append(arr)
    return out


@dataclasses.dataclass(frozen=True)
class TimerConfig:
    """time_evaluator settings: each of ``repeat`` results is the mean of >= ``min_repeat_ms`` of runs."""

    repeat: int = 3
    min_repeat_ms: int = 20


def _time(rt_mod, device, args, cfg: TimerConfig) -> list[float]:
    evaluator = rt_mod.time_evaluator(rt_mod.entry_name, device, number=1, repeat=cfg.repeat,
                                      min_repeat_ms=cfg.min_repeat_ms)
    device.sync()
    return [float(x) for x in evaluator(*args).results]


def _build(mod: tvm.IRModule, target: tvm.target.Target):
    """What MetaSchedule's default_build does, minus the 17-26 s tensor-intrinsic import (done once, lazily)."""
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return tvm.compile(mod, target=target).mod


class _ArtifactStore:
    """Built modules by fake artifact path: the builder and the runner live in the same process."""

    def __init__(self):
        self._mods: dict[str, object] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def put(self, rt_mod) -> str:
        with self._lock:
            key = f"dayzero-inproc/{next(self._ids)}"
            self._mods[key] = rt_mod
        return key

    def pop(self, key: str):
        with self._lock:
            return self._mods.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._mods.clear()


@derived_object
class _InProcessBuilder(ms.builder.PyBuilder):
    def __init__(self, store: _ArtifactStore, deadline: float | None):
        super().__init__()
        self.store = store
        self.deadline = deadline

    def build(self, build_inputs):
        results = []
        for inp in build_inputs:
            if self.deadline is not None and time.monotonic() > self.deadline:
                results.append(ms.builder.BuilderResult(None, "dayzero: tuning time budget spent; not built"))
                continue
            try:
                key = self.store.put(_build(inp.mod, inp.target))
                results.append(ms.builder.BuilderResult(key, None))
            except Exception as err:  # noqa: BLE001 - a failed candidate is a result, not a crash
                results.append(ms.builder.BuilderResult(None, f"dayzero in-process build failed: {err}"))
        return results


@derived_object
class _InProcessRunner(ms.runner.PyRunner):
    def __init__(self, store: _ArtifactStore, timer: TimerConfig):
        super().__init__()
        self.store = store
        self.timer = timer
        self._args: dict[str, list] = {}

    def run(self, runner_inputs):
        from tvm.s_tir.meta_schedule.runner.local_runner import LocalRunnerFuture

        futures = []
        for inp in runner_inputs:
            rt_mod = self.store.pop(str(inp.artifact_path))
            if rt_mod is None:
                futures.append(LocalRunnerFuture(error_message=f"no built module for {inp.artifact_path}"))
                continue
            try:
                info = [a.as_json() for a in inp.args_info]
                device = tvm.device(str(inp.device_type), 0)
                key = json.dumps([str(inp.device_type), info], default=str)
                if key not in self._args:
                    self._args[key] = _alloc_args(info, device)
                futures.append(LocalRunnerFuture(res=_time(rt_mod, device, self._args[key], self.timer)))
            except Exception as err:  # noqa: BLE001 - a failed candidate is a result, not a crash
                futures.append(LocalRunnerFuture(error_message=f"dayzero in-process run failed: {err}"))
        return futures


@derived_object
class _Monitor(ms.measure_callback.PyMeasureCallback):
    """Counts trials, tracks the best time, reports progress, and stops the task when the time budget is spent."""

    def __init__(self, kernel: str, progress: ProgressFn | None, deadline: float | None):
        super().__init__()
        self.kernel = kernel
        self.progress = progress
        self.deadline = deadline
        self.trials = 0
        self.valid = 0
        self.best: float | None = None
        self.terminated = False

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results):
        for res in runner_results:
            self.trials += 1
            secs = res.run_secs
            if res.error_msg is None and secs is not None and len(secs) > 0:
                self.valid += 1
                t = float(np.median([float(x) for x in secs]))
                self.best = t if self.best is None else min(self.best, t)
        if self.progress is not None:
            try:
                self.progress(self.kernel, self.trials, self.best)
            except Exception:  # noqa: BLE001 - a broken progress bar must not kill tuning
                logger.exception("tuning progress callback failed")
        if self.deadline is not None and time.monotonic() > self.deadline and not self.terminated:
            self.terminated = True
            task_scheduler.terminate_task(task_id)


def measure(mod: tvm.IRModule, target, timer: TimerConfig | None = None) -> float:
    """Median seconds of one call of ``mod['main']`` on random inputs (built and run in this process)."""
    t = as_target(target)
    timer = timer or TimerConfig(repeat=5, min_repeat_ms=50)
    rt_mod = _build(mod, t)
    device = tvm.device(t.get_target_device_type(), 0)
    info = [a.as_json() for a in ms.arg_info.ArgInfo.from_prim_func(mod["main"])]
    return float(np.median(_time(rt_mod, device, _alloc_args(info, device), timer)))


# ---------------------------------------------------------------------------------------------------------------
# tuning


@dataclasses.dataclass(frozen=True)
class TuneResult:
    """``mod``: the faster of the tuned and the default schedule. ``tuned_s`` is None when no valid candidate was
    found (then ``mod`` is the default). ``note`` says why when tuning was skipped or found nothing."""

    mod: tvm.IRModule
    default_s: float | None
    tuned_s: float | None
    trials_done: int
    valid_trials: int = 0
    record_path: Path | None = None
    note: str = ""

    @property
    def tuned(self) -> bool:
        return self.tuned_s is not None and (self.default_s is None or self.tuned_s <= self.default_s)


def _has_symbolic_shape(func) -> bool:
    """True when a parameter is a scalar or a buffer with a non-constant dim (MetaSchedule measures static shapes)."""
    for param in func.params:
        if not isinstance(param, tvm.tirx.Buffer):
            return True
        if any(not isinstance(s, tvm.tirx.IntImm) for s in param.shape):
            return True
    return False


def _cost_model() -> str:
    try:
        import xgboost  # noqa: F401
    except ImportError:
        return "random"  # evolutionary search still mutates the measured best; the model only ranks candidates
    return "xgb"


@contextlib.contextmanager
def _unnamed_handlers_detached(name: str = "tvm.s_tir.meta_schedule"):
    """MetaSchedule's ``create_loggers`` re-lists the handlers already on its logger *by name* in a dictConfig, and
    fails on a handler without one (``'NoneType' object has no attribute 'format'``). Others attach such handlers:
    pytest >= 9 adds its unnamed log-capture handlers to non-propagating loggers like this one, and so may an
    application. Detach them for the call and put them back after, so tuning works whoever else logs."""
    log = logging.getLogger(name)
    unnamed = [h for h in log.handlers if h.get_name() is None]
    for h in unnamed:
        log.removeHandler(h)
    try:
        yield
    finally:
        for h in unnamed:
            if h not in log.handlers:
                log.addHandler(h)


_intrin_lock = threading.Lock()


def import_tensor_intrinsics() -> None:
    """Import ``tvm.s_tir.tensor_intrin`` (MetaSchedule's ``TuneContext`` imports it on first use) within
    ``shallow_frames`` (codegen/tvmscript.py). The module parses ~250 TVMScript functions, each with a stack walk
    that, with the full ``inspect.stack``, took 100-240 s on this 2-core host inside pytest (every importlib frame of
    the import itself has no file on disk), once per process, before the first trial."""
    if "tvm.s_tir.tensor_intrin" in sys.modules:
        return
    with _intrin_lock, shallow_frames():
        import tvm.s_tir.tensor_intrin  # noqa: F401


EVOLUTION_MIN_TRIALS = 64  # a smaller budget is tuned by replay-trace (see ``tune``)


def tune(
    prim_func,
    target,
    trials: int,
    minutes: float | None,
    db: TuningDatabase,
    progress: ProgressFn | None = None,
    *,
    strategy: str | None = None,
    trials_per_iter: int = 16,
    seed: int | None = 0,
    timer: TimerConfig | None = None,
) -> TuneResult:
    """Tune one kernel with MetaSchedule (in-process builder/runner) within ``trials`` and ``minutes``, store the
    record in ``db`` and return the faster of the tuned and the default schedule.

    ``strategy``: MetaSchedule search strategy, "evolutionary" or "replay-trace"; default: evolutionary from
    ``EVOLUTION_MIN_TRIALS`` trials up. Below that a budget buys less than one generation: evolutionary search
    samples and mutates a population of 512 candidates before its first measurement (tens of seconds per kernel
    on this host) and then measures a handful, while replay-trace samples only the candidates it measures.
    Shapes must be static (specialize symbolic dims first); otherwise the default schedule comes back untuned.
    """
    if trials < 1:
        raise UserError(f"tuning trials must be >= 1, got {trials}")
    if minutes is not None and minutes <= 0:
        raise UserError(f"tuning minutes must be > 0, got {minutes}")
    t = as_target(target)
    name = kernel_name(prim_func)
    mod = normalize(prim_func)
    default_mod = default_schedule(mod["main"], t)
    if _has_symbolic_shape(mod["main"]):
        return TuneResult(default_mod, None, None, 0, note="symbolic shape: specialize before tuning")
    timer = timer or TimerConfig()
    strategy = strategy or ("evolutionary" if trials >= EVOLUTION_MIN_TRIALS else "replay-trace")
    default_s = measure(default_mod, t)

    deadline = None if minutes is None else time.monotonic() + 60.0 * minutes
    store = _ArtifactStore()
    monitor = _Monitor(name, progress, deadline)
    database = ms.database.MemoryDatabase()
    # MetaSchedule sizes its console handler from its logger's level at each call, and its own dictConfig
    # leaves that logger at DEBUG: quiet it every time (the full log still goes to the work dir)
    logging.getLogger("tvm.s_tir.meta_schedule").setLevel(
        logging.DEBUG if logger.isEnabledFor(logging.DEBUG) else logging.WARNING)
    import_tensor_intrinsics()
    try:
        with tempfile.TemporaryDirectory(prefix="dayzero-tune-") as work_dir, _unnamed_handlers_detached():
            ms.tune_tir(
                mod, t, work_dir,
                max_trials_global=trials,
                num_trials_per_iter=max(1, min(trials_per_iter, trials)),
                builder=_InProcessBuilder(store, deadline),
                runner=_InProcessRunner(store, timer),
                database=database,
                cost_model=_cost_model(),
                # not "default": its RemoveBuildArtifact would rmtree the dirname of our fake artifact paths
                measure_callbacks=[ms.measure_callback.AddToDatabase(), ms.measure_callback.UpdateCostModel(),
                                   monitor],
                task_scheduler="round-robin",
                strategy=strategy,
                num_tuning_cores=max(1, min(os.cpu_count() or 1, 2)),
                seed=seed,
            )
    except tvm.error.InternalError as err:
        # the monitor ends a task at the deadline; MetaSchedule then trips over the terminated task. What was
        # measured so far is in the database: keep it.
        if not monitor.terminated:
            logger.warning("MetaSchedule failed on %s (%s); keeping the default schedule", name,
                           str(err).splitlines()[0])
        else:
            logger.debug("tuning of %s stopped at the deadline: %s", name, err)
    except tvm.s_tir.schedule.ScheduleError as err:
        # MetaSchedule's design-space rules can trip on multi-stage kernels (reverse-compute-at of a fused
        # epilogue): record "no better schedule" so the kernel is not tried again
        logger.warning("MetaSchedule cannot schedule %s (%s); keeping the default schedule", name,
                       str(err).splitlines()[0])
    finally:
        store.clear()
    trials_done, valid = monitor.trials, monitor.valid

    best = database.query_tuning_record(mod, t, "main")
    trace_json = tuned_mod = tuned_s = None
    if best is not None:
        try:
            trace_json = trace_to_json(best.trace)
            tuned_mod = apply_trace(mod["main"], trace_json)
            tuned_s = measure(tuned_mod, t)
        except Exception as err:  # noqa: BLE001 - keep the default rather than fail the compile
            logger.warning("best candidate of %s did not replay (%s); keeping the default schedule", name, err)
            trace_json = tuned_mod = tuned_s = None

    rec = TuningRecord(
        workload_hash=workload_hash(mod), target=target_str(t), kernel=name, trace=trace_json,
        default_s=default_s, tuned_s=tuned_s, trials=trials_done, workload=tvm.ir.save_json(mod["main"]),
    )
    path = db.put(rec, t)
    note = "" if tuned_s is not None else "no valid candidate; default schedule kept"
    result_mod = tuned_mod if rec.tuned_wins else default_mod
    return TuneResult(result_mod, default_s, tuned_s, trials_done, valid, path, note)


def tune_kernels(kernels: list[Kernel], target: tvm.target.Target, db: TuningDatabase,
                 symbols: dict[str, tuple[int, int]], trials: int, minutes: float | None,
                 progress=None) -> dict:
    """Tune every tunable kernel that has no record yet, heaviest ops first, within the time budget.

    ``progress(kernel, trials_done, best_s)`` is called as trials complete. Returns {kernel: TuneResult note}."""
    deadline = time.monotonic() + minutes * 60 if minutes else None
    order = sorted((k for k in kernels if not is_hand_scheduled(k) and tunable_rank(k) is not None),
                   key=tunable_rank)
    done = {}
    for k in order:
        work = tuning_workload(k, symbols)
        if db.get(work, target) is not None:
            continue
        left = None if deadline is None else (deadline - time.monotonic()) / 60
        if left is not None and left <= 0:
            break
        cb = (lambda name, n, best, kname=k.name: progress(kname, n, best)) if progress else None
        res = tune(work, target, trials=trials, minutes=left, db=db, progress=cb)
        done[k.name] = {"trials": res.trials_done, "default_s": res.default_s, "tuned_s": res.tuned_s}
    return done
