"""Auto-tuned fallbacks: MetaSchedule with an in-process builder and runner, and a persistent tuning database.

    kernel PrimFunc ──► lookup(db, f, target) ──► record? ──yes──► apply its trace to a fresh schedule
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
``python -m dayzero.tools.bench_tuning_probe --mode default|inproc --kernel matmul|reduction --trials N
[--per-iter K] [--strategy evolutionary|replay-trace]``). Valid trials per minute:

    kernel                         stock LocalBuilder/Runner           in-process (this module)
    matmul 256^3 fp32              2.7  (16 tried in 179 s, 8 valid)   94 evolutionary (64 in 41 s), 263 replay-trace
    row sum 1024x4096 fp32         0    (16 tried in 318 s, 0 valid)   106 evolutionary (60 in 34 s)

    default (rule-based) vs tuned: matmul 16.4 ms -> 0.18 ms (dl.cpu has no matmul rule: parallel naive loop);
                                   row sum 4.3-4.6 ms -> 0.6-1.8 ms (noisy under the shared load)

In process, one batch of 16 candidates costs ~1 s to build and ~2 s to time; the rest is the evolutionary search
(~3 s per batch with the random cost model). The first ``tune`` in a process also pays MetaSchedule's one-time
``import tvm.s_tir.tensor_intrin`` (17-30 s, done by its TuneContext; not avoidable from outside).

The database is one directory per target key (``<root>/<target-key>/<workload-hash>.json``), one record per file,
shared by every model: the key is the structural hash of the normalized unscheduled PrimFunc, so the same kernel
built twice, by any model, finds the same record. A record also stores the full target and the workload itself
(checked with structural equality on lookup), so a record from another target or a hash collision is never used.
Writes go to a temp file in the same directory, then ``os.replace``: readers and concurrent writers never see a
partial file, and a killed tuning run leaves the previous record (or none). A file that does not parse is skipped
with a ``TuningDatabaseWarning``. Records are untrusted (a database may be shared): a trace is replayed only after
``trace_check.check_trace`` accepts every instruction and annotation in it; a refused record is warned about and
the kernel keeps its default schedule.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import logging
import os
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import tvm
import tvm_ffi
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from .. import InternalError, UserError
from .trace_check import TraceRefused, check_trace

logger = logging.getLogger(__name__)

RECORD_FORMAT = "dayzero-tuning-record/1"
ENV_DIR = "DAYZERO_TUNING_DIR"

ProgressFn = Callable[[str, int, "float | None"], None]
"""progress(kernel name, trials done, best time so far in seconds or None)."""


class TuningDatabaseWarning(UserWarning):
    """A tuning record was unreadable or did not apply; it is skipped (the kernel falls back)."""


# ---------------------------------------------------------------------------------------------------------------
# keys


def _as_target(target) -> tvm.target.Target:
    if isinstance(target, tvm.target.Target):
        return target
    try:
        return tvm.target.Target(target)
    except Exception as err:  # noqa: BLE001 - TVM raises its own error types
        raise UserError(f"invalid tuning target {target!r}: {err}") from err


def _target_str(target: tvm.target.Target) -> str:
    """Canonical text of a target (TVM 0.27 prints targets as JSON with sorted attributes)."""
    return str(target)


def target_key(target) -> str:
    """Directory name for a target: readable kind and cpu/arch, plus a hash of the full canonical target."""
    t = _as_target(target)
    attrs = t.attrs
    detail = attrs.get("mcpu") or attrs.get("arch") or ""
    digest = hashlib.sha256(_target_str(t).encode()).hexdigest()[:12]
    return "-".join(x for x in (t.kind.name, str(detail), digest) if x)


def normalize(prim_func) -> tvm.IRModule:
    """The unscheduled workload as MetaSchedule sees it: a copy of the function, named ``main``, noalias."""
    if isinstance(prim_func, tvm.IRModule):
        funcs = [f for _, f in prim_func.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
        if len(funcs) != 1:
            raise InternalError(f"tuning takes one PrimFunc, got a module with {len(funcs)}")
        prim_func = funcs[0]
    if not isinstance(prim_func, tvm.tirx.PrimFunc):
        raise InternalError(f"tuning takes a tirx.PrimFunc, got {type(prim_func).__name__}")
    # A deep copy: s_tir.Schedule (used by dlight, MetaSchedule and apply_trace) rewrites the IR nodes it is given
    # in place, so scheduling a module that shares its body with the caller's PrimFunc would change the caller's.
    func = tvm.ir.load_json(tvm.ir.save_json(prim_func))
    func = func.with_attr("global_symbol", "main").with_attr("tirx.noalias", True)
    return tvm.IRModule({"main": func})


def workload_hash(prim_func) -> str:
    """16 hex digits: structural hash of the normalized unscheduled PrimFunc (names of buffers/vars ignored)."""
    return f"{tvm_ffi.structural_hash(normalize(prim_func)['main']) & 0xFFFFFFFFFFFFFFFF:016x}"


def _kernel_name(prim_func) -> str:
    if isinstance(prim_func, tvm.tirx.PrimFunc) and prim_func.attrs is not None:
        name = prim_func.attrs.get("global_symbol")
        if name is not None:
            return str(name)
    return "main"


# ---------------------------------------------------------------------------------------------------------------
# the database


@dataclasses.dataclass(frozen=True)
class TuningRecord:
    """One tuned kernel on one target. ``trace`` is MetaSchedule's trace JSON (``Trace.as_json``), None when no
    valid candidate was found; ``tuned_s``/``default_s`` are the times measured at tuning time."""

    workload_hash: str
    target: str
    kernel: str
    trace: list | None
    default_s: float | None
    tuned_s: float | None
    trials: int
    workload: str  # tvm.ir.save_json of the normalized unscheduled function
    tvm_version: str = tvm.__version__

    @property
    def tuned_wins(self) -> bool:
        return self.trace is not None and self.tuned_s is not None and (
            self.default_s is None or self.tuned_s <= self.default_s
        )

    def to_json(self) -> dict:
        return {"format": RECORD_FORMAT, **dataclasses.asdict(self)}

    @staticmethod
    def from_json(obj: dict) -> TuningRecord:
        if not isinstance(obj, dict) or obj.get("format") != RECORD_FORMAT:
            raise ValueError(f"not a {RECORD_FORMAT} record")
        fields = {f.name for f in dataclasses.fields(TuningRecord)}
        missing = fields - set(obj) - {"tvm_version"}
        if missing:
            raise ValueError(f"record misses {sorted(missing)}")
        rec = TuningRecord(**{k: obj[k] for k in fields if k in obj})
        if not isinstance(rec.workload_hash, str) or not isinstance(rec.target, str):
            raise ValueError("record key fields are not strings")
        if rec.trace is not None and not isinstance(rec.trace, list):
            raise ValueError("record trace is not a list")
        return rec


class TuningDatabase:
    """Tuning records on disk: ``<root>/<target-key>/<workload-hash>.json``.

    root: argument, else ``$DAYZERO_TUNING_DIR``, else ``~/.cache/dayzero/tuning``.
    """

    def __init__(self, path: str | os.PathLike | None = None):
        if path is None:
            path = os.environ.get(ENV_DIR) or Path.home() / ".cache" / "dayzero" / "tuning"
        self.root = Path(path).expanduser()

    def __repr__(self) -> str:
        return f"TuningDatabase({str(self.root)!r})"

    def record_path(self, prim_func, target) -> Path:
        return self.root / target_key(target) / f"{workload_hash(prim_func)}.json"

    def get(self, prim_func, target) -> TuningRecord | None:
        """The record for this kernel on this target, or None (missing, unreadable, or not this workload)."""
        t = _as_target(target)
        path = self.record_path(prim_func, t)
        rec = self._read(path)
        if rec is None:
            return None
        if rec.target != _target_str(t) or rec.workload_hash != workload_hash(prim_func):
            logger.debug("tuning record %s is for another target/workload; ignored", path)
            return None
        if rec.trace is not None:
            try:  # untrusted input: only allowlisted schedule instructions and annotations are ever replayed
                check_trace(rec.trace)
            except TraceRefused as err:
                warnings.warn(f"tuning record {path} refused: {err}; the kernel keeps its default schedule",
                              TuningDatabaseWarning, stacklevel=2)
                return None
        try:
            same = tvm_ffi.structural_equal(tvm.ir.load_json(rec.workload), normalize(prim_func)["main"])
        except Exception as err:  # noqa: BLE001 - a record written by another TVM version may not load
            warnings.warn(f"tuning record {path}: workload does not load ({err}); skipped",
                          TuningDatabaseWarning, stacklevel=2)
            return None
        if not same:
            warnings.warn(f"tuning record {path}: structural hash collision with another workload; skipped",
                          TuningDatabaseWarning, stacklevel=2)
            return None
        return rec

    def put(self, rec: TuningRecord, target) -> Path:
        """Write ``rec`` atomically. If a valid record for the same key is already there and is faster, keep it."""
        path = self.root / target_key(target) / f"{rec.workload_hash}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        old = self._read(path, warn=False)
        if (old is not None and old.target == rec.target and old.tuned_wins and old.tuned_s is not None
                and (rec.tuned_s is None or old.tuned_s < rec.tuned_s)):
            logger.info("kept the faster existing tuning record %s (%.3g s < %s s)", path, old.tuned_s, rec.tuned_s)
            return path
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(rec.to_json(), f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        return path

    def records(self, target=None):
        """Every readable record (of one target if given); unreadable files are skipped with a warning."""
        dirs = [self.root / target_key(target)] if target is not None else sorted(self.root.glob("*"))
        for d in dirs:
            for p in sorted(d.glob("*.json")):
                rec = self._read(p)
                if rec is not None:
                    yield rec

    @staticmethod
    def _read(path: Path, warn: bool = True) -> TuningRecord | None:
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        except OSError as err:
            if warn:
                warnings.warn(f"tuning record {path} unreadable ({err}); skipped", TuningDatabaseWarning, stacklevel=3)
            return None
        try:
            return TuningRecord.from_json(json.loads(text))
        except (ValueError, TypeError, KeyError) as err:
            if warn:
                warnings.warn(f"tuning record {path} is corrupt ({err}); skipped", TuningDatabaseWarning,
                              stacklevel=3)
            return None


# ---------------------------------------------------------------------------------------------------------------
# schedules


def _trace_to_json(trace) -> list:
    """``Trace.as_json`` keeps IntImm/FloatImm objects; turn them into plain JSON numbers."""

    def plain(x):
        if isinstance(x, list | tuple):
            return [plain(i) for i in x]
        if isinstance(x, dict):
            return {str(k): plain(v) for k, v in x.items()}
        if isinstance(x, tvm.tirx.IntImm):
            return int(x.value)
        if isinstance(x, tvm.tirx.FloatImm):
            return float(x.value)
        return x

    return plain(trace.as_json(remove_postproc=False))


def apply_trace(prim_func, trace_json: list) -> tvm.IRModule:
    """A fresh schedule of the normalized workload with the recorded trace replayed on it. The trace names blocks,
    so pass the workload stored with the record (the caller's copy may name its blocks differently).
    Raises ``TraceRefused`` for a trace outside the allowlist (codegen/trace_check.py), before replaying anything."""
    check_trace(trace_json)
    sch = tvm.s_tir.Schedule(normalize(prim_func))
    tvm.s_tir.schedule.Trace.apply_json_to_schedule(trace_json, sch)
    return sch.mod


def lookup(db: TuningDatabase, prim_func, target) -> tvm.IRModule | None:
    """The tuned module from a stored record (its trace applied to a fresh schedule), or None.

    None also when the record says the rule-based default was faster, or when the trace no longer applies (e.g.
    written by another TVM version: warned and skipped)."""
    rec = db.get(prim_func, target)
    if rec is None or not rec.tuned_wins:
        return None
    try:  # the stored workload is structurally equal to prim_func (db.get checked) and has the trace's names
        return apply_trace(tvm.ir.load_json(rec.workload), rec.trace)
    except Exception as err:  # noqa: BLE001 - any TVM error here means "the record does not apply"
        warnings.warn(f"tuning record for {rec.kernel} ({rec.workload_hash}) does not apply ({err}); skipped",
                      TuningDatabaseWarning, stacklevel=2)
        return None


def _dlight_rules(target: tvm.target.Target):
    from tvm.s_tir import dlight as dl

    if "gpu" in target.keys:
        return [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()]
    # not dl.cpu.GEMV: it vectorises across strided rows with a 256-step unroll, LLVM then spends 10-40 s on one
    # small expert bmm, and the code is no faster than parallel loops
    return [dl.cpu.Reduction()]


def _cpu_parallel_fallback(mod: tvm.IRModule) -> tvm.IRModule:
    """Parallelize the leading spatial loops of every block; vectorize a pure elementwise block's inner loop."""
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


def default_schedule(prim_func, target) -> tvm.IRModule:
    """The rule-based default: dlight ``dl.gpu`` rules for GPU targets, ``dl.cpu`` for CPU; on CPU, a function no
    rule takes gets its outermost spatial loops parallelized (and elementwise inner loops vectorized)."""
    from tvm.s_tir import dlight as dl

    t = _as_target(target)
    mod = normalize(prim_func)
    try:
        with t:
            out = dl.ApplyDefaultSchedule(*_dlight_rules(t))(mod)
    except (tvm.error.TVMError, tvm.s_tir.schedule.ScheduleError) as err:  # a rule that trips on this kernel
        logger.debug("dlight rules failed on %s: %s", _kernel_name(prim_func), err)
        out = normalize(prim_func)
    func = out["main"]
    if func.attrs is not None and "tirx.is_scheduled" in func.attrs:
        return out
    if "gpu" in t.keys:  # dl.gpu.Fallback applies to everything it can; what is left will not build
        return out
    return _cpu_parallel_fallback(out)


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
    t = _as_target(target)
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


def tune(
    prim_func,
    target,
    trials: int,
    minutes: float | None,
    db: TuningDatabase,
    progress: ProgressFn | None = None,
    *,
    strategy: str = "evolutionary",
    trials_per_iter: int = 16,
    seed: int | None = 0,
    timer: TimerConfig | None = None,
) -> TuneResult:
    """Tune one kernel with MetaSchedule (in-process builder/runner) within ``trials`` and ``minutes``, store the
    record in ``db`` and return the faster of the tuned and the default schedule.

    ``strategy``: MetaSchedule search strategy ("evolutionary", or the cheaper "replay-trace" for tiny budgets).
    Shapes must be static (specialize symbolic dims first); otherwise the default schedule comes back untuned.
    """
    if trials < 1:
        raise UserError(f"tuning trials must be >= 1, got {trials}")
    if minutes is not None and minutes <= 0:
        raise UserError(f"tuning minutes must be > 0, got {minutes}")
    t = _as_target(target)
    name = _kernel_name(prim_func)
    mod = normalize(prim_func)
    default_mod = default_schedule(mod["main"], t)
    if _has_symbolic_shape(mod["main"]):
        return TuneResult(default_mod, None, None, 0, note="symbolic shape: specialize before tuning")
    timer = timer or TimerConfig()
    default_s = measure(default_mod, t)

    deadline = None if minutes is None else time.monotonic() + 60.0 * minutes
    store = _ArtifactStore()
    monitor = _Monitor(name, progress, deadline)
    database = ms.database.MemoryDatabase()
    # MetaSchedule sizes its console handler from its logger's level at each call, and its own dictConfig
    # leaves that logger at DEBUG: quiet it every time (the full log still goes to the work dir)
    logging.getLogger("tvm.s_tir.meta_schedule").setLevel(
        logging.DEBUG if logger.isEnabledFor(logging.DEBUG) else logging.WARNING)
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
            trace_json = _trace_to_json(best.trace)
            tuned_mod = apply_trace(mod["main"], trace_json)
            tuned_s = measure(tuned_mod, t)
        except Exception as err:  # noqa: BLE001 - keep the default rather than fail the compile
            logger.warning("best candidate of %s did not replay (%s); keeping the default schedule", name, err)
            trace_json = tuned_mod = tuned_s = None

    rec = TuningRecord(
        workload_hash=workload_hash(mod), target=_target_str(t), kernel=name, trace=trace_json,
        default_s=default_s, tuned_s=tuned_s, trials=trials_done, workload=tvm.ir.save_json(mod["main"]),
    )
    path = db.put(rec, t)
    note = "" if tuned_s is not None else "no valid candidate; default schedule kept"
    result_mod = tuned_mod if rec.tuned_wins else default_mod
    return TuneResult(result_mod, default_s, tuned_s, trials_done, valid, path, note)


__all__ = [
    "TimerConfig", "TuneResult", "TuningDatabase", "TuningDatabaseWarning", "TuningRecord", "apply_trace",
    "default_schedule", "lookup", "measure", "normalize", "target_key", "tune", "workload_hash",
]
