"""The CLI contract: --help everywhere, --json, exit codes, one-line errors, no half-written artifacts."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from dayzero.tools.cli import main
from conftest import LOWPREC_MAX_SEQ, SHARED_MAX_SEQ

COMMANDS = ["compile", "run", "dump-ir", "report", "demo", "bench", "plan", "make-tiny"]


@pytest.mark.parametrize("cmd", COMMANDS)
def test_help(cmd):
    r = CliRunner().invoke(main, [cmd, "--help"])
    assert r.exit_code == 0 and "Usage" in r.output


@pytest.mark.parametrize("args, needle", [
    # counts with a suffix (capacity.parse_count: k = 10^3, M = 10^6) reach the compile options, checked there
    (["--max-seq", "1M", "--prefill-chunk", "2M"], "--prefill-chunk must be in [1, --max-seq=1000000], got 2000000"),
    (["--max-seq", "64k", "--prefill-chunk", "64001"], "--prefill-chunk must be in [1, --max-seq=64000]"),
    (["--max-seq", "1Q"], "--max-seq: expected a number like 1000, 128k or 1M, got '1Q'"),
    (["--max-seq", "0"], "--max-seq: must be positive"),
])
def test_compile_counts_take_suffixes(args, needle, tmp_path):
    r = CliRunner().invoke(main, ["compile", str(tmp_path / "ckpt"), "-o", str(tmp_path / "out"), *args])
    assert r.exit_code == 2 and needle in r.output, r.output
    assert not (tmp_path / "out").exists()


def test_bench_long_kinds():
    """bench long splits a decode step by the step's op: the indexer op, the attention kernels, the rest (a
    module path decides nothing: the indexer's compressor projections are rest)."""
    from dayzero.tools.bench_long import _kind

    assert _kind("dsa_indexer_topk at model.layers.0.self_attn.indexer (x.py:1)") == "indexer"
    assert _kind("dsa_indexer_topk at model.layers.1.self_attn.compressor.indexer (x.py:592)") == "indexer"
    assert _kind("linear at model.layers.1.self_attn.compressor.indexer.kv_proj (x.py:529)") == "rest"
    assert _kind("compressed_attention at model.layers.0.self_attn (x.py:857)") == "attention"
    assert _kind("mla_sparse_attention at model.layers.0.self_attn (x.py:9)") == "attention"
    assert _kind("linear at model.layers.0.self_attn.q_b_proj (x.py:9)") == "rest"
    r = CliRunner().invoke(main, ["bench", "long", "--contexts", "2M"])
    assert r.exit_code == 2 and "--contexts must be non-empty, each in [2, --max-seq 1000000]" in r.output


def _refused(args: list[str]) -> str:
    """``dayzero ARGS`` in-process (click's runner; the exit code and stderr of a real process are checked end to
    end in test_untrusted_parse.py): exit 2 by the CLI's own exit, nothing on stdout, one stderr line, returned."""
    r = CliRunner().invoke(main, args)
    assert isinstance(r.exception, SystemExit) and r.exit_code == 2, (args, r.output, r.exc_info)
    assert r.stdout == "" and "Traceback" not in r.stderr, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr  # one line, no traceback
    return lines[0]


@pytest.mark.slow
def test_unsupported_ops_listed_at_once(tmp_path):
    out = tmp_path / "out"
    line = _refused(["compile", "dayzero.tools.examples:unsupported", "-o", str(out)])
    assert "i0" in line and "atan2" in line and "examples.py:" in line
    assert not out.exists()
    assert not list(tmp_path.iterdir())  # no temp dir left behind either


