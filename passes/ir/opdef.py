"""The op definition record: what the IR knows of an op (arguments, typed attrs, reference, aliasing), the
argument kinds, and the dtype names the IR uses. ``ops.py`` holds the registry of ATen ops, ``dayzero_ops.py``
declares dayzero's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import sympy
import torch

from dayzero import InternalError

# argument kinds
TENSOR, OPT_TENSOR, TENSOR_LIST, OPT_TENSOR_LIST, ATTR = "tensor", "opt_tensor", "tensor_list", "opt_tensor_list", "attr"


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
