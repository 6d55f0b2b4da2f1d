"""shard: split the program over the device mesh (passes/ir/collective.py); here the routed experts over the ``ep``
axis (expert parallel).

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
Routing, attention, shared experts and the rest stay replicated (identical on every rank).

Matched on the op (one of ``MOE_OPS``) and the shapes of its inputs, never on names. Ordering: after moe and dequant
(which make the MoE ops), before expert_workspace (which converts the rank's experts only).
"""

from __future__ import annotations

from dayzero import UserError
from dayzero.passes.ir.collective import Mesh
from dayzero.passes.ir.node import Graph, Node, TensorType, rewrite, users
from dayzero.passes.pipeline import Found

EP = "ep"
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


def shard(g: Graph, mesh: Mesh) -> tuple[Graph, Found]:
    """Expert parallel over ``mesh``'s ep axis; Found counts ``shard.expert_parallel`` (layers split)."""
    ep = mesh.size(EP)
    if ep == 1:
        return g, Found()
    uses = users(g)
    split: dict[int, Node] = {}  # weight node id -> its shard (one node per weight, however many users)
    count = 0

    def fn(n: Node) -> Node | None:
        nonlocal count
        if n.op not in MOE_OPS:
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
    g = rewrite(g, fn)
    return g, Found({"shard.expert_parallel": count} if count else {})
