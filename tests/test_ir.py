"""The IR: text round trip, verifier, shape rules (ATen meta) on traced upstream models."""

from __future__ import annotations

import pytest
import sympy
import torch

from dayzero import InternalError, UserError
from dayzero.passes.ir.node import Graph, Node, Span, TensorType, structurally_equal
from dayzero.passes.ir.text import make_symbol, parse_graph, print_graph
from dayzero.passes.ir.verify import VerifyError, check_shapes, verify
from dayzero.tools import examples
from dayzero.tools.driver import optimize, trace_model


@pytest.fixture(scope="module", params=[pytest.param("tiny_dense", marks=pytest.mark.slow), pytest.param("tiny_moe", marks=pytest.mark.slow)])
def traced(request):
    return trace_model(getattr(examples, request.param)(), max_seq=64)


def test_round_trip_is_structurally_equal(traced):
    g = traced.traced.graph
    text = print_graph(g)
    g2 = parse_graph(text)
    assert structurally_equal(g, g2)
    assert print_graph(g2) == text


def test_round_trip_after_passes(traced):
    g, _ = optimize(traced, verify=True)
    assert structurally_equal(g, parse_graph(print_graph(g)))


def test_sequence_length_stays_symbolic(traced):
    g = traced.traced.graph
    assert g.symbols == (("seq", 1, 64),)
    (inp,) = g.inputs
    assert inp.shape == (1, make_symbol("seq"))
    assert g.outputs[0].shape == (1, make_symbol("seq"), 256)


def test_spans_point_at_upstream_source(traced):
    spans = [n.span for n in traced.traced.graph.nodes() if n.op == "linear"]
    assert spans and all(s.source.startswith("transformers/models/") for s in spans)
    assert any(".layers.1." in s.module for s in spans)
    # the frontend writes each node's decoder layer into its span: structure codegen reads, never the module text
    assert {s.layer for s in spans} == {("layers", 0), ("layers", 1), None}  # None: lm_head, outside the stack
    assert all(f".layers.{s.layer[1]}." in s.module if s.layer else ".layers." not in s.module for s in spans)


@pytest.mark.parametrize("seq", [1, 5, 33])
def test_shapes_agree_with_aten_meta(traced, seq):
    check_shapes(traced.traced.graph, {"seq": seq})


def _tiny_graph(op="add.Tensor", out_shape=(4,)):
    s = make_symbol("seq")
    x = Node.make("input", (), {"name": "x"}, [TensorType("float32", (s, 4))])
    w = Node.make("weight", (), {"name": "w"}, [TensorType("float32", (4,))])
    y = Node.make(op, (x, w), {"alpha": 1}, [TensorType("float32", (s,) + tuple(out_shape))])
    return Graph("main", (x,), (y,), (("seq", 1, 16),))


def test_text_form_example():
    g = _tiny_graph()
    assert print_graph(g) == (
        "graph main symbols(seq in [1, 16]) {\n"
        '  %0 = input {name="x"} : float32[seq, 4]\n'
        '  %1 = weight {name="w"} : float32[4]\n'
        "  %2 = add.Tensor(%0, %1) {alpha=1} : float32[seq, 4]\n"
        "  return %2\n"
        "}\n")


def test_attr_values_round_trip():
    s = make_symbol("seq")
    x = Node.make("input", (), {"name": "x"}, [TensorType("float32", (s, 4))])
    y = Node.make("view", (x,), {"size": (2 * s, 2)}, [TensorType("float32", (2 * s, 2))])
    z = Node.make("clamp", (y,), {"min": float("-inf"), "max": 1e-30}, [TensorType("float32", (2 * s, 2))])
    g = Graph("main", (x,), (z,), (("seq", 1, 16),))
    g2 = parse_graph(print_graph(g))
    assert structurally_equal(g, g2)
    assert g2.outputs[0].inputs[0].attr["size"] == (2 * s, 2)


def test_verifier_rejects_wrong_shape():
    g = _tiny_graph(out_shape=(5,))
    verify(g)  # structurally fine
    with pytest.raises(VerifyError, match="declared"):
        check_shapes(g, {"seq": 3})


def test_verifier_rejects_undeclared_symbol():
    g = _tiny_graph()
    g = g.replace(symbols=())
    with pytest.raises(VerifyError, match="undeclared"):
        verify(g)


def test_verifier_rejects_wrong_input_count():
    g = _tiny_graph()
    bad = g.outputs[0].replace(inputs=g.outputs[0].inputs[:1])
    with pytest.raises(VerifyError):
        verify(g.replace(outputs=(bad,)))


def test_span_layer_round_trips_in_the_text_form():
    x = Node.make("input", (), {"name": "x"}, [TensorType("float32", (4,))])
    y = Node.make("neg", (x,), {}, [TensorType("float32", (4,))], Span("model.layers.3.mlp", "m.py:7", ("layers", 3)))
    g = Graph("main", (x,), (y,), ())
    text = print_graph(g)
    assert 'loc("model.layers.3.mlp", "m.py:7", "layers", 3)' in text
    g2 = parse_graph(text)
    assert structurally_equal(g, g2) and g2.outputs[0].span.layer == ("layers", 3)
    with pytest.raises(UserError, match="non-negative integer"):
        parse_graph(text.replace('"layers", 3)', '"layers", 2.5)'))


def test_parse_errors_are_user_errors():
    with pytest.raises(UserError):
        parse_graph("graph main symbols() {\n  %0 = add.Tensor(%7) : float32[1]\n  return %0\n}\n")
    assert issubclass(VerifyError, InternalError)


def test_span_source_is_the_upstream_line_not_generated_code():
    """A node traced through torch.fx-generated code (``<eval_with_key>.N``: N counts the graphs this process
    generated) takes the upstream line that called it, so two traces of one model in one process have the same
    spans (compare checks the artifact's steps against a re-trace by span)."""
    import types

    from dayzero.frontend.torch_export import _span

    trace = ('  File "/x/site-packages/transformers/models/deepseek_v32/modeling_deepseek_v32.py", line 120, in f\n'
             '  File "/x/site-packages/torch/fx/graph_module.py", line 400, in __call__\n'
             '  File "<eval_with_key>.68", line 5, in forward\n')
    node = types.SimpleNamespace(meta={"stack_trace": trace, "nn_module_stack": {"a": ("L['self'].model.x", None)}})
    span = _span(node, "model.")
    assert span.source == "transformers/models/deepseek_v32/modeling_deepseek_v32.py:120"
    assert span.module == "x"
