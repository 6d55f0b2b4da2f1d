"""The frontend's two export paths give the same program.

``export_module`` traces and decomposes in one pass through torch's private ``_export`` (the decomposition table
applied while tracing) where this torch has it, else through the public ``torch.export.export`` followed by
``run_decompositions``. Both must give the same graph signature, ranges and IR, one the verifier accepts and that
computes what the module computes.
"""

from __future__ import annotations

import pytest
import torch

from dayzero.frontend import torch_export
from dayzero.frontend.torch_export import export_module, to_graph
from dayzero.passes.ir.text import print_graph
from dayzero.passes.ir.verify import verify


class _Block(torch.nn.Module):
    """Kept ops (linear, silu, softmax, layer_norm, sdpa), an op the table decomposes (addcmul) and a
    buffer the forward writes (state): what the upstream models' exports hold."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.norm = torch.nn.LayerNorm(16)
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(16, 16, bias=False)
        self.register_buffer("total", torch.zeros(16), persistent=False)

    def forward(self, x):
        h = self.norm(x)
        a, b = self.up(h).chunk(2, dim=-1)
        h = torch.addcmul(torch.nn.functional.silu(a) * b, a, b, value=0.5)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        q = h.view(1, x.shape[1], 2, 8).transpose(1, 2)
        att = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        h = att.transpose(1, 2).reshape(1, x.shape[1], 16)
        self.total.add_(h.sum((0, 1)))
        return torch.softmax(self.down(h), dim=-1)


def _export(one_pass: bool):
    m = _Block().eval()
    seq = torch.export.Dim("seq", min=2, max=64)
    ep = export_module(m, (torch.randn(1, 8, 16),), {"x": {1: seq}}, one_pass=one_pass)
    return m, ep


def _targets(ep):
    return sorted({str(n.target) for n in ep.graph.nodes if n.op == "call_function"})


def test_this_torch_has_the_one_pass_export():
    """torch 2.13 (pyproject's pin) has the private pieces: the default path is the one-pass export. A torch that
    drops them fails here first (the compile still works, on the slower public path)."""
    assert torch_export._one_pass_pieces() is not None


def test_both_paths_give_the_same_program():
    _, one = _export(True)
    _, two = _export(False)
    assert [(s.kind, s.target, s.persistent) for s in one.graph_signature.input_specs] == \
           [(s.kind, s.target, s.persistent) for s in two.graph_signature.input_specs]
    assert [(s.kind, s.target) for s in one.graph_signature.output_specs] == \
           [(s.kind, s.target) for s in two.graph_signature.output_specs]
    assert {str(k): (int(v.lower), int(v.upper)) for k, v in one.range_constraints.items()} == \
           {str(k): (int(v.lower), int(v.upper)) for k, v in two.range_constraints.items()}
    assert _targets(one) == _targets(two)
    kept = {"aten.linear.default", "aten.silu.default", "aten.softmax.int", "aten.layer_norm.default",
            "aten.scaled_dot_product_attention.default"}
    assert kept <= set(_targets(one))  # KEEP_OPS stay whole on the one-pass path too
    assert "aten.addcmul.default" not in _targets(one)  # ... and the table's ops are decomposed (mul, add)
    g1 = to_graph(one, {}).graph
    g2 = to_graph(two, {}).graph
    verify(g1)
    verify(g2)
    assert print_graph(g1) == print_graph(g2)
    assert any(n.op == "state" for n in g1.nodes())  # the written buffer is state on both paths


@pytest.mark.parametrize("one_pass", [True, False])
def test_each_path_computes_the_module(one_pass):
    m, ep = _export(one_pass)
    run = ep.module()
    for n in (3, 17):
        x = torch.randn(1, n, 16)
        with torch.no_grad():
            want = m(x)
            got = run(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_without_the_private_api_the_public_path_runs(monkeypatch):
    """A torch whose ``_export_to_aten_ir`` takes no ``decomp_table`` (or has no ``_export``): the public path."""
    from torch.export import _trace

    real = _trace._export_to_aten_ir

    def no_table(*args, **kwargs):  # an older signature: no decomp_table parameter (run_decompositions still works)
        return real(*args, **kwargs)

    monkeypatch.setattr(_trace, "_export_to_aten_ir", no_table)
    assert torch_export._one_pass_pieces() is None
    public = []
    real_export = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: public.append(1) or real_export(*a, **k))
    _, ep = _export(True)
    assert public == [1]
    verify(to_graph(ep, {}).graph)
    monkeypatch.delattr(_trace, "_export")
    assert torch_export._one_pass_pieces() is None


def test_the_environment_forces_the_public_path(monkeypatch):
    public = []
    real_export = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: public.append(1) or real_export(*a, **k))
    monkeypatch.setenv("DAYZERO_EXPORT", "two-pass")
    m = _Block().eval()
    export_module(m, (torch.randn(1, 8, 16),), None)
    assert public == [1]
    monkeypatch.delenv("DAYZERO_EXPORT")
    export_module(m, (torch.randn(1, 8, 16),), None)
    assert public == [1]  # the default: one pass, no public export


def test_a_failed_export_is_one_user_error_on_both_paths():
    from dayzero import UserError

    class Bad(torch.nn.Module):
        def forward(self, x):
            return x[: int(x.sum())]  # data-dependent size: torch.export refuses

    for one_pass in (True, False):
        with pytest.raises(UserError, match="^torch.export failed"):
            export_module(Bad(), (torch.ones(4),), None, one_pass=one_pass)


@pytest.mark.slow
def test_the_public_path_compiles_tiny_qwen3_moe_to_upstream(tmp_path, monkeypatch):
    """The fallback path end to end: the same prefill/decode IR as the one-pass trace, and a compiled artifact whose
    logits match transformers' eager forward (the one-pass path is what tests/test_upstream_models.py compiles)."""
    from dayzero.frontend.hf import load_upstream
    from dayzero.frontend.trace import trace_model
    from dayzero.runtime.executor import load
    from dayzero.tools.driver import compile_model
    from dayzero.tools.make_tiny import make_tiny

    ck = make_tiny("qwen3_moe", tmp_path / "ckpt", seed=0)
    one = trace_model(str(ck), max_seq=32, trace_cache="off")
    monkeypatch.setenv("DAYZERO_EXPORT", "two-pass")
    two = trace_model(str(ck), max_seq=32, trace_cache="off")
    for a, b in ((one.traced, two.traced), (one.decode, two.decode)):
        verify(b.graph)
        assert print_graph(a.graph) == print_graph(b.graph)
    compile_model(str(ck), tmp_path / "art", max_seq=32, trace_cache="off")
    rt = load(tmp_path / "art")
    m = load_upstream(ck)
    ids = torch.randint(0, 256, (1, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = m(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
    got = rt.prefill(ids)
    assert got.shape == ref.shape
    assert float((got - ref).abs().max()) <= 1e-4
