"""Shapes read from files are parsed by a grammar, never evaluated (passes/ir/shape_expr.py).

A crafted program.json or IR text whose dimension is Python (``__import__('os').system(...)``) is refused with a
one-line UserError (CLI exit 2) and runs nothing; every shape string real artifacts hold parses to the expression
``sympy.sympify`` gave before.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import sympy

from dayzero import UserError
from dayzero.passes.ir.node import norm_dim
from dayzero.passes.ir.shape_expr import (MAX_SYMBOL_VALUE, check_symbols, dim_function, dim_value, make_symbol,
                                          parse_dim, symbol_table)
from dayzero.passes.ir.text import parse_graph

from _artifact_edit import rehash

SEQ, BATCH, BLOCKS = (make_symbol(n) for n in ("seq", "batch", "seq_blocks"))
SYMS = {"seq": SEQ, "batch": BATCH, "seq_blocks": BLOCKS}

# the dimension forms the compiler makes, written the way program.json and the IR text write them (sympy.sstr)
ACCEPTED = [SEQ, 8 * BLOCKS, SEQ + 1, 4 - SEQ, 2 * SEQ - 1, -SEQ, BATCH * SEQ, -2 * BATCH * SEQ, SEQ / 2,
            sympy.Rational(3, 2) * SEQ, SEQ**2, sympy.floor(SEQ / 8), sympy.ceiling(SEQ / 8), sympy.Mod(SEQ, 8),
            sympy.Max(4, SEQ), sympy.Min(BATCH, SEQ), sympy.Max(3, BATCH, SEQ), 8 * sympy.floor((SEQ + 7) / 8),
            BATCH * sympy.Mod(SEQ, 3) + sympy.floor(SEQ / 8), sympy.Integer(7)]


@pytest.mark.parametrize("expr", ACCEPTED, ids=sympy.sstr)
def test_every_form_the_compiler_writes_parses_back_to_the_same_expression(expr):
    assert parse_dim(sympy.sstr(expr), SYMS) == expr


@pytest.mark.parametrize("expr", ACCEPTED, ids=sympy.sstr)
def test_evaluation_is_exact_integer_arithmetic(expr):
    env = {"seq": 24, "batch": 3, "seq_blocks": 5}
    want = expr.subs({SYMS[k]: v for k, v in env.items()})  # sympy's own substitution is the reference
    assert dim_value(parse_dim(sympy.sstr(expr), SYMS), env) == int(want)
    assert dim_function(parse_dim(sympy.sstr(expr), SYMS), ["seq", "batch", "seq_blocks"])(24, 3, 5) == int(want)


def test_spacing_floor_division_and_unary_signs():
    assert parse_dim("(seq//8)", SYMS) == sympy.floor(SEQ / 8)  # how torch prints its FloorDiv
    assert parse_dim(" - -seq", SYMS) == SEQ
    assert parse_dim("+seq", SYMS) == SEQ


def test_a_non_integer_value_is_a_user_error():
    with pytest.raises(UserError, match="not an integer"):
        dim_value(parse_dim("seq/2", SYMS), {"seq": 5})


INJECTIONS = [
    "__import__('os').system('touch pwned')",
    "seq.__class__.__mro__",
    "exec('1')",
    "eval(\"1\")",
    "lambda: 1",
    "seq; import os",
    "[c for c in ()]",
    "Symbol('x')",
    "seq\n+1",
    "S.One",
    "E",
    "oo",
    "pi",
    "undeclared",
    "floor(seq",
    "seq +",
    "Max()",
    "floor(seq, 2)",
    "",
]


@pytest.mark.parametrize("text", INJECTIONS)
def test_anything_outside_the_grammar_is_a_one_line_user_error_naming_the_text(text):
    with pytest.raises(UserError) as e:
        parse_dim(text, SYMS)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("dimension expression") and repr(text)[:40] in msg


@pytest.mark.parametrize("text,why", [
    ("10**10**10", "exponent"),
    ("seq**9", "exponent"),
    ("(seq**8)**8", "exponent 64"),
    ("((2**8)**8)**8", "exceeds 128 bits"),
    ("9223372036854775807*9223372036854775807*9223372036854775807", "exceeds 128 bits"),
    ("99999999999999999999", "exceeds"),
    ("seq/0", "division by zero"),
    ("seq/(seq - seq)", "division by zero"),
    ("Mod(seq, 0)", "by zero"),
    ("-" * 40 + "seq", "nested deeper"),
    ("(" * 40 + "seq" + ")" * 40, "nested deeper"),
    ("seq + " * 60 + "1", "longer than"),
])
def test_sizes_are_bounded(text, why):
    with pytest.raises(UserError, match=why):
        parse_dim(text, SYMS)


@pytest.mark.parametrize("entries,why", [
    ([["seq; rm", 1, 4]], "not an identifier"),
    ([["floor", 1, 4]], "not an identifier"),
    ([["seq", -1, 4]], "range"),
    ([["seq", 8, 4]], "range"),
    ([["seq", 1, MAX_SYMBOL_VALUE + 1]], "range"),
    ([["seq", 1, "4"]], "range"),
    ([["seq", 1, 4.5]], "range"),
    ([["seq", 1]], r"\[name, lo, hi\]"),
    ([["seq", 1, 4], ["seq", 1, 4]], "twice"),
    ("seq", "list"),
])
def test_declared_symbols_are_identifiers_with_integer_ranges(entries, why):
    with pytest.raises(UserError, match=why):
        check_symbols(entries)


def test_norm_dim_never_parses_text():
    with pytest.raises(TypeError, match="not the text"):
        norm_dim("__import__('os').getcwd()")


IR = """graph main symbols(seq in [1, 64]) {
  %0 = input {name="input_ids"} : int64[1, DIM]
  return %0
}
"""


def test_ir_text_with_an_injected_dimension_fails_cleanly(tmp_path):
    flag = tmp_path / "pwned"
    assert parse_graph(IR.replace("DIM", "`2*seq`")).outputs[0].shape == (1, 2 * SEQ)
    for dim in (f"`__import__('os').system('touch {flag}')`", "`seq.real`", "undeclared"):
        with pytest.raises(UserError):
            parse_graph(IR.replace("DIM", dim))
    with pytest.raises(UserError, match="not an identifier|range"):
        parse_graph(IR.replace("seq in [1, 64]", "seq in [-1, 64]").replace("DIM", "seq"))
    assert not flag.exists()


# ---- real artifacts -------------------------------------------------------------------------------------------

def test_every_shape_of_a_real_artifact_parses_as_sympify_did(tiny_compiled):
    _, art, _ = tiny_compiled("qwen3_moe")
    pj = json.loads((art / "program.json").read_text())
    seen = 0
    for prog in pj["programs"].values():
        syms = symbol_table(check_symbols(prog["symbols"]))
        for b in prog["buffers"]:
            for d in b["shape"]:
                if isinstance(d, str):
                    # the reference: what the runtime built before (trusted text, written by this test's compile)
                    assert parse_dim(d, syms) == sympy.sympify(d, locals=syms), d
                    seen += 1
    assert seen > 0


def _dayzero(*args):
    """``dayzero ARGS`` in a real process (exit code and stderr as a user sees them)."""
    return subprocess.run([sys.executable, "-m", "dayzero.tools.cli", *args], capture_output=True, text=True,
                          timeout=600)


def _refused(code: int, stderr: str, args) -> None:
    """Exit 2 and one line on stderr naming the dimension or shape, no traceback."""
    assert code == 2, (args, stderr)
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr and ("dimension" in lines[0] or "shape" in lines[0]), stderr


@pytest.fixture
def crafted(tiny_compiled, tmp_path):
    """(artifact copy whose program.json carries ``shape`` on the token-id input, the file it must not create)."""
    _, art, _ = tiny_compiled("qwen3_moe")

    def make(shape_of):
        out = tmp_path / f"art{len(list(tmp_path.iterdir()))}"
        shutil.copytree(art, out)
        flag = tmp_path / "pwned"
        pj = json.loads((out / "program.json").read_text())
        prog = pj["programs"]["prefill"]
        bid = prog["inputs"][0]
        prog["buffers"][bid]["shape"][-1] = shape_of(flag)
        (out / "program.json").write_text(json.dumps(pj))
        rehash(out)  # a consistent manifest: the shape text itself must be refused, not the changed bytes
        return out, flag
    return make


CRAFTED = {
    "os.system": lambda f: f"__import__('os').system('touch {f}')",
    "in-sum": lambda f: f"seq + __import__('pathlib').Path('{f}').touch()",
    "bomb": lambda f: "10**10**10**10",
    "not-a-dim": lambda f: [1, 2],
}


@pytest.mark.slow
@pytest.mark.parametrize("shape_of", CRAFTED.values(), ids=CRAFTED.keys())
def test_crafted_program_json_is_refused_by_report_and_run(crafted, shape_of):
    """In-process (click's runner: the same command, its one stderr line and exit code, without a Python start
    per case); the end-to-end process is the test below."""
    from click.testing import CliRunner

    from dayzero.tools.cli import main

    art, flag = crafted(shape_of)
    for args in (["report", str(art)], ["run", str(art), "--input-ids", "1,2,3"]):
        r = CliRunner().invoke(main, args)
        assert isinstance(r.exception, SystemExit), (args, r.exc_info)  # the CLI's own exit, nothing escaped
        _refused(r.exit_code, r.stderr, args)
        assert r.stdout == "", (args, r.stdout)
        assert not flag.exists()


@pytest.mark.slow
def test_crafted_program_json_is_refused_by_a_real_process(crafted):
    """One case through a real ``python -m dayzero.tools.cli`` process per command: the exit code, stderr and no
    traceback as a shell sees them, and nothing run."""
    art, flag = crafted(CRAFTED["os.system"])
    for args in (["report", str(art)], ["run", str(art), "--input-ids", "1,2,3"]):
        r = _dayzero(*args)
        _refused(r.returncode, r.stderr, args)
        assert not flag.exists()
