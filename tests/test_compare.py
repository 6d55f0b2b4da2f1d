"""``dayzero compare``: the compiled artifact against upstream eager, and where they part.

Specification:
* a correct artifact compares within 1e-4 (exit 0), the interpreter matches upstream (the trace is right);
* an artifact whose copy of one layer-1 weight was corrupted after compiling fails (exit 1) and names the first
  divergent node: the linear reading that weight, in ``layers.1``, with its upstream source line;
* a top-k over exactly tied scores is reported as "tie at <node>", not as a numerical bug, and the comparison
  downstream follows the compiled tie-break.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from dayzero.tools.cli import main
from dayzero.tools.compare import compare, diff, topk_tie

from _artifact_edit import rehash

TINY_MOE = "dayzero.tools.examples:tiny_moe"


def test_compare_passes_on_a_correct_artifact(compiled_factory):
    art, _, _ = compiled_factory("tiny_moe")
    r = CliRunner().invoke(main, ["compare", TINY_MOE, str(art), "--json", "--seq-len", "7"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    assert res["ok"] and res["trace_ok"] and res["first_divergence"] is None and res["ties"] == []
    assert res["max_abs_diff"] <= 1e-4 and res["max_rel_diff"] >= 0 and res["seq_len"] == 7
    layers = [e["layer"] for e in res["layers"]]
    assert "model.model.layers.0" in layers and "model.model.layers.1" in layers
    assert res["weights"]["upstream"] > 0  # the reference reads upstream's tensors, not the artifact's


def test_corrupted_weight_fails_and_names_the_layer(compiled_factory, tmp_path):
    art, _, _ = compiled_factory("tiny_moe")
    bad = tmp_path / "bad"
    shutil.copytree(art, bad)
    name = "model.model.layers.1.self_attn.o_proj.weight"
    w = load_file(str(bad / "weights.safetensors"))
    w[name][3, 5] += 0.5
    save_file(w, str(bad / "weights.safetensors"))
    rehash(bad)  # a wrong weight compiled in, not a damaged file (the hash check would refuse that at load)

    r = CliRunner().invoke(main, ["compare", TINY_MOE, str(bad), "--json", "--per-node"])
    assert r.exit_code == 1, r.output
    res = json.loads(r.output)
    assert not res["ok"] and res["trace_ok"] and res["stage"] == "compile"
    fd = res["first_divergence"]
    assert fd["layer"] == "model.model.layers.1" and fd["op"] == "linear"
    assert fd["module"] == "model.model.layers.1.self_attn.o_proj"
    assert fd["source"].startswith("transformers/models/qwen3_moe/modeling_qwen3_moe.py:")
    assert fd["abs_diff"] > 1e-4 and fd["node"].startswith("%")
    by_layer = {e["layer"]: e for e in res["layers"]}
    assert by_layer["model.model.layers.0"]["first_divergence"] is None
    # --per-node: every step, and nothing before the corrupted linear is outside tolerance
    nodes = res["nodes"]
    assert [n["step"] for n in nodes] == list(range(len(nodes)))
    assert not any(n["bad"] for n in nodes[:fd["step"]])

    r = CliRunner().invoke(main, ["compare", TINY_MOE, str(bad)])  # the human form names it too
    assert r.exit_code == 1 and "first divergence: %" in r.output and "model.model.layers.1" in r.output


class TieRouter(torch.nn.Module):
    """Every row scores its 6 candidates 3 > 2 = 2 = 2 > 1 > 0: the 2nd place is a three-way tie."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 6, bias=False)
        self.w = torch.nn.Parameter(torch.tensor([3.0, 1.0, 2.0, 2.0, 2.0, 0.0]))

    def forward(self, x):
        scores = self.proj(x) * 0.0 + self.w
        vals, idx = torch.topk(scores, 2, dim=-1)
        return self.proj(x).gather(-1, idx) * vals


@pytest.fixture(scope="module")
def tie_artifact(tmp_path_factory):
    from dayzero.tools.driver import compile_model

    torch.manual_seed(0)
    model = (TieRouter().eval(), (torch.randn(1, 5, 4),))
    out = tmp_path_factory.mktemp("tie") / "art"
    compile_model(model, out, max_seq=16)
    return model, out


