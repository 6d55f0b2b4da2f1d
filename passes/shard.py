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

Attention over the tp group: each TP rank keeps heads/tp of the query heads (and of the kv heads and their KV
cache where there are several)::

    linear(g(linear(x, W_q [Nq, K]), .., cache_k, cache_v, side), W_o [H, Nq])
        ==>  all_reduce[tp](linear(g'(linear(x, W_q [Nq/tp, K]), .., cache_k [.., kv/tp, ..], ..), W_o [H, Nq/tp]))

The head axis is found backward from o_proj's input (the row-split linear) through g, which must treat heads
independently (element-wise with broadcast, views that keep heads as blocks or merge them with a batch axis,
permutes, expands, slices / cats / reductions over other axes, cache index_put, scaled_dot_product_attention, bmm
over the head batch) and hold an attention op (sdpa, bmm, softmax over positions). Each tensor's head axis may
hold its heads in blocks (``_view_axis``): a fused q/k/v projection's [T, 3*H*D] columns, heads merged with the
batch; a rank's part is its heads of every block. The walk ends at a projection (column-split per head: a fused
one's rows are the rank's heads of each block, shard attr (group, dim, parts, blocks)), a KV cache (split, with
its writes back), a per-head weight (gpt-oss's and V4's sinks, V4's grouped o_a_proj: split on that axis), a
buffer made from nothing or a folded constant with equal blocks (one block), or a tensor whose head extent is 1,
broadcast over the heads: MLA's shared latent KV head and
DeepSeek-V4's single K=V head, the masks (the DSA indexer's top-k mask among them: the indexer stays whole, so its
top-k is identical on every rank), rotary tables. Those are computed whole on every rank. Anything else (a node
that mixes heads, a head count tp does not divide, a split value read outside the block, a pattern op) leaves that
attention replicated. An o_proj bias is added after the all_reduce.

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

import math
from collections.abc import Mapping

import sympy
import torch

from dayzero import UserError
from dayzero.passes.fold_constants import constant_name
from dayzero.passes.fuse import ELEMENTWISE as _POINTWISE
from dayzero.passes.ir.collective import Mesh
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


def _sliced(w: Node, group: str, dim: int, parts: int, blocks: int = 1) -> Node:
    """``w`` (a weight, or its bf16 upcast) as this rank's slice ``dim`` of ``parts``: the weight with attr
    ``shard`` = (group, dim, parts) and the slice's shape, under the same upcast. ``blocks`` > 1: ``dim`` holds
    that many blocks (a fused q/k/v projection's rows) and the slice is the rank's part of each, in order (attr
    (group, dim, parts, blocks))."""
    s = _stored(w)
    shape = tuple(d // parts if k == dim else d for k, d in enumerate(s.shape))
    shard = (group, dim, parts) if blocks == 1 else (group, dim, parts, blocks)
    part = Node.make("weight", (), dict(s.attr, shard=shard), [TensorType(s.dtype, shape)], s.span)
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

_WALK_LIMIT = 4000  # nodes walked back from one o_proj candidate before giving up (a residual stream, not a block)
# ops that keep every axis, reading across their ``dim`` only (the head axis must be another)
_DIM_OPS = {"slice.Tensor", "split_with_sizes", "split.Tensor", "cat", "softmax.int", "_softmax", "log_softmax.int",
            "_log_softmax", "slice_scatter"}
# ops that may drop their ``dim`` (keepdim false, select)
_REDUCE_OPS = {"select.int", "mean.dim", "sum.dim_IntList", "amax", "amin", "max.dim", "min.dim"}
_COPIES = {"clone", "alias", "contiguous", "copy"}  # copy(dst, src): dst's values, src broadcast into them
_VIEWS = ("view", "_unsafe_view", "reshape")
_SQUEEZES = ("squeeze", "squeeze.dim", "squeeze.dims")


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


def _divisible(d, tp: int) -> bool:
    """Extent ``d`` (an int, or a symbolic extent such as 4*batch) is a multiple of tp at every binding."""
    if isinstance(d, int):
        return d % tp == 0
    c, _ = sympy.expand(d).as_coeff_Mul()
    return bool(c.is_Integer) and int(c) % tp == 0


def _part(d, tp: int):
    """One rank's part of extent ``d`` (a multiple of tp)."""
    return d // tp if isinstance(d, int) else sympy.expand(d / tp)


def _same(x, y) -> bool:
    return x == y or sympy.expand(x - y) == 0


def _quot(x, y):
    """``x / y`` when ``y`` divides ``x`` (integers, or products of the shape symbols with an integer factor);
    else None."""
    if isinstance(x, int) and isinstance(y, int):
        return x // y if y and x % y == 0 else None
    q = sympy.cancel(x / y)  # extents are ints or expressions of the graph's symbols (never text): x or y is one
    if q.is_Integer:
        return int(q)
    num, den = sympy.fraction(q)
    if den != 1 or q.is_number or not all(c.is_Integer for c in sympy.Poly(num, *num.free_symbols).coeffs()):
        return None
    return q


def _splits(d, blocks, tp: int) -> bool:
    """Extent ``d`` is ``blocks`` blocks, each a multiple of tp."""
    e = _quot(d, blocks)
    return e is not None and _divisible(e, tp)


def _view_axis(src: tuple, dst: tuple, a: int, tp: int, outer=1) -> tuple[int, object]:
    """Where the heads of ``src``'s axis ``a`` lie in ``dst`` (a reshape of ``src``): (axis, blocks) such that each
    rank's part of ``src`` is its part of ``dst``.

    A rank's part of an axis with ``outer`` blocks is the tp-th contiguous slice of each block ([H] with outer 1:
    H/tp heads; [3*H*D] with outer 3, a fused q/k/v projection's columns: H/tp heads of each of q, k and v; [B*H]
    with outer B: the rank's heads of every batch row). In flat order the heads of ``src`` are ``prefix`` runs
    (the product of the axes before ``a``, times ``outer``) of ``run`` elements each, the rank holding the tp-th
    contiguous slice of each run. The same elements in ``dst``: the first axis whose start divides ``prefix``
    (``blocks`` = prefix / that start) and whose extent is ``blocks`` blocks of a multiple of tp: each such block,
    with the axes after it, is one run."""
    if not _splits(src[a], outer, tp):
        raise _NoSplit
    prefix = math.prod(src[:a]) * outer
    start = 1
    for b, d in enumerate(dst):
        blocks = _quot(prefix, start)
        if d != 1 and blocks is not None:
            if _splits(d, blocks, tp):
                return b, blocks
        start = start * d
    raise _NoSplit


class _Heads:
    """One attention block split over the tp ranks' heads: node id -> the axis of its outputs that holds the heads
    (each rank computes its tp-th block of that axis), found walking backward from o_proj's input through the
    attention op to the head-carrying tensors. The walk ends at

    * a projection linear(x, W) whose output columns are the heads: W (and its bias) split by rows, x untouched;
    * a KV cache (state) holding heads: split on that axis, with the block's writes back to it;
    * a per-head weight (sinks, a grouped projection's matrix, through views): split on that axis; a folded
      constant whose tp blocks are equal (a zero-filled buffer): a constant of one block;
    * a buffer made from nothing (``empty``, ``full``, ...): made of the rank's size;
    * a tensor whose head extent is 1, broadcast over the heads (MLA's shared latent KV head, DeepSeek-V4's single
      K=V head, a mask, rotary tables, the DSA indexer's mask): not split, every rank computes it whole.

    Raises _NoSplit where the block does not split: an op that mixes heads, a head extent tp does not divide, a
    split value read outside the block (or a graph output), no attention op (scores over positions) on the way."""

    def __init__(self, o: Node, uses: dict[int, list[Node]], tp: int, constants: Mapping[str, torch.Tensor]):
        self.tp, self.uses, self.constants = tp, uses, constants
        self.axis: dict[int, int] = {}
        self.outer: dict[int, object] = {}  # node id -> the blocks of its head axis (_view_axis)
        self.nodes: dict[int, Node] = {}
        self.projections: dict[int, int] = {}  # linear id -> the blocks of its output columns
        self.assigns: list[Node] = []
        self.attends = False
        h = o.inputs[0]
        stack = [(h, len(h.shape) - 1, 1)]
        while stack:
            n, a, outer = stack.pop()
            if id(n) in self.axis:
                if self.axis[id(n)] != a or not _same(self.outer[id(n)], outer):
                    raise _NoSplit  # reached on two axes, or with two layouts of the heads
                continue
            self._set(n, a, outer)
            if len(self.axis) > _WALK_LIMIT:
                raise _NoSplit
            if n.op in _VIEWS:
                b, blocks = _view_axis(n.shape, n.inputs[0].shape, a, tp, outer)
                stack.append((n.inputs[0], b, blocks))
            else:
                stack.extend((i, k, outer) for i, k in self._back(n, a, outer) if k is not None)
        if not self.attends:
            raise _NoSplit
        # every split value is read only inside the block, by o_proj, or by a write back to its split cache
        for k, n in list(self.nodes.items()):
            for u in uses.get(k, []):
                if id(u) in self.axis or u is o or any(u is w for w in self.assigns):
                    continue
                state, value = u.inputs[0], u.inputs[-1]
                if u.op == "assign" and state.op == "state" and id(state) in self.axis and \
                        self.axis.get(id(value)) == self.axis[id(state)]:
                    self.assigns.append(u)
                    continue
                raise _NoSplit
        for u in self.assigns:
            self.axis[id(u)] = self.axis[id(u.inputs[0])]
            self.outer[id(u)] = self.outer[id(u.inputs[0])]
            self.nodes[id(u)] = u

    def _set(self, n: Node, axis: int, outer) -> None:
        if n.op == "input" or not n.types or any(
                len(t.shape) <= axis or not _splits(t.shape[axis], outer, self.tp) for t in n.types):
            raise _NoSplit
        self.axis[id(n)] = axis
        self.outer[id(n)] = outer
        self.nodes[id(n)] = n

    @staticmethod
    def _aligned(i: Node, a: int, r: int) -> tuple[Node, int | None]:
        """Input ``i`` broadcast against axis ``a`` of a rank-``r`` output: its axis there, None when it has no
        such axis or extent 1 (the same on every head: not split)."""
        k = a - (r - len(i.shape))
        return (i, None) if k < 0 or i.shape[k] == 1 else (i, k)

    def _back(self, n: Node, a: int, outer) -> list[tuple[Node, int | None]]:
        """The inputs of ``n`` (its head axis ``a`` in ``outer`` blocks; not a view: those are _view_axis's) with
        the axis each must split on (None: not split), the same blocks."""
        op, r = n.op, len(n.types[0].shape)
        if op == "linear" and _projection(n, self.uses):
            if a != r - 1 or not isinstance(outer, int):
                raise _NoSplit
            self.projections[id(n)] = outer  # a fused projection (q, k and v columns): the rank's rows of each
            return []
        if outer != 1 and (op == "weight" or op == "state"):
            raise _NoSplit  # a stored tensor holding the heads interleaved with another axis
        if op == "weight":
            if "shard" in n.attr:
                raise _NoSplit
            v = self.constants.get(n.attr["name"])
            if v is not None and not all(torch.equal(b, v.chunk(self.tp, a)[0]) for b in v.chunk(self.tp, a)):
                raise _NoSplit  # a constant that differs per head
            return []
        if op == "state" or (not n.inputs and "size" in n.attr):
            return []
        if op == "getitem":
            return [(n.inputs[0], a)]
        if op in _POINTWISE or op in _COPIES:
            return [self._aligned(i, a, r) for i in n.inputs]
        src = n.inputs[0].shape if n.inputs else ()
        if op == "permute":
            return [(n.inputs[0], _dims(n.attr["dims"], r)[a])]
        if op == "transpose.int":
            d0, d1 = _dims(n.attr["dim0"], r)[0], _dims(n.attr["dim1"], r)[0]
            return [(n.inputs[0], d1 if a == d0 else d0 if a == d1 else a)]
        if op == "unsqueeze":
            d = _dims(n.attr["dim"], r)[0]
            if a == d:
                raise _NoSplit
            return [(n.inputs[0], a - (d < a))]
        if op in _SQUEEZES:
            dims = _dims(n.attr["dim"], len(src)) if n.attr.get("dim") is not None else range(len(src))
            kept = [b for b in range(len(src)) if not (b in dims and src[b] == 1)]
            return [(n.inputs[0], kept[a])]
        if op == "expand":
            return [self._aligned(n.inputs[0], a, r)]
        if op in _DIM_OPS:
            if a in _dims(n.attr["dim"], r):
                raise _NoSplit
            if op in ("softmax.int", "_softmax", "log_softmax.int", "_log_softmax"):
                self.attends = True  # scores over positions
            return [(i, a) for i in n.inputs]
        if op in _REDUCE_OPS:
            dims = _dims(n.attr["dim"], len(src))
            keep = n.attr.get("keepdim", False) and op != "select.int"
            kept = [b for b in range(len(src)) if keep or b not in dims]
            if kept[a] in dims:
                raise _NoSplit
            return [(n.inputs[0], kept[a])]
        if op == "stack":
            d = _dims(n.attr["dim"], r)[0]
            if a == d:
                raise _NoSplit
            return [(i, a - (d < a)) for i in n.inputs]
        if op == "scaled_dot_product_attention":  # (q, k, v[, mask]) [B, heads, T, D]
            if a != r - 3:
                raise _NoSplit
            self.attends = True
            return [self._aligned(i, a, r) for i in n.inputs]
        if op in ("bmm", "matmul"):  # batched over the heads
            if a >= r - 2:
                raise _NoSplit
            self.attends = True
            return [self._aligned(i, a, r) for i in n.inputs]
        if op == "index_put":  # (cache, indices.., values): one index tensor, not on the head axis
            flags = n.attr["indices"]
            if len(n.inputs) != 3 or sum(bool(x) for x in flags) != 1 or (a < len(flags) and flags[a]):
                raise _NoSplit
            return [(n.inputs[0], a), (n.inputs[1], None), self._aligned(n.inputs[2], a, r)]
        raise _NoSplit

    def rewritten(self, n: Node, original: Node, made: dict[str, torch.Tensor]) -> Node:
        """``n`` (inputs rewritten) with its head axis divided by tp: its types, size attrs (views, expands,
        buffers), the rows of a projection's weights, the shard attr of a weight, the block of a constant (added
        to ``made``)."""
        b, tp = self.axis[id(original)], self.tp
        types = tuple(TensorType(t.dtype, tuple(_part(d, tp) if k == b else d for k, d in enumerate(t.shape)))
                      for t in n.types)
        attrs = n.attr
        if id(original) in self.projections:  # its rows (and bias) are this rank's heads, bf16 slices as stored
            blocks = self.projections[id(original)]
            n = n.replace(inputs=(n.inputs[0], *(_sliced(w, TP, 0, tp, blocks) for w in n.inputs[1:])))
        elif n.op == "weight" and attrs["name"] in self.constants:  # every block the same: one block
            v = self.constants[attrs["name"]].chunk(tp, b)[0].contiguous()
            name = constant_name(v, types[0])
            made[name] = v
            return Node.make("weight", (), {"name": name}, types, n.span)
        elif n.op == "weight":
            attrs["shard"] = (TP, b, tp)
        elif "size" in attrs and (n.op in (*_VIEWS, "expand") or not n.inputs):
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


def _attention_blocks(g: Graph, uses: dict[int, list[Node]], tp: int, taken: set[int],
                      constants: Mapping[str, torch.Tensor]) -> tuple[set[int], dict]:
    """The o_proj ids of the attention blocks that split over tp heads, and node id -> the _Heads of its block."""
    outputs = {id(o) for o in g.outputs}
    heads: dict[int, _Heads] = {}
    ops: set[int] = set()
    for o in g.nodes():
        if id(o) in taken or not _projection(o, uses) or not o.inputs[0].shape or \
                not isinstance(o.inputs[0].shape[-1], int) or o.inputs[0].shape[-1] % tp:
            continue
        try:
            block = _Heads(o, uses, tp, constants)
        except _NoSplit:
            continue
        if any(k in heads or k in taken or (k in outputs and block.nodes[k].op != "assign") for k in block.axis):
            continue
        ops.add(id(o))
        for k in block.axis:
            heads[k] = block
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


def shard(g: Graph, mesh: Mesh, constants: Mapping[str, torch.Tensor] | None = None) -> tuple[Graph, Found]:
    """Expert parallel over ``mesh``'s ep axis, dense MLPs, attention heads and the vocabulary over its tp axis;
    Found counts ``shard.expert_parallel``, ``shard.tensor_parallel_mlp``, ``shard.tensor_parallel_attention``,
    ``shard.tensor_parallel_vocab`` (blocks split) and ``shard.replicated_kv_caches`` (caches left whole under
    tp); ``constants``: the folded constants so far (an attention reads its per-head blocks of one), Found's are
    the blocks it made."""
    ep, tp = mesh.size(EP), mesh.size(TP)
    if ep == 1 and tp == 1:
        return g, Found()
    uses = users(g)
    outputs = {id(o) for o in g.outputs}
    mlps = {id(n) for n in g.nodes() if tp > 1 and _dense_mlp(n, uses, outputs) and n.shape and
            n.inputs[0].shape[-1] % tp == 0}
    attention, heads = _attention_blocks(g, uses, tp, mlps, constants or {}) if tp > 1 else (set(), {})
    made: dict[str, torch.Tensor] = {}  # constants of one rank's block (same on every rank)
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
            return heads[id(original)].rewritten(n, original, made)
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
                                       ("shard.tensor_parallel_vocab", vocab_count)) if v}, constants=made)
