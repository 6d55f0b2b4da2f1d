"""Dequant-GEMV (decode) and dequant-GEMM (prefill) over low-precision weights read as published.

Every kernel computes ``y[t, o] = sum_k x[t, k] * W[o, k]`` with W given in its storage format (see
``dayzero.frontend.lowprec`` for the formats), never materialised in full
(``decode.py`` gives the formats' layouts).

Argument order of every PrimFunc:  x fp32 [T, K], weight..., scales..., [expert int32], y fp32 [T, O].
GEMV kernels have a static T (1..64 decode tokens); GEMM kernels a symbolic T (one compiled kernel serves every T).

Format decode in ``decode.py``, the GEMV kernels in ``gemv.py`` (the integer MXFP4 route in ``gemv_int8.py``), the
GEMM kernels in ``gemm.py``, the schedule steps they share in ``scheduling.py``; ``build`` compiles one kernel of
``KERNELS`` by name.

Compiled kernels need 64-byte-aligned, offset-0 tensors (torch allocations are; numpy views may not be).
"""

from __future__ import annotations

import tvm

from dayzero import UserError
from dayzero.codegen.kernels.dequant.decode import is_cuda, lookup_mode  # noqa: F401  (lookup_mode: public)
from dayzero.codegen.kernels.dequant.gemm import fp8_block_gemm, mxfp4_gemm
from dayzero.codegen.kernels.dequant.gemv import fp8_block_gemv, mxfp4_gemv
from dayzero.codegen.kernels.dequant.gemv_int8 import int8_route  # noqa: F401  (public: the route rule)

KERNELS = {
    "mxfp4_gemv": mxfp4_gemv,
    "mxfp4_gemm": mxfp4_gemm,
    "fp8_block_gemv": fp8_block_gemv,
    "fp8_block_gemm": fp8_block_gemm,
}

_CACHE: dict = {}


def build(kind: str, *args, target: dict, **kwargs):
    """Compile kernel KIND (one of KERNELS) for TARGET; cached per (kind, args, target). Returns the callable."""
    if kind not in KERNELS:
        raise UserError(f"unknown dequant kernel {kind!r}; expected one of {', '.join(KERNELS)}")
    key = (kind, args, tuple(sorted(kwargs.items())), tuple(sorted((k, str(v)) for k, v in target.items())))
    if key not in _CACHE:
        func = KERNELS[kind](*args, target=target, **kwargs)
        lib = tvm.compile(tvm.IRModule({"main": func}), target=target)
        _CACHE[key] = lib if is_cuda(target) else lib["main"]
    return _CACHE[key]
