"""Helpers shared by the low-precision expert tests (test_dequant_pass.py: MXFP4, test_fp8_experts.py: FP8 blocks).

- ``dequantized_upstream``: the reference, transformers' eager model on the checkpoint's dequantised weights
  (make-tiny's ``dequantize_checkpoint``, or transformers' own MXFP4 loader for gpt-oss's published layout).
- ``check_fused_experts``: the compile report of a low-precision checkpoint puts every MoE layer on one fused,
  hand-scheduled kernel and keeps the experts resident as stored (bytes per weight within a range).
- ``assert_prefill_matches``: compiled prefill logits equal the reference's within 1e-4 at several lengths.
- ``to_bf16_checkpoint``: a copy of a checkpoint with its float32 tensors stored bf16 (test_bf16_weights.py,
  test_dist.py).
- ``rewrite_checkpoint`` / ``compile_fails``: a damaged copy of a checkpoint, and `dayzero compile` on it exiting 2
  with one line that names the problem, writing nothing.
"""

from __future__ import annotations

import shutil

import numpy as np
import torch
from click.testing import CliRunner
from conftest import LOWPREC_MAX_SEQ

TOL = 1e-4


def dequantized_upstream(ckpt, tmp, loader: str = "dequantize_checkpoint"):
    """transformers' eager model on ``ckpt``'s weights dequantised to fp32; ``loader="transformers_mxfp4"`` uses
    transformers' own MXFP4 dequantisation (``Mxfp4Config(dequantize=True)``) instead of make-tiny's."""
    if loader == "transformers_mxfp4":
        from transformers import AutoModelForCausalLM, Mxfp4Config

        return AutoModelForCausalLM.from_pretrained(
            str(ckpt), quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32).eval()
    from dayzero.frontend.hf import load_upstream
    from dayzero.tools.make_tiny import dequantize_checkpoint

    return load_upstream(dequantize_checkpoint(ckpt, tmp / "deq"))


def expert_values(ckpt) -> int:
    """How many weights the checkpoint's low-precision expert tensors hold (their stored shapes, unpacked)."""
    from dayzero.frontend.checkpoint import Checkpoint, low_precision_groups

    return sum(int(np.prod(g.stored)) for g in low_precision_groups(Checkpoint(ckpt), check_values=False).values())


def check_fused_experts(report: dict, ckpt, fused_op: str, bytes_per_weight: tuple[float, float]) -> None:
    """One fused dequant (both expert chains) per MoE layer, every ``fused_op`` kernel hand-scheduled, no plain ``moe_experts``
    left, and zone low_precision_weights within ``bytes_per_weight`` (lo, hi) of the expert weight count."""
    n_moe = report["patterns"]["moe.grouped_experts"]
    assert n_moe >= 1 and report["patterns"].get("dequant.experts") == n_moe
    fused = [k for k, op in report["kernel_ops"].items() if op == fused_op]
    assert fused  # one kernel per distinct shape, shared by the layers and programs that have it
    assert all(report["routes"][k] == "hand-scheduled" for k in fused)
    assert "moe_experts" not in report["kernel_ops"].values()
    lp = report["programs"]["prefill"]["memory"]["zones"]["low_precision_weights"]
    per_weight = lp / expert_values(ckpt)
    lo, hi = bytes_per_weight
    assert lo <= per_weight < hi, per_weight  # as stored + scales (+ alignment), never an fp32 copy


def assert_prefill_matches(rt, ref, lengths, seed: int = 0) -> torch.Generator:
    """Random prompts of each length (generator seeded ``seed``): compiled prefill logits within TOL of ``ref``'s
    eager forward. Returns the generator, for the caller's next draws."""
    gen = torch.Generator().manual_seed(seed)
    for n in lengths:
        ids = torch.randint(0, 256, (1, n), generator=gen)
        with torch.no_grad():
            want = ref(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
        got = rt.prefill(ids)
        if rt.stateful:
            rt.reset()
        assert got.shape == want.shape
        err = float((got - want).abs().max())
        assert err <= TOL, (n, err)
    return gen


def rewrite_checkpoint(src, dst, fn, framework: str = "pt"):
    """A copy of checkpoint ``src`` at ``dst`` whose model.safetensors tensors (a dict of ``framework`` arrays,
    "pt" or "np") ``fn`` edited in place; the file's metadata is kept."""
    import importlib

    from safetensors import safe_open

    io = importlib.import_module({"pt": "safetensors.torch", "np": "safetensors.numpy"}[framework])
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    with safe_open(str(f), framework) as h:
        meta = h.metadata()
    t = io.load_file(str(f))
    fn(t)
    io.save_file(t, str(f), metadata=meta)
    return dst


def to_bf16_checkpoint(src, dst, declared: bool = False):
    """A copy of checkpoint ``src`` at ``dst`` with every float32 tensor stored as bfloat16 (as published
    checkpoints are); ``declared``: its config.json says so too (``dtype``: what `dayzero plan` reads)."""
    import json

    def fn(t):
        for k, v in t.items():
            if v.dtype == torch.float32:
                t[k] = v.bfloat16()
    rewrite_checkpoint(src, dst, fn)
    if declared:
        cfg = json.loads((dst / "config.json").read_text())
        cfg["dtype"] = "bfloat16"
        (dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    return dst


def compile_fails(ckpt, out, *needles) -> None:
    """`dayzero compile ckpt -o out` exits 2 with one line (no traceback) holding every needle; out not written."""
    from dayzero.tools.cli import main

    r = CliRunner().invoke(main, ["compile", str(ckpt), "-o", str(out), "--max-seq", str(LOWPREC_MAX_SEQ)])
    assert r.exit_code == 2, r.output
    line = r.output.strip()
    assert "Traceback" not in line and len(line.splitlines()) == 1, line
    for s in needles:
        assert s in line, line
    assert not out.exists()
