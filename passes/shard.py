"""shard: split the program over the device mesh (passes/ir/collective.py): the routed experts over the ``ep``
axis (expert parallel) and dense MLPs over the ``tp`` axis (tensor parallel).

Each EP rank keeps E/ep consecutive experts of every MoE layer (rank i: experts [i*E/ep, (i+1)*E/ep)) and
computes their part of the combine for every token; the parts add up over the group::

    moe_experts*(x, ids [T,k], w [T,k], W_a [E, ..], .., W_z [E, ..])
        ==>  all_reduce[ep](moe_experts*(x, ids - group_rank[ep] * E/ep, w, W_a [E/ep, ..], .., W_z [E/ep, ..]))

An id shifted outside [0, E/ep) is another rank's expert: the op's semantics (reference and kernel) skip it. Every
expert tensor of the op (the MoE ops' inputs after the routing ones: matrices, scales, biases, all with the
experts first) must be a ``weight`` read only by MoE ops: it becomes the same weight with attr ``shard`` =
("ep", 0, ep) and its slice's shape, and each rank binds only its slice of the checkpoint tensor (the artifact's
weights manifest gives each group rank its own copy runs). A layer whose expert tensors are anything else
(a computed tensor, a weight read elsewhere) stays replicated: every rank computes all its experts, no collective.

A dense MLP (a dense layer's, or the shared experts beside the routed ones) over the tp group: each TP rank keeps
I/tp of the intermediate columns, its up-projections column-split and its down-projection row-split::

    linear(f(linear(x, W_1 [I, K]), .., linear(x, W_n [I, K])), W_d [H, I])       f elementwise, no biases
        ==>  all_reduce[tp](linear(f(linear(x, W_1 [I/tp, K]), ..), W_d [H, I/tp]))   W_i: shard ("tp", 0, tp),
                                                                                          W_d: ("tp", 1, tp)

Routing, attention, embeddings, the head and the rest stay replicated (identical on every rank of a group).

Matched on ops and shapes (the MoE ops; linear / elementwise trees read only inside the block), never on names. Ordering: after moe and dequant
(which make the MoE ops), before expert_workspace (which converts the rank's experts only).
"""

from __future__ import annotations

from dayzero import UserError
from dayzero.passes.ir.collective import Mesh
from dayzero.passes.ir.node import Graph, Node, TensorType, rewrite, users
from dayzero.passes.pipeline import Found

EP, TP = "ep", "tp"
# elementwise ops an MLP's activation is made of (every input the same shape as the output)
_ELEMENTWISE = {"silu", "gelu", "sigmoid", "relu", "tanh", "neg", "clamp", "mul.Tensor", "add.Tensor", "sub.Tensor",
                "div.Tensor", "mul.Scalar", "add.Scalar"}
MOE_OPS = ("moe_experts", "moe_experts_mxfp4", "moe_experts_fp8")  # x, ids, w, then expert tensors [E, ..]
_ROUTING_INPUTS = 3


def _expert_count(n: Node, uses: dict[int, list[Node]]) -> int | None:
    """E when every expert tensor of MoE node ``n`` is a weight [E, ..], read by MoE ops only; else None."""
    ts = n.inputs[_ROUTING_INPUTS:]
    if not ts or not all(t.op == "weight" and "shard" not in t.attr and t.shape and isinstance(t.shape[0], int)
                         for t in ts):
        return None
    E = ts[0].shape[0]
    if any(t.shape[0] != E or any(u.op not in MOE_OPS for u in uses.get(id(t), ())) for t in ts):
        return None
    return E if n.inputs[1].dtype == "int64" and len(n.inputs[1].shape) == 2 else None


def _dense_mlp(down: Node, uses: dict[int, list[Node]], outputs: set[int]) -> bool:
    """``down`` is the down-projection of a dense MLP: linear(f(linear(x, W_1), .., linear(x, W_n)), W_d), f
    elementwise over tensors of one shape [.., I], no biases, every node between read only inside the MLP and
    every W a 2-D weight read only by its linear."""
    if down.op != "linear" or down.attr.get("bias") or down.inputs[1].op != "weight" or len(down.inputs[1].shape) != 2:
        return False
    h = down.inputs[0]
    if len(h.types) != 1 or not h.shape or not isinstance(h.shape[-1], int) or down.inputs[1].shape[1] != h.shape[-1]:
        return False
    inside, leaves, stack, xs = {id(down)}, [], [h], set()
    while stack:
        n = stack.pop()
        if id(n) in inside:
            continue
        inside.add(id(n))
        if len(n.types) != 1 or n.shape != h.shape:
            return False
        if n.op == "linear" and not n.attr.get("bias") and n.inputs[1].op == "weight" and \
                len(n.inputs[1].shape) == 2:
            leaves.append(n)
            xs.add(id(n.inputs[0]))
            inside.add(id(n.inputs[1]))
        elif n.op in _ELEMENTWISE:
            stack.extend(n.inputs)
        else:
            return False
    between = inside - {id(down)}
    return bool(leaves) and len(xs) == 1 and not between & outputs and \
        all(id(u) in inside for k in between for u in uses.get(k, ())) and \
        all(uses.get(id(w.inputs[1]), []) == [w] for w in (*leaves, down))


