"""fold_empty: a value with a 0 in its static shape holds no elements: one canonical form, no kernel, no bytes.

    %p = slice.Tensor(%q) {start=16, ...} : f32[1, 4, seq, 0]      %p = empty.memory_format {size=[1, 4, `seq`, 0]}
    %c = cat(%r, %p) {dim=-1, tensors=2} : f32[1, 4, seq, 16]  ==>   (%c is %r)
    %s = sum.dim_IntList(%p) {dim=[-1]} : f32[1, 4, seq]            %s = full {size=[1, 4, `seq`], fill_value=0.0}

(a partial rotary embedding whose rotated part spans the whole head: the pass-through half is empty.)

Rules, in one bottom-up sweep (a node sees its inputs already rewritten):

* empty -- a node whose one output is statically empty (some dimension is the integer 0) becomes
  ``empty.memory_format`` of its type: no inputs, so whatever computed it is gone too. Inputs, weights, states and
  in-place ops (their write is the point) are left alone. The program builder gives an empty value a buffer of 0
  bytes and no kernel.
* cat -- statically empty inputs are dropped (ATen skips them, including the legacy 1-D ``[0]`` tensor); a cat
  left with one input is that input. Where a dropped input decided the result dtype (ATen promotes over all
  inputs), what is left is cast to it (``_to_copy``).
* fill -- a node whose every input is statically empty but whose output is not (a reduction over an empty
  dimension: sum -> 0, prod -> 1, any -> False, mean -> nan) becomes ``full`` of the value its reference computes
  on empty inputs, when every element gets that one value (checked at two bindings of the symbols). A reference
  that raises (amax of nothing) leaves the node as it is.

Ordering: before fold_constants, which leaves 0-element values alone, so empties keep this form.
"""

from __future__ import annotations

import functools
import math

import torch

from dayzero.passes.ir import ops
from dayzero.passes.ir.node import Graph, Node, TensorType, rewrite
from dayzero.passes.ir.verify import concrete_shape

EMPTY = "empty.memory_format"


def empty_like_type(t: TensorType, span) -> Node:
    """The canonical empty value of type ``t`` (which must be statically empty)."""
    return Node.make(EMPTY, (), {"size": t.shape, "dtype": t.dtype}, [t], span)


def _is_empty(n: Node) -> bool:
    return all(t.is_empty for t in n.types)


def _bindings(g: Graph) -> list[dict[str, int]]:
    lo = {s: max(a, 1) for s, a, _ in g.symbols}
    return [lo, {s: min(v + 1, g.symbol_bounds[s][1]) for s, v in lo.items()}]


def _uniform_value(n: Node, envs: list[dict[str, int]]):
    """The one value every element of ``n``'s output takes when its (empty) inputs are run, or None."""
    od = ops.get(n.op)
    if od.reference is not None or od.aten is None:  # dayzero's own ops: bound by the runtime or fused
        return None
    found = None
    for env in envs:
        ins = [torch.empty(concrete_shape(i.shape, env), dtype=ops.torch_dtype(i.dtype)) for i in n.inputs]
        try:
            out = od.call(ins, n.attr, env)
        except Exception:  # noqa: BLE001 - ATen refuses this op on empty inputs (amax): keep the kernel
            return None
        if not isinstance(out, torch.Tensor) or out.numel() == 0:
            return None
        flat = out.reshape(-1)
        v = flat[0].item()
        if isinstance(v, float) and math.isnan(v):
            same = bool(flat.isnan().all())
        else:
            same = bool((flat == flat[0]).all())
        if not same or (found is not None and not _same(found, v)):
            return None
        found = v
    return found


def _same(a, b) -> bool:
    return a == b or (a != a and b != b)  # nan equals nan here


def _cat_without_empties(n: Node) -> Node:
    """cat of the non-empty inputs; an empty input may still have decided the dtype (ATen promotes over every
    input): then the cat of the others is cast to it."""
    keep = [i for i in n.inputs if not _is_empty(i)]
    dtype = ops.dtype_name(functools.reduce(torch.promote_types, (ops.torch_dtype(i.dtype) for i in keep)))
    cat = keep[0] if len(keep) == 1 else \
        Node.make("cat", keep, dict(n.attr, tensors=len(keep)), [TensorType(dtype, n.shape)], n.span)
    return cat if dtype == n.dtype else Node.make("_to_copy", (cat,), {"dtype": n.dtype}, n.types, n.span)


def fold_empty(g: Graph) -> Graph:
    envs = _bindings(g)

    def fn(n: Node):
        if n.op in ("input", "weight", "state", EMPTY) or len(n.types) != 1 or ops.get(n.op).inplace:
            return None
        if n.type.is_empty:
            return empty_like_type(n.type, n.span)
        if n.op == "cat" and any(_is_empty(i) for i in n.inputs):
            return _cat_without_empties(n)
        if n.inputs and all(_is_empty(i) for i in n.inputs):
            v = _uniform_value(n, envs)
            if v is not None:
                return Node.make("full", (), {"size": n.shape, "fill_value": v, "dtype": n.dtype}, n.types, n.span)
        return None

    return rewrite(g, fn)
