"""dequant: a dequantisation feeding its consumer -> one fused node reading the weight as stored.

The PyTorch frontend knows the format of a checkpoint's low-precision weights: its binding
(``frontend/lowprec.bind_low_precision``) emits the typed op ``dequant(data, scale) {format mxfp4 | fp8, block,
transposed}``, which the rules below read directly. A graph that arrives without the binding (ONNX's
``MatMulNBits`` / blocked ``DequantizeLinear``, a user module that dequantises itself the way transformers'
``convert_moe_packed_tensors`` and DeepSeek's ``weight_dequant`` do) holds the dequantisation as plain ATen ops:
three such chains are recognised, by op identity, attrs, dtypes, shapes and constant values, never names, and
both paths meet in the same fused ops::

MXFP4 B uint8 [.., O, G, 16] ─┬─ bitwise_and(15) ─ _to_copy(int) ─ unsqueeze(-1) ─┐
                              └─ rshift(4) ─ [and(15)] ─ _to_copy(int) ─ unsqueeze(-1) ─ cat(-1) ─ view [.., O, G, 32]
      LUT f32 [16] (a constant equal to the E2M1 table) ─────────────────────────────── index.Tensor(LUT, codes) ─┐
      S uint8 [.., O, G] ─ _to_copy(f32) ─ sub(127) ─ exp2 ─ unsqueeze(-1) ──────────────────────────────────── mul
                                                          mul [.., O, G, 32] ─ view [.., O, 32G] ─ [transpose(-1, -2)]

FP8   Wq float8_e4m3fn [.., N, K] ─ _to_copy(f32) ───────────────────────────────────────────────────────────┐
      S f32 [.., ⌈N/br⌉, ⌈K/bc⌉] ─ [repeat_interleave(br, -2)] ─ [repeat_interleave(bc, -1)] ─ [slice]* ─ mul
                                   (unsqueeze ─ expand ─ [clone] ─ view each)       [.., N, K]
      (DeepSeek's 128x128 blocks: br = bc = 128; the frontend binds experts shorter than a scale block with
      br < 128, one scale row per br rows: see frontend/checkpoint._fp8_param)

INT4  P uint8 (packed, any shape) ─┬─ bitwise_and(15) ─ view [.., 1] ─┐
                                   └─ rshift(4) ─────── view [.., 1] ─ cat(-1) ─ view ─ [xor(8)] ─ _to_copy(f32)
      ─ [sub(c)] ─ view ─ [sub(Z)] ─ mul(S) ─ view [R, C]     S, Z f32 broadcast as [R/bs, 1, C] (blocks along
                                                              rows) or [R, C/bs, 1] (along columns), c a scalar

Rewrites (x [.., K] fp32; T = the product of x's leading dims, symbolic or not)::

    moe_experts(x, ids, w, W_gu, [b_gu], W_d, [b_d])    both W MXFP4 chains (layout nk: untransposed; kn: transposed)
        ==>  moe_experts_mxfp4(x, ids, w, B_gu, S_gu, [b_gu], B_d, S_d, [b_d])
    moe_experts(x, ids, w, W_gu, [b_gu], W_d, [b_d])    both W FP8 chains [E, .., ..] (either layout; blocks any)
        ==>  moe_experts_fp8(x, ids, w, Wq_gu, S_gu, [b_gu], Wq_d, S_d, [b_d])   attrs gate_up_block, down_block

    linear(x, W [N, K], [b])  |  matmul / mm(x, W [K, N])      W any of the three chains (int4 [R, C] = [N, K] is
        ==>  view [.., N] ( dequant_linear_FMT(view [T, K] (x), stored...) ) [+ b]     layout nk, [K, N] is kn;
                                                                                 MXFP4 / FP8 through matmul need
             FMT = int4:  (x, view [R, C/2] (P), view S2 (S), [view S2 (Z)])      the transposed chain)
                   mxfp4: (x, B [N, G, 16], S [N, G])      fp8: (x, Wq [N, K], S)

A checkpoint's bf16 projections and tables (the frontend's ``_to_copy(W bf16)`` binding) are not fused here but by
``dequant_bf16`` after ``shard``, which splits them over the ranks like any weight first.

Constants are checked by value: the E2M1 table and the exponent bias 127 (folded by ``fold_constants``
into the ``constants`` the pass reads), the nibble mask 15 and shift 4, the int4 xor 8 and offset. The fused kernels
(``codegen/kernels/moe.py`` ``wfmt="mxfp4"`` / ``"fp8"``; ``codegen/kernels/dequant_linear.py``: decode GEMV for a static
T <= 64, prefill GEMM for a symbolic T) decode each weight element as they read it, so weights stay resident as
stored and no full-precision copy exists. A chain whose consumer does not fuse, or that differs in any checked
detail (a wrong bit layout, no scale, a partial block), stays as its generic ops (correct, slow, and a
full-precision temporary); a typed op no consumer fused lowers on its own (``codegen/lower/dequant.py``). Counts:
``dequant.experts`` (fused expert blocks, two weights each) and ``dequant.linear``.

Ordering: after ``fold_constants`` (the table, 127 and the ONNX literals are constants) and after ``moe``.
"""

