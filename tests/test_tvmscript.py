"""codegen/tvmscript.py: TVMScript kernels parse to the same PrimFunc with the shallow stack walk as with
``inspect``'s own, and ``inspect`` is restored after."""

from __future__ import annotations

import inspect
import sys

import pytest
import tvm

from dayzero.codegen import tvmscript
from dayzero.codegen.kernels import moe as K

SILU_GLU = ("mul", ("silu", ("col", 0, 1, 32)), ("col", 32, 1, 32))


@pytest.mark.parametrize("wfmt", ["dense", "mxfp4"])
def test_moe_kernel_parses_the_same_as_with_the_full_stack_walk(wfmt):
    args = (4, 64, 64, 32, 2)
    kw = dict(layout="nk", act=SILU_GLU, gate_up_bias=False, down_bias=False, wfmt=wfmt)
    raw = K.moe_experts_func.__wrapped__.__wrapped__  # below lru_cache and parsed_shallow: TVM's own inspect
    assert inspect.unwrap(K.moe_experts_func) is raw
    full = raw(*args, **kw)
    with tvmscript.shallow_frames():
        shallow = raw(*args, **kw)
    tvm.ir.assert_structural_equal(full, shallow)


def test_frame_infos_are_the_outer_frames_with_context_for_the_first_three():
    def here():
        return inspect.getouterframes(inspect.currentframe(), 1), tvmscript.frame_infos(inspect.currentframe(), 1)

    full, shallow = here()
    assert [f.frame for f in shallow] == [f.frame for f in full]
    assert [(f.filename, f.lineno, f.function) for f in shallow[:3]] == \
        [(f.filename, f.lineno, f.function) for f in full[:3]]
    assert [f.code_context for f in shallow[:3]] == [f.code_context for f in full[:3]]
    assert all(f.code_context is None for f in shallow[3:])


def test_shallow_frames_restores_inspect_after_an_error():
    stack, outer = inspect.stack, inspect.getouterframes
    with pytest.raises(RuntimeError), tvmscript.shallow_frames():
        assert inspect.stack is not stack and inspect.getouterframes is not outer
        assert inspect.stack()[0].frame is sys._getframe()
        raise RuntimeError("x")
    assert (inspect.stack, inspect.getouterframes) == (stack, outer)


def test_from_source_parses_each_text_once():
    src = ('@T.prim_func\ndef main(a_: T.handle, b_: T.handle):\n'
           '    a = T.match_buffer(a_, (T.int64(8),), "float32")\n'
           '    b = T.match_buffer(b_, (T.int64(8),), "float32")\n'
           '    for i in range(T.int64(8)):\n'
           '        b[i] = a[i] * T.float32(2)\n')
    f = tvmscript.from_source(src)
    assert tvmscript.from_source(src) is f
    tvm.ir.assert_structural_equal(f, tvm.script.from_source(src))
