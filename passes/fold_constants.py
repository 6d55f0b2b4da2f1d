"""fold_constants: evaluate at compile time every value that depends on no input and no weight.

    scalar_tensor(1e-6)            weight "const.<hash>"  (bound from the artifact's constants)
    arange(0, 8) -> mul(., 2)  ==>
    full([], True)

Only statically shaped values are folded (a value shaped by ``seq`` depends on the input's length) and only small
ones (at most ``MAX_ELEMENTS``): folding a large broadcast would trade a cheap kernel for resident bytes. Empty
values (0 elements) are left in fold_empty's form (``empty.memory_format``: no bytes, no manifest entry).

A buffer made by an ``empty*`` op (upstream's ``new_empty`` then slice copies, as MLA's ``expand_kv`` writes its
keys) folds to zeros: its contents are never read before written, and uninitialised memory would give the
artifact different bytes (and constant names) on every compile; zeros also split over tensor-parallel ranks as one
block (passes/shard.py).
"""

from __future__ import annotations

import hashlib

import torch

from dayzero.passes.ir import ops
from dayzero.passes.ir.node import Graph, Node, TensorType, rewrite
from dayzero.passes.pipeline import Found

MAX_ELEMENTS = 1 << 16


def constant_name(v: torch.Tensor, t: TensorType) -> str:
    """The weight name of folded value ``v`` of type ``t``: a hash of its bytes and type."""
    raw = v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return "const." + hashlib.sha256(raw + str(t).encode()).hexdigest()[:16]


def fold_constants(g: Graph) -> tuple[Graph, Found]:
    """Returns the rewritten graph and, in ``Found.constants``, the folded values (name -> tensor)."""
    values: dict[int, torch.Tensor] = {}
    constants: dict[str, torch.Tensor] = {}

    def fn(n: Node):
        if n.op in ("input", "weight", "state") or len(n.types) != 1 or ops.get(n.op).inplace:
            return None
        if not all(id(i) in values for i in n.inputs):
            return None
        if any(not isinstance(d, int) for d in n.shape):
            return None
        numel = 1
        for d in n.shape:
            numel *= d
        if numel > MAX_ELEMENTS or numel == 0:
            return None
        v = ops.get(n.op).call([values[id(i)] for i in n.inputs], n.attr)
        if n.op.startswith(("empty", "new_empty")):
            v = torch.zeros_like(v)
        name = constant_name(v, n.types[0])
        constants[name] = v
        folded = Node.make("weight", (), {"name": name}, n.types, n.span)
        values[id(folded)] = v
        return folded

    return rewrite(g, fn), Found(constants=constants)
