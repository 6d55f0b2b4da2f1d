"""The pattern language (passes/ir/pattern.py) on small hand-built IR: match, no match, captures, view stripping,
alternatives, constants, and the rewrite's per-rule counts."""

import torch

from dayzero.passes.ir.node import Graph, Node, TensorType
from dayzero.passes.ir.pattern import (Alt, Match, P, Rule, V, const, filled, isin, many, need, rewrite, scalar,
                                       strip_views, with_scalar)
from dayzero.passes.pipeline import pattern_pass


def _t(dtype, *shape):
    return [TensorType(dtype, shape)]


def _inp(name, *shape, dtype="float32"):
    return Node.make("input", (), {"name": name}, _t(dtype, *shape))


def _op(op, ins, shape, attrs=None, dtype="float32"):
    return Node.make(op, ins, attrs or {}, _t(dtype, *shape))


X = _inp("x", 4, 8)
W = Node.make("weight", (), {"name": "w"}, _t("float32", 8, 8))
S = Node.make("weight", (), {"name": "s"}, _t("float32"))
CONSTS = {"s": torch.tensor(2.0), "w": torch.ones(8, 8)}


def test_op_attr_dtype_shape_predicates():
    mm = _op("mm", (X, W), (4, 8))
    assert P("mm").match(mm, Match())
    assert P({"mm", "bmm"}).match(mm, Match())
    assert not P("bmm").match(mm, Match())
    assert P("mm", dtype="float32", shape=(4, 8), ndim=2).match(mm, Match())
    assert not P("mm", shape=(8, 4)).match(mm, Match())
    assert not P("mm", dtype={"int64", "bool"}).match(mm, Match())
    s = _op("sum.dim_IntList", (mm,), (4,), {"dim": (1,), "keepdim": False})
    assert P("sum.dim_IntList", attrs={"dim": isin((1,), (-1,)), "keepdim": False}).match(s, Match())
    assert not P("sum.dim_IntList", attrs={"dim": (0,)}).match(s, Match())
    # a missing attr reads as None
    assert P("sum.dim_IntList", attrs={"dtype": None}).match(s, Match())
    assert not P("sum.dim_IntList", attrs={"dtype": "float32"}).match(s, Match())


def test_inputs_and_captures():
    mm = _op("mm", (X, W), (4, 8))
    m = Match()
    assert P("mm", P("input", name="a"), P(name="b"), name="root").match(mm, m)
    assert m.a is X and m.b is W and m.root is mm
    # wrong input count, wrong input op
    assert not P("mm", P()).match(mm, Match())
    assert P("mm", P(), rest=True).match(mm, Match())
    assert not P("mm", P("weight"), P("weight")).match(mm, Match())


def test_same_name_twice_means_same_node():
    same = _op("mul.Tensor", (X, X), (4, 8))
    other = _op("mul.Tensor", (X, _inp("y", 4, 8)), (4, 8))
    pat = P("mul.Tensor", P(name="a"), P(name="a"))
    assert pat.match(same, Match()) and not pat.match(other, Match())


def test_commute_and_failed_branch_leaves_no_bindings():
    mul = _op("mul.Tensor", (S, X), (4, 8))
    pat = P("mul.Tensor", P("input", name="x"), scalar(2.0, name="s"), commute=True)
    m = Match(CONSTS)
    assert pat.match(mul, m) and m.x is X and m.s is S
    assert not P("mul.Tensor", P("input", name="x"), scalar(3.0), commute=True).match(mul, Match(CONSTS))
    # the first order binds "x" to S's slot and fails: the binding is undone before the second order
    pat2 = P("mul.Tensor", P(name="x", dtype="float32", ndim=2), const(name="c"), commute=True)
    m = Match(CONSTS)
    assert pat2.match(mul, m) and m.x is X and m.c is S


def test_constants_need_the_folded_table():
    assert const().match(S, Match(CONSTS))
    assert not const().match(S, Match({}))  # a weight that was not folded is not a constant
    assert not const().match(X, Match(CONSTS))


def test_view_stripping():
    v = _op("view", (X,), (32,), {"size": (32,)})
    c = _op("clone", (v,), (32,))
    u = _op("unsqueeze", (c,), (1, 32), {"dim": 0})
    same = _op("expand", (u,), (1, 32), {"size": (1, 32)})
    assert strip_views(same) is X
    assert V(P("input", name="x")).match(same, Match())
    assert not P("input").match(same, Match())
    # an expand that broadcasts is data, not a view: it stops the stripping
    grow = _op("expand", (u,), (3, 32), {"size": (3, 32)})
    assert strip_views(grow) is grow and strip_views(grow, broadcast=True) is X
    assert strip_views(grow, broadcast=True, keep_rank=True) is u  # the unsqueeze changes the rank: it stays
    assert not V(P("input")).match(grow, Match())
    # the capture is the stripped node
    m = Match()
    assert P("neg", V(P(name="a"))).match(_op("neg", (c,), (32,)), m) and m.a is X


