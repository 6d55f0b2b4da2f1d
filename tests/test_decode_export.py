"""frontend/decode_export: prefill + decode with transformers' cache as exported state, token-exact vs generate()."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.export.graph_signature import InputKind, OutputKind

from dayzero import UserError

PROMPT = 12  # > gpt-oss's sliding window (8) and > V3.2's index_topk (4): both sparse paths are live
NEW = 16
MAX_CACHE = 48


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from dayzero.tools.make_tiny import make_tiny

    made = {}

    def get(model_type: str):
        if model_type not in made:
            made[model_type] = make_tiny(model_type, tmp_path_factory.mktemp(model_type) / "ckpt", seed=0)
        return made[model_type]
    return get


def _upstream(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, experts_implementation="batched_mm").eval()


def _greedy_exported(ep, ids: torch.Tensor, new: int) -> list[list[int]]:
    mod = ep.module()
    p = ids.shape[1]
    with torch.no_grad():
        logits = mod(input_ids=ids, cache_position=torch.arange(p))
        toks = [logits[:, -1].argmax(-1)]
        for i in range(new - 1):
            logits = mod(input_ids=toks[-1][:, None], cache_position=torch.tensor([p + i]))
            toks.append(logits[:, -1].argmax(-1))
    return torch.stack(toks, 1).tolist()


def _greedy_upstream(model, ids: torch.Tensor, new: int) -> list[list[int]]:
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False)
    return out[:, ids.shape[1]:].tolist()


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss", "deepseek_v32"])
def test_prefill_then_decode_matches_generate(tiny, model_type):
    from dayzero.frontend.decode_export import export_with_cache, reset_cache

    torch.manual_seed(0)
    model = _upstream(tiny(model_type))
    ep, info = export_with_cache(model, max_cache_len=MAX_CACHE, batch_size=1, max_seq=24)

    # every cache tensor is a buffer updated by exactly one graph output; nothing is a lifted constant
    sig = ep.graph_signature
    assert not [s for s in sig.input_specs if s.kind == InputKind.CONSTANT_TENSOR and "cache" in s.target]
    assert set(info.buffer_mutations) == {c.buffer for c in info.cache}
    mutated = {s.target: s.arg.name for s in sig.output_specs if s.kind == OutputKind.BUFFER_MUTATION}
    assert mutated == info.buffer_mutations
    assert [s.kind for s in sig.output_specs].count(OutputKind.USER_OUTPUT) == 1
    # decomposed and functional: no in-place op survives
    inplace = [n.target for n in ep.graph.nodes if isinstance(n.target, torch._ops.OpOverload)
               and n.target._schema.is_mutable]
    assert not inplace, inplace
    for c in info.cache:
        assert c.shape[c.position_dim] == MAX_CACHE
    if model_type == "deepseek_v32":
        assert {c.kind for c in info.cache} == {"keys", "values", "indexer_keys"}
    if model_type == "gpt_oss":
        assert {c.sliding_window for c in info.cache if c.layer_type == "sliding_attention"} == {8}

    ids = torch.randint(2, model.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    assert _greedy_exported(ep, ids, NEW) == _greedy_upstream(model, ids, NEW)

    # logits too: prefill 12 then 18 single-token steps == upstream's cache-less forward over all 30 positions
    # (past the sliding window: a full-length cache with the window in the mask is the same computation)
    reset_cache(ep, info)
    assert all(not ep.constants[c.buffer].any() for c in info.cache)
    ids = torch.randint(2, model.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(3))
    mod = ep.module()
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
        got = [mod(input_ids=ids[:, :PROMPT], cache_position=torch.arange(PROMPT))]
        got += [mod(input_ids=ids[:, p:p + 1], cache_position=torch.tensor([p])) for p in range(PROMPT, 30)]
    torch.testing.assert_close(torch.cat(got, 1), ref, atol=1e-4, rtol=1e-4)


def test_batch_of_two_same_length(tiny):
    from dayzero.frontend.decode_export import export_with_cache

    model = _upstream(tiny("qwen3_moe"))
    ep, _ = export_with_cache(model, max_cache_len=32, batch_size=2, max_seq=16)
    ids = torch.randint(2, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    assert _greedy_exported(ep, ids, 8) == _greedy_upstream(model, ids, 8)


def test_decode_program_attends_over_whole_cache(tiny):
    """max_seq=1 gives the fixed-shape decode program: one query against all max_cache_len positions, masked."""
    from dayzero.frontend.decode_export import export_with_cache

    model = _upstream(tiny("qwen3_moe"))
    ep, info = export_with_cache(model, max_cache_len=MAX_CACHE, max_seq=1)
    assert not ep.range_constraints  # no symbol: a fixed-shape program
    sdpa = [n for n in ep.graph.nodes if n.target == torch.ops.aten.scaled_dot_product_attention.default]
    assert len(sdpa) == model.config.num_hidden_layers
    for n in sdpa:
        q, k, v, mask = (a.meta["val"].shape for a in n.args[:4])
        assert q[2] == 1 and k[2] == MAX_CACHE and tuple(mask) == (1, 1, 1, MAX_CACHE)
    puts = [n for n in ep.graph.nodes if n.target == torch.ops.aten.index_put.default]
    assert len(puts) == len(info.cache) == 2 * model.config.num_hidden_layers
    counts = collections.Counter(n.target for n in ep.graph.nodes if n.op == "call_function")
    assert torch.ops.aten.index_copy_.default not in counts


def test_deepseek_v4_has_no_static_cache(tiny):
    """DeepSeek-V4's caches (DeepseekV4HCACache / DeepseekV4CSACache) are dynamic: a clear error, not a bad graph."""
    from dayzero.frontend.decode_export import export_with_cache

    model = _upstream(tiny("deepseek_v4"))
    with pytest.raises(UserError, match="heavily_compressed_attention"):
        export_with_cache(model, max_cache_len=MAX_CACHE, max_seq=16)


@pytest.mark.xfail(strict=True, raises=UserError, reason=(
    "DeepSeek-V4 compressed caches are not static: DeepseekV4HCACache/CSACache subclass DynamicSlidingWindowLayer, "
    "grow compressed_kv by torch.cat, keep pending tokens (buffer_kv, length = position mod compress_rate) and "
    "entry_count as Python ints, and the compressors branch on those lengths (chunk_kv.shape[1] > 0, seq_len == 1, "
    "prior_kv is None); transformers has no static layer for them (StaticCache raises KeyError), so one exported "
    "decode graph cannot cover all positions"))
def test_deepseek_v4_prefill_then_decode(tiny):
    from dayzero.frontend.decode_export import export_with_cache

    torch.manual_seed(0)
    model = _upstream(tiny("deepseek_v4"))
    ep, _ = export_with_cache(model, max_cache_len=MAX_CACHE, max_seq=24)
    ids = torch.randint(2, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    assert _greedy_exported(ep, ids, NEW) == _greedy_upstream(model, ids, NEW)
