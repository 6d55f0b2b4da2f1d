"""compile --tune: real trials, records reused by every later compile, a damaged database never breaks one."""

from __future__ import annotations

import json

import pytest
import torch

from dayzero.runtime import load
from dayzero.tools import examples
from dayzero.tools.driver import compile_model


@pytest.mark.slow
def test_tune_then_warm_compile_reuses_records(tmp_path):
    db = tmp_path / "db"
    model = examples.tiny_projection()
    first = compile_model(model, tmp_path / "a", max_seq=32, tune=4, tuning_dir=str(db))
    assert first["seconds"]["tuned_kernels"] >= 1  # the linear kernel was tuned
    records = list(db.glob("*/*.json"))
    assert records
    rec = json.loads(records[0].read_text())
    assert rec["trials"] >= 1 and rec["default_s"] > 0

    second = compile_model(model, tmp_path / "b", max_seq=32, tune=4, tuning_dir=str(db))
    assert second["seconds"]["tuned_kernels"] == 0  # nothing tuned twice
    linear = [k for k, op in second["kernel_ops"].items() if op == "linear"][0]
    expected_route = "tuned" if rec["tuned_s"] is not None and rec["tuned_s"] <= rec["default_s"] else "default"
    assert second["routes"][linear] == expected_route
    if expected_route == "tuned":
        assert second["tuned"][linear]["tuned_s"] == rec["tuned_s"]

    module, _ = model
    x = torch.randn(1, 19, 64)
    with torch.no_grad():
        ref = module(x)
    got = load(tmp_path / "b").programs["prefill"].run([x])[0]
    assert (got - ref).abs().max().item() <= 1e-4


@pytest.mark.slow
def test_damaged_database_is_skipped(tmp_path):
    """A killed tuning run can leave a truncated record: the next compile warns and carries on."""
    import tvm

    from dayzero.codegen.program import build_program
    from dayzero.codegen.schedule import tuning_workload
    from dayzero.codegen.tuning import TuningDatabase, TuningDatabaseWarning
    from dayzero.targets.host import host_target_dict
    from dayzero.tools.driver import optimize, trace_model

    db = TuningDatabase(str(tmp_path / "db"))
    fe = trace_model(examples.tiny_projection(), max_seq=16)
    g, _ = optimize(fe)
    prog = build_program(g)
    (k,) = [k for k in prog.kernels.values() if k.op == "linear"]
    path = db.record_path(tuning_workload(k, {"seq": (1, 16)}), tvm.target.Target(host_target_dict()))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"workload_hash": "01234')  # cut short mid-write
    with pytest.warns(TuningDatabaseWarning):
        rep = compile_model(examples.tiny_projection(), tmp_path / "out", max_seq=16, tuning_dir=str(db.root))
    assert rep["routes"][k.name] == "default"
