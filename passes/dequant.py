"""dequant: a dequantisation chain feeding its consumer -> one fused node reading the weight as stored.

A low-precision weight enters the IR as its stored tensors followed by the dequantisation in plain ATen ops (the
PyTorch frontend's ``frontend/lowprec.bind_low_precision``, the steps of transformers' ``convert_moe_packed_tensors``
and DeepSeek's ``weight_dequant``; the ONNX frontend's ``MatMulNBits`` / blocked ``DequantizeLinear``). Three
chains are recognised, by op identity, attrs, dtypes, shapes and constant values, never names::

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

Constants are checked by value: the E2M1 table and the exponent bias 127 (folded by ``fold_constants`` into
``ctx.constants``), the nibble mask 15 and shift 4, the int4 xor 8 and offset. The fused kernels
(the kernel table's ``moe_experts_mxfp4`` / ``_fp8`` and ``dequant_linear_*``: decode GEMV for a static
T <= 64, prefill GEMM for a symbolic T) decode each weight element as they read it, so weights stay resident as
stored and no full-precision copy exists. A chain whose consumer does not fuse, or that differs in any checked
detail (a wrong bit layout, no scale, a partial block), stays as its generic ops (correct, slow, and a
full-precision temporary).

Ordering: after ``fold_constants`` (the table, 127 and the ONNX literals are constants) and after ``moe``.
"""

from __future__ import annotations

import numpy as np

from dayzero.passes.ir.node import Graph, Node, TensorType, rewrite
from dayzero.passes.ir.reference_dequant import E2M1 as _E2M1
from dayzero.targets import capabilities
from dayzero.targets.capabilities import int4_storage

OP_MOE = "moe_experts_mxfp4"
OP_MOE_FP8 = "moe_experts_fp8"
_RESHAPES = {"view", "_unsafe_view", "reshape", "alias", "clone"}


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
    a = n.attr
    x, ids, w, wgu = n.inputs[:4]
    bgu = n.inputs[4] if a["gate_up_bias"] else None
    wd = n.inputs[5 if a["gate_up_bias"] else 4]
    bd = n.inputs[-1] if a["down_bias"] else None
    gu, d = match_mxfp4(wgu, constants), match_mxfp4(wd, constants)
    if gu is None or d is None:
        return _fuse_moe_fp8(n, x, ids, w, wgu, bgu, wd, bd)
    want_t = a["layout"] == "kn"  # an input-major [E, in, out] weight is the transposed dequant
    if gu[2] != want_t or d[2] != want_t:
        return None
    H, GU = int(x.shape[1]), int(gu[0].shape[1])
    if not capabilities.moe_experts_mxfp4(H, GU, int(a["inter"])):
        return None
    ins = [x, ids, w, gu[0], gu[1]] + ([bgu] if bgu is not None else []) + [d[0], d[1]] + \
        ([bd] if bd is not None else [])
    attrs = {k: a[k] for k in ("act", "inter", "gate_up_bias", "down_bias")}
    return Node.make(OP_MOE, ins, attrs, [TensorType(n.dtype, n.shape)], n.span)


def _fuse_moe_fp8(n: Node, x, ids, w, wgu, bgu, wd, bd) -> Node | None:
    """moe_experts whose two expert matrices are FP8 block chains -> moe_experts_fp8 (weights as stored, either
    layout: the chain's output is the parameter itself, so the scale blocks lie over its last two axes)."""
    a = n.attr
    gu, d = match_fp8_blocks(wgu), match_fp8_blocks(wd)
    if gu is None or d is None or len(wgu.shape) != 3 or len(wd.shape) != 3:
        return None
    if not capabilities.moe_experts_fp8(int(x.shape[1]), int(wgu.shape[1] if a["layout"] == "nk" else wgu.shape[2]),
                                int(a["inter"])):
        return None
    ins = [x, ids, w, gu[0], gu[1]] + ([bgu] if bgu is not None else []) + [d[0], d[1]] + \
        ([bd] if bd is not None else [])
    attrs = {k: a[k] for k in ("layout", "act", "inter", "gate_up_bias", "down_bias")}
    attrs.update(gate_up_block=tuple(gu[2:]), down_block=tuple(d[2:]))
    return Node.make(OP_MOE_FP8, ins, attrs, [TensorType(n.dtype, n.shape)], n.span)


def _repeat(n: Node):
    """view(expand(unsqueeze(src, d + 1), r at d + 1)) merging d and d + 1 -> (src, d, r): repeat_interleave."""
    if n.op not in _RESHAPES or n.op == "clone":
        return None
    e = _through(n.inputs[0], {"clone"})
    if e.op != "expand" or e.inputs[0].op != "unsqueeze":
        return None
    src = e.inputs[0].inputs[0]
    nd = len(src.shape)
    d = e.inputs[0].attr["dim"] % (nd + 1) - 1
    if d < 0:
        return None
    r = e.shape[d + 1]
    if tuple(e.shape) != (*src.shape[:d + 1], r, *src.shape[d + 1:]) or \
            tuple(n.shape) != (*src.shape[:d], src.shape[d] * r, *src.shape[d + 1:]):
        return None
    return src, d, r


