"""The prefill whose logits are one position's: the compiler's ``prefill_last`` program.

Generation and serving read the logits of a prompt's last token only, yet the prefill program computes the LM head
at every position: for gpt-oss (a 201,088 x 2880 head) a 4K-token prompt spends 4.7 TFLOP on rows nobody reads,
more than its two first layers. This variant of the traced prefill takes one more input, ``last_index`` (int64 [1]:
the row of a chunk's last real token; the runtime pads chunks on the right) and selects that row of the LM head's
input before the head::

    %h  = ... : float32[1, seq, H]                 %h  = ... : float32[1, seq, H]
    %lg = linear(%h, %w) : float32[1, seq, V]  ->  %i  = input {name="last_index"} : int64[1]
                                                    %r  = index_select(%h, %i) {dim=1} : float32[1, 1, H]
                                                    %lg = linear(%r, %w) : float32[1, 1, V]

The head is matched on graph shape: the program's first output is a ``linear`` over [1, seq, H] rows (every
causal LM of transformers traces so). Everything else (the KV-cache writes, the other outputs) is unchanged.
"""

from __future__ import annotations

from dayzero.passes.ir.node import Graph, Node, TensorType

LAST_INDEX = "last_index"
LAST_PROGRAM = "prefill_last"


def last_position(g: Graph) -> tuple[Graph | None, str]:
    """(the prefill graph with one position's logits, "") or (None, why) when its first output is not the LM head
    over the sequence's rows."""
    head = g.outputs[0] if g.outputs else None
    if head is None or head.op != "linear":
        return None, f"the first output is {head.op if head is not None else 'missing'}, not the LM head's linear"
    rows = head.inputs[0]
    shape = rows.type.shape
    if len(shape) != 3 or shape[0] != 1 or isinstance(shape[1], int):
        return None, f"the LM head reads {list(shape)}, not [1, seq, hidden] rows"
    index = Node.make("input", (), {"name": LAST_INDEX}, [TensorType("int64", (1,))])
    row = Node.make("index_select", [rows, index], {"dim": 1}, [TensorType(rows.dtype, (1, 1, shape[2]))],
                    span=head.span)
    (out,) = head.types
    logits = head.replace(inputs=(row, *head.inputs[1:]),
                          types=(TensorType(out.dtype, (1, 1, *out.shape[2:])),))
    return g.replace(inputs=(*g.inputs, index), outputs=(logits, *g.outputs[1:])), ""
