"""The pattern language: declarative matches over the IR and a rule-driven rewrite that counts matches per rule.

In the spirit of tinygrad's ``UPat``/``PatternMatcher`` and TVM Relax's dataflow patterns::

    P("mul.Tensor", V(P(name="a")), P.const(lambda t: t.numel() == 1, name="s"), commute=True)

matches a ``mul.Tensor`` node whose inputs are, in either order, anything (captured as ``a`` after looking through
views) and a folded scalar constant (captured as ``s``). A pattern tests, in this order: the op (a name or a set of
names; ``None`` is a wildcard), the attrs (a value compared with ``==``, or a predicate on the value; a missing attr
reads as ``None``), dtype and shape (a value, a set of values, or a predicate), the inputs (one pattern each, in
order; ``rest=True`` allows more), then ``where(node, m)``, a predicate that may bind derived values with
``m.bind``. ``Alt(p, q, ...)`` is the first alternative that matches.

Captures: ``name=`` binds the node in the match ``m``; binding a name twice requires the same node (identity), so
``P("and", P(name="b"), P(name="b"))`` is "the same value on both sides". A failed alternative leaves no bindings.

One view-stripping rule: ``V(p)`` matches ``p`` against ``strip_views(node)``, the node under every op that only
re-labels the same elements (reshapes, (un)squeezes, aliases, clones, and expands that keep the shape).

Recurring constructs: ``cast(p)`` (an optional dtype cast), ``const`` / ``scalar`` (folded constants by value),
``with_scalar(op, p, v)`` (``op(p, v)`` in either ATen spelling: ``<op>.Tensor`` with a constant operand or
``<op>.Scalar``), ``filled(v)`` (a full or a constant whose every element is ``v``), ``many(wrap, p)`` (``p`` under
any number of layers of ``wrap``: a repeated sub-pattern).

A rule is ``Rule(name, pattern, build)``; ``build(node, m)`` returns the replacement or ``None`` (or raises
``NoMatch``, through ``need(cond)``). ``rewrite(graph, rules, constants)`` applies the first rule that rewrites each
node, bottom-up (``passes/ir/node.rewrite``), and returns the graph and ``{rule name: matches}``; rule names are
``<pass>.<pattern>``, the names the compile report lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from dayzero import InternalError

from .node import Graph, Node
from .node import rewrite as rewrite_nodes

VIEW_OPS = frozenset({"view", "_unsafe_view", "reshape", "alias", "clone", "squeeze", "squeeze.dim", "squeeze.dims",
                      "unsqueeze"})


def strip_views(n: Node, broadcast: bool = False, keep_rank: bool = False) -> Node:
    """The node under every op that only re-labels the same elements: reshapes, (un)squeezes, aliases, clones and
    expands that keep the shape (a value, not a new layout of data, flows through them). ``broadcast``: through
    every expand too (the same values, read repeatedly); ``keep_rank``: stop where the rank would change."""
    while len(n.types) == 1 and n.inputs and len(n.inputs[0].types) == 1 and (
            n.op in VIEW_OPS or (n.op == "expand" and (broadcast or n.shape == n.inputs[0].shape))) and \
            not (keep_rank and len(n.shape) != len(n.inputs[0].shape)):
        n = n.inputs[0]
    return n


class NoMatch(Exception):
    """Raised by a rule's builder (through ``need``) when a detail beyond the pattern does not hold."""


def need(cond) -> None:
    if not cond:
        raise NoMatch


class Match(dict):
    """The captures of one match (name -> node or bound value), with the graph's folded constants."""

    def __init__(self, constants: Mapping[str, Any] | None = None):
        super().__init__()
        self.constants = constants if constants is not None else {}

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def bind(self, name: str, value) -> bool:
        """Bind ``name`` (nodes by identity, other values by equality); False when it is bound to something else."""
        if name in self:
            old = self[name]
            return old is value if isinstance(old, Node) or isinstance(value, Node) else old == value
        self[name] = value
        return True

    def value(self, n: Node):
        """The folded constant tensor a ``weight`` node holds, else None."""
        if n.op == "weight":
            return self.constants.get(n.attr["name"])
        return None


def isin(*values) -> Callable[[Any], bool]:
    """An attr/dtype predicate: the value is one of ``values``."""
    return lambda v: v in values


