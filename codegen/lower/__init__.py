"""Lowering: one IR node -> a TE compute (TVM's op definition language), per op, by op family.

``LOWERINGS[op](ctx, ins, attrs, out_types)`` returns the output ``te.Tensor`` (or a list, for multi-output
ops). ``ins`` are placeholders shaped like the node's inputs; symbolic dimensions are ``int64`` TIR variables
named after the graph's symbols (``seq``), so one compiled kernel serves every sequence length.

Semantics are ATen's (the IR speaks ATen): broadcasting aligns trailing dimensions, type promotion follows
``torch.result_type``, every value is a contiguous row-major tensor. Where TOPI has the op (topk, cumsum) we use
it; the rest are short ``te.compute`` definitions. The schedules live in ``codegen/schedule.py``; ops TE cannot
express have hand-written kernels instead (``codegen/kernels/table.py``).

    common.py       the symbol context, dims -> TIR, casts, broadcast loads, type promotion, the elementwise compute
    elementwise.py  arithmetic, comparisons, unary math, casts, where, clamp, bit ops
    shape.py        expand, permute, transpose, slice, select, cat, split, creation, copies, padding
    index.py        embedding, index, gather, index_select, the scatter family, index_put
    reduce.py       sum / mean / amax / ..., argmax, softmax, logsumexp, cumsum, topk, sort
    linear.py       linear, mm / bmm / matmul
    attention.py    scaled_dot_product_attention (the generic form)
    nn.py           rms_norm, layer_norm, convolution, pooling
    dequant.py      the typed dequant op (MXFP4 / FP8 blocks -> float32) where no consumer fused it
    fused.py        a ``fused`` group (passes/fuse.py): its members' computes composed, then inlined
"""

from __future__ import annotations

from typing import Callable

from tvm import te

from dayzero import InternalError
from . import attention, dequant, elementwise, fused, index, linear, nn, reduce, shape
from .common import Ctx  # noqa: F401 (the kernel builder's interface: codegen/program.py)

_FAMILIES = (elementwise, shape, index, reduce, linear, attention, nn, dequant, fused)


def _merge(families) -> dict[str, Callable]:
    table: dict[str, Callable] = {}
    for fam in families:
        twice = table.keys() & fam.LOWERINGS.keys()
        if twice:
            raise InternalError(f"{fam.__name__} lowers {sorted(twice)} again")
        table.update(fam.LOWERINGS)
    return table


# op -> its lowering, every family's table in one
LOWERINGS: dict[str, Callable] = _merge(_FAMILIES)


def lower_node(ctx: Ctx, op: str, ins: list[te.Tensor], attrs: dict, out_types) -> list[te.Tensor]:
    fn = LOWERINGS.get(op)
    if fn is None:
        raise InternalError(f"no lowering for {op}")
    res = fn(ctx, ins, dict(attrs, __op__=op), list(out_types))
    return list(res) if isinstance(res, (list, tuple)) else [res]
