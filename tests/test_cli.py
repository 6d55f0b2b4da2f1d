"""The CLI contract: --help everywhere, --json, exit codes, one-line errors, no half-written artifacts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from dayzero.tools.cli import main

COMMANDS = ["compile", "run", "dump-ir", "report", "demo", "bench", "plan", "make-tiny"]


@pytest.mark.parametrize("cmd", COMMANDS)
def test_help(cmd):
    r = CliRunner().invoke(main, [cmd, "--help"])
    assert r.exit_code == 0 and "Usage" in r.output


def _dayzero(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "dayzero.tools.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_unsupported_ops_listed_at_once(tmp_path):
    out = tmp_path / "out"
    r = _dayzero("compile", "dayzero.tools.examples:unsupported", "-o", str(out))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr  # one line, no traceback
    assert "i0" in lines[0] and "atan2" in lines[0] and "examples.py:" in lines[0]
    assert not out.exists()
    assert not list(tmp_path.iterdir())  # no temp dir left behind either


@pytest.mark.slow
@pytest.mark.parametrize("args, needle", [
    (["compile", "/nonexistent/dir", "-o", "X"], "neither a checkpoint"),
    (["run", "/nonexistent", "--input-ids", "1"], "not a dayzero artifact"),
    (["report", "/nonexistent"], "not a dayzero artifact"),
])
def test_bad_input_one_line_exit_2(args, needle, tmp_path):
    r = _dayzero(*args)
    assert r.returncode == 2
    assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_compile_run_report_json(compiled_factory, tmp_path):
    out = tmp_path / "art"
    r = CliRunner().invoke(main, ["compile", "dayzero.tools.examples:tiny_dense", "-o", str(out),
                                  "--max-seq", "32", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["kernels"] > 10
    r = CliRunner().invoke(main, ["run", str(out), "--input-ids", "1,2,3", "--json"])
    res = json.loads(r.output)
    assert res["logits_shape"] == [1, 3, 256] and len(res["argmax"]) == 3
    r = CliRunner().invoke(main, ["run", str(out), "--input-ids", "1,x"])
    assert r.exit_code == 2 and "comma-separated" in r.output
    r = CliRunner().invoke(main, ["report", str(out), "--json"])
    rep = json.loads(r.output)
    assert rep["unsupported"] == [] and rep["routes"]


@pytest.mark.slow
def test_dump_ir_writes_every_pass(tmp_path):
    from dayzero.passes.pipeline import PIPELINE
    from dayzero.passes.ir.text import parse_graph

    r = CliRunner().invoke(main, ["dump-ir", "dayzero.tools.examples:tiny_moe", "--dir", str(tmp_path),
                                  "--max-seq", "16"])
    assert r.exit_code == 0, r.output
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["000_input.ir"] + [f"{k:03d}_{n}.ir" for k, (n, _) in enumerate(PIPELINE, 1)]
    for f in files:
        parse_graph((tmp_path / f).read_text())


@pytest.mark.slow
def test_demo_json():
    """The demo: tiny DeepSeek-V4 with FP8 experts, a chat prompt through its template, text out, equal to
    upstream transformers (its own FP8 loader) in logits and greedy tokens; every pattern found on a kernel route."""
    r = _dayzero("demo", "--json", timeout=1800)  # a V4 compile: about a minute alone, much longer on a busy host
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["max_abs_diff"] <= 1e-4 and res["ok"] and res["tokens_match_upstream"]
    assert {"compile", "run", "eager"} <= set(res["seconds"])
    assert res["artifact"] and res["model"] == "deepseek_v4" and res["experts"] == "fp8"
    assert res["prompt_tokens"] > 10 and res["tokens"] and res["text"] == res["upstream_text"]
    pats = res["patterns"]
    assert {"moe", "dequant"} <= set(pats) and any(p.startswith("compressed_attention") for p in pats)
    fp8 = pats["dequant"]["kernels"]
    assert fp8 and all(set(routes) == {"hand-scheduled"} for routes in fp8.values())
    assert all(p["kernels"] for p in pats.values())  # every pattern found has its kernels listed


def test_demo_pattern_routes():
    """Which kernels each pattern of a compile report produced, and their routes."""
    from dayzero.tools.demo import pattern_routes

    report = {"patterns": {"moe": 2, "dequant": 4, "compressed_attention_csa": 1, "paged_kv_write": 3},
              "kernel_ops": {"k0": "moe_experts_fp8", "k1": "compressed_attention", "k2": "paged_state_index_put",
                             "k3": "add", "k4": "compressed_attention"},
              "routes": {"k0": "hand-scheduled", "k1": "hand-scheduled", "k2": "hand-scheduled", "k3": "default",
                         "k4": "tuned"}}
    assert pattern_routes(report) == {
        "compressed_attention_csa": {"found": 1, "kernels": {"compressed_attention": {"hand-scheduled": 1,
                                                                                       "tuned": 1}}},
        "dequant": {"found": 4, "kernels": {"moe_experts_fp8": {"hand-scheduled": 1}}},
        "moe": {"found": 2, "kernels": {"moe_experts_fp8": {"hand-scheduled": 1}}},
        "paged_kv_write": {"found": 3, "kernels": {"paged_state_index_put": {"hand-scheduled": 1}}}}
