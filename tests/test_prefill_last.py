"""The ``prefill_last`` program (passes/last_position.py): generation's prefill computes the LM head for the last
real token only.

Spec: every tiny text architecture's artifact has it; ``prefill(ids, last=True)`` runs it and equals the full
prefill's last row (one row of the head: its own summation order, so fp32-close, and the same greedy token), for
prompts of any length, and leaves the request's cache as the full prefill does (the next decode step is the same).
(A chunk padded on the right reads the row of its last real token, not the last row: tests/passes/
test_last_position.py; chunked prompts through it: test_chunked_prefill*.py, whose greedy tokens equal upstream.)
A multimodal artifact has none (its prefill is runtime/multimodal.py's).
"""

from __future__ import annotations

import json

import pytest
import torch

from dayzero.passes.last_position import LAST_PROGRAM
from dayzero.runtime import load

TEXT_MODELS = ("qwen3_moe", "gpt_oss", "deepseek_v32", "deepseek_v4")


@pytest.mark.parametrize("model_type", TEXT_MODELS)
def test_last_position_prefill_equals_the_full_prefills_last_row(model_type, tiny_compiled):
    _, art, _ = tiny_compiled(model_type)
    rt = load(art)
    assert LAST_PROGRAM in rt.programs
    for n in (1, 13, 37):
        ids = torch.randint(1, 200, (1, n), generator=torch.Generator().manual_seed(n))
        rt.reset()
        full = rt.prefill(ids)
        after_full = rt.decode(7)
        rt.reset()
        last = rt.prefill(ids, last=True)
        assert last.shape == (1, 1, full.shape[-1])
        torch.testing.assert_close(last, full[:, -1:], rtol=1e-5, atol=1e-5 * float(full.abs().max()))
        assert int(last.argmax()) == int(full[0, -1].argmax())
        torch.testing.assert_close(rt.decode(7), after_full, rtol=0, atol=0)  # the same cache after either


def test_a_multimodal_artifact_has_no_last_position_program(tiny_compiled):
    _, art, _ = tiny_compiled("qwen3_vl_moe")
    assert LAST_PROGRAM not in json.loads((art / "program.json").read_text())["programs"]
