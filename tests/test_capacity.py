"""Capacity planning from config.json alone: parameter counts vs published figures, KV arithmetic written out,
weight formats, the device split, target specs and the `plan` command."""

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from dayzero import UserError
from dayzero.targets.spec import SPEC_DIR, TargetSpec, load_target_spec
from dayzero.tools.capacity import _bytes, kv_bytes_per_sequence, kv_layout, load_config, parse_count, plan_capacity
from dayzero.tools.plan_cmd import plan

CONFIGS = Path(__file__).parent / "data" / "configs"
H200 = load_target_spec("h200")


def cfg(name):
    return load_config(CONFIGS / f"{name}.json")


@pytest.fixture(scope="module")
def plans():
    return {n: plan_capacity(cfg(n), H200, devices=8, context="1M") for n in
            ("deepseek_v3", "deepseek_v32", "deepseek_v4_flash", "gpt_oss_120b", "kimi_k2")}


# ---- parameters vs published figures ----------------------------------------------------------------------------
# The convention (plan["param_convention"]): params_total = the transformers model (main model, no MTP modules);
# params_active = params_total less the input embedding table and less the routed experts a token does not use.
# Each figure is compared with the publisher's most precise statement, within 1%:
#   DeepSeek-V3   671B total / 36.7B active: README_WEIGHTS.md of the V3 release ("Main Model Weights: 671B, 36.7B
#                 activated"; the "37B" of the paper is that figure rounded); its MTP module "11.5B unique".
#   gpt-oss-120b  116.83B / 5.13B: OpenAI's model card table.
#   Kimi-K2       32B active: the K2 report.  Its "1.04T" total: see test_kimi_k2_total_is_the_architecture_sum.
#   DeepSeek-V4-Flash 284B total: the V4 release.  Its "13B" active: see test_v4_flash_active_is_13b_rounded.

PUBLISHED_TOTAL = {"deepseek_v3": 671e9, "deepseek_v4_flash": 284e9, "gpt_oss_120b": 116.83e9}
PUBLISHED_ACTIVE = {"deepseek_v3": 36.7e9, "gpt_oss_120b": 5.13e9, "kimi_k2": 32e9}


@pytest.mark.parametrize("name", list(PUBLISHED_TOTAL))
def test_total_params_within_1_percent_of_published(plans, name):
    total = PUBLISHED_TOTAL[name]
    assert abs(plans[name]["params_total"] - total) <= 0.01 * total


@pytest.mark.parametrize("name", list(PUBLISHED_ACTIVE))
def test_active_params_within_1_percent_of_published(plans, name):
    active = PUBLISHED_ACTIVE[name]
    assert abs(plans[name]["params_active"] - active) <= 0.01 * active


def test_convention_is_stated_in_the_plan(plans):
    for r in plans.values():
        assert set(r["param_convention"]) == {"total", "active", "mtp"}
        assert "MTP" in r["param_convention"]["total"] and "embedding" in r["param_convention"]["active"]


def test_deepseek_v3_mtp_module_matches_release(plans):
    # One MTP module = a decoder layer like layer 60 (attention 187.1M + 256 routed and 1 shared expert of
    # 3*h*I + router) + eh_proj 2h*h + 3 norms of h.  DeepSeek: "11.5B unique parameters"; the hub checkpoint
    # (main model + module + the module's own copies of embedding and head) "685B".
    h, v, E, I = 7168, 129280, 256, 2048
    attn = h * 1536 + 1536 + 1536 * 128 * 192 + h * 576 + 512 + 512 * 128 * 256 + 128 * 128 * h
    layer = attn + 2 * h + E * 3 * h * I + 3 * h * I + E * h
    r = plans["deepseek_v3"]
    assert r["mtp_module_params"] == layer + 2 * h * h + 3 * h
    assert r["params_mtp"] == r["mtp_module_params"]  # num_nextn_predict_layers = 1
    assert abs(r["params_mtp"] - 11.5e9) <= 0.01 * 11.5e9
    hub = r["params_total"] + r["params_mtp"] + 2 * v * h
    assert abs(hub - 685e9) <= 0.01 * 685e9


