"""Chunked prefill: `dayzero compile --prefill-chunk N` and the runtime's chunk-by-chunk prefill.

Spec:
- The prefill program's sequence symbol ranges up to the chunk while the KV cache still holds --max-seq
  positions (``Runtime.max_length``); ``Runtime.prefill_chunk`` is the chunk.
- A prompt longer than several chunks (70 tokens in chunks of 16; 33 = 16 + 16 + 1) is prefilled chunk by chunk
  at increasing positions, each chunk reading the cache the ones before wrote: its logits equal the upstream
  model's eager forward on the whole prompt, and greedy decoding after it equals upstream ``generate()``, on every
  pattern that looks across chunk boundaries: Qwen3-MoE (full attention), gpt-oss (sliding window 8, attention
  sinks), DeepSeek-V3.2 (indexer top-k over the cached keys), DeepSeek-V4 (compressor windows that straddle
  chunks, CSA indexer, HCA, sliding window, hyper-connections).
- Qwen3-MoE and gpt-oss (sliding windows: their pools are sized by the chunk) are compiled with
  ``--prefill-chunk 16``, so ``prefill`` splits the prompt itself; DeepSeek-V3.2 and V4 reuse the session's shared
  artifacts (conftest.tiny_compiled: one prefill call could take the whole prompt) and are driven 16 tokens per
  call with ``append=True``: the same calls at the same positions, without compiling them a second time (in
  test_chunked_prefill_shared.py, so that another xdist worker can run them; the checks are tests/_chunked.py).
- The prefill's per-call memory (activations, I/O) is sized by the chunk: smaller than a compile without one.
- A chunk outside [1, --max-seq] is one line, exit 2.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from dayzero.tools.cli import main

from _chunked import CHUNK, MAX_SEQ, check_matches_upstream, upstream_model


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss"])
def chunked(request, tmp_path_factory, tiny_compiled):
    """(model type, runtime, upstream model, report) of the shared checkpoint compiled with --prefill-chunk (the
    runtime splits the prompt itself). DeepSeek-V3.2 and V4: test_chunked_prefill_shared.py."""
    from dayzero.runtime import load

    d = tmp_path_factory.mktemp(f"chunked_{request.param}")
    ckpt = tiny_compiled(request.param)[0]
    r = CliRunner().invoke(main, ["compile", str(ckpt), "-o", str(d / "art"), "--max-seq", str(MAX_SEQ),
                                  "--max-batch", "1", "--prefill-chunk", str(CHUNK)])
    assert r.exit_code == 0, r.output
    art, report = d / "art", json.loads((d / "art" / "report.json").read_text())
    return request.param, load(art), upstream_model(ckpt), report


@pytest.mark.slow
def test_chunked_prefill_matches_upstream(chunked):
    _, rt, ref, _ = chunked
    check_matches_upstream(rt, ref, None)


@pytest.mark.slow
def test_prefill_memory_is_sized_by_the_chunk(chunked, tiny_compiled):
    model_type, _, _, report = chunked
    if model_type != "qwen3_moe":
        pytest.skip("one architecture is enough for the prefill's sizes")
    full = tiny_compiled(model_type)[2]  # max_seq 128, no chunk: prefill takes all 128 tokens at once

    def per_call(rep):
        zones = rep["programs"]["prefill"]["memory"]["zones"]
        return zones["activations"] + zones["io"]
    assert full["programs"]["prefill"]["memory"]["bounds"] == {"seq": MAX_SEQ}
    assert report["programs"]["prefill"]["memory"]["bounds"] == {"seq": CHUNK}
    assert per_call(report) * 4 < per_call(full)


@pytest.mark.slow
def test_sliding_window_pool_is_sized_by_the_chunk(chunked):
    """A sliding-window K/V pool (gpt-oss's sliding layers, DeepSeek-V4's K = V state) holds, for the one request
    (--max-batch 1), the W - 1 positions before a call plus the call's chunk, ceil((W - 1 + chunk) / 16) + 1
    blocks, and the scratch block: not --max-seq's 128 / 16 blocks; the prompts of the test above ran through it."""
    model_type, rt, _, report = chunked
    windowed = [t for t in report["kv_pages"]["tables"] if t["window"]]
    if model_type != "gpt_oss":  # Qwen3-MoE: full attention only
        assert not windowed
        return
    assert windowed and report["kv_pages"]["table_len"] == MAX_SEQ // 16
    for t in windowed:
        assert t["blocks"] == -(-(t["window"] - 1 + CHUNK) // 16) + 1 + 1 < MAX_SEQ // 16 + 1
        assert rt.kv.by_name[t["name"]].blocks == t["blocks"]


@pytest.mark.parametrize("chunk", ["0", "65"])
def test_bad_prefill_chunk(chunk, tmp_path):
    r = CliRunner().invoke(main, ["compile", "no/such/dir", "-o", str(tmp_path / "o"), "--max-seq", "64",
                                  "--prefill-chunk", chunk])
    assert r.exit_code == 2 and "--prefill-chunk" in r.output and "Traceback" not in r.output
