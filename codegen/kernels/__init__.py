"""Hand-scheduled TVM kernels (TE compute definition + s_tir schedule per target, marked scheduled).

    dequant   MXFP4 / FP8-block dequant-GEMV (decode) and dequant-GEMM (prefill), host CPU and CUDA
"""

from .dequant import (  # noqa: F401
    KERNELS,
    build,
    fp8_block_gemm,
    fp8_block_gemv,
    mxfp4_gemm,
    mxfp4_gemv,
)
from . import moe  # noqa: F401,E402  (moe_experts: grouped expert GEMM kernel, registers lower.PRIMFUNCS)
from . import state  # noqa: F401,E402  (state_index_put / assign: in-place KV-cache writes)
from . import attention  # noqa: F401,E402  (cache_attention / sparse_attention: read only the rows a query sees)
from . import compressed_attention  # noqa: F401,E402  (DeepSeek-V4 CSA / HCA: the window rows + the selected / valid entries)
from . import dequant_linear  # noqa: F401,E402  (dequant_linear_{int4,mxfp4,fp8}: dense linear over stored low-precision weights)
from . import expert_workspace  # noqa: F401,E402  (moe_experts_mxfp4_ws: MXFP4 experts via a converted-expert workspace)
