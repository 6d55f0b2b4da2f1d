"""The op registry: for every op, its arguments, its reference implementation and its shape rule.

Most ops are ATen ops, registered on first use from the ATen schema (so the IR speaks ATen's vocabulary and its
semantics are ATen's, exactly): tensor arguments become node inputs, every other argument a typed attr named as
in the schema. The reference implementation calls the ATen op itself, and the shape/dtype rule is the same call on
``meta`` tensors (ATen's own meta functions), evaluated at concrete symbol values. dayzero's own ops (``input``,
``weight``, ``getitem`` and the fused ops the pattern passes create) are declared in one place,
``dayzero_ops.py``, each with a hand-written reference; the registry starts with them.

An op's lowering (IR op -> TE compute) or hand-written kernel is looked up by its name on the compiler's side
(the lowering families and the kernel table); nothing here knows them.
"""

from __future__ import annotations

import torch

from dayzero import InternalError
from .dayzero_ops import DAYZERO_OPS
# the registry's vocabulary, used as ops.OpDef, ops.TENSOR, ops.dtype_name, ... across the package
from .opdef import (ATTR, DTYPE_BYTES, OPT_TENSOR, OPT_TENSOR_LIST, TENSOR, TENSOR_LIST,  # noqa: F401
                    OpDef, bind_symbols, dtype_name, torch_dtype)

# arguments that do not change the computation on our targets
_DROPPED_ARGS = {"layout", "device", "pin_memory", "memory_format", "non_blocking"}

__all__ = ["ATTR", "DTYPE_BYTES", "OPT_TENSOR", "OPT_TENSOR_LIST", "TENSOR", "TENSOR_LIST", "OpDef", "REGISTRY",
           "aten_name", "aten_op", "bind_symbols", "dtype_name", "get", "register", "torch_dtype"]

REGISTRY: dict[str, OpDef] = {op.name: op for op in DAYZERO_OPS}


def register(op: OpDef) -> OpDef:
    if op.name in REGISTRY:
        raise InternalError(f"op {op.name} registered twice")
    REGISTRY[op.name] = op
    return op


def aten_name(overload) -> str:
    packet, ov = overload._schema.name.split("::")[-1], overload._overloadname
    return packet if ov == "default" else f"{packet}.{ov}"


# Views: contiguous in, contiguous out, same bytes. Everything else runs a kernel.
_VIEW_OPS = {"view", "_unsafe_view", "reshape", "squeeze", "squeeze.dim", "squeeze.dims", "unsqueeze", "alias",
             "clone", "lift_fresh_copy"}


def aten_op(overload) -> OpDef:
    """The OpDef of an ATen overload, registered from its schema on first use."""
    name = aten_name(overload)
    if name in REGISTRY:
        return REGISTRY[name]
    args = []
    for a in overload._schema.arguments:
        t = str(a.type)
        if a.name in _DROPPED_ARGS:
            continue
        kind = {"Tensor": TENSOR, "Optional[Tensor]": OPT_TENSOR, "List[Tensor]": TENSOR_LIST,
                "List[Optional[Tensor]]": OPT_TENSOR_LIST}.get(t, ATTR)
        args.append((a.name, kind))
    return register(OpDef(name=name, args=tuple(args), aten=overload, view=name in _VIEW_OPS,
                          doc=str(overload._schema)))


def get(name: str) -> OpDef:
    op = REGISTRY.get(name)
    if op is None:
        # ATen ops register lazily: resolve "add.Tensor" -> torch.ops.aten.add.Tensor
        packet, _, ov = name.partition(".")
        try:
            overload = getattr(getattr(torch.ops.aten, packet), ov or "default")
        except AttributeError:
            raise InternalError(f"unknown op {name!r}") from None
        op = aten_op(overload)
    return op