@pytest.mark.slow
def test_topk_tie_detected_end_to_end(tie_artifact):
    model, art = tie_artifact
    res = compare(model, art, seq_len=9, per_node=True)
    assert res["ok"] and res["trace_ok"] and res["first_divergence"] is None
    if not res["logits_ok"]:  # the kernel broke the tie another way than torch: it must be named as a tie
        assert len(res["ties"]) == 1 and res["ties"][0].startswith("tie at %")
        assert "k-th and (k+1)-th scores equal" in res["ties"][0]
        assert [n["op"] for n in res["nodes"] if n.get("tie")] == ["topk"]


@pytest.mark.slow
def test_a_wrong_trace_is_reported_as_such(tie_artifact, monkeypatch):
    from dayzero.passes.ir import interp

    model, art = tie_artifact
    real = interp.run_graph
    monkeypatch.setattr(interp, "run_graph", lambda *a, **k: [o + 1.0 for o in real(*a, **k)])
    res = compare(model, art, seq_len=3)
    assert not res["ok"] and not res["trace_ok"] and res["stage"] == "trace"
    assert res["first_divergence"]["source"] == "trace" and "tracing" in res["first_divergence"]["message"]


def test_topk_tie_rules():
    scores = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0], [5.0, 4.0, 3.0, 2.0, 1.0]])
    ref_v, ref_i = scores.topk(2, -1)  # row 0: 2nd place tied between 2 and 3
    other = ref_i.clone()
    other[0, 1] = 3 if int(ref_i[0, 1]) == 2 else 2
    t = topk_tie(scores, ref_i, other, 2, -1)
    assert t == {"rows": 1, "kth_tied": True}
    assert topk_tie(scores, ref_i, ref_i.clone(), 2, -1) is None  # same choice: nothing to explain
    wrong = ref_i.clone()
    wrong[1, 1] = 2  # 3.0 instead of 4.0: a real divergence
    assert topk_tie(scores, ref_i, wrong, 2, -1) is None
    swapped = torch.tensor([[0, 3], [0, 1]]), torch.tensor([[0, 2], [0, 1]])
    s2 = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0], [5.0, 4.0, 3.0, 2.0, 1.0]])
    assert topk_tie(s2, swapped[1], swapped[0], 2, -1)["rows"] == 1
    # ties within 1e-6 count, a gap of 1e-3 does not
    near = torch.tensor([[3.0, 2.0 + 5e-7, 2.0]])
    assert topk_tie(near, torch.tensor([[0, 1]]), torch.tensor([[0, 2]]), 2, -1)["kth_tied"]
    far = torch.tensor([[3.0, 2.001, 2.0]])
    assert topk_tie(far, torch.tensor([[0, 1]]), torch.tensor([[0, 2]]), 2, -1) is None


def test_diff_tolerance():
    ref = torch.tensor([1000.0, 1.0, 0.0])
    out = ref + torch.tensor([0.01, 0.0, 5e-5])
    assert diff(out, ref, 1e-4, 0.0)["bad"] == 1  # 0.01 on 1000 is outside an absolute 1e-4
    assert diff(out, ref, 1e-4, 1e-4)["bad"] == 0  # ... inside a stated relative bound
    d = diff(out, ref, 1e-4, 0.0)
    assert abs(d["rel"] - 1e-5) < 1e-7 and abs(d["abs"] - 0.01) < 1e-4  # float32 inputs
    nan = torch.tensor([float("nan")])
    assert diff(nan, nan, 1e-4, 0.0)["bad"] == 1  # NaN never agrees: NaN weights give NaN on both sides
    assert diff(nan, nan, 1e-4, 0.0, skip_ref_nan=True)["bad"] == 0  # ... unless the reference is undefined there
    assert diff(nan, torch.tensor([1.0]), 1e-4, 0.0)["bad"] == 1
    assert diff(torch.tensor([1.0]), nan, 1e-4, 0.0)["bad"] == 1
    assert diff(torch.tensor([float("inf")]), torch.tensor([float("inf")]), 1e-4, 0.0)["bad"] == 0
    assert diff(torch.zeros(2), torch.zeros(3), 1e-4, 0.0)["bad"] > 0


