"""Symbolic dimensions read back from text: a small grammar, parsed into sympy by constructors, never evaluated.

Every shape string dayzero reads (program.json buffers, the IR text form, report/compare) comes from a file, and
a file is untrusted input: ``sympy.sympify`` would run it as Python. ``parse_dim`` accepts exactly the forms
``sympy.sstr`` writes for the dimensions the compiler makes, over the declared symbols, and nothing else:

    sum    := term (('+' | '-') term)*
    term   := factor (('*' | '/' | '//') factor)*
    factor := ('-' | '+') factor | power
    power  := atom ['**' factor]                      exponent: an integer literal in [0, MAX_POW]
    atom   := INT | SYMBOL | FUNC '(' sum (',' sum)* ')' | '(' sum ')'
    FUNC   := floor | ceiling | Mod | Max | Min        (arity 1, 1, 2, >= 1, >= 1)

    "8*seq_blocks"  "seq + 1"  "4 - seq"  "floor(seq/8)"  "Mod(seq, 8)"  "Max(4, seq)"  "(seq//8)"  "seq**2"

Sizes are bounded (text length, literal digits, nesting depth, exponents, the magnitude of every constant built),
so no input makes the parser or the evaluator run long or allocate much (no ``10**10**10``). Anything else is a
``UserError`` naming the text. ``dim_function`` / ``dim_value`` evaluate a parsed dimension with exact integer
arithmetic (fractions for ``seq/2`` inside ``floor``), replacing ``sympy.lambdify``. ``check_symbols`` validates
the declared symbols (``[name, lo, hi]``): identifiers, integer ranges 0 <= lo <= hi <= MAX_SYMBOL_VALUE.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from fractions import Fraction

import sympy

from dayzero import InternalError, UserError

MAX_TEXT = 256  # characters of one dimension expression
MAX_DEPTH = 16  # nesting of parentheses, calls and unary signs
MAX_LITERAL = 2**63 - 1  # largest integer literal
MAX_CONST_BITS = 128  # numerator / denominator of any constant the parser builds
MAX_POW = 8  # largest exponent of a power
MAX_ARGS = 16  # arguments of Max / Min
MAX_SYMBOL_VALUE = 2**32  # upper bound of a declared symbol's range
MAX_SYMBOLS = 64

FUNCTIONS = {"floor": (sympy.floor, 1, 1), "ceiling": (sympy.ceiling, 1, 1), "Mod": (sympy.Mod, 2, 2),
             "Max": (sympy.Max, 1, MAX_ARGS), "Min": (sympy.Min, 1, MAX_ARGS)}

_TOKEN = re.compile(r"(?P<ws>[ \t]+)|(?P<int>[0-9]+)|(?P<name>[A-Za-z_][A-Za-z0-9_]*)|(?P<op>\*\*|//|[-+*/(),])")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def make_symbol(name: str) -> sympy.Symbol:
    """Every symbolic dimension is a positive integer symbol (so sympy simplifies shapes soundly)."""
    return sympy.Symbol(name, integer=True, positive=True)


def _show(text: str) -> str:
    return repr(text if len(text) <= 80 else text[:77] + "...")


class _Parser:
    def __init__(self, text: str, symbols: Mapping[str, sympy.Symbol]):
        self.text = text
        self.symbols = symbols
        self.toks: list[tuple[str, str]] = []
        pos = 0
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if m is None:
                self.fail(f"unexpected character {text[pos]!r}")
            if m.lastgroup != "ws":
                self.toks.append((m.lastgroup, m.group()))
            pos = m.end()
        self.i = 0
        self.depth = 0

    def fail(self, why: str):
        raise UserError(f"dimension expression {_show(self.text)}: {why}")

    def peek(self) -> str | None:
        return self.toks[self.i][1] if self.i < len(self.toks) else None

    def take(self, want: str | None = None) -> tuple[str, str]:
        if self.i >= len(self.toks):
            self.fail("unexpected end")
        kind, v = self.toks[self.i]
        if want is not None and v != want:
            self.fail(f"expected {want!r}, got {v!r}")
        self.i += 1
        return kind, v

    def checked(self, e: sympy.Expr) -> sympy.Expr:
        """Refuse what sympy built if it is not a finite dimension of bounded size."""
        if e.has(sympy.zoo, sympy.oo, -sympy.oo, sympy.nan):
            self.fail("not finite (a division by zero?)")
        for a in e.atoms(sympy.Rational):
            if max(abs(a.p).bit_length(), abs(a.q).bit_length()) > MAX_CONST_BITS:
                self.fail(f"a constant exceeds {MAX_CONST_BITS} bits")
        for p in e.atoms(sympy.Pow):
            if not (p.exp.is_Integer and abs(int(p.exp)) <= MAX_POW):
                self.fail(f"exponent {p.exp} is outside [-{MAX_POW}, {MAX_POW}]")
        return e

    def enter(self):
        self.depth += 1
        if self.depth > MAX_DEPTH:
            self.fail(f"nested deeper than {MAX_DEPTH}")

    def sum(self) -> sympy.Expr:
        e = self.term()
        while self.peek() in ("+", "-"):
            _, op = self.take()
            t = self.term()
            e = self.checked(sympy.Add(e, t if op == "+" else sympy.Mul(sympy.Integer(-1), t)))
        return e

    def term(self) -> sympy.Expr:
        e = self.factor()
        while self.peek() in ("*", "/", "//"):
            _, op = self.take()
            f = self.factor()
            if op == "*":
                e = sympy.Mul(e, f)
            else:
                if f == 0:
                    self.fail("division by zero")
                e = sympy.Mul(e, sympy.Pow(f, sympy.Integer(-1)))
                if op == "//":
                    e = sympy.floor(e)
            e = self.checked(e)
        return e

    def factor(self) -> sympy.Expr:
        if self.peek() in ("-", "+"):
            _, op = self.take()
            self.enter()
            f = self.factor()
            self.depth -= 1
            return self.checked(sympy.Mul(sympy.Integer(-1), f)) if op == "-" else f
        return self.power()

    def power(self) -> sympy.Expr:
        base = self.atom()
        if self.peek() != "**":
            return base
        self.take()
        kind, v = self.take()
        if kind != "int" or len(v) > 2 or int(v) > MAX_POW:
            self.fail(f"an exponent is an integer literal in [0, {MAX_POW}], got {v!r}")
        return self.checked(sympy.Pow(base, sympy.Integer(int(v))))

    def atom(self) -> sympy.Expr:
        kind, v = self.take()
        if kind == "int":
            if len(v) > 19 or int(v) > MAX_LITERAL:
                self.fail(f"integer {v[:24]} exceeds {MAX_LITERAL}")
            return sympy.Integer(int(v))
        if kind == "name":
            if self.peek() == "(":
                if v not in FUNCTIONS:
                    self.fail(f"unknown function {v!r}")
                fn, lo, hi = FUNCTIONS[v]
                self.take("(")
                self.enter()
                args = [self.sum()]
                while self.peek() == ",":
                    self.take()
                    args.append(self.sum())
                self.take(")")
                self.depth -= 1
                if not lo <= len(args) <= hi:
                    self.fail(f"{v} takes {lo if lo == hi else f'{lo} to {hi}'} argument(s), got {len(args)}")
                if v == "Mod" and args[1] == 0:
                    self.fail("Mod by zero")
                return self.checked(fn(*args))
            if v not in self.symbols:
                self.fail(f"unknown symbol {v!r} (declared: {', '.join(self.symbols) or 'none'})")
            return self.symbols[v]
        if v == "(":
            self.enter()
            e = self.sum()
            self.take(")")
            self.depth -= 1
            return e
        self.fail(f"unexpected {v!r}")

    def parse(self) -> sympy.Expr:
        if not self.toks:
            self.fail("empty")
        e = self.sum()
        if self.i != len(self.toks):
            self.fail(f"unexpected {self.toks[self.i][1]!r}")
        return e


def parse_dim(text: str, symbols: Mapping[str, sympy.Symbol]) -> sympy.Expr:
    """The sympy expression of a dimension written as text, over ``symbols`` (name -> Symbol); UserError if the
    text is not in the grammar above."""
    if not isinstance(text, str):
        raise UserError(f"dimension {text!r} is not an integer or an expression string")
    if len(text) > MAX_TEXT:
        raise UserError(f"dimension expression {_show(text)} is longer than {MAX_TEXT} characters")
    return _Parser(text, symbols).parse()


def check_symbols(entries) -> dict[str, tuple[int, int]]:
    """Declared symbols ``[[name, lo, hi], ...]`` as {name: (lo, hi)}; UserError on a bad name or range."""
    if not isinstance(entries, list | tuple) or len(entries) > MAX_SYMBOLS:
        raise UserError(f"symbols must be a list of at most {MAX_SYMBOLS} [name, lo, hi] entries")
    out: dict[str, tuple[int, int]] = {}
    for ent in entries:
        if not (isinstance(ent, list | tuple) and len(ent) == 3):
            raise UserError(f"symbol entry {str(ent)[:80]!r} is not [name, lo, hi]")
        name, lo, hi = ent
        if not (isinstance(name, str) and _IDENT.match(name) and len(name) <= 64) or name in FUNCTIONS:
            raise UserError(f"symbol name {str(name)[:80]!r} is not an identifier")
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (lo, hi)) \
                or not 0 <= lo <= hi <= MAX_SYMBOL_VALUE:
            raise UserError(f"symbol {name}: range [{str(lo)[:24]}, {str(hi)[:24]}] is not integers "
                            f"0 <= lo <= hi <= {MAX_SYMBOL_VALUE}")
        if name in out:
            raise UserError(f"symbol {name} is declared twice")
        out[name] = (lo, hi)
    return out


def symbol_table(names: Iterable[str]) -> dict[str, sympy.Symbol]:
    return {n: make_symbol(n) for n in names}


# ---- exact evaluation -------------------------------------------------------------------------------------------

def _compile(e: sympy.Expr, index: Mapping[str, int]) -> Callable[[tuple], int | Fraction]:
    if e.is_Integer:
        c = int(e)
        return lambda env: c
    if e.is_Rational:
        q = Fraction(int(e.p), int(e.q))
        return lambda env: q
    if e.is_Symbol:
        if e.name not in index:
            raise InternalError(f"dimension symbol {e.name} has no value")
        k = index[e.name]
        return lambda env: env[k]
    args = [_compile(a, index) for a in e.args]
    if isinstance(e, sympy.Add):
        return lambda env: sum(f(env) for f in args)
    if isinstance(e, sympy.Mul):
        return lambda env: math.prod(f(env) for f in args)
    if isinstance(e, sympy.Pow) and e.exp.is_Integer:
        base, n = args[0], int(e.exp)
        return (lambda env: base(env) ** n) if n >= 0 else (lambda env: Fraction(1, base(env) ** -n))
    if isinstance(e, sympy.floor):
        return lambda env: math.floor(args[0](env))
    if isinstance(e, sympy.ceiling):
        return lambda env: math.ceil(args[0](env))
    if isinstance(e, sympy.Mod):
        return lambda env: args[0](env) % args[1](env)
    if isinstance(e, sympy.Max):
        return lambda env: max(f(env) for f in args)
    if isinstance(e, sympy.Min):
        return lambda env: min(f(env) for f in args)
    raise InternalError(f"dimension {e} ({type(e).__name__}) has no exact evaluation")


def dim_function(e: sympy.Expr | int, order: Iterable[str]) -> Callable[..., int]:
    """``f(*values)``: the integer value of ``e`` with the symbols in ``order`` bound to ``values``."""
    if isinstance(e, int):
        return lambda *env: e
    order = tuple(order)
    f = _compile(e, {n: k for k, n in enumerate(order)})

    def value(*env) -> int:
        v = f(env)
        if isinstance(v, Fraction):
            if v.denominator != 1:
                raise UserError(f"dimension {e} is not an integer at {dict(zip(order, env))}")
            v = v.numerator
        return int(v)
    return value


def dim_value(e: sympy.Expr | int, values: Mapping[str, int]) -> int:
    """The integer value of ``e`` with every symbol bound by ``values`` (name -> int)."""
    names = tuple(values)
    return dim_function(e, names)(*(values[n] for n in names))


def parse_program_shapes(prog: dict) -> tuple[dict[str, tuple[int, int]], dict[str, sympy.Expr]]:
    """A program.json program's declared symbols and every buffer dimension text, checked and parsed:
    ({name: (lo, hi)}, {dimension text: expression}). UserError on a bad symbol, dimension or buffer list."""
    symbols = check_symbols(prog.get("symbols", []))
    table = symbol_table(symbols)
    exprs: dict[str, sympy.Expr] = {}
    buffers = prog.get("buffers", [])
    if not isinstance(buffers, list):
        raise UserError(f"program {str(prog.get('name'))[:40]!r}: buffers is not a list")
    for b in buffers:
        shape = b.get("shape") if isinstance(b, dict) else None
        if not isinstance(shape, list):
            raise UserError(f"program {str(prog.get('name'))[:40]!r}: a buffer has no shape list")
        for d in shape:
            if isinstance(d, str):
                if d not in exprs:
                    exprs[d] = parse_dim(d, table)
            elif not (isinstance(d, int) and not isinstance(d, bool) and d >= 0):
                raise UserError(f"program {str(prog.get('name'))[:40]!r}: buffer dimension {str(d)[:40]!r} is "
                                "neither a non-negative int nor an expression")
    return symbols, exprs


def dim_at(d: int | str, values: Mapping[str, int]) -> int:
    """A program.json dimension (an int, or text over the symbols of ``values``) at those symbol values."""
    if isinstance(d, int) and not isinstance(d, bool):
        return d
    return dim_value(parse_dim(d, symbol_table(values)), values)


__all__ = ["check_symbols", "dim_at", "dim_function", "dim_value", "make_symbol", "parse_dim", "parse_program_shapes",
           "symbol_table"]
