"""FP8-block routed experts (DeepSeek layout) resident as FP8, dequantised inside the fused moe kernel.

Spec:
- Published layout: each expert's gate / up / down is its own [out, in] float8_e4m3fn tensor with its own
  ``weight_scale_inv`` fp32 [ceil(out/128), ceil(in/128)]; transformers stacks them into [E, 2I, H] / [E, H, I].
  The loader binds the FP8 bytes element for element and re-expresses the scales per block of g rows of the
  stacked parameter (g = 128 for full-size experts: the published scales one to one; g = 32 for a tiny model's
  32-row experts, which straddle a 128-row block). Replaying the learned copy runs and decoding with
  scale[.., r // g, c // 128] gives exactly (bit for bit) each key's own DeepSeek dequantisation.
- The frontend's FP8 chain for such a parameter is recognised by shape (block factors read from the repeats) and
  computes the same values.
- moe_experts_fp8's kernel (E4M3 x block scale decoded in registers) matches its reference (dequantise, then the
  moe reference) on random bytes covering every finite E4M3 code, layouts nk and kn, row blocks below 128, for a
  decode-sized (1 token) and a prefill-sized call; it compiles for CUDA sm_90.
- slow: tiny Qwen3-MoE written by ``make-tiny --experts fp8`` (DeepSeek's published FP8 layout, as Qwen3's own
  FP8 releases use it) compiles with every MoE layer on the fused moe_experts_fp8 kernel (hand-scheduled, listed
  by ``dayzero report``), experts resident at ~1 byte per weight (zone low_precision_weights), prefill logits
  match the upstream eager model on the dequantised weights, and greedy decoding matches upstream ``generate``.
  The same checkpoint feeds the bad-checkpoint cases below. DeepSeek with this layout runs end to end in the demo
  (tests/test_demo.py: tiny DeepSeek-V4, FP8 experts, equal to transformers' own FP8 loader).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from dayzero.frontend import checkpoint as ck
from dayzero.frontend import lowprec
from dayzero.passes import dequant as dq
from dayzero.passes.ir import interp  # noqa: F401
from dayzero.passes.ir import ops
from dayzero.passes.ir import reference_dequant as rd
from dayzero.passes.ir import reference_moe as rm

from _dequant_chain import dequant_graph
from _lowprec_ref import assert_prefill_matches, check_fused_experts, compile_fails, dequantized_upstream, \
    rewrite_checkpoint


def _random_fp8(shape, block, seed):
    """Random E4M3 bytes (every finite code; the NaN codes 0x7F / 0xFF replaced) and power-of-two-ish scales."""
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, shape, dtype=np.uint8)
    b[(b & 0x7F) == 0x7F] ^= 1
    sh = (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))
    s = (rng.uniform(0.5, 1.0, sh) * np.exp2(rng.integers(-10, 3, sh))).astype(np.float32)
    return torch.from_numpy(b).view(torch.float8_e4m3fn), torch.from_numpy(s)


# ---- loader: scales re-expressed per row block --------------------------------------------------------------

def _groups(keys: dict) -> dict:
    return {k: ck.LowPrecGroup(k, "fp8", k, k + "_scale_inv", tuple(w.shape), False) for k, (w, _) in keys.items()}


def _replay(runs, tensors: dict, numel: int, dtype) -> torch.Tensor:
    out = torch.full((numel,), float("nan"), dtype=torch.float32) if dtype == torch.float32 else \
        torch.zeros(numel, dtype=dtype)
    for d0, key, s0, n in runs:
        out[d0:d0 + n] = tensors[key].reshape(-1)[s0:s0 + n]
    return out


def _stacked_per_expert(E, I, H, seed=0):
    """E experts' gate / up [I, H] as their own FP8 keys, stacked like transformers' gate_up_proj [E, 2I, H]."""
    keys, runs = {}, []
    for e in range(E):
        for j, part in enumerate(("gate", "up")):
            k = f"experts.{e}.{part}_proj.weight"
            keys[k] = _random_fp8((I, H), (128, 128), seed + 2 * e + j)
            runs.append(((2 * e + j) * I * H, k, 0, I * H))
    return keys, runs, (E, 2 * I, H)


def _stacked_fused(E, R, C, seed=0):
    """One fused [E, R, C] FP8 key with per-expert [E, ceil(R/128), ceil(C/128)] scales, bound whole."""
    keys = {"experts.gate_up_proj": _random_fp8((E, R, C), (128, 128), seed)}
    return keys, [(0, "experts.gate_up_proj", 0, E * R * C)], (E, R, C)


@pytest.mark.parametrize("case,g", [
    (lambda: _stacked_per_expert(4, 32, 64), 32),     # tiny model: 32-row experts straddle a 128-row block
    (lambda: _stacked_per_expert(2, 256, 200), 128),  # full-size-like: the published scales one to one
    (lambda: _stacked_per_expert(3, 48, 64), 16),     # 48-row experts
    (lambda: _stacked_fused(3, 200, 96), 128),        # a fused [E, R, C] key, partial edge blocks
])
def test_scales_rebound_per_row_block_are_exact(case, g):
    keys, runs, shape = case()
    p = ck._fp8_param("p", runs, _groups(keys), shape[-2], shape[-1])
    assert p.row_block == g
    numel = int(np.prod(shape))
    data = {k: w.view(torch.uint8) for k, (w, _) in keys.items()}
    scales = {k + "_scale_inv": s for k, (_, s) in keys.items()}
    wq = _replay(p.data_runs, data, numel, torch.uint8).view(torch.float8_e4m3fn).reshape(shape)
    sshape = ck.fp8_scale_shape(shape, g)
    s = _replay(p.scale_runs, scales, int(np.prod(sshape)), torch.float32).reshape(sshape)
    assert not s.isnan().any()  # every scale element written
    got = rd.fp8_blocks_dequant_ref(wq, s, (g, 128))
    # the reference: each checkpoint key dequantised on its own by DeepSeek's rule, then stacked as transformers does
    want = torch.cat([lowprec.dequant_fp8_block(w, sc).reshape(-1) for w, sc in keys.values()]).reshape(shape)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    if g == 128:  # no copy per row block: one scale run per key (merged when contiguous)
        assert len(p.scale_runs) <= len(keys)


# ---- the frontend chain and its match -----------------------------------------------------------------------

@pytest.mark.parametrize("shape,g", [((4, 64, 64), 32), ((4, 64, 32), 128), ((3, 48, 200), 16)])
def test_chain_is_recognised_and_exact(shape, g):
    sshape = ck.fp8_scale_shape(shape, g)
    graph = dequant_graph("fp8", False, ("float8_e4m3fn", shape), ("float32", sshape), g)
    m = dq.match_fp8_blocks(graph.outputs[0])
    assert m is not None and m[0].op == "input" and m[1].op == "input" and m[2:] == (g, 128)
    w, s = _random_fp8(shape, (g, 128), 5)
    vals = {}
    for n in graph.nodes():
        vals[id(n)] = {"weight": w, "scale_inv": s}[n.attr["name"]] if n.op == "input" else \
            ops.get(n.op).call([vals[id(i)] for i in n.inputs], n.attr)
    got = vals[id(graph.outputs[0])]
    want = rd.fp8_blocks_dequant_ref(w, s, (g, 128))
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    if g == 128 and len(shape) == 3:  # per expert exactly lowprec's DeepSeek dequantisation
        assert torch.equal(want[1], lowprec.dequant_fp8_block(w[1], s[1]))


# ---- the kernel ----------------------------------------------------------------------------------------------

E, H, I, K_TOP = 4, 64, 32, 2
ACT = ("mul", ("silu", ("col", 0, 1, I)), ("col", I, 1, I))


def _kernel_case(layout, gate_up_block, down_block, target_kind="llvm"):
    from dayzero.codegen.kernels import moe as km

    return km.moe_experts_func(E, H, 2 * I, I, K_TOP, layout=layout, act=ACT, gate_up_bias=True, down_bias=False,
                               wfmt="fp8", gate_up_block=gate_up_block, down_block=down_block,
                               target_kind=target_kind)


@pytest.mark.slow  # a heavy kernel build: the end-to-end tier
@pytest.mark.parametrize("layout,gub,db,wide", [("nk", (32, 128), (128, 128), False),
                                                ("kn", (128, 16), (16, 128), False),
                                                ("nk", (32, 128), (128, 128), True)])
def test_moe_fp8_kernel_matches_reference(layout, gub, db, wide, monkeypatch):
    """wide: the stacks declared with int64 dimensions, as a stack past int32 elements is (DeepSeek-V3.2's FP8
    gate_up, 256 x 4096 x 7168: its flattened index overflowed int32 and TVM refused the literal)."""
    import tvm

    from dayzero.codegen.kernels import moe as km
    from dayzero.targets.host import host_target_dict

    if wide:
        monkeypatch.setattr(km, "WIDE_ELEMENTS", 1)
        km.moe_experts_func.cache_clear()  # its cache may hold the int32 build of the same parameters
    func = _kernel_case(layout, gub, db)
    if wide:
        km.moe_experts_func.cache_clear()  # nor may later tests get the int64 build
    assert ("GB: T.Buffer((T.int64(4), T.int64(64), T.int64(64))" in func.script()) == wide
    lib = tvm.compile(tvm.IRModule({"main": func}), target=host_target_dict())["main"]
    gu_shape, d_shape = ((E, 2 * I, H), (E, H, I)) if layout == "nk" else ((E, H, 2 * I), (E, I, H))
    gq, gs = _random_fp8(gu_shape, gub, 2)
    dq_, ds = _random_fp8(d_shape, db, 3)
    gen = torch.Generator().manual_seed(1)
    bgu = torch.randn(E, 2 * I, generator=gen)
    for tokens in (1, 13):  # the decode tile and the prefill tiles (4-token, 2-token and 1-token remainders)
        x = torch.randn(tokens, H, generator=gen)
        ids = torch.stack([torch.randperm(E, generator=gen)[:K_TOP] for _ in range(tokens)])
        w = torch.rand(tokens, K_TOP, generator=gen)
        y = torch.empty(tokens, H)
        lib(x, ids, w, gq, gs, bgu, dq_, ds, y)
        ref = rm.moe_fp8_reference([x, ids, w, gq, gs, bgu, dq_, ds], {
            "act": ACT, "inter": I, "layout": layout, "gate_up_bias": True, "down_bias": False,
            "gate_up_block": gub, "down_block": db})
        err = float((y - ref).abs().max())
        assert err <= 1e-5 * float(ref.abs().max()), (tokens, err)


@pytest.mark.slow
def test_moe_fp8_node_kernel_compiles_for_sm90():
    """The node's kernel (the parameters the dequant pass records) rebuilt by the schedule rule for CUDA."""
    import tvm

    from dayzero.codegen import schedule
    from dayzero.codegen.kernels import moe as km
    from dayzero.codegen.program import Kernel
    from dayzero.passes.ir.node import Node, TensorType

    def inp(name, dtype, shape):
        return Node.make("input", (), {"name": name}, [TensorType(dtype, shape)])
    ins = [inp("x", "float32", (5, H)), inp("ids", "int64", (5, K_TOP)), inp("w", "float32", (5, K_TOP)),
           inp("guw", "float8_e4m3fn", (E, 2 * I, H)), inp("gus", "float32", (E, 2, 1)),
           inp("dw", "float8_e4m3fn", (E, H, I)), inp("ds", "float32", (E, 1, 1))]
    n = Node.make(dq.OP_MOE_FP8, ins, dict(layout="nk", act=ACT, inter=I, gate_up_bias=False, down_bias=False,
                                           gate_up_block=(32, 128), down_block=(128, 128)),
                  [TensorType("float32", (5, H))])
    f = km.prim_func_fp8(n).with_attr("global_symbol", "k")
    target = {"kind": "cuda", "arch": "sm_90"}
    mod = schedule.schedule_kernel(Kernel("k", dq.OP_MOE_FP8, f, "key"), tvm.target.Target(target), None)
    lib = tvm.compile(mod, target=target)
    src = lib.mod.imports[0].inspect_source()
    assert "__global__" in src


