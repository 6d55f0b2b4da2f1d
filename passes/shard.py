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

Attention over the tp group: each TP rank keeps heads/tp of the query heads and kv_heads/tp of the kv heads (and
their KV cache)::

    linear(g(linear(x, W_q [Nq, K]), linear(x, W_k), linear(x, W_v), cache_k, cache_v, side), W_o [H, Nq])
        ==>  all_reduce[tp](linear(g'(linear(x, W_q [Nq/tp, K]), .., cache_k [.., kv/tp, ..], ..), W_o [H, Nq/tp]))

where g is any graph of ops that treat the head axis independently (element-wise with broadcast, views that keep
heads as their outer blocks, permutes, expands, slices / cats / reductions over other axes, cache index_put,
scaled_dot_product_attention, bmm over the head batch): the head axis is followed from each projection's output
columns through g, every node on the way gets its head axis divided by tp (view and expand sizes too), a state
(KV cache) it writes is split on the same axis, and a per-head weight it reads (gpt-oss's sinks, through views
and expands) is split too; anything else (a node that mixes heads, a kv head count tp does not divide, MLA's shared
rope key, a pattern op) leaves that attention replicated. An o_proj bias is added after the all_reduce.

The vocabulary over the tp group: each TP rank keeps V/tp rows of the embedding table and of the LM head::

    embedding(W [V, H], ids)  ==>  all_reduce[tp](embedding(W [V/tp, H], clamp(l, 0, V/tp - 1)) * (0 <= l < V/tp))
                                   with l = ids - group_rank[tp] * V/tp     (other ranks' tokens look up zeros)
    linear(x, W [V, K]) -> a graph output  ==>  all_gather[tp, dim -1](linear(x, W [V/tp, K]))

(each table a weight read by that one node only; a tied table, read by both, stays whole).

Routing, the norms and the rest stay replicated (identical on every rank of a group).

Matched on ops and shapes (the MoE ops; linear / elementwise trees read only inside the block; the head axis
followed through an attention block; embedding and output projections), never on names. Ordering: after moe and
dequant (which make the MoE ops), before inplace_state, the attention patterns and paged_kv (which see the rank's
heads and caches) and expert_workspace (which converts the rank's experts only). A bf16 checkpoint's projection or
table arrives as ``_to_copy(weight bf16)`` (frontend/lowprec.bind_bf16) and splits as a weight does, its slice
bf16 under the same upcast: dequant_bf16, after this pass, reads each rank's slice as stored.
"""

from __future__ import annotations

from dayzero import UserError
from dayzero.passes.ir.collective import Mesh
import math

from dayzero.passes.fuse import ELEMENTWISE as _POINTWISE
from dayzero.passes.ir.node import Graph, Node, TensorType, rewrite, users
from dayzero.passes.pipeline import Found

EP, TP = "ep", "tp"
# elementwise ops an MLP's activation is made of (every input the same shape as the output)
_ELEMENTWISE = {"silu", "gelu", "sigmoid", "relu", "tanh", "neg", "clamp", "mul.Tensor", "add.Tensor", "sub.Tensor",
                "div.Tensor", "mul.Scalar", "add.Scalar"}
MOE_OPS = ("moe_experts", "moe_experts_mxfp4", "moe_experts_fp8")  # x, ids, w, then expert tensors [E, ..]
_ROUTING_INPUTS = 3


# ---- weights as the checkpoint stores them ------------------------------------------------------------------------
# A linear's weight or an embedding's table is a ``weight``, or a bf16 one under the frontend's exact upcast
# ``_to_copy(weight bfloat16, float32)`` (frontend/lowprec.bind_bf16; passes/dequant_bf16.py fuses it after this
# pass): either splits the same way, the slice staying in the dtype the checkpoint stores.

def _stored(w: Node) -> Node | None:
    """The checkpoint ``weight`` behind ``w``: ``w`` itself, or the bf16 weight its upcast reads; else None."""
    if w.op == "weight":
        return w
    if w.op == "_to_copy" and w.attr.get("dtype") == "float32" and len(w.inputs) == 1 and \
            w.inputs[0].op == "weight" and w.inputs[0].dtype == "bfloat16" and w.inputs[0].shape == w.shape:
        return w.inputs[0]
    return None


def _own(w: Node, reader: Node, uses: dict[int, list[Node]]) -> bool:
    """``w`` is an unsplit checkpoint weight (or its bf16 upcast) read by ``reader`` only."""
    s = _stored(w)
    return s is not None and "shard" not in s.attr and uses.get(id(w), []) == [reader] and \
        (s is w or uses.get(id(s), []) == [w])


def _sliced(w: Node, group: str, dim: int, parts: int) -> Node:
    """``w`` (a weight, or its bf16 upcast) as this rank's slice ``dim`` of ``parts``: the weight with attr
    ``shard`` = (group, dim, parts) and the slice's shape, under the same upcast."""
    s = _stored(w)
    shape = tuple(d // parts if k == dim else d for k, d in enumerate(s.shape))
    part = Node.make("weight", (), dict(s.attr, shard=(group, dim, parts)), [TensorType(s.dtype, shape)], s.span)
    return part if s is w else w.replace(inputs=(part,), types=(TensorType(w.dtype, shape),))


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
    if down.op != "linear" or down.attr.get("bias") or _stored(down.inputs[1]) is None or \
            len(down.inputs[1].shape) != 2:
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
        if n.op == "linear" and not n.attr.get("bias") and _stored(n.inputs[1]) is not None and \
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
        all(_own(w.inputs[1], w, uses) for w in (*leaves, down))


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
                new[id(n)] = n.replace(inputs=(n.inputs[0], _sliced(n.inputs[1], TP, 0, tp)), types=(t,))
            else:
                new[id(n)] = n.replace(inputs=tuple(split(i) for i in n.inputs), types=(t,))
        return new[id(n)]
    part = down.replace(inputs=(split(h), _sliced(down.inputs[1], TP, 1, tp)))
    return Node.make("all_reduce", (part,), {"group": TP, "size": tp, "reduce": "sum"}, [down.type], down.span)


# ---- attention heads over the tp group ----------------------------------------------------------------------------

_REGION_LIMIT = 4000  # nodes walked back from one o_proj candidate before giving up (a residual stream, not a block)
_DIM_OPS = {"slice.Tensor", "select.int", "split_with_sizes", "split.Tensor", "cat", "softmax.int", "_softmax",
            "log_softmax.int", "_log_softmax", "mean.dim", "sum.dim_IntList", "amax", "amin", "max.dim", "min.dim"}
_COPIES = {"clone", "alias", "contiguous", "getitem"}


class _NoSplit(Exception):
    """This block does not split over heads: it stays replicated."""


def _projection(n: Node, uses: dict[int, list[Node]]) -> bool:
    """``n`` is linear(x, W [N, K] (, b [N])) with W (and b) unsharded weights read by ``n`` only."""
    if n.op != "linear" or len(n.types) != 1:
        return False
    ws = n.inputs[1:]
    return all(_own(w, n, uses) for w in ws) and len(ws[0].shape) == 2 and all(len(w.shape) == 1 for w in ws[1:])


def _dims(v, rank: int) -> list[int]:
    """An op's dim attr (int or list, maybe negative) as non-negative axes of a rank-``rank`` tensor (None, every
    axis: no split)."""
    ds = v if isinstance(v, (list, tuple)) else [v]
    if not rank or not ds or not all(isinstance(d, int) for d in ds):
        raise _NoSplit
    return [d % rank for d in ds]


def _view_axis(src: tuple, dst: tuple, a: int, tp: int) -> int:
    """The axis of ``dst`` (a reshape of ``src``) holding ``src``'s axis ``a`` as its outer blocks: the elements
    of each tp-th of axis ``a`` are each tp-th of that axis of ``dst``."""
    if not isinstance(src[a], int) or src[a] % tp:
        raise _NoSplit
    outer = math.prod(src[:a])
    for b, d in enumerate(dst):
        if d != 1 and math.prod(dst[:b]) == outer:
            if isinstance(d, int) and d % tp == 0:
                return b
            break
    raise _NoSplit


class _Heads:
    """The head axis of every node of one attention block (node id -> axis), found forward from its projections
    and caches, with the per-head tensors read beside them (a weight, through views); raises _NoSplit where the
    block does not split."""

    def __init__(self, o: Node, uses: dict[int, list[Node]], order: dict[int, int], tp: int):
        self.tp, self.uses = tp, uses
        self.axis: dict[int, int] = {}
        self.nodes: dict[int, Node] = {}
        h = o.inputs[0]
        seen, seeds, stack = set(), [], [h]
        while stack:  # back from o_proj's input to the projections and caches it reads
            n = stack.pop()
            if id(n) in seen:
                continue
            seen.add(id(n))
            if len(seen) > _REGION_LIMIT:
                raise _NoSplit
            if n.op == "state" or _projection(n, uses):
                seeds.append(n)
            elif n.op not in ("weight", "input"):
                stack.extend(n.inputs)
        region = {id(s) for s in seeds}
        self._by_id = self._within(h, seen)
        self.assigns: list[Node] = []  # the block's cache writes back to their states
        for n in sorted(self._by_id.values(), key=lambda n: order[id(n)]):
            if id(n) not in region and any(id(i) in region for i in n.inputs):
                region.add(id(n))
        if not any(s.op == "linear" for s in seeds) or id(h) not in region:
            raise _NoSplit
        self.region = region
        for s in seeds:
            if s.op == "linear":
                self._set(s, len(s.shape) - 1)
            else:
                self.nodes[id(s)] = s  # a cache: its axis is the one the values written into it have
        for n in sorted((self._by_id[i] for i in region if id(self._by_id[i]) not in self.axis and
                         self._by_id[i].op != "state"), key=lambda n: order[id(n)]):
            self._set(n, self._rule(n))
        if self.axis.get(id(h)) != len(h.shape) - 1:
            raise _NoSplit
        # every node split here is read only by nodes split here, o_proj, and the writes back to its caches
        for k, n in list(self.nodes.items()):
            if k not in self.axis:
                raise _NoSplit  # a cache read but never written in this block
            for u in uses.get(k, []):
                if id(u) in self.axis or u is o:
                    continue
                if u.op == "assign" and u.inputs[0].op == "state" and id(u.inputs[0]) in self.axis \
                        and id(u.inputs[1]) in self.axis:
                    self.assigns.append(u)
                    continue
                raise _NoSplit
        for u in self.assigns:  # a cache written back: the state's axis
            self.axis[id(u)] = self.axis[id(u.inputs[0])]
            self.nodes[id(u)] = u

    @staticmethod
    def _within(h: Node, seen: set[int]) -> dict[int, Node]:
        """id -> node of ``h`` and its ancestors inside ``seen``."""
        out, stack = {}, [h]
        while stack:
            n = stack.pop()
            if id(n) in out or id(n) not in seen:
                continue
            out[id(n)] = n
            stack.extend(n.inputs)
        return out

    def _set(self, n: Node, axis: int) -> None:
        if any(not isinstance(t.shape[axis], int) or t.shape[axis] % self.tp for t in n.types):
            raise _NoSplit
        if self.axis.get(id(n), axis) != axis:
            raise _NoSplit
        self.axis[id(n)] = axis
        self.nodes[id(n)] = n

    def _in(self, i: Node, rank: int) -> int | None:
        """Axis of input ``i`` aligned to an output of ``rank`` dims (trailing alignment), None outside the block."""
        if id(i) not in self.region:
            return None
        if id(i) not in self.axis:
            raise _NoSplit  # a cache read before it is written
        return self.axis[id(i)] + rank - len(i.shape)

    def _side(self, i: Node, b: int, rank: int) -> None:
        """Input ``i`` outside the block, broadcast against axis ``b`` of a rank-``rank`` output: fine when it has
        no such axis or extent 1 there; else it is a per-head tensor: split it (a weight through views)."""
        k = b - (rank - len(i.shape))
        if k < 0 or i.shape[k] == 1:
            return
        self._split_side(i, k)

    def _split_side(self, n: Node, k: int) -> None:
        if id(n) in self.axis:
            if self.axis[id(n)] != k:
                raise _NoSplit
            return
        if n.op == "weight" and "shard" not in n.attr:
            self._set(n, k)
        elif n.op in ("view", "_unsafe_view", "reshape"):
            self._set(n, k)
            self._split_side(n.inputs[0], _view_axis(n.shape, n.inputs[0].shape, k, self.tp))
        elif n.op == "expand":
            self._set(n, k)
            src = n.inputs[0]
            j = k - (len(n.shape) - len(src.shape))
            if j >= 0 and src.shape[j] != 1:
                self._split_side(src, j)
        elif n.op == "unsqueeze":
            self._set(n, k)
            d = _dims(n.attr["dim"], len(n.shape))[0]
            if k == d:
                raise _NoSplit
            self._split_side(n.inputs[0], k - (k > d))
        else:
            raise _NoSplit

    def _rule(self, n: Node) -> int:
        """The head axis of ``n``'s outputs from its inputs' (raises _NoSplit for an op that mixes heads)."""
        op, r = n.op, len(n.types[0].shape)
        if op == "getitem":
            return self.axis[id(n.inputs[0])]
        if op == "index_put":  # (cache, indices.., values): the cache takes the values' head axis
            cache, values, src = n.inputs[0], n.inputs[-1], n.inputs[0].shape
            if len(n.inputs) != 2 + sum(bool(x) for x in n.attr["indices"]) or id(values) not in self.axis:
                raise _NoSplit
            b = self.axis[id(values)] + len(src) - len(values.shape)
            if b < len(n.attr["indices"]) and n.attr["indices"][b]:
                raise _NoSplit
            if cache.op == "state" and id(cache) not in self.axis:
                self._set(cache, b)
            elif self._in(cache, len(src)) != b:
                raise _NoSplit
            return b
        if op in _POINTWISE or op in _COPIES or op == "cat":
            aligned = {self._in(i, r) for i in n.inputs if id(i) in self.region}
            if len(aligned) != 1:
                raise _NoSplit
            (b,) = aligned
            if op == "cat" and b in _dims(n.attr["dim"], r):
                raise _NoSplit
            for i in n.inputs:
                if id(i) not in self.region:
                    self._side(i, b, r)
            return b
        a = self._in(n.inputs[0], len(n.inputs[0].shape))
        if a is None:
            raise _NoSplit
        src = n.inputs[0].shape
        if op in ("view", "_unsafe_view", "reshape"):
            return _view_axis(src, n.shape, a, self.tp)
        if op == "permute":
            return _dims(n.attr["dims"], r).index(a)
        if op == "transpose.int":
            d0, d1 = _dims(n.attr["dim0"], r)[0], _dims(n.attr["dim1"], r)[0]
            return d1 if a == d0 else d0 if a == d1 else a
        if op == "unsqueeze":
            d = _dims(n.attr["dim"], r)[0]
            return a + (d <= a)
        if op == "expand":
            return a + r - len(src)
        if op in _DIM_OPS:
            dims = _dims(n.attr.get("dim", n.attr.get("dims")), len(src))
            if a in dims:
                raise _NoSplit
            kept = n.attr.get("keepdim", True) and op not in ("select.int",)
            return a - (0 if kept else sum(d < a for d in dims))
        if op == "scaled_dot_product_attention":  # (q, k, v[, mask]) [B, heads, T, D]
            b = r - 3
            if [self._in(i, len(i.shape)) for i in n.inputs[:3]] != [b, b, b]:
                raise _NoSplit
            for i in n.inputs[3:]:
                if id(i) in self.region:
                    raise _NoSplit
                self._side(i, b, r)
            return b
        if op in ("bmm", "matmul"):  # batched over the heads
            if r < 3 or {self._in(i, r) for i in n.inputs} != {a + r - len(src)} or a + r - len(src) >= r - 2:
                raise _NoSplit
            return a + r - len(src)
        raise _NoSplit

    def rewritten(self, n: Node, original: Node) -> Node:
        """``n`` (inputs rewritten) with its head axis divided by tp: its types, view / expand sizes, and the
        shard attr of a weight."""
        b, tp = self.axis[id(original)], self.tp
        types = tuple(TensorType(t.dtype, tuple(d // tp if k == b else d for k, d in enumerate(t.shape)))
                      for t in n.types)
        attrs = n.attr
        if n.op == "linear":  # a projection: its rows (and bias) are this rank's heads
            n = n.replace(inputs=(n.inputs[0], *(_sliced(w, TP, 0, tp) for w in n.inputs[1:])))
        elif n.op == "weight":
            attrs["shard"] = (TP, b, tp)
        elif n.op in ("view", "_unsafe_view", "reshape", "expand") and "size" in attrs:
            size = list(attrs["size"])
            if size[b] != -1:
                size[b] = types[0].shape[b]
            attrs["size"] = size
        return n.replace(types=types, attrs=attrs)


def _split_attention(o: Node, tp: int) -> Node:
    """o_proj (inputs rewritten: its input holds the rank's heads) row-split, all_reduce[tp], then its bias."""
    part = o.replace(inputs=(o.inputs[0], _sliced(o.inputs[1], TP, 1, tp)), attrs=dict(o.attr, bias=False))
    out = Node.make("all_reduce", (part,), {"group": TP, "size": tp, "reduce": "sum"}, [o.type], o.span)
    if len(o.inputs) == 3:
        out = Node.make("add.Tensor", (out, o.inputs[2]), {"alpha": 1}, [o.type], o.span)
    return out


def _attention_blocks(g: Graph, uses: dict[int, list[Node]], tp: int, taken: set[int]) -> tuple[set[int], dict]:
    """The o_proj ids of the attention blocks that split over tp heads, and node id -> the _Heads of its block."""
    order = {id(n): k for k, n in enumerate(g.nodes())}
    outputs = {id(o) for o in g.outputs}
    heads: dict[int, _Heads] = {}
    ops: set[int] = set()
    for o in g.nodes():
        if id(o) in taken or not _projection(o, uses) or not o.inputs[0].shape or \
                not isinstance(o.inputs[0].shape[-1], int) or o.inputs[0].shape[-1] % tp:
            continue
        try:
            block = _Heads(o, uses, order, tp)
        except _NoSplit:
            continue
        if any(k in heads or k in taken or (k in outputs and block.nodes[k].op != "assign") for k in block.axis):
            continue
        ops.add(id(o))
        for k in block.axis:
            heads[k] = block
        for a in block.assigns:
            heads[id(a)] = block
    return ops, heads


def _table(n: Node, uses: dict[int, list[Node]], tp: int) -> bool:
    """``n``'s table (its vocabulary first: embedding's input 0, a linear's input 1) is a 2-D weight read by ``n``
    only, its rows a multiple of tp."""
    w = n.inputs[0 if n.op == "embedding" else 1]
    return _own(w, n, uses) and len(w.shape) == 2 and isinstance(w.shape[0], int) and w.shape[0] % tp == 0


def _split_embedding(n: Node, tp: int) -> Node:
    """embedding(W, ids) with this rank's V/tp rows: a masked local lookup, then all_reduce[tp]."""
    w, ids = n.inputs[0], n.inputs[1]
    local = w.shape[0] // tp
    it, sp = ids.type, n.span
    rank = Node.make("group_rank", (), {"group": TP, "size": tp}, [TensorType("int64", (1,))], sp)
    start = Node.make("mul.Scalar", (rank,), {"other": local}, [TensorType("int64", (1,))], sp)
    rel = Node.make("sub.Tensor", (ids, start), {"alpha": 1}, [it], sp)
    bt = TensorType("bool", it.shape)
    inside = Node.make("logical_and", (Node.make("ge.Scalar", (rel,), {"other": 0}, [bt], sp),
                                       Node.make("lt.Scalar", (rel,), {"other": local}, [bt], sp)), {}, [bt], sp)
    idx = Node.make("clamp", (rel,), {"min": 0, "max": local - 1}, [it], sp)
    rows = n.replace(inputs=(_sliced(w, TP, 0, tp), idx))
    mask = Node.make("_to_copy", (inside,), {"dtype": n.dtype}, [TensorType(n.dtype, it.shape)], sp)
    mask = Node.make("unsqueeze", (mask,), {"dim": len(it.shape)}, [TensorType(n.dtype, (*it.shape, 1))], sp)
    part = Node.make("mul.Tensor", (rows, mask), {}, [n.type], sp)
    return Node.make("all_reduce", (part,), {"group": TP, "size": tp, "reduce": "sum"}, [n.type], sp)


def _split_head(n: Node, tp: int) -> Node:
    """linear(x, W [V, K] (, b)) with this rank's V/tp rows, then all_gather[tp] of the logits."""
    ws = [_sliced(w, TP, 0, tp) for w in n.inputs[1:]]
    shape = n.shape
    part = n.replace(inputs=(n.inputs[0], *ws), types=(TensorType(n.dtype, (*shape[:-1], shape[-1] // tp)),))
    return Node.make("all_gather", (part,), {"group": TP, "size": tp, "dim": len(shape) - 1}, [n.type], n.span)


def shard(g: Graph, mesh: Mesh) -> tuple[Graph, Found]:
    """Expert parallel over ``mesh``'s ep axis, dense MLPs, attention heads and the vocabulary over its tp axis;
    Found counts ``shard.expert_parallel``, ``shard.tensor_parallel_mlp``, ``shard.tensor_parallel_attention``,
    ``shard.tensor_parallel_vocab`` (blocks split) and ``shard.replicated_kv_caches`` (caches left whole under
    tp)."""
    ep, tp = mesh.size(EP), mesh.size(TP)
    if ep == 1 and tp == 1:
        return g, Found()
    uses = users(g)
    outputs = {id(o) for o in g.outputs}
    mlps = {id(n) for n in g.nodes() if tp > 1 and _dense_mlp(n, uses, outputs) and n.shape and
            n.inputs[0].shape[-1] % tp == 0}
    attention, heads = _attention_blocks(g, uses, tp, mlps) if tp > 1 else (set(), {})
    vocab = {id(n) for n in g.nodes() if tp > 1 and id(n) not in attention and id(n) not in mlps and (
        (n.op == "embedding" and _table(n, uses, tp)) or
        (id(n) in outputs and _projection(n, uses) and _table(n, uses, tp)))}
    split: dict[int, Node] = {}  # weight node id -> its shard (one node per weight, however many users)
    count = mlp_count = attn_count = vocab_count = 0

    def fn(n: Node, original: Node) -> Node | None:
        nonlocal count, mlp_count, attn_count, vocab_count
        if id(original) in vocab:
            vocab_count += 1
            return _split_embedding(n, tp) if n.op == "embedding" else _split_head(n, tp)
        if id(original) in mlps:
            mlp_count += 1
            return _split_mlp(n, tp)
        if id(original) in attention:
            attn_count += 1
            return _split_attention(n, tp)
        if id(original) in heads:
            return heads[id(original)].rewritten(n, original)
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
                split[id(t)] = _sliced(t, EP, 0, ep)
            experts.append(split[id(t)])
        part = n.replace(inputs=(n.inputs[0], local_ids, n.inputs[2], *experts))
        count += 1
        return Node.make("all_reduce", (part,), {"group": EP, "size": ep, "reduce": "sum"}, [n.type], n.span)

    before = g.nodes()
    # rewrite() hands fn a node whose inputs are already rewritten; weights have none, so they keep their
    # identity and ``uses`` (of the graph before) still describes them
    g = rewrite(g, fn, with_original=True)
    # KV caches an attention left whole under tp (MLA, an indexer, compressed attention, kv heads tp does not
    # divide): counted, so the report says so
    whole = sum(1 for n in before if tp > 1 and n.op == "state" and n.attr.get("zone") == "kv_cache"
                and id(n) not in heads)
    return g, Found({k: v for k, v in (("shard.expert_parallel", count), ("shard.tensor_parallel_mlp", mlp_count),
                                       ("shard.replicated_kv_caches", whole),
                                       ("shard.tensor_parallel_attention", attn_count),
                                       ("shard.tensor_parallel_vocab", vocab_count)) if v})