def test_kimi_k2_total_is_the_architecture_sum(plans):
    # Kimi-K2 as released (61 layers, the first dense, num_nextn_predict_layers = 0, no MTP weights) counts
    # 1.0264T, exactly the hand sum below.  The report's "1.04T" is 1.3% above it; it is the same architecture
    # plus one MTP module (17.2B: a 384-expert layer + eh_proj + norms), 1.0436T, within 0.4% -- the figure of
    # the model as trained with a next-token-prediction module, which the release does not ship.
    h, v, E, I, layers = 7168, 163840, 384, 2048, 61
    attn = h * 1536 + 1536 + 1536 * 64 * 192 + h * (512 + 64) + 512 + 512 * 64 * (128 + 128) + 64 * 128 * h
    moe = E * 3 * h * I + 3 * h * I + E * h  # routed + 1 shared + router
    dense = 3 * h * 18432
    total = 2 * v * h + layers * (attn + 2 * h) + dense + (layers - 1) * moe + h
    r = plans["kimi_k2"]
    assert r["params_total"] == total and r["params_mtp"] == 0
    assert r["mtp_module_params"] == attn + 2 * h + moe + 2 * h * h + 3 * h
    assert 0.012 < (1.04e12 - total) / 1.04e12 < 0.014
    assert abs(total + r["mtp_module_params"] - 1.04e12) <= 0.01 * 1.04e12


def test_v4_flash_active_is_13b_rounded(plans):
    # DeepSeek gives V4-Flash's active count to two significant figures ("13B", i.e. anything in [12.5B, 13.5B)),
    # coarser than 1%.  Under the V3 convention above it is 13.27B: attention 5.09B + 43 layers x (6 routed +
    # 1 shared experts of 3*4096*2048, router 256*4096, mHC) + lm_head 0.53B.  No consistent convention lands
    # within 1% of 13.0B: dropping the head as well gives 12.74B (2% low), and V3 would then be 35.7B, not 36.7B.
    h, v, E, I, layers, k = 4096, 129280, 256, 2048, 43, 6
    r = plans["deepseek_v4_flash"]
    p = r["params_by_category"]
    experts = layers * (k + 1) * 3 * h * I
    assert p["shared_experts"] == layers * 3 * h * I
    assert p["routed_experts"] == layers * E * 3 * h * I
    assert r["params_active"] == (p["attention"] + p["router"] + p["hyper_connections"] + p["norms"] + p["lm_head"]
                                  + experts)
    assert round(r["params_active"] / 1e9) == 13
    assert abs(r["params_active"] - 13.27e9) <= 0.005e9
    assert p["lm_head"] == p["embeddings"] == v * h


def test_deepseek_v3_total_by_hand(plans):
    h, v, E, I, layers, dense_layers = 7168, 129280, 256, 2048, 61, 3
    attn = h * 1536 + 1536 + 1536 * 128 * 192 + h * 576 + 512 + 512 * 128 * 256 + 128 * 128 * h
    moe = E * 3 * h * I + 3 * h * I + E * h
    total = 2 * v * h + layers * (attn + 2 * h) + dense_layers * 3 * h * 18432 + (layers - dense_layers) * moe + h
    r = plans["deepseek_v3"]
    assert r["params_total"] == total
    routed = (layers - dense_layers) * E * 3 * h * I
    assert r["params_by_category"]["routed_experts"] == routed
    assert r["params_active"] == total - v * h - routed * (E - 8) // E
    assert r["params_active_incl_embedding"] == r["params_active"] + v * h


# ---- KV cache arithmetic ----------------------------------------------------------------------------------------


def test_kv_per_token_mla_v3_and_kimi(plans):
    per_layer = (512 + 64) * 2  # kv_lora_rank + qk_rope_head_dim, bf16
    for name in ("deepseek_v3", "kimi_k2"):
        kv = plans[name]["kv_bytes_per_token"]
        assert kv["by_layer_type"] == {"mla": per_layer}
        assert kv["total"] == 61 * per_layer == 70272
        assert plans[name]["kv_bytes_per_sequence"] == 70272 * 1_000_000