def _test(spec, v) -> bool:
    if callable(spec):
        return bool(spec(v))
    if isinstance(spec, (set, frozenset)):
        return v in spec
    return v == spec


@dataclass(frozen=True, eq=False)
class Pat:
    op: str | frozenset | None = None
    src: tuple["Pat", ...] | None = None  # None: any inputs
    name: str | None = None
    attrs: tuple[tuple[str, Any], ...] = ()
    dtype: Any = None
    shape: Any = None  # a tuple, or a predicate on the shape
    ndim: int | None = None
    where: Callable[[Node, Match], bool] | None = None
    commute: bool = False  # two inputs, either order
    rest: bool = False  # more inputs than ``src`` allowed
    views: tuple[bool, bool] | None = None  # match against strip_views(node, *views)
    alts: tuple["Pat", ...] = ()

    def __post_init__(self):
        if self.name is not None and hasattr(Match, self.name):
            raise InternalError(f"pattern capture name {self.name!r} hides Match.{self.name}")

    def match(self, n: Node, m: Match) -> bool:
        saved = dict(m)
        if self._match(n, m):
            return True
        m.clear()
        m.update(saved)
        return False

    def _match(self, n: Node, m: Match) -> bool:
        if self.views is not None:
            n = strip_views(n, *self.views)
        if self.alts:
            if not any(a.match(n, m) for a in self.alts):
                return False
            return self.name is None or m.bind(self.name, n)
        if self.op is not None and not (n.op == self.op if isinstance(self.op, str) else n.op in self.op):
            return False
        if self.attrs:
            a = n.attr
            if not all(_test(spec, a.get(k)) for k, spec in self.attrs):
                return False
        if self.dtype is not None and (len(n.types) != 1 or not _test(self.dtype, n.dtype)):
            return False
        if self.ndim is not None and (len(n.types) != 1 or len(n.shape) != self.ndim):
            return False
        if self.shape is not None and (len(n.types) != 1 or not _test(self.shape, tuple(n.shape))):
            return False
        if self.name is not None and not m.bind(self.name, n):
            return False
        if self.src is not None:
            if len(n.inputs) < len(self.src) or (not self.rest and len(n.inputs) != len(self.src)):
                return False
            orders = [n.inputs]
            if self.commute:
                orders.append(n.inputs[::-1])
            if not any(_all(self.src, ins, m) for ins in orders):
                return False
        return self.where is None or bool(self.where(n, m))


def _all(pats, ins, m: Match) -> bool:
    saved = dict(m)
    if all(p.match(i, m) for p, i in zip(pats, ins)):
        return True
    m.clear()
    m.update(saved)
    return False


def P(op: str | Iterable[str] | None = None, *src: Pat, name: str | None = None, attrs: Mapping[str, Any] | None = None,
      dtype: Any = None, shape: Any = None, ndim: int | None = None, where=None, commute: bool = False,
      rest: bool = False) -> Pat:
    """A pattern: ``P(op, *inputs, name=, attrs=, dtype=, shape=, ndim=, where=, commute=, rest=)``; ``P()`` or
    ``P(name="x")`` matches any node. Without input patterns the inputs are not looked at."""
    ops_ = op if op is None or isinstance(op, str) else frozenset(op)
    return Pat(ops_, tuple(src) if src else None, name, tuple(sorted((attrs or {}).items())), dtype, shape, ndim,
               where, commute, rest)


def V(p: Pat, broadcast: bool = False, keep_rank: bool = False) -> Pat:
    """``p`` through any views (``strip_views``)."""
    return Pat(**{**p.__dict__, "views": (broadcast, keep_rank)})


def Alt(*alts: Pat, name: str | None = None) -> Pat:
    """The first of ``alts`` that matches (its bindings kept)."""
    return Pat(alts=tuple(alts), name=name)


def const(pred: Callable[[Any], bool] | None = None, name: str | None = None) -> Pat:
    """A folded constant (a ``weight`` in the constants) whose tensor satisfies ``pred``."""
    def where(n: Node, m: Match) -> bool:
        t = m.value(n)
        return t is not None and (pred is None or bool(pred(t)))
    return Pat("weight", name=name, where=where)


def scalar_is(pred: Callable[[Any], bool], name: str | None = None) -> Pat:
    """A folded one-element constant whose value (a 0-d tensor) satisfies ``pred``."""
    return const(lambda t: t.numel() == 1 and bool(pred(t.reshape(-1)[0])), name)


