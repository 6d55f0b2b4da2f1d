"""The op registry: for every op, its arguments, its reference implementation and its lowering.

Most ops are ATen ops, registered on first use from the ATen schema (so the IR speaks ATen's vocabulary and its
semantics are ATen's, exactly): tensor arguments become node inputs, every other argument a typed attr named as
in the schema. The reference implementation calls the ATen op itself, and the shape/dtype rule is the same call on
``meta`` tensors (ATen's own meta functions), evaluated at concrete symbol values. dayzero's own ops (``input``,
``weight``, ``getitem`` and the fused ops the pattern passes create) register explicitly with a hand-written
reference.

The lowering (IR op -> TE compute) lives in ``codegen/lower.py``; ``OpDef.lower`` is looked up there by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import sympy
import torch

from dayzero import InternalError

# argument kinds
TENSOR, OPT_TENSOR, TENSOR_LIST, OPT_TENSOR_LIST, ATTR = "tensor", "opt_tensor", "tensor_list", "opt_tensor_list", "attr"

# arguments that do not change the computation on our targets
_DROPPED_ARGS = {"layout", "device", "pin_memory", "memory_format", "non_blocking"}


@dataclass
class OpDef:
    name: str
    args: tuple[tuple[str, str], ...] = ()  # (name, kind) in call order
    aten: Any = None  # the torch OpOverload, for ATen ops
    view: bool = False  # output aliases input 0's (contiguous) storage: no kernel, no copy
    reference: Callable[..., Any] | None = None  # (inputs: list[Tensor], attrs: dict) -> Tensor | tuple
    doc: str = ""
    meta_ok: bool = True  # the reference runs on meta tensors (shape rule)
    inplace: bool = False  # writes into input 0's buffer; the output aliases it (the kernel takes inputs only)

    def call(self, inputs: list[torch.Tensor], attrs: dict[str, Any], env: dict[str, int] | None = None):
        """Run the reference implementation; symbolic attrs take their values from ``env``."""
        if env is not None:
            attrs = {k: bind_symbols(v, env) for k, v in attrs.items()}
        if self.reference is not None:
            return self.reference(inputs, attrs)
        args, kwargs = self.unflatten(inputs, attrs)
        out = self.aten(*args, **kwargs)
        # every IR value is a contiguous row-major tensor: keep the reference in the same layout
        if isinstance(out, (tuple, list)):
            return type(out)(o.contiguous() for o in out)
        return out.contiguous()

    def unflatten(self, inputs: list[torch.Tensor], attrs: dict[str, Any]):
        """Rebuild the ATen call's (args, kwargs) from node inputs and attrs."""
        it = iter(inputs)
        args, kwargs = [], {}
        schema = {a.name: a for a in self.aten._schema.arguments}
        for name, kind in self.args:
            if kind == TENSOR:
                v = next(it)
            elif kind == OPT_TENSOR:
                v = next(it) if attrs[name] else None
            elif kind == TENSOR_LIST:
                v = [next(it) for _ in range(attrs[name])]
            elif kind == OPT_TENSOR_LIST:
                v = [next(it) if p else None for p in attrs[name]]
            else:
                v = attrs.get(name, None)
                if name == "dtype" and v is not None:
                    v = torch_dtype(v)
                if isinstance(v, tuple):
                    v = list(v)
            if schema[name].kwarg_only:
                kwargs[name] = v
            else:
                args.append(v)
        if "device" in schema and schema["device"].kwarg_only:
            kwargs["device"] = torch.get_default_device()  # factories follow `with torch.device(...)`
        return args, kwargs


def bind_symbols(v: Any, env: dict[str, int]) -> Any:
    """Replace symbolic dimensions inside an attr value by their concrete values."""
    if isinstance(v, tuple):
        return tuple(bind_symbols(x, env) for x in v)
    if isinstance(v, sympy.Basic):
        return int(v.subs({s: env[s.name] for s in v.free_symbols}))
    return v


REGISTRY: dict[str, OpDef] = {}


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


# ---- dtypes -------------------------------------------------------------------------------------------------

def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise InternalError(f"unknown dtype {name!r}")
    return dt


DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
               "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


# ---- dayzero's own ops --------------------------------------------------------------------------------------

def _no_ref(name):
    def ref(inputs, attrs):
        raise InternalError(f"{name} has no reference: it is bound by the runtime")
    return ref


register(OpDef("input", args=(("name", ATTR),), reference=_no_ref("input"), meta_ok=False,
               doc="a program input; attr name"))
register(OpDef("weight", args=(("name", ATTR),), reference=_no_ref("weight"), meta_ok=False,
               doc="a parameter, buffer or constant, bound at load time; attr name (key in the weights manifest)"))
register(OpDef("state", args=(("name", ATTR), ("zone", ATTR)), reference=_no_ref("state"), meta_ok=False,
               doc="a persistent mutable buffer shared by the programs of an artifact (KV cache, cross-layer state);"
                   " attrs name, zone (kv_cache | cross_layer_state); zero when a request starts"))
register(OpDef("assign", reference=lambda ins, a: ins[0].copy_(ins[1]), inplace=True, meta_ok=False,
               doc="state := value (whole tensor), at the end of the program; output aliases the state"))
register(OpDef("state_index_put", args=(("indices", ATTR),), inplace=True, meta_ok=False,
               reference=lambda ins, a: torch.ops.aten.index_put_(  # the ATen op takes None for an open dim
                   ins[0], [ins[1 + a["indices"][:k + 1].count(True) - 1] if p else None
                    for k, p in enumerate(a["indices"])], ins[-1]),
               doc="state[..., idx, ...] = values in place (index_put into a state buffer); attr indices: which "
                   "dims are indexed; inputs: state, index tensors, values; output aliases the state"))
register(OpDef("getitem", args=(("index", ATTR),), view=True,
               reference=lambda ins, a: ins[0][a["index"]], doc="output #index of a multi-output node"))
