"""The batched decode program: one step serves every running request (tools/driver.batched_decode_graph).

Requests of different prompt lengths, each in its own slot, advance together through ``Runtime.decode_batch``:
each token is at its own position and reads its own KV blocks through its own block-table row, and the tokens
equal what each request gets alone from upstream's ``generate()`` (transformers' own cache, same weights).
"""

from __future__ import annotations

import json

import pytest
import torch

from dayzero import UserError
from dayzero.frontend.hf import load_upstream
from dayzero.passes.ir import ops, reference_attention as ra
from dayzero.runtime import load
from conftest import SHARED_MAX_SEQ

BATCHED = ["qwen3_moe", "gpt_oss", "deepseek_v3", "deepseek_v32", "deepseek_v4"]
STEPS = 12


def _prompt(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _upstream(ref, prompt, n):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=BATCHED)
def served(request, tiny_compiled):
    ckpt, art, report = tiny_compiled(request.param)
    ref = load_upstream(ckpt)
    ref.generation_config.eos_token_id = None
    return load(art), ref, report


@pytest.mark.slow
def test_three_requests_step_together_as_each_alone_upstream(served):
    """Prompts of 3, 12 and 21 tokens (positions cross a 16-row block at different steps); the first request
    stops after 5 tokens, so later steps run B=2 on slots 1 and 2 only."""
    rt, ref, report = served
    assert rt.has_batched_decode and report["decode_batch"] == {"built": True, "reason": None}
    prompts = [_prompt(n, 100 + n) for n in (3, 12, 21)]
    limits = [5, STEPS + 1, STEPS + 1]
    out = {}
    for slot, p in enumerate(prompts):
        out[slot] = [int(rt.prefill(p, slot=slot)[0, -1].argmax())]
    for _ in range(STEPS):
        live = [s for s in out if len(out[s]) < limits[s]]
        logits = rt.decode_batch([out[s][-1] for s in live], live)
        assert logits.shape == (len(live), rt.programs["decode_batch"].buffers[
            rt.programs["decode_batch"].user_outputs[0]]["shape"][-1])
        for s, row in zip(live, logits):
            out[s].append(int(row.argmax()))
    for slot, p in enumerate(prompts):
        assert rt.lengths[slot] == len(p) + limits[slot] - 1
        assert out[slot] == _upstream(ref, p, limits[slot]), slot


