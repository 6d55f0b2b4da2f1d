"""The tuning database: one JSON record per (target, kernel workload), read back as a schedule trace.

Records are written by the tuner (``tuner.py``) and replayed by the schedule rule chain (``schedule.py``).

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

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import warnings
from pathlib import Path

import tvm
import tvm_ffi

from .. import InternalError, UserError
from .trace_check import TraceRefused, check_trace

logger = logging.getLogger(__name__)

RECORD_FORMAT = "dayzero-tuning-record/1"
ENV_DIR = "DAYZERO_TUNING_DIR"


class TuningDatabaseWarning(UserWarning):
    """A tuning record was unreadable or did not apply; it is skipped (the kernel falls back)."""


# ---------------------------------------------------------------------------------------------------------------
# keys


def as_target(target) -> tvm.target.Target:
    if isinstance(target, tvm.target.Target):
        return target
    try:
        return tvm.target.Target(target)
    except Exception as err:  # noqa: BLE001 - TVM raises its own error types
        raise UserError(f"invalid tuning target {target!r}: {err}") from err


def target_str(target: tvm.target.Target) -> str:
    """Canonical text of a target (TVM 0.27 prints targets as JSON with sorted attributes)."""
    return str(target)


def target_key(target) -> str:
    """Directory name for a target: readable kind and cpu/arch, plus a hash of the full canonical target."""
    t = as_target(target)
    attrs = t.attrs
    detail = attrs.get("mcpu") or attrs.get("arch") or ""
    digest = hashlib.sha256(target_str(t).encode()).hexdigest()[:12]
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


def kernel_name(prim_func) -> str:
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
        t = as_target(target)
        path = self.record_path(prim_func, t)
        rec = self._read(path)
        if rec is None:
            return None
        if rec.target != target_str(t) or rec.workload_hash != workload_hash(prim_func):
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


def trace_to_json(trace) -> list:
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
