"""End to end: compiled artifacts match the upstream model run eagerly (fp32, max abs diff <= 1e-4)."""

from __future__ import annotations

import json

import pytest
import torch

from dayzero.runtime import load

TOL = 1e-4


@pytest.mark.parametrize("name", ["tiny_dense", "tiny_moe"])
def test_one_artifact_serves_every_length(compiled_factory, name):
    out, module, _ = compiled_factory(name)
    rt = load(out)
    for seq in (1, 7, 33):
        ids = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(seq))
        with torch.no_grad():
            expected = module(ids)
        got = rt.prefill(ids)
        assert got.shape == expected.shape
        assert (got - expected).abs().max().item() <= TOL, f"seq {seq}"


def test_artifact_layout_and_report(compiled_factory):
    out, _, _ = compiled_factory("tiny_moe")
    names = {p.name for p in out.iterdir()}
    assert {"program.json", "kernels.so", "weights.json", "weights.safetensors", "report.json",
            "final.ir"} <= names
    rep = json.loads((out / "report.json").read_text())
    assert rep["unsupported"] == []
    assert set(rep["routes"].values()) <= {"hand-scheduled", "tuned", "default", "generic"}
    assert rep["target"]["kind"] == "llvm" and rep["target"]["mcpu"]  # the detected CPU, never generic
    mem = rep["programs"]["prefill"]["memory"]
    assert mem["arena_bytes"] % 64 == 0 and mem["zones"]["weights"] > 0
    prog = json.loads((out / "program.json").read_text())["programs"]["prefill"]
    assert all(off % 64 == 0 for off in prog["memory"]["offsets"].values())


def test_kernels_are_shared_across_layers(compiled_factory):
    out, _, _ = compiled_factory("tiny_dense")
    prog = json.loads((out / "program.json").read_text())["programs"]["prefill"]
    assert len(prog["kernels"]) < len(prog["steps"]) * 0.7


def test_out_of_range_inputs_are_user_errors(compiled_factory):
    from dayzero import UserError

    out, _, _ = compiled_factory("tiny_dense")
    rt = load(out)
    with pytest.raises(UserError, match="outside"):
        rt.prefill([1, 2, 999])
    with pytest.raises(UserError, match="compiled range"):
        rt.prefill(list(range(65)))
    with pytest.raises(UserError, match="empty"):
        rt.prefill([])


def test_checkpoint_directory_end_to_end(tiny_compiled):
    """A published-layout checkpoint (per-expert tensors) binds through learned recipes and matches eager."""
    from dayzero.frontend.hf import load_upstream

    ckpt, art, _ = tiny_compiled("qwen3_moe")  # make-tiny's published layout, compiled once per session (conftest)
    manifest = json.loads((art / "weights.json").read_text())
    gate_up = manifest["tensors"]["model.layers.0.mlp.experts.gate_up_proj"]
    assert gate_up["source"] == "checkpoint"
    assert {r[1] for r in gate_up["runs"]} >= {"model.layers.0.mlp.experts.0.gate_proj.weight"}
    rt = load(art)
    ref = load_upstream(ckpt)
    for seq in (1, 7, 33):
        ids = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(seq))
        with torch.no_grad():
            expected = ref(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        assert (rt.prefill(ids) - expected).abs().max().item() <= TOL


def test_fused_kernels_and_call_arguments_made_at_load(compiled_factory):
    """The prefill runs fused kernels (passes/fuse.py: no lone norm or element-wise step left where a group took
    it), and every call's tensor arguments are TVM tensors made once per binding (a torch tensor would be converted
    on every call); the loop over them computes what the torch-argument loop does."""
    import tvm

    out, module, _ = compiled_factory("tiny_moe")
    pj = json.loads((out / "program.json").read_text())["programs"]["prefill"]
    kernel_ops = {k["op"] for k in pj["kernels"].values()}
    assert "fused" in kernel_ops and not {"rsqrt", "pow.Tensor_Scalar", "mean.dim"} & kernel_ops
    rt = load(out)
    prog = rt.programs["prefill"]
    ids = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(7))
    want = prog.run([ids])[0]
    calls, fast, _, (logits,) = prog._cache(prog.bind([ids]), 0)
    assert len(fast) == len(calls) == len(pj["steps"])
    assert all(isinstance(a, (tvm.runtime.Tensor, int)) for _, args in fast for a in args)
    for loop in (calls, fast):
        logits.zero_()
        for f, args in loop:
            f(*args)
        assert torch.equal(logits, want)
