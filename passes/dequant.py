"""dequant: an MXFP4 dequantisation chain feeding the routed experts -> one ``moe_experts_mxfp4`` node.

A low-precision checkpoint parameter enters the IR as its stored tensors followed by the dequantisation in plain
ATen ops (``frontend/lowprec.bind_low_precision``, the steps of transformers' ``convert_moe_packed_tensors``)::

    B uint8 [.., O, G, 16] ─┬─ bitwise_and(15) ─ _to_copy(int) ─ unsqueeze(-1) ─┐
                            └─ rshift(4) ─ [and(15)] ─ _to_copy(int) ─ unsqueeze(-1) ─ cat(-1) ─ view [.., O, G, 32]
    LUT f32 [16] (a constant equal to the E2M1 table) ─────────────────────────────── index.Tensor(LUT, codes) ─┐
    S uint8 [.., O, G] ─ _to_copy(f32) ─ sub(127) ─ exp2 ─ unsqueeze(-1) ──────────────────────────────────── mul
                                                        mul [.., O, G, 32] ─ view [.., O, 32G] ─ [transpose(-1, -2)]
                                                                                                  = W fp32

    moe_experts(x, ids, w, W_gu, [b_gu], W_d, [b_d])   with both W_gu, W_d such chains (layout nk: untransposed;
                                                       kn: transposed, gpt-oss)
        ==>  moe_experts_mxfp4(x, ids, w, B_gu, S_gu, [b_gu], B_d, S_d, [b_d])     (layout nk, same act/inter)

The match is by op identity, attrs, dtypes and shapes, never names: the table is accepted when the folded constant
(``ctx.constants``) holds exactly the 16 E2M1 values, the exponent when it subtracts the constant 127. The fused
kernel (``codegen/kernels/moe.py``, ``wfmt="mxfp4"``) decodes each weight element in registers as the grouped GEMM
reads it, so the experts stay resident at 4.25 bits per weight and no full-precision copy exists. A chain whose
consumer does not fuse stays as its generic ops (correct, slow, and a full-precision temporary).

Not matched yet (see the report): FP8-block chains, a chain feeding ``linear`` (no checkpoint dayzero makes has a
quantised dense linear; the dequant GEMM/GEMV kernels exist in ``codegen/kernels/dequant.py``), and the ONNX
frontend's 4-bit form (its scales are fp32 tensors, not E8M0 exponents: a different scale side).
Ordering: after ``fold_constants`` (the table and 127 are constants) and after ``moe``.
"""

from __future__ import annotations

import numpy as np
import torch

from dayzero.passes.ir import ops
from dayzero.passes.ir.node import Graph, Node, TensorType, rewrite

OP_MOE = "moe_experts_mxfp4"
_RESHAPES = {"view", "_unsafe_view", "reshape", "alias", "clone"}
_E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


# ---- the op --------------------------------------------------------------------------------------------------

