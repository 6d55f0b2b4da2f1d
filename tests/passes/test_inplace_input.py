"""inplace_input: a scatter into a clone of a program input nothing else reads writes into the input's own buffer
(``scatter_inplace``, passes/inplace_input.py); a clone or an input with another reader keeps the copy. The kernel
equals torch's ``scatter_`` and writes nothing for an index outside the dim."""

import numpy as np
import pytest
import torch

from dayzero.passes.inplace_input import inplace_input
from dayzero.passes.ir import ops

from .ir_spec import assert_ir, ir

HEAD = """
graph main symbols(batch in [1, 4]) {
  %0 = input {name="entries"} : float32[batch, 9, 8]
  %1 = input {name="rows"} : int64[batch, 1, 8]
  %2 = input {name="new"} : float32[batch, 1, 8]
"""


def test_a_scatter_into_a_cloned_input_writes_into_the_input():
    before = HEAD + """
      %3 = clone(%0) : float32[batch, 9, 8]
      %4 = scatter.src(%3, %1, %2) {dim=1} : float32[batch, 9, 8]
      %5 = unsqueeze(%4) {dim=1} : float32[batch, 1, 9, 8]
      return %5, %4
    }
    """
    after, found = inplace_input(ir(before, shapes=False))
    assert found.patterns == {"inplace_input_scatter": 1}
    assert_ir(after, HEAD + """
      %3 = scatter_inplace(%0, %1, %2) {dim=1} : float32[batch, 9, 8]
      %4 = unsqueeze(%3) {dim=1} : float32[batch, 1, 9, 8]
      return %4, %3
    }
    """, shapes=False)


@pytest.mark.parametrize("reader", ["%0", "%3"])
def test_a_copy_whose_source_is_read_again_stays(reader):
    before = HEAD + f"""
      %3 = clone(%0) : float32[batch, 9, 8]
      %4 = scatter.src(%3, %1, %2) {{dim=1}} : float32[batch, 9, 8]
      %5 = mul.Tensor(%4, {reader}) : float32[batch, 9, 8]
      return %5, %4
    }}
    """
    after, found = inplace_input(ir(before, shapes=False))
    assert found.patterns == {}
    assert_ir(after, before, shapes=False)


def test_the_kernel_is_torchs_scatter_and_skips_rows_outside_the_dim():
    import tvm

    from dayzero.codegen.kernels.table import KERNELS

    g = ir(HEAD + """
      %3 = scatter_inplace(%0, %1, %2) {dim=1} : float32[batch, 9, 8]
      return %3
    }
    """, shapes=False)
    node = g.outputs[0]
    x = torch.randn(3, 9, 8)
    rows = torch.tensor([0, 8, 4]).view(3, 1, 1).expand(3, 1, 8).contiguous()
    new = torch.randn(3, 1, 8)
    want = ops.REGISTRY["scatter_inplace"].reference([x.clone(), rows, new], {"dim": 1})
    run = tvm.compile(tvm.IRModule({"main": KERNELS["scatter_inplace"].compute(node)}), target="llvm")["main"]
    got = x.clone()
    run(got, rows, new)
    np.testing.assert_array_equal(got.numpy(), want.numpy())
    bad = rows.clone()
    bad[1] = 9  # past the last row: nothing written for batch row 1
    got = x.clone()
    run(got, bad, new)
    assert torch.equal(got[1], x[1]) and torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
