"""``dayzero demo``: the mission end to end on a fresh machine, in about a minute.

A fixed-seed tiny DeepSeek-V4 (transformers' own modeling code with every feature on: compressed sparse attention
(CSA, with its indexer top-k) and heavily compressed attention (HCA), a sliding-window layer, hash-routed and
learned-routed MoE layers with a shared expert, mHC hyper-connections) is written as a checkpoint directory with
its routed experts in DeepSeek's published FP8 block format and a tiny tokenizer + chat template (make-tiny), and
compiled (prefill and decode programs sharing the KV cache; experts resident as FP8). A text prompt goes through
the chat template, is prefilled and decoded greedily, and the text comes back through the tokenizer. The same
checkpoint is loaded by transformers itself (its FP8 loader, dequantising to fp32 on the CPU) as the reference:
the prompt's logits and the greedy tokens of upstream ``generate()`` are compared. The report says which kernel
route (hand-scheduled / tuned / default / generic) each recognised pattern took.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch

DEMO_MODEL = "deepseek_v4"
DEMO_EXPERTS = "fp8"  # DeepSeek's published layout; transformers loads it on the CPU for the reference
DEMO_PROMPT = "What does a sparse mixture-of-experts model do?"
MAX_SEQ = 64
TOLERANCE = 1e-4
GENERATE = 16  # greedy tokens generated with prefill + decode and compared with upstream generate()
SERVE_SLOTS = 4  # request slots of the artifact `demo --serve` serves (continuous batching)


def build_tiny(model_type: str, out: str | None, experts: str = "fp32", **compile_kw) -> tuple[Path, Path, dict]:
    """Write the fixed-seed tiny checkpoint of ``model_type`` (routed experts stored as ``experts``) into a fresh
    temporary folder and compile it to ``out`` (or next to the checkpoint): (checkpoint dir, artifact dir,
    seconds per phase)."""
    from dayzero.tools.driver import compile_model
    from dayzero.tools.make_tiny import make_tiny

    work = Path(tempfile.mkdtemp(prefix=f"dayzero-demo-{model_type}-"))
    ckpt = work / "checkpoint"
    art = Path(out) if out else work / "artifact"
    seconds = {}
    t0 = time.perf_counter()
    make_tiny(model_type, ckpt, experts=experts, seed=0)
    seconds["checkpoint"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    compile_model(str(ckpt), str(art), **compile_kw)
    seconds["compile"] = time.perf_counter() - t0
    return ckpt, art, seconds


# kernels a pattern's rewrite produces, where their op is not named after the pattern
_PATTERN_OPS = {"dequant": ("fp8", "mxfp4"), "paged_kv_write": ("paged_",), "inplace_kv_write": ("state_index_put",)}


def _produced(pattern: str, op: str) -> bool:
    """Whether kernels of ``op`` come from ``pattern``'s rewrite: the op is named after the pattern (``moe`` ->
    ``moe_experts_fp8``), the pattern after a variant of the op (``compressed_attention_csa`` ->
    ``compressed_attention``), or ``_PATTERN_OPS`` lists it; a ``<pass>.<rule>`` name matches through either part
    (``sparse_attention.cache_attention`` -> ``cache_attention``)."""
    if "." in pattern:
        return any(_produced(part, op) for part in pattern.split("."))
    if pattern in _PATTERN_OPS:
        return any(k in op for k in _PATTERN_OPS[pattern])
    return op == pattern or op.startswith(pattern + "_") or pattern.startswith(op + "_")


def pattern_routes(report: dict) -> dict:
    """``{pattern: {"found": n, "kernels": {op: {route: kernels}}}}`` from a compile report: the kernels each
    pattern produced and the route each took."""
    out = {}
    for pattern, n in sorted(report.get("patterns", {}).items()):
        kernels: dict = {}
        for k, op in sorted(report.get("kernel_ops", {}).items()):
            if _produced(pattern, op):
                route = report["routes"].get(k, "?")
                kernels.setdefault(op, {}).setdefault(route, 0)
                kernels[op][route] += 1
        out[pattern] = {"found": n, "kernels": kernels}
    return out


def upstream_reference(ckpt: Path):
    """transformers' own model on the checkpoint, eager, fp32 (its FP8 loader dequantises the experts)."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    from dayzero.frontend.hf import _quiet

    cfg = json.loads((ckpt / "config.json").read_text())
    kw = {"quantization_config": FineGrainedFP8Config(dequantize=True)} \
        if cfg.get("quantization_config", {}).get("quant_method") == "fp8" else {}
    with _quiet():
        return AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32, **kw).eval()


def run_demo(out: str | None = None, prompt: str = DEMO_PROMPT, max_batch: int = 1) -> dict:
    """The demo; ``max_batch`` request slots in the artifact (``demo --serve`` serves several at once)."""
    from dayzero.runtime import load
    from dayzero.runtime.text import encode_chat

    ckpt, art, seconds = build_tiny(DEMO_MODEL, out, experts=DEMO_EXPERTS, max_seq=MAX_SEQ, max_batch=max_batch)
    t0 = time.perf_counter()
    rt = load(art)
    tok = rt.tokenizer
    seconds["load"] = time.perf_counter() - t0
    ids = encode_chat(tok, [{"role": "user", "content": prompt}])
    t0 = time.perf_counter()
    logits = rt.prefill(ids)
    seconds["run"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    new = min(GENERATE, rt.max_length - len(ids))
    tokens = rt.generate(ids, new, stop_ids=rt.eos_ids)
    seconds["generate"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref = upstream_reference(ckpt)
    x = torch.tensor([ids])
    with torch.no_grad():
        expected = ref(input_ids=x, attention_mask=torch.ones_like(x)).logits
        upstream = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False,
                                eos_token_id=rt.eos_ids)[0, len(ids):].tolist()
    seconds["eager"] = time.perf_counter() - t0
    diff = float((logits - expected).abs().max())
    same = tokens == upstream
    report = json.loads((art / "report.json").read_text())
    return {"model": DEMO_MODEL, "experts": DEMO_EXPERTS, "checkpoint": str(ckpt), "artifact": str(art),
            "prompt": prompt, "prompt_tokens": len(ids), "max_abs_diff": diff, "ok": diff <= TOLERANCE and same,
            "seconds": seconds, "tokens": tokens, "text": tok.decode(tokens, skip_special_tokens=True),
            "upstream_text": tok.decode(upstream, skip_special_tokens=True), "tokens_match_upstream": same,
            "patterns": pattern_routes(report)}