from __future__ import annotations

import math

import numpy as np

from dayzero.passes.ir.node import Node, TensorType, view_node
from dayzero.passes.ir.pattern import (ALPHA1, Alt, Match, P, Pat, Rule, V, cast, const, isin, last_dim, many, need,
                                       strip_views, with_scalar)
from dayzero.passes.ir.reference_dequant import E2M1 as _E2M1, int4_storage
from dayzero.passes.pipeline import pattern_pass
from dayzero.targets import capabilities

OP_MOE = "moe_experts_mxfp4"
OP_MOE_FP8 = "moe_experts_fp8"
OP_DEQUANT = "dequant"  # the typed op of the frontend's low-precision binding (passes/ir/dayzero_ops.py)


# ---- the match -----------------------------------------------------------------------------------------------

def _is_last_swap(n: Node) -> bool:
    nd = len(n.shape)
    if n.op in ("permute", "permute_copy"):
        d = tuple(x % nd for x in n.attr["dims"])
        return d == (*range(nd - 2), nd - 1, nd - 2)
    if n.op == "transpose.int":
        return {n.attr["dim0"] % nd, n.attr["dim1"] % nd} == {nd - 2, nd - 1}
    return False


def _unit_axis(p: Pat) -> Pat:
    """``p``'s value with one trailing unit axis added (an unsqueeze or a reshape)."""
    return P({"view", "_unsafe_view", "reshape", "alias", "clone", "unsqueeze"}, p,
             where=lambda n, m: tuple(n.shape) == (*n.inputs[0].shape, 1))


# the 4-bit codes of uint8 ``packed``, low nibble first: and(P, 15), [and](shift(P, 4), [15]), each [cast], joined
# along a new last axis (cat of unit axes, or stack)
_SHIFT4 = with_scalar("bitwise_right_shift", P(name="packed", dtype="uint8"), 4)
_LO = cast(with_scalar("bitwise_and", P(name="packed", dtype="uint8"), 15))
_HI = cast(Alt(with_scalar("bitwise_and", _SHIFT4, 15), _SHIFT4))
_NIBBLES = V(Alt(P("cat", _unit_axis(_LO), _unit_axis(_HI), where=lambda n, m: last_dim(n) and n.shape[-1] == 2),
                 P("stack", _LO, _HI, where=last_dim)))
_E2M1_TABLE = const(lambda t: tuple(t.shape) == (16,) and
                    np.array_equal(t.float().numpy().view(np.uint32), _E2M1.view(np.uint32)))
