"""Tiny upstream MoE checkpoints compile once and match transformers' eager forward at several lengths.

One artifact per architecture serves seq 1, 16 and 100: lengths the traced graph does not accept directly
(DeepSeek-V3.2's seq >= index_topk) are padded on the right by the runtime and the logits sliced back.
"""

from __future__ import annotations

import pytest
import torch

from dayzero.frontend.hf import load_upstream
from dayzero.runtime.executor import load

SEQS = (1, 16, 100)


def _check(tiny_compiled, model_type, atol=1e-4):
    ck, art, _ = tiny_compiled(model_type)  # one artifact (max_seq 128) per architecture for the whole session
    rt = load(art)
    m = load_upstream(ck)
    gen = torch.Generator().manual_seed(0)
    for n in SEQS:
        ids = torch.randint(0, 256, (1, n), generator=gen)
        with torch.no_grad():
            ref = m(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
        got = rt.prefill(ids)
        assert got.shape == ref.shape
        assert float((got - ref).abs().max()) <= atol, (model_type, n, float((got - ref).abs().max()))


@pytest.mark.slow
def test_gpt_oss(tiny_compiled):
    _check(tiny_compiled, "gpt_oss")


@pytest.mark.slow
def test_deepseek_v32(tiny_compiled):
    _check(tiny_compiled, "deepseek_v32")


@pytest.mark.slow
def test_deepseek_v4(tiny_compiled):
    # compressed attention (CSA every 4, HCA every 8 tokens) on dayzero's fixed-size cache (frontend/v4_cache.py):
    # any length, no padding; 16 and 100 close compression windows (100 leaves one open), whose CSA overlap half is
    # an open-ended slice_scatter (new_kv[:, 1:, :4])
    _check(tiny_compiled, "deepseek_v4")
