"""The ``fused`` node (passes/fuse.py): its members' TE computes composed into one, and the composed PrimFunc's
intermediate element-wise blocks inlined into their readers.

A member that is a view (a contiguous reshape, no kernel alone) becomes an index remap of the value it views:
dimensions the two shapes share at the front and back are indexed directly, the rest through the flat index.
After ``te.create_prim_func`` each member is a block; ``inline_members`` inlines every spatial block but the output
into the blocks that read it, so the kernel keeps only its reductions' results (one row each) besides its output:
a fused RMSNorm is one reduction block and one output block, an element-wise chain one block.
"""

from __future__ import annotations

import tvm
import tvm.sym
from tvm import te

from dayzero.passes.ir import ops
from dayzero.passes.ir.node import TensorType
from .common import MATERIALIZE, lowering_table

LOWERINGS: dict = {}
lowering = lowering_table(LOWERINGS)


@lowering("fused")
def _fused(ctx, ins, attrs, outs):
    from . import lower_node  # the merged table, which includes this family

    vals = list(ins)
    for op, args, op_attrs, dtype, shape in attrs["body"]:
        t = TensorType(dtype, shape)
        xs = [vals[a] for a in args]
        if ops.get(op).view:
            vals.append(_reshape(ctx, xs[0], t))
        else:
            (out,) = lower_node(ctx, op, xs, dict(op_attrs), [t])
            vals.append(out)
    return vals[-1]


def _same(a, b) -> bool:
    return tvm.sym.Analyzer().can_prove_equal(a, b)


def _reshape(ctx, x: te.Tensor, t: TensorType) -> te.Tensor:
    """``x`` read as the contiguous row-major ``t.shape`` (same element count)."""
    src, dst = list(x.shape), ctx.shape(t.shape)
    head = 0
    while head < min(len(src), len(dst)) and _same(src[head], dst[head]):
        head += 1
    tail = 0
    while tail < min(len(src), len(dst)) - head and _same(src[-1 - tail], dst[-1 - tail]):
        tail += 1
    mid_src, mid_dst = src[head:len(src) - tail], dst[head:len(dst) - tail]

    def f(*idx):
        idx = list(idx)
        mid = idx[head:len(idx) - tail]
        flat = tvm.tirx.const(0, "int64")
        for i, d in zip(mid, mid_dst):
            if not (isinstance(d, tvm.tirx.IntImm) and d.value == 1):
                flat = flat * d + i
        sub = []
        for k, d in enumerate(reversed(mid_src)):
            if isinstance(d, tvm.tirx.IntImm) and d.value == 1:
                sub.append(tvm.tirx.const(0, "int64"))
            elif k == len(mid_src) - 1:  # the outermost: what is left of the flat index is below d, so no modulo
                sub.append(flat)  # (a row read through the view stays affine and vectorisable; LLVM took 78 s
                #                    on one rotary kernel's symbolic (batch*4) modulo)
            else:
                sub.append(tvm.tirx.floormod(flat, d))
                flat = tvm.tirx.floordiv(flat, d)
        return x(*idx[:head], *reversed(sub), *idx[len(idx) - tail:])
    return te.compute(dst, f, name="view")


def inline_members(func: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc:
    """Every spatial block of the composed kernel but the last (its output) and those marked MATERIALIZE inlined
    into its readers; reduction blocks stay (their results are rows, computed once). A block TVM cannot inline
    stays a block."""
    sch = tvm.s_tir.Schedule(func)
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    for b in blocks[:-1]:
        blk = sch.get(b)
        if MATERIALIZE in blk.annotations:
            continue
        if all(iv.iter_type == tvm.tirx.IterVar.DataPar for iv in blk.iter_vars):
            try:
                sch.compute_inline(b)
            except tvm.s_tir.schedule.ScheduleError:
                pass
    return sch.mod["main"]
