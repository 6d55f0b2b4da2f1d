"""inplace_state: write KV-cache updates into the state buffer instead of copying the whole cache.

torch.export functionalises a cache write into "a new cache with these rows replaced", then assigns it back:

    %s = state "cache_0_keys"                     %s = state "cache_0_keys"
    %u = index_put(%s, [_, _, %pos], %k)   ==>    %u = state_index_put(%s, %pos, %k)   (writes rows in place;
    ... readers of %u (attention) ...             ... readers of %u ...                 %u aliases %s)
    assign(%s, %u)                                (the assign is gone: %u is the state)

Only when the state has no other reader (nothing may still need the old contents after the in-place write).
Every other ``assign`` stays: a whole-tensor copy into the state at the end.
"""

from __future__ import annotations

from dayzero.passes.ir.node import Graph, Node, users
from dayzero.passes.pipeline import Found, counted


def inplace_state(g: Graph) -> tuple[Graph, Found]:
    use = users(g)
    replaced: dict[int, Node] = {}
    count = 0
    for out in g.outputs:
        if out.op != "assign":
            continue
        state, value = out.inputs
        if value.op != "index_put" or value.inputs[0] is not state or value.attr.get("accumulate"):
            continue
        if {id(u) for u in use.get(id(state), [])} != {id(value), id(out)}:
            continue
        present = value.attr["indices"]
        idx = value.inputs[1:-1]
        if sum(present) != 1 or len(idx) != 1 or idx[0].type.ndim != 1 or value.inputs[-1].type.ndim != state.type.ndim:
            continue  # the kernel writes rows along one dimension (a KV cache's position dim)
        new = Node.make("state_index_put", value.inputs, {"indices": present}, value.types, value.span)
        replaced[id(value)] = new
        replaced[id(out)] = new
        count += 1
    if not count:
        return g, Found()

    # rebuild: swap the index_put and the assign for the in-place write
    new_of: dict[int, Node] = {}
    for n in g.nodes():
        if id(n) in replaced:
            r = replaced[id(n)]
            if id(r) not in new_of:
                new_of[id(r)] = r.replace(inputs=tuple(new_of.get(id(i), i) for i in r.inputs))
            new_of[id(n)] = new_of[id(r)]
            continue
        ins = tuple(new_of.get(id(i), i) for i in n.inputs)
        new_of[id(n)] = n if all(a is b for a, b in zip(ins, n.inputs)) else n.replace(inputs=ins)
    g = g.replace(inputs=tuple(new_of[id(i)] for i in g.inputs),
                  outputs=tuple(new_of[id(o)] for o in g.outputs))
    return g, counted("inplace_kv_write", count)
