"""Low-precision experts resident as published, dequantised inside the fused kernel.

Spec:
- The frontend's MXFP4 dequant chain (plain ATen ops) computes exactly lowprec.dequant_mxfp4; the dequant pass
  recognises it by its shape (table checked by value, exponent bias 127) and nothing else: a chain with another
  table or bias is left alone.
- moe_experts_mxfp4's kernel (weights decoded in registers) matches its reference (dequantise, then the moe
  reference) on random blocks covering every FP4 code and a wide E8M0 range.
- Bad low-precision checkpoints (blocks/scales shape mismatch, truncated safetensors, NaN E8M0 scale code):
  `dayzero compile` exits 2 with one line naming the tensor, writes nothing.
- slow: tiny gpt-oss (MXFP4, its published fused layout) and Qwen3-MoE (MXFP4 per-expert keys) compile with the
  experts in zone low_precision_weights at 4.25 bits per weight, the report lists pattern `dequant` and the fused
  kernel's route, and logits match the upstream eager model on the dequantised weights. (DeepSeek-V3.2 with
  low-precision experts runs end to end in test_fp8_experts.py, in its published FP8 layout.)
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from dayzero.frontend import lowprec
from dayzero.passes import dequant as dq
from dayzero.passes.fold_constants import fold_constants
from dayzero.passes.ir import interp  # noqa: F401
from dayzero.passes.ir import ops
from dayzero.passes.ir import reference_moe as rm
from dayzero.passes.ir.node import Graph

from _dequant_chain import dequant_graph
from _lowprec_ref import assert_prefill_matches, check_fused_experts, compile_fails, dequantized_upstream, \
    rewrite_checkpoint


def _chain(in_major=False, shape=(4, 32, 2)):
    E, O, G = shape
    g = dequant_graph("mxfp4", in_major, ("uint8", (E, O, G, 16)), ("uint8", (E, O, G)))
    g, found = fold_constants(g)
    return g, found.constants


def _eval(g: Graph, feeds: dict, consts: dict) -> torch.Tensor:
    vals = {}
    for n in g.nodes():
        if n.op == "input":
            vals[id(n)] = feeds[n.attr["name"]]
        elif n.op == "weight":
            vals[id(n)] = consts[n.attr["name"]]
        else:
            vals[id(n)] = ops.get(n.op).call([vals[id(i)] for i in n.inputs], n.attr)
    return vals[id(g.outputs[0])]


def _random_mx(E, O, G, seed=0):
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (E, O, G, 16), dtype=np.uint8)
    s = rng.integers(100, 140, (E, O, G), dtype=np.uint8)
    return torch.from_numpy(b), torch.from_numpy(s)


@pytest.mark.parametrize("in_major", [False, True])
def test_chain_is_exact_and_matches(in_major):
    g, consts = _chain(in_major)
    b, s = _random_mx(4, 32, 2)
    want = lowprec.dequant_mxfp4(b, s)
    want = want.transpose(-1, -2) if in_major else want
    got = _eval(g, {"blocks": b, "scales": s}, consts)
    assert torch.equal(got.view(torch.int32), want.contiguous().view(torch.int32))
    m = dq.match_mxfp4(g.outputs[0], consts)
    assert m is not None and m[0].op == "input" and m[1].op == "input" and m[2] == in_major


def test_chain_with_other_table_or_bias_is_not_matched():
    g, consts = _chain()
    lut = next(n for n in g.nodes() if n.op == "weight" and tuple(n.shape) == (16,))
    bad = dict(consts)
    bad[lut.attr["name"]] = consts[lut.attr["name"]] * 2
    assert dq.match_mxfp4(g.outputs[0], bad) is None
    bias = next(n for n in g.nodes() if n.op == "weight" and n.shape == () and
                float(consts[n.attr["name"]]) == 127.0)
    bad = dict(consts)
    bad[bias.attr["name"]] = torch.tensor(126.0)
    assert dq.match_mxfp4(g.outputs[0], bad) is None


@pytest.mark.slow  # a heavy kernel build: the end-to-end tier
def test_moe_mxfp4_kernel_matches_reference():
    import tvm

    from dayzero.codegen.kernels import moe as km
    from dayzero.targets.host import host_target_dict

    E, H, I, k, Tn = 4, 64, 32, 2, 7
    act = ("mul", ("silu", ("col", 0, 1, I)), ("col", I, 1, I))
    f = km.moe_experts_func(E, H, 2 * I, I, k, layout="nk", act=act, gate_up_bias=True, down_bias=False,
                            wfmt="mxfp4")
    lib = tvm.compile(tvm.IRModule({"main": f}), target=host_target_dict())["main"]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(Tn, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(Tn)])
    w = torch.rand(Tn, k, generator=gen)
    gb, gs = _random_mx(E, 2 * I, H // 32, seed=2)
    db, ds = _random_mx(E, H, I // 32, seed=3)
    bgu = torch.randn(E, 2 * I, generator=gen)
    y = torch.empty(Tn, H)
    lib(x, ids, w, gb, gs, bgu, db, ds, y)
    ref = rm.moe_mxfp4_reference([x, ids, w, gb, gs, bgu, db, ds],
                                 {"act": act, "inter": I, "gate_up_bias": True, "down_bias": False})
    assert torch.allclose(y, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max())), float((y - ref).abs().max())


# ---- bad checkpoints through `dayzero compile` ------------------------------------------------------------------

KEY = "model.layers.0.mlp.experts.gate_up_proj"


def test_blocks_scales_shape_mismatch(lowprec_tiny, tmp_path):
    def fn(t):
        t[KEY + "_scales"] = np.ascontiguousarray(t[KEY + "_scales"][:, :-1])
    ckpt = rewrite_checkpoint(lowprec_tiny("gpt_oss", "mxfp4"), tmp_path / "ck", fn, framework="np")
    compile_fails(ckpt, tmp_path / "out", KEY, "does not match")


def test_nan_scale_code(lowprec_tiny, tmp_path):
    def fn(t):
        t[KEY + "_scales"] = t[KEY + "_scales"].copy()
        t[KEY + "_scales"][1, 2, 0] = 0xFF
    ckpt = rewrite_checkpoint(lowprec_tiny("gpt_oss", "mxfp4"), tmp_path / "ck", fn, framework="np")
    compile_fails(ckpt, tmp_path / "out", KEY + "_scales", "NaN")


def test_truncated_safetensors(lowprec_tiny, tmp_path):
    shutil.copytree(lowprec_tiny("gpt_oss", "mxfp4"), tmp_path / "ck")
    f = tmp_path / "ck" / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    compile_fails(tmp_path / "ck", tmp_path / "out", "model.safetensors", "truncated")


# ---- end to end (slow) -------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("model_type,loader", [
    ("gpt_oss", "transformers_mxfp4"),  # the reference: transformers' own loader dequantises the published layout
    ("qwen3_moe", "dequantize_checkpoint"),  # per-expert keys, each its own blocks + scales
])
def test_tiny_model_with_mxfp4_experts_matches_eager(model_type, loader, lowprec_compiled, tmp_path):
    from dayzero.runtime.executor import load

    ckpt, art, report = lowprec_compiled(model_type, "mxfp4")  # compiled once per session (conftest)
    # blocks + scales: 4.25 bits (+ 64-byte alignment) per weight, never an fp32 copy
    check_fused_experts(report, ckpt, "moe_experts_mxfp4", (4.25 / 8, 4.3 / 8))
    assert_prefill_matches(load(art), dequantized_upstream(ckpt, tmp_path, loader), (1, 16, 40))
