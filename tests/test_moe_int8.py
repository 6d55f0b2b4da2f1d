"""MXFP4 routed experts on integer tiles (codegen/kernels/moe.py ``int8``; ``dayzero compile --int8-activations``).

- The kernel against its op reference (``moe_experts_mxfp4`` with attr int8: x and act(...) rounded to int8 per
  32-block by ``reference_moe.int8_blocks_ref``, the GEMMs in float64 on the decoded weights): the integer dot
  products are exact, the only other error is fp32 rounding of the per-block scaling and the sums, so
  max |y - ref| <= 1e-6 max |ref| (observed ~1e-7). Token counts cover the MB-row, 2-row and 1-row tiles; block
  counts every tail of the WMAX-block step; both integer modes (vnni here; maddubs as haswell code).
- The option: the pass marks the decode programs' moe_experts_mxfp4 nodes only, bad combinations are one line.
- End to end (slow): tiny gpt-oss (MXFP4 experts) compiled with the option: prefill stays exact, every decode
  step's logits are within the error transformers' own bf16 path has on the same tokens (measured in the test: the
  bound the brief of issue 17 set for this option), and the greedy tokens equal upstream's.
"""

from __future__ import annotations

import json

import pytest
import torch

from dayzero.codegen.kernels.dequant.gemv_int8 import int8_mode
from dayzero.passes.ir import reference_moe as rm
from dayzero.targets.host import host_target_dict

from _cli import assert_compile_refused

HOST = host_target_dict()
HASWELL = {"kind": "llvm", "mcpu": "haswell", "num-cores": 2}
pytestmark = pytest.mark.skipif(int8_mode(HOST) is None, reason="the host has no AVX2: no integer route to run")


def _mx(E, O, K, seed):
    """Trained-like MXFP4 weights (fan-in scaled normals quantised as published)."""
    from dayzero.frontend import lowprec

    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(E, O, K, generator=g) / K ** 0.5).numpy()
    b, s = lowprec.quantize_mxfp4(w)
    return torch.from_numpy(b).clone(), torch.from_numpy(s).clone()


# (E, k, H, I): GH = H / 32 and GI = I / 32 cover G % 4 = 0..3 and G < 4
@pytest.mark.parametrize("shape, mode", [((6, 2, 96, 64), None), ((4, 2, 160, 128), None),
                                         ((4, 3, 224, 192), None), ((6, 2, 96, 64), "maddubs")])
def test_int8_kernel_matches_its_reference(shape, mode):
    import tvm

    from dayzero.codegen.kernels.moe import moe_experts_func

    E, k, H, I = shape
    if mode == "maddubs" and int8_mode(HOST) != "vnni":
        pytest.skip("the host runs maddubs as its own mode")
    act = ("mul", ("silu", ("col", 0, 2, I)), ("col", 1, 2, I))
    f = moe_experts_func(E, H, 2 * I, I, k, layout="nk", act=act, gate_up_bias=True, down_bias=True, wfmt="mxfp4",
                         int8=mode or True)
    lib = tvm.compile(tvm.IRModule({"main": f}), target=HASWELL if mode else HOST)["main"]
    gub, gus = _mx(E, 2 * I, H, 0)
    db, ds = _mx(E, H, I, 1)
    g = torch.Generator().manual_seed(2)
    bgu, bd = torch.randn(E, 2 * I, generator=g) * 0.1, torch.randn(E, H, generator=g) * 0.1
    attrs = dict(act=act, inter=I, gate_up_bias=True, down_bias=True)
    for T in (1, 2, 3, 7, 9):  # experts get 1..>MB tokens: every tile kind
        x = torch.randn(T, H, generator=g)
        x[0, :32] = 0  # an all-zero block quantises to zeros
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        w = torch.rand(T, k, generator=g)
        y = torch.empty(T, H)
        lib(x, ids, w, gub, gus, bgu, db, ds, bd, y)
        ins = [x, ids, w, gub, gus, bgu, db, ds, bd]
        ref = rm.moe_mxfp4_reference(ins, dict(attrs, int8=True))
        assert float((y - ref).abs().max()) <= 1e-6 * float(ref.abs().max()), T
        # and it is the rounded computation, not the fp32 one (which the reference without int8 gives)
        exact = rm.moe_mxfp4_reference(ins, attrs)
        assert float((y - exact).abs().max()) > 1e-4 * float(exact.abs().max())


def test_int8_decode_tiles_prefetch_the_next_rows():
    """The integer 1- and 2-row tiles prefetch the next weight rows' code bytes each step of blocks, as the fp32
    tiles do (gpt-oss-20b experts streamed from DRAM, ``dayzero bench moe --full-width``: decode T = 1 3.4 -> 2.4 ms,
    T = 8 18 -> 11 ms). G = 8 blocks: the main steps run (with G < WMAX only the remainder steps would)."""
    import re

    import tvm

    from dayzero.codegen.kernels.moe import moe_experts_func

    act = ("mul", ("silu", ("col", 0, 2, 64)), ("col", 1, 2, 64))
    f = moe_experts_func(4, 256, 128, 64, 2, layout="nk", act=act, gate_up_bias=False, down_bias=False, wfmt="mxfp4",
                         int8=True)
    asm = tvm.compile(tvm.IRModule({"main": f}), target=HOST).mod.inspect_source("asm")
    assert re.findall(r"\bprefetch\w*\b", asm)


