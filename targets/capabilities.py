"""What dayzero's hand-written kernels take, per target kind: the question a pass asks before it creates a fused op.

A pattern pass rewrites a subgraph into one of dayzero's fused ops only when a kernel for it exists with these
shapes and dtypes on the compile target; otherwise it leaves the generic ops (slow, correct). Passes ask here,
never codegen (layers import one way); codegen's kernel table (``codegen/kernels/table.py``) answers
``supports(target, node)`` with the same functions, and the kernels take their tiling constants from here, so the
answer and the kernel cannot drift apart.

    moe_experts            H, GU multiples of NB; H, I multiples of L; gate/up and down stored alike in fp32 /
                           bf16 / fp16                                       (codegen/kernels/moe.py)
    moe_experts_mxfp4      H, I multiples of the MXFP4 block (32); H, GU multiples of NB
    moe_experts_fp8        the dense kernel's tiling (any scale blocks, nk or kn)
    moe_experts_mxfp4_ws   both of the above tilings, host CPU (llvm) only (codegen/kernels/expert_workspace.py)
    dequant_linear_int4    nk / kn layout, blocks along axis 0 or 1 that tile it, an even row length
                                                                             (codegen/kernels/dequant_linear.py)

Target kinds are TVM's (``llvm`` for the host CPU, ``cuda``): every kernel is written for both (``KINDS``), except
the expert workspace (``WORKSPACE_KINDS``: host CPU only), which ``passes/expert_workspace.py``'s route choice asks.
"""

from __future__ import annotations

from dayzero.passes.ir.reference_dequant import int4_storage  # the op's storage geometry

# the grouped expert GEMM's tiles (codegen/kernels/moe.py): MB token rows x NB weight rows, L fp32 lanes
MOE_MB, MOE_NB, MOE_L = 4, 4, 16
MXFP4_BLOCK = 32  # values per E8M0 scale

KINDS = ("llvm", "cuda")  # the target kinds the kernels are written for
WORKSPACE_KINDS = ("llvm",)  # the converted-expert workspace route is written for the host CPU only

_DENSE_EXPERT_DTYPES = ("float32", "bfloat16", "float16")


def _dense_tiles(H: int, GU: int, I: int) -> bool:
    return not (H % MOE_NB or GU % MOE_NB or H % MOE_L or I % MOE_L)


def _mxfp4_tiles(H: int, GU: int, I: int) -> bool:
    return not (H % MXFP4_BLOCK or I % MXFP4_BLOCK or GU % MOE_NB or H % MOE_NB)


def moe_experts(H: int, GU: int, I: int, wgu_dtype: str, wd_dtype: str) -> bool:
    """The grouped expert GEMM over dense expert weights [E, GU, H] / [E, H, I] (either layout)."""
    return wgu_dtype == wd_dtype and wgu_dtype in _DENSE_EXPERT_DTYPES and \
        _dense_tiles(H, GU, I)


def moe_experts_mxfp4(H: int, GU: int, I: int) -> bool:
    """The grouped expert GEMM decoding MXFP4 expert weights as it reads them (layout nk)."""
    return _mxfp4_tiles(H, GU, I)


def moe_experts_fp8(H: int, GU: int, I: int) -> bool:
    """The grouped expert GEMM over FP8 E4M3 expert weights with block scales: the dense kernel's tiling."""
    return _dense_tiles(H, GU, I)


def moe_experts_mxfp4_ws(H: int, GU: int, I: int) -> bool:
    """MXFP4 experts converted into a workspace slot, then the dense GEMMs: both tilings (on WORKSPACE_KINDS)."""
    return _dense_tiles(H, GU, I) and _mxfp4_tiles(H, GU, I)


def dequant_linear_int4_problem(p: dict) -> str | None:
    """Why the int4 dequant-linear kernel cannot take attrs ``p``, or None when it can."""
    (R, C), _ = int4_storage(p)
    if p["layout"] not in ("nk", "kn") or p["block_axis"] not in (0, 1):
        return f"layout {p['layout']} / block axis {p['block_axis']}"
    if C % 2:
        return f"odd row length {C} (a byte would straddle two rows)"
    if (R, C)[p["block_axis"]] % p["block"]:
        return f"blocks of {p['block']} do not tile {(R, C)[p['block_axis']]}"
    return None
