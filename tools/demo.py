"""``dayzero demo``: the embedded default, end to end on a fresh machine.

A fixed-seed tiny Qwen3-MoE (transformers' own modeling code, every MoE feature on: softmax router, top-k with
normalised weights, q/k norms, GQA) is written as a checkpoint directory, compiled (prefill and decode programs
sharing the KV cache), run, and compared with the upstream model run eagerly on the same weights and input: the
prefill logits, and 16 greedily generated tokens against upstream ``generate()``.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

DEMO_MODEL = "qwen3_moe"
TOLERANCE = 1e-4
GENERATE = 16  # greedy tokens generated with prefill + decode and compared with upstream generate()


def build_tiny(model_type: str, out: str | None, **compile_kw) -> tuple[Path, Path, dict]:
    """Write the fixed-seed tiny checkpoint of ``model_type`` into a fresh temporary folder and compile it to
    ``out`` (or next to the checkpoint): (checkpoint dir, artifact dir, seconds per phase)."""
    from dayzero.tools.driver import compile_model
    from dayzero.tools.make_tiny import make_tiny

    work = Path(tempfile.mkdtemp(prefix=f"dayzero-demo-{model_type}-"))
    ckpt = work / "checkpoint"
    art = Path(out) if out else work / "artifact"
    seconds = {}
    t0 = time.perf_counter()
    make_tiny(model_type, ckpt, seed=0)
    seconds["checkpoint"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    compile_model(str(ckpt), str(art), **compile_kw)
    seconds["compile"] = time.perf_counter() - t0
    return ckpt, art, seconds


def run_demo(out: str | None = None, seq_len: int = 16) -> dict:
    from dayzero.frontend.hf import load_upstream
    from dayzero.runtime import load

    ckpt, art, seconds = build_tiny(DEMO_MODEL, out, max_seq=max(64, seq_len))
    t0 = time.perf_counter()
    rt = load(art)
    seconds["load"] = time.perf_counter() - t0
    ids = torch.randint(0, 256, (1, seq_len), generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    logits = rt.prefill(ids)
    seconds["run"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref = load_upstream(ckpt)
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    seconds["eager"] = time.perf_counter() - t0
    diff = float((logits - expected).abs().max())
    t0 = time.perf_counter()
    tokens = rt.generate(ids, GENERATE)
    seconds["generate"] = time.perf_counter() - t0
    with torch.no_grad():
        upstream = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GENERATE,
                                do_sample=False)[0, seq_len:].tolist()
    same = tokens == upstream
    return {"model": DEMO_MODEL, "checkpoint": str(ckpt), "artifact": str(art), "seq_len": seq_len,
            "max_abs_diff": diff, "ok": diff <= TOLERANCE and same, "seconds": seconds,
            "argmax": logits[0].argmax(-1).tolist(), "tokens": tokens, "tokens_match_upstream": same}