def test_kv_per_token_dsa_v32(plans):
    per_layer = (512 + 64) * 2 + 128 * 1 + 4  # MLA latent bf16 + indexer key: 128 fp8 + one fp32 scale
    kv = plans["deepseek_v32"]["kv_bytes_per_token"]
    assert kv["by_layer_type"] == {"mla+indexer": per_layer}
    assert kv["total"] == 61 * 1284


def test_kv_gpt_oss_sliding_layers_cap_at_window(plans):
    full = 2 * 8 * 64 * 2  # K and V, 8 kv heads, head_dim 64, bf16
    r = plans["gpt_oss_120b"]
    assert r["kv_bytes_per_token"]["by_layer_type"] == {"sliding_attention": 0.0, "full_attention": full}
    assert r["kv_bytes_per_token"]["total"] == 18 * full
    assert r["kv_bytes_per_sequence"] == 18 * full * 1_000_000 + 18 * full * 128


def test_kv_deepseek_v4_flash(plans):
    # 2 sliding-only layers, then CSA (m=4) / HCA (m'=128) alternating: 21 CSA, 20 HCA.  Every layer keeps a
    # window of 128 shared K=V entries of head_dim 512; CSA adds per 4 tokens one 512-entry and one indexer key
    # (128 fp8 + 4-byte scale); HCA adds per 128 tokens one 512-entry.
    r = plans["deepseek_v4_flash"]
    layers = r["kv_layer_types"]
    assert {t: e["layers"] for t, e in layers.items()} == {
        "sliding_attention": 2, "compressed_sparse_attention": 21, "heavily_compressed_attention": 20}
    csa = (512 * 2 + 132) / 4
    hca = 512 * 2 / 128
    assert r["kv_bytes_per_token"]["by_layer_type"] == {
        "sliding_attention": 0.0, "compressed_sparse_attention": csa, "heavily_compressed_attention": hca}
    assert r["kv_bytes_per_token"]["total"] == 21 * 289 + 20 * 8 == 6229
    T = 1_000_000
    window = 43 * 128 * 512 * 2
    state = sum(e["state_bytes"] * e["layers"] for e in layers.values())
    expected = window + 21 * (T // 4) * (1024 + 132) + 20 * (T // 128) * 1024 + state
    assert r["kv_bytes_per_sequence"] == expected
    assert state < 0.01 * expected


def test_kv_short_context_is_window_bound():
    layout = kv_layout(cfg("deepseek_v4_flash"))
    no_state = {t: {**e, "state_bytes": 0} for t, e in layout.items()}
    assert kv_bytes_per_sequence(no_state, 3) == 43 * 3 * 1024  # no compressed entry yet, window not full


def test_kv_fp8_halves_the_latent():
    assert kv_layout(cfg("deepseek_v3"), "fp8")["mla"]["bytes_per_token"] == 576


# ---- weight formats ---------------------------------------------------------------------------------------------


def test_block_format_arithmetic():
    assert _bytes((256, 130), "bf16") == 2 * 256 * 130
    assert _bytes((256, 130), "fp8_block") == 256 * 130 + 4 * 2 * 2  # 2 x 2 blocks of 128x128, fp32 scale each
    assert _bytes((4, 64, 96), "mxfp4") == 4 * (64 * 96 // 2 + 64 * 3)  # 4 bits + one E8M0 per 32
    assert _bytes((64, 96), "mxfp4") * 8 / (64 * 96) == 4.25


def test_gpt_oss_mxfp4_experts(plans):
    r = plan_capacity(cfg("gpt_oss_120b"), H200)
    assert r["weight_format"] == "mxfp4"
    matrices = 36 * 128 * (2880 * 5760 + 2880 * 2880)
    biases = 36 * 128 * (5760 + 2880)
    assert r["resident_bytes_by_category"]["routed_experts"] == matrices * 4.25 / 8 + 2 * biases
    assert 64e9 < r["resident_bytes"]["mxfp4"] < 66e9  # the published checkpoint is ~65 GB


def test_auto_format_follows_quantization_config(plans):
    assert plans["deepseek_v3"]["weight_format"] == "fp8_block"
    assert plans["deepseek_v4_flash"]["weight_format"] == "mxfp4_fp8"
    rb = plans["deepseek_v3"]["resident_bytes"]
    assert rb["bf16"] == 2 * plans["deepseek_v3"]["params_total"]
    assert rb["mxfp4_fp8"] < rb["mxfp4"] < rb["fp8_block"] < rb["bf16"]


# ---- devices, fits, batch ---------------------------------------------------------------------------------------


def test_experts_split_by_expert_and_rest_by_tensor():
    c = cfg("deepseek_v3")
    one = plan_capacity(c, H200, devices=1, context=4096, attention="tp")
    by_cat = one["resident_bytes_by_category"]
    for n in (8, 3):
        r = plan_capacity(c, H200, devices=n, context=4096, attention="tp")
        replicated = by_cat["router"] + by_cat["norms"] + by_cat["other"] + by_cat["hyper_connections"]
        split = (by_cat["embeddings"] + by_cat["lm_head"] + by_cat["attention"] + by_cat["dense_mlp"]
                 + by_cat["shared_experts"]) / n
        experts = by_cat["routed_experts"] * math.ceil(256 / n) / 256
        assert r["per_device"]["weights"] == int(replicated + split + experts)


@pytest.mark.parametrize("name,devices,attention", [("gpt_oss_120b", 1, "tp"), ("gpt_oss_120b", 4, "tp"),
                                                    ("deepseek_v4_flash", 8, "dp"), ("deepseek_v3", 8, "dp")])
def test_max_batch_is_the_edge_of_fits(name, devices, attention):
    c = cfg(name)
    r = plan_capacity(c, H200, devices=devices, context="128k", attention=attention)
    mb = r["max_batch"]
    assert mb > 0
    assert plan_capacity(c, H200, devices=devices, context="128k", batch=mb, attention=attention)["fits"]
    step = devices if attention == "dp" else 1  # dp: batch is split over devices
    assert not plan_capacity(c, H200, devices=devices, context="128k", batch=mb + step, attention=attention)["fits"]


def test_v3_at_1m_does_not_fit_one_h200_node(plans):
    r = plans["deepseek_v3"]
    assert not r["fits"] and r["max_batch"] == 0  # 70 GB of latent cache per 1M-token sequence


def test_v4_flash_at_1m_fits_one_h200_node(plans):
    r = plans["deepseek_v4_flash"]
    assert r["fits"] and r["max_batch"] >= 100


# ---- input errors -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("patch,field", [
    ({"num_experts_per_tok": 300}, "num_experts_per_tok"),
    ({"num_attention_heads": 100, "head_dim": None}, "head_dim"),
    ({"model_type": None}, "model_type"),
    ({"hidden_size": "big"}, "hidden_size"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"first_k_dense_replace": 99}, "first_k_dense_replace"),
    ({"model_type": "no_such_model"}, "model_type"),
])
def test_bad_config_field_is_named(patch, field):
    c = {**cfg("deepseek_v3"), **patch}
    with pytest.raises(UserError, match=field):
        plan_capacity(c, H200, context=4096)


