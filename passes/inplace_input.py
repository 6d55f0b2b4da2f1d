"""inplace_input: a scatter into a copy of a program input writes into the input's own buffer instead.

DeepSeek-V4's batched decode step (frontend/decode_export.py ``RowDecodeStep``) takes each request's states as
inputs and returns the new ones; torch.export functionalises its in-place writes into "copy the input, then
scatter the new rows into the copy":

    %e = input "cache_1_compressor_entries"           %e = input "cache_1_compressor_entries"
    %c = clone(%e)                            ==>     %u = scatter_inplace(%e, %idx, %src) {dim}   (%u aliases %e)
    %u = scatter.src(%c, %idx, %src) {dim}
    ... readers of %u, %u returned ...                ... readers of %u, %u returned ...

An input's buffer is the program's own (the runtime copies the caller's tensor into it every run), so writing
into it changes nothing the caller holds. Only when the input has no other reader (the clone) and the copy none
but the scatter: nothing can still need the old contents. Each such state is E + 1 rows (E = max-seq / rate
compressed entries) of which the step writes one row a request: the copy and the out-of-place scatter moved all of
them twice.
"""

from __future__ import annotations

from dayzero.passes.ir.node import Graph, Node, rewrite, users
from dayzero.passes.pipeline import Found, counted

OP = "scatter_inplace"


def inplace_input(g: Graph) -> tuple[Graph, Found]:
    use = users(g)
    returned = {id(o) for o in g.outputs}
    inputs = {id(i) for i in g.inputs}

    def one_user(n: Node, user: Node) -> bool:
        return id(n) not in returned and [id(u) for u in use.get(id(n), [])] == [id(user)]

    count = 0

    def rule(n: Node, original: Node) -> Node | None:
        nonlocal count
        if n.op != "scatter.src" or original.inputs[0].op != "clone":
            return None
        copy = original.inputs[0]
        src = copy.inputs[0]
        if id(src) not in inputs or not one_user(copy, original) or not one_user(src, copy) or src.type != n.type:
            return None
        count += 1
        return Node.make(OP, (src, *n.inputs[1:]), {"dim": n.attr["dim"]}, n.types, n.span)

    out = rewrite(g, rule, with_original=True)
    return out, counted("inplace_input_scatter", count)
