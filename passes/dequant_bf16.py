"""dequant_bf16: a checkpoint's bf16 projection or embedding table read through its exact fp32 upcast -> a node
that reads the bf16 weight as stored.

The frontend binds a parameter the checkpoint stores in bfloat16 and the trace reads only as a linear's weight or
an embedding's table as ``_to_copy(weight bfloat16, float32)`` (``frontend/lowprec.bind_bf16``; exact: every bf16
value is an fp32 value). Rewrites (x [.., K] fp32; T = the product of x's leading dims, symbolic or not)::

    linear(x, _to_copy(W bf16 [N, K]), [b])
        ==>  view [.., N] ( dequant_linear_bf16(view [T, K] (x), W) ) [+ b]
    embedding(_to_copy(W bf16 [V, H]), ids)
        ==>  _to_copy(embedding(W, ids))          (the rows gathered as stored, then converted: never the whole table)
    bmm(x [G, M, K], permute(view(_to_copy(W bf16 [G N, K]), [G, N, K]), [0, 2, 1]))
        ==>  permute(view(dequant_linear_bf16(view [M, G K] (permute(x, [1, 0, 2])), W, groups=G), [M, G, N]),
                     [1, 0, 2])         (a grouped projection, DeepSeek-V4's o_a_proj: head group g through rows g N..)

The kernels (``codegen/kernels/dequant_linear.py`` ``fmt="bf16"``: decode GEMV for a static T <= 64, prefill GEMM
for a symbolic T) convert each element as they read it and accumulate in fp32, so the weight stays resident at 2
bytes an element; the grouped projection read the weight through a per-step fp32 permute copy (4 x 134 MB a decode
step at V4-Flash's widths). Counts ``dequant_bf16.linear``, ``dequant_bf16.embedding`` and ``dequant_bf16.grouped``.

Ordering: after ``shard`` (passes/shard.py), which splits the binding as it splits any weight (each rank's slice of
the bf16 tensor, still under its ``_to_copy``), so every rank's slice stays bf16 as stored; before ``fuse``.
"""

from __future__ import annotations

import math

from dayzero.passes.ir.node import Node, TensorType, view_node
from dayzero.passes.ir.pattern import Match, P, Rule, need
from dayzero.passes.pipeline import pattern_pass

OP = "dequant_linear_bf16"

# float(W), W a bfloat16 matrix (or table)
_BF16 = P("_to_copy", P(name="stored", dtype="bfloat16", ndim=2), attrs={"dtype": "float32"})


def match_bf16(w: Node) -> Node | None:
    """W fp32 [N, K] -> the bfloat16 [N, K] it is an exact upcast of, else None."""
    m = Match()
    return m.stored if _BF16.match(w, m) else None


def _fused_linear(n: Node, m: Match) -> Node:
    """linear(x, float(W bf16 [N, K]), [b]) -> view(dequant_linear_bf16(view(x), W)) [+ b]."""
    x, w = n.inputs[:2]
    bias = n.inputs[2] if n.attr.get("bias") and len(n.inputs) == 3 else None
    N, K = w.shape
    need(isinstance(N, int) and isinstance(K, int) and x.shape[-1] == K)
    lead = tuple(x.shape[:-1])
    T = math.prod(lead) if lead else 1
    y = Node.make(OP, [view_node(x, (T, K), n.span), m.stored], {"N": N, "K": K}, [TensorType("float32", (T, N))],
                  n.span)
    y = view_node(y, (*lead, N), n.span)
    if bias is not None:
        y = Node.make("add.Tensor", (y, bias), {"alpha": 1}, [TensorType("float32", n.shape)], n.span)
    return y


def _embedding_rows(n: Node, m: Match) -> Node:
    """embedding(float(W bf16), ids) -> float(embedding(W, ids)): only the rows read are converted."""
    rows = n.replace(inputs=(m.stored, *n.inputs[1:]), types=(TensorType("bfloat16", n.shape),))
    return Node.make("_to_copy", (rows,), {"dtype": "float32"}, [n.type], n.span)


def _permute(x: Node, dims: tuple[int, ...], span) -> Node:
    return Node.make("permute", (x,), {"dims": dims}, [TensorType(x.dtype, tuple(x.shape[d] for d in dims))], span)


def _grouped_linear(n: Node, m: Match) -> Node:
    """bmm(x [G, M, K], float(W bf16 [G N, K]) viewed [G, N, K] and transposed) -> one grouped dequant_linear_bf16
    over x's groups side by side (module docstring)."""
    x, W = m.x, m.stored
    G, N, K = m.grouped.shape
    need(all(isinstance(d, int) for d in (G, N, K)) and tuple(W.shape) == (G * N, K) and G > 1)
    need(x.shape[0] == G and x.shape[2] == K)
    M = x.shape[1]
    # x is usually the tokens' groups transposed to lead ([M, G, K] -> [G, M, K]): read them in place
    lead = x.inputs[0] if x.op == "permute" and tuple(x.attr["dims"]) == (1, 0, 2) else _permute(x, (1, 0, 2), n.span)
    rows = view_node(lead, (M, G * K), n.span)
    y = Node.make(OP, [rows, W], {"N": G * N, "K": K, "groups": G}, [TensorType("float32", (M, G * N))], n.span)
    return _permute(view_node(y, (M, G, N), n.span), (1, 0, 2), n.span)


_FP32 = {"dtype": "float32"}
_GROUPED_W = P("permute", P("view", _BF16, name="grouped", ndim=3), attrs={"dims": lambda d: tuple(d) == (0, 2, 1)})
dequant_bf16 = pattern_pass("dequant_bf16", (
    Rule("dequant_bf16.linear", P("linear", P(where=lambda n, m: len(n.shape) >= 1, **_FP32), _BF16, rest=True,
                                  **_FP32), _fused_linear),
    Rule("dequant_bf16.embedding", P("embedding", _BF16, rest=True, **_FP32), _embedding_rows),
    Rule("dequant_bf16.grouped", P("bmm", P(name="x", ndim=3, **_FP32), _GROUPED_W, **_FP32), _grouped_linear),
))