def test_parse_count():
    assert parse_count("1M") == 1_000_000
    assert parse_count("128k") == 128_000
    assert parse_count("1.5M") == 1_500_000
    assert parse_count(4096) == 4096
    for bad in ("1X", "", "-5", 0):
        with pytest.raises(UserError):
            parse_count(bad)


def test_missing_config_file(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_config(tmp_path / "nope.json")
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(UserError, match="JSON"):
        load_config(tmp_path)


# ---- target specs -----------------------------------------------------------------------------------------------


def test_shipped_targets():
    h200, b200, acc = (load_target_spec(n) for n in ("h200", "b200", "example_accel_64gb"))
    assert (h200.memory_bytes, h200.mem_bandwidth_gbps, h200.fp4_compute, h200.fp8_compute) == (141e9, 4800, False, True)
    assert (b200.memory_bytes, b200.mem_bandwidth_gbps, b200.fp4_compute) == (192e9, 8000, True)
    assert (acc.memory_bytes, acc.fp4_compute, set(acc.native_dtypes) >= {"bf16", "fp8_e4m3"}) == (64e9, False, True)


@pytest.mark.parametrize("patch,field", [
    ({"memory_bytes": -1}, "memory_bytes"),
    ({"memory_bytes": None}, "memory_bytes"),
    ({"fp4_compute": "yes"}, "fp4_compute"),
    ({"native_dtypes": ["bf16", "fp7"]}, "native_dtypes"),
    ({"mem_bandwidth_gbps": 0}, "mem_bandwidth_gbps"),
    ({"colour": "red"}, "colour"),
])
def test_malformed_spec_names_field_and_file(tmp_path, patch, field):
    data = {**json.loads((SPEC_DIR / "h200.json").read_text()), **patch}
    data = {k: v for k, v in data.items() if v is not None}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UserError, match=field) as e:
        load_target_spec(path)
    assert "bad.json" in str(e.value)


