"""Shared fixtures: models compiled once per run (compiling is the slow part), GPU marker handling.

The suite runs on pytest-xdist workers (``-n auto``, files kept whole per worker: module fixtures are built once).
What every worker shares is built once per *run*, not per worker: the tiny checkpoints and their compiled artifacts
(``tiny_compiled``, ``lowprec_tiny``, ``lowprec_compiled``) live in the run's shared folder, each built under a file
lock by the first worker that needs it and read back by the others, and the trace cache is one folder for all."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from filelock import FileLock


def _run_root(tmp_path_factory) -> Path:
    """The folder every worker of this run shares (the workers' base temp's parent under xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def pytest_configure(config):
    """An xdist worker, and every process it starts (CLI subprocesses inherit the environment), uses its share of
    the cores: TVM's pool (runtime ``use_all_cores``), torch's and OpenMP's would each take every core, so two
    workers on two cores ran four busy threads, whose spin-waits and barriers stall on a descheduled peer. A
    count the user set is kept; ``-n 0`` keeps every core."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    share = max(1, cores // workers)
    os.environ.setdefault("TVM_NUM_THREADS", str(share))
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(share)
        torch.set_num_threads(share)


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same global RNG state, whatever ran before it in its worker: a test drawing
    unseeded inputs sees the same numbers in any order and under any -n (an unseeded draw against a tight
    tolerance failed once in one order and passed in another)."""
    torch.manual_seed(0)
    np.random.seed(0)


@pytest.fixture(autouse=True, scope="session")
def _private_caches(tmp_path_factory):
    """Tests never read or write the user's tuning database or trace cache (~/.cache/dayzero/...): each run has its
    own trace cache, shared by its workers and the CLI processes they start (the trace cache is what lets two tests
    that compile the same config skip the second torch.export), and each worker its own tuning database."""
    traces = _run_root(tmp_path_factory) / "traces"
    traces.mkdir(exist_ok=True)
    env = {"DAYZERO_TUNING_DIR": str(tmp_path_factory.mktemp("tuning")), "DAYZERO_TRACE_CACHE": str(traces)}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


class _Once:
    """A session cache of expensive builds (compiles): ``get(key, build)`` runs ``build()`` once per key. A build
    that raised is not run again: every later test that needs it fails at once on the first error (one broken
    compile would otherwise be recompiled, and fail, for each of its dependent tests)."""

    def __init__(self):
        self.done, self.failed = {}, {}

    def get(self, key, build):
        if key in self.failed:
            raise RuntimeError(f"{key!r} failed to build earlier in this session") from self.failed[key]
        if key not in self.done:
            try:
                self.done[key] = build()
            except Exception as err:
                self.failed[key] = err
                raise
        return self.done[key]


class _OncePerRun:
    """``get(name, build)``: ``build(folder)`` fills ``<run root>/<name>`` once per run, whichever worker comes first
    (under a file lock; the others wait, then read the folder), and returns what it made; ``read(folder)`` gives the
    same from the folder for a worker that did not build it. A failed build leaves its error for the others."""

    def __init__(self, tmp_path_factory, read):
        self.root, self.read, self.once = _run_root(tmp_path_factory), read, _Once()

    def get(self, name: str, build):
        return self.once.get(name, lambda: self._get(name, build))

    def _get(self, name: str, build):
        folder = self.root / name
        with FileLock(str(folder) + ".lock"):
            failed = folder / ".failed"
            if failed.exists():
                raise RuntimeError(f"{name} failed to build on another worker: {failed.read_text()}")
            if (folder / ".done").exists():
                return self.read(folder)
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            try:
                made = build(folder)
            except Exception as err:
                failed.write_text(f"{type(err).__name__}: {err}"[:2000])
                raise
            (folder / ".done").touch()
            return made


# the session fixtures below that compile (or write) tiny checkpoints: a test using one is end-to-end
COMPILING_FIXTURES = frozenset({"compiled_factory", "tiny_compiled", "lowprec_tiny", "lowprec_compiled"})


def pytest_collection_modifyitems(config, items):
    """GPU tests skip without a GPU; a test that uses a compiling fixture or compiles kernels for CUDA sm_90 (a
    check for a target this host cannot run) is marked ``slow`` (the end-to-end tier:
    ``pytest -m "not slow"`` is the fast tier, plain ``pytest`` runs both)."""
    has_gpu = torch.cuda.is_available()
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip)
        if "slow" in item.keywords:
            continue
        if COMPILING_FIXTURES & set(getattr(item, "fixturenames", ())) or "cuda_sm90" in item.name:
            item.add_marker(pytest.mark.slow)  # an end-to-end compile, or a compile check for a GPU target
    end_to_end = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: _run_order(item.path, end_to_end))


