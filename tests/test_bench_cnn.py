"""``dayzero bench cnn``: the ResNet-50 it builds is the standard one (its convolutions, parameters and FLOPs), and
the suite's JSON contract (DESIGN.md's bench object) with dayzero's output checked against onnxruntime's."""

from __future__ import annotations

import json

import onnx
import pytest
from click.testing import CliRunner

from dayzero.tools.bench_cnn import conv_flops, resnet50_onnx
from dayzero.tools.cli import main


def test_resnet50_graph_is_the_standard_architecture(tmp_path):
    convs = resnet50_onnx(tmp_path / "r.onnx")
    m = onnx.load(str(tmp_path / "r.onnx"))
    ops = [n.op_type for n in m.graph.node]
    assert ops.count("Conv") == len(convs) == 53 and ops.count("BatchNormalization") == 53
    assert ops.count("Add") == 16 and ops.count("MaxPool") == 1 and ops.count("Gemm") == 1  # 16 bottlenecks
    conv_params = sum(cout * cin * k * k for cin, _, _, cout, k, _, _ in convs)
    assert conv_params + 2048 * 1000 + 1000 == pytest.approx(25.5e6, rel=0.01)  # torchvision's 25.6M less BN's
    # torchvision's resnet50: 4.09 G multiply-adds (convolutions and the classifier)
    assert (sum(conv_flops(*c) for c in convs) + 2 * 2048 * 1000) / 2 == pytest.approx(4.09e9, rel=0.01)
    assert convs[0] == (3, 224, 224, 64, 7, 2, 3) and convs[-1] == (512, 7, 7, 2048, 1, 1, 0)


@pytest.mark.slow
def test_bench_cnn_json_matches_onnxruntime():
    r = CliRunner().invoke(main, ["bench", "cnn", "--json", "--rounds", "2", "--threads", "1"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)  # progress lines go to stderr
    assert out["suite"] == "cnn" and out["machine"]["peak_GFLOPs"] > 0
    model, *convs = out["results"]
    assert model["case"] == "resnet50_onnx_b1" and model["baselines"]["onnxruntime"] > 0
    assert model["max_rel_err"] < 1e-4  # dayzero computed what onnxruntime does
    # distinct shapes: the stem, 4 in the first stage (its first downsample has the expansion conv's shape), 6 in
    # each later one (a, b s2, c, down s2 of the first block; a, b of the others)
    assert len(convs) == 1 + 4 + 3 * 6 and sum(c["count"] for c in convs) == 53
    for row in out["results"]:
        assert row["unit"] == "s" and row["bound_name"] == "flops/peak" and 0 < row["bound"] <= row["dayzero"]
    for c in convs:
        assert c["cpu_rule"] == "conv2d" and c["max_rel_err"] < 1e-4