def _split_mlp(down: Node, tp: int) -> Node:
    """The dense MLP ending at ``down`` (inputs already rewritten) with its up-projections column-split and its
    down-projection row-split over the tp group, then all_reduce[tp]."""
    h = down.inputs[0]
    I = h.shape[-1]
    new: dict[int, Node] = {}

    def split(n: Node) -> Node:
        if id(n) not in new:
            t = TensorType(n.dtype, (*n.shape[:-1], I // tp))
            if n.op == "linear":
                w = n.inputs[1]
                sw = Node.make("weight", (), dict(w.attr, shard=(TP, 0, tp)),
                               [TensorType(w.dtype, (w.shape[0] // tp, w.shape[1]))], w.span)
                new[id(n)] = n.replace(inputs=(n.inputs[0], sw), types=(t,))
            else:
                new[id(n)] = n.replace(inputs=tuple(split(i) for i in n.inputs), types=(t,))
        return new[id(n)]
    wd = down.inputs[1]
    swd = Node.make("weight", (), dict(wd.attr, shard=(TP, 1, tp)), [TensorType(wd.dtype, (wd.shape[0], I // tp))],
                    wd.span)
    part = down.replace(inputs=(split(h), swd))
    return Node.make("all_reduce", (part,), {"group": TP, "size": tp, "reduce": "sum"}, [down.type], down.span)


def shard(g: Graph, mesh: Mesh) -> tuple[Graph, Found]:
    """Expert parallel over ``mesh``'s ep axis, dense MLPs over its tp axis; Found counts
    ``shard.expert_parallel`` and ``shard.tensor_parallel_mlp`` (blocks split)."""
    ep, tp = mesh.size(EP), mesh.size(TP)
    if ep == 1 and tp == 1:
        return g, Found()
    uses = users(g)
    outputs = {id(o) for o in g.outputs}
    mlps = {id(n) for n in g.nodes() if tp > 1 and _dense_mlp(n, uses, outputs) and n.shape and
            n.inputs[0].shape[-1] % tp == 0}
    split: dict[int, Node] = {}  # weight node id -> its shard (one node per weight, however many users)
    count = mlp_count = 0

    def fn(n: Node, original: Node) -> Node | None:
        nonlocal count, mlp_count
        if id(original) in mlps:
            mlp_count += 1
            return _split_mlp(n, tp)
        if n.op not in MOE_OPS or ep == 1:
            return None
        E = _expert_count(n, uses)
        if E is None:
            return None
        if E % ep:
            raise UserError(f"--ep {ep}: the {E} routed experts of {n.span} do not split evenly over {ep} ranks")
        local = E // ep
        ids = n.inputs[1]
        rank = Node.make("group_rank", (), {"group": EP, "size": ep}, [TensorType("int64", (1,))], n.span)
        start = Node.make("mul.Scalar", (rank,), {"other": local}, [TensorType("int64", (1,))], n.span)
        local_ids = Node.make("sub.Tensor", (ids, start), {"alpha": 1}, [ids.type], n.span)
        experts = []
        for t in n.inputs[_ROUTING_INPUTS:]:
            if id(t) not in split:
                split[id(t)] = Node.make("weight", (), dict(t.attr, shard=(EP, 0, ep)),
                                         [TensorType(t.dtype, (local, *t.shape[1:]))], t.span)
            experts.append(split[id(t)])
        part = n.replace(inputs=(n.inputs[0], local_ids, n.inputs[2], *experts))
        count += 1
        return Node.make("all_reduce", (part,), {"group": EP, "size": ep, "reduce": "sum"}, [n.type], n.span)

    # rewrite() hands fn a node whose inputs are already rewritten; weights have none, so they keep their
    # identity and ``uses`` (of the graph before) still describes them
    g = rewrite(g, fn, with_original=True)
    return g, Found({k: v for k, v in (("shard.expert_parallel", count), ("shard.tensor_parallel_mlp", mlp_count))
                     if v})
