"""The IR's text form: ``print_graph`` writes it, ``parse_graph`` reads it back (structurally equal).

    graph main symbols(seq in [1, 256]) {
      %0 = input {name="input_ids"} : int64[1, seq]
      %1 = weight {name="model.embed_tokens.weight"} : float32[256, 64]
      %2 = embedding(%1, %0) {padding_idx=-1, ...} : float32[1, seq, 64] loc("model.embed_tokens", "sparse.py:189")
      %3 = rms_norm(%2, %1) {...} : float32[1, seq, 64] loc("model.layers.0.input_layernorm", "m.py:5", "layers", 0)
      %4 = topk(%3) {k=2, ...} : (float32[1, seq, 2], int64[1, seq, 2])
      return %2
    }

Attr values: null, true, false, ints, floats (repr, inf, nan), JSON strings, [lists], and symbolic
dimensions in backticks (`2*seq`). In types a dimension is an int, a symbol name, or a backticked expression.
A span is ``loc(module, source)``, with the repeated block's stack name and index after them when it has one.
Inputs are the ``input`` nodes in order of appearance.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import sympy

from dayzero import UserError
from .node import Graph, Node, Span, TensorType
from .shape_expr import check_symbols, make_symbol, parse_dim


# ---- printing -----------------------------------------------------------------------------------------------

def _dim(d) -> str:
    if isinstance(d, int):
        return str(d)
    if isinstance(d, sympy.Symbol):
        return d.name
    return f"`{sympy.sstr(d)}`"


def _type(t: TensorType) -> str:
    return f"{t.dtype}[{', '.join(_dim(d) for d in t.shape)}]"


def _value(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, tuple):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, sympy.Basic):
        return f"`{sympy.sstr(v)}`"
    raise TypeError(f"attr value {v!r} has no text form")


def print_graph(g: Graph) -> str:
    names: dict[int, str] = {}
    syms = ", ".join(f"{n} in [{lo}, {hi}]" for n, lo, hi in g.symbols)
    lines = [f"graph {g.name} symbols({syms}) {{"]
    for k, n in enumerate(g.nodes()):
        names[id(n)] = f"%{k}"
        s = f"  %{k} = {n.op}"
        if n.inputs:
            s += "(" + ", ".join(names[id(i)] for i in n.inputs) + ")"
        if n.attrs:
            s += " {" + ", ".join(f"{a}={_value(v)}" for a, v in n.attrs) + "}"
        ty = _type(n.types[0]) if len(n.types) == 1 else "(" + ", ".join(map(_type, n.types)) + ")"
        s += " : " + ty
        if n.span.module or n.span.source or n.span.layer:
            layer = f", {json.dumps(n.span.layer[0])}, {n.span.layer[1]}" if n.span.layer else ""
            s += f" loc({json.dumps(n.span.module)}, {json.dumps(n.span.source)}{layer})"
        lines.append(s)
    lines.append("  return " + ", ".join(names[id(o)] for o in g.outputs))
    lines.append("}")
    return "\n".join(lines) + "\n"


# ---- parsing ------------------------------------------------------------------------------------------------

_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<ref>%\d+)
  | (?P<str>"(?:[^"\\]|\\.)*")
  | (?P<expr>`[^`]*`)
  | (?P<num>-?(?:\d+\.\d*(?:[eE][+-]?\d+)?|\d+[eE][+-]?\d+|\d+))
  | (?P<ninf>-inf)
  | (?P<name>[A-Za-z_][\w.]*)
  | (?P<punct>[\[\](){}=:,])
""", re.VERBOSE)


