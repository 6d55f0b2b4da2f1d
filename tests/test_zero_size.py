"""Zero-size tensors, as a specification: empty tensors are legal everywhere in dayzero, as in ATen.

A value with a static 0 in its shape is folded to one canonical empty value (passes/fold_empty.py: no kernel, no
bytes), a cat drops its empty inputs, a reduction over an empty dimension becomes the fill ATen gives; a dimension
that is 0 only at run (``seq - 1`` at seq 1) runs kernels on compact views and reductions still write their
identity. Every model below compiles, runs and equals torch eager (or onnxruntime): same shapes, dtypes, values.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dayzero.passes.fold_constants import fold_constants
from dayzero.passes.fold_empty import fold_empty
from dayzero.passes.ir.node import structurally_equal
from dayzero.passes.ir.text import parse_graph, print_graph
from dayzero.passes.ir.verify import check_shapes, verify
from dayzero.passes.memory_plan import Buffer, plan_zones
from dayzero.runtime import load
from dayzero.tools.driver import compile_model

TOL = 1e-5
SEQS = (1, 5, 17)

# ---- the folding rule, Before / Expected ----------------------------------------------------------------------

BEFORE = """
graph main symbols(seq in [1, 64]) {
  %0 = input {name="q"} : float32[1, 4, seq, 16]
  %1 = slice.Tensor(%0) {dim=3, end=16, start=0, step=1} : float32[1, 4, seq, 16]
  %2 = neg(%1) : float32[1, 4, seq, 16]
  %3 = slice.Tensor(%0) {dim=3, end=9223372036854775807, start=16, step=1} : float32[1, 4, seq, 0]
  %4 = mul.Tensor(%3, %3) : float32[1, 4, seq, 0]
  %5 = cat(%2, %4) {dim=-1, tensors=2} : float32[1, 4, seq, 16]
  %6 = sum.dim_IntList(%3) {dim=[-1], dtype=null, keepdim=false} : float32[1, 4, seq]
  %7 = full {dtype="float64", fill_value=0, size=[0]} : float64[0]
  %8 = cat(%7, %2, %7) {dim=-1, tensors=3} : float64[1, 4, seq, 16]
  %9 = gt.Scalar(%3) {other=0} : bool[1, 4, seq, 0]
  %10 = all.dim(%9) {dim=-1, keepdim=false} : bool[1, 4, seq]
  %11 = arange.start_step {dtype=null, end=0, start=0, step=1} : int64[0]
  %12 = scalar_tensor {dtype="int64", s=2} : int64[]
  %13 = mul.Tensor(%11, %12) : int64[0]
  return %5, %6, %8, %10, %4, %13
}
"""

EXPECTED = """
graph main symbols(seq in [1, 64]) {
  %0 = input {name="q"} : float32[1, 4, seq, 16]
  %1 = slice.Tensor(%0) {dim=3, end=16, start=0, step=1} : float32[1, 4, seq, 16]
  %2 = neg(%1) : float32[1, 4, seq, 16]
  %3 = full {dtype="float32", fill_value=0.0, size=[1, 4, `seq`]} : float32[1, 4, seq]
  %4 = _to_copy(%2) {dtype="float64"} : float64[1, 4, seq, 16]
  %5 = full {dtype="bool", fill_value=true, size=[1, 4, `seq`]} : bool[1, 4, seq]
  %6 = empty.memory_format {dtype="float32", size=[1, 4, `seq`, 0]} : float32[1, 4, seq, 0]
  %7 = empty.memory_format {dtype="int64", size=[0]} : int64[0]
  return %2, %3, %4, %5, %6, %7
}
"""


def test_fold_empty_before_expected():
    before, expected = parse_graph(BEFORE), parse_graph(EXPECTED)
    for g in (before, expected):
        verify(g)
        check_shapes(g, {"seq": 3})
    got = fold_empty(before)
    assert structurally_equal(got, expected), print_graph(got)
    assert structurally_equal(parse_graph(print_graph(got)), expected)  # the text form parses back


def test_fold_constants_leaves_empty_values_in_their_form():
    """A static empty value would otherwise become a 0-byte weight constant (a manifest entry for nothing)."""
    g = fold_empty(parse_graph(BEFORE))
    folded, found = fold_constants(g)
    assert structurally_equal(folded, g) and found.constants == {}


def test_zero_size_buffers_get_aligned_offsets():
    bufs = [Buffer("a", 100, 0, 2), Buffer("empty", 0, 1, 1), Buffer("b", 64, 1, 3), Buffer("io0", 0, 0, 3, "io"),
            Buffer("io1", 8, 0, 3, "io")]
    p = plan_zones(bufs, 64)
    assert all(off % 64 == 0 and 0 <= off <= p.total_bytes for off in p.offsets.values())


# ---- module factories: compile, run, equal torch eager ---------------------------------------------------------

def partial_rotary_whole_head():
    """transformers' Phi with ``partial_rotary_factor=1.0``: the rotary part spans the whole head, so the
    pass-through half ``q[..., rotary_dim:]`` is empty and concatenated back (issue 20, item 9)."""
    from dayzero.tools.examples import _build

    return _build("phi", intermediate_size=128, partial_rotary_factor=1.0)


class _EmptySliceMidGraph(torch.nn.Module):
    def forward(self, x):  # [1, seq, 8]
        e = torch.exp(x[:, :, 3:3] * 2 + 1)  # [1, seq, 0] through elementwise ops
        y = torch.cat([x[:, :, :3], e, x[:, :, 3:]], -1)  # x again, around an empty middle piece
        return torch.relu(y) + e.transpose(1, 2).sum(1).unsqueeze(-1)


def empty_slice_mid_graph():
    return _EmptySliceMidGraph(), (torch.randn(1, 5, 8),)


class _CatWithEmpty(torch.nn.Module):
    def forward(self, x):
        legacy = x.new_zeros(0)  # 1-D [0]: ATen skips it whatever the other inputs' rank
        wide = torch.zeros(1, x.shape[1], 0, dtype=torch.float64)  # empty, but its dtype promotes the result
        return torch.cat([legacy, x, legacy], 1), torch.cat([x, wide], -1), torch.cat([x[..., :0], x[..., 8:]], -1)


def cat_with_empty():
    return _CatWithEmpty(), (torch.randn(1, 5, 8),)


class _EmptyReductions(torch.nn.Module):
    def forward(self, x):
        e = x[..., 8:]  # [1, seq, 0]
        return (e.sum(-1), e.prod(-1), e.mean(-1), e.sum((1, 2)), (e > 0).any(-1), (e > 0).all(-1),
                x * e.sum(-1, keepdim=True) + 1)


def empty_reductions():
    return _EmptyReductions(), (torch.randn(1, 5, 8),)


class _EmptyOutput(torch.nn.Module):
    def forward(self, x):
        return x * 2, x[:, :, 8:] * 3, x.new_zeros(2, 0) + 1


def empty_output():
    return _EmptyOutput(), (torch.randn(1, 5, 8),)


_compiled: dict = {}


def _compile(factory, tmp_path_factory):
    if factory.__name__ not in _compiled:
        module, inputs = factory()
        out = tmp_path_factory.mktemp(factory.__name__) / "artifact"
        compile_model((module, inputs), out, max_seq=64, verify=True)
        _compiled[factory.__name__] = out, module.eval()
    return _compiled[factory.__name__]


def _no_step_writes_an_empty_value(out) -> bool:
    prog = json.loads((out / "program.json").read_text())["programs"]["prefill"]
    shapes = {b["id"]: b["shape"] for b in prog["buffers"]}
    return all(0 not in shapes[a] for st in prog["steps"] for a in st["args"][len(st["args"]) - st["outputs"]:])


def _assert_equal(got, expected):
    expected = expected if isinstance(expected, (tuple, list)) else (expected,)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert (tuple(g.shape), g.dtype) == (tuple(e.shape), e.dtype)
        torch.testing.assert_close(g, e, atol=TOL, rtol=TOL, equal_nan=True)


@pytest.mark.slow
def test_partial_rotary_over_the_whole_head(tmp_path_factory):
    out, module = _compile(partial_rotary_whole_head, tmp_path_factory)
    assert _no_step_writes_an_empty_value(out)
    assert "[1, 4, seq, 0]" not in (out / "final.ir").read_text()  # the cats dropped the empty halves
    rt = load(out)
    for seq in SEQS:
        ids = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(seq))
        with torch.no_grad():
            expected = module(ids)
        _assert_equal([rt.prefill(ids)], expected)


@pytest.mark.slow
@pytest.mark.parametrize("factory", [empty_slice_mid_graph, cat_with_empty, empty_reductions, empty_output],
                         ids=lambda f: f.__name__)
def test_factory_with_empty_tensors_equals_eager(factory, tmp_path_factory):
    out, module = _compile(factory, tmp_path_factory)
    assert _no_step_writes_an_empty_value(out)
    rt = load(out)
    for seq in SEQS:
        x = torch.randn(1, seq, 8, generator=torch.Generator().manual_seed(seq))
        with torch.no_grad():
            _assert_equal(rt.run(x), module(x))


# ---- a dimension that is 0 only at run ---------------------------------------------------------------------------

def _onnx_shifted(path):
    """X [2, seq, 8] -> S = ReduceSum(X[:, 1:], axis 1) [2, 8]; C = Concat(X[:, 1:]^2, X[:, :1]) [2, seq, 8];
    T = X[:, 1:] [2, seq - 1, 8]: at seq 1 the slice is empty at run, a reduction over it is zeros."""
    import onnx
    from onnx import TensorProto, helper

    def ints(name, v):
        return helper.make_tensor(name, TensorProto.INT64, [len(v)], v)
    nodes = [helper.make_node("Slice", ["X", "one", "big", "ax1"], ["T"]),
             helper.make_node("ReduceSum", ["T", "ax1"], ["S"], keepdims=0),
             helper.make_node("Mul", ["T", "T"], ["T2"]),
             helper.make_node("Slice", ["X", "zero", "one", "ax1"], ["H"]),
             helper.make_node("Concat", ["T2", "H"], ["C"], axis=1)]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("S", "C", "T")]
    g = helper.make_graph(nodes, "shifted", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, "seq", 8])],
                          outs, [ints("one", [1]), ints("big", [1 << 62]), ints("ax1", [1]), ints("zero", [0])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


@pytest.mark.slow
def test_dimension_empty_at_run(tmp_path):
    from dayzero.tools.onnx_reference import reference_outputs

    model = _onnx_shifted(tmp_path / "shifted.onnx")
    compile_model(str(model), tmp_path / "art", max_seq=64, verify=True)
    assert "`seq - 1`" in (tmp_path / "art" / "final.ir").read_text()
    rt = load(tmp_path / "art")
    assert not json.loads((tmp_path / "art" / "weights.json").read_text())["tensors"]  # the arena is scratch only
    for seq in (1, 4):
        x = np.random.default_rng(seq).standard_normal((2, seq, 8)).astype(np.float32)
        rt.arena.fill_(0x47)  # float32 51015.28: a reduction that never wrote its output would return it
        got = rt.run(x)
        ref = reference_outputs(str(model), {"X": x})
        assert [tuple(g.shape) for g in got] == [r.shape for r in ref]
        for g, r in zip(got, ref):
            np.testing.assert_allclose(g.numpy(), r, atol=TOL, rtol=TOL)
    # at seq 1 the kernel writing X[:, 1:] and its square (one fused kernel) has nothing to write: it is not
    # called, and every kernel with something to write is
    from dayzero.runtime.executor import _no_call

    prog = rt.programs["prefill"]
    calls = prog._prepare(prog.bind([torch.zeros(2, 1, 8)]))[0]
    empty = [n_out > 0 and all(a.numel() == 0 for a in args[len(bids) - n_out:len(bids)])
             for (_, args), (_, bids, _, _, n_out) in zip(calls, prog.steps)]
    assert any(empty)
    assert [f is _no_call for f, _ in calls] == empty


def test_reductions_that_can_be_empty_keep_their_schedules():
    """The masked reductions (extent ``seq - 1``) still take the default schedule rules and compile for CUDA
    (codegen runs without a GPU; running them needs one)."""
    import tvm

    from dayzero.codegen import program, schedule
    from dayzero.passes.ir.node import Node, TensorType
    from dayzero.passes.ir.text import make_symbol

    s = make_symbol("seq")
    x = Node.make("input", (), {"name": "x"}, [TensorType("float32", (2, s - 1, 64))])
    xt = Node.make("input", (), {"name": "xt"}, [TensorType("float32", (2, 64, s - 1))])
    w = Node.make("input", (), {"name": "w"}, [TensorType("float32", (32, s - 1))])
    nodes = [Node.make("sum.dim_IntList", [x], {"dim": (1,), "keepdim": False}, [TensorType("float32", (2, 64))]),
             Node.make("amax", [x], {"dim": (1,), "keepdim": False}, [TensorType("float32", (2, 64))]),
             Node.make("linear", [xt, w], {"bias": False}, [TensorType("float32", (2, 64, 32))])]
    for target in ({"kind": "cuda", "arch": "sm_90"}, {"kind": "llvm"}):
        t = tvm.target.Target(target)
        for n in nodes:
            k = program.Kernel("k", n.op, program.make_prim_func(n, "k"), "key", node=n)
            tvm.compile(schedule.schedule_kernel(k, t, None, {"seq": (1, 64)}), target=t)
            assert k.route == "default", (n.op, target["kind"])