@pytest.mark.parametrize("args, needle", [
    (["compile", "/nonexistent/dir", "-o", "X"], "neither a checkpoint"),
    (["run", "/nonexistent", "--input-ids", "1"], "not a dayzero artifact"),
    (["report", "/nonexistent"], "not a dayzero artifact"),
])
def test_bad_input_one_line_exit_2(args, needle, tmp_path):
    assert needle in _refused(args)


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
    # @FILE: a prompt too long for the command line (commas and/or whitespace between the ids)
    (tmp_path / "ids.txt").write_text("1,\n2 3\n")
    r = CliRunner().invoke(main, ["run", str(out), "--input-ids", f"@{tmp_path / 'ids.txt'}", "--json"])
    assert r.exit_code == 0, r.output
    assert {k: v for k, v in json.loads(r.output).items() if k != "seconds"} == \
        {k: v for k, v in res.items() if k != "seconds"}
    for bad, needle in ((tmp_path / "none.txt", "no such file"), (tmp_path / "ids.txt", "not a text file")):
        if bad.exists():
            bad.write_bytes(b"1,2,\xff")
        r = CliRunner().invoke(main, ["run", str(out), "--input-ids", f"@{bad}"])
        assert r.exit_code == 2 and needle in r.output, r.output
    r = CliRunner().invoke(main, ["report", str(out), "--json"])
    rep = json.loads(r.output)
    assert rep["unsupported"] == [] and rep["routes"]


def _step_files() -> list[str]:
    from dayzero.tools.compiler import GRAPH_STEPS

    return ["000_trace.ir"] + [f"{k:03d}_{n}.ir" for k, (n, _) in enumerate(GRAPH_STEPS, 1)]


@pytest.mark.slow
def test_dump_ir_writes_every_pass(tmp_path):
    from dayzero.passes.ir.text import parse_graph

    r = CliRunner().invoke(main, ["dump-ir", "dayzero.tools.examples:tiny_moe", str(tmp_path), "--max-seq", "16"])
    assert r.exit_code == 0, r.output
    assert [p.name for p in tmp_path.iterdir()] == ["prefill"]  # a stateless module: one program
    files = sorted(p.name for p in (tmp_path / "prefill").iterdir())
    assert files == _step_files()
    for f in files:
        parse_graph((tmp_path / "prefill" / f).read_text())


def test_dump_ir_takes_compile_options(tmp_path):
    r = CliRunner().invoke(main, ["dump-ir", "dayzero.tools.examples:tiny_moe", str(tmp_path / "d"),
                                  "--kv-blocks", "1"])
    assert r.exit_code == 2 and r.output.strip() == "error: --kv-blocks must be at least 2 (block 0 is the " \
                                                    "scratch block)", r.output
    assert not (tmp_path / "d").exists()


def test_dump_ir_stateful_expert_route(lowprec_tiny, tmp_path):
    """A stateful MXFP4 checkpoint on the workspace route: every program's dump shows the steps that only compile
    options switch on (paged KV, the batched decode's token positions, the expert workspace)."""
    from dayzero.passes.ir.text import parse_graph

    ckpt = lowprec_tiny("gpt_oss", "mxfp4")
    r = CliRunner().invoke(main, ["dump-ir", str(ckpt), str(tmp_path), "--max-seq", str(LOWPREC_MAX_SEQ), "--max-batch", "2",
                                  "--expert-route", "workspace"])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decode", "decode_batch", "prefill", "prefill_last"]
    for prog in ("prefill", "prefill_last", "decode", "decode_batch"):
        d = tmp_path / prog
        assert sorted(p.name for p in d.iterdir()) == _step_files()
        ir = {f: parse_graph((d / f).read_text()) for f in _step_files()}

        def ops(f):
            return {n.op for n in ir[f].nodes()}

        def tables(f):
            return [n.attr["name"] for n in ir[f].inputs if n.attr.get("kind") == "block_table"]
        pages, positions, workspace = (next(f for f in _step_files() if f.endswith(f"_{s}.ir"))
                                       for s in ("paged_kv", "token_positions", "expert_workspace"))
        before = _step_files()[_step_files().index(pages) - 1]
        assert not tables(before) and tables(pages), prog  # paged_kv adds the block tables
        ws_before = _step_files()[_step_files().index(workspace) - 1]
        assert "moe_experts_mxfp4" in ops(ws_before) and "moe_experts_mxfp4" not in ops(workspace)
        assert "moe_experts_mxfp4_ws" in ops(workspace), prog
        pos_before = _step_files()[_step_files().index(positions) - 1]
        changed = (d / positions).read_text() != (d / pos_before).read_text()
        assert changed == (prog == "decode_batch"), prog  # each token at its own position: the batched step only


