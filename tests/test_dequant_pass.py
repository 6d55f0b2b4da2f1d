"""Low-precision experts resident as published, dequantised inside the fused kernel.

Spec:
- The frontend's MXFP4 dequant chain (plain ATen ops) computes exactly lowprec.dequant_mxfp4; the dequant pass
  recognises it by its shape (table checked by value, exponent bias 127) and nothing else: a chain with another
  table or bias is left alone.
- moe_experts_mxfp4's kernel (weights decoded in registers) matches its reference (dequantise, then the moe
  reference) on random blocks covering every FP4 code and a wide E8M0 range.
- Bad low-precision checkpoints (blocks/scales shape mismatch, truncated safetensors, NaN E8M0 scale code):
  `dayzero compile` exits 2 with one line naming the tensor, writes nothing.
- slow: tiny gpt-oss (MXFP4) and DeepSeek-V3.2 (MXFP4) compile with the experts in zone low_precision_weights at
  4.25 bits per weight, the report lists pattern `dequant` and the fused kernel's route, and logits match the
  upstream eager model on the dequantised weights.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from dayzero.frontend import lowprec
from dayzero.passes import dequant as dq
from dayzero.passes.fold_constants import fold_constants
from dayzero.passes.ir import interp  # noqa: F401
from dayzero.passes.ir import ops
from dayzero.passes.ir.node import Graph, Node, TensorType, rewrite


def _chain(in_major=False, shape=(4, 32, 2)):
    E, O, G = shape
    g = lowprec._dequant_graph("mxfp4", in_major, ("uint8", (E, O, G, 16)), ("uint8", (E, O, G)))
    consts: dict = {}
    return fold_constants(g, consts), consts


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
    ref = dq.moe_mxfp4_reference([x, ids, w, gb, gs, bgu, db, ds],
                                 {"act": act, "inter": I, "gate_up_bias": True, "down_bias": False})
    assert torch.allclose(y, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max())), float((y - ref).abs().max())


# ---- bad checkpoints through `dayzero compile` ------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_mx(tmp_path_factory):
    from dayzero.tools.make_tiny import make_tiny

    d = tmp_path_factory.mktemp("mx") / "gpt_oss"
    make_tiny("gpt_oss", d, experts="mxfp4")
    return d


def _rewrite(src, dst, fn):
    from safetensors.numpy import load_file, save_file
    from safetensors import safe_open

    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    with safe_open(str(f), "np") as h:
        meta = h.metadata()
    t = load_file(str(f))
    fn(t)
    save_file(t, str(f), metadata=meta)


def _compile_fails(ckpt, out, *needles):
    from dayzero.tools.cli import main

    r = CliRunner().invoke(main, ["compile", str(ckpt), "-o", str(out), "--max-seq", "32"])
    assert r.exit_code == 2, r.output
    line = r.output.strip()
    assert "Traceback" not in line and len(line.splitlines()) == 1, line
    for s in needles:
        assert s in line, line
    assert not out.exists()


KEY = "model.layers.0.mlp.experts.gate_up_proj"


def test_blocks_scales_shape_mismatch(tiny_mx, tmp_path):
    def fn(t):
        t[KEY + "_scales"] = np.ascontiguousarray(t[KEY + "_scales"][:, :-1])
    _rewrite(tiny_mx, tmp_path / "ck", fn)
    _compile_fails(tmp_path / "ck", tmp_path / "out", KEY, "does not match")


def test_nan_scale_code(tiny_mx, tmp_path):
    def fn(t):
        t[KEY + "_scales"] = t[KEY + "_scales"].copy()
        t[KEY + "_scales"][1, 2, 0] = 0xFF
    _rewrite(tiny_mx, tmp_path / "ck", fn)
    _compile_fails(tmp_path / "ck", tmp_path / "out", KEY + "_scales", "NaN")


def test_truncated_safetensors(tiny_mx, tmp_path):
    shutil.copytree(tiny_mx, tmp_path / "ck")
    f = tmp_path / "ck" / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    _compile_fails(tmp_path / "ck", tmp_path / "out", "model.safetensors", "truncated")


# ---- end to end (slow) -------------------------------------------------------------------------------------------

def _expert_values(ck) -> int:
    from dayzero.frontend.checkpoint import Checkpoint, low_precision_groups

    return sum(int(np.prod(g.stored)) for g in low_precision_groups(Checkpoint(ck), check_values=False).values())


def _check(tmp_path, model_type, reference):
    from dayzero.runtime.executor import load
    from dayzero.tools.driver import compile_model
    from dayzero.tools.make_tiny import make_tiny

    ck = tmp_path / model_type
    make_tiny(model_type, ck, experts="mxfp4")
    report = compile_model(str(ck), tmp_path / "a.dz", max_seq=64)
    n_moe = report["patterns"]["moe"]
    assert report["patterns"].get("dequant") == 2 * n_moe
    fused = [k for k, op in report["kernel_ops"].items() if op == "moe_experts_mxfp4"]
    assert fused and all(report["routes"][k] == "hand-scheduled" for k in fused)
    assert "moe_experts" not in report["kernel_ops"].values()
    lp = report["programs"]["prefill"]["memory"]["zones"]["low_precision_weights"]
    bits = lp * 8 / _expert_values(ck)
    assert 4.25 <= bits < 4.3, bits  # blocks + scales (+ 64-byte alignment), never a fp32 copy
    m = reference(ck, tmp_path)
    rt = load(tmp_path / "a.dz")
    gen = torch.Generator().manual_seed(0)
    for n in (1, 16, 40):
        ids = torch.randint(0, 256, (1, n), generator=gen)
        with torch.no_grad():
            ref = m(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
        got = rt.prefill(ids)
        if rt.stateful:
            rt.reset()
        assert float((got - ref).abs().max()) <= 1e-4, (model_type, n, float((got - ref).abs().max()))


@pytest.mark.slow
def test_gpt_oss_mxfp4(tmp_path):
    def reference(ck, _):
        from transformers import AutoModelForCausalLM, Mxfp4Config

        return AutoModelForCausalLM.from_pretrained(
            str(ck), quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32).eval()
    _check(tmp_path, "gpt_oss", reference)


@pytest.mark.slow
def test_deepseek_v32_mxfp4(tmp_path):
    def reference(ck, tmp):
        from dayzero.frontend.hf import load_upstream
        from dayzero.tools.make_tiny import dequantize_checkpoint

        return load_upstream(dequantize_checkpoint(ck, tmp / "deq"))
    _check(tmp_path, "deepseek_v32", reference)
