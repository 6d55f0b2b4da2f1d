"""bf16 weights as the checkpoint stores them (frontend/lowprec.bind_bf16, passes/dequant.py, the
``dequant_linear_bf16`` kernels of codegen/kernels/dequant_linear.py).

A checkpoint's bf16 projection / LM head / embedding table stays bf16 in the arena (2 bytes an element, read from
the checkpoint as published) and is consumed by kernels that convert each element as they read it and accumulate in
fp32: exact, since every bf16 value is an fp32 value (the reference upcasts the same values).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")


def _host():
    from dayzero.targets.host import host_target_dict

    return host_target_dict()


def _numpy_linear(x: np.ndarray, w_bf16: "torch.Tensor") -> np.ndarray:
    """y = x @ W.T in float64, W the bf16 values read as float32 by numpy (an independent upcast)."""
    bits = w_bf16.view(torch.int16).numpy().astype(np.uint16).astype(np.uint32) << 16
    return x.astype(np.float64) @ bits.view(np.float32).astype(np.float64).T


@pytest.mark.parametrize("T,N,K", [(1, 37, 53), (1, 64, 2880), (3, 29, 97), (16, 61, 64)])
def test_the_decode_gemv_matches_numpy_at_odd_and_prime_shapes(T, N, K):
    from dayzero.codegen.kernels import dequant_linear

    f = dequant_linear.build({"fmt": "bf16", "N": N, "K": K, "T": T}, _host())
    g = torch.Generator().manual_seed(N * K + T)
    x = torch.randn(T, K, generator=g)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).bfloat16()
    y = torch.full((T, N), float("nan"))
    f(x, w, y)
    ref = _numpy_linear(x.numpy(), w)
    np.testing.assert_allclose(y.numpy(), ref, rtol=0, atol=2e-6 * np.abs(ref).max())


@pytest.mark.parametrize("N,K", [(6, 96), (64, 2880), (40, 1024)])
def test_eight_tokens_take_the_line_by_line_gemv_on_avx512_and_avx2(N, K):
    """On AVX-512 and on AVX2 a bf16 GEMV of 8 tokens (static, or a batched decode step's symbolic count of 5..8
    requests) is ``dequant/gemv_bf16.py``'s kernel (x split into even / odd columns: its buffer XP; rows in pairs
    of 16-lane vectors, or one at a time in 8 lanes), matching numpy at k blocks of 16..512 and tasks of 2..32
    rows; the rows past a symbolic count are not written."""
    from dayzero.codegen.kernels import dequant_linear
    from dayzero.codegen.kernels.dequant import gemv_bf16

    host = _host()
    if not gemv_bf16.lanes_for(host):
        pytest.skip("the kernel is AVX-512's and AVX2's")
    g = torch.Generator().manual_seed(N + K)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).bfloat16()
    for p, ts in (({"fmt": "bf16", "N": N, "K": K, "T": 8}, [8]),
                  ({"fmt": "bf16", "N": N, "K": K, "T": None, "t_max": 8}, [5, 8, 3])):
        assert "XP[" in dequant_linear.kernel(p, host).script() and \
            "XP[" not in dequant_linear.kernel(dict(p, t_max=12) if p["T"] is None else dict(p, T=4), host).script()
        f = dequant_linear.build(p, host)
        for t in ts:
            x = torch.randn(t, K, generator=g)
            rows = torch.full((8, N), float("nan"))  # y is its first t rows: the kernel writes no others
            y = rows[:t]
            f(x, w, y)
            ref = _numpy_linear(x.numpy(), w)
            np.testing.assert_allclose(y.numpy(), ref, rtol=0, atol=2e-6 * np.abs(ref).max())
            assert bool(rows[t:].isnan().all())


def test_the_prefill_gemm_serves_every_token_count_from_one_kernel():
    from dayzero.codegen.kernels import dequant_linear

    N, K = 67, 131  # primes: no tile divides them
    f = dequant_linear.build({"fmt": "bf16", "N": N, "K": K, "T": None}, _host())
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).bfloat16()
    for T in (1, 5, 70, 131):  # within one token tile, across tiles, a partial last tile
        x = torch.randn(T, K, generator=g)
        y = torch.full((T, N), float("nan"))
        f(x, w, y)
        ref = _numpy_linear(x.numpy(), w)
        np.testing.assert_allclose(y.numpy(), ref, rtol=0, atol=2e-6 * np.abs(ref).max(), err_msg=f"T={T}")


def test_the_op_reference_is_the_upcast_weight():
    from dayzero.passes.ir.ops import get

    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 53, generator=g)
    w = torch.randn(37, 53, generator=g).bfloat16()
    y = get("dequant_linear_bf16").reference([x, w], {"N": 37, "K": 53})
    ref = _numpy_linear(x.numpy(), w)  # fp32 sums in another order: a few ulp of the largest output apart
    np.testing.assert_allclose(y.numpy(), ref, rtol=0, atol=2e-6 * np.abs(ref).max())


@pytest.mark.slow
def test_a_bf16_checkpoint_keeps_its_projections_and_tables_bf16_in_the_arena_and_matches_upstream(
        lowprec_tiny, tmp_path):
    from click.testing import CliRunner

    from dayzero.runtime import load
    from dayzero.tools.cli import main
    from dayzero.tools.compare import compare
    from dayzero.tools.driver import compile_model

    from _lowprec_ref import to_bf16_checkpoint

    ckpt = to_bf16_checkpoint(lowprec_tiny("gpt_oss", "mxfp4"), tmp_path / "ckpt")  # MXFP4 experts, bf16 else
    art = tmp_path / "art"
    compile_model(str(ckpt), art, max_seq=16, max_batch=2)
    tensors = json.loads((art / "weights.json").read_text())["tensors"]
    dtypes = {k: v["dtype"] for k, v in tensors.items()}
    for name in ("lm_head.weight", "embed_tokens.weight", "layers.0.self_attn.q_proj.weight",
                 "layers.1.self_attn.o_proj.weight"):
        key = next(k for k in dtypes if k.endswith(name))
        assert dtypes[key] == "bfloat16", (key, dtypes[key])
    # read by other kernels than a linear's or an embedding's: kept fp32 (converted at load)
    assert dtypes[next(k for k in dtypes if k.endswith("layers.0.input_layernorm.weight"))] == "float32"

    # the arena: each bf16 weight buffer takes 2 bytes an element (the weights zone is their sum, 64-byte aligned)
    from dayzero.passes.ir.ops import DTYPE_BYTES

    programs = json.loads((art / "program.json").read_text())["programs"]
    held = {b["weight"]: b for p in programs.values() for b in p["buffers"] if b.get("weight") and
            b["zone"] == "weights"}  # placed once by name for every program
    assert held[next(k for k in held if k.endswith("lm_head.weight"))]["dtype"] == "bfloat16"
    nbytes = [int(np.prod(b["shape"])) * DTYPE_BYTES[b["dtype"]] for b in held.values()]
    for name, prog in programs.items():
        assert sum(nbytes) <= prog["memory"]["zones"]["weights"] <= sum(-(-n // 64) * 64 for n in nbytes), name
        assert {k["op"] for k in prog["kernels"].values()} >= {"dequant_linear_bf16", "embedding"}, name

    rt = load(art)

    res = compare(str(ckpt), str(art))
    assert res["ok"], res
    out = rt.generate([1, 2, 3, 4], max_new_tokens=4)
    for i, tok in enumerate(out):  # decode (the T = 1 GEMV) agrees with a prefill (the GEMM)
        rt.reset()
        assert int(rt.prefill(torch.tensor([[1, 2, 3, 4, *out[:i]]]))[0, -1].argmax()) == tok
    r = CliRunner().invoke(main, ["compare", str(ckpt), str(art), "--streamed", "--seq-len", "4", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["ok"]


@pytest.mark.parametrize("T,G,N,K", [(1, 8, 16, 64), (2, 3, 5, 37), (None, 4, 24, 48)])
def test_the_grouped_kernel_reads_each_row_group_against_its_own_columns(T, G, N, K):
    """groups = G: rows [g N, (g+1) N) of W take x's columns [g K, (g+1) K) (a grouped projection such as
    DeepSeek-V4's o_a_proj); the GEMV (static T) and the GEMM (symbolic T, run at 1 and 37 tokens) against numpy
    group by group."""
    from dayzero.codegen.kernels import dequant_linear

    f = dequant_linear.build({"fmt": "bf16", "N": G * N, "K": K, "T": T, "groups": G}, _host())
    for t in ([T] if T else [1, 37]):
        g = torch.Generator().manual_seed(G * N * K + t)
        x = torch.randn(t, G * K, generator=g)
        w = (torch.randn(G * N, K, generator=g) * K ** -0.5).bfloat16()
        y = torch.full((t, G * N), float("nan"))
        f(x, w, y)
        ref = np.concatenate([_numpy_linear(x[:, i * K:(i + 1) * K].numpy(), w[i * N:(i + 1) * N])
                              for i in range(G)], axis=1)
        np.testing.assert_allclose(y.numpy(), ref, rtol=0, atol=2e-6 * np.abs(ref).max())


@pytest.mark.slow
def test_a_grouped_bf16_projection_stays_bf16_and_is_not_permuted_each_step(lowprec_tiny, tmp_path):
    """DeepSeek-V4's o_a_proj reads its bf16 weight [G N, K] as [G, N, K] transposed into a bmm: it stays bf16 in the
    arena as stored and becomes one grouped dequant_linear_bf16, so no step copies a weight (the fp32 permute of
    134 MB per layer and step at V4-Flash's widths); the artifact matches upstream."""
    from dayzero.tools.compare import compare
    from dayzero.tools.driver import compile_model

    from _lowprec_ref import to_bf16_checkpoint

    ckpt = to_bf16_checkpoint(lowprec_tiny("deepseek_v4", "mxfp4"), tmp_path / "ckpt")
    art = tmp_path / "art"
    compile_model(str(ckpt), art, max_seq=16, max_batch=2)
    dtypes = {k: v["dtype"] for k, v in json.loads((art / "weights.json").read_text())["tensors"].items()}
    assert [dtypes[k] for k in dtypes if k.endswith("o_a_proj.weight")] == ["bfloat16"] * 3
    for name, prog in json.loads((art / "program.json").read_text())["programs"].items():
        zone = {b["id"]: b["zone"] for b in prog["buffers"]}
        copies = [st["node"] for st in prog["steps"] if st["node"].split(" ")[0] in ("permute", "fused") and
                  any(zone[a] == "weights" for a in st["args"][:-st["outputs"] or None]) and "o_a_proj" in st["node"]]
        assert not copies, (name, copies[:2])
        assert any(k["op"] == "dequant_linear_bf16" and "o_a_proj" in k["span"] for k in prog["kernels"].values())
    res = compare(str(ckpt), str(art))
    assert res["ok"], res["max_abs_diff"]


@pytest.mark.slow
def test_mla_with_a_bf16_up_projection_runs_on_the_absorbed_kernel(tmp_path):
    """DeepSeek-V3.2 with its projections in bf16: kv_b_proj reaches the attention as dequant_bf16's rewrite of the
    linear, and the MLA is still recognised (mla_sparse_attention reading W as stored), so a decode step reads the
    latent rows it selects instead of expanding the whole latent cache through W; the artifact matches upstream."""
    from dayzero.tools.compare import compare
    from dayzero.tools.driver import compile_model
    from dayzero.tools.make_tiny import make_tiny

    from _lowprec_ref import to_bf16_checkpoint

    ckpt = to_bf16_checkpoint(make_tiny("deepseek_v32", tmp_path / "tiny", seed=0), tmp_path / "ckpt")
    art = tmp_path / "art"
    compile_model(str(ckpt), art, max_seq=16, max_batch=2)
    dtypes = {k: v["dtype"] for k, v in json.loads((art / "weights.json").read_text())["tensors"].items()}
    assert {dtypes[k] for k in dtypes if k.endswith("kv_b_proj.weight")} == {"bfloat16"}
    for name, prog in json.loads((art / "program.json").read_text())["programs"].items():
        ops = [k["op"] for k in prog["kernels"].values()]
        assert "mla_sparse_attention" in ops, (name, sorted(set(ops)))
        assert not any(k["op"] == "dequant_linear_bf16" and "kv_b_proj" in k["span"]
                       for k in prog["kernels"].values()), name
    res = compare(str(ckpt), str(art))
    assert res["ok"], res["max_abs_diff"]
