"""What a pass returns besides its graph: ``Found``; and ``pattern_pass``, a pass that is its rule set.

Every pass is a function ``(graph, what it reads) -> (graph, Found)`` (``fold_empty``, which finds nothing, returns
its graph alone): what it reads are explicit arguments (the folded constants, the paged KV configuration, ...),
and what it produced (pattern counts, constants it made, the paged KV layout) comes back in its ``Found``. The
order the passes run in, and the rest of the compiler, is one list in tools/compiler.py (``GRAPH_STEPS``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

import torch

from dayzero.passes.ir.node import Graph
from dayzero.passes.ir.pattern import Rule, rewrite


@dataclass
class Found:
    """What a pass produced besides its graph."""
    patterns: dict[str, int] = field(default_factory=dict)  # pattern name -> matches
    constants: dict[str, torch.Tensor] = field(default_factory=dict)  # tensors the pass folded or made
    # the paged KV layout paged_kv chose (the artifact's ``kv_pages``): {"block_size", "table_len", "length",
    # "tables"}; None: the caches stay contiguous
    kv_pages: dict | None = None

    def merge(self, other: Found) -> None:
        """Add ``other`` (a later pass's) to this: counts add up, constants and the layout accumulate."""
        for k, v in other.patterns.items():
            self.patterns[k] = self.patterns.get(k, 0) + v
        self.constants.update(other.constants)
        self.kv_pages = other.kv_pages if other.kv_pages is not None else self.kv_pages


def counted(name: str, count: int) -> Found:
    """A pass's ``Found`` with ``count`` matches of pattern ``name`` (none listed when 0)."""
    return Found({name: count} if count else {})


def pattern_pass(name: str, rules: Iterable[Rule]) -> Callable[[Graph, Mapping[str, torch.Tensor]], tuple]:
    """The pass ``name`` that is its rule set: ``(graph, constants) -> (graph, Found)``, rewriting with
    ``rules`` (``passes/ir/pattern.rewrite``) over the folded ``constants``; ``Found.patterns`` counts each rule's
    matches."""
    rules = tuple(rules)

    def run(g: Graph, constants: Mapping[str, torch.Tensor] | None = None) -> tuple[Graph, Found]:
        g, counts = rewrite(g, rules, constants)
        return g, Found(counts)
    run.__name__ = run.__qualname__ = name
    run.__doc__ = f"{name}: rewrite with {', '.join(r.name for r in rules)}; Found counts each rule's matches."
    return run