def _dequant_ref(b: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """[.., O, G, 16] + [.., O, G] -> fp32 [.., O, 32G], as lowprec.dequant_mxfp4 (torch)."""
    lut = torch.from_numpy(_E2M1)
    codes = torch.stack([(b & 15).long(), (b >> 4).long()], dim=-1).reshape(*b.shape[:-1], 32)
    return (lut[codes] * torch.exp2(s.float() - 127).unsqueeze(-1)).reshape(*b.shape[:-2], b.shape[-2] * 32)


def moe_mxfp4_reference(ins, attrs):
    from .moe import moe_reference

    it = iter(ins)
    x, ids, w, gb, gs = (next(it) for _ in range(5))
    bgu = next(it) if attrs["gate_up_bias"] else None
    db, ds = next(it), next(it)
    bd = next(it) if attrs["down_bias"] else None
    if x.device.type == "meta":
        return torch.empty(x.shape, dtype=torch.promote_types(x.dtype, w.dtype), device="meta")
    dense = [x, ids, w, _dequant_ref(gb, gs)] + ([bgu] if bgu is not None else []) + [_dequant_ref(db, ds)] + \
        ([bd] if bd is not None else [])
    return moe_reference(dense, dict(attrs, layout="nk"))


if ops.REGISTRY.get(OP_MOE) is None:
    ops.register(ops.OpDef(
        OP_MOE, args=(("x", ops.TENSOR), ("topk_ids", ops.TENSOR), ("topk_weights", ops.TENSOR),
                      ("gate_up_blocks", ops.TENSOR), ("gate_up_scales", ops.TENSOR), ("b_gate_up", ops.OPT_TENSOR),
                      ("down_blocks", ops.TENSOR), ("down_scales", ops.TENSOR), ("b_down", ops.OPT_TENSOR),
                      ("act", ops.ATTR), ("inter", ops.ATTR), ("gate_up_bias", ops.ATTR), ("down_bias", ops.ATTR)),
        reference=moe_mxfp4_reference,
        doc="moe_experts with MXFP4 expert matrices as published (layout nk): gate_up_blocks uint8 [E,GU,H/32,16], "
            "gate_up_scales uint8 [E,GU,H/32], down_blocks [E,H,I/32,16], down_scales [E,H,I/32]; other args as "
            "moe_experts"))


# ---- the match -----------------------------------------------------------------------------------------------

def _const(n: Node, constants):
    if n.op == "weight" and n.attr["name"] in constants:
        return constants[n.attr["name"]]
    return None


def _through(n: Node, opset) -> Node:
    while n.op in opset and len(n.inputs) >= 1 and len(n.types) == 1:
        n = n.inputs[0]
    return n


def _is_last_swap(n: Node) -> bool:
    nd = len(n.shape)
    if n.op in ("permute", "permute_copy"):
        d = tuple(x % nd for x in n.attr["dims"])
        return d == (*range(nd - 2), nd - 1, nd - 2)
    if n.op == "transpose.int":
        return {n.attr["dim0"] % nd, n.attr["dim1"] % nd} == {nd - 2, nd - 1}
    return False


def _scalar_is(n: Node, value: float, constants) -> bool:
    c = _const(n, constants)
    return c is not None and c.numel() == 1 and float(c.reshape(-1)[0]) == value


def _scale_side(n: Node, constants) -> Node | None:
    """unsqueeze(exp2(_to_copy(S) - 127), -1) -> S (uint8 [.., G])."""
    n = _through(n, _RESHAPES | {"unsqueeze"})
    if n.op != "exp2":
        return None
    n = n.inputs[0]
    if n.op == "sub.Tensor" and n.attr.get("alpha", 1) == 1 and _scalar_is(n.inputs[1], 127.0, constants):
        n = n.inputs[0]
    elif n.op == "sub.Scalar" and n.attr.get("other") == 127 and n.attr.get("alpha", 1) == 1:
        n = n.inputs[0]
    else:
        return None
    if n.op != "_to_copy":
        return None
    s = n.inputs[0]
    return s if s.dtype == "uint8" else None


def _nibble(n: Node, high: bool) -> Node | None:
    """_to_copy(B & 15) (low) or _to_copy([(] B >> 4 [) & 15]) (high) -> B."""
    n = _through(n, {"_to_copy"} | _RESHAPES)
    if n.op == "bitwise_and.Scalar" and n.attr.get("other") == 15:
        inner = n.inputs[0]
        if not high:
            return inner if inner.dtype == "uint8" else None
        n = inner
    if high and n.op in ("__rshift__.Scalar", "bitwise_right_shift.Tensor_Scalar") and n.attr.get("other") == 4:
        b = n.inputs[0]
        return b if b.dtype == "uint8" else None
    return None


def _value_side(n: Node, constants) -> Node | None:
    """index.Tensor(E2M1 table, view(cat(lo[.., None], hi[.., None], -1))) -> B (uint8 [.., G, 16])."""
    if n.op != "index.Tensor" or n.attr.get("indices") != (True,) or len(n.inputs) != 2:
        return None
    lut = _const(n.inputs[0], constants)
    if lut is None or tuple(lut.shape) != (16,) or \
            not np.array_equal(lut.float().numpy().view(np.uint32), _E2M1.view(np.uint32)):
        return None
    codes = _through(n.inputs[1], _RESHAPES)
    if codes.op not in ("cat", "stack") or len(codes.inputs) != 2 or \
            codes.attr.get("dim") not in (-1, len(codes.shape) - 1):
        return None
    lo_n, hi_n = codes.inputs
    if codes.op == "cat":
        if lo_n.op != "unsqueeze" or hi_n.op != "unsqueeze" or codes.shape[-1] != 2:
            return None
        lo_n, hi_n = lo_n.inputs[0], hi_n.inputs[0]
    lo, hi = _nibble(lo_n, False), _nibble(hi_n, True)
    if lo is None or lo is not hi or len(lo.shape) < 2 or lo.shape[-1] != 16:
        return None
    return lo


def match_mxfp4(w: Node, constants) -> tuple[Node, Node, bool] | None:
    """W (fp32) -> (blocks, scales, transposed) when W is an MXFP4 dequant chain, else None."""
    transposed = _is_last_swap(w)
    n = w.inputs[0] if transposed else w
    n = _through(n, _RESHAPES)
    if n.op != "mul.Tensor" or len(n.inputs) != 2 or n.dtype != "float32" or len(n.shape) < 3 or n.shape[-1] != 32:
        return None
    for a, b in (n.inputs, n.inputs[::-1]):
        blocks, scales = _value_side(a, constants), _scale_side(b, constants)
        if blocks is not None and scales is not None:
            break
    else:
        return None
    lead = tuple(blocks.shape[:-1])
    if tuple(scales.shape) != lead or tuple(n.shape) != (*lead, 32):
        return None
    out = (*lead[:-1], lead[-1] * 32)
    base = w.inputs[0] if transposed else w
    if tuple(base.shape) != out:
        return None
    return blocks, scales, transposed


def _fuse_moe(n: Node, constants) -> Node | None:
    if n.op != "moe_experts":
        return None
    from dayzero.codegen.kernels import moe as kernels

    a = n.attr
    x, ids, w, wgu = n.inputs[:4]
    bgu = n.inputs[4] if a["gate_up_bias"] else None
    wd = n.inputs[5 if a["gate_up_bias"] else 4]
    bd = n.inputs[-1] if a["down_bias"] else None
    gu, d = match_mxfp4(wgu, constants), match_mxfp4(wd, constants)
    if gu is None or d is None:
        return None
    want_t = a["layout"] == "kn"  # an input-major [E, in, out] weight is the transposed dequant
    if gu[2] != want_t or d[2] != want_t:
        return None
    H, GU = int(x.shape[1]), int(gu[0].shape[1])
    if not kernels.supports_mxfp4(H, GU, int(a["inter"])):
        return None
    ins = [x, ids, w, gu[0], gu[1]] + ([bgu] if bgu is not None else []) + [d[0], d[1]] + \
        ([bd] if bd is not None else [])
    attrs = {k: a[k] for k in ("act", "inter", "gate_up_bias", "down_bias")}
    return Node.make(OP_MOE, ins, attrs, [TensorType(n.dtype, n.shape)], n.span)


def dequant(g: Graph, ctx) -> Graph:
    """Fuse MXFP4 dequant chains into their consumers; counts fused chains in ``ctx.patterns["dequant"]``."""
    count = 0

    def fn(n: Node):
        nonlocal count
        r = _fuse_moe(n, ctx.constants)
        if r is not None:
            count += 2  # the gate/up and the down chains
        return r

    out = rewrite(g, fn)
    if count:
        ctx.patterns["dequant"] = ctx.patterns.get("dequant", 0) + count
    return out
