"""make-tiny: tiny faithful checkpoints of transformers MoE decoders, in their published on-disk formats."""

import hashlib
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from dayzero import UserError  # noqa: E402
from dayzero.frontend import lowprec  # noqa: E402
from dayzero.tools import make_tiny as mt  # noqa: E402

FIVE = ["deepseek_v4", "deepseek_v32", "gpt_oss", "qwen3_moe", "qwen3_vl_moe"]


@pytest.fixture(autouse=True)
def _few_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _logits(model, cfg):
    with torch.no_grad():
        return model(**mt.check_inputs(cfg)).logits


def _reload(path, cfg, **kw):
    return mt.auto_class(cfg).from_pretrained(path, experts_implementation="batched_mm", dtype=torch.float32,
                                              **kw).eval()


def _digest(path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


@pytest.mark.parametrize("model_type", FIVE)
def test_fp32_roundtrip_matches_in_memory_model(model_type, tmp_path):
    path = mt.make_tiny(model_type, tmp_path / model_type)
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    cfg = mt.shrink_config(model_type)
    ref = mt.build_model(cfg)
    a = _logits(ref, cfg)
    b = _logits(_reload(path, cfg), cfg)
    assert torch.equal(a, b)
    # activations stay O(1): logits neither vanish nor explode
    assert 0.1 < a.std().item() < 10


def test_tiny_configs_keep_every_feature():
    v4 = mt.shrink_config("deepseek_v4")
    assert v4.layer_types == ["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention"]
    assert v4.mlp_layer_types == ["hash_moe", "moe", "moe"]
    assert (v4.hidden_size, v4.head_dim, v4.num_key_value_heads, v4.hc_mult) == (64, 32, 1, 4)
    assert v4.qk_rope_head_dim == 8 and v4.compress_rates["heavily_compressed_attention"] == 8
    assert (v4.n_routed_experts, v4.num_experts_per_tok, v4.n_shared_experts) == (8, 2, 1)
    v32 = mt.shrink_config("deepseek_v32")
    assert v32.mlp_layer_types == ["dense", "sparse"] and v32.first_k_dense_replace == 1
    assert (v32.index_n_heads, v32.index_topk, v32.index_head_dim) == (8, 4, 16)
    assert (v32.n_group, v32.topk_group, v32.kv_lora_rank) == (2, 1, 32)
    oss = mt.shrink_config("gpt_oss")
    assert oss.layer_types == ["sliding_attention", "full_attention"] and oss.sliding_window == 8
    rp = oss.rope_parameters
    assert rp["rope_type"] == "yarn" and rp["original_max_position_embeddings"] * rp["factor"] == 4096
    vl = mt.shrink_config("qwen3_vl_moe")
    assert vl.text_config.rope_parameters["mrope_section"] == [2, 3, 3]
    assert vl.vision_config.depth == 2 and vl.image_token_id < 256


def test_degenerate_parameters_are_filled():
    cfg = mt.shrink_config("deepseek_v4")
    model = mt.build_model(cfg)
    bufs = dict(model.named_buffers())
    params = dict(model.named_parameters())
    tables = [b for n, b in bufs.items() if n.endswith("tid2eid")]
    assert tables
    for t in tables:
        assert len(set(t.flatten().tolist())) > 1  # not every token to one expert
        assert all(len(set(row)) == len(row) for row in t.tolist())  # distinct experts within a row
        assert int(t.max()) < cfg.n_routed_experts
    for n, b in bufs.items():
        if n.endswith("e_score_correction_bias"):
            assert b.abs().max() > 0 and b.abs().max() < 1
    sinks = [p for n, p in params.items() if n.endswith("sinks")]
    assert sinks and all(p.abs().max() > 0 for p in sinks)
    norms = [p for n, p in params.items() if "norm" in n and p.dim() == 1]
    assert norms and all((p - 1).abs().max() < 0.5 and not torch.all(p == 1) for p in norms)


@pytest.mark.parametrize("model_type", ["gpt_oss", "qwen3_moe"])
def test_mxfp4_experts(model_type, tmp_path):
    from safetensors import safe_open

    path = mt.make_tiny(model_type, tmp_path / "ck", experts="mxfp4")
    conf = json.loads((path / "config.json").read_text())
    assert conf["quantization_config"]["quant_method"] == "mxfp4"
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        if model_type == "gpt_oss":
            p = "model.layers.0.mlp.experts."
            assert f.get_tensor(p + "gate_up_proj_blocks").shape == (8, 64, 2, 16)
            assert f.get_tensor(p + "gate_up_proj_scales").shape == (8, 64, 2)
            assert f.get_tensor(p + "down_proj_blocks").shape == (8, 64, 1, 16)
            assert f.get_tensor(p + "down_proj_scales").dtype == torch.uint8
            assert f.get_tensor(p + "down_proj_bias").dtype == torch.float32
            assert p + "gate_up_proj" not in keys
            stored = (f.get_tensor(p + "gate_up_proj_blocks"), f.get_tensor(p + "gate_up_proj_scales"))
        else:
            p = "model.layers.0.mlp.experts.3.gate_proj."
            assert f.get_tensor(p + "weight_blocks").shape == (32, 2, 16)
            assert f.get_tensor(p + "weight_scales").shape == (32, 2)
            assert p + "weight" not in keys
    cfg = mt.shrink_config(model_type)
    ref = _logits(mt.build_model(cfg, experts="mxfp4"), cfg)
    if model_type == "gpt_oss":  # the one MXFP4 rounding rule: lowprec's, applied to the fp32 weights
        w = mt.build_model(cfg).model.layers[0].mlp.experts.gate_up_proj.detach().transpose(1, 2)  # [E, out, in]
        want = lowprec.dequant_mxfp4(*lowprec.quantize_mxfp4(w.contiguous()))
        assert torch.equal(lowprec.dequant_mxfp4(*stored), want)  # values (the bytes may differ: 12 = 3*4 = 6*2)
    if model_type == "gpt_oss":  # transformers' own loader dequantises the published layout
        from transformers import Mxfp4Config

        got = _logits(_reload(path, cfg, quantization_config=Mxfp4Config(dequantize=True)), cfg)
        assert torch.equal(ref, got)
    plain = mt.dequantize_checkpoint(path, tmp_path / "plain")
    assert torch.equal(ref, _logits(_reload(plain, cfg), cfg))
    # the reference really is quantised: differs from the fp32 model
    assert not torch.equal(ref, _logits(mt.build_model(cfg), cfg))


def test_fp8_experts_deepseek_v32(tmp_path):
    from safetensors import safe_open

    path = mt.make_tiny("deepseek_v32", tmp_path / "ck", experts="fp8")
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128] and qc["fmt"] == "e4m3"
    assert qc["activation_scheme"] == "dynamic"
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        p = "model.layers.1.mlp.experts.0.down_proj."
        assert f.get_tensor(p + "weight").dtype == torch.float8_e4m3fn
        assert f.get_tensor(p + "weight_scale_inv").shape == (1, 1)
        assert f.get_tensor("model.layers.1.mlp.shared_experts.down_proj.weight").dtype == torch.float32
        # lowprec's rule (power-of-two scale_inv): requantising the stored values reproduces them
        q, sinv = f.get_tensor(p + "weight"), f.get_tensor(p + "weight_scale_inv")
        q2, sinv2 = lowprec.quantize_fp8_block(lowprec.dequant_fp8_block(q, sinv))
        assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(sinv2, sinv)
    cfg = mt.shrink_config("deepseek_v32")
    ref = _logits(mt.build_model(cfg, experts="fp8"), cfg)
    plain = mt.dequantize_checkpoint(path, tmp_path / "plain")
    assert torch.equal(ref, _logits(_reload(plain, cfg), cfg))
    from transformers import FineGrainedFP8Config  # transformers' fp8 loader needs accelerate (a dependency)

    got = _logits(_reload(path, cfg, quantization_config=FineGrainedFP8Config(dequantize=True)), cfg)
    assert torch.allclose(ref, got, atol=1e-5)