@pytest.mark.slow
def test_batch_of_one_is_decode(served):
    """decode_batch([t], [s]) gives decode(t, s)'s logits (two programs, so to fp32 rounding) and advances the
    request alike."""
    rt, _, _ = served
    p = _prompt(9, 9)
    for slot in (0, 2):
        rt.prefill(p, slot=slot)
    a = rt.decode(17, slot=0)[0, -1]
    b = rt.decode_batch([17], [2])[0]
    assert rt.lengths[0] == rt.lengths[2] == 10
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert int(a.argmax()) == int(b.argmax())
    a2 = rt.decode(int(a.argmax()), slot=0)[0, -1]
    b2 = rt.decode_batch([int(b.argmax())], [2])[0]
    torch.testing.assert_close(b2, a2, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_bad_steps_raise_and_change_nothing(served):
    rt, _, _ = served
    rt.reset()
    rt.prefill(_prompt(4, 4), slot=0)
    before = dict(rt.lengths)
    for tokens, slots, match in (([1, 2], [0], "one token per slot"), ([1], [rt.max_batch], "not a request slot"),
                                 ([1, 2], [0, 0], "twice"), ([1, 2], [0, 1], "before prefill"),
                                 ([10 ** 6], [0], "outside"), ([1], ["0"], "not a request slot"),
                                 ([1.5], [0], "not a token id"), ([], [], "one token per slot")):
        with pytest.raises(UserError, match=match):
            rt.decode_batch(tokens, slots)
    assert rt.lengths == before


@pytest.mark.slow
def test_deepseek_v4_steps_rows_of_requests(tiny_compiled):
    """Its compressed entries, pending rings and overlaps are per-request states: its decode_batch is the row
    program (frontend/decode_export.RowDecodeStep), which takes every state of the decode program as an input,
    one row per request, and returns each new one; it keeps no state of its own."""
    ckpt, art, report = tiny_compiled("deepseek_v4")
    rt = load(art)
    assert rt.has_batched_decode and rt._row_batched
    prog, dec = rt.programs["decode_batch"], rt.programs["decode"]
    names = [prog.buffers[b]["name"] for b in prog.inputs]
    assert names[:2] == ["input_ids", "positions"] and not prog.states and not prog.table_inputs
    assert set(names[2:]) == set(dec.states) | {n for n in dec.shared_states if n.endswith("_keys")}
    assert len(prog.user_outputs) == len(names) - 1
    # a paged K=V state goes in as the window ending at each request's token, not every position of its cache
    window = rt.program_json["kv_pages"]["row_window"]
    assert window == json.loads((ckpt / "config.json").read_text())["sliding_window"] < \
        rt.program_json["kv_pages"]["length"]
    assert {prog.buffers[b]["shape"][2] for b in prog.inputs if prog.buffers[b]["name"] in dec.shared_states} == \
        {window}
    # the CSA indexer is one kernel that scans only each row's visible keys, as in the one-request step
    steps = {p: [st["node"] for st in rt.program_json["programs"][p]["steps"]] for p in ("decode", "decode_batch")}
    assert not [n for n in steps["decode_batch"] if ".indexer" in n and n.startswith(("bmm", "topk"))]
    assert [n for n in steps["decode_batch"] if n.startswith("dsa_indexer_topk")] == \
        [n for n in steps["decode"] if n.startswith("dsa_indexer_topk")] != []


@pytest.mark.slow
def test_mxfp4_experts_step_together_as_upstream(lowprec_compiled, tmp_path):
    """MXFP4 routed experts (the low-precision MoE kernels in the batched program): two requests stepped together
    give upstream's greedy tokens on the checkpoint's dequantised weights."""
    from _lowprec_ref import dequantized_upstream

    ckpt, art, _ = lowprec_compiled("qwen3_moe", "mxfp4")
    rt = load(art)
    assert rt.has_batched_decode
    ref = dequantized_upstream(ckpt, tmp_path)
    ref.generation_config.eos_token_id = None
    prompts = [_prompt(5, 300), _prompt(17, 301)]
    out = {k: [int(rt.prefill(p, slot=k)[0, -1].argmax())] for k, p in enumerate(prompts)}
    for _ in range(8):
        for k, row in enumerate(rt.decode_batch([out[0][-1], out[1][-1]], [0, 1])):
            out[k].append(int(row.argmax()))
    for k, p in enumerate(prompts):
        assert out[k] == _upstream(ref, p, 9), k


@pytest.mark.slow
def test_full_pool_fails_the_step_and_names_the_slot(tmp_path):
    """3 usable blocks, 3 requests of 14 tokens (one block each): the step that reaches position 16 needs a
    second block per request and fails naming the slot, advancing nobody; a reset request's block serves the
    next step, and the tokens still equal upstream's."""
    from dayzero.tools.driver import compile_model
    from dayzero.tools.make_tiny import make_tiny

    ckpt = make_tiny("qwen3_moe", tmp_path / "ckpt", seed=0)
    compile_model(str(ckpt), tmp_path / "art", max_seq=SHARED_MAX_SEQ, max_batch=3, kv_blocks=4)
    rt = load(tmp_path / "art")
    ref = load_upstream(ckpt)
    ref.generation_config.eos_token_id = None
    prompts = [_prompt(14, 200 + k) for k in range(3)]
    out = {k: [int(rt.prefill(p, slot=k)[0, -1].argmax())] for k, p in enumerate(prompts)}
    for _ in range(2):  # positions 14 and 15: the first block
        for k, row in enumerate(rt.decode_batch([out[k][-1] for k in range(3)], [0, 1, 2])):
            out[k].append(int(row.argmax()))
    with pytest.raises(UserError, match="slot 1: KV cache full"):
        rt.decode_batch([out[k][-1] for k in (1, 0, 2)], [1, 0, 2])
    assert [rt.lengths[k] for k in range(3)] == [16, 16, 16]
    rt.reset(2)  # one block back: slot 1 takes it, slot 0 then finds the pool empty
    with pytest.raises(UserError, match="slot 0: KV cache full"):
        rt.decode_batch([out[k][-1] for k in (1, 0)], [1, 0])
    for _ in range(3):
        out[1].append(int(rt.decode_batch([out[1][-1]], [1])[0].argmax()))
    assert out[1] == _upstream(ref, prompts[1], 6)
    rt.reset(1)
    out[0].append(int(rt.decode_batch([out[0][-1]], [0])[0].argmax()))
    assert out[0] == _upstream(ref, prompts[0], 4)


# ---- passes ----------------------------------------------------------------------------------------------------

BEFORE = """graph main symbols(seq in [1, 8]) {
  %0 = input {name="cache_position"} : int64[seq]
  %1 = arange.start_step {dtype=null, end=`seq`, start=0, step=1} : int64[seq]
  %2 = select.int(%0) {dim=0, index=0} : int64[]
  %3 = clone(%2) : int64[]
  %4 = add.Tensor(%1, %3) {alpha=1} : int64[seq]
  %5 = arange.start_step {dtype=null, end=`seq`, start=1, step=1} : int64[seq]
  %6 = add.Tensor(%5, %3) {alpha=1} : int64[seq]
  return %4, %6
}
"""


def test_token_positions_reads_each_tokens_own_position():
    """arange(0, S) + p[0] (transformers' contiguous positions) becomes p itself under the batched-decode flag;
    an arange from 1 is another computation and stays (the driver then refuses the batched program: the first
    position is still read); without the flag nothing changes."""
    from dayzero.passes.ir.text import parse_graph, print_graph
    from dayzero.passes.token_positions import first_position_reads, token_positions

    g = parse_graph(BEFORE)
    out, found = token_positions(g, per_token=True)
    assert out.outputs[0] is out.inputs[0] and found.patterns == {"token_positions": 1}
    assert out.outputs[1].op == "add.Tensor" and [n.op for n in first_position_reads(out)] == ["select.int", "clone"]
    assert print_graph(token_positions(g, per_token=False)[0]) == print_graph(g)


# ---- kernels with per-token block tables: query s reads (and token s writes) its own request's blocks -----------

BS = 16


def _pool(logicals: list[torch.Tensor], dim: int, blocks: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One NaN pool of ``blocks`` blocks holding every request's logical cache at shuffled blocks (never the
    scratch block 0), and the per-token table [S, NT] whose row s maps request s."""
    L = logicals[0].shape[dim]
    nt = -(-L // BS)
    free = torch.randperm(blocks - 1, generator=torch.Generator().manual_seed(seed)) + 1
    assert len(logicals) * nt <= blocks - 1
    shape = list(logicals[0].shape)
    shape[dim] = blocks * BS
    pool = torch.full(shape, float("nan"), dtype=logicals[0].dtype)
    table = free[:len(logicals) * nt].reshape(len(logicals), nt).to(torch.int32)
    for s, x in enumerate(logicals):
        for i in range(nt):
            pool.narrow(dim, int(table[s, i]) * BS, BS).copy_(x.narrow(dim, i * BS, BS))
    return pool, table


def _compile(func):
    import tvm

    return tvm.compile(tvm.IRModule({"main": func}), target="llvm")


@pytest.mark.parametrize("W,sinks", [(0, False), (8, True)])
def test_per_token_dense_kernel_reads_each_querys_own_request(W, sinks):
    from dayzero.codegen.kernels.attention import build
    from dayzero.passes import sparse_attention as sa

    g = torch.Generator().manual_seed(W)
    L, blocks, S = 64, 16, 3
    qpos = torch.tensor([5, 40, 17])
    q = torch.randn(1, 4, S, 16, generator=g)
    ks = [torch.randn(1, 2, L, 16, generator=g) for _ in range(S)]
    vs = [torch.randn(1, 2, L, 16, generator=g) for _ in range(S)]
    extra = [torch.randn(4, generator=g)] if sinks else []
    attrs = {"scale": 0.25, "window": W, "sinks": sinks}
    want = torch.cat([ra.dense_reference([q[:, :, s:s + 1], ks[s], vs[s], qpos[s:s + 1]] + extra, attrs)
                      for s in range(S)], dim=2)
    for s in range(S):  # rows a query must not see: never read
        hidden = ~ra.valid_positions(L, qpos[s:s + 1], W)[0]
        ks[s][:, :, hidden], vs[s][:, :, hidden] = float("nan"), float("nan")
    kp, table = _pool(ks, 2, blocks, seed=1)
    vp, _ = _pool(vs, 2, blocks, seed=1)
    p = dict(op=sa.DENSE, B=1, Hq=4, Hkv=2, S=None, L=L, D=16, Dv=16, dtype="float32", out_dtype="float32",
             pos_dtype="int64", scale=0.25, window=W, sinks=sinks, sink_dtype="float32", paged=BS, P=blocks * BS,
             NT=int(table.shape[1]), table_dtype="int32", per_token=True)
    o = torch.full((1, 4, S, 16), float("nan"))
    _compile(build(p, "llvm"))["main"](q, kp, vp, qpos, *extra, table, o)
    torch.testing.assert_close(o, want, rtol=1e-5, atol=1e-5)
    # the IR op's reference (by_token) runs the same per-query semantics on the pool
    ref = ops.REGISTRY[sa.DENSE].reference([q, kp.nan_to_num(), vp.nan_to_num(), qpos] + extra + [table],
                                              dict(attrs, paged=BS, length=L, per_token=True))
    torch.testing.assert_close(ref, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("W,sinks", [(0, False), (8, True)])
def test_per_row_dense_kernel_reads_each_rows_own_position(W, sinks):
    """DeepSeek-V4's row program (per_row): batch row b is request b, one query at qpos[b]; one kernel for every
    batch size (B symbolic). Each row equals that request alone; rows it must not see hold NaN."""
    from dayzero.codegen.kernels.attention import build
    from dayzero.passes import sparse_attention as sa

    g = torch.Generator().manual_seed(W + 1)
    L, B = 64, 4
    qpos = torch.tensor([40, 0, 17, 63])
    q = torch.randn(B, 4, 1, 16, generator=g)
    k, v = torch.randn(B, 2, L, 16, generator=g), torch.randn(B, 2, L, 16, generator=g)
    extra = [torch.randn(4, generator=g)] if sinks else []
    attrs = {"scale": 0.25, "window": W, "sinks": sinks}
    want = torch.cat([ra.dense_reference([q[b:b + 1], k[b:b + 1], v[b:b + 1], qpos[b:b + 1]] + extra, attrs)
                      for b in range(B)])
    # the IR op's reference (by_row) runs the same per-row semantics
    ref = ops.REGISTRY[sa.DENSE].reference([q, k, v, qpos] + extra, dict(attrs, per_row=True))
    torch.testing.assert_close(ref, want, rtol=1e-5, atol=1e-5)
    for b in range(B):
        hidden = ~ra.valid_positions(L, qpos[b:b + 1], W)[0]
        k[b, :, hidden], v[b, :, hidden] = float("nan"), float("nan")
    p = dict(op=sa.DENSE, B=None, Hq=4, Hkv=2, S=1, L=L, D=16, Dv=16, dtype="float32", out_dtype="float32",
             pos_dtype="int64", scale=0.25, window=W, sinks=sinks, sink_dtype="float32", per_row=True)
    f = _compile(build(p, "llvm"))["main"]
    for n in (B, 1):
        o = torch.full((n, 4, 1, 16), float("nan"))
        f(q[:n], k[:n], v[:n], qpos[:n], *extra, o)
        torch.testing.assert_close(o, want[:n], rtol=1e-5, atol=1e-5)


def test_ring_dense_kernel_reads_the_window_ending_at_each_rows_query():
    """A sliding layer of DeepSeek-V4's row program: k / v hold only the window ending at each row's query
    (``ring``, row j at position qpos[b] - (W-1) + j): equal to the whole-length cache's attention, and rows
    before position 0 (NaN) are not read."""
    from dayzero.codegen.kernels.attention import build
    from dayzero.passes import sparse_attention as sa

    g = torch.Generator().manual_seed(5)
    L, B, W = 64, 4, 8
    qpos = torch.tensor([40, 0, 5, 63])
    q = torch.randn(B, 4, 1, 16, generator=g)
    k, v = torch.randn(B, 2, L, 16, generator=g), torch.randn(B, 2, L, 16, generator=g)
    sinks = torch.randn(4, generator=g)
    attrs = {"scale": 0.25, "window": W, "sinks": True, "per_row": True}
    want = ops.REGISTRY[sa.DENSE].reference([q, k, v, qpos, sinks], attrs)
    at = qpos.view(-1, 1) - (W - 1) + torch.arange(W)
    kh = torch.stack([k[b][:, at[b].clamp(min=0)] for b in range(B)])
    vh = torch.stack([v[b][:, at[b].clamp(min=0)] for b in range(B)])
    ring = dict(attrs, window=0, ring=True)
    torch.testing.assert_close(ops.REGISTRY[sa.DENSE].reference([q, kh, vh, qpos, sinks], ring), want,
                               rtol=1e-5, atol=1e-5)
    before = (at < 0).nonzero(as_tuple=True)
    kh[before[0], :, before[1]], vh[before[0], :, before[1]] = float("nan"), float("nan")
    p = dict(op=sa.DENSE, B=None, Hq=4, Hkv=2, S=1, L=W, D=16, Dv=16, dtype="float32", out_dtype="float32",
             pos_dtype="int64", scale=0.25, window=0, sinks=True, sink_dtype="float32", per_row=True, ring=True)
    f = _compile(build(p, "llvm"))["main"]
    for n in (B, 1):
        o = torch.full((n, 4, 1, 16), float("nan"))
        f(q[:n], kh[:n], vh[:n], qpos[:n], sinks, o)
        torch.testing.assert_close(o, want[:n], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dense", [True, False], ids=["mla_attention", "mla_sparse_attention"])
def test_per_token_mla_kernel_reads_each_querys_own_request(dense):
    from dayzero.codegen.kernels.attention import build
    from dayzero.passes import sparse_attention as sa

    g = torch.Generator().manual_seed(int(dense))
    L, blocks, H, S, K = 64, 16, 4, 3, 4
    qpos = torch.tensor([33, 5, 50])
    q = torch.randn(1, H, S, 24, generator=g)
    lats = [torch.randn(1, 1, L, 32, generator=g) for _ in range(S)]
    ropes = [torch.randn(1, 1, L, 8, generator=g) for _ in range(S)]
    w = torch.randn(H * 32, 32, generator=g) * 0.1
    idx = torch.stack([torch.randperm(int(qpos[s]) + 1, generator=g)[:K] for s in range(S)])[None]
    want = []
    for s in range(S):
        k, v = ra.mla_expand(lats[s], ropes[s], w, 16, H)
        qs, ps = q[:, :, s:s + 1], qpos[s:s + 1]
        want.append(ra.dense_reference([qs, k, v, ps], {"scale": 0.2, "window": 0, "sinks": False}) if dense
                    else ra.sparse_reference([qs, k, v, ps, idx[:, s:s + 1]], {"scale": 0.2}))
        lats[s][:, :, int(qpos[s]) + 1:], ropes[s][:, :, int(qpos[s]) + 1:] = float("nan"), float("nan")
    lp, table = _pool(lats, 2, blocks, seed=2)
    rp, _ = _pool(ropes, 2, blocks, seed=2)
    p = dict(op=sa.MLA_DENSE if dense else sa.MLA, B=1, H=H, S=None, L=L, R=32, Dn=16, Dr=8, Dv=16,
             K=0 if dense else K, dense=dense, dtype="float32", lat_dtype="float32", w_dtype="float32",
             out_dtype="float32", pos_dtype="int64", idx_dtype=None if dense else "int64", scale=0.2, paged=BS,
             P=blocks * BS, NT=int(table.shape[1]), table_dtype="int32", per_token=True)
    o = torch.full((1, H, S, 16), float("nan"))
    _compile(build(p, "llvm"))["main"](q, lp, rp, w, qpos, *([] if dense else [idx]), table, o)
    torch.testing.assert_close(o, torch.cat(want, dim=2), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_per_token_indexer_kernel_equals_torch_topk_per_request():
    """Small-integer scores (exact in any order): query s's top-k over its own request's keys."""
    from dayzero.codegen.kernels import indexer
    from dayzero.passes import sparse_attention as sa

    g = torch.Generator().manual_seed(3)
    L, blocks, Hi, Di, K, S = 64, 16, 4, 16, 4, 3
    r = lambda *sh: torch.randint(-3, 4, sh, generator=g).float()  # noqa: E731
    q, w = r(1, S, Hi, Di), r(1, S, Hi)
    keys = [r(1, L, Di) for _ in range(S)]
    qpos = torch.tensor([20, 63, 6])
    attrs = {"scale": 0.25, "k": K, "sorted": True, "fill": float("-inf")}
    want = torch.cat([ra.indexer_reference([q[:, s:s + 1], w[:, s:s + 1], keys[s], qpos[s:s + 1]], attrs)
                      for s in range(S)], dim=1)
    for s in range(S):
        keys[s][:, int(qpos[s]) + 1:] = float("nan")  # future rows: scored as fill, never read as NaN
    pool, table = _pool(keys, 1, blocks, seed=3)
    p = dict(op=sa.INDEXER, B=1, S=None, Hi=Hi, Di=Di, L=L, K=K, sorted=True, scale=0.25, fill=float("-inf"),
             q_dtype="float32", w_dtype="float32", k_dtype="float32", pos_dtype="int64", paged=BS, P=blocks * BS,
             NT=int(table.shape[1]), table_dtype="int32", per_token=True)
    o = torch.full((1, S, K), -1, dtype=torch.int64)
    _compile(indexer.build(p, "llvm"))["main"](q, w, pool, qpos, table, o)
    assert torch.equal(o, want), (o, want)


def test_per_token_write_lands_in_each_tokens_table_row():
    from dayzero.codegen.kernels.table import KERNELS
    from dayzero.passes.ir.node import Node, TensorType
    from dayzero.passes.ir.shape_expr import make_symbol

    blocks, S = 8, 3
    seq = make_symbol("seq")
    state = TensorType("float32", (1, 2, blocks * BS, 4))
    node = Node.make("paged_state_index_put",
                     [Node.make("state", (), {"name": "s", "zone": "kv_pages"}, (state,)),
                      Node.make("input", (), {"name": "pos"}, (TensorType("int64", (seq,)),)),
                      Node.make("input", (), {"name": "v"}, (TensorType("float32", (1, 2, seq, 4)),)),
                      Node.make("input", (), {"name": "block_table"}, (TensorType("int32", (seq, 4)),))],
                     {"dim": 2, "block_size": BS, "per_token": True}, (state,))
    lib = _compile(KERNELS["paged_state_index_put"].compute(node))
    table = torch.tensor([[4, 2, 0, 0], [1, 0, 0, 0], [3, 5, 7, 6]], dtype=torch.int32)
    pos = torch.tensor([17, 3, 60])
    vals = torch.randn(1, 2, S, 4)
    pool = torch.zeros(1, 2, blocks * BS, 4)
    lib["main"](pool, pos, vals, table)
    want = torch.zeros_like(pool)
    want[:, :, 2 * BS + 1] = vals[:, :, 0]  # token 0: position 17 -> its block 1 = pool block 2, row 1
    want[:, :, 1 * BS + 3] = vals[:, :, 1]  # token 1: position 3 -> its block 0 = pool block 1, row 3
    want[:, :, 6 * BS + 12] = vals[:, :, 2]  # token 2: position 60 -> its block 3 = pool block 6, row 12
    assert torch.equal(pool, want)
    ref = torch.zeros_like(pool)
    from dayzero.passes.ir import ops

    ops.REGISTRY["paged_state_index_put"].reference([ref, pos, vals, table], {"dim": 2, "block_size": BS})
    assert torch.equal(ref, want)


def _per_token_params(op: str) -> dict:
    from dayzero.passes import sparse_attention as sa

    paged = dict(paged=BS, P=16 * BS, NT=4, table_dtype="int32", per_token=True, S=None)
    if op == sa.DENSE:
        return dict(paged, op=op, B=1, Hq=4, Hkv=2, L=64, D=16, Dv=16, dtype="float32", out_dtype="float32",
                    pos_dtype="int64", scale=0.25, window=8, sinks=True, sink_dtype="float32")
    if op in (sa.MLA, sa.MLA_DENSE):
        dense = op == sa.MLA_DENSE
        return dict(paged, op=op, B=1, H=4, L=64, R=32, Dn=16, Dr=8, Dv=16, K=0 if dense else 4, dense=dense,
                    dtype="float32", lat_dtype="float32", w_dtype="float32", out_dtype="float32", pos_dtype="int64",
                    idx_dtype=None if dense else "int64", scale=0.2)
    return dict(paged, op=op, B=1, Hi=4, Di=16, L=64, K=4, sorted=True, scale=0.25, fill=float("-inf"),
                q_dtype="float32", w_dtype="float32", k_dtype="float32", pos_dtype="int64")


@pytest.mark.parametrize("op", ["cache_attention", "mla_attention", "mla_sparse_attention", "dsa_indexer_topk"])
def test_per_token_kernels_compile_for_cuda_sm90(op):
    import tvm

    from dayzero.codegen.kernels import attention, indexer

    build = indexer.build if op == "dsa_indexer_topk" else attention.build
    f = build(_per_token_params(op), "cuda").with_attr("tirx.is_scheduled", True)
    lib = tvm.compile(tvm.IRModule({"main": f}), target={"kind": "cuda", "arch": "sm_90"})
    assert "__global__" in lib.mod.imports[0].inspect_source()


def test_deepseek_v4_row_step_states_share_the_batch_dim(tmp_path):
    """Every input and output of the row program has the one ``batch`` dim, bounded by --max-batch: torch.export
    gives each input its own symbol for a Dim bounded [1, 2] (the inputs' shapes then say nothing about each
    other, and no attention or indexer pattern of the step matched at --max-batch 2)."""
    from dayzero.frontend.checkpoint import Checkpoint
    from dayzero.frontend.trace import _trace_rows
    from dayzero.passes.ir.shape_expr import make_symbol
    from dayzero.tools.make_tiny import make_tiny

    g = _trace_rows(Checkpoint(make_tiny("deepseek_v4", tmp_path / "ckpt", seed=0)), 32, 2).graph
    assert g.symbols == (("batch", 1, 2),)
    batch = make_symbol("batch")
    assert [i.type.shape[0] for i in g.inputs] == [batch] * len(g.inputs)
    assert [o.type.shape[0] for o in g.outputs] == [batch] * len(g.outputs)


@pytest.mark.slow
def test_deepseek_v4_rows_move_only_the_entries_their_steps_touch(tmp_path):
    """At --max-seq 8192 the compressed entries are 2049 (CSA, rate 4) and 1025 (HCA, rate 8) rows a request: the
    row program scatters each step's entry into its own input (no copy of the state), the runtime gathers a
    request's rows only up to the one its step writes (rounded up to ENTRY_ROWS_ALIGN) and writes back only that
    row. Two long prompts (7930 and 6001 tokens, several prefill chunks, compressor windows and sliding windows)
    step together across position 7936, where the longer one's CSA rows pass a multiple of 64; their tokens
    equal each alone upstream (eager still fits at 8K), and each alone through the one-request decode."""
    from dayzero.runtime.executor import ENTRY_ROWS_ALIGN
    from dayzero.codegen.kernels import indexer
    from dayzero.tools.driver import compile_model
    from dayzero.tools.make_tiny import make_tiny

    assert ENTRY_ROWS_ALIGN % indexer.JB == 0  # a gathered prefix ends on a tile boundary of the readers
    ckpt = make_tiny("deepseek_v4", tmp_path / "ckpt", seed=0)
    compile_model(str(ckpt), tmp_path / "art", max_seq=8192, max_batch=2, prefill_chunk=1024)
    rt = load(tmp_path / "art")
    assert rt._row_entries == {"cache_0_compressor_entries": 8, "cache_1_compressor_entries": 4,
                               "cache_1_indexer_entries": 4}
    steps = [st["node"] for st in rt.program_json["programs"]["decode_batch"]["steps"]]
    assert len([n for n in steps if n.startswith("scatter_inplace")]) == 3 and not [
        n for n in steps if n.startswith(("scatter.src", "clone"))]
    ref = load_upstream(ckpt)
    ref.generation_config.eos_token_id = None
    prompts = [_prompt(n, 7 + n) for n in (7930, 6001)]
    alone = [rt.generate(p, STEPS + 1, slot=0) for p in prompts]
    out = {s: [int(rt.prefill(p, slot=s, last=True)[0, -1].argmax())] for s, p in enumerate(prompts)}
    for _ in range(STEPS):
        for s, row in zip(out, rt.decode_batch([out[s][-1] for s in out], list(out))):
            out[s].append(int(row.argmax()))
    for s, p in enumerate(prompts):
        want = _upstream(ref, p, STEPS + 1)
        assert out[s] == want and alone[s] == want, s
