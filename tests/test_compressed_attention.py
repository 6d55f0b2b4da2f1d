"""compressed_attention: DeepSeek-V4's CSA and HCA attention is recognised on every compressed layer of the traced
upstream graphs (prefill and decode), the op's reference equals upstream's dense eager attention, and the kernels
equal the reference while never reading a row a query does not see (those rows hold NaN).

End-to-end token equality with upstream generate() is tests/test_generate.py (deepseek_v4) and
tests/test_compare.py; the eager fixed-size cache is tests/test_decode_export.py.
"""

from __future__ import annotations

import json

import pytest
import torch
import tvm

from dayzero.codegen.kernels import compressed_attention as kern
from dayzero.passes import compressed_attention as ca
from dayzero.passes.ir import reference_attention as ra
from dayzero.passes.ir.ops import get as op_def

HOST = {"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu()}
from conftest import SHARED_MAX_SEQ as MAX_SEQ  # the shared artifacts' length: their traces are reused


# ---- the pattern on the traced upstream graphs ---------------------------------------------------------------

@pytest.fixture(scope="module")
def v4_programs(tmp_path_factory):
    from dayzero.tools.compiler import run_pipeline
    from dayzero.tools.driver import trace_model
    from dayzero.tools.make_tiny import make_tiny

    ckpt = make_tiny("deepseek_v4", tmp_path_factory.mktemp("v4") / "ckpt", seed=0)
    fe = trace_model(str(ckpt), MAX_SEQ)
    cfg = json.loads((ckpt / "config.json").read_text())
    return cfg, {"prefill": run_pipeline(fe.traced.graph, verify=True),
                 "decode": run_pipeline(fe.decode.graph, verify=True)}


@pytest.mark.slow
@pytest.mark.parametrize("which", ["prefill", "decode"])
def test_pattern_fires_on_every_compressed_layer(v4_programs, which):
    cfg, progs = v4_programs
    g, found = progs[which]
    types = cfg["layer_types"]
    n_csa, n_hca = types.count("compressed_sparse_attention"), types.count("heavily_compressed_attention")
    assert n_csa and n_hca
    nodes = [n for n in g.nodes() if n.op == ca.OP]
    assert found.patterns.get(f"{ca.OP}.csa") == n_csa and found.patterns.get(f"{ca.OP}.hca") == n_hca
    assert len(nodes) == n_csa + n_hca
    rates = cfg["compress_rates"]
    for n in nodes:
        q, kv, qpos, ent, sinks = n.inputs[:5]
        assert (q.shape[2] == 1) == (which == "decode")
        assert n.attr["window"] == cfg["sliding_window"] and n.attr["idx"] != n.attr["epos"]
        # the operands are the caches themselves (every position / every entry row), never a concatenation
        assert kv.op == "state_index_put" and tuple(kv.shape) == (1, 1, MAX_SEQ, cfg["head_dim"])
        assert ent.op == "unsqueeze" and ent.inputs[0].op == "state_index_put"
        assert ent.inputs[0].inputs[0].op == "state"
        assert sinks.op == "weight" and sinks.attr["name"].endswith("sinks")
        if n.attr["idx"]:  # CSA: the indexer's top-k (k = index_topk), E = ceil(L / m) + the scratch row
            assert ent.shape[2] == -(-MAX_SEQ // rates["compressed_sparse_attention"]) + 1
            assert n.inputs[5].shape[-1] == cfg["index_topk"] and n.inputs[5].dtype == "int64"
        else:  # HCA: the causal rule at rate m'
            assert ent.shape[2] == -(-MAX_SEQ // rates["heavily_compressed_attention"]) + 1
            assert n.attr["rate"] == rates["heavily_compressed_attention"] and n.inputs[5].dtype == "int64"
    # the CSA indexer is one dsa_indexer_topk over its compressed keys (the state itself) at the CSA rate: no
    # per-head score over every entry row is left
    rate = rates["compressed_sparse_attention"]
    ix = [n for n in g.nodes() if n.op == "dsa_indexer_topk"]
    assert found.patterns.get("sparse_attention.dsa_indexer_topk") == len(ix) == n_csa
    for n in ix:
        assert n.attr["rate"] == rate and n.attr["k"] == cfg["index_topk"]
        assert n.inputs[2].op == "state_index_put" and n.inputs[2].shape[1] == -(-MAX_SEQ // rate) + 1
    assert not [m for m in g.nodes() if m.op in ("bmm", "relu") and m.shape[-1] == -(-MAX_SEQ // rate) + 1]
    # nothing dense over the L + E rows is left: no softmax, no scatter of the block bias, no cat of the caches
    total = {MAX_SEQ + n.inputs[3].shape[2] for n in nodes}
    assert not [m for m in g.nodes() if m.op in ("softmax.int", "_softmax") and m.shape[-1] - 1 in total]
    assert not [m for m in g.nodes() if m.op == "scatter.value"]
    assert not [m for m in g.nodes() if m.op == "cat" and m.type.ndim == 4 and m.shape[2] in total]


@pytest.mark.slow
def test_pattern_fires_when_the_position_arange_is_too_long_to_fold(tmp_path_factory, monkeypatch):
    """At a long --max-seq (1M) the mask's arange(L) is longer than fold_constants folds (MAX_ELEMENTS), so it
    stays an ``arange.start_step`` node (plus a zero offset, under views): the attention patterns still fire, else
    prefill attends densely over all L rows (bmm [.., chunk, L + E]). Shrinking MAX_ELEMENTS below L = 128 gives
    the same graph without a 1M-row trace."""
    from dayzero.passes import fold_constants
    from dayzero.tools.compiler import run_pipeline
    from dayzero.tools.driver import trace_model
    from dayzero.tools.make_tiny import make_tiny

    ckpt = make_tiny("deepseek_v4", tmp_path_factory.mktemp("v4long") / "ckpt", seed=0)
    fe = trace_model(str(ckpt), MAX_SEQ)
    monkeypatch.setattr(fold_constants, "MAX_ELEMENTS", 16)
    cfg = json.loads((ckpt / "config.json").read_text())
    types = cfg["layer_types"]
    for graph in (fe.traced.graph, fe.decode.graph):  # the mask's positions: an arange of L rows (not folded)
        assert any(n.op == "arange.start_step" and n.attr.get("end") == MAX_SEQ for n in graph.nodes())
        g, found = run_pipeline(graph, verify=True)
        assert found.patterns.get(f"{ca.OP}.csa") == types.count("compressed_sparse_attention")
        assert found.patterns.get(f"{ca.OP}.hca") == types.count("heavily_compressed_attention")
        assert found.patterns.get("sparse_attention.cache_attention") == types.count("sliding_attention")
        assert found.patterns.get("sparse_attention.dsa_indexer_topk") == types.count("compressed_sparse_attention")
        assert not [m for m in g.nodes() if m.op == "bmm" and MAX_SEQ in m.shape[-1:]]


@pytest.mark.slow
def test_compiled_programs_run_the_hand_scheduled_kernel(tiny_compiled):
    """In the compiled tiny V4 artifact (the session's shared one), every CSA and HCA layer of the prefill and the
    decode program is one compressed_attention step, and every CSA indexer one dsa_indexer_topk step, through
    the hand-scheduled kernels."""
    ckpt, art, report = tiny_compiled("deepseek_v4")
    types = json.loads((ckpt / "config.json").read_text())["layer_types"]
    n = types.count("compressed_sparse_attention") + types.count("heavily_compressed_attention")
    progs = json.loads((art / "program.json").read_text())["programs"]
    for name in ("prefill", "decode"):
        for op, count in ((ca.OP, n), ("dsa_indexer_topk", types.count("compressed_sparse_attention"))):
            steps = [s for s in progs[name]["steps"] if report["kernel_ops"][s["kernel"]] == op]
            assert len(steps) == count, (name, op)
            assert {report["routes"][s["kernel"]] for s in steps} == {"hand-scheduled"}
    assert report["patterns"][f"{ca.OP}.csa"] == types.count("compressed_sparse_attention")
    assert report["patterns"][f"{ca.OP}.hca"] == types.count("heavily_compressed_attention")


# ---- the reference is upstream's eager attention -------------------------------------------------------------

def _case(B, H, Hkv, S, start, L, E, D, K, R, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, D, generator=g)
    kv, ent = torch.randn(B, Hkv, L, D, generator=g), torch.randn(B, Hkv, E, D, generator=g)
    sinks = torch.randn(H, generator=g)
    qpos = torch.arange(S) + start
    # CSA: upstream's indexer output after its causal rule, per (b, s): distinct valid entries, -1 past them,
    # then the compressor's `where(valid, idx, E)`
    idx = torch.full((B, S, K), E, dtype=torch.int64)
    for b in range(B):
        for s in range(S):
            valid = (int(qpos[s]) + 1) // R
            pick = torch.randperm(max(valid, 1), generator=g)[:min(K, valid)]
            idx[b, s, :len(pick)] = pick
            idx[b, s] = idx[b, s][torch.randperm(K, generator=g)]
    return q, kv, ent, sinks, qpos, idx


def _upstream(q, kv, ent, sinks, bias, scale):
    """transformers' DeepSeek-V4 eager attention over cat([kv, entries]) with the additive mask ``bias``."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import eager_attention_forward

    mod = torch.nn.Module()
    mod.sinks = torch.nn.Parameter(sinks)
    mod.num_key_value_groups = q.shape[1] // kv.shape[1]
    x = torch.cat([kv, ent], dim=2)
    out, _ = eager_attention_forward(mod, q, x, x, bias, scaling=scale)
    return out.transpose(1, 2)


def _window_bias(L, qpos, W):
    j = torch.arange(L)
    ok = (j[None] <= qpos[:, None]) & (j[None] > qpos[:, None] - W)
    return torch.where(ok, 0.0, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("csa", [True, False])
def test_reference_equals_upstream_eager(csa):
    B, H, Hkv, S, start, L, E, D, K, R, W = 2, 4, 1, 9, 3, 32, 9, 16, 3, 4, 8
    q, kv, ent, sinks, qpos, idx = _case(B, H, Hkv, S, start, L, E, D, K, R, seed=1)
    if csa:  # upstream: full(-inf) [B,1,S,E+1], 0 scattered at the indices, sliced to E
        block = torch.full((B, 1, S, E + 1), float("-inf")).scatter_(-1, idx.unsqueeze(1), 0.0)[..., :E]
    else:  # upstream HCA: entry e >= (p + 1) // R -> -inf
        block = torch.zeros(B, 1, S, E).masked_fill(
            torch.arange(E).view(1, 1, 1, -1) >= ((qpos + 1) // R).view(1, 1, -1, 1), float("-inf"))
    bias = torch.cat([_window_bias(L, qpos, W)[None, None].expand(B, 1, S, L), block], dim=-1)
    ref = _upstream(q, kv, ent, sinks, bias, 0.3)
    attrs = {"scale": 0.3, "window": W, "rate": 0 if csa else R, "idx": csa, "epos": not csa}
    got = ra.compressed_reference([q, kv, qpos, ent, sinks, idx if csa else qpos], attrs)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


# ---- kernels vs the reference --------------------------------------------------------------------------------

def _params(csa, B, H, Hkv, S, L, E, D, K, R, W):
    p = dict(op=ca.OP, B=B, H=H, Hkv=Hkv, S=S if S == 1 else None, L=L, E=E, D=D, dtype="float32",
             kv_dtype="float32", ent_dtype="float32", out_dtype="float32", pos_dtype="int64", sink_dtype="float32",
             scale=0.3, window=W, rate=0 if csa else R)
    p.update(K=K, idx_dtype="int64") if csa else p.update(epos_dtype="int64")
    return p


def _run(p, ins):
    lib = tvm.compile(tvm.IRModule({"main": kern.build(p, "llvm")}), target=HOST)
    o = torch.full(tuple(ins[0].shape), float("nan"))
    lib["main"](*ins, o)
    return o


CASES = [  # B, H, Hkv, S, start, L, E, K, R, W
    (1, 4, 1, 1, 0, 64, 17, 2, 4, 8),     # first decode step: one window row, no valid entry
    (1, 4, 1, 1, 37, 64, 17, 2, 4, 8),    # decode mid-cache: rows 30..37, entries < 9
    (2, 4, 1, 1, 63, 64, 17, 4, 4, 8),    # last row, batch 2 (each batch row its own indices)
    (1, 8, 2, 1, 20, 64, 9, 3, 8, 0),     # GQA, unbounded window
    (1, 4, 1, 29, 0, 64, 17, 2, 4, 8),    # prefill from position 0
    (2, 8, 2, 23, 17, 64, 17, 4, 4, 8),   # prefill after a cached prefix, GQA (head groups of 4), batch 2
    (1, 32, 1, 5, 50, 64, 9, 3, 8, 5),    # 32 heads on one kv head: groups of 16
    (1, 4, 1, 37, 90, 256, 70, 2, 2, 8),  # HCA over several 16-entry tiles, each query its own last one
]


@pytest.mark.parametrize("csa", [True, False], ids=["csa", "hca"])
@pytest.mark.parametrize("B,H,Hkv,S,start,L,E,K,R,W", CASES)
def test_kernel_matches_reference_reading_only_visible_rows(csa, B, H, Hkv, S, start, L, E, K, R, W):
    D = 48 if H >= 8 else 16  # the GQA cases score over three 16-lane vectors (the kernels' vector dot products)
    q, kv, ent, sinks, qpos, idx = _case(B, H, Hkv, S, start, L, E, D, K, R, seed=S * 7 + start + H)
    if csa:  # out-of-range indices are skipped: -1 and past E' (upstream's E and scratch columns)
        idx[0, 0, 0] = -1 if K > 2 else idx[0, 0, 0]
    attrs = {"scale": 0.3, "window": W, "rate": 0 if csa else R, "idx": csa, "epos": not csa}
    ins = [q, kv, qpos, ent, sinks, idx if csa else qpos.clone()]
    ref = ra.compressed_reference(ins, attrs)
    assert torch.isfinite(ref).all()
    # every row no query of the call sees holds NaN: one read of any of them would poison the output
    seen_kv = ra.valid_positions(L, qpos, W).any(0)
    seen_ent = ra.entry_selection(attrs, B, S, E, idx if csa else None, None if csa else qpos).any(1)  # [B, E]
    kv[:, :, ~seen_kv] = float("nan")
    for b in range(B):
        ent[b, :, ~seen_ent[b]] = float("nan")
    assert bool(torch.isnan(ent).any()) or bool(seen_ent.all())
    got = _run(_params(csa, B, H, Hkv, S, L, E, D, K, R, W), ins)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("csa", [True, False], ids=["csa", "hca"])
def test_per_row_kernel_gives_each_row_its_own_position(csa):
    """The row-batched decode step (per_row): one query per batch row, row b at positions[b], B symbolic (one
    kernel for every batch size). Each row equals upstream's eager attention of that request alone, and the op's
    reference agrees; rows no query sees are NaN."""
    H, Hkv, L, E, D, K, R, W = 4, 1, 64, 17, 16, 2, 4, 8
    pos = torch.tensor([0, 37, 7, 63, 20])
    B = len(pos)
    attrs = {"scale": 0.3, "window": W, "rate": 0 if csa else R, "idx": csa, "epos": not csa, "per_row": True}
    p = _params(csa, B, H, Hkv, 1, L, E, D, K, R, W)
    p.update(B=None, per_row=True)
    lib = tvm.compile(tvm.IRModule({"main": kern.build(p, "llvm")}), target=HOST)
    rows = [_case(1, H, Hkv, 1, int(s), L, E, D, K, R, seed=int(s)) for s in pos]
    q, kv, ent = (torch.cat([r[k] for r in rows]) for k in range(3))
    idx = torch.cat([r[5] for r in rows])
    sinks = rows[0][3]
    want = []
    for b, s in enumerate(pos.tolist()):
        qp = torch.tensor([s])
        if csa:
            block = torch.full((1, 1, 1, E + 1), float("-inf")).scatter_(-1, idx[b:b + 1].unsqueeze(1), 0.0)[..., :E]
        else:
            block = torch.zeros(1, 1, 1, E).masked_fill(torch.arange(E).view(1, 1, 1, -1) >= (s + 1) // R,
                                                        float("-inf"))
        bias = torch.cat([_window_bias(L, qp, W)[None, None], block], dim=-1)
        want.append(_upstream(q[b:b + 1], kv[b:b + 1], ent[b:b + 1], sinks, bias, 0.3))
    want = torch.cat(want)
    ins = [q, kv, pos, ent, sinks, idx if csa else pos.clone()]
    torch.testing.assert_close(op_def(ca.OP).call(ins, attrs), want, rtol=1e-5, atol=1e-6)
    for b, s in enumerate(pos.tolist()):  # what row b does not see is NaN
        kv[b, :, ~ra.valid_positions(L, torch.tensor([s]), W)[0]] = float("nan")
    for n in (B, 1):
        o = torch.full((n, H, 1, D), float("nan"))
        lib["main"](*[x[:n] if x is not sinks else x for x in ins], o)
        torch.testing.assert_close(o, want[:n], rtol=1e-5, atol=1e-5)


def _held(full: torch.Tensor, pos: torch.Tensor, W: int) -> torch.Tensor:
    """[B, H, L, D] -> [B, H, W, D]: row b's window ending at pos[b] (row j at position pos[b] - (W-1) + j),
    positions before 0 NaN (the kernel must not read them)."""
    at = pos.view(-1, 1) - (W - 1) + torch.arange(W)
    out = torch.stack([full[b][:, at[b].clamp(min=0)] for b in range(len(pos))])
    out[(at < 0).nonzero(as_tuple=True)[0], :, (at < 0).nonzero(as_tuple=True)[1]] = float("nan")
    return out


@pytest.mark.parametrize("csa", [True, False], ids=["csa", "hca"])
def test_ring_kernel_reads_the_window_ending_at_each_rows_query(csa):
    """The row-batched decode step's K=V states hold only the window ending at each row's query (``ring``: row j
    at position pos[b] - (W-1) + j): the kernel and the op's reference give what the whole-length state gives
    (upstream's eager attention of that request alone), rows before position 0 (NaN) unread."""
    H, Hkv, L, E, D, K, R, W = 4, 1, 64, 17, 16, 2, 4, 8
    pos = torch.tensor([0, 37, 3, 63, 7])
    B = len(pos)
    rows = [_case(1, H, Hkv, 1, int(s), L, E, D, K, R, seed=int(s)) for s in pos]
    q, kv, ent = (torch.cat([r[k] for r in rows]) for k in range(3))
    idx = torch.cat([r[5] for r in rows])
    sinks = rows[0][3]
    attrs = {"scale": 0.3, "window": W, "rate": 0 if csa else R, "idx": csa, "epos": not csa, "per_row": True}
    want = op_def(ca.OP).call([q, kv, pos, ent, sinks, idx if csa else pos.clone()], attrs)
    held = _held(kv, pos, W)
    ins = [q, held, pos, ent, sinks, idx if csa else pos.clone()]
    ring = dict(attrs, window=0, ring=True)
    torch.testing.assert_close(op_def(ca.OP).call([x.nan_to_num(0.0) if x is held else x for x in ins], ring),
                               want, rtol=1e-5, atol=1e-6)
    p = _params(csa, B, H, Hkv, 1, W, E, D, K, R, 0)
    p.update(B=None, per_row=True, ring=True)
    lib = tvm.compile(tvm.IRModule({"main": kern.build(p, "llvm")}), target=HOST)
    for n in (B, 1):
        o = torch.full((n, H, 1, D), float("nan"))
        lib["main"](*[x[:n] if x is not sinks else x for x in ins], o)
        torch.testing.assert_close(o, want[:n], rtol=1e-5, atol=1e-5)


def test_csa_reads_only_selected_entries_of_a_long_history():
    """4096 entries, all NaN but the two a decode query selects: the kernel still returns the reference."""
    B, H, L, E, D, W = 1, 4, 64, 4096, 16, 8
    g = torch.Generator().manual_seed(3)
    q, kv = torch.randn(B, H, 1, D, generator=g), torch.randn(B, 1, L, D, generator=g)
    sinks = torch.randn(H, generator=g)
    ent = torch.full((B, 1, E, D), float("nan"))
    idx = torch.tensor([[[4000, 17]]])
    ent[:, :, idx[0, 0]] = torch.randn(B, 1, 2, D, generator=g)
    qpos = torch.tensor([40])
    attrs = {"scale": 0.3, "window": W, "rate": 0, "idx": True, "epos": False}
    clean = ent.nan_to_num(0.0)
    ref = ra.compressed_reference([q, kv, qpos, clean, sinks, idx], attrs)
    got = _run(_params(True, B, H, 1, 1, L, E, D, 2, 0, W), [q, kv, qpos, ent, sinks, idx])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("csa", [True, False], ids=["csa", "hca"])
@pytest.mark.parametrize("S", [1, None, "rows"])
def test_cuda_sm90_compiles(csa, S):
    p = _params(csa, 1, 4, 1, 1, 64, 17, 32, 2, 4, 8)
    p["S"] = S
    if S == "rows":  # the row-batched decode step: a symbolic batch, one query per row at its own position
        p.update(S=1, B=None, per_row=True)
    f = kern.build(p, "cuda").with_attr("tirx.is_scheduled", True)
    lib = tvm.compile(tvm.IRModule({"main": f}), target={"kind": "cuda", "arch": "sm_90"})
    src = lib.mod.imports[0].inspect_source()
    assert "__global__" in src and "threadIdx.x" in src  # one thread per query