def test_int8_blocks_ref_rounds_per_block():
    x = torch.tensor([[127.0, 63.4, -0.6, 0.4] + [0.0] * 28 + [1.0] * 32])
    q = rm.int8_blocks_ref(x)
    assert q[0, :4].tolist() == [127.0, 63.0, -1.0, 0.0]  # steps of max/127 = 1 within block 0
    # block 1: q = 127 everywhere, times fp32(1 * fp32(1/127)): 1 to fp32 rounding
    assert torch.allclose(q[0, 32:], torch.ones(32, dtype=torch.float64), rtol=1e-7, atol=0)


def test_pass_marks_mxfp4_experts_only():
    from dayzero.passes import expert_workspace as ew
    from dayzero.passes.ir.node import Graph, Node, TensorType

    def inp(name, dtype, shape):
        return Node.make("input", (), {"name": name}, [TensorType(dtype, shape)], None)
    E, H, I, k = 2, 64, 32, 2
    x, ids, w = inp("x", "float32", (1, H)), inp("ids", "int64", (1, k)), inp("w", "float32", (1, k))
    blocks = [inp("gb", "uint8", (E, 2 * I, H // 32, 16)), inp("gs", "uint8", (E, 2 * I, H // 32)),
              inp("db", "uint8", (E, H, I // 32, 16)), inp("ds", "uint8", (E, H, I // 32))]
    attrs = dict(act=("mul", ("col", 0, 1, I), ("col", I, 1, I)), inter=I, gate_up_bias=False, down_bias=False)
    moe = Node.make("moe_experts_mxfp4", [x, ids, w, *blocks], attrs, [TensorType("float32", (1, H))], None)
    g = Graph("main", (x, ids, w, *blocks), (moe,))
    out, found = ew.int8_activations(g)
    (m,) = [n for n in out.nodes() if n.op == "moe_experts_mxfp4"]
    assert m.attr["int8"] is True and found.patterns == {"int8_activations": 1}
    again, found2 = ew.int8_activations(out)
    assert found2.patterns.get("int8_activations", 0) == 0


@pytest.mark.parametrize("args, needle", [
    (["--int8-activations", "--expert-route", "workspace"], "--int8-activations"),
    (["--int8-activations", "--compute-dtype", "bf16"], "--int8-activations"),
    (["--int8-activations", "--target", "cuda"], "--int8-activations"),
])
def test_bad_options(tmp_path, args, needle):
    assert_compile_refused(tmp_path, args, needle)


@pytest.mark.slow
def test_gpt_oss_int8_decode_within_upstream_bf16(lowprec_tiny, tmp_path):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from dayzero.runtime.executor import load
    from dayzero.tools.driver import compile_model

    ck = lowprec_tiny("gpt_oss", "mxfp4")
    art = tmp_path / "a.dz"
    compile_model(str(ck), art, max_seq=64, max_batch=2, int8_activations=True)
    rep = json.loads((art / "report.json").read_text())
    assert rep["experts"]["int8_activations"] is True
    # the integer tiles are the decode programs' (each of the 2 MoE layers), never the prefill's
    assert rep["experts"]["int8_layers"] == {"decode": 2, "decode_batch": 2}
    rt = load(art)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (1, 24), generator=g)
    P = 8
    pre = rt.prefill(ids[:, :P])[0]
    dec = torch.cat([rt.decode(int(t)).reshape(1, -1) for t in ids[0, P:]])  # logits at positions P..23
    kw = dict(quantization_config=Mxfp4Config(dequantize=True))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(str(ck), dtype=torch.float32, **kw).eval()(
            input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[0]
        ref_bf16 = AutoModelForCausalLM.from_pretrained(str(ck), dtype=torch.bfloat16, **kw).eval()(
            input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[0].float()
    scale = float(ref[P:].abs().max())
    assert float((pre - ref[:P]).abs().max()) <= 1e-5 * scale  # prefill: the exact fp32 tiles
    err = float((dec - ref[P:]).abs().max())
    err_bf16 = float((ref_bf16[P:] - ref[P:]).abs().max())
    # measured: int8 1.07% of max, upstream bf16 1.63%; the integer tiles change decode, they are not a no-op
    assert 1e-4 * scale < err <= err_bf16, (err / scale, err_bf16 / scale)
    assert torch.equal(dec.argmax(-1), ref[P:].argmax(-1))
    # greedy generation: the same tokens as upstream's
    rt.reset(0)
    out = rt.generate(ids[:, :16], 6)
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(str(ck), dtype=torch.float32, **kw).eval().generate(
            ids[:, :16], attention_mask=torch.ones_like(ids[:, :16]), max_new_tokens=6, do_sample=False)[0, 16:]
    assert list(out) == want.tolist()
