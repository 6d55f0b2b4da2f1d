"""sparse_attention: the pattern fires on the prefill and decode programs of every cached architecture, and the
kernels equal their torch references while reading only the rows a query sees.

End-to-end generation equality (artifact vs upstream, with these ops in both programs) is tests/test_generate.py.
"""

from __future__ import annotations

import pytest
import torch
import tvm
from hypothesis import given, settings
from hypothesis import strategies as st

from dayzero.codegen.kernels.attention import build
from dayzero.passes import sparse_attention as sa
from dayzero.passes.ir import ops, reference_attention as ra
from conftest import SHARED_MAX_SEQ

HOST = {"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu()}


# ---- the pattern on traced upstream graphs -------------------------------------------------------------------

MAX_SEQ = SHARED_MAX_SEQ  # the shared artifacts' length: the session's trace cache already holds these traces

EXPECTED = {  # architecture -> (op, layers, {window: count}, sinks)
    "qwen3_moe": (sa.DENSE, 2, {0: 2}, False),
    "gpt_oss": (sa.DENSE, 2, {8: 1, 0: 1}, True),  # sliding_attention (window 8) + full_attention, both with sinks
    "deepseek_v32": (sa.MLA, 2, {0: 2}, False),  # DSA in both layers (index_topk 4) over the MLA latent cache
}


@pytest.fixture(scope="module", params=sorted(EXPECTED))
def programs(request, tmp_path_factory):
    from dayzero.tools.compiler import run_pipeline
    from dayzero.tools.driver import trace_model
    from dayzero.tools.make_tiny import make_tiny

    ckpt = make_tiny(request.param, tmp_path_factory.mktemp(request.param) / "ckpt", seed=0)
    fe = trace_model(str(ckpt), MAX_SEQ)
    return request.param, {"prefill": run_pipeline(fe.traced.graph, verify=True),
                           "decode": run_pipeline(fe.decode.graph, verify=True)}


@pytest.mark.slow
@pytest.mark.parametrize("which", ["prefill", "decode"])
def test_pattern_fires(programs, which):
    arch, progs = programs
    g, found = progs[which]
    op, layers, windows, sinks = EXPECTED[arch]
    nodes = [n for n in g.nodes() if n.op == op]
    assert found.patterns.get(f"sparse_attention.{op}") == layers == len(nodes)
    assert not [n for n in g.nodes() if n.op == "scaled_dot_product_attention"]  # nothing left dense
    got: dict[int, int] = {}
    for n in nodes:
        got[n.attr.get("window", 0)] = got.get(n.attr.get("window", 0), 0) + 1
        k = n.inputs[1]
        assert k.shape[2] == MAX_SEQ  # reads the cache (max_len rows) through qpos / idx, never a copy of it
        if op == sa.DENSE:
            assert k.op == "state_index_put" and n.attr["sinks"] == sinks
        elif op == sa.MLA:  # the latent and rope caches themselves, never an expansion of them
            assert k.op == n.inputs[2].op == "state_index_put" and n.attr["nope"] == 16
            assert n.inputs[5].shape[-1] == 4 and n.inputs[5].dtype == "int64"
        else:
            assert n.inputs[4].shape[-1] == 4 and n.inputs[4].dtype == "int64"
        seq = n.inputs[0].shape[2]
        assert (seq == 1) == (which == "decode")
    assert got == windows
    # nothing is computed over every cache row but the indexer scores: no kv_b_proj over the latent cache
    assert not [m for m in g.nodes() if m.op == "linear" and m.inputs[0].op == "state_index_put"]
    if op == sa.MLA:  # the indexer is one fused op per layer; no generic top-k over the cache rows is left
        assert found.patterns.get(f"sparse_attention.{sa.INDEXER}") == layers
        assert not [m for m in g.nodes() if m.op == "topk" and m.inputs[0].shape[-1] == MAX_SEQ]
        for m in g.nodes():
            if m.op == sa.INDEXER:
                assert m.inputs[2].op == "state_index_put" and m.attr["k"] == 4 and m.attr["sorted"]


# ---- kernels vs references -----------------------------------------------------------------------------------

def _run(p: dict, ins: list[torch.Tensor], kind: str = "llvm") -> torch.Tensor:
    f = build(p, kind)
    lib = tvm.compile(tvm.IRModule({"main": f}), target=HOST)
    o = torch.full((p["B"], p["Hq"], ins[0].shape[2], p["Dv"]), float("nan"))
    lib["main"](*ins, o)
    return o


def _dense_params(S, L, W, sinks, Hq=4, Hkv=2, D=16, Dv=16):
    return dict(op=sa.DENSE, B=1, Hq=Hq, Hkv=Hkv, S=S if S == 1 else None, L=L, D=D, Dv=Dv, dtype="float32",
                out_dtype="float32", pos_dtype="int64", scale=0.25, window=W, sinks=sinks, sink_dtype="float32")


@pytest.mark.parametrize("S,start,W,sinks", [
    (1, 0, 0, False),     # first decode step: one row
    (1, 20, 0, False),
    (1, 63, 0, True),     # last cache row
    (1, 3, 8, True),      # window longer than the history
    (1, 7, 8, True),      # window edge: rows 0..7 exactly
    (1, 30, 8, True),     # rows 23..30
    (1, 30, 1, False),    # a window of one row
    (37, 0, 0, False),    # prefill from position 0 (blocked: 3 query blocks, last one partial)
    (37, 5, 8, True),     # prefill after a cached prefix, windowed, sinks
    (16, 48, 0, True),    # one full block ending at the last row
])
def test_dense_kernel_matches_reference(S, start, W, sinks):
    g = torch.Generator().manual_seed(S * 100 + start)
    p = _dense_params(S, 64, W, sinks)
    q = torch.randn(1, 4, S, 16, generator=g)
    k, v = torch.randn(1, 2, 64, 16, generator=g), torch.randn(1, 2, 64, 16, generator=g)
    qpos = torch.arange(S) + start
    ins = [q, k, v, qpos] + ([torch.randn(4, generator=g)] if sinks else [])
    ref = ra.dense_reference(ins, {"scale": 0.25, "window": W, "sinks": sinks})
    # rows no query may see hold NaN: the kernel must never read them
    hidden = ~ra.valid_positions(64, qpos, W).any(0)
    k[:, :, hidden], v[:, :, hidden] = float("nan"), float("nan")
    torch.testing.assert_close(_run(p, ins), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("S,Hq,Hkv,D,Dv,start,W,sinks", [
    (1, 8, 1, 64, 64, 40, 0, True),    # gpt-oss's heads: 8 queries a KV head, D = 4 vectors of 16 lanes
    (1, 8, 2, 64, 32, 63, 24, False),  # a window that starts and ends inside 16-row blocks
    (1, 6, 2, 24, 16, 37, 0, False),   # D = 3 vectors of 8 lanes, 3 heads a group
    (1, 4, 4, 8, 8, 5, 3, True),       # no grouping, fewer rows than a block
    (21, 8, 1, 64, 64, 30, 0, True),   # prefill: 4 queries x 8 heads a task, the last block of queries partial
    (19, 6, 2, 24, 16, 0, 5, False),   # prefill from row 0, a window: blocks a query sees none of
])
def test_blocked_kernels_at_model_head_dims(S, Hq, Hkv, D, Dv, start, W, sinks):
    """The blocked kernels (decode: one task per KV head and query; prefill: per KV head and block of queries;
    the rows in blocks of 16) at head counts and widths the other cases do not reach: several lane vectors per
    score, partial blocks, unread rows NaN."""
    g = torch.Generator().manual_seed(Hq * D + start)
    p = _dense_params(S, 64, W, sinks, Hq=Hq, Hkv=Hkv, D=D, Dv=Dv)
    q = torch.randn(1, Hq, S, D, generator=g)
    k, v = torch.randn(1, Hkv, 64, D, generator=g), torch.randn(1, Hkv, 64, Dv, generator=g)
    qpos = torch.arange(S) + start
    ins = [q, k, v, qpos] + ([torch.randn(Hq, generator=g)] if sinks else [])
    ref = ra.dense_reference(ins, {"scale": 0.25, "window": W, "sinks": sinks})
    hidden = ~ra.valid_positions(64, qpos, W).any(0)
    k[:, :, hidden], v[:, :, hidden] = float("nan"), float("nan")
    torch.testing.assert_close(_run(p, ins), ref, rtol=1e-5, atol=1e-5)


def _sparse_case(S, start, K, L=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, S, 24, generator=g)
    k, v = torch.randn(1, 4, L, 24, generator=g), torch.randn(1, 4, L, 16, generator=g)
    qpos = torch.arange(S) + start
    idx = torch.stack([_distinct_with(int(qpos[s]), K, L, g) for s in range(S)])[None]
    return q, k, v, qpos, idx


def _distinct_with(pos: int, K: int, L: int, g) -> torch.Tensor:
    """K distinct rows including ``pos`` (a top-k over the visible rows always holds at least one of them)."""
    rest = torch.randperm(L, generator=g)
    rest = rest[rest != pos][:K - 1]
    return torch.cat([torch.tensor([pos]), rest])[torch.randperm(K, generator=g)]


@pytest.mark.parametrize("S,start,K", [
    (1, 40, 4),   # decode, some selected rows in the future (masked)
    (1, 1, 8),    # k larger than the valid length (2 rows visible): the rest point past qpos
    (1, 63, 4),
    (30, 2, 4),   # prefill: per-query indices
    (5, 0, 16),   # k larger than every query's valid length
])
def test_sparse_kernel_matches_reference(S, start, K):
    q, k, v, qpos, idx = _sparse_case(S, start, K, seed=S + start + K)
    p = dict(op=sa.SPARSE, B=1, Hq=4, Hkv=4, S=S if S == 1 else None, L=64, D=24, Dv=16, dtype="float32",
             out_dtype="float32", pos_dtype="int64", scale=0.2, K=K, idx_dtype="int64", window=0, sinks=False)
    ins = [q, k, v, qpos, idx]
    ref = ra.sparse_reference(ins, {"scale": 0.2})
    read = torch.zeros(64, dtype=torch.bool)
    for s in range(S):
        read[idx[0, s][idx[0, s] <= qpos[s]]] = True
    k[:, :, ~read], v[:, :, ~read] = float("nan"), float("nan")  # unselected rows are never read
    torch.testing.assert_close(_run(p, ins), ref, rtol=1e-5, atol=1e-5)


def test_decode_reads_rows_not_max_len():
    """A 64K-row cache, 10 rows written: every other row is NaN and the kernel still returns the reference."""
    L = 65536
    p = _dense_params(1, L, 0, False)
    q = torch.randn(1, 4, 1, 16)
    k, v = torch.full((1, 2, L, 16), float("nan")), torch.full((1, 2, L, 16), float("nan"))
    k[:, :, :10], v[:, :, :10] = torch.randn(1, 2, 10, 16), torch.randn(1, 2, 10, 16)
    qpos = torch.tensor([9])
    ref = ra.dense_reference([q, k[:, :, :10], v[:, :, :10], qpos], {"scale": 0.25, "window": 0, "sinks": False})
    torch.testing.assert_close(_run(p, [q, k, v, qpos]), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op,S", [(sa.DENSE, 1), (sa.DENSE, None), (sa.SPARSE, 1), (sa.SPARSE, None)])
def test_cuda_sm90_compiles(op, S):
    p = (_dense_params(S or 2, 64, 8, True) if op == sa.DENSE else
         dict(op=sa.SPARSE, B=1, Hq=4, Hkv=4, S=S, L=64, D=24, Dv=16, dtype="float32", out_dtype="float32",
              pos_dtype="int64", scale=0.2, K=4, idx_dtype="int64", window=0, sinks=False))
    p["S"] = S
    f = build(p, "cuda").with_attr("tirx.is_scheduled", True)
    lib = tvm.compile(tvm.IRModule({"main": f}), target={"kind": "cuda", "arch": "sm_90"})
    src = lib.mod.imports[0].inspect_source()
    assert "__global__" in src and "threadIdx.x" in src  # one thread per query (one block when it fits)


def _mla_case(S, start, K, B=1, H=4, L=64, R=32, nope=16, Dr=8, Dv=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, nope + Dr, generator=g)
    lat, rope = torch.randn(B, 1, L, R, generator=g), torch.randn(B, 1, L, Dr, generator=g)
    w = torch.randn(H * (nope + Dv), R, generator=g) * R ** -0.5
    qpos = torch.arange(S) + start
    idx = torch.stack([torch.stack([_distinct_with(int(qpos[s]), K, L, g) for s in range(S)]) for _ in range(B)])
    return q, lat, rope, w, qpos, idx


@pytest.mark.parametrize("S,start,K,B,H", [
    (1, 40, 4, 1, 4),   # decode, some selected rows in the future (masked)
    (1, 1, 8, 1, 4),    # k larger than the valid length
    pytest.param(1, 63, 4, 2, 4, marks=pytest.mark.slow),  # last row, batch 2 (each batch row its own cache and indices)
    (30, 2, 4, 1, 4),   # prefill: per-query indices
    (1, 50, 8, 1, 32),  # 32 heads: 8 tasks of 4 heads, each selected row read once per group
    (9, 20, 4, 2, 32),  # prefill with head groups, batch 2
])
def test_mla_kernel_matches_upstream_expansion(S, start, K, B, H):
    """The absorbed kernel equals attention over upstream's expanded K/V (mla_expand) restricted to idx, and
    reads only the selected latent rows."""
    from dayzero.codegen.kernels.attention import mla_head_group

    assert mla_head_group(H, "llvm") == (4 if H == 32 else 1)
    q, lat, rope, w, qpos, idx = _mla_case(S, start, K, B=B, H=H, seed=S + start + K + B)
    ins = [q, lat, rope, w, qpos, idx]
    ref = ra.mla_sparse_reference(ins, {"scale": 0.2, "nope": 16})
    read = torch.zeros(B, 64, dtype=torch.bool)
    for b in range(B):
        for s in range(S):
            read[b, idx[b, s][idx[b, s] <= qpos[s]]] = True
    lat[~read[:, None]], rope[~read[:, None]] = float("nan"), float("nan")
    p = dict(op=sa.MLA, B=B, H=H, S=S if S == 1 else None, L=64, R=32, Dn=16, Dr=8, Dv=16, K=K,
             dtype="float32", lat_dtype="float32", w_dtype="float32", out_dtype="float32", pos_dtype="int64",
             idx_dtype="int64", scale=0.2)
    lib = tvm.compile(tvm.IRModule({"main": build(p, "llvm")}), target=HOST)
    o = torch.full((B, H, S, 16), float("nan"))
    lib["main"](*ins, o)
    torch.testing.assert_close(o, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("S,R,Dr", [(1, 128, 32), (None, 96, 24)])
def test_mla_kernel_at_wider_latents(S, R, Dr):
    """The absorbed kernel's vector dot products (scores over latent + rope in 16 / 8 lanes, the value
    up-projection over the latent) at widths where each takes several vectors, decode and prefill."""
    n = 1 if S == 1 else 7
    q, lat, rope, w, qpos, idx = _mla_case(n, 20, 8, H=8, R=R, nope=16, Dr=Dr, Dv=16, seed=R)
    ins = [q, lat, rope, w, qpos, idx]
    ref = ra.mla_sparse_reference(ins, {"scale": 0.2, "nope": 16})
    p = dict(op=sa.MLA, B=1, H=8, S=S, L=64, R=R, Dn=16, Dr=Dr, Dv=16, K=8, dtype="float32", lat_dtype="float32",
             w_dtype="float32", out_dtype="float32", pos_dtype="int64", idx_dtype="int64", scale=0.2)
    lib = tvm.compile(tvm.IRModule({"main": build(p, "llvm")}), target=HOST)
    o = torch.full((1, 8, n, 16), float("nan"))
    lib["main"](*ins, o)
    torch.testing.assert_close(o, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("S,H,K,dense", [(37, 64, 21, False), (5, 128, 19, False), (19, 64, 0, True)])
def test_mla_cpu_tiles_head_groups_query_blocks_and_per_request_tables(S, H, K, dense):
    """The CPU kernel's blocking (codegen/kernels/mla_cpu.py) where each part of it is exercised: groups of 8 and
    16 heads (scores as vectors over the heads), tiles of JT rows (row_tiles) with a partial last one, more
    queries than a block of SB (W applied per block, a partial last block), and every query reading its own
    request's rows through its own table row (the batched decode step) from a pool whose rows no query may read
    are NaN; equal, query by query, to attention over upstream's expansion of that request's cache (mla_expand)."""
    from dayzero.codegen.kernels import mla_cpu, row_tiles
    from dayzero.codegen.kernels.attention import mla_head_group

    L, R, Dr, nope, Dv, bs = 48, 64, 16, 32, 32, 16
    assert mla_head_group(H, "llvm") == H // 8 and (S > mla_cpu.SB or H == 128) and K % row_tiles.JT != 0 or dense
    g = torch.Generator().manual_seed(S + H + K)
    nb = L // bs
    blocks = S * nb + 1
    q = torch.randn(1, H, S, nope + Dr, generator=g)
    w = torch.randn(H * (nope + Dv), R, generator=g) * R ** -0.5
    table = (torch.randperm(blocks - 1, generator=g) + 1).view(S, nb).int()  # request s owns blocks table[s]
    qpos = torch.randint(L // 2, L, (S,), generator=g)
    lat_pool = torch.full((1, 1, blocks * bs, R), float("nan"))
    rope_pool = torch.full((1, 1, blocks * bs, Dr), float("nan"))
    caches, idx = [], torch.zeros((1, S, K), dtype=torch.int64)
    for s in range(S):
        lat, rope = torch.randn(1, 1, L, R, generator=g), torch.randn(1, 1, L, Dr, generator=g)
        caches.append((lat, rope))
        rows = table[s].long().repeat_interleave(bs) * bs + torch.arange(L) % bs  # pool row of each position
        seen = torch.arange(L) <= qpos[s]  # a row past the request's position stays NaN: never read
        lat_pool[0, 0, rows[seen]], rope_pool[0, 0, rows[seen]] = lat[0, 0, seen], rope[0, 0, seen]
        if not dense:  # distinct rows, some in the future (masked)
            idx[0, s] = torch.randperm(L, generator=g)[:K]
    attrs = {"scale": 0.2, "nope": nope}
    ref = torch.cat([(ra.mla_dense_reference([q[:, :, s:s + 1], *caches[s], w, qpos[s:s + 1]], attrs) if dense else
                      ra.mla_sparse_reference([q[:, :, s:s + 1], *caches[s], w, qpos[s:s + 1], idx[:, s:s + 1]],
                                              attrs)) for s in range(S)], dim=2)
    p = dict(op=sa.MLA_DENSE if dense else sa.MLA, B=1, H=H, S=None, L=L, R=R, Dn=nope, Dr=Dr, Dv=Dv, K=K,
             dense=dense, dtype="float32", lat_dtype="float32", w_dtype="float32", out_dtype="float32",
             pos_dtype="int64", idx_dtype=None if dense else "int64", scale=0.2, paged=bs, P=blocks * bs, NT=nb,
             table_dtype="int32", per_token=True)
    lib = tvm.compile(tvm.IRModule({"main": build(p, "llvm")}), target=HOST)
    o = torch.full((1, H, S, Dv), float("nan"))
    lib["main"](q, lat_pool, rope_pool, w, qpos, *([] if dense else [idx]), table, o)
    torch.testing.assert_close(o, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("S", [1, None])
def test_mla_cuda_sm90_compiles(S):
    p = dict(op=sa.MLA, B=1, H=4, S=S, L=64, R=32, Dn=16, Dr=8, Dv=16, K=4, dtype="float32", lat_dtype="float32",
             w_dtype="float32", out_dtype="float32", pos_dtype="int64", idx_dtype="int64", scale=0.2)
    f = build(p, "cuda").with_attr("tirx.is_scheduled", True)
    lib = tvm.compile(tvm.IRModule({"main": f}), target={"kind": "cuda", "arch": "sm_90"})
    assert "__global__" in lib.mod.imports[0].inspect_source()


# ---- the indexer kernel vs torch ------------------------------------------------------------------------------

_IX_LIBS: dict = {}


def _indexer_lib(B, S, Hi, Di, L, K, sorted_=True, rate=1, kind="llvm"):
    from dayzero.codegen.kernels import indexer

    key = (B, S, Hi, Di, L, K, sorted_, rate)
    if key not in _IX_LIBS:
        p = dict(op=sa.INDEXER, B=B, S=S if S == 1 else None, Hi=Hi, Di=Di, L=L, K=K, sorted=sorted_, scale=0.25,
                 fill=float("-inf"), rate=rate, q_dtype="float32", w_dtype="float32", k_dtype="float32",
                 pos_dtype="int64")
        _IX_LIBS[key] = tvm.compile(tvm.IRModule({"main": indexer.build(p, kind)}), target=HOST)["main"]
    return _IX_LIBS[key]


def _indexer_check(B, S, Hi, Di, L, K, start, sorted_=True, seed=0, values=3, rate=1):
    """Small-integer q/k/w and a power-of-two scale make every score exact whatever the summation order, so
    the kernel must return torch.topk's indices exactly: ReLU zeros and equal sums give many ties."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *sh: torch.randint(-values, values + 1, sh, generator=g).float()  # noqa: E731
    q, w, keys = r(B, S, Hi, Di), r(B, S, Hi), r(B, L, Di)
    qpos = torch.arange(S) + start
    attrs = {"scale": 0.25, "k": K, "sorted": sorted_, "fill": float("-inf"), "rate": rate}
    ref = ra.indexer_reference([q, w, keys, qpos], attrs)
    out = torch.full((B, S, K), -1, dtype=torch.int64)
    _indexer_lib(B, S, Hi, Di, L, K, sorted_, rate)(q, w, keys, qpos, out)
    assert torch.equal(out, ref), (out, ref)


@pytest.mark.parametrize("B,S,L,K,start,sorted_", [
    (1, 1, 64, 4, 40, True),      # decode, nth_element + sort path (k*64 > L)
    (1, 1, 64, 4, 2, True),       # fewer visible rows than k: -inf ties decide the tail, as in torch
    pytest.param(2, 1, 4096, 4, 3000, True, marks=pytest.mark.slow),  # partial_sort (heap select) path, batch 2, 4 chunks of key rows
    pytest.param(1, 1, 5000, 300, 4999, True, marks=pytest.mark.slow),  # large k: introsort of the selected rows with its depth-limited recursion
    (1, 1, 300, 40, 299, False),  # sorted=False: nth_element order
    pytest.param(1, 37, 64, 4, 0, True, marks=pytest.mark.slow),  # prefill from 0: 5 query blocks, the last partial
    pytest.param(2, 9, 128, 16, 50, False, marks=pytest.mark.slow),  # prefill after a cached prefix, batch 2
])
def test_indexer_kernel_equals_torch_topk(B, S, L, K, start, sorted_):
    _indexer_check(B, S, 8, 16, L, K, start, sorted_, seed=B + S + L + K)


@pytest.mark.parametrize("B,S,L,K,start,rate", [
    (1, 1, 65, 2, 40, 4),         # decode over compressed keys (DeepSeek-V4's CSA, rate 4): keys j < 41 // 4
    (1, 1, 320, 2, 250, 4),       # partial_sort path: the top-k reads max(visible, k) rows, not L
    (1, 1, 320, 5, 9, 4),         # two visible keys, k 5: -inf rows past them complete the top-k, as in torch
    (1, 1, 320, 2, 2, 4),         # no complete window yet: every score -inf
    pytest.param(1, 37, 320, 2, 0, 4, marks=pytest.mark.slow),  # prefill from 0, the first queries see nothing
    pytest.param(2, 9, 129, 3, 100, 8, marks=pytest.mark.slow),  # prefill after a prefix, rate 8, batch 2
    pytest.param(1, 1, 4096, 4, 1000, 1, marks=pytest.mark.slow),  # rate 1: a query reads rows <= qpos only
])
def test_indexer_kernel_rate_equals_torch_topk(B, S, L, K, start, rate):
    """Rate R: key j is visible iff j < (qpos + 1) // R (upstream V4's ``future_mask``); the kernel scores the
    visible keys only and still returns torch.topk's indices over the whole -inf-filled row, ties included."""
    _indexer_check(B, S, 8, 16, L, K, start, True, seed=B + S + L + K, rate=rate)


def test_topk_prefix_equals_the_whole_row():
    """topk_exact's ``scan``: on the partial_sort path, a row whose tail is -inf selects as its first
    max(visible, k) entries do (exact ties included), so the indexer's top-k costs its visible rows only."""
    from dayzero.codegen.kernels.topk_exact import python_topk

    g = torch.Generator().manual_seed(0)
    for k, n in [(1, 64), (2, 128), (2, 200), (3, 192), (5, 400)]:
        for nv in (0, 1, k - 1, k, k + 1, n // 2, n - 1, n):
            for values in (0, 2):  # 0: every visible score ties
                row = torch.randint(-values, values + 1, (n,), generator=g).float()
                row[nv:] = float("-inf")
                want = torch.topk(row, k).indices.tolist()
                assert python_topk(row.tolist(), k, True, scan=min(n, max(nv, k))) == want, (k, n, nv, values)


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), values=st.integers(0, 3), start=st.integers(0, 299))
def test_indexer_ties_hypothesis(seed, values, start):
    """Random tie-heavy data (values 0: every score 0; 1: few distinct sums) on both top-k paths."""
    _indexer_check(1, 1, 4, 8, 300, 4, start, True, seed=seed, values=values)   # nth_element + sort
    _indexer_check(1, 1, 4, 8, 320, 5, start, True, seed=seed, values=values)   # partial_sort (5*64 <= 320)


@pytest.mark.parametrize("L,K", [(65, 2), (320, 5)])  # nth_element + sort; partial_sort (k * 64 <= L)
def test_per_row_indexer_gives_each_row_its_own_position(L, K):
    """DeepSeek-V4's row program (per_row): batch row b is request b, its one query at qpos[b], B symbolic (one
    kernel for every batch size); each row returns torch.topk's indices of that request alone, exactly (ties
    included), and the op's reference agrees; rows no query sees are NaN and never read."""
    from dayzero.codegen.kernels import indexer

    g = torch.Generator().manual_seed(L + K)
    r = lambda *sh: torch.randint(-3, 4, sh, generator=g).float()  # noqa: E731
    qpos = torch.tensor([40, 0, 250, 7, 17])
    B, Hi, Di, rate = len(qpos), 8, 16, 4
    q, w, keys = r(B, 1, Hi, Di), r(B, 1, Hi), r(B, L, Di)
    attrs = {"scale": 0.25, "k": K, "sorted": True, "fill": float("-inf"), "rate": rate}
    want = torch.cat([ra.indexer_reference([q[b:b + 1], w[b:b + 1], keys[b:b + 1], qpos[b:b + 1]], attrs)
                      for b in range(B)])
    assert torch.equal(ops.REGISTRY[sa.INDEXER].reference([q, w, keys, qpos], dict(attrs, per_row=True)), want)
    for b in range(B):
        keys[b, (int(qpos[b]) + 1) // rate:] = float("nan")
    p = dict(op=sa.INDEXER, B=None, S=1, per_row=True, Hi=Hi, Di=Di, L=L, K=K, sorted=True, scale=0.25,
             fill=float("-inf"), rate=rate, q_dtype="float32", w_dtype="float32", k_dtype="float32",
             pos_dtype="int64")
    f = tvm.compile(tvm.IRModule({"main": indexer.build(p, "llvm")}), target=HOST)["main"]
    for n in (B, 1):
        out = torch.full((n, 1, K), -1, dtype=torch.int64)
        f(q[:n], w[:n], keys[:n], qpos[:n], out)
        assert torch.equal(out, want[:n]), (n, out, want[:n])


@pytest.mark.parametrize("S,rate", [(1, 1), (None, 1), (None, 4), ("rows", 4)])
def test_indexer_cuda_sm90_compiles(S, rate):
    from dayzero.codegen.kernels import indexer

    p = dict(op=sa.INDEXER, B=1, S=S, Hi=8, Di=16, L=64, K=4, sorted=True, scale=0.25, fill=float("-inf"),
             rate=rate, q_dtype="float32", w_dtype="float32", k_dtype="float32", pos_dtype="int64")
    if S == "rows":  # the row-batched decode step: a symbolic batch, one query a row at its own position
        p.update(S=1, B=None, per_row=True)
    f = indexer.build(p, "cuda").with_attr("tirx.is_scheduled", True)
    lib = tvm.compile(tvm.IRModule({"main": f}), target={"kind": "cuda", "arch": "sm_90"})
    src = lib.mod.imports[0].inspect_source()
    assert "__global__" in src and "threadIdx.x" in src


class _UpstreamIndexer(torch.nn.Module):
    """DeepseekV32Indexer.forward's scoring and selection, on explicit inputs (``act`` is ReLU upstream)."""

    def __init__(self, L, act):
        super().__init__()
        self.L, self.act = L, act

    def forward(self, q, w, keys, pos):
        mask = torch.arange(self.L)[None, None, None, :] <= pos[None, None, :, None]
        scores = self.act(torch.matmul(q, keys.transpose(-1, -2).unsqueeze(1)) * 0.25)
        x = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)
        x = x.masked_fill(~mask[:, 0], float("-inf"))
        return x.topk(4, dim=-1).indices


@pytest.mark.parametrize("B,act,fires", [(1, torch.relu, True), (2, torch.relu, True),
                                         (1, torch.nn.functional.gelu, False)])
def test_indexer_pattern_on_a_traced_module(B, act, fires):
    """The match is on graph shape: upstream's formula traced from any module fuses (batch 1 and 2); with another
    activation it is left alone. Either way the graph computes what the module does (same indices)."""
    from dayzero.frontend.torch_export import export_module, to_graph
    from dayzero.passes.ir.interp import run_graph
    from dayzero.tools.compiler import run_pipeline

    g = torch.Generator().manual_seed(B)
    r = lambda *sh: torch.randint(-2, 3, sh, generator=g).float()  # noqa: E731  (exact scores, many ties)
    ins = (r(B, 5, 8, 16), r(B, 5, 8), r(B, 32, 16), torch.arange(5) + 10)
    m = _UpstreamIndexer(32, act)
    t = to_graph(export_module(m, ins))
    gr, found = run_pipeline(t.graph, verify=True)
    assert found.patterns.get(f"sparse_attention.{sa.INDEXER}", 0) == int(fires)
    assert bool([n for n in gr.nodes() if n.op == "topk"]) != fires
    out = run_graph(gr, dict(zip([n.attr["name"] for n in gr.inputs], ins)),
                    lambda name: t.weights.get(name, found.constants.get(name)))[0]
    assert torch.equal(out, m(*ins))


class _UpstreamV4Selection(torch.nn.Module):
    """DeepseekV4Indexer.forward's selection on explicit inputs: upstream's scorer module itself, then its
    future mask at rate R, top-k and -1 sentinel (modeling_deepseek_v4.py)."""

    def __init__(self, rate, k):
        from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4IndexerScorer

        super().__init__()
        cfg = DeepseekV4Config(hidden_size=8, index_n_heads=4, index_head_dim=16)  # scales 1/4 and 1/2: exact
        self.scorer, self.rate, self.k = DeepseekV4IndexerScorer(cfg), rate, k
        g = torch.Generator().manual_seed(rate)
        self.scorer.weights_proj.weight.data = torch.randint(-2, 3, (4, 8), generator=g).float()

    def forward(self, q, keys, hidden, pos):
        scores = self.scorer(q, keys, hidden)
        thr = (pos[None] + 1) // self.rate
        future = torch.arange(keys.shape[1]).view(1, 1, -1) >= thr.unsqueeze(-1)
        top = scores.masked_fill(future, float("-inf")).topk(self.k, dim=-1).indices
        return torch.where(top >= thr.unsqueeze(-1), torch.full_like(top, -1), top)


@pytest.mark.parametrize("start,rate", [(10, 4), (0, 8)])  # (0, 8): no window complete yet, every pick -1
def test_v4_indexer_pattern_on_upstream_scorer(start, rate):
    """Upstream's DeepseekV4IndexerScorer (heads summed by mul + sum, ReLU before the scale) under the future
    mask of compressed keys becomes dsa_indexer_topk with the rate; the graph computes what upstream does
    (the same indices and -1 sentinels, exact small-integer scores, many ties)."""
    from dayzero.frontend.torch_export import export_module, to_graph
    from dayzero.passes.ir.interp import run_graph
    from dayzero.tools.compiler import run_pipeline

    g = torch.Generator().manual_seed(start)
    r = lambda *sh: torch.randint(-2, 3, sh, generator=g).float()  # noqa: E731
    ins = (r(1, 6, 4, 16), r(1, 9, 16), r(1, 6, 8), torch.arange(6) + start)
    m = _UpstreamV4Selection(rate, 3)
    t = to_graph(export_module(m, ins))
    gr, found = run_pipeline(t.graph, verify=True)
    assert found.patterns.get(f"sparse_attention.{sa.INDEXER}", 0) == 1
    assert [n.attr["rate"] for n in gr.nodes() if n.op == sa.INDEXER] == [rate]
    assert not [n for n in gr.nodes() if n.op == "topk"]
    weights = {**t.weights, **found.constants}
    out = run_graph(gr, dict(zip([n.attr["name"] for n in gr.inputs], ins)), weights.get)[0]
    assert torch.equal(out, m(*ins))


class _UpstreamV4RowSelection(_UpstreamV4Selection):
    """The same selection in DeepSeek-V4's row program: one query per batch row, row b at pos[b]."""

    def forward(self, q, keys, hidden, pos):
        scores = self.scorer(q, keys, hidden)
        thr = (pos.view(-1, 1) + 1) // self.rate  # [B, 1]
        future = torch.arange(keys.shape[1]).view(1, 1, -1) >= thr.unsqueeze(-1)  # [B, 1, L]
        top = scores.masked_fill(future, float("-inf")).topk(self.k, dim=-1).indices
        return torch.where(top >= thr.unsqueeze(-1), torch.full_like(top, -1), top)


def test_v4_indexer_pattern_with_one_position_per_row():
    """The row-batched decode step's indexer (positions [B], one query a row) becomes dsa_indexer_topk with
    ``per_row``; the graph computes what upstream does row by row."""
    from dayzero.frontend.torch_export import export_module, to_graph
    from dayzero.passes.ir.interp import run_graph
    from dayzero.tools.compiler import run_pipeline

    g = torch.Generator().manual_seed(1)
    r = lambda *sh: torch.randint(-2, 3, sh, generator=g).float()  # noqa: E731
    ins = (r(3, 1, 4, 16), r(3, 9, 16), r(3, 1, 8), torch.tensor([30, 2, 13]))
    m = _UpstreamV4RowSelection(4, 3)
    t = to_graph(export_module(m, ins))
    gr, found = run_pipeline(t.graph, verify=True)
    assert found.patterns.get(f"sparse_attention.{sa.INDEXER}", 0) == 1
    assert [n.attr.get("per_row") for n in gr.nodes() if n.op == sa.INDEXER] == [True]
    weights = {**t.weights, **found.constants}
    out = run_graph(gr, dict(zip([n.attr["name"] for n in gr.inputs], ins)), weights.get)[0]
    assert torch.equal(out, m(*ins))
