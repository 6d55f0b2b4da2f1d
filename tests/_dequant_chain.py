"""The dequantisation of a low-precision weight as the plain ATen ops that upstream code writes, exported to IR:
what a graph holds when it arrives without the frontend's low-precision binding (which emits the typed ``dequant``
op instead, frontend/lowprec.py). ``dequant_graph`` exports transformers' ``convert_moe_packed_tensors`` (MXFP4)
or DeepSeek-V3's ``weight_dequant`` (FP8 blocks) over inputs (data, scale); the dequant pass must recognise both.
"""

from __future__ import annotations

import torch

from dayzero.frontend.torch_export import export_module, to_graph


def _mxfp4_module(in_major: bool):
    class MxDequant(torch.nn.Module):
        def forward(self, blocks, scales):  # the steps of transformers' convert_moe_packed_tensors
            # the E2M1 table from its definition (sign, 2 exponent bits, 1 mantissa bit): static, so
            # fold_constants turns it into a constant the dequant pass can check by value
            c = torch.arange(16, device=blocks.device)
            e, m = (c >> 1) & 3, (c & 1).to(torch.float32)
            mag = torch.where(e == 0, m * 0.5, torch.exp2(e.to(torch.float32) - 1.0) * (1.0 + m * 0.5))
            lut = torch.where(c >= 8, -mag, mag)
            lo = (blocks & 0x0F).to(torch.int64)
            hi = (blocks >> 4).to(torch.int64)
            codes = torch.stack([lo, hi], dim=-1).reshape(*blocks.shape[:-1], 2 * blocks.shape[-1])
            vals = lut[codes]
            scale = torch.exp2(scales.to(torch.float32) - 127.0)
            w = (vals * scale.unsqueeze(-1)).reshape(*blocks.shape[:-2], blocks.shape[-2] * 2 * blocks.shape[-1])
            return w.transpose(-1, -2) if in_major else w
    return MxDequant()


def _fp8_module(row_block: int):
    class Fp8Dequant(torch.nn.Module):
        def forward(self, weight, scale_inv):  # DeepSeek-V3's weight_dequant: one scale per (row_block x 128)
            r, c = weight.shape[-2:]
            s = scale_inv.repeat_interleave(row_block, dim=-2) if row_block > 1 else scale_inv
            s = s.repeat_interleave(128, dim=-1)[..., :r, :c]
            return weight.to(torch.float32) * s
    return Fp8Dequant()


def dequant_graph(fmt: str, in_major: bool, data_t, scale_t, row_block: int = 128):
    """The dequant chain as an IR graph over inputs (data, scale) and the weight ``lut`` (MXFP4), cached by
    shape. FP8: ``row_block`` rows share a scale row (see checkpoint.fp8_scale_shape)."""
    key = (fmt, in_major, data_t, scale_t, row_block)
    if key not in _GRAPHS:
        (dd, ds), (sd, ss) = data_t, scale_t
        mod = _mxfp4_module(in_major) if fmt == "mxfp4" else _fp8_module(row_block)
        ex = (torch.zeros(ds, dtype=getattr(torch, dd), device="meta"),
              torch.zeros(ss, dtype=getattr(torch, sd), device="meta"))
        _GRAPHS[key] = to_graph(export_module(mod, ex, None)).graph
    return _GRAPHS[key]


_GRAPHS: dict = {}