# The files whose one test takes minutes of a worker, heaviest first (CPU seconds alone, -n 0: the full-width
# gpt-oss 251 s, the demo+serve 140 s; ~190 s and ~200 s of wall in a fresh-clone run). ``--dist loadfile`` hands
# whole files to the workers in collection order (addopts turns off xdist's default reordering by test count,
# which sent these one-test files last, so a 3-minute file ran alone at the end of the run): they start first and
# the many small files fill the other workers around them. The chunked prefill on the shared DeepSeek-V3.2 / V4
# artifacts follows: the first file to need those builds them (the tiny V4 compile alone ~140 s), so they are
# built early, beside the two above, and the later files that read them find them made.
HEAVY_FIRST = ("test_full_size.py", "test_demo.py", "test_chunked_prefill_shared.py")


def _run_order(path: Path, end_to_end: set) -> tuple[int, int]:
    """Files in HEAVY_FIRST first (in that order), then the files holding end-to-end tests, then the rest: a
    stable sort, so files keep their collected order within each group and tests theirs within a file."""
    if path.name in HEAVY_FIRST:
        return 0, HEAVY_FIRST.index(path.name)
    return (1 if path in end_to_end else 2), 0


@pytest.fixture(scope="session")
def compiled_factory(tmp_path_factory):
    """compiled_factory("tiny_dense") -> (artifact dir, module, example inputs), cached per session."""
    from dayzero.tools import examples
    from dayzero.tools.driver import compile_model

    cache = _Once()

    def build(name: str):
        module, inputs = getattr(examples, name)()
        out = tmp_path_factory.mktemp(name) / "artifact"
        compile_model((module, inputs), out, max_seq=64, verify=True)
        return out, module, inputs
    return lambda name: cache.get(name, lambda: build(name))


SHARED_MAX_SEQ = 128
SHARED_MAX_BATCH = 3
# the multimodal checkpoint's shared artifact carries two image grids (a 64x64 image and a 64 high x 96 wide one),
# so that test_vision.py's checks of several compiled grids run on it instead of on a compile of their own
SHARED_IMAGE_GRIDS = {"qwen3_vl_moe": ("1x4x4", "1x4x6")}


@pytest.fixture(scope="session")
def tiny_compiled(tmp_path_factory):
    """tiny_compiled("gpt_oss") -> (checkpoint dir, artifact dir, report): every make-tiny architecture is written
    (seed 0) and compiled (max_seq 128, max_batch 3, SHARED_IMAGE_GRIDS for a multimodal one) once per run, shared
    by every test that needs it (compiling is the slow part of the suite)."""
    from dayzero.tools.driver import compile_model
    from dayzero.tools.make_tiny import make_tiny

    def build(d: Path):
        model_type = d.name.removeprefix("shared_")
        ckpt = make_tiny(model_type, d / "ckpt", seed=0)
        compile_model(str(ckpt), d / "art", max_seq=SHARED_MAX_SEQ, max_batch=SHARED_MAX_BATCH,
                      image_grids=SHARED_IMAGE_GRIDS.get(model_type))
        return read(d)

    def read(d: Path):
        return d / "ckpt", d / "art", json.loads((d / "art" / "report.json").read_text())
    cache = _OncePerRun(tmp_path_factory, read)
    return lambda model_type: cache.get(f"shared_{model_type}", build)


LOWPREC_MAX_SEQ = 64


@pytest.fixture(scope="session")
def lowprec_tiny(tmp_path_factory):
    """lowprec_tiny("qwen3_moe", "fp8") -> checkpoint dir: make-tiny (seed 0) with the routed experts stored in that
    format (mxfp4 | fp8 | bf16), written once per run. Tests that damage it work on a copy."""
    from dayzero.tools.make_tiny import make_tiny

    cache = _OncePerRun(tmp_path_factory, lambda d: d / "ckpt")

    def get(model_type: str, experts: str):
        return cache.get(f"lowprec_{model_type}_{experts}",
                         lambda d: make_tiny(model_type, d / "ckpt", experts=experts, seed=0))
    return get


@pytest.fixture(scope="session")
def lowprec_compiled(lowprec_tiny, tmp_path_factory):
    """lowprec_compiled("qwen3_moe", "fp8") -> (checkpoint dir, artifact dir, report): lowprec_tiny's checkpoint
    compiled (max_seq 64, default max_batch) once per run, shared by every test of that model and format."""
    from dayzero.tools.driver import compile_model

    def get(model_type: str, experts: str):
        ckpt = lowprec_tiny(model_type, experts)

        def build(d: Path):
            compile_model(str(ckpt), d / "a.dz", max_seq=LOWPREC_MAX_SEQ)
            return read(d)

        def read(d: Path):
            return ckpt, d / "a.dz", json.loads((d / "a.dz" / "report.json").read_text())
        return _OncePerRun(tmp_path_factory, read).get(f"lowprec_art_{model_type}_{experts}", build)
    return get
