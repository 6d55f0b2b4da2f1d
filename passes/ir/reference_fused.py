"""The reference of a ``fused`` node (passes/fuse.py): its members' own references, run in body order.

A body entry is ``(op, args, attrs, dtype, shape)``; ``args`` index the node's inputs first, then the earlier
entries' values; the last entry's value is the node's output. Symbolic attrs and shapes inside the body are
already bound to their values (``OpDef.call`` binds the whole ``body`` attr).
"""

from __future__ import annotations

import torch

from dayzero import InternalError


def fused_reference(inputs: list[torch.Tensor], attrs: dict) -> torch.Tensor:
    from . import ops  # the registry imports this module's op declarations

    vals = list(inputs)
    for op, args, op_attrs, _dtype, _shape in attrs["body"]:
        if any(not 0 <= a < len(vals) for a in args):
            raise InternalError(f"fused body entry {op} reads a value that is not defined before it")
        od = ops.get(op)
        out = od.call([vals[a] for a in args], dict(op_attrs))
        if od.view:  # every IR value is contiguous: a view's reference may return a strided alias
            out = out.contiguous()
        vals.append(out)
    return vals[-1]
