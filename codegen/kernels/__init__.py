"""Hand-scheduled TVM kernels (TE compute definition + s_tir schedule per target, marked scheduled).

    dequant   MXFP4 / FP8-block dequant-GEMV (decode) and dequant-GEMM (prefill), host CPU and CUDA

The kernels of dayzero's fused ops are listed in one explicit table, ``table.py`` (op -> compute, schedule rule,
supports).
"""

from .dequant import (  # noqa: F401
    KERNELS,
    build,
    fp8_block_gemm,
    fp8_block_gemv,
    mxfp4_gemm,
    mxfp4_gemv,
)