def test_stored_values_are_fixed_points_of_lowprec_quantisers():
    """make-tiny rounds the experts in memory with lowprec's quantisers, then writes the encoding of the rounded
    values: that is exact only if dequantised values quantise back to themselves."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 5, 64)).astype(np.float32)
    d = lowprec.dequant_mxfp4(*lowprec.quantize_mxfp4(w))
    assert np.abs(d - w).max() < 0.5 * np.abs(w).max()
    assert np.array_equal(lowprec.dequant_mxfp4(*lowprec.quantize_mxfp4(d)), d)
    q, sinv = lowprec.quantize_fp8_block(rng.standard_normal((130, 70)).astype(np.float32))
    assert sinv.shape == (2, 1)
    d = lowprec.dequant_fp8_block(q, sinv)
    q2, sinv2 = lowprec.quantize_fp8_block(d)
    assert np.array_equal(q2.view(np.uint8), q.view(np.uint8)) and np.array_equal(sinv2, sinv)


def test_deterministic_bytes(tmp_path):
    a = mt.make_tiny("deepseek_v4", tmp_path / "a", experts="mxfp4", seed=3)
    b = mt.make_tiny("deepseek_v4", tmp_path / "b", experts="mxfp4", seed=3)
    assert _digest(a) == _digest(b)
    c = mt.make_tiny("deepseek_v4", tmp_path / "c", experts="mxfp4", seed=4)
    assert _digest(c)["model.safetensors"] != _digest(a)["model.safetensors"]


def test_bf16_experts(tmp_path):
    from safetensors import safe_open

    path = mt.make_tiny("qwen3_moe", tmp_path / "ck", experts="bf16")
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.0.mlp.experts.0.up_proj.weight").dtype == torch.bfloat16
        assert f.get_tensor("model.layers.0.mlp.gate.weight").dtype == torch.float32
    cfg = mt.shrink_config("qwen3_moe")
    assert torch.equal(_logits(mt.build_model(cfg, experts="bf16"), cfg), _logits(_reload(path, cfg), cfg))


def test_errors(tmp_path):
    with pytest.raises(UserError, match="unknown model_type"):
        mt.make_tiny("no_such_model", tmp_path / "x")
    with pytest.raises(UserError, match="not a MoE"):
        mt.make_tiny("llama", tmp_path / "x")
    with pytest.raises(UserError, match="too few"):
        mt.make_tiny("deepseek_v4", tmp_path / "x", layers=2)
    with pytest.raises(UserError, match="--experts"):
        mt.make_tiny("qwen3_moe", tmp_path / "x", experts="int3")
    assert not (tmp_path / "x").exists()


def test_cli(tmp_path):
    from click.testing import CliRunner

    out = tmp_path / "ck"
    r = CliRunner().invoke(mt.make_tiny_cmd, ["qwen3_moe", "-o", str(out), "--layers", "3", "--json"])
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert info["num_hidden_layers"] == 3 and "model.safetensors" in info["files"]
    r = CliRunner().invoke(mt.make_tiny_cmd, ["no_such_model", "-o", str(tmp_path / "y")])
    assert r.exit_code != 0 and isinstance(r.exception, UserError)