# MXFP4: E2M1 table[codes of B] * exp2(float(S) - 127)
_MXFP4 = V(P("mul.Tensor", P("index.Tensor", _E2M1_TABLE, _NIBBLES, attrs={"indices": (True,)}),
             V(P("exp2", with_scalar("sub", P("_to_copy", P(name="scales", dtype="uint8")), 127))),
             commute=True, dtype="float32", name="mul"))


def _typed(fmt: str, data_dtype: str) -> Pat:
    return P(OP_DEQUANT, P(name="data", dtype=data_dtype), P(name="scale"), attrs={"format": fmt})


_TYPED_MXFP4, _TYPED_FP8 = _typed("mxfp4", "uint8"), _typed("fp8", "float8_e4m3fn")


def match_mxfp4(w: Node, constants) -> tuple[Node, Node, bool] | None:
    """W (fp32) -> (blocks, scales, transposed) when W is an MXFP4 dequant (the typed op or the ATen chain)."""
    transposed = _is_last_swap(w)
    base, m = w.inputs[0] if transposed else w, Match(constants)
    if _TYPED_MXFP4.match(base, m):
        return m.data, m.scale, transposed != base.attr["transposed"]
    if not _MXFP4.match(base, m):
        return None
    lead = tuple(m.packed.shape[:-1])
    if len(lead) < 2 or m.packed.shape[-1] != 16 or tuple(m.scales.shape) != lead or \
            tuple(m.mul.shape) != (*lead, 32) or tuple(base.shape) != (*lead[:-1], lead[-1] * 32):
        return None
    return m.packed, m.scales, transposed


def _interleaved(n: Node, m: Match) -> bool:
    """n = view(expand(unsqueeze(src, d + 1)), r at d + 1) merging axes d and d + 1: src repeat_interleave'd r
    times along d; binds ``rep<d>`` = r (once per axis)."""
    e = n.inputs[0].inputs[0] if n.inputs[0].op == "clone" else n.inputs[0]
    src = e.inputs[0].inputs[0]
    d = e.inputs[0].attr["dim"] % (len(src.shape) + 1) - 1
    r = e.shape[d + 1] if d >= 0 else None
    return d >= 0 and tuple(e.shape) == (*src.shape[:d + 1], r, *src.shape[d + 1:]) and \
        tuple(n.shape) == (*src.shape[:d], src.shape[d] * r, *src.shape[d + 1:]) and m.bind(f"rep{d}", r)


def _repeat(p: Pat) -> Pat:
    """view([clone](expand(unsqueeze(p)))) repeating ``p`` along one axis (``_interleaved``)."""
    e = P("expand", P("unsqueeze", p))
    return P({"view", "_unsafe_view", "reshape", "alias"}, Alt(P("clone", e), e), where=_interleaved)


# FP8: float(Wq) * S, S repeated over blocks along at most two axes, then sliced
_FP8 = P("mul.Tensor", P("_to_copy", P(name="wq", dtype="float8_e4m3fn"), name="cast"),
         many(lambda p: P("slice.Tensor", p, attrs={"start": isin(0, None), "step": isin(1, None)}),
              many(_repeat, P(name="s"), at_most=2)), commute=True, dtype="float32")