# ---- end to end (slow) -------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_tiny_qwen3_moe_with_fp8_experts_runs_on_the_fused_kernel(lowprec_compiled):
    from dayzero.tools.cli import main

    ckpt, art, report = lowprec_compiled("qwen3_moe", "fp8")  # compiled once per session (conftest)
    check_fused_experts(report, ckpt, "moe_experts_fp8", (1.0, 1.03))  # fp8 bytes + block scales (+ alignment)
    shown = CliRunner().invoke(main, ["report", str(art)])
    assert shown.exit_code == 0 and "moe_experts_fp8" in shown.output and "hand-scheduled" in shown.output


@pytest.mark.slow
def test_tiny_qwen3_moe_with_fp8_experts_matches_eager(lowprec_compiled, tmp_path):
    from dayzero.runtime.executor import load

    ckpt, art, _ = lowprec_compiled("qwen3_moe", "fp8")
    ref = dequantized_upstream(ckpt, tmp_path)
    rt = load(art)
    gen = assert_prefill_matches(rt, ref, (1, 16, 40))
    prompt = torch.randint(0, 256, (9,), generator=gen).tolist()
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 9, dtype=torch.long),
                           max_new_tokens=12, do_sample=False)
    assert rt.generate(prompt, 12) == out[0, 9:].tolist()


# ---- bad FP8 checkpoints through `dayzero compile` ----------------------------------------------------------------

KEY = "model.layers.0.mlp.experts.3.up_proj.weight"


@pytest.mark.parametrize("fn,needles", [
    (lambda t: t[KEY + "_scale_inv"].fill_(float("nan")), (KEY + "_scale_inv", "NaN/Inf")),
    (lambda t: t[KEY + "_scale_inv"].fill_(float("inf")), (KEY + "_scale_inv", "NaN/Inf")),
    (lambda t: t.update({KEY + "_scale_inv": torch.ones(2, 1)}), (KEY, "weight_scale_inv", "[1, 1]")),
    (lambda t: t.pop(KEY + "_scale_inv"), (KEY, "without its block scales")),
])
def test_bad_fp8_checkpoint_is_one_line_exit_2(lowprec_tiny, tmp_path, fn, needles):
    ckpt = rewrite_checkpoint(lowprec_tiny("qwen3_moe", "fp8"), tmp_path / "ck", fn)
    compile_fails(ckpt, tmp_path / "out", *needles)
