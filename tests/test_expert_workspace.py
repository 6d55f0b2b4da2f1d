"""MXFP4 experts through the converted-expert workspace (codegen/kernels/expert_workspace.py,
passes/expert_workspace.py).

- The kernel matches the moe_experts_mxfp4 reference (dequantise as transformers does, then the moe reference) for
  every compute dtype: fp32 and fp8_e4m3 (weights exact in both) to fp32 rounding, bf16 exactly against the
  reference on bf16-rounded activations and within bf16 tolerance of fp32.
- The LRU cache behaves as an independent Python LRU model of the same sequence says (hits, conversions, tags,
  last-use ticks read from the state), stale slots never change the result, and a converted slot holds exactly
  the dequantised expert.
- End to end (slow): tiny gpt-oss with MXFP4 experts compiled with ``--compute-dtype h200`` (bf16 from the spec)
  and an expert cache matches transformers eager on the dequantised weights within bf16 tolerance; the cache
  state persists across calls and requests; the resident bytes are the MXFP4 experts (4.25 bits/weight) plus the
  workspace, never a converted copy of every expert.
- Bad options: one line, exit 2, nothing written.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from click.testing import CliRunner

from dayzero.passes import expert_workspace as ew
from dayzero.passes.ir import reference_dequant as rd
from dayzero.passes.ir import reference_moe as rm
from dayzero.passes.ir.dayzero_ops import workspace_slot_bytes

from _cli import assert_compile_refused

E, H, I, K = 4, 64, 32, 2
ACT = ("mul", ("silu", ("col", 0, 1, I)), ("col", I, 1, I))
STORAGE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float8_e4m3fn": torch.uint8}


def _mx(O, G, seed):
    """Random MXFP4 blocks (every FP4 code) and scales around 2^0 (a realistic exponent spread)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 256, (E, O, G, 16), dtype=torch.uint8, generator=g),
            torch.randint(118, 132, (E, O, G), dtype=torch.uint8, generator=g))