@pytest.mark.slow
def test_dump_ir_multimodal_programs(tmp_path):
    """A multimodal checkpoint: its vision program is dumped beside prefill, decode and the batched text decode
    step, through the same steps (only the text programs' caches are paged)."""
    from dayzero.passes.ir.text import parse_graph
    from dayzero.tools.make_tiny import make_tiny

    ckpt = make_tiny("qwen3_vl_moe", tmp_path / "ckpt", seed=0)
    r = CliRunner().invoke(main, ["dump-ir", str(ckpt), str(tmp_path / "ir"), "--max-seq", str(SHARED_MAX_SEQ),
                                  "--image-grid", "1x4x4"])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in (tmp_path / "ir").iterdir()) == ["decode", "decode_batch", "prefill",
                                                                    "vision_1x4x4"]
    last = _step_files()[-1]
    for prog, paged in (("prefill", True), ("decode", True), ("decode_batch", True), ("vision_1x4x4", False)):
        assert sorted(p.name for p in (tmp_path / "ir" / prog).iterdir()) == _step_files()
        g = parse_graph((tmp_path / "ir" / prog / last).read_text())
        assert any(n.attr.get("kind") == "block_table" for n in g.inputs) == paged, prog


def test_demo_pattern_routes():
    """Which kernels each pattern of a compile report produced, and their routes."""
    from dayzero.tools.demo import pattern_routes

    report = {"patterns": {"moe.grouped_experts": 2, "dequant.experts": 2, "compressed_attention.csa": 1,
                           "sparse_attention.cache_attention": 1, "paged_kv_write": 3},
              "kernel_ops": {"k0": "moe_experts_fp8", "k1": "compressed_attention", "k2": "paged_state_index_put",
                             "k3": "add", "k4": "compressed_attention", "k5": "cache_attention"},
              "routes": {"k0": "hand-scheduled", "k1": "hand-scheduled", "k2": "hand-scheduled", "k3": "default",
                         "k4": "tuned", "k5": "hand-scheduled"}}
    assert pattern_routes(report) == {
        "compressed_attention.csa": {"found": 1, "kernels": {"compressed_attention": {"hand-scheduled": 1,
                                                                                       "tuned": 1}}},
        "dequant.experts": {"found": 2, "kernels": {"moe_experts_fp8": {"hand-scheduled": 1}}},
        "moe.grouped_experts": {"found": 2, "kernels": {"moe_experts_fp8": {"hand-scheduled": 1}}},
        "paged_kv_write": {"found": 3, "kernels": {"paged_state_index_put": {"hand-scheduled": 1}}},
        "sparse_attention.cache_attention": {"found": 1, "kernels": {"cache_attention": {"hand-scheduled": 1}}}}


def test_bench_long_full_width_shares_bench_fulls_checkpoint(tmp_path, monkeypatch):
    """``bench long --full-width-layers N`` makes (make-full) or reuses the checkpoint where ``bench full`` keeps
    it, WORK/MODEL_LN/ckpt, and compiles its own artifact beside bench full's."""
    from dayzero.tools import bench_full, bench_long, compiler, make_full

    made, compiled = [], []

    def fake_make_full(model, out, layers=None, **_):
        made.append((model, layers))
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")

    def fake_compile(ckpt, art, opts):
        compiled.append((ckpt, art.name, opts.max_seq, opts.max_batch, opts.prefill_chunk))
        art.mkdir(parents=True)
        (art / "artifact.json").write_text("{}")

    monkeypatch.setattr(make_full, "make_full", fake_make_full)
    monkeypatch.setattr(compiler, "compile_artifact", fake_compile)
    ckpt, full_art, _ = bench_full._artifact("deepseek_v4", 4, tmp_path, 4005, 8, 512)
    long_art = bench_long._artifact("deepseek_v4", tmp_path, 32000, 512, full_layers=4)
    assert made == [("deepseek_v4", 4)]  # once: bench long found bench full's checkpoint
    assert long_art.parent / "ckpt" == ckpt and long_art != full_art
    assert compiled[-1] == (str(ckpt), "art_32000_512", 32000, 1, 512)
    bench_long._artifact("deepseek_v4", tmp_path, 32000, 512, full_layers=4, batch=2)  # the batched step's own
    assert compiled[-1] == (str(ckpt), "art_32000_512_b2", 32000, 2, 512)
    assert bench_long._artifact("deepseek_v4", tmp_path, 32000, 512).parent.name == "deepseek_v4"  # tiny: its own
