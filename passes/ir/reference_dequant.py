"""Torch references of the low-precision formats dayzero's fused ops read (declared in ``dayzero_ops.py``).

    mxfp4   blocks uint8 [.., O, G, 16] (two E2M1 codes a byte, low nibble first) + E8M0 scales uint8 [.., O, G]
    fp8     float8_e4m3fn (or its uint8 bytes) [.., R, C] times fp32 scales per (br, bc) block
    int4    packed uint8 [R, C/2] + fp32 scales (and zero points) per block along one axis
    bf16    bfloat16 [N, K] (every bf16 value is an fp32 value: the upcast is exact)
"""

from __future__ import annotations

import numpy as np
import torch


FP8_LINEAR_BLOCK = (128, 128)  # dequant_linear_fp8's scale blocks (DeepSeek's published layout)
# the 16 E2M1 values by code
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def int4_storage(p: dict) -> tuple[tuple[int, int], tuple[int, int]]:
    """((R, C) of the unpacked int4 storage, shape of its scales / zero points) for dequant_linear_int4 attrs
    ``p`` (N, K, layout, block, block_axis)."""
    R, C = (p["N"], p["K"]) if p["layout"] == "nk" else (p["K"], p["N"])
    bs = p["block"]
    return (R, C), ((R // bs, C) if p["block_axis"] == 0 else (R, C // bs))


def mxfp4_dequant_ref(b: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """[.., O, G, 16] + [.., O, G] -> fp32 [.., O, 32G], as lowprec.dequant_mxfp4 (torch)."""
    lut = torch.from_numpy(E2M1)
    codes = torch.stack([(b & 15).long(), (b >> 4).long()], dim=-1).reshape(*b.shape[:-1], 32)
    return (lut[codes] * torch.exp2(s.float() - 127).unsqueeze(-1)).reshape(*b.shape[:-2], b.shape[-2] * 32)


def fp8_blocks_dequant_ref(wq: torch.Tensor, s: torch.Tensor, block) -> torch.Tensor:
    """fp32 [.., R, C] = E4M3(wq) * s[.., r // br, c // bc] (wq float8_e4m3fn or its uint8 bytes)."""
    br, bc = block
    r, c = wq.shape[-2:]
    v = (wq.view(torch.float8_e4m3fn) if wq.dtype == torch.uint8 else wq).float()
    return v * s.float().repeat_interleave(br, dim=-2)[..., :r, :].repeat_interleave(bc, dim=-1)[..., :c]


def int4_dequant_ref(packed: torch.Tensor, scales: torch.Tensor, zp: torch.Tensor | None, a) -> torch.Tensor:
    """fp32 W [N, K] from int4 storage, step for step as the ONNX chain (see dequant_linear_int4's doc)."""
    (R, C), ss = int4_storage(a)
    b = packed.reshape(R, C // 2)
    codes = torch.stack([b & 15, b >> 4], dim=-1).reshape(R, C)
    if a["signed"]:
        codes = codes ^ 8
    v = codes.float()
    if a["offset"]:
        v = v - a["offset"]
    rep = lambda t: t.reshape(ss).repeat_interleave(a["block"], dim=a["block_axis"])  # noqa: E731
    if zp is not None:
        v = v - rep(zp)
    w = v * rep(scales)
    return w if a["layout"] == "nk" else w.t()


def linear_reference(fmt: str):
    def ref(ins, attrs):
        x = ins[0]
        if x.device.type == "meta":
            return torch.empty((x.shape[0], attrs["N"]), dtype=torch.float32, device="meta")
        if fmt == "int4":
            w = int4_dequant_ref(ins[1], ins[2], ins[3] if attrs["zero_point"] else None, attrs)
        elif fmt == "mxfp4":
            w = mxfp4_dequant_ref(ins[1], ins[2])
        elif fmt == "bf16":
            w = ins[1].float()
            G = attrs.get("groups", 1)
            if G > 1:  # row group g reads x's columns [g K, (g+1) K)
                xg = x.float().reshape(x.shape[0], G, -1)
                return torch.einsum("tgk,gnk->tgn", xg, w.reshape(G, -1, xg.shape[-1])).reshape(x.shape[0], -1) \
                    .contiguous()
        else:
            w = fp8_blocks_dequant_ref(ins[1], ins[2], FP8_LINEAR_BLOCK)
        return (x.float() @ w.float().t()).contiguous()
    return ref


def dequant_reference(ins, attrs):
    """The typed ``dequant`` op: fp32 W from a weight as stored (see its doc), as lowprec.dequant_mxfp4 /
    dequant_fp8_block."""
    data, scale = ins
    mx = attrs["format"] == "mxfp4"
    if data.device.type == "meta":
        w = torch.empty((*data.shape[:-2], data.shape[-2] * 32) if mx else data.shape, dtype=torch.float32,
                        device="meta")
    else:
        w = mxfp4_dequant_ref(data, scale) if mx else fp8_blocks_dequant_ref(data, scale, attrs["block"])
    return (w.transpose(-1, -2) if attrs["transposed"] else w).contiguous()
