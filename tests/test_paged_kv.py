"""Paged KV cache: pools of blocks, per-request block tables (passes/paged_kv.py, runtime/kv_pages.py).

Kernels read a request's cache through its table: each case builds the logically contiguous cache, scatters its
blocks into a pool at shuffled places, fills every other row of the pool (blocks of no one, the scratch block 0)
with NaN, and checks the kernel against the op's reference on the logical cache. End to end, the compiled tiny
models generate upstream's greedy tokens from shuffled, poisoned pools, and a pool too small for a batch fails
one request while the others finish.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
import tvm

from dayzero.codegen.kernels import indexer
from dayzero.codegen.kernels.attention import build
from dayzero.codegen.kernels.table import KERNELS
from dayzero.passes import sparse_attention as sa
from dayzero.passes.ir import reference_attention as ra
from dayzero.passes.ir.node import Node, TensorType
from conftest import SHARED_MAX_SEQ

HOST = "llvm"
BS = 16


def _page(logical: torch.Tensor, dim: int, table: torch.Tensor, blocks: int) -> torch.Tensor:
    """A NaN pool of ``blocks`` blocks holding logical block i at block table[i] (allocated entries only)."""
    shape = list(logical.shape)
    shape[dim] = blocks * BS
    pool = torch.full(shape, float("nan"), dtype=logical.dtype)
    for i, b in enumerate(table.tolist()):
        if b and i * BS < logical.shape[dim]:
            n = min(BS, logical.shape[dim] - i * BS)
            pool.narrow(dim, b * BS, n).copy_(logical.narrow(dim, i * BS, n))
    return pool


def _table(used_tokens: int, L: int, blocks: int, seed: int) -> torch.Tensor:
    """Shuffled blocks (never 0) for the first ceil(used / BS) logical blocks, the scratch block 0 after."""
    rng = random.Random(seed)
    free = list(range(1, blocks))
    rng.shuffle(free)
    need = -(-used_tokens // BS)
    t = torch.zeros(-(-L // BS), dtype=torch.int32)
    t[:need] = torch.tensor(free[:need], dtype=torch.int32)
    return t


def _paged(p: dict, table: torch.Tensor, blocks: int) -> dict:
    return dict(p, paged=BS, P=blocks * BS, NT=int(table.shape[0]), table_dtype="int32")


@pytest.mark.parametrize("S,start,W,sinks", [(1, 40, 0, False), (1, 40, 8, True), (37, 5, 0, True), (20, 30, 8, False)])
def test_paged_dense_kernel_reads_through_the_table(S, start, W, sinks):
    g = torch.Generator().manual_seed(S + start + W)
    L, blocks = 64, 9
    q = torch.randn(1, 4, S, 16, generator=g)
    k, v = torch.randn(1, 2, L, 16, generator=g), torch.randn(1, 2, L, 16, generator=g)
    qpos = torch.arange(S) + start
    hidden = ~ra.valid_positions(L, qpos, W).any(0)
    k[:, :, hidden], v[:, :, hidden] = float("nan"), float("nan")  # rows no query sees: never read
    extra = [torch.randn(4, generator=g)] if sinks else []
    ref = ra.dense_reference([q, k.nan_to_num(), v.nan_to_num(), qpos] + extra,
                             {"scale": 0.25, "window": W, "sinks": sinks})
    table = _table(start + S, L, blocks, seed=S)
    p = _paged(dict(op=sa.DENSE, B=1, Hq=4, Hkv=2, S=S if S == 1 else None, L=L, D=16, Dv=16, dtype="float32",
                    out_dtype="float32", pos_dtype="int64", scale=0.25, window=W, sinks=sinks,
                    sink_dtype="float32"), table, blocks)
    lib = tvm.compile(tvm.IRModule({"main": build(p, "llvm")}), target=HOST)
    o = torch.full((1, 4, S, 16), float("nan"))
    lib["main"](q, _page(k, 2, table, blocks), _page(v, 2, table, blocks), qpos, *extra, table, o)
    torch.testing.assert_close(o, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("S,start", [(1, 50), (9, 20)])
def test_paged_mla_kernel_reads_only_selected_rows_through_the_table(S, start):
    g = torch.Generator().manual_seed(S + start)
    L, blocks, H, K = 64, 7, 4, 4
    q = torch.randn(1, H, S, 24, generator=g)
    lat, rope = torch.randn(1, 1, L, 32, generator=g), torch.randn(1, 1, L, 8, generator=g)
    w = torch.randn(H * 32, 32, generator=g) * 0.1
    qpos = torch.arange(S) + start
    idx = torch.stack([torch.randperm(int(qpos[s]) + 1, generator=g)[:K] for s in range(S)])[None]
    ins = [q, lat, rope, w, qpos, idx]
    ref = ra.mla_sparse_reference(ins, {"scale": 0.2, "nope": 16})
    read = torch.zeros(L, dtype=torch.bool)
    read[idx.flatten()] = True
    lat[:, :, ~read], rope[:, :, ~read] = float("nan"), float("nan")
    table = _table(start + S, L, blocks, seed=start)
    p = _paged(dict(op=sa.MLA, B=1, H=H, S=S if S == 1 else None, L=L, R=32, Dn=16, Dr=8, Dv=16, K=K,
                    dtype="float32", lat_dtype="float32", w_dtype="float32", out_dtype="float32", pos_dtype="int64",
                    idx_dtype="int64", scale=0.2), table, blocks)
    lib = tvm.compile(tvm.IRModule({"main": build(p, "llvm")}), target=HOST)
    o = torch.full((1, H, S, 16), float("nan"))
    lib["main"](q, _page(lat, 2, table, blocks), _page(rope, 2, table, blocks), w, qpos, idx, table, o)
    torch.testing.assert_close(o, ref, rtol=1e-5, atol=1e-5)


def test_paged_mla_reference_reads_the_pool_through_the_table_once():
    """The reference of a paged MLA sparse attention (what ``dayzero compare`` runs on DeepSeek-V3.2) equals the
    contiguous one: the cache is gathered through the table once, the expanded K/V not read as a pool again."""
    g = torch.Generator().manual_seed(3)
    L, blocks, H, K, S, start = 64, 7, 4, 4, 5, 20
    q = torch.randn(1, H, S, 24, generator=g)
    lat, rope = torch.randn(1, 1, L, 32, generator=g), torch.randn(1, 1, L, 8, generator=g)
    w = torch.randn(H * 32, 32, generator=g) * 0.1
    qpos = torch.arange(S) + start
    idx = torch.stack([torch.randperm(int(qpos[s]) + 1, generator=g)[:K] for s in range(S)])[None]
    ref = ra.mla_sparse_reference([q, lat, rope, w, qpos, idx], {"scale": 0.2, "nope": 16})
    table = _table(L, L, blocks + 4, seed=1)
    paged = [q, _page(lat, 2, table, blocks + 4), _page(rope, 2, table, blocks + 4), w, qpos, idx, table]
    out = ra.mla_sparse_reference(paged, {"scale": 0.2, "nope": 16, "paged": BS, "length": L})
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize("S,start,paged", [(1, 50, True), (1, 0, False), (9, 20, True), (5, 3, False)])
def test_dense_mla_kernel_equals_attention_over_upstreams_expansion(S, start, paged):
    """mla_attention (MLA without an indexer: DeepSeek-V3, Kimi-K2): the absorbed kernel equals causal attention
    over upstream's expanded K/V (mla_expand), and reads no row past the query's position."""
    g = torch.Generator().manual_seed(S + start)
    L, blocks, H = 64, 7, 4
    q = torch.randn(1, H, S, 24, generator=g)
    lat, rope = torch.randn(1, 1, L, 32, generator=g), torch.randn(1, 1, L, 8, generator=g)
    w = torch.randn(H * 32, 32, generator=g) * 0.1
    qpos = torch.arange(S) + start
    k, v = ra.mla_expand(lat, rope, w, 16, H)
    ref = ra.dense_reference([q, k, v, qpos], {"scale": 0.2, "window": 0, "sinks": False})
    lat[:, :, start + S:], rope[:, :, start + S:] = float("nan"), float("nan")
    p = dict(op=sa.MLA_DENSE, B=1, H=H, S=S if S == 1 else None, L=L, R=32, Dn=16, Dr=8, Dv=16, K=0, dense=True,
             dtype="float32", lat_dtype="float32", w_dtype="float32", out_dtype="float32", pos_dtype="int64",
             idx_dtype=None, scale=0.2)
    ins = [q, lat, rope, w, qpos]
    if paged:
        table = _table(start + S, L, blocks, seed=S)
        p = _paged(p, table, blocks)
        ins = [q, _page(lat, 2, table, blocks), _page(rope, 2, table, blocks), w, qpos, table]
    lib = tvm.compile(tvm.IRModule({"main": build(p, "llvm")}), target=HOST)
    o = torch.full((1, H, S, 16), float("nan"))
    lib["main"](*ins, o)
    torch.testing.assert_close(o, ref, rtol=1e-5, atol=1e-5)


def test_dense_mla_is_recognised_and_the_cache_never_expanded(tiny_compiled):
    """Tiny DeepSeek-V3 (MLA, no indexer): every layer's attention is mla_attention in both programs, no
    kv_b_proj runs over the latent cache, and the latent + rope caches are paged."""
    ckpt, art, report = tiny_compiled("deepseek_v3")
    layers = json.loads((ckpt / "config.json").read_text())["num_hidden_layers"]
    assert report["patterns"]["sparse_attention.mla_attention"] == layers  # the prefill's count
    pj = json.loads((art / "program.json").read_text())
    for prog in pj["programs"].values():
        ops = {st["node"].split(" at ")[0] for st in prog["steps"]}
        assert "mla_attention" in ops and "cache_attention" not in ops
        kv = [b for b in prog["buffers"] if b.get("state") and b["alias_of"] is None]
        assert kv and all(b["zone"] == "kv_pages" for b in kv)
    import re

    ir = (art / "final.ir").read_text()  # the prefill's IR: no linear reads a cache
    caches = set(re.findall(r"(%\d+) = paged_state_index_put", ir))
    assert len(caches) == 2 * layers
    assert not [ln for ln in ir.splitlines() if re.search(r"= linear\((%\d+)", ln)
                and re.search(r"= linear\((%\d+)", ln).group(1) in caches]


@pytest.mark.parametrize("csa", [True, False], ids=["csa", "hca"])
@pytest.mark.parametrize("S,start", [(1, 37), (23, 17)])
def test_paged_compressed_attention_reads_the_window_through_the_table(csa, S, start):
    """DeepSeek-V4's compressed_attention with its K=V state paged (its compressed entries stay per request)."""
    from dayzero.codegen.kernels import compressed_attention as kern
    from dayzero.passes import compressed_attention as ca

    g = torch.Generator().manual_seed(S + start + csa)
    H, L, E, D, K, R, W, blocks = 4, 64, 17, 16, 3, 4, 8, 9
    q, kv, ent = torch.randn(1, H, S, D, generator=g), torch.randn(1, 1, L, D, generator=g), torch.randn(
        1, 1, E, D, generator=g)
    sinks, qpos = torch.randn(H, generator=g), torch.arange(S) + start
    idx = torch.stack([torch.randperm(max((int(p) + 1) // R, K), generator=g)[:K] for p in qpos])[None]
    attrs = {"scale": 0.3, "window": W, "rate": 0 if csa else R, "idx": csa, "epos": not csa}
    extra = idx if csa else qpos.clone()
    ref = ra.compressed_reference([q, kv, qpos, ent, sinks, extra], attrs)
    kv[:, :, ~ra.valid_positions(L, qpos, W).any(0)] = float("nan")
    table = _table(start + S, L, blocks, seed=S)
    p = dict(op=ca.OP, B=1, H=H, Hkv=1, S=S if S == 1 else None, L=L, E=E, D=D, dtype="float32", kv_dtype="float32",
             ent_dtype="float32", out_dtype="float32", pos_dtype="int64", sink_dtype="float32", scale=0.3,
             window=W, rate=0 if csa else R)
    p.update(K=K, idx_dtype="int64") if csa else p.update(epos_dtype="int64")
    lib = tvm.compile(tvm.IRModule({"main": kern.build(_paged(p, table, blocks), "llvm")}), target=HOST)
    o = torch.full((1, H, S, D), float("nan"))
    lib["main"](q, _page(kv, 2, table, blocks), qpos, ent, sinks, extra, table, o)
    torch.testing.assert_close(o, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("S,start", [(1, 37), (1, 2), pytest.param(19, 10, marks=pytest.mark.slow)])
def test_paged_indexer_kernel_equals_torch_topk(S, start):
    """Small-integer scores (exact in any order): the kernel returns torch.topk's indices over the logical keys,
    while the pool's other rows (other requests' blocks, the scratch block) hold NaN."""
    g = torch.Generator().manual_seed(S + start)
    L, blocks, Hi, Di, K = 64, 11, 4, 16, 4
    r = lambda *sh: torch.randint(-3, 4, sh, generator=g).float()  # noqa: E731
    q, w, keys = r(1, S, Hi, Di), r(1, S, Hi), r(1, L, Di)
    qpos = torch.arange(S) + start
    attrs = {"scale": 0.25, "k": K, "sorted": True, "fill": float("-inf")}
    ref = ra.indexer_reference([q, w, keys, qpos], attrs)
    table = _table(start + S, L, blocks, seed=S * start)
    p = _paged(dict(op=sa.INDEXER, B=1, S=S if S == 1 else None, Hi=Hi, Di=Di, L=L, K=K, sorted=True, scale=0.25,
                    fill=float("-inf"), q_dtype="float32", w_dtype="float32", k_dtype="float32",
                    pos_dtype="int64"), table, blocks)
    keys[:, int(qpos.max()) + 1:] = float("nan")  # future rows: scored as fill, never as NaN
    lib = tvm.compile(tvm.IRModule({"main": indexer.build(p, "llvm")}), target=HOST)
    o = torch.full((1, S, K), -1, dtype=torch.int64)
    lib["main"](q, w, _page(keys, 1, table, blocks), qpos, table, o)
    assert torch.equal(o, ref), (o, ref)


def test_paged_write_lands_in_the_tables_rows():
    blocks, L, S = 6, 64, 7
    state = TensorType("float32", (1, 2, blocks * BS, 4))
    node = Node.make("paged_state_index_put",
                     [Node.make("state", (), {"name": "s", "zone": "kv_pages"}, (state,)),
                      Node.make("input", (), {"name": "pos"}, (TensorType("int64", (S,)),)),
                      Node.make("input", (), {"name": "v"}, (TensorType("float32", (1, 2, S, 4)),)),
                      Node.make("input", (), {"name": "block_table"}, (TensorType("int32", (L // BS,)),))],
                     {"dim": 2, "block_size": BS}, (state,))
    lib = tvm.compile(tvm.IRModule({"main": KERNELS["paged_state_index_put"].compute(node)}), target=HOST)
    table = torch.tensor([4, 2, 5, 0], dtype=torch.int32)
    pos = torch.tensor([13, 14, 15, 16, 17, 33, 40])
    vals = torch.randn(1, 2, S, 4)
    pool = torch.zeros(1, 2, blocks * BS, 4)
    lib["main"](pool, pos, vals, table)
    want = torch.zeros_like(pool)
    for s, p in enumerate(pos.tolist()):
        want[:, :, int(table[p // BS]) * BS + p % BS] = vals[:, :, s]
    assert torch.equal(pool, want)


# ---- end to end ---------------------------------------------------------------------------------------------

def _upstream(ckpt):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(ckpt)).eval()


def _greedy(model, prompt, n):
    with torch.no_grad():
        return model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)[0, len(prompt):].tolist()


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss", "deepseek_v32"])
def test_compiled_caches_are_pools_read_through_block_tables(tiny_compiled, model_type):
    from dayzero.runtime import load

    ckpt, art, report = tiny_compiled(model_type)
    pj = json.loads((art / "program.json").read_text())
    pages = pj["kv_pages"]
    assert {k: pages[k] for k in ("block_size", "table_len", "length")} == {"block_size": 16, "table_len": 8,
                                                                            "length": 128}
    tables = {t["name"]: t for t in pages["tables"]}
    assert {k: tables["block_table"][k] for k in ("name", "window", "blocks")} == {
        "name": "block_table", "window": 0, "blocks": 3 * 8 + 1}  # max_batch 3 x 128
    window = json.loads((ckpt / "config.json").read_text()).get("sliding_window") if model_type == "gpt_oss" else 0
    if window:  # sliding layers: their own pool, two windows + one whole prompt + the scratch block
        assert tables[f"block_table_w{window}"]["blocks"] == 2 * (-(-window // 16) + 1) + 8 + 1 < 25
    assert len(tables) == 1 + bool(window)
    for prog in pj["programs"].values():
        names = [prog["buffers"][b]["name"] for b in prog["inputs"]]
        assert names[-len(tables):] == [t["name"] for t in pages["tables"]]
        # a table is an input of kind block_table (IR structure, passes/paged_kv.py), not a name prefix
        kinds = [prog["buffers"][b].get("input_kind") for b in prog["inputs"]]
        assert kinds == [None] * (len(kinds) - len(tables)) + ["block_table"] * len(tables)
        kv = [b for b in prog["buffers"] if b.get("state") and b["alias_of"] is None]
        assert kv and all(b["zone"] == "kv_pages" and any(t["blocks"] * 16 in b["shape"] for t in tables.values())
                          for b in kv)
        assert prog["memory"]["zones"].get("kv_cache", 0) == 0
    assert report["patterns"]["paged_kv_write"] >= 2

    rt = load(art)
    prefill = rt.programs["prefill"]
    assert prefill.table_inputs == [t["name"] for t in pages["tables"]]
    for b in prefill.buffers:  # every row of every pool: NaN
        if b["zone"] == "kv_pages" and b.get("state") and b["alias_of"] is None:
            prefill.view(b["id"], ()).fill_(float("nan"))
    for c in rt.kv.classes:
        random.Random(7).shuffle(c.free)
    model = _upstream(ckpt)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, model.config.vocab_size, (37,), generator=g).tolist()
    out = rt.generate(prompt, max_new_tokens=12)
    table = rt.kv.tables[0][:4].tolist()
    assert table[3] == 0 and 0 not in table[:3] and table[:3] != [1, 2, 3]  # 48 tokens in 3 shuffled blocks
    assert out == _greedy(model, prompt, 12)
    if window:  # 48 tokens written; the sliding pool keeps only the blocks the next query can see
        held = rt.kv.owned(0, f"block_table_w{window}")
        assert len(held) <= -(-window // 16) + 1 and rt.kv.table(f"block_table_w{window}", 0)[0] == 0
    # a second turn appends to the request's blocks: the history is never prefilled again
    turn = torch.randint(0, model.config.vocab_size, (5,), generator=g).tolist()
    more = rt.generate(turn, max_new_tokens=4, append=True)
    assert more == _greedy(model, prompt + out + turn, 4)
    assert rt.kv.tables[0][:3].tolist() == table[:3]


@pytest.mark.slow
def test_full_pool_fails_one_request_and_freed_blocks_serve_the_next(tmp_path):
    """A pool of 5 blocks (80 tokens) for 3 requests of 14 + 12 tokens (2 blocks each): each prefill takes one
    block; at position 16 two requests get their second block and the third finds the pool empty: it alone gets
    the error, the others finish with upstream's tokens. Its block is freed; once a finished request is reset the
    third runs and its blocks are ones the others held before."""
    from dayzero.runtime import load
    from dayzero.runtime.executor import generate_batch
    from dayzero.tools.driver import compile_model
    from dayzero.tools.make_tiny import make_tiny

    ckpt = make_tiny("qwen3_moe", tmp_path / "ckpt", seed=0)
    compile_model(str(ckpt), tmp_path / "art", max_seq=SHARED_MAX_SEQ, max_batch=3, kv_blocks=6)
    rt = load(tmp_path / "art")
    assert rt.kv.stats() == {"block_table": {"block_size": 16, "window": 0, "blocks": 5, "used": 0, "free": 5}}
    model = _upstream(ckpt)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, model.config.vocab_size, (14,), generator=g).tolist() for _ in range(3)]
    res = generate_batch(rt, prompts, max_new_tokens=12)
    assert [r["error"] is None for r in res] == [True, True, False]
    assert "KV cache full" in res[2]["error"] and "--kv-blocks" in res[2]["error"]
    for p, r in zip(prompts[:2], res[:2]):
        assert r["tokens"] == _greedy(model, p, 12)
    assert rt.kv.stats()["block_table"]["used"] == 4 and rt.kv.owned(2) == []
    held = set(rt.kv.owned(0))
    rt.reset(0)
    out = rt.generate(prompts[2], max_new_tokens=12, slot=2)
    assert out == _greedy(model, prompts[2], 12)
    assert set(rt.kv.owned(2)) & held  # freed blocks are handed out again


def test_bad_kv_options_are_user_errors(tmp_path):
    from dayzero import UserError
    from dayzero.tools.driver import compile_model

    with pytest.raises(UserError, match="--kv-blocks"):
        compile_model("x", tmp_path / "a", kv_blocks=1)
    with pytest.raises(UserError, match="--kv-block-size"):
        compile_model("x", tmp_path / "a", kv_block_size=-1)
    assert not (tmp_path / "a").exists()
