"""The typed ``dequant`` op (passes/dequant.py, emitted by the frontend's low-precision binding) where no consumer
fused it: the stored codes and scales -> float32, elementwise.

    mxfp4   data uint8 [..., R, C/2] (two E2M1 codes per byte, low nibble first), scale uint8 [..., R, C/32]
            (E8M0): w[r, c] = e2m1(code) * 2^(scale - 127)
    fp8     data float8 [..., R, C], scale float32 [..., R/br, C/bc]: w[r, c] = data[r, c] * scale[r//br, c//bc]
    transposed: the stored layout is [..., C, R] (the output is its transpose)
"""

from __future__ import annotations

from typing import Callable

import tvm
from tvm import te

from dayzero.codegen.kernels.dequant.decode import e2m1_value, e8m0_value
from .common import cast, lowering_table

LOWERINGS: dict[str, Callable] = {}
lowering = lowering_table(LOWERINGS)


@lowering("dequant")
def _dequant(ctx, ins, attrs, outs):
    data, scale = ins
    u8 = lambda v: tvm.tirx.const(v, "uint8")  # noqa: E731

    def w(*i):
        *lead, r, c = i[:-2] + (i[-1], i[-2]) if attrs["transposed"] else i
        if attrs["format"] == "mxfp4":
            byte = data[(*lead, r, c // 32, (c % 32) // 2)]
            code = tvm.tirx.Select(c % 2 == 0, byte & u8(15), byte >> u8(4))
            return e2m1_value(code) * e8m0_value(scale[(*lead, r, c // 32)])
        br, bc = attrs["block"]
        return cast(data[(*lead, r, c)], "float32") * scale[(*lead, r // br, c // bc)]
    return te.compute(ctx.shape(outs[0].shape), w, name="dequant")
