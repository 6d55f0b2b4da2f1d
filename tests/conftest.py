"""Shared fixtures: models compiled once per session (compiling is the slow part), GPU marker handling."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _private_caches(tmp_path_factory):
    """Tests never read or write the user's tuning database or trace cache (~/.cache/dayzero/...): each session
    has its own, shared by its tests and the CLI processes they start (the trace cache is what lets two tests
    that compile the same config skip the second torch.export)."""
    import os

    env = {"DAYZERO_TUNING_DIR": "tuning", "DAYZERO_TRACE_CACHE": "traces"}
    old = {k: os.environ.get(k) for k in env}
    for k, sub in env.items():
        os.environ[k] = str(tmp_path_factory.mktemp(sub))
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


@pytest.fixture(scope="session")
def tiny_compiled(tmp_path_factory):
    """tiny_compiled("gpt_oss") -> (checkpoint dir, artifact dir, report): every make-tiny architecture is written
    (seed 0) and compiled (max_seq 128, max_batch 3) once per session, shared by every test that needs it
    (compiling is the slow part of the suite)."""
    import json

    from dayzero.tools.driver import compile_model
    from dayzero.tools.make_tiny import make_tiny

    cache = _Once()

    def build(model_type: str):
        d = tmp_path_factory.mktemp(f"shared_{model_type}")
        ckpt = make_tiny(model_type, d / "ckpt", seed=0)
        compile_model(str(ckpt), d / "art", max_seq=SHARED_MAX_SEQ, max_batch=SHARED_MAX_BATCH)
        return ckpt, d / "art", json.loads((d / "art" / "report.json").read_text())
    return lambda model_type: cache.get(model_type, lambda: build(model_type))


LOWPREC_MAX_SEQ = 64


@pytest.fixture(scope="session")
def lowprec_tiny(tmp_path_factory):
    """lowprec_tiny("qwen3_moe", "fp8") -> checkpoint dir: make-tiny (seed 0) with the routed experts stored in that
    format (mxfp4 | fp8 | bf16), written once per session. Tests that damage it work on a copy."""
    from dayzero.tools.make_tiny import make_tiny

    cache = _Once()

    def build(model_type: str, experts: str):
        d = tmp_path_factory.mktemp(f"lowprec_{model_type}_{experts}")
        return make_tiny(model_type, d / "ckpt", experts=experts, seed=0)
    return lambda model_type, experts: cache.get((model_type, experts), lambda: build(model_type, experts))


@pytest.fixture(scope="session")
def lowprec_compiled(lowprec_tiny, tmp_path_factory):
    """lowprec_compiled("qwen3_moe", "fp8") -> (checkpoint dir, artifact dir, report): lowprec_tiny's checkpoint
    compiled (max_seq 64, default max_batch) once per session, shared by every test of that model and format."""
    from dayzero.tools.driver import compile_model

    cache = _Once()

    def build(model_type: str, experts: str):
        ckpt = lowprec_tiny(model_type, experts)
        art = tmp_path_factory.mktemp(f"lowprec_art_{model_type}_{experts}") / "a.dz"
        return ckpt, art, compile_model(str(ckpt), art, max_seq=LOWPREC_MAX_SEQ)
    return lambda model_type, experts: cache.get((model_type, experts), lambda: build(model_type, experts))
