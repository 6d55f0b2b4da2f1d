"""``dayzero bench full`` on a narrow gpt-oss (make_full's test-only overrides: published layer types, experts and
top-k, hidden 64): the JSON has DESIGN.md's fields, every decode case's bound is the larger of the step's bytes over
the bandwidth and its weight FLOPs over the matmul rate, both measured in the run, a prefill's bound its FLOPs; the
bytes and FLOPs are the checkpoint's own, counted here from the tensors independently. The full-width figures are
the benchmark's, not CI's."""

import json
import math

import pytest

torch = pytest.importorskip("torch")

NARROW = dict(hidden_size=64, intermediate_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=512, eos_token_id=500, pad_token_id=499)


@pytest.mark.slow
def test_bench_full_narrow_gpt_oss(tmp_path):
    from safetensors import safe_open

    from dayzero.tools.bench_full import bench_full

    out = bench_full("gpt_oss", 1, tmp_path, contexts=[1, 40], batches=[1, 2], prefills=[16], steps=1,
                     prefill_budget=30.0, eager_max_gb=1.0, overrides=NARROW)
    assert out["suite"] == "full" and out["machine"]["read_bandwidth_GBps"] > 0
    cases = {r["case"]: r for r in out["results"]}
    assert set(cases) == {"decode_b1_ctx1", "decode_b2_ctx1", "decode_b1_ctx40", "decode_b2_ctx40", "prefill_16"}
    bw = out["machine"]["read_bandwidth_GBps"] * 1e9
    ckpt = tmp_path / "gpt_oss_L1" / "ckpt"
    cfg = json.loads((ckpt / "config.json").read_text())
    E, k, H = cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["hidden_size"]
    sizes, values = {}, {}
    for f in ckpt.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            for name in st.keys():
                t = st.get_tensor(name)
                sizes[name] = t.numel() * t.element_size()
                # MXFP4: two values a block byte, the scales none
                values[name] = 0 if name.endswith("_scales") else 2 * t.numel() if name.endswith("_blocks") else \
                    t.numel()
    peak = out["machine"]["matmul_peak_GFLOPs"] * 1e9
    v_experts = sum(v for n, v in values.items() if ".mlp.experts." in n)
    v_head = values["lm_head.weight"]
    v_dense = sum(values.values()) - v_experts - v_head - values["model.embed_tokens.weight"]

    def flops(tokens, head_rows):  # 2 a value: k experts a token, the LM head for head_rows rows
        return 2 * (tokens * (v_dense + k * v_experts / E) + head_rows * v_head)
    experts = sum(v for n, v in sizes.items() if ".mlp.experts." in n)
    embed = sizes["model.embed_tokens.weight"]
    other = sum(sizes.values()) - experts - embed
    kv_token = 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 2  # bf16 K and V, one layer (sliding: window 128)
    for b in (1, 2):
        for c in (1, 40):
            r = cases[f"decode_b{b}_ctx{c}"]
            reached = E * (1 - (1 - k / E) ** b)
            want = other + b * embed // cfg["vocab_size"] + reached * experts / E + b * c * kv_token
            assert r["step_bytes"] == pytest.approx(want, rel=1e-6), (b, c)
            assert r["bytes_bound"] == pytest.approx(r["step_bytes"] / bw, rel=2e-2)  # bandwidth rounded in JSON
            assert r["step_flops"] == pytest.approx(flops(b, b), rel=1e-9), (b, c)
            assert r["flops_bound"] == pytest.approx(r["step_flops"] / peak, rel=2e-2)
            assert r["bound"] == max(r["bytes_bound"], r["flops_bound"])
            assert r["dayzero"] > 0 and r["tokens_per_s"] == pytest.approx(b / r["dayzero"])
            assert r["arena_step_bytes"] > r["step_bytes"]  # fp32 copies of the bf16 weights
            assert r["prefilled_tokens"] == [max(1, c - 1)] * b
    assert math.isclose(cases["prefill_16"]["tokens_per_s"], 16 / cases["prefill_16"]["dayzero"])
    assert cases["prefill_16"]["step_flops"] == pytest.approx(flops(16, 1), rel=1e-9)
    assert cases["prefill_16"]["bound"] == pytest.approx(flops(16, 1) / peak, rel=2e-2)
    assert cases["prefill_16"]["baselines"]["torch_eager"] > 0  # a narrow model fits: eager runs
    assert cases["decode_b1_ctx1"]["baselines"]["torch_eager"] > 0
    assert "compile_s" in out and "make_full_s" in out
    # the load's resident growth against the report's plan total (a narrow model's arena is a few MB: no ratio)
    assert out["load_rss_bytes"] > 0 and out["plan_total_bytes"] > 0
    assert out["load_rss_over_plan"] == out["load_rss_bytes"] / out["plan_total_bytes"]
    again = bench_full("gpt_oss", 1, tmp_path, contexts=[40], batches=[2], prefills=[16], steps=1,
                       prefill_budget=30.0, eager_max_gb=0.0, overrides=NARROW)
    assert "compile_s" not in again and "make_full_s" not in again  # the checkpoint and artifact are reused
    assert "torch_eager_skipped" in again["results"][0]


def test_checkpoint_parts_are_named_as_the_model_names_them(tmp_path):
    """DeepSeek-V4 publishes its LM head as ``head.weight`` and its routers under ``ffn.gate``: the bench counts
    each checkpoint tensor under the model's own parameter name (transformers' renamings), so the head's values are
    the LM head's (read for the rows whose logits are kept), not every token's."""
    from dayzero.tools.bench_full import checkpoint_bytes, step_flops
    from dayzero.tools.make_tiny import make_tiny

    ckpt = make_tiny("deepseek_v4", tmp_path / "ckpt", seed=0)
    cfg = json.loads((ckpt / "config.json").read_text())
    cb = checkpoint_bytes(ckpt)
    head = cfg["vocab_size"] * cfg["hidden_size"]
    assert cb["values_by"]["lm_head"] == head and "other" not in cb["values_by"]
    assert step_flops(cb, cfg, 16, 1) - step_flops(cb, cfg, 16, 0) == 2 * head