@pytest.fixture(scope="module")
def weights():
    gen = torch.Generator().manual_seed(7)
    gb, gs = _mx(2 * I, H // 32, 1)
    db, ds = _mx(H, I // 32, 2)
    return dict(gb=gb, gs=gs, db=db, ds=ds, bgu=torch.randn(E, 2 * I, generator=gen),
                bd=torch.randn(E, H, generator=gen))


_LIBS = {}


def _kernel(compute_dtype, slots, cache):
    import tvm

    from dayzero.codegen.kernels import expert_workspace as kw
    from dayzero.targets.host import host_target_dict

    key = (compute_dtype, slots, cache)
    if key not in _LIBS:
        f = kw.workspace_func(E, H, 2 * I, I, K, act=ACT, gate_up_bias=True, down_bias=True,
                              compute_dtype=compute_dtype, slots=slots, cache=cache)
        _LIBS[key] = tvm.compile(tvm.IRModule({"main": f}), target=host_target_dict())["main"]
    return _LIBS[key]


class _State:
    def __init__(self, compute_dtype, slots):
        from dayzero.codegen.kernels import expert_workspace as kw

        self.ws = torch.zeros(slots, kw.slot_elems(H, 2 * I, I), dtype=STORAGE[compute_dtype])
        self.meta = torch.zeros(kw.meta_len(slots), dtype=torch.int64)


def _call(lib, st, wt, x, ids, w, layer):
    y = torch.empty_like(x)
    lib(x, ids, w, wt["gb"], wt["gs"], wt["bgu"], wt["db"], wt["ds"], wt["bd"],
        torch.tensor([layer], dtype=torch.int32), st.ws, st.meta, y)
    return y


def _reference(wt, x, ids, w):
    return rm.moe_mxfp4_reference([x, ids, w, wt["gb"], wt["gs"], wt["bgu"], wt["db"], wt["ds"], wt["bd"]],
                                  {"act": ACT, "inter": I, "gate_up_bias": True, "down_bias": True})


def _bf16_reference(wt, x, ids, w):
    """What a bf16 matrix unit computes: both GEMMs' inputs (x, the activation) rounded to bf16, weights exact in
    bf16 (E2M1 x E8M0), fp32 accumulation. Written out token by token, independent of the moe reference."""
    r = lambda t: t.bfloat16().double()  # noqa: E731
    wgu, wd = rd.mxfp4_dequant_ref(wt["gb"], wt["gs"]).double(), rd.mxfp4_dequant_ref(wt["db"], wt["ds"]).double()
    y = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g = wgu[e] @ r(x[t]) + wt["bgu"][e].double()
            a = torch.nn.functional.silu(g[:I]) * g[I:]
            y[t] += float(w[t, j]) * (wd[e] @ r(a.float()) + wt["bd"][e].double())
    return y.float()


def _inputs(T, seed, experts=None):
    g = torch.Generator().manual_seed(seed)
    pool = experts if experts is not None else list(range(E))
    ids = torch.stack([torch.tensor(pool)[torch.randperm(len(pool), generator=g)[:K]] for _ in range(T)])
    return torch.randn(T, H, generator=g), ids, torch.rand(T, K, generator=g)


@pytest.mark.slow  # a heavy kernel build: the end-to-end tier
@pytest.mark.parametrize("cd", ["float32", "float8_e4m3fn", "bfloat16"])
def test_kernel_matches_reference(weights, cd):
    lib = _kernel(cd, 1, False)
    st = _State(cd, 1)
    for T, seed in ((1, 0), (7, 1), (33, 2)):  # decode, remainder tiles, many tokens per expert
        x, ids, w = _inputs(T, seed)
        y = _call(lib, st, weights, x, ids, w, 0)
        ref = _reference(weights, x, ids, w)
        scale = float(ref.abs().max())
        if cd == "bfloat16":
            exact = _bf16_reference(weights, x, ids, w)
            assert float((y - exact).abs().max()) <= 1e-5 * scale, float((y - exact).abs().max()) / scale
            assert float((y - ref).abs().max()) <= 2e-2 * scale
        else:
            assert float((y - ref).abs().max()) <= 1e-5 * scale, (cd, T)
    # no cache: every routed expert of every call was converted, nothing hit
    assert int(st.meta[1]) == 0 and int(st.meta[2]) == int(st.meta[0]) > 0


def _lru_model(calls, slots):
    """Independent model: (hits, conversions, {slot key: last tick}) of an LRU over (layer, expert) keys, each call
    touching its distinct experts in ascending order (one tick per touch)."""
    cache, hits, conv, tick = OrderedDict(), 0, 0, 0
    for layer, experts in calls:
        for e in sorted(set(experts)):
            tick += 1
            key = layer * E + e + 1
            if key in cache:
                hits += 1
                cache.move_to_end(key)
            else:
                conv += 1
                if len(cache) == slots:
                    cache.popitem(last=False)
            cache[key] = tick
    return hits, conv, dict(cache)


@pytest.mark.slow  # a heavy kernel build: the end-to-end tier
@pytest.mark.parametrize("cd", ["float32", "bfloat16"])
def test_lru_cache_hits_and_tags(weights, cd):
    slots = 3
    lib = _kernel(cd, slots, True)
    st = _State(cd, slots)
    # two layers (layer ids 0 and 5) sharing the workspace; a skewed sequence: experts 0, 1 hot
    calls = [(0, [0, 1]), (0, [0, 1]), (5, [0, 1]), (0, [1, 2]), (0, [0, 1]), (5, [3, 0]), (0, [0, 1]),
             (0, [0, 1]), (5, [0, 3])]
    for i, (layer, experts) in enumerate(calls):
        x, ids, w = _inputs(5, 10 + i, experts)
        y = _call(lib, st, weights, x, ids, w, layer)
        ref = _bf16_reference(weights, x, ids, w) if cd == "bfloat16" else _reference(weights, x, ids, w)
        assert float((y - ref).abs().max()) <= 1e-5 * float(ref.abs().max()), i  # stale slots never leak
    hits, conv, live = _lru_model(calls, slots)
    meta = st.meta.tolist()
    assert meta[0] == sum(len(set(e)) for _, e in calls)
    assert (meta[1], meta[2]) == (hits, conv) and hits > 0
    tags, last = meta[4:4 + slots], meta[4 + slots:]
    assert dict(zip(tags, last)) == live
    # a cached slot holds exactly the dequantised expert (gate/up rows then down rows)
    s = tags.index(0 * E + 1 + 1)  # layer 0, expert 1
    want = torch.cat([rd.mxfp4_dequant_ref(weights["gb"][1], weights["gs"][1]).reshape(-1),
                      rd.mxfp4_dequant_ref(weights["db"][1], weights["ds"][1]).reshape(-1)])
    assert torch.equal(st.ws[s].float(), want)


def _two_layer_graph(seq):
    """x -> moe_experts_mxfp4 (blocks "model.layers.1...") -> moe_experts_mxfp4 (blocks "model.layers.0..."): the
    layer numbering must follow the order the nodes run in (graph order), not the blocks' names."""
    from dayzero.passes.ir.node import Graph, Node, TensorType

    def inp(name, dt, shape):
        return Node.make("input", (), {"name": name}, [TensorType(dt, shape)])

    def wt(name, dt, shape):
        return Node.make("weight", (), {"name": name, "zone": "low_precision_weights"}, [TensorType(dt, shape)])
    x, ids, w = inp("x", "float32", (seq, H)), inp("ids", "int64", (seq, K)), inp("w", "float32", (seq, K))
    y = x
    for layer in (1, 0):
        p = f"model.layers.{layer}.mlp.experts."
        ins = [y, ids, w, wt(p + "gate_up_proj_blocks", "uint8", (E, 2 * I, H // 32, 16)),
               wt(p + "gate_up_proj_scales", "uint8", (E, 2 * I, H // 32)),
               wt(p + "down_proj_blocks", "uint8", (E, H, I // 32, 16)),
               wt(p + "down_proj_scales", "uint8", (E, H, I // 32))]
        y = Node.make(ew.OP_IN, ins, {"act": ACT, "inter": I, "gate_up_bias": False, "down_bias": False},
                      [TensorType("float32", (seq, H))])
    return Graph("main", (x, ids, w), (y,), (("seq", 1, 32),))


def test_rewrite_shares_one_workspace_placed_once():
    from dayzero.codegen.kernels import expert_workspace as kw
    from dayzero.codegen.memory import plan_programs
    from dayzero.codegen.program import build_program
    from dayzero.passes.ir.text import make_symbol, parse_graph, print_graph
    from dayzero.passes.ir.verify import verify

    seq = make_symbol("seq")
    g, found = ew.expert_workspace(_two_layer_graph(seq), compute_dtype="bfloat16", cache_bytes=1 << 40)
    verify(g)
    assert print_graph(parse_graph(print_graph(g))) == print_graph(g)
    nodes = [n for n in g.nodes() if n.op == ew.OP]
    assert len(nodes) == 2 and found.patterns["expert_workspace"] == 2
    # run order: the experts named layers.1 first; the keys follow the graph order, not the names
    assert [n.inputs[-3].attr["name"] for n in nodes] == ["expert_workspace.layer0", "expert_workspace.layer1"]
    assert [int(found.constants[n.inputs[-3].attr["name"]][0]) for n in nodes] == [0, 1]
    # one workspace for both layers: state nodes of one name are one buffer (codegen/memory.py)
    assert len({n.inputs[-2].attr["name"] for n in nodes}) == len({n.inputs[-1].attr["name"] for n in nodes}) == 1
    ws, meta = nodes[0].inputs[-2], nodes[0].inputs[-1]
    slots = 2 * E  # a huge budget is capped at the (layer, expert) keys
    assert ws.attr["zone"] == meta.attr["zone"] == "dequant_workspace"
    assert ws.dtype == "bfloat16" and tuple(ws.shape) == (slots, kw.slot_elems(H, 2 * I, I))
    # planned once, beside the weights, not per request slot; the same bytes in every program
    prog = build_program(g, "prefill", {})
    layout = plan_programs([prog], slots=3)
    mem = layout["programs"]["prefill"]
    want = slots * workspace_slot_bytes(H, 2 * I, I, "bfloat16") + -(-kw.meta_len(slots) * 8 // 64) * 64
    assert mem["zones"]["dequant_workspace"] == want and layout["state_stride"] == 0
    offs = {mem["offsets"][b.id] for b in prog.buffers if b.state == ws.attr["name"]}
    assert len(offs) == 1


def test_route_policy():
    # measured (kernel docstring): fp32 without a cache decodes in registers (fused) in every program; a cache or a
    # non-fp32 compute dtype asks every program to read the workspace
    assert ew.route_for(compute_dtype="float32", cache_bytes=0) == "fused"
    assert ew.route_for(compute_dtype="float32", cache_bytes=0, route="workspace") == "workspace"
    assert ew.route_for(compute_dtype="float32", cache_bytes=1 << 20) == "workspace"
    assert ew.route_for(compute_dtype="bfloat16", cache_bytes=0) == "workspace"
    assert ew.route_for(compute_dtype="float32", cache_bytes=0, route="fused") == "fused"
    assert ew.route_for(compute_dtype="float32", cache_bytes=0, target_kind="cuda") == "fused"


def test_spec_compute_dtype():
    from dayzero import UserError
    from dayzero.targets.spec import TargetSpec, load_target_spec
    from dayzero.tools.driver import resolve_compute_dtype

    assert load_target_spec("h200").compute_dtype == "bf16"
    assert load_target_spec("example_accel_64gb").compute_dtype == "fp8_e4m3"
    assert resolve_compute_dtype(None, {"kind": "llvm"}) == "fp32"  # the host computes in fp32
    assert resolve_compute_dtype("h200", {"kind": "llvm"}) == "bf16"
    base = {"name": "x", "memory_bytes": 10, "mem_bandwidth_gbps": 1, "native_dtypes": ["fp32"],
            "fp4_compute": False}
    assert TargetSpec.from_dict(base).compute_dtype == "fp32"
    with pytest.raises(UserError, match="compute_dtype"):
        TargetSpec.from_dict(dict(base, compute_dtype="bf16"))  # not native
    with pytest.raises(UserError, match="compute_dtype"):
        TargetSpec.from_dict(dict(base, compute_dtype="fp16"))


@pytest.mark.parametrize("args, needle", [
    (["--expert-cache", "lots"], "--expert-cache"),
    (["--compute-dtype", "fp16"], "--compute-dtype"),
    (["--expert-route", "fused", "--expert-cache", "1MiB"], "fused"),
    (["--expert-route", "workspace", "--target", "cuda"], "host CPU only"),
])
def test_bad_options(tmp_path, args, needle):
    assert_compile_refused(tmp_path, args, needle)


@pytest.mark.slow
def test_gpt_oss_bf16_workspace_with_cache(tmp_path):
    import json

    import numpy as np
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from dayzero.codegen.kernels import expert_workspace as kw
    from dayzero.runtime.executor import load
    from dayzero.tools.cli import main
    from dayzero.tools.make_tiny import make_tiny

    ck = make_tiny("gpt_oss", tmp_path / "ck", experts="mxfp4", seed=0)
    cfg = json.loads((ck / "config.json").read_text())
    Hm, Im, Em = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"]
    slot = workspace_slot_bytes(Hm, 2 * Im, Im, "bfloat16")
    art = tmp_path / "a.dz"
    r = CliRunner().invoke(main, ["compile", str(ck), "-o", str(art), "--max-seq", "64", "--max-batch", "2",
                                  "--compute-dtype", "h200", "--expert-cache", str(6 * slot)])
    assert r.exit_code == 0, r.output
    rep = json.loads((art / "report.json").read_text())
    assert rep["experts"]["compute_dtype"] == "bf16"
    # every program takes the workspace route, the batched decode step (decode_batch) included
    ws = ["moe_experts_mxfp4_ws"]
    assert rep["experts"]["routes"] == {"prefill": ws, "prefill_last": ws, "decode": ws, "decode_batch": ws}
    zones = rep["programs"]["prefill"]["memory"]["zones"]
    # resident: MXFP4 experts as stored (4.25 bits per weight) + 6 bf16 slots + the bookkeeping, nothing else
    n_w = cfg["num_hidden_layers"] * Em * (2 * Im * Hm + Hm * Im)
    assert 4.25 <= zones["low_precision_weights"] * 8 / n_w < 4.3
    assert zones["dequant_workspace"] == 6 * slot + -(-kw.meta_len(6) * 8 // 64) * 64
    assert zones["dequant_workspace"] < n_w * 2 / cfg["num_hidden_layers"]  # < one layer's experts in bf16
    shown = CliRunner().invoke(main, ["report", str(art)])
    assert shown.exit_code == 0 and f"{zones['dequant_workspace']:,} B workspace" in shown.output, shown.output

    m = AutoModelForCausalLM.from_pretrained(str(ck), quantization_config=Mxfp4Config(dequantize=True),
                                             dtype=torch.float32).eval()
    rt = load(art)
    prog = rt.programs["prefill"]
    (meta_id,) = [b for n, b in prog.shared_states.items() if n.startswith("expert_cache.")]

    def meta():
        return prog.view(meta_id, ()).tolist()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (1, 16), generator=gen)
    with torch.no_grad():
        ref = m(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
    got = rt.prefill(ids)
    err = float((got - ref).abs().max())
    assert err <= 2e-2 * float(ref.abs().max()), err  # bf16 inputs to the expert GEMMs
    first = meta()
    assert first[0] > 0 and first[1] + first[2] == first[0]
    # a one-token prompt routes 2 experts in each of the 2 layers (4 keys <= 6 slots); the same prompt again, as
    # a new request: the cache survives the request reset and all 4 hit, nothing is converted again
    rt.reset(0)
    one = rt.prefill(ids[:, :1])
    before = meta()
    rt.reset(0)
    again = rt.prefill(ids[:, :1])
    assert torch.equal(again, one)
    second = meta()
    assert (second[0] - before[0], second[1] - before[1], second[2] - before[2]) == (4, 4, 0)
    # decode reads the same workspace (the cache persists across programs); greedy tokens as upstream's
    rt.reset(0)
    out = rt.generate(ids, 8)
    with torch.no_grad():
        want = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)[0, 16:]
    assert np.array_equal(np.asarray(out).reshape(-1), want.numpy()), (out, want)
    assert meta()[0] > second[0]
    # two requests in flight (two KV-cache slots, one shared workspace): each gets the tokens it gets alone
    from dayzero.runtime import generate_batch

    other = torch.randint(0, 256, (1, 5), generator=gen)
    alone = rt.generate(other, 4)
    res = generate_batch(rt, [ids, other], max_new_tokens=4)
    assert [r["tokens"] for r in res] == [list(out[:4]), list(alone)], res
