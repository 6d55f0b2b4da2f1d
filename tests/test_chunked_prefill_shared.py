"""Chunked prefill on the session's shared DeepSeek-V3.2 (indexer top-k over the cached keys) and DeepSeek-V4
(compressor windows that straddle chunks, CSA indexer, HCA, sliding window, hyper-connections) artifacts: the spec
is test_chunked_prefill.py's. These artifacts were compiled without a chunk (conftest.tiny_compiled: one prefill
call could take the whole prompt), so the test drives them 16 tokens per call with ``append=True``: the same calls
at the same positions as a chunked compile, without compiling them a second time.

A file of its own: the two shared compiles it may build are minutes of one worker, which ``--dist loadfile`` can
then run beside the chunked compiles of test_chunked_prefill.py (conftest.HEAVY_FIRST starts it early).
"""

from __future__ import annotations

import pytest

from _chunked import CHUNK, check_matches_upstream, upstream_model


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["deepseek_v32", "deepseek_v4"])
def test_chunked_prefill_matches_upstream(tiny_compiled, model_type):
    from dayzero.runtime import load

    ckpt, art, _ = tiny_compiled(model_type)
    check_matches_upstream(load(art), upstream_model(ckpt), CHUNK)
