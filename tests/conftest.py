"""Shared fixtures: models compiled once per session (compiling is the slow part), GPU marker handling."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _private_tuning_database(tmp_path_factory):
    """Tests never read or write the user's tuning database (~/.cache/dayzero/tuning)."""
    import os

    old = os.environ.get("DAYZERO_TUNING_DIR")
    os.environ["DAYZERO_TUNING_DIR"] = str(tmp_path_factory.mktemp("tuning"))
    yield
    if old is None:
        os.environ.pop("DAYZERO_TUNING_DIR", None)
    else:
        os.environ["DAYZERO_TUNING_DIR"] = old


def pytest_collection_modifyitems(config, items):
    has_gpu = torch.cuda.is_available()
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def compiled_factory(tmp_path_factory):
    """compiled_factory("tiny_dense") -> (artifact dir, module, example inputs), cached per session."""
    from dayzero.tools import examples
    from dayzero.tools.driver import compile_model

    cache = {}

    def get(name: str):
        if name not in cache:
            module, inputs = getattr(examples, name)()
            out = tmp_path_factory.mktemp(name) / "artifact"
            compile_model((module, inputs), out, max_seq=64, verify=True)
            cache[name] = (out, module, inputs)
        return cache[name]
    return get


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

    cache = {}

    def get(model_type: str):
        if model_type not in cache:
            d = tmp_path_factory.mktemp(f"shared_{model_type}")
            ckpt = make_tiny(model_type, d / "ckpt", seed=0)
            compile_model(str(ckpt), d / "art", max_seq=SHARED_MAX_SEQ, max_batch=SHARED_MAX_BATCH)
            cache[model_type] = (ckpt, d / "art", json.loads((d / "art" / "report.json").read_text()))
        return cache[model_type]
    return get