def test_alternatives_and_where():
    add = _op("add.Tensor", (X, X), (4, 8), {"alpha": 1})
    sub = _op("sub.Tensor", (X, X), (4, 8), {"alpha": 1})
    pat = Alt(P("add.Tensor", name="op"), P("sub.Tensor", name="op"))
    m = Match()
    assert pat.match(sub, m) and m.op is sub
    bound = P("add.Tensor", where=lambda n, m: m.bind("alpha", n.attr["alpha"]) and n.attr["alpha"] == 1)
    m = Match()
    assert bound.match(add, m) and m.alpha == 1
    assert not P("add.Tensor", where=lambda n, m: False).match(add, Match())


def test_rewrite_counts_per_rule_and_first_rule_wins():
    a = _op("neg", (X,), (4, 8))
    b = _op("neg", (a,), (4, 8))
    r = _op("relu", (b,), (4, 8))
    g = Graph("g", (X,), (r,))

    def to_abs(n, m):
        return Node.make("abs", (m.x,), {}, n.types, n.span)

    def skip_all(n, m):
        need(False)

    rules = [Rule("t.declined", P("neg"), skip_all), Rule("t.neg_to_abs", P("neg", P(name="x")), to_abs),
             Rule("t.never", P("neg"), to_abs)]
    out, counts = rewrite(g, rules)
    assert counts == {"t.neg_to_abs": 2}
    assert [n.op for n in out.nodes()] == ["input", "abs", "abs", "relu"]
    assert out.nodes()[2].inputs[0] is out.nodes()[1]  # the second rewrite sees the first's output
    same, counts = rewrite(g, [Rule("t.none", P("mm"), to_abs)])
    assert counts == {} and same.outputs[0] is r


def test_a_capture_name_may_not_hide_the_match_api():
    import pytest

    from dayzero import InternalError

    with pytest.raises(InternalError, match="keys"):
        P(name="keys")


def test_with_scalar_matches_both_aten_spellings_of_a_scalar_operand():
    tensor_form = _op("sub.Tensor", (X, S), (4, 8), {"alpha": 1})  # S folds to 2.0
    scalar_form = _op("sub.Scalar", (X,), (4, 8), {"other": 2, "alpha": 1})
    pat = with_scalar("sub", P("input", name="x"), 2, name="op")
    for n in (tensor_form, scalar_form):
        m = Match(CONSTS)
        assert pat.match(n, m) and m.x is X and m.op is n
    assert not with_scalar("sub", P("input"), 3).match(tensor_form, Match(CONSTS))
    assert not with_scalar("sub", P("input"), 2, tensor=False).match(tensor_form, Match(CONSTS))
    assert not with_scalar("sub", P("input"), 2).match(_op("sub.Scalar", (X,), (4, 8), {"other": 2, "alpha": 2}),
                                                       Match())
    # ATen's shift has its own scalar spellings
    shift = _op("__rshift__.Scalar", (X,), (4, 8), {"other": 4})
    assert with_scalar("bitwise_right_shift", P("input"), 4).match(shift, Match())


def test_filled_reads_fulls_and_constants_by_value():
    full = _op("full", (), (4, 8), {"fill_value": float("-inf"), "size": (4, 8)})
    assert filled(float("-inf")).match(full, Match())
    assert not filled(0.0).match(full, Match())
    consts = {"w": torch.ones(8, 8), "s": torch.arange(4.0)}
    assert filled(1.0).match(W, Match(consts))
    assert not filled(1.0).match(Node.make("weight", (), {"name": "s"}, _t("float32", 4)), Match(consts))
    # a predicate sees the value and the match
    m = Match(consts)
    m["E"] = 1
    assert filled(lambda v, m: v >= m.E).match(W, m) and not filled(lambda v, m: v > m.E).match(W, m)


def test_many_matches_any_number_of_layers_up_to_its_bound():
    n = X
    for _ in range(3):
        n = _op("neg", (n,), (4, 8))
    m = Match()
    assert many(lambda p: P("neg", p), P("input", name="x")).match(n, m) and m.x is X
    assert many(lambda p: P("neg", p), P("input")).match(X, Match())  # no layer at all
    assert not many(lambda p: P("neg", p), P("input"), at_most=2).match(n, Match())
    assert not many(lambda p: P("relu", p), P("input")).match(n, Match())


def test_a_pattern_pass_returns_its_graph_and_each_rule_s_matches():
    r = _op("relu", (_op("neg", (X,), (4, 8)),), (4, 8))
    negate = pattern_pass("negate", (Rule("negate.abs", P("neg", P(name="x")),
                                          lambda n, m: Node.make("abs", (m.x,), {}, n.types, n.span)),))
    out, found = negate(Graph("g", (X,), (r,)), CONSTS)
    assert [n.op for n in out.nodes()] == ["input", "abs", "relu"] and found.patterns == {"negate.abs": 1}
    assert negate.__name__ == "negate"