def test_compare_user_errors(compiled_factory, tmp_path):
    art, _, _ = compiled_factory("tiny_moe")
    r = CliRunner().invoke(main, ["compare", TINY_MOE, str(tmp_path / "nothing")])
    assert r.exit_code == 2 and "not a dayzero artifact" in r.output
    r = CliRunner().invoke(main, ["compare", TINY_MOE, str(art), "--seq-len", "999"])
    assert r.exit_code == 2 and "outside the artifact's range" in r.output
    r = CliRunner().invoke(main, ["compare", "dayzero.tools.examples:tiny_dense", str(art)])
    assert r.exit_code == 2 and "not compiled from this model" in r.output


@pytest.mark.slow
def test_compare_on_an_mxfp4_checkpoint(lowprec_compiled):
    """The upstream reference of a checkpoint with MXFP4 experts loads on a fresh install (transformers' MXFP4
    loader needs accelerate: a declared dependency), and the artifact matches it."""
    ckpt, art, _ = lowprec_compiled("gpt_oss", "mxfp4")
    r = CliRunner().invoke(main, ["compare", str(ckpt), str(art), "--json", "--seq-len", "9"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    assert res["ok"] and res["max_abs_diff"] <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("seq_len", ["1", "16"])
def test_compare_on_deepseek_v32_with_paged_sparse_attention(tiny_compiled, seq_len):
    """DeepSeek-V3.2's MLA sparse attention reads a paged cache: compare's reference gathers it through the block
    table (it crashed with an IndexError, exit 3, reading the table twice), and the artifact matches upstream."""
    ckpt, art, _ = tiny_compiled("deepseek_v32")
    r = CliRunner().invoke(main, ["compare", str(ckpt), str(art), "--json", "--seq-len", seq_len])
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    assert res["ok"] and res["trace_ok"] and res["max_abs_diff"] <= 1e-4 and res["seq_len"] == int(seq_len)


def _png(path, h, w, seed):
    import numpy as np
    from PIL import Image

    Image.fromarray(np.random.RandomState(seed).randint(0, 255, (h, w, 3), dtype=np.uint8)).save(path)
    return str(path)


@pytest.mark.slow
def test_compare_with_an_image_on_a_multimodal_checkpoint(tiny_compiled, tmp_path):
    """``compare --image``: the tiny Qwen3-VL-MoE prefill with one 64x64 image (grid 1x4x4: 4 image tokens after
    the 2x2 merge) matches upstream's AutoModelForImageTextToText, and the compiled vision features match
    upstream's encoder."""
    ckpt, art, _ = tiny_compiled("qwen3_vl_moe")
    img = _png(tmp_path / "a.png", 64, 64, 1)
    r = CliRunner().invoke(main, ["compare", str(ckpt), str(art), "--json", "--seq-len", "9", "--image", img])
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    assert res["ok"] and res["trace_ok"] and res["max_abs_diff"] <= 1e-4 and res["stage"] is None
    assert res["vision"]["ok"] and res["vision"]["max_abs_diff"] <= 1e-4
    assert res["images"] == [img] and res["prompt_tokens"] == 9 + 2 + 4  # text, vision start/end, image tokens


def test_compare_image_on_a_text_only_artifact_is_a_user_error(compiled_factory, tmp_path):
    art, _, _ = compiled_factory("tiny_moe")
    img = _png(tmp_path / "a.png", 64, 64, 1)
    r = CliRunner().invoke(main, ["compare", TINY_MOE, str(art), "--image", img])
    assert r.exit_code == 2, r.output
    assert r.output.count("\n") == 1 and "no vision program" in r.output and "--image" in r.output


@pytest.mark.slow
def test_compare_with_an_image_localises_a_vision_divergence(tiny_compiled, tmp_path, monkeypatch):
    """Image features off by 0.01 (the vision program's output perturbed after it ran) are reported as stage
    ``vision``, not blamed on the text program or the trace."""
    from dayzero.runtime.multimodal import Multimodal

    ckpt, art, _ = tiny_compiled("qwen3_vl_moe")
    features = Multimodal.features  # where every image of a request is encoded

    def off(self, pixels, grid):
        return features(self, pixels, grid) + 0.01
    monkeypatch.setattr(Multimodal, "features", off)
    res = compare(str(ckpt), art, seq_len=5, images=[_png(tmp_path / "a.png", 64, 64, 2)])
    assert not res["ok"] and res["stage"] == "vision" and not res["vision"]["ok"]
    assert abs(res["vision"]["max_abs_diff"] - 0.01) < 1e-3 and res["first_divergence"]["source"] == "vision"


# ---- streamed: upstream one decoder layer at a time (issue 17 item 4) ---------------------------------------------

@pytest.mark.slow
def test_streamed_compare_matches_layer_by_layer_and_names_a_wrong_layer(lowprec_compiled, tmp_path):
    """``--streamed`` on gpt-oss with MXFP4 experts: every layer, on the compiled previous layer's output, matches
    upstream's layer (weights materialised one module at a time, MXFP4 decoded by transformers' own converter), as
    do the logits. Against a checkpoint whose layer-1 o_proj differs in one element, layer 0 stays ok and layer 1
    is the first divergence."""
    from _lowprec_ref import rewrite_checkpoint

    ckpt, art, _ = lowprec_compiled("gpt_oss", "mxfp4")
    r = CliRunner().invoke(main, ["compare", str(ckpt), str(art), "--json", "--seq-len", "9", "--streamed"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    assert res["mode"] == "streamed" and res["ok"] and res["first_divergence"] is None
    assert [e["layer"] for e in res["layers"]] == ["model.embed_tokens", "model.layers.0", "model.layers.1",
                                                   "lm_head"]
    assert all(e["ok"] and e["chain_ok"] and e["max_abs_diff"] <= 1e-4 for e in res["layers"])
    whole = compare(str(ckpt), art, seq_len=9)  # the whole-model comparison agrees on the logits
    assert abs(whole["max_abs_diff"] - res["max_abs_diff"]) <= 1e-5 and res["top1_agreement"] == 1.0

    def bump(t):
        t["model.layers.1.self_attn.o_proj.weight"][3, 5] += 0.5
    other = rewrite_checkpoint(ckpt, tmp_path / "other", bump)
    r = CliRunner().invoke(main, ["compare", str(other), str(art), "--seq-len", "9", "--streamed"])
    assert r.exit_code == 1, r.output
    assert "first divergence: model.layers.1 " in r.output and "MISMATCH" in r.output
    r = CliRunner().invoke(main, ["compare", str(other), str(art), "--seq-len", "9", "--streamed", "--json"])
    by = {e["layer"]: e for e in json.loads(r.output)["layers"]}
    assert by["model.layers.0"]["ok"] and not by["model.layers.1"]["ok"]


def test_reference_decodes_experts_that_transformers_loader_leaves_missing(lowprec_tiny):
    """transformers' loader has no converter for DeepSeek-V4's MXFP4 expert pairs (``w1.weight_blocks`` and
    ``w1.weight_scales``): it reports the fused expert parameters missing and initialises them at random, so a
    reference built by it alone is not the checkpoint's model. ``load_upstream`` fills them from the checkpoint
    instead: expert 3's down projection equals its stored FP4 codes times 2^(E8M0 - 127), decoded here with
    ml_dtypes."""
    import ml_dtypes
    from safetensors import safe_open

    from dayzero.frontend.hf import load_upstream

    ckpt = lowprec_tiny("deepseek_v4", "mxfp4")
    key = "model.layers.1.ffn.experts.3.w2.weight_"
    stored = {}
    for f in ckpt.glob("*.safetensors"):
        with safe_open(f, "np") as g:
            stored.update({k: g.get_tensor(k) for k in g.keys() if k.startswith(key)})
    blocks, scales = stored[key + "blocks"], stored[key + "scales"]  # [out, in/32, 16], [out, in/32]
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:2], 32)
    want = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32) * np.exp2(scales.astype(np.float32) - 127)[..., None]
    got = load_upstream(ckpt).model.layers[1].mlp.experts.down_proj[3]
    assert torch.equal(got, torch.from_numpy(want.reshape(got.shape)))


@pytest.mark.slow
def test_streamed_compare_follows_hyper_connection_streams(lowprec_compiled, tmp_path):
    """DeepSeek-V4 (MXFP4 experts, CSA and HCA layers, hash routing first) streamed: its decoder layers take and
    return ``hc_mult`` residual streams, so layer 0 runs on the compiled embedding copied into each stream, every
    layer's output is the layer's own stream mix (not the compressor's cache writes traced after it), and the head
    collapses the compiled last state through upstream's ``hc_head`` before the norm. A one-element change in layer
    2's attention output projection is named as the first divergence."""
    from _lowprec_ref import rewrite_checkpoint

    ckpt, art, _ = lowprec_compiled("deepseek_v4", "mxfp4")
    r = CliRunner().invoke(main, ["compare", str(ckpt), str(art), "--json", "--seq-len", "9", "--streamed"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    assert res["ok"] and [e["layer"] for e in res["layers"]] == [
        "model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2", "lm_head"]
    assert all(e["ok"] and e["chain_ok"] and e["max_abs_diff"] <= 1e-4 for e in res["layers"])
    whole = compare(str(ckpt), art, seq_len=9)
    assert abs(whole["max_abs_diff"] - res["max_abs_diff"]) <= 1e-5 and res["top1_agreement"] == 1.0

    def bump(t):
        t["model.layers.2.attn.wo_b.weight"][3, 5] += 0.5
    other = rewrite_checkpoint(ckpt, tmp_path / "other", bump)
    r = CliRunner().invoke(main, ["compare", str(other), str(art), "--seq-len", "9", "--streamed", "--json"])
    assert r.exit_code == 1, r.output
    res = json.loads(r.output)
    assert res["first_divergence"]["layer"] == "model.layers.2"
    by = {e["layer"]: e for e in res["layers"]}
    assert by["model.layers.1"]["ok"] and not by["model.layers.2"]["ok"]


def test_streamed_mode_is_chosen_when_the_reference_would_not_fit(tmp_path):
    """The fp32 reference's size comes from config.json alone (a meta model): the published gpt-oss-20b (20.9B
    parameters, 84 GB in fp32) streams on any machine with less than its size; a tiny model does not."""
    from dayzero.tools import compare_streamed as cs
    from dayzero.tools.make_full import full_config
    from dayzero.tools.make_tiny import make_tiny

    tiny = make_tiny("gpt_oss", tmp_path / "tiny", seed=0)
    assert not cs.needs_streaming(tiny, available=10 ** 9)
    assert cs.needs_streaming(tiny, available=10 ** 3)
    full_config("gpt_oss").save_pretrained(tmp_path / "oss20b")
    assert 84e9 <= cs.reference_bytes(tmp_path / "oss20b") <= 84e9 * cs.LOADER_OVERHEAD * 1.05
    assert cs.needs_streaming(tmp_path / "oss20b", available=64 * 2 ** 30)
    r = CliRunner().invoke(main, ["compare", TINY_MOE, str(tmp_path / "x"), "--streamed"])
    assert r.exit_code == 2 and "--streamed compares against a checkpoint directory" in r.output


def test_the_first_layer_input_is_copied_along_the_stream_axis_when_streams_equal_positions():
    """Upstream expands DeepSeek-V4's embedding [1, S, H] into hc_mult streams [1, S, hc, H]. With S == hc the
    shapes alone allow either axis; the compiled embedding must be copied along the one upstream copied along (it
    was broadcast over the positions: full-width V4-Flash compared at --seq-len 4 reported layer 0 off by 6.4)."""
    from dayzero.tools.compare_streamed import _as_layer_input

    g = torch.Generator().manual_seed(0)
    mine, upstream_embedding = torch.randn(1, 4, 8, generator=g), torch.randn(1, 4, 8, generator=g)
    theirs = upstream_embedding.unsqueeze(2).expand(-1, -1, 4, -1).contiguous()
    assert torch.equal(_as_layer_input("model.layers.0", mine, theirs), mine.unsqueeze(2).expand(-1, -1, 4, -1))