def match_fp8_blocks(w: Node) -> tuple[Node, Node, int, int] | None:
    """W fp32 [.., N, K] = E4M3(Wq) x scale S repeated (br, bc) times along the last two axes -> (Wq
    float8_e4m3fn [.., N, K], S fp32 [.., ceil(N/br), ceil(K/bc)], br, bc), else None. A missing repeat is a
    factor 1 (one scale per row)."""
    if w.op != "mul.Tensor" or len(w.inputs) != 2 or w.dtype != "float32" or len(w.shape) < 2:
        return None
    if not all(isinstance(d, int) for d in w.shape):
        return None
    nd = len(w.shape)
    *lead, N, K = w.shape
    for a, b in (w.inputs, w.inputs[::-1]):
        if a.op != "_to_copy" or a.inputs[0].dtype != "float8_e4m3fn" or tuple(a.shape) != tuple(w.shape):
            continue
        while b.op == "slice.Tensor" and b.attr.get("start") in (0, None) and b.attr.get("step", 1) == 1:
            b = b.inputs[0]
        axes = {}
        for _ in range(2):
            r = _repeat(b)
            if r is None or r[1] in axes:
                break
            b, d, f = r
            axes[d] = f
        br, bc = axes.get(nd - 2, 1), axes.get(nd - 1, 1)
        if set(axes) - {nd - 2, nd - 1} or b.dtype != "float32" or \
                tuple(b.shape) != (*lead, -(-N // br), -(-K // bc)):
            continue
        return a.inputs[0], b, br, bc
    return None


def match_fp8(w: Node) -> tuple[Node, Node] | None:
    """W fp32 [N, K] -> (Wq float8_e4m3fn [N, K], scale_inv fp32 [ceil(N/128), ceil(K/128)]), else None."""
    m = match_fp8_blocks(w)
    if m is None or len(w.shape) != 2 or m[2:] != (128, 128):
        return None
    return m[0], m[1]


def _bits(n: Node, op_t: str, op_s: tuple, value: int, constants) -> Node | None:
    """op(P, value) as a .Tensor op with a constant [1] operand or a .Scalar op with attr other -> P."""
    if n.op == op_t and len(n.inputs) == 2 and _scalar_is(n.inputs[1], value, constants):
        return n.inputs[0]
    if n.op in op_s and n.attr.get("other") == value:
        return n.inputs[0]
    return None


def _int4_codes(n: Node, constants) -> tuple[Node, bool] | None:
    """f32 of the nibble codes, optionally ^ 8 -> (P uint8, signed)."""
    if n.op != "_to_copy" or n.dtype != "float32":
        return None
    n = _through(n.inputs[0], _RESHAPES)
    signed = False
    x = _bits(n, "bitwise_xor.Tensor", ("bitwise_xor.Scalar",), 8, constants)
    if x is not None:
        n, signed = _through(x, _RESHAPES), True
    if n.op != "cat" or len(n.inputs) != 2 or n.attr.get("dim") not in (-1, len(n.shape) - 1) or n.shape[-1] != 2:
        return None
    lo_v, hi_v = n.inputs
    if lo_v.shape[-1] != 1 or hi_v.shape[-1] != 1 or lo_v.op not in _RESHAPES | {"unsqueeze"} or \
            hi_v.op not in _RESHAPES | {"unsqueeze"}:
        return None
    lo_n, hi_n = lo_v.inputs[0], hi_v.inputs[0]
    if tuple(lo_v.shape) != (*lo_n.shape, 1) or tuple(hi_v.shape) != (*hi_n.shape, 1):
        return None
    lo = _bits(lo_n, "bitwise_and.Tensor", ("bitwise_and.Scalar",), 15, constants)
    hi = _bits(hi_n, "bitwise_right_shift.Tensor", ("__rshift__.Scalar", "bitwise_right_shift.Tensor_Scalar"), 4,
               constants)
    if lo is None or lo is not hi or lo.dtype != "uint8" or tuple(lo.shape) != tuple(lo_n.shape):
        return None
    return lo, signed


def match_int4(w: Node, constants) -> dict | None:
    """W fp32 [R, C] -> {"packed", "scales", "zero_points", "block", "block_axis", "signed", "offset"}, else None."""
    if w.dtype != "float32" or len(w.shape) != 2 or not all(isinstance(d, int) for d in w.shape):
        return None
    R, C = w.shape
    m = _through(w, _RESHAPES)
    if m.op != "mul.Tensor" or len(m.inputs) != 2 or len(m.shape) != 3:
        return None
    for a, b in (m.inputs, m.inputs[::-1]):
        sb = tuple(b.shape)
        if len(sb) != 3 or b.dtype != "float32":
            continue
        if sb[1] == 1 and m.shape[1] > 1 and tuple(m.shape) == (sb[0], m.shape[1], sb[2]):
            axis, bs = 0, m.shape[1]
            ok = R == sb[0] * bs and C == sb[2]
        elif sb[2] == 1 and m.shape[2] > 1 and tuple(m.shape) == (sb[0], sb[1], m.shape[2]):
            axis, bs = 1, m.shape[2]
            ok = R == sb[0] and C == sb[1] * bs
        else:
            continue
        scales = _through(b, _RESHAPES)
        if not ok or scales.op != "weight" or scales.dtype != "float32":
            continue
        v, zp, offset = _through(a, _RESHAPES), None, 0.0
        if v.op == "sub.Tensor" and v.attr.get("alpha", 1) == 1 and tuple(v.inputs[1].shape) == sb:
            z = _through(v.inputs[1], _RESHAPES)
            if z.op != "weight" or z.dtype != "float32":
                continue
            zp, v = z, _through(v.inputs[0], _RESHAPES)
        if v.op == "sub.Tensor" and v.attr.get("alpha", 1) == 1:
            c = _const(v.inputs[1], constants)
            if c is None or c.numel() != 1:
                continue
            offset, v = float(c.reshape(-1)[0]), _through(v.inputs[0], _RESHAPES)
        codes = _int4_codes(v, constants)
        if codes is None:
            continue
        packed, signed = codes
        if _numel(packed.shape) * 2 != R * C or _numel(scales.shape) * bs != R * C or \
                (zp is not None and _numel(zp.shape) != _numel(scales.shape)):
            continue
        return {"packed": packed, "scales": scales, "zero_points": zp, "block": int(bs), "block_axis": axis,
                "signed": signed, "offset": offset}
    return None


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def _view(x: Node, shape, span) -> Node:
    shape = tuple(shape)
    if tuple(x.shape) == shape:
        return x
    return Node.make("view", (x,), {"size": shape}, [TensorType(x.dtype, shape)], span)


def _fuse_linear(n: Node, constants) -> Node | None:
    """linear(x, W [N, K], [b]) / matmul|mm(x, W [K, N]) with W a dequant chain -> dequant_linear_FMT."""
    if n.op == "linear" and len(n.inputs) >= 2:
        x, w, kn = n.inputs[0], n.inputs[1], False
        bias = n.inputs[2] if n.attr.get("bias") else None
    elif n.op in ("matmul", "mm") and len(n.inputs) == 2:
        x, w, kn, bias = n.inputs[0], n.inputs[1], True, None
    else:
        return None
    if x.dtype != "float32" or n.dtype != "float32" or len(w.shape) != 2 or len(x.shape) < 1:
        return None
    N = w.shape[1] if kn else w.shape[0]
    K = w.shape[0] if kn else w.shape[1]
    if not isinstance(N, int) or not isinstance(K, int) or x.shape[-1] != K:
        return None
    op, ins, attrs = None, [], {"N": N, "K": K}
    q = match_int4(w, constants)
    if q is not None:
        a = dict(attrs, layout="kn" if kn else "nk", block=q["block"], block_axis=q["block_axis"],
                 signed=q["signed"], offset=q["offset"], zero_point=q["zero_points"] is not None)
        if capabilities.dequant_linear_int4_problem(a) is None:
            (R, C), ss = int4_storage(a)
            ins = [_view(q["packed"], (R, C // 2), n.span), _view(q["scales"], ss, n.span)]
            if q["zero_points"] is not None:
                ins.append(_view(q["zero_points"], ss, n.span))
            op, attrs = "dequant_linear_int4", a
    if op is None:
        base = w.inputs[0] if kn and _is_last_swap(w) else (None if kn else w)
        if base is not None:
            f = match_fp8(base)
            mx = match_mxfp4(w, constants)
            if f is not None:
                op, ins = "dequant_linear_fp8", list(f)
            elif mx is not None and mx[2] == kn and len(mx[0].shape) == 3:
                op, ins = "dequant_linear_mxfp4", [mx[0], mx[1]]
    if op is None:
        return None
    lead = tuple(x.shape[:-1])
    T = _numel(lead) if lead else 1
    x2 = _view(x, (T, K), n.span)
    y = Node.make(op, [x2, *ins], attrs, [TensorType("float32", (T, N))], n.span)
    y = _view(y, (*lead, N), n.span)
    if bias is not None:
        y = Node.make("add.Tensor", (y, bias), {"alpha": 1}, [TensorType("float32", n.shape)], n.span)
    return y


def dequant(g: Graph, ctx) -> Graph:
    """Fuse dequant chains into their consumers; counts fused chains in ``ctx.patterns["dequant"]``."""
    count = 0

    def fn(n: Node):
        nonlocal count
        r = _fuse_moe(n, ctx.constants)
        if r is not None:
            count += 2  # the gate/up and the down chains
            return r
        r = _fuse_linear(n, ctx.constants)
        if r is not None:
            count += 1
        return r

    out = rewrite(g, fn)
    if count:
        ctx.patterns["dequant"] = ctx.patterns.get("dequant", 0) + count
    return out
