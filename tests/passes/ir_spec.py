"""Run one IR pass on Before text and compare the result with Expected text, structurally (up to value renaming).

The text form (passes/ir/text.py) numbers values in the order they are written; ``structurally_equal`` compares
graphs node for node in their topological order (derived from the outputs), so two texts that differ only in how
their values are named or ordered compare equal, and a mismatch is shown as a diff of both graphs re-printed.
Both graphs go through the verifier first: a spec must itself be valid IR.
"""

from __future__ import annotations

import difflib
import textwrap

import pytest

from dayzero.passes.ir.node import Graph, structurally_equal
from dayzero.passes.ir.text import parse_graph, print_graph
from dayzero.passes.ir.verify import check_shapes, verify


def ir(text: str, shapes: bool = True) -> Graph:
    """Parse (dedented) IR text and verify it; ``shapes``: also check every node's type against its op's shape
    rule at the symbols' upper bounds (catches a mistyped hand-written spec)."""
    g = parse_graph(textwrap.dedent(text))
    verify(g)
    if shapes:
        check_shapes(g, {s: hi for s, _, hi in g.symbols})
    return g


def assert_ir(actual: Graph, expected: str | Graph, shapes: bool = True) -> None:
    """``actual`` (a pass's output, verified here) equals ``expected`` up to value renaming."""
    verify(actual)
    want = ir(expected, shapes) if isinstance(expected, str) else expected
    if not structurally_equal(actual, want):
        diff = "\n".join(difflib.unified_diff(print_graph(want).splitlines(), print_graph(actual).splitlines(),
                                              "expected", "actual", lineterm=""))
        pytest.fail("the pass's output differs from the expected IR:\n" + diff, pytrace=False)