def match_fp8_blocks(w: Node) -> tuple[Node, Node, int, int] | None:
    """W fp32 [.., N, K] = E4M3(Wq) x scale S repeated (br, bc) times along the last two axes -> (Wq
    float8_e4m3fn [.., N, K], S fp32 [.., ceil(N/br), ceil(K/bc)], br, bc), else None: the typed op, or the ATen
    chain where a missing repeat is a factor 1 (one scale per row)."""
    m = Match()
    if _TYPED_FP8.match(w, m) and not w.attr["transposed"] and all(isinstance(d, int) for d in w.shape):
        return m.data, m.scale, *w.attr["block"]
    if len(w.shape) < 2 or not all(isinstance(d, int) for d in w.shape) or not _FP8.match(w, m) or \
            tuple(m.cast.shape) != tuple(w.shape):
        return None
    *lead, N, K = w.shape
    br, bc = m.pop(f"rep{len(lead)}", 1), m.pop(f"rep{len(lead) + 1}", 1)
    if any(k.startswith("rep") for k in m) or m.s.dtype != "float32" or \
            tuple(m.s.shape) != (*lead, -(-N // br), -(-K // bc)):
        return None
    return m.wq, m.s, br, bc


# INT4: ((float(codes [^ 8]) [- c]) [- Z]) * S, S [R/bs, 1, C] or [R, C/bs, 1]
_INT4_CODES = P("_to_copy", V(Alt(with_scalar("bitwise_xor", _NIBBLES, 8, name="xor"), _NIBBLES)), dtype="float32")
_INT4_OFFSET = Alt(P("sub.Tensor", V(_INT4_CODES), const(lambda t: t.numel() == 1, name="offset"), attrs=ALPHA1),
                   _INT4_CODES)
_INT4_ZP = Alt(P("sub.Tensor", V(_INT4_OFFSET), V(P("weight", dtype="float32", name="zp")), attrs=ALPHA1,
                 where=lambda n, m: tuple(n.inputs[1].shape) == tuple(m.sv.shape)), _INT4_OFFSET)
_INT4 = V(P("mul.Tensor", P(name="sv", ndim=3, dtype="float32"), V(_INT4_ZP), ndim=3, commute=True, name="mul"))


def match_int4(w: Node, constants) -> dict | None:
    """W fp32 [R, C] -> {"packed", "scales", "zero_points", "block", "block_axis", "signed", "offset"}, else None."""
    m = Match(constants)
    if w.dtype != "float32" or len(w.shape) != 2 or not all(isinstance(d, int) for d in w.shape) or \
            not _INT4.match(w, m):
        return None
    (R, C), ms, sb, scales = w.shape, tuple(m.mul.shape), tuple(m.sv.shape), strip_views(m.sv)
    if sb[1] == 1 and ms[1] > 1 and ms == (sb[0], ms[1], sb[2]):
        axis, bs, ok = 0, ms[1], R == sb[0] * ms[1] and C == sb[2]
    elif sb[2] == 1 and ms[2] > 1 and ms == (sb[0], sb[1], ms[2]):
        axis, bs, ok = 1, ms[2], R == sb[0] and C == sb[1] * ms[2]
    else:
        return None
    zp, packed = m.get("zp"), m.packed
    if not ok or scales.op != "weight" or scales.dtype != "float32" or \
            math.prod(packed.shape) * 2 != R * C or math.prod(scales.shape) * bs != R * C or \
            (zp is not None and math.prod(zp.shape) != math.prod(scales.shape)):
        return None
    offset = float(m.value(m.offset).reshape(-1)[0]) if "offset" in m else 0.0
    return {"packed": packed, "scales": scales, "zero_points": zp, "block": int(bs), "block_axis": axis,
            "signed": "xor" in m, "offset": offset}


def _fused_experts(n: Node, m: Match) -> Node | None:
    """moe_experts whose two expert matrices are MXFP4 chains (layout nk: untransposed, kn: transposed) ->
    moe_experts_mxfp4, or FP8 block chains (either layout: the chain's output is the parameter itself, so the
    scale blocks lie over its last two axes) -> moe_experts_fp8."""
    a = n.attr
    x, ids, w, wgu = n.inputs[:4]
    bgu = n.inputs[4] if a["gate_up_bias"] else None
    wd = n.inputs[5 if a["gate_up_bias"] else 4]
    bd = n.inputs[-1] if a["down_bias"] else None
    H, inter, want_t = int(x.shape[1]), int(a["inter"]), a["layout"] == "kn"
    gu, d = match_mxfp4(wgu, m.constants), match_mxfp4(wd, m.constants)
    if gu is not None and d is not None:
        need(gu[2] == d[2] == want_t and capabilities.moe_experts_mxfp4(H, int(gu[0].shape[1]), inter))
        op, attrs = OP_MOE, {k: a[k] for k in ("act", "inter", "gate_up_bias", "down_bias")}
    else:
        gu, d = match_fp8_blocks(wgu), match_fp8_blocks(wd)
        need(gu is not None and d is not None and len(wgu.shape) == len(wd.shape) == 3)
        need(capabilities.moe_experts_fp8(H, int(wgu.shape[1] if a["layout"] == "nk" else wgu.shape[2]), inter))
        op, attrs = OP_MOE_FP8, {k: a[k] for k in ("layout", "act", "inter", "gate_up_bias", "down_bias")}
        attrs.update(gate_up_block=tuple(gu[2:]), down_block=tuple(d[2:]))
    ins = [i for i in (x, ids, w, gu[0], gu[1], bgu, d[0], d[1], bd) if i is not None]
    return Node.make(op, ins, attrs, [TensorType(n.dtype, n.shape)], n.span)


def _fused_linear(n: Node, m: Match) -> Node | None:
    """linear(x, W [N, K], [b]) / matmul|mm(x, W [K, N]) with W a dequant chain -> dequant_linear_FMT."""
    kn = n.op != "linear"
    x, w = n.inputs[:2]
    bias = n.inputs[2] if not kn and n.attr.get("bias") else None
    N, K = (w.shape[1], w.shape[0]) if kn else w.shape
    need(isinstance(N, int) and isinstance(K, int) and x.shape[-1] == K)

    op, ins, attrs = None, [], {"N": N, "K": K}
    q = match_int4(w, m.constants)
    if q is not None:
        a = dict(attrs, layout="kn" if kn else "nk", block=q["block"], block_axis=q["block_axis"],
                 signed=q["signed"], offset=q["offset"], zero_point=q["zero_points"] is not None)
        if capabilities.dequant_linear_int4_problem(a) is None:
            (R, C), ss = int4_storage(a)
            ins = [view_node(q["packed"], (R, C // 2), n.span), view_node(q["scales"], ss, n.span)]
            if q["zero_points"] is not None:
                ins.append(view_node(q["zero_points"], ss, n.span))
            op, attrs = "dequant_linear_int4", a
    base = w.inputs[0] if kn and _is_last_swap(w) else (None if kn else w)
    if op is None and base is not None:
        f, mx = match_fp8_blocks(base), match_mxfp4(w, m.constants)
        if f is not None and len(base.shape) == 2 and f[2:] == (128, 128):
            op, ins = "dequant_linear_fp8", list(f[:2])
        elif mx is not None and mx[2] == kn and len(mx[0].shape) == 3:
            op, ins = "dequant_linear_mxfp4", [mx[0], mx[1]]
    need(op is not None)
    lead = tuple(x.shape[:-1])
    T = math.prod(lead) if lead else 1
    y = Node.make(op, [view_node(x, (T, K), n.span), *ins], attrs, [TensorType("float32", (T, N))], n.span)
    y = view_node(y, (*lead, N), n.span)
    if bias is not None:
        y = Node.make("add.Tensor", (y, bias), {"alpha": 1}, [TensorType("float32", n.shape)], n.span)
    return y


_FP32 = {"dtype": "float32"}
_X = P(where=lambda n, m: len(n.shape) >= 1, **_FP32)
# fuse dequant chains into their consumers; counts ``dequant.experts`` (fused expert blocks, two chains each) and
# ``dequant.linear``
dequant = pattern_pass("dequant", (
    Rule("dequant.experts", P("moe_experts"), _fused_experts),
    Rule("dequant.linear", Alt(P("linear", _X, P(ndim=2), rest=True, **_FP32),
                               P({"matmul", "mm"}, _X, P(ndim=2), **_FP32)), _fused_linear),
))
