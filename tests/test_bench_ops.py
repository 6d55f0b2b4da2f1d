"""``dayzero bench ops --json``: the suite's JSON contract (DESIGN.md's bench object) on one small case, the
kernel checked against torch eager in the same run."""

from __future__ import annotations

import json

from click.testing import CliRunner

from dayzero.tools.bench_ops import cases
from dayzero.tools.cli import main


def test_bench_ops_json_one_case():
    r = CliRunner().invoke(main, ["bench", "ops", "--json", "--quick", "--case", "rms_norm"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)  # progress lines go to stderr
    assert out["suite"] == "ops" and out["machine"]["peak_GFLOPs"] > 0
    (row,) = out["results"]
    assert row["case"] == "rms_norm_16x2880" and row["unit"] == "s"
    assert row["dayzero"] > 0 and row["baselines"]["torch_eager"] > 0
    assert row["bound"] > 0 and row["bound_name"] in ("flops/peak", "bytes/read_bandwidth")
    assert row["route"] in ("hand-scheduled", "tuned", "default", "generic")
    assert row["max_rel_err"] < 1e-4  # the kernel computed what torch does


def test_bench_ops_covers_each_family_at_model_shapes():
    names = [c.name for c in cases()]
    for t in (1, 16, 512):  # projections 2880-7168 wide at T = 1, 16, 512, fp32 and bf16
        assert f"linear_float32_2880x2880_T{t}" in names and f"linear_float32_7168x2048_T{t}" in names
        assert f"linear_bfloat16_2880x2880_T{t}" in names
        assert f"dequant_linear_bf16_2880x2880_T{t}" in names  # fp32 x, a bf16 weight as a checkpoint stores it
    assert "softmax_16x201088" in names and "softmax_512x4096" in names and "rms_norm_512x7168" in names
    assert any(n.startswith("bmm_") for n in names)


def test_bench_text_output_gives_each_result_and_its_baselines(capsys):
    """The benches' text form (``echo_bench``): a header, then one line per result with its baselines scaled;
    ``--json`` prints the object instead, nothing else."""
    from dayzero.tools.bench import baselines_text, echo_bench

    out = {"results": [{"case": "decode", "dayzero": 2e-3, "baselines": {"torch": 3e-3, "relax": 2.5e-3}}]}
    echo_bench(out, False, lambda r: f"{r['case']} {r['dayzero'] * 1e3:.1f} ms ({baselines_text(r, 1e3, '.1f', 'ms')})",
               "header")
    assert capsys.readouterr().out.splitlines() == ["header", "decode 2.0 ms (torch 3.0 ms, relax 2.5 ms)"]
    echo_bench(out, True, lambda r: "unused", "header")
    assert json.loads(capsys.readouterr().out) == out
    assert baselines_text({"baselines": {"eager": 0.5}}) == "eager 0.5"


def test_bench_dequant_times_the_batched_decode_route_beside_the_gemm_it_replaced(monkeypatch):
    """``bench dequant``'s bf16 batched-decode cases (small shapes here): today's route, the few-token GEMM and
    torch eager side by side, each with the weight-bytes bound, and the route's result within fp32 rounding of an
    fp64 product."""
    import torch

    from dayzero.targets.host import host_target_dict
    from dayzero.tools import bench_dequant

    monkeypatch.setattr(bench_dequant, "BATCH_SHAPES", [(64, 96)])
    out = bench_dequant.bf16_batch_cases(10e9, True, host_target_dict(), torch.Generator().manual_seed(0))
    assert [r["case"] for r in out] == ["decode_batch_bf16_64x96_n4", "decode_batch_bf16_64x96_n8"]
    for r in out:
        assert set(r["baselines"]) == {"few_token_gemm", "torch_eager_bf16"} and r["dayzero"] > 0
        assert r["bound"] == 64 * 96 * 2 / 10e9 and r["max_rel_err_vs_fp64"] < 1e-5


def test_bench_attention_full_width_json_at_smaller_dims(monkeypatch):
    """``dayzero bench attention --full-width --json``: the MLA and V4 compressed-attention cases' JSON (the tiled
    CPU kernels, their row-by-row forms and torch, each kernel checked against torch in the run), at smaller dims
    so it runs in seconds (the published dims are what the bench runs)."""
    from dayzero.tools import bench_attention

    monkeypatch.setattr(bench_attention, "FULL", dict(H=16, Dn=32, Dr=16, Dv=32, R=64, K=40, L=256))
    monkeypatch.setattr(bench_attention, "V4", dict(H=16, D=32, W=8, K=12, E=41, pos=299))
    r = CliRunner().invoke(main, ["bench", "attention", "--full-width", "--quick", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["suite"] == "attention" and out["machine"]["read_bandwidth_GBps"] > 0
    assert [row["case"] for row in out["results"]] == ["mla_full_b1", "mla_full_b8", "v4_csa_full_b1",
                                                       "v4_csa_full_b8", "v4_hca_full_b8"]
    for row in out["results"]:
        torch_name = "torch_absorbed" if row["case"].startswith("mla") else "torch_eager"
        assert row["dayzero"] > 0 and row["baselines"]["dayzero_rows"] > 0 and row["baselines"][torch_name] > 0
        assert row["bound"] > 0 and 0 < row["fraction_of_bound"] == row["bound"] / row["dayzero"]
    mla, v4 = out["results"][:2], out["results"][2:]
    assert all(row["flops"] == 2 * row["queries"] * 16 * (40 * (2 * 64 + 16) + 64 * 64) for row in mla)
    assert [row["rows"] for row in v4] == [8 + 12, 8 + 12, 8 + 2]  # window + CSA's selected / HCA's valid entries
