"""tools/bench.py: the ``tvm_relax`` baseline of ``dayzero bench e2e`` computes the upstream model's logits (stock
Relax import of the same torch.export, default pipeline), so the times it reports are of the same computation."""

from __future__ import annotations

import pytest
import torch

from dayzero.frontend.hf import load_upstream
from dayzero.tools.bench import relax_baseline
from dayzero.tools.make_tiny import make_tiny


@pytest.mark.slow
@pytest.mark.parametrize("model", ["qwen3_moe", "deepseek_v32"])  # V3.2: the import fixes (V4 still fails later)
def test_relax_baseline_matches_the_upstream_logits(tmp_path, model):
    ckpt = make_tiny(model, tmp_path / "ckpt", seed=0)
    upstream = load_upstream(ckpt, experts="batched_mm")
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(5))
    run, seconds = relax_baseline(upstream, ids)
    with torch.no_grad():
        want = upstream(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
    got = torch.from_numpy(run().numpy())
    assert seconds > 0
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
