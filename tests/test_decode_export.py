"""frontend/decode_export: prefill + decode with transformers' cache as exported state, token-exact vs generate()."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.export.graph_signature import InputKind, OutputKind

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


@pytest.mark.slow
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


@pytest.mark.slow
def test_batch_of_two_same_length(tiny):
    from dayzero.frontend.decode_export import export_with_cache

    model = _upstream(tiny("qwen3_moe"))
    ep, _ = export_with_cache(model, max_cache_len=32, batch_size=2, max_seq=16)
    ids = torch.randint(2, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    assert _greedy_exported(ep, ids, 8) == _greedy_upstream(model, ids, 8)


@pytest.mark.slow
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


V4_PROMPT = 32  # past 4 HCA (8) and 8 CSA (4) windows and the sliding window (8)


def _v4_step(tiny):
    from dayzero.frontend.decode_export import CacheStep

    model = _upstream(tiny("deepseek_v4"))
    return model, CacheStep(model, MAX_CACHE)


def _zero(step):
    for name, buf in step.named_buffers():
        if name.startswith("cache_"):
            buf.zero_()


def _v4_logits(step, ids, chunks):
    """Prefill ``chunks`` (lengths, each continuing the previous), then one token at a time to the end."""
    _zero(step)
    got, s = [], 0
    with torch.no_grad():
        for n in chunks:
            got.append(step(ids[:, s:s + n], torch.arange(s, s + n)))
            s += n
        for p in range(s, ids.shape[1]):
            got.append(step(ids[:, p:p + 1], torch.tensor([p])))
    return torch.cat(got, 1)


@pytest.mark.slow
def test_deepseek_v4_fixed_size_cache_equals_forward(tiny):
    """DeepSeek-V4 on dayzero's fixed-size compressed cache (frontend/v4_cache.py), run eagerly: prefills that start
    and end mid-window (a later chunk resumes from the pending ring and the CSA overlap), then single tokens across
    CSA (4) / HCA (8) window boundaries and past the sliding window (8), give upstream's cache-less forward; the
    state keeps its shapes at every position."""
    model, step = _v4_step(tiny)
    shapes = {n: tuple(b.shape) for n, b in step.named_buffers()}
    kinds = {(step.layer_types[i], attr) for i, attr, _ in step.names}
    assert kinds == {(lt, "keys") for lt in ("heavily_compressed_attention", "compressed_sparse_attention",
                                               "sliding_attention")} | {
        ("heavily_compressed_attention", f"compressor_{p}") for p in ("pending_kv", "pending_gate", "entries")} | {
        ("compressed_sparse_attention", f"{name}_{p}") for name in ("compressor", "indexer")
        for p in ("pending_kv", "pending_gate", "entries", "overlap_kv", "overlap_gate")}
    rows = {attr: getattr(step, n).shape[1] for i, attr, n in step.names if i == 0 and attr.endswith("entries")}
    assert rows == {"compressor_entries": MAX_CACHE // 8 + 1}  # one per HCA window + the scratch row

    ids = torch.randint(0, model.config.vocab_size, (1, V4_PROMPT), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
    for chunks in ((13,), (2, 5, 16)):
        torch.testing.assert_close(_v4_logits(step, ids, chunks), ref, atol=1e-4, rtol=1e-4)
    assert {n: tuple(b.shape) for n, b in step.named_buffers()} == shapes


@pytest.mark.slow
def test_deepseek_v4_single_query_needs_the_hca_validity_bias(tiny):
    """With one query upstream's HCA compressor returns no block bias: its running list holds only closed windows.
    The fixed-size entries also hold open and unwritten ones, so a pre-hook adds upstream's causal rule to the
    mask; without it decode attends to them and the logits move."""
    model, step = _v4_step(tiny)
    ids = torch.randint(0, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
    for h in step._hooks:
        h.remove()
    assert float((_v4_logits(step, ids, (13,)) - ref).abs().max()) > 1e-2


@pytest.mark.slow
def test_deepseek_v4_row_step_is_each_request_alone(tiny):
    """The batched decode step (``RowDecodeStep``, run eagerly): three requests whose states were filled alone
    (prompts of 13, 21 and 7 tokens), stacked as batch rows, then stepped together 12 times at their own positions
    (across CSA / HCA window boundaries at different steps): every row's logits equal upstream's cache-less forward
    of that request alone. The sliding K=V states go in as the window ending at each row's token (what the runtime
    reads from the pool) and the token's row comes back as the window's last. Upstream rotates a pooled entry at
    one position for the whole batch: without the per-row rope offset the rows whose windows start elsewhere
    move."""
    from dayzero.frontend.decode_export import RowDecodeStep

    model, step = _v4_step(tiny)
    rows = RowDecodeStep(step)
    W = rows.window_rows
    assert W == model.config.sliding_window < step.max_cache_len
    gen = torch.Generator().manual_seed(3)
    lens = [13, 21, 7]
    seqs = [torch.randint(0, model.config.vocab_size, (1, 40), generator=gen) for _ in lens]
    states = []
    with torch.no_grad():
        for s, n in zip(seqs, lens):
            _zero(step)
            step(s[:, :n], torch.arange(n))
            states.append([getattr(step, name).clone() for _, _, name in step.names])
        stacked = [torch.cat(ts) for ts in zip(*states)]
        keys = [k for k, (_, attr, _) in enumerate(step.names) if attr == "keys"]

        def window(full, pos):  # [B, H, L, D] -> [B, H, W, D]: rows p - W + 1 .. p of row b (before 0: row 0)
            at = (torch.tensor(pos).view(-1, 1) - (W - 1) + torch.arange(W)).clamp(min=0)
            return torch.stack([full[b][:, at[b]] for b in range(len(pos))])

        def run(steps, hooks=True):
            full, pos, worst = list(stacked), list(lens), 0.0
            for _ in range(steps):
                ids = torch.stack([s[0, p] for s, p in zip(seqs, pos)]).view(-1, 1)
                ins = [window(t, pos) if k in keys else t for k, t in enumerate(full)]
                out, *new = rows(ids, torch.tensor(pos), *ins)
                for k, t in enumerate(new):
                    if k in keys:  # the token's own row, at its position
                        assert t.shape[2] == W
                        full[k] = full[k].clone()
                        full[k][torch.arange(len(pos)), :, torch.tensor(pos)] = t[:, :, -1]
                    else:
                        full[k] = t
                for b, (s, p) in enumerate(zip(seqs, pos)):
                    ref = model(input_ids=s[:, :p + 1], attention_mask=torch.ones(1, p + 1, dtype=torch.long),
                                use_cache=False).logits[0, -1]
                    worst = max(worst, float((out[b, 0] - ref).abs().max()))
                pos = [p + 1 for p in pos]
            return worst
        assert run(12) < 1e-4
        for h in rows._hooks:
            h.remove()
        assert run(4) > 1e-2
