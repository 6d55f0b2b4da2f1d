"""The batched decode program: one step serves every running request (tools/driver.batched_decode_graph).

Requests of different prompt lengths, each in its own slot, advance together through ``Runtime.decode_batch``:
each token is at its own position and reads its own KV blocks through its own block-table row, and the tokens
equal what each request gets alone from upstream's ``generate()`` (transformers' own cache, same weights).
"""

from __future__ import annotations

import pytest
import torch

from dayzero import UserError
from dayzero.frontend.hf import load_upstream
from dayzero.runtime import load

BATCHED = ["qwen3_moe", "gpt_oss", "deepseek_v3", "deepseek_v32"]
STEPS = 12


def _prompt(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _upstream(ref, prompt, n):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=BATCHED)
def served(request, tiny_compiled):
    ckpt, art, report = tiny_compiled(request.param)
    ref = load_upstream(ckpt)
    ref.generation_config.eos_token_id = None
    return load(art), ref, report


@pytest.mark.slow
def test_three_requests_step_together_as_each_alone_upstream(served):
    """Prompts of 3, 12 and 21 tokens (positions cross a 16-row block at different steps); the first request
    stops after 5 tokens, so later steps run B=2 on slots 1 and 2 only."""
    rt, ref, report = served
    assert rt.has_batched_decode and report["decode_batch"] == {"built": True, "reason": None}
    prompts = [_prompt(n, 100 + n) for n in (3, 12, 21)]
    limits = [5, STEPS + 1, STEPS + 1]
    out = {}
    for slot, p in enumerate(prompts):
        out[slot] = [int(rt.prefill(p, slot=slot)[0, -1].argmax())]
    for _ in range(STEPS):
        live = [s for s in out if len(out[s]) < limits[s]]
        logits = rt.decode_batch([out[s][-1] for s in live], live)
        assert logits.shape == (len(live), rt.programs["decode_batch"].buffers[
            rt.programs["decode_batch"].user_outputs[0]]["shape"][-1])
        for s, row in zip(live, logits):
            out[s].append(int(row.argmax()))
    for slot, p in enumerate(prompts):
        assert rt.lengths[slot] == len(p) + limits[slot] - 1
        assert out[slot] == _upstream(ref, p, limits[slot]), slot


@pytest.mark.slow
def test_batch_of_one_is_decode(served):
    """decode_batch([t], [s]) gives decode(t, s)'s logits (two programs, so to fp32 rounding) and advances the
    request alike."""
    rt, _, _ = served
    p = _prompt(9, 9)
    for slot in (0, 2):
        rt.prefill(p, slot=slot)
    a = rt.decode(17, slot=0)[0, -1]
    b = rt.decode_batch([17], [2])[0]
    assert rt.lengths[0] == rt.lengths[2] == 10
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert int(a.argmax()) == int(b.argmax())
    a2 = rt.decode(int(a.argmax()), slot=0)[0, -1]
    b2 = rt.decode_batch([int(b.argmax())], [2])[0]
    torch.testing.assert_close(b2, a2, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_bad_steps_raise_and_change_nothing(served):
    rt, _, _ = served
    rt.reset()
    rt.prefill(_prompt(4, 4), slot=0)
    before = dict(rt.lengths)
    for tokens, slots, match in (([1, 2], [0], "one token per slot"), ([1], [rt.max_batch], "not a request slot"),
                                 ([1, 2], [0, 0], "twice"), ([1, 2], [0, 1], "before prefill"),
                                 ([10 ** 6], [0], "outside"), ([1], ["0"], "not a request slot"),
                                 ([1.5], [0], "not a token id"), ([], [], "one token per slot")):
        with pytest.raises(UserError, match=match):
            rt.decode_batch(tokens, slots)
    assert rt.lengths == before


@pytest.mark.slow
def test_deepseek_v4_has_no_batched_step(tiny_compiled):
    """Its compressed entries, pending rings and overlaps are per-request states (not paged): it steps each
    request with decode()."""
    _, art, report = tiny_compiled("deepseek_v4")
    rt = load(art)
    assert not rt.has_batched_decode and "decode_batch" not in rt.programs
    assert report["decode_batch"]["built"] is False and "per request slot" in report["decode_batch"]["reason"]
    rt.prefill([1, 2, 3], slot=0)
    with pytest.raises(UserError, match="no batched decode program"):
        rt.decode_batch([4], [0])
