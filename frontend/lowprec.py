"""Low-precision weight formats as published, read without offline conversion.

Two formats, each with a validator (raises UserError naming the tensor), a reference dequantiser (fp32, built on
ml_dtypes' own format definitions, no hand-rolled bit tables) and a writer (fp32 -> the bytes a real checkpoint
holds; make-tiny uses it).

MXFP4, gpt-oss layout (OCP MX: 32 FP4 E2M1 values share one E8M0 scale)::

    blocks  uint8 [..., G, 16]   byte b = blocks[..., g, j] holds two E2M1 codes, low nibble first:
                                 W[..., 32*g + 2*j]     = E2M1(b & 0xF)  * 2^(scales[..., g] - 127)
                                 W[..., 32*g + 2*j + 1] = E2M1(b >> 4)   * 2^(scales[..., g] - 127)
    scales  uint8 [..., G]       E8M0 exponent, bias 127; 0xFF is NaN (rejected)
    W       fp32  [..., G*32]    for an expert weight: [E, out, in] (transformers transposes it afterwards)

FP8 block, DeepSeek-V3 layout::

    weight          float8_e4m3fn (or its uint8 bytes) [..., R, C]
    weight_scale_inv fp32 [..., ceil(R/128), ceil(C/128)]   (edge blocks may be partial)
                    W[..., r, c] = E4M3(weight[..., r, c]) * weight_scale_inv[..., r // 128, c // 128]

Every function takes numpy arrays or torch tensors and returns the same kind it was given.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from .. import UserError
from ..passes.ir.formats import (
    E8M0_BIAS,
    E8M0_NAN,
    FP4_MAX,
    FP8_BLOCK_SIZE,
    FP8_E4M3_MAX,
    MXFP4_BLOCK,
    MXFP4_BYTES_PER_BLOCK,
)

FP8_BLOCK = (FP8_BLOCK_SIZE, FP8_BLOCK_SIZE)  # (rows, columns) of one weight_scale_inv block

# The 16 E2M1 values and the 256 E8M0 scales, decoded by ml_dtypes (the format's definition, not our own table).
FP4_E2M1_VALUES = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)


# ----------------------------------------------------------------------------------------------- helpers
def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def _np(x) -> np.ndarray:
    """A numpy view of x (a torch tensor or array-like); float8 torch tensors come back as their uint8 bytes."""
    if _is_torch(x):
        import torch

        t = x.detach().cpu()
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu):
            t = t.view(torch.uint8)
        return t.contiguous().numpy()
    return np.asarray(x)


def _like(ref, arr: np.ndarray):
    """arr as the same kind as ref (torch tensor if ref is one); float8 arrays become torch float8 tensors."""
    if not _is_torch(ref):
        return arr
    import torch

    if arr.dtype == ml_dtypes.float8_e4m3fn:
        return torch.from_numpy(np.ascontiguousarray(arr).view(np.uint8)).view(torch.float8_e4m3fn)
    return torch.from_numpy(np.ascontiguousarray(arr))


def _u8(x, name: str, what: str) -> np.ndarray:
    a = _np(x)
    if a.dtype != np.uint8:
        if a.dtype == np.int8:  # some loaders hand packed bytes over as int8
            return a.view(np.uint8)
        raise UserError(f"{name}: {what} must be uint8, got {a.dtype}")
    return a


# ----------------------------------------------------------------------------------------------- MXFP4
def validate_mxfp4(blocks, scales, name: str = "weight") -> tuple[np.ndarray, np.ndarray]:
    """Check an MXFP4 pair; return (blocks, scales) as uint8 numpy views. Raises UserError naming `name`."""
    b = _u8(blocks, f"{name}_blocks", "MXFP4 blocks")
    s = _u8(scales, f"{name}_scales", "E8M0 scales")
    if b.ndim < 2 or b.shape[-1] != MXFP4_BYTES_PER_BLOCK:
        raise UserError(f"{name}_blocks: MXFP4 blocks must be [..., G, 16] uint8, got shape {list(b.shape)}")
    if tuple(b.shape[:-1]) != tuple(s.shape):
        raise UserError(
            f"{name}: blocks shape {list(b.shape)} does not match scales shape {list(s.shape)} "
            f"(expected scales {list(b.shape[:-1])})"
        )
    nan = s == E8M0_NAN
    if nan.any():
        idx = tuple(int(i) for i in np.argwhere(nan)[0])
        raise UserError(f"{name}_scales: {int(nan.sum())} NaN E8M0 scale code(s) 0xFF, first at index {list(idx)}")
    return b, s


def e8m0_to_float32(scales) -> np.ndarray:
    """E8M0 codes (uint8 [...]) -> fp32 2^(s-127) (0xFF -> NaN), via ml_dtypes.float8_e8m0fnu."""
    return _np(scales).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float32)


def unpack_fp4(blocks) -> np.ndarray:
    """uint8 [..., K/2] -> fp32 [..., K] E2M1 values, low nibble first, via ml_dtypes.float4_e2m1fn."""
    b = _np(blocks).astype(np.uint8, copy=False)
    codes = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(*b.shape[:-1], b.shape[-1] * 2)
    return codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)


def dequant_mxfp4(blocks, scales, name: str = "weight"):
    """MXFP4 blocks [..., G, 16] + scales [..., G] -> fp32 [..., G*32] (rows stay [out, in]; no transpose)."""
    b, s = validate_mxfp4(blocks, scales, name)
    vals = unpack_fp4(b)  # [..., G, 32]
    with np.errstate(over="ignore"):  # 6 * 2^127 is inf in fp32, as in every other implementation
        w = vals * e8m0_to_float32(s)[..., None]
    return _like(blocks, w.reshape(*b.shape[:-2], b.shape[-2] * MXFP4_BLOCK))


def quantize_mxfp4(w, name: str = "weight"):
    """fp32 [..., K] (K % 32 == 0) -> (blocks uint8 [..., K/32, 16], scales uint8 [..., K/32]).

    Per 32 values: scale = 2^ceil(log2(amax / 6)) (the "round up" rule of the triton kernels gpt-oss was
    quantised with, so no value saturates), E8M0 code clamped to [0, 254]; elements w / scale rounded to nearest
    even E2M1 by ml_dtypes. An all-zero block gets code 0 (smallest scale) and zero codes.
    """
    a = _np(w).astype(np.float32)
    if a.ndim < 1 or a.shape[-1] % MXFP4_BLOCK:
        raise UserError(f"{name}: MXFP4 needs the last dim to be a multiple of 32, got shape {list(a.shape)}")
    if not np.isfinite(a).all():
        raise UserError(f"{name}: cannot quantise non-finite values to MXFP4")
    g = a.reshape(*a.shape[:-1], a.shape[-1] // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = np.abs(g).max(axis=-1)
    with np.errstate(divide="ignore"):
        e = np.ceil(np.log2(amax.astype(np.float64) / FP4_MAX))
    e = np.where(amax > 0, e, -E8M0_BIAS)
    code = np.clip(e + E8M0_BIAS, 0, 254).astype(np.uint8)
    scale = code.view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    q = (g.astype(np.float64) / scale[..., None]).astype(np.float32)
    codes = q.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0x0F
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return _like(w, blocks), _like(w, code)


# ----------------------------------------------------------------------------------------------- FP8 block
def _fp8_bytes(weight, name: str) -> np.ndarray:
    a = _np(weight)
    if a.dtype == ml_dtypes.float8_e4m3fn:
        return a.view(np.uint8)
    return _u8(a, name, "FP8 E4M3 weight (float8_e4m3fn or its bytes)")


def validate_fp8_block(weight, scale_inv, block=FP8_BLOCK, name: str = "weight") -> tuple[np.ndarray, np.ndarray]:
    """Check an FP8-block pair; return (weight bytes uint8, scale_inv fp32) numpy. Raises UserError naming it."""
    wb = _fp8_bytes(weight, name)
    s = _np(scale_inv)
    if wb.ndim < 2:
        raise UserError(f"{name}: FP8 block weight must be [..., R, C], got shape {list(wb.shape)}")
    if s.dtype != np.float32:
        raise UserError(f"{name}_scale_inv: must be float32, got {s.dtype}")
    br, bc = block
    want = (*wb.shape[:-2], math.ceil(wb.shape[-2] / br), math.ceil(wb.shape[-1] / bc))
    if tuple(s.shape) != want:
        raise UserError(
            f"{name}: weight shape {list(wb.shape)} with {br}x{bc} blocks needs weight_scale_inv shape "
            f"{list(want)}, got {list(s.shape)}"
        )
    bad = ~np.isfinite(s)
    if bad.any():
        idx = [int(i) for i in np.argwhere(bad)[0]]
        raise UserError(f"{name}_scale_inv: {int(bad.sum())} NaN/Inf value(s), first at index {idx}")
    return wb, s


def fp8_e4m3_to_float32(weight) -> np.ndarray:
    """E4M3 bytes or float8_e4m3fn [...] -> fp32, via ml_dtypes.float8_e4m3fn (0x7F / 0xFF are NaN)."""
    return _fp8_bytes(weight, "weight").view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def dequant_fp8_block(weight, scale_inv, block=FP8_BLOCK, name: str = "weight"):
    """FP8 E4M3 [..., R, C] x weight_scale_inv [..., ceil(R/br), ceil(C/bc)] -> fp32 [..., R, C]."""
    wb, s = validate_fp8_block(weight, scale_inv, block, name)
    br, bc = block
    r, c = wb.shape[-2:]
    full = np.repeat(np.repeat(s, br, axis=-2), bc, axis=-1)[..., :r, :c]
    return _like(scale_inv if _is_torch(scale_inv) else weight, fp8_e4m3_to_float32(wb) * full)


def quantize_fp8_block(w, block=FP8_BLOCK, name: str = "weight"):
    """fp32 [..., R, C] -> (weight float8_e4m3fn [..., R, C], weight_scale_inv fp32 [..., ceil(R/br), ceil(C/bc)]).

    Per block scale_inv = 2^ceil(log2(amax / 448)) (a power of two, as DeepSeek-V3.2's UE8M0 scales; the same
    "round up" rule as ``quantize_mxfp4``, so no value saturates), weight = RNE_E4M3(w / scale_inv); an all-zero
    block gets scale_inv 1. Dequantised values are fixed points, also when re-blocked over a sub-range of rows
    (make-tiny rounds fused gate/up experts, then stores gate and up apart). numpy in ->
    ml_dtypes.float8_e4m3fn array; torch in -> torch.float8_e4m3fn tensor.
    """
    a = _np(w).astype(np.float32)
    if a.ndim < 2:
        raise UserError(f"{name}: FP8 block quantisation needs [..., R, C], got shape {list(a.shape)}")
    if not np.isfinite(a).all():
        raise UserError(f"{name}: cannot quantise non-finite values to FP8")
    br, bc = block
    r, c = a.shape[-2:]
    nr, nc = math.ceil(r / br), math.ceil(c / bc)
    pad = np.zeros((*a.shape[:-2], nr * br, nc * bc), np.float32)
    pad[..., :r, :c] = a
    t = pad.reshape(*a.shape[:-2], nr, br, nc, bc)
    amax = np.abs(t).max(axis=(-3, -1))
    with np.errstate(divide="ignore"):
        e = np.ceil(np.log2(amax.astype(np.float64) / FP8_E4M3_MAX))
    scale_inv = np.where(amax > 0, np.exp2(e), 1.0).astype(np.float32)
    full = np.repeat(np.repeat(scale_inv, br, axis=-2), bc, axis=-1)[..., :r, :c]
    q = np.clip(a / full, -FP8_E4M3_MAX, FP8_E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
    return _like(w, q), _like(w, scale_inv)


# ----------------------------------------------------------------------------------------------- graph binding
# A checkpoint parameter stored in low precision enters the IR as its stored tensors (``weight`` nodes of the
# stored dtype/shape, zone low_precision_weights) read by one typed ``dequant`` op: the format is known here, so
# no pass has to recognise it. passes/dequant.py fuses it into the consumer's kernel (or lowers it alone).
# (A graph arriving without this binding holds the dequantisation as plain ATen ops: tests/_dequant_chain.py
# exports such chains.)
# FP8 parameters stacked from several checkpoint tensors (per-expert gate/up/down) get one scale per row_block rows
# (checkpoint._fp8_param; 128 for published DeepSeek experts): block (row_block, 128).

LOW_PRECISION_ZONE = "low_precision_weights"


def bind_low_precision(traced, params: dict) -> int:
    """Replace every ``weight`` node named by ``params`` ({name: checkpoint.LowPrecParam}) with its stored tensors
    read by one typed ``dequant`` op (format, block, transposed: passes/ir/dayzero_ops.py). Returns how many
    were replaced."""
    from dayzero.passes.ir.node import Node, Span, TensorType, repeated_block, rewrite

    done = 0

    def fn(n):
        nonlocal done
        if n.op != "weight" or n.attr["name"] not in params:
            return None
        p = params[n.attr["name"]]
        if n.dtype != "float32":
            raise UserError(f"{p.param}: low-precision storage for a {n.dtype} parameter is not supported")
        data_t, scale_t = p.types(n.shape)
        module = n.attr["name"].rsplit(".", 1)[0]
        span = Span(module, "dayzero.frontend.lowprec", repeated_block(module))
        data = Node.make("weight", (), {"name": p.data_name, "zone": LOW_PRECISION_ZONE},
                         [TensorType(*data_t)], span)
        scale = Node.make("weight", (), {"name": p.scale_name, "zone": LOW_PRECISION_ZONE},
                          [TensorType(*scale_t)], span)
        mx = p.fmt == "mxfp4"
        shape = (*data_t[1][:-2], data_t[1][-2] * MXFP4_BLOCK) if mx else tuple(data_t[1])
        transposed = bool(p.in_major) and mx
        if transposed:
            shape = (*shape[:-2], shape[-1], shape[-2])
        if TensorType("float32", shape) != n.type:
            raise UserError(f"{p.param}: dequantised float32{list(shape)} does not match the parameter's {n.type}")
        out = Node.make("dequant", (data, scale), {"format": p.fmt, "transposed": transposed, "out_dtype": "float32",
                                                   "block": MXFP4_BLOCK if mx else (p.row_block, FP8_BLOCK[1])},
                        [n.type], span)
        done += 1
        return out

    traced.graph = rewrite(traced.graph, fn)
    return done


# ----------------------------------------------------------------------------------------------- bf16 binding
# A parameter the checkpoint stores in bfloat16 that the (fp32) trace reads only as a ``linear``'s weight or an
# ``embedding``'s table stays bfloat16 in the arena, as published: it enters the IR as a bfloat16 ``weight`` read
# by ``_to_copy`` to float32 (exact), which passes/dequant.py moves into the consumer (``dequant_linear_bf16``;
# the embedding gathers bf16 rows, then converts them). Any other reader (norms, biases, routers' fused ops, expert
# stacks, sinks) keeps the fp32 copy the runtime converts at load: those are small, or read by kernels that take fp32.

BF16_READERS = {"linear": 1, "embedding": 0}  # op -> the input a bf16-stored weight may be (or a grouped
# projection's view, _grouped_projection)


def bf16_weights(graphs, stored_bf16) -> set[str]:
    """Names among ``stored_bf16`` (parameters the checkpoint holds in bfloat16 only) that are float32 ``weight``
    nodes of every graph in ``graphs`` where they occur, each read only as ``BF16_READERS`` says."""
    from dayzero.passes.ir.node import users

    ok, bad = set(), set()
    for g in graphs:
        uses = users(g)
        for n in g.nodes():
            name = n.attr.get("name") if n.op == "weight" else None
            if name not in stored_bf16 or name in bad:
                continue
            readers = uses.get(id(n), [])
            if n.dtype == "float32" and "shard" not in n.attr and len(n.shape) == 2 and readers and all(
                    (r.op in BF16_READERS and r.inputs[BF16_READERS[r.op]] is n and
                     sum(i is n for i in r.inputs) == 1) or _grouped_projection(r, n, uses) for r in readers):
                ok.add(name)
            else:
                bad.add(name)
    return ok - bad


def _grouped_projection(view, w, uses) -> bool:
    """``view`` reads ``w`` [G N, K] as [G, N, K], and is read only transposed as a ``bmm``'s right operand: a
    grouped projection (passes/dequant_bf16.py's ``dequant_bf16.grouped``)."""
    if view.op != "view" or len(view.shape) != 3 or view.shape[-1] != w.shape[-1]:
        return False
    ts = uses.get(id(view), [])
    if len(ts) != 1 or ts[0].op != "permute" or tuple(ts[0].attr.get("dims", ())) != (0, 2, 1):
        return False
    mms = uses.get(id(ts[0]), [])
    return len(mms) == 1 and mms[0].op == "bmm" and mms[0].inputs[1] is ts[0] and mms[0].inputs[0] is not ts[0]


def bind_bf16(traced, names: set[str]) -> int:
    """Every float32 ``weight`` named in ``names`` -> ``_to_copy(weight bfloat16, dtype float32)``; returns how
    many nodes were replaced."""
    from dayzero.passes.ir.node import Node, TensorType, rewrite

    done = 0

    def fn(n):
        nonlocal done
        if n.op != "weight" or n.attr["name"] not in names:
            return None
        done += 1
        stored = Node.make("weight", (), dict(n.attr), [TensorType("bfloat16", n.shape)], n.span)
        return Node.make("_to_copy", (stored,), {"dtype": "float32"}, [n.type], n.span)

    traced.graph = rewrite(traced.graph, fn)
    return done
