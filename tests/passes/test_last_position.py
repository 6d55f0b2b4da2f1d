"""passes/last_position.py: the prefill whose logits are its last real token's (the ``prefill_last`` program).

Spec: the first output, the LM head's ``linear`` over [1, seq, H] rows, reads one row, ``index_select`` at a new
input ``last_index`` (int64 [1]); its type becomes [1, 1, V]; every other output and node is unchanged. A graph
whose first output is not such a linear gets no variant, with the reason.
"""

from __future__ import annotations

import torch

from dayzero.passes.ir.interp import run_graph
from dayzero.passes.last_position import last_position

from .ir_spec import assert_ir, ir

PREFILL = """
graph main symbols(seq in [1, 16]) {
  %0 = input {name="h"} : float32[1, seq, 8]
  %1 = weight {name="norm.weight"} : float32[8]
  %2 = mul.Tensor(%0, %1) : float32[1, seq, 8]
  %3 = weight {name="lm_head.weight"} : float32[12, 8]
  %4 = linear(%2, %3) {bias=false} : float32[1, seq, 12]
  %5 = weight {name="k_proj.weight"} : float32[4, 8]
  %6 = linear(%0, %5) {bias=false} : float32[1, seq, 4]
  return %4, %6
}
"""


def test_the_lm_head_reads_the_last_index_row_only():
    g, why = last_position(ir(PREFILL))
    assert why == ""
    assert_ir(g, """
    graph main symbols(seq in [1, 16]) {
      %0 = input {name="h"} : float32[1, seq, 8]
      %1 = weight {name="norm.weight"} : float32[8]
      %2 = mul.Tensor(%0, %1) : float32[1, seq, 8]
      %3 = input {name="last_index"} : int64[1]
      %4 = index_select(%2, %3) {dim=1} : float32[1, 1, 8]
      %5 = weight {name="lm_head.weight"} : float32[12, 8]
      %6 = linear(%4, %5) {bias=false} : float32[1, 1, 12]
      %7 = weight {name="k_proj.weight"} : float32[4, 8]
      %8 = linear(%0, %7) {bias=false} : float32[1, seq, 4]
      return %6, %8
    }
    """)


def test_its_logits_are_the_full_prefills_row_and_the_other_outputs_unchanged():
    before = ir(PREFILL)
    after, _ = last_position(before)
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(1, 7, 8, generator=gen)
    ws = {n.attr["name"]: torch.randn(*n.shape, generator=gen) for n in before.nodes() if n.op == "weight"}
    full = run_graph(before, {"h": h}, ws.__getitem__)
    for row in (6, 3):  # the last token, and the last real one of a chunk padded on the right
        last = run_graph(after, {"h": h, "last_index": torch.tensor([row])}, ws.__getitem__)
        torch.testing.assert_close(last[0], full[0][:, row:row + 1], rtol=1e-6, atol=1e-6)  # one row: its own sum order
        torch.testing.assert_close(last[1], full[1], rtol=0, atol=0)


def test_no_variant_where_the_first_output_is_not_the_lm_head_over_rows():
    g, why = last_position(ir("""
    graph main symbols(seq in [1, 16]) {
      %0 = input {name="h"} : float32[1, seq, 8]
      %1 = exp(%0) : float32[1, seq, 8]
      return %1
    }
    """))
    assert g is None and "not the LM head" in why
    g, why = last_position(ir("""
    graph main symbols(seq in [1, 16]) {
      %0 = input {name="h"} : float32[1, 5, 8]
      %1 = weight {name="lm_head.weight"} : float32[12, 8]
      %2 = linear(%0, %1) {bias=false} : float32[1, 5, 12]
      return %2
    }
    """))
    assert g is None and "[1, seq, hidden]" in why
