"""The reference interpreter: runs a graph with every op's reference implementation (ATen, eagerly).

Used to check passes numerically (a pass must not change what the graph computes) and to localise the first
divergence between the compiled program and upstream.
"""

from __future__ import annotations

from typing import Callable

import torch

from dayzero import UserError
from . import ops
from .node import Graph, Node


def infer_env(g: Graph, inputs: dict[str, torch.Tensor]) -> dict[str, int]:
    """Symbol values from the input tensors' shapes (every symbol appears bare in some input dimension)."""
    env: dict[str, int] = {}
    for n in g.inputs:
        t = inputs[n.attr["name"]]
        for d, v in zip(n.shape, t.shape):
            if not isinstance(d, int) and d.is_Symbol:
                env[d.name] = int(v)
            elif not isinstance(d, int) and len(d.free_symbols) == 1:  # 8*seq_blocks: solve the linear dim
                (sym,) = d.free_symbols
                a, b = d.as_poly(sym).all_coeffs() if d.as_poly(sym).degree() == 1 else (0, 0)
                if a and (int(v) - int(b)) % int(a) == 0:
                    env.setdefault(sym.name, (int(v) - int(b)) // int(a))
    for s, lo, hi in g.symbols:
        if s in env and not lo <= env[s] <= hi:
            raise UserError(f"{s}={env[s]} is outside its declared range [{lo}, {hi}]")
    return env


def run_graph(g: Graph, inputs: dict[str, torch.Tensor], weights: Callable[[str], torch.Tensor],
              observe: Callable[[Node, object], None] | None = None) -> list[torch.Tensor]:
    env = infer_env(g, inputs)
    vals: dict[int, object] = {}
    for n in g.nodes():
        if n.op == "input":
            v = inputs[n.attr["name"]]
        elif n.op in ("weight", "state"):  # states: the caller's tensors, updated in place by the program
            v = weights(n.attr["name"])
        else:
            v = ops.get(n.op).call([vals[id(i)] for i in n.inputs], n.attr, env)
        vals[id(n)] = v
        if observe is not None:
            observe(n, v)
    return [vals[id(o)] for o in g.outputs]
