"""token_positions: every token at its own position (the batched decode program: one token per request).

A cache-filling prefill knows its positions are contiguous, so transformers derives the rows it writes and the
positions its masks compare with from the first one (``StaticLayer.update``: ``arange(seq) + cumulative_length``;
the model's ``cache_position = arange(seq) + past_seen_tokens``; both are ``cache_position[0]`` here, see
frontend/decode_export.py)::

    %p = input "cache_position" int[S]                %p = input "cache_position" int[S]
    %a = arange(0, S)                          ==>    (%p itself: token s is at position %p[s])
    %x = add(%a, clone*(select(%p, dim 0, index 0)))

For contiguous positions the two are equal, so the rewrite keeps the prefill exact; it makes the graph valid for
any per-token positions, which is what the batched decode step needs: its S tokens are S requests' next tokens,
one each (``decode_batch``, tools/compiler.py), each with its own position and block table (paged_kv with
``per_token``). Runs only under ``per_token``. A graph that still reads ``%p[0]`` after it (some
other use of the first position) is not per-token: ``first_position_reads`` lists those nodes.
"""

from __future__ import annotations

from dayzero.passes.ir.node import Graph, Node, rewrite
from dayzero.passes.pipeline import Found, counted


def _first_of(x: Node) -> Node | None:
    """clone*(select(%p, 0, 0)) of a 1-D int graph input %p -> %p."""
    while x.op in ("clone", "alias") and x.inputs:
        x = x.inputs[0]
    if x.op != "select.int" or x.attr.get("dim") != 0 or x.attr.get("index") != 0:
        return None
    p = x.inputs[0]
    if p.op != "input" or p.type.ndim != 1 or not p.dtype.startswith("int"):
        return None
    return p


def _is_arange_of(a: Node, length) -> bool:
    return (a.op in ("arange.start_step", "arange.start", "arange") and (a.attr.get("start") or 0) == 0
            and (a.attr.get("step") or 1) == 1 and str(a.attr.get("end")) == str(length))


def token_positions(g: Graph, per_token: bool) -> tuple[Graph, Found]:
    """Under ``per_token`` (the batched decode program), each token's positions instead of the first's + arange;
    counts ``token_positions``."""
    if not per_token:
        return g, Found()
    count = 0

    def fn(n: Node) -> Node | None:
        nonlocal count
        if n.op != "add.Tensor" or n.attr.get("alpha", 1) != 1 or len(n.inputs) != 2:
            return None
        for a, x in (n.inputs, n.inputs[::-1]):
            p = _first_of(x)
            if p is not None and _is_arange_of(a, p.shape[0]) and p.dtype == n.dtype \
                    and tuple(n.shape) == tuple(p.shape):
                count += 1
                return p
        return None

    g = rewrite(g, fn)
    return g, counted("token_positions", count)


def first_position_reads(g: Graph) -> list[Node]:
    """Nodes that still read the first position of a positions input (the graph is not per-token)."""
    return [n for n in g.nodes() if _first_of(n) is not None]