def test_unknown_target_lists_known_ones():
    with pytest.raises(UserError, match="h200"):
        load_target_spec("tpu_v9")


def test_spec_from_dict_round_trip():
    s = TargetSpec.from_dict({"name": "x", "memory_bytes": 10, "native_dtypes": ["bf16"], "fp4_compute": False,
                              "mem_bandwidth_gbps": 1})
    assert s.usable_bytes == 10 and not s.fp8_compute


# ---- the plan command -------------------------------------------------------------------------------------------


def test_plan_command_json():
    res = CliRunner().invoke(plan, [str(CONFIGS / "gpt_oss_120b.json"), "--target", "b200", "--context", "128k",
                                    "--devices", "2", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["context"] == 128_000 and out["devices"] == 2 and out["target"] == "b200"
    assert out["fits"] is True and out["max_batch"] > 0


def test_plan_command_table():
    res = CliRunner().invoke(plan, [str(CONFIGS / "deepseek_v4_flash.json"), "--target", "h200", "--devices", "8"])
    assert res.exit_code == 0, res.output
    assert "compressed_sparse" in res.output and "largest batch" in res.output


@pytest.mark.parametrize("args", [
    ["--target", "tpu_v9"],
    ["--target", "h200", "--context", "lots"],
    ["--target", "h200", "--devices", "0"],
])
def test_plan_command_errors_are_user_errors(args):
    res = CliRunner().invoke(plan, [str(CONFIGS / "gpt_oss_120b.json"), *args])
    assert isinstance(res.exception, UserError), res.output
    assert "\n" not in str(res.exception)


def test_plan_command_help():
    res = CliRunner().invoke(plan, ["--help"])
    assert res.exit_code == 0 and "--target" in res.output


def test_host_target_plans_dayzeros_cpu_runtime(tmp_path):
    """``--target host``: weights held in fp32 except the low-precision experts (as stored), the workspace of one
    fp32 prefill of the whole context, no dequant workspace. Against the compiled full-width 2-layer gpt-oss
    (make-full, --max-seq 32; report zones weights + low_precision_weights = 5,694,504,768 B, prefill workspace
    28,164,672 B) and its Qwen3-MoE counterpart (7,474,293,184 B; 21,840,448 B)."""
    from dayzero.targets.spec import load_target_spec
    from dayzero.tools.make_full import full_config

    host = load_target_spec("host")
    assert host.name == "host" and not host.fp4_compute and "bf16" not in host.native_dtypes
    for model_type, weights, workspace in (("gpt_oss", 5_694_504_768, 28_164_672),
                                           ("qwen3_moe", 7_474_293_184, 21_840_448)):
        full_config(model_type, layers=2).save_pretrained(tmp_path / model_type)
        cfg = load_config(tmp_path / model_type / "config.json")
        if model_type == "gpt_oss":  # as make-full writes it: the published MXFP4 experts
            cfg["quantization_config"] = {"quant_method": "mxfp4"}
        r = plan_capacity(cfg, host, context=32, batch=1, kv_dtype="fp32")
        assert abs(r["per_device"]["weights"] / weights - 1) <= 0.02, r["per_device"]
        assert abs(r["workspace_bytes"]["total"] / workspace - 1) <= 0.02, r["workspace_bytes"]
        assert r["workspace_bytes"]["dequant"] == 0


def test_modules_a_quantised_checkpoint_does_not_convert_are_planned_as_stored():
    """``quantization_config.modules_to_not_convert`` (transformers' patterns) keeps those matrices bf16 in the FP8
    plan: full-width DeepSeek-V3.2 with bf16 projections and FP8 experts (make-full's checkpoint) was planned with
    every projection FP8, 17.03 GB against the 19.06 GB the artifact holds. Listing o_proj adds, per layer, its
    bf16 bytes less its FP8 bytes (values plus one fp32 scale per 128 x 128 block)."""
    base = cfg("deepseek_v32")
    keep = json.loads(json.dumps(base))
    keep["quantization_config"]["modules_to_not_convert"] = ["lm_head", "model.layers.*.self_attn.o_proj"]
    a = plan_capacity(base, H200, context=4096, batch=1)["per_device"]["weights"]
    b = plan_capacity(keep, H200, context=4096, batch=1)["per_device"]["weights"]
    rows, cols = base["hidden_size"], base["num_attention_heads"] * base["v_head_dim"]
    fp8 = rows * cols + 4 * math.ceil(rows / 128) * math.ceil(cols / 128)
    assert b - a == base["num_hidden_layers"] * (2 * rows * cols - fp8)
    keep["quantization_config"]["modules_to_not_convert"] = "o_proj"
    with pytest.raises(UserError, match="modules_to_not_convert must be a list"):
        plan_capacity(keep, H200, context=4096, batch=1)


def test_the_host_plans_one_prefill_chunk_of_workspace():
    """An artifact compiled with --prefill-chunk N prefills N tokens at a time: its workspace is that of a prefill
    of N tokens, whatever the context (full-width DeepSeek-V3.2, chunk 512 at 4005: 0.46 GB, not 3.6)."""
    from dayzero.targets.host import host_spec

    c = cfg("deepseek_v32")
    chunked = plan_capacity(c, host_spec(), context=4005, batch=1, kv_dtype="fp32", prefill_chunk=512)
    short = plan_capacity(c, host_spec(), context=512, batch=1, kv_dtype="fp32")
    whole = plan_capacity(c, host_spec(), context=4005, batch=1, kv_dtype="fp32")
    assert chunked["workspace_bytes"] == short["workspace_bytes"] != whole["workspace_bytes"]
    assert chunked["per_device"]["weights"] == whole["per_device"]["weights"]
    r = CliRunner().invoke(plan, [str(CONFIGS / "deepseek_v32.json"), "--target", "host", "--context", "4005",
                                  "--prefill-chunk", "0", "--json"])
    assert isinstance(r.exception, UserError) and "prefill chunk must be a positive integer" in str(r.exception)


def test_a_query_head_without_an_mla_split_is_head_dim_wide():
    """DeepSeek-V4's query heads are head_dim (512) wide, its rope the last qk_rope_head_dim (64) of them: the
    plan took 64 values a head. One step's activations on a GPU target, from the config alone: bf16 residual
    streams (x hc_mult) twice, q, K and V, the widest MLP (k routed + shared experts), 8192 tokens."""
    v4 = cfg("deepseek_v4_flash")
    assert v4.get("qk_rope_head_dim") and not v4.get("qk_nope_head_dim")
    k = v4["num_experts_per_tok"] + v4["n_shared_experts"]
    per_token = 2 * (2 * v4["hc_mult"] * v4["hidden_size"] + v4["num_attention_heads"] * v4["head_dim"]
                     + 2 * v4["num_key_value_heads"] * v4["head_dim"] + 2 * k * v4["moe_intermediate_size"])
    assert plan_capacity(v4, H200, context=1 << 20, batch=1)["workspace_bytes"]["activations"] == 8192 * per_token