class _Parser:
    def __init__(self, text: str):
        self.toks: list[tuple[str, str]] = []
        pos = 0
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if not m:
                raise UserError(f"IR text: unexpected character {text[pos]!r} at offset {pos}")
            if m.lastgroup != "ws":
                self.toks.append((m.lastgroup, m.group()))
            pos = m.end()
        self.i = 0
        self.symbols: dict[str, sympy.Symbol] = {}

    def peek(self, value: str | None = None) -> bool:
        return self.i < len(self.toks) and (value is None or self.toks[self.i][1] == value)

    def next(self, kind: str | None = None) -> str:
        if self.i >= len(self.toks):
            raise UserError("IR text: unexpected end")
        k, v = self.toks[self.i]
        if kind is not None and k != kind and v != kind:
            raise UserError(f"IR text: expected {kind}, got {v!r}")
        self.i += 1
        return v

    def expr(self, src: str):
        return parse_dim(src, self.symbols)  # a grammar, never evaluated: IR text is a file like any other

    def value(self) -> Any:
        k, v = self.toks[self.i]
        self.i += 1
        if k == "num":
            return float(v) if any(c in v for c in ".eE") else int(v)
        if k == "str":
            return json.loads(v)
        if k == "expr":
            return self.expr(v[1:-1])
        if k == "ninf":
            return float("-inf")
        if k == "name":
            consts = {"null": None, "true": True, "false": False, "inf": float("inf"), "nan": float("nan")}
            if v in consts:
                return consts[v]
            raise UserError(f"IR text: unknown value {v!r}")
        if v == "[":
            return tuple(self.items("]", self.value))
        raise UserError(f"IR text: unexpected {v!r}")

    def dim(self):
        k, v = self.toks[self.i]
        self.i += 1
        if k == "num":
            return int(v)
        if k == "name":
            if v not in self.symbols:
                raise UserError(f"IR text: dimension {v!r} is not a declared symbol")
            return self.symbols[v]
        if k == "expr":
            return self.expr(v[1:-1])
        raise UserError(f"IR text: bad dimension {v!r}")

    def ttype(self) -> TensorType:
        dtype = self.next("name")
        self.next("[")
        return TensorType(dtype, tuple(self.items("]", self.dim)))

    def items(self, close: str, read) -> list:
        """``read()`` items separated by commas (a trailing one allowed) up to CLOSE, which is consumed."""
        out = []
        while not self.peek(close):
            out.append(read())
            if self.peek(","):
                self.next()
        self.next(close)
        return out

    def symbol_decl(self) -> tuple[str, int, int]:
        """``s in [lo, hi]``, declaring symbol s."""
        s = self.next("name")
        self.next("in")
        self.next("[")
        lo = int(self.next("num"))
        self.next(",")
        hi = int(self.next("num"))
        self.next("]")
        self.symbols[s] = make_symbol(s)
        return s, lo, hi

    def attr(self) -> tuple[str, object]:
        a = self.next("name")
        self.next("=")
        return a, self.value()

    def graph(self) -> Graph:
        self.next("graph")
        name = self.next("name")
        self.next("symbols")
        self.next("(")
        symbols = self.items(")", self.symbol_decl)
        check_symbols(symbols)
        self.next("{")
        env: dict[str, Node] = {}
        inputs = []
        while not self.peek("return"):
            ref = self.next("ref")
            self.next("=")
            op = self.next("name")
            def defined_ref():
                r = self.next("ref")
                if r not in env:
                    raise UserError(f"IR text: {r} used before it is defined")
                return env[r]

            ins = []
            if self.peek("("):
                self.next()
                ins = self.items(")", defined_ref)
            attrs = {}
            if self.peek("{"):
                self.next()
                attrs = dict(self.items("}", self.attr))
            self.next(":")
            if self.peek("("):
                self.next()
                types = self.items(")", self.ttype)
            else:
                types = [self.ttype()]
            span = Span()
            if self.peek("loc"):
                self.next()
                self.next("(")
                mod = json.loads(self.next("str"))
                self.next(",")
                src = json.loads(self.next("str"))
                layer = None
                if self.peek(","):  # the repeated block: stack name, index
                    self.next(",")
                    stack = json.loads(self.next("str"))
                    self.next(",")
                    index = self.next("num")
                    if not index.isdigit():
                        raise UserError(f"IR text: a repeated block's index is a non-negative integer, got {index!r}")
                    layer = (stack, int(index))
                self.next(")")
                span = Span(mod, src, layer)
            node = Node.make(op, ins, attrs, types, span)
            env[ref] = node
            if op == "input":
                inputs.append(node)
        self.next("return")
        outs = [env[self.next("ref")]]
        while self.peek(","):
            self.next()
            outs.append(env[self.next("ref")])
        self.next("}")
        return Graph(name, tuple(inputs), tuple(outs), tuple(symbols))


def parse_graph(text: str) -> Graph:
    return _Parser(text).graph()

