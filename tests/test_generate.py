"""Prefill + decode from one artifact: generation equals upstream's own cached greedy generation, token for token.

Each architecture is compiled once (module fixture) from a make-tiny checkpoint; the reference is transformers'
``generate(do_sample=False)`` with its own KV cache on the same weights. DeepSeek-V4 runs on dayzero's fixed-size
compressed cache (frontend/v4_cache.py) against upstream's dynamic one.
"""

from __future__ import annotations

import pytest
import torch

from dayzero import UserError
from dayzero.frontend.hf import load_upstream
from dayzero.runtime import generate_batch, load

MAX_SEQ = 128  # the shared session artifacts (conftest.tiny_compiled)
NEW = 32


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss", "deepseek_v3", "deepseek_v32", "deepseek_v4"])
def served(request, tiny_compiled):
    ckpt, art, _ = tiny_compiled(request.param)
    rt = load(art)
    assert rt.max_length == MAX_SEQ and rt.max_batch >= 3
    ref = load_upstream(ckpt)
    ref.generation_config.eos_token_id = None  # generate exactly n tokens, as rt.generate does without stop_ids
    return rt, ref


def _upstream(ref, prompt, n):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def _prompt(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.slow
def test_greedy_generation_matches_upstream(served):
    rt, ref = served
    assert rt.stateful and set(rt.programs) - {"decode_batch"} == {"prefill", "prefill_last", "decode"}
    prompt = _prompt(9, 1)
    assert rt.generate(prompt, NEW) == _upstream(ref, prompt, NEW)


@pytest.mark.slow
def test_batch_of_three_different_lengths(served):
    """Where the artifact has a batched decode program, the three requests advance in one call per step."""
    rt, ref = served
    prompts = [_prompt(n, n) for n in (3, 12, 21)]
    steps = []
    batched = rt.decode_batch
    rt.decode_batch = lambda tokens, slots: steps.append(len(slots)) or batched(tokens, slots)
    try:
        res = generate_batch(rt, prompts, max_new_tokens=NEW)
    finally:
        del rt.decode_batch
    assert steps == ([3] * (NEW - 1) if rt.has_batched_decode else [])
    for p, r in zip(prompts, res):
        assert r["error"] is None
        assert r["tokens"] == _upstream(ref, p, NEW)


@pytest.mark.slow
def test_decode_reads_the_cache_not_the_prefix(served):
    """The decode program takes one token and its position (and the request's block table where caches are
    paged): it cannot recompute the prefix."""
    rt, _ = served
    dec = rt.programs["decode"]
    names = [dec.buffers[b]["name"] for b in dec.inputs]
    shapes = [tuple(dec.shape(b, ())) for b in dec.inputs]
    assert names[:2] == ["input_ids", "cache_position"] and shapes[:2] == [(1, 1), (1,)]
    assert all(n == "block_table" or n.startswith("block_table_w") for n in names[2:])  # one per window class

    def cache(prog):
        return {b["state"]: b["zone"] for b in prog.buffers if b.get("state") and b["alias_of"] is None
                and b["zone"] in ("kv_cache", "kv_pages")}
    assert cache(dec) and cache(dec) == cache(rt.programs["prefill"])  # the KV cache is state shared with prefill


@pytest.mark.slow
def test_bad_requests_fail_alone(served):
    rt, ref = served
    good = _prompt(5, 5)
    res = generate_batch(rt, [[], [1, 2, 999], _prompt(MAX_SEQ + 1, 0)], max_new_tokens=4)
    assert "empty" in res[0]["error"] and "outside" in res[1]["error"] and "exceeds" in res[2]["error"]
    res = generate_batch(rt, [good, _prompt(MAX_SEQ - 2, 7)], max_new_tokens=8)
    assert res[0]["error"] is None and res[0]["tokens"] == _upstream(ref, good, 8)
    assert "budget" in res[1]["error"]
    with pytest.raises(UserError, match="budget|exceeds"):
        rt.generate(_prompt(MAX_SEQ, 3), 4)


@pytest.mark.slow
def test_sampling_is_seeded(served):
    rt, _ = served
    p = _prompt(6, 6)
    a = rt.generate(p, 8, temperature=0.8, top_p=0.9, seed=3)
    b = rt.generate(p, 8, temperature=0.8, top_p=0.9, seed=3)
    assert a == b and len(a) == 8


@pytest.mark.slow
def test_each_program_is_planned_close_to_its_peak_live_bound(served):
    """Issue 7: for the prefill and the decode program, planned bytes <= 1.05x the peak-live lower bound
    (weights and KV cache are live throughout, so the activations decide it)."""
    import json

    rt, _ = served
    rep = json.loads((rt.path / "report.json").read_text())
    for name in ("prefill", "decode"):
        m = rep["programs"][name]["memory"]
        planned, peak = sum(m["planned_bytes"].values()), sum(m["peak_live_bytes"].values())
        assert planned <= 1.05 * peak, (name, planned, peak)
        assert m["zones"].get("kv_cache", 0) + m["zones"].get("kv_pages", 0) > 0 and m["zones"]["weights"] > 0


@pytest.mark.slow
def test_second_turn_reuses_the_cache(served):
    """A second turn appended to a finished request continues from its cache: no re-prefill of the history,
    and the tokens equal upstream generating from the whole conversation."""
    rt, ref = served
    first, second = _prompt(7, 70), _prompt(5, 71)
    out1 = rt.generate(first, 6, slot=1)
    cached = rt.lengths[1]
    prefill_calls = []
    progs = [rt.programs[n] for n in ("prefill", "prefill_last") if n in rt.programs]  # generation: prefill_last
    origs = [p.run for p in progs]
    for p, orig in zip(progs, origs):
        p.run = lambda inputs, *a, orig=orig, **k: prefill_calls.append(inputs[0].shape) or orig(inputs, *a, **k)
    try:
        out2 = rt.generate(second, 6, slot=1, append=True)
    finally:
        for p, orig in zip(progs, origs):
            p.run = orig
    assert cached == 7 + 5  # the prompt and the 5 tokens decoded (the 6th is written with the next turn)
    assert [s[-1] for s in prefill_calls] in ([6], [8])  # only the new turn (+ the pending token), maybe padded
    assert out2 == _upstream(ref, first + out1 + second, 6)


@pytest.mark.slow
def test_deepseek_v4_cache_is_fixed_size_and_written_per_row(tiny_compiled):
    """DeepSeek-V4's compressed cache (frontend/v4_cache.py) in the artifact: prefill takes any length with no
    padding (a padded tail would be read as the open window's tokens); a decode step writes one row of each
    layer's K=V and of each compressor's entries, and copies only the compressors' pending / overlap windows
    (compress_rate rows, independent of the cache length)."""
    _, art, _ = tiny_compiled("deepseek_v4")
    rt = load(art)
    assert rt.programs["prefill"].symbols == {"seq": (1, MAX_SEQ)}
    dec = rt.programs["decode"]
    # per-request states and the paged pools (a sliding layer's K=V, read only by cache_attention)
    state_of = {b["id"]: b["state"] for b in dec.buffers if b.get("state") and b["alias_of"] is None
                and b["zone"] in ("kv_cache", "kv_pages")}
    written = {}
    for _, args, _, node, _ in dec.steps:
        op = node.split(" at ")[0]
        if args and args[0] in state_of and op in ("state_index_put", "paged_state_index_put", "assign"):
            name, shape = state_of[args[0]], dec.shape(args[0], ())
            written[name] = op
            if op != "assign":  # (state, positions, rows[, block table])
                assert dec.shape(args[1], ()) == (1,), name
            else:
                assert MAX_SEQ not in shape and shape[1] <= 8, (name, shape)
    assert set(written) == set(state_of.values())
    paged = {b["state"] for b in dec.buffers if b.get("state") and b["alias_of"] is None and b["zone"] == "kv_pages"}
    assert paged == {f"cache_{i}_keys" for i in range(3)}  # K=V pools; entries, rings, overlaps stay per request
    per_row = {n for n, op in written.items() if op != "assign"}
    assert per_row == {f"cache_{i}_keys" for i in range(3)} | {
        "cache_0_compressor_entries", "cache_1_compressor_entries", "cache_1_indexer_entries"}


@pytest.mark.slow
def test_cli_run_generates(served):
    """`dayzero run OUT --input-ids ... --max-new-tokens N --json` prints upstream's greedy tokens."""
    import json

    from click.testing import CliRunner

    from dayzero.tools.cli import main

    rt, ref = served
    prompt = _prompt(10, 10)
    r = CliRunner().invoke(main, ["run", str(rt.path), "--input-ids", ",".join(map(str, prompt)),
                                  "--max-new-tokens", "8", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["tokens"] == _upstream(ref, prompt, 8)


@pytest.mark.slow
def test_compare_reads_the_prefill_of_a_stateful_artifact(tiny_compiled):
    """`dayzero compare CKPT OUT` on an artifact with a KV cache checks its prefill from an empty cache, step by step
    against the IR interpreter and against upstream's forward."""
    from dayzero.tools.compare import compare

    ckpt, art, _ = tiny_compiled("qwen3_moe")
    r = compare(str(ckpt), art, seq_len=12)
    assert r["program"] == "prefill" and r["input_shapes"] == [[1, 12], [12], [MAX_SEQ // 16]]  # + block table
    assert r["ok"] and r["trace_ok"] and r["first_divergence"] is None, r.get("first_divergence")