def scalar(value: float, name: str | None = None) -> Pat:
    """A folded one-element constant equal to ``value``."""
    return scalar_is(lambda v: float(v) == value, name)


def cast(p: Pat, to: str | None = None, sources=None) -> Pat:
    """``p``, or ``p`` under a dtype cast (``_to_copy``; to dtype ``to``, from one of ``sources``), through views
    either side."""
    return V(Alt(P("_to_copy", V(p), attrs={"dtype": to} if to else None,
                   where=None if sources is None else lambda n, m: n.inputs[0].dtype in sources), p))


ALPHA1 = {"alpha": isin(1, None)}  # add/sub's alpha absent or 1

# the ATen names of ``op(tensor, scalar)`` when the scalar is an attr (``other``) instead of a tensor operand
_SCALAR_FORMS = {"bitwise_right_shift": ("bitwise_right_shift.Tensor_Scalar", "__rshift__.Scalar")}


def with_scalar(op: str, x: Pat, value, tensor: bool = True, name: str | None = None) -> Pat:
    """``op(x, value)`` in either of ATen's spellings: ``<op>.Scalar`` with attr ``other`` (add/sub with alpha 1),
    or (``tensor``) ``<op>.Tensor`` with a folded one-element constant operand (captured as ``name``)."""
    forms = [P(f, x, attrs={"other": value, **ALPHA1}) for f in _SCALAR_FORMS.get(op, (f"{op}.Scalar",))]
    if tensor:
        forms.insert(0, P(f"{op}.Tensor", x, scalar(float(value)), attrs=ALPHA1))
    return Alt(*forms, name=name)


def fill_value(n: Node, m: Match) -> float | None:
    """The value every element of ``n`` holds (a ``full`` / ``full_like``, or a folded constant), else None."""
    if n.op in ("full", "full_like") and isinstance(n.attr.get("fill_value"), (int, float)):
        return float(n.attr["fill_value"])
    t = m.value(n)
    if t is not None and t.numel() and bool((t == t.reshape(-1)[0]).all()):
        return float(t.reshape(-1)[0])
    return None


def filled(value: float | Callable[[float, Match], bool]) -> Pat:
    """A value every element of which is ``value`` (or satisfies ``value(v, m)``): a full or a folded constant."""
    test = value if callable(value) else (lambda v, m: v == value)
    return P(where=lambda n, m: (v := fill_value(n, m)) is not None and bool(test(v, m)))


def many(wrap: Callable[[Pat], Pat], inner: Pat, at_most: int = 4) -> Pat:
    """``inner`` under 0 to ``at_most`` layers of ``wrap`` (``wrap(p)`` is the layer's pattern with ``p`` as its
    input), as many layers as match: e.g. ``many(lambda p: P("slice.Tensor", p), P(name="x"))``."""
    p = inner
    for _ in range(at_most):
        p = Alt(wrap(p), inner)
    return p


def last_dim(n: Node, m: Match | None = None) -> bool:
    """The op's ``dim`` attr names its (first) output's last axis."""
    return n.attr.get("dim") in (-1, len(n.types[0].shape) - 1)


@dataclass(frozen=True)
class Rule:
    name: str  # "<pass>.<pattern>": the name the compile report counts it under
    pattern: Pat
    build: Callable[[Node, Match], Node | None]


@dataclass
class Rewriter:
    """Applies ``rules`` node by node (the first that returns a node wins) and counts the matches of each."""
    rules: tuple[Rule, ...]
    constants: Mapping[str, Any] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def __call__(self, n: Node) -> Node | None:
        for r in self.rules:
            m = Match(self.constants)
            if not r.pattern.match(n, m):
                continue
            try:
                out = r.build(n, m)
            except NoMatch:
                out = None
            if out is not None:
                self.counts[r.name] = self.counts.get(r.name, 0) + 1
                return out
        return None


def rewrite(graph: Graph, rules: Iterable[Rule], constants: Mapping[str, Any] | None = None) \
        -> tuple[Graph, dict[str, int]]:
    """Rewrite ``graph`` bottom-up with ``rules``; returns the new graph and ``{rule name: matches}`` (rules that
    never fired are left out)."""
    rw = Rewriter(tuple(rules), constants if constants is not None else {})
    return rewrite_nodes(graph, rw), rw.counts
