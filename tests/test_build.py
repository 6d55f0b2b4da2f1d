"""codegen/build.py: kernels compiled as several modules in threads, joined by import, written as one library
whose objects are emitted in parallel: the same bytes as TVM's own export, every kernel callable."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import te

from dayzero.codegen.build import export_library


def _scale(name: str, k: float):
    a = te.placeholder((16,), name="A")
    b = te.compute((16,), lambda i: a[i] * k, name="B")
    return te.create_prim_func([a, b]).with_attr("global_symbol", name)


def test_joined_modules_export_as_tvm_does_and_every_kernel_runs(tmp_path):
    target = tvm.target.Target("llvm")
    libs = [tvm.compile(tvm.IRModule({f"k{j}_{i}": _scale(f"k{j}_{i}", 1.0 + j + 3 * i) for j in range(3)}),
                        target=target) for i in range(3)]
    for other in libs[1:]:
        libs[0].mod.import_module(other.mod)
    libs[0].export_library(str(tmp_path / "tvm.so"))
    export_library(libs[0], tmp_path / "ours.so")
    assert (tmp_path / "ours.so").read_bytes() == (tmp_path / "tvm.so").read_bytes()
    m = tvm.runtime.load_module(str(tmp_path / "ours.so"))
    x = tvm.runtime.tensor(np.arange(16, dtype="float32"))
    for i in range(3):
        for j in range(3):
            y = tvm.runtime.tensor(np.zeros(16, "float32"))
            m[f"k{j}_{i}"](x, y)
            np.testing.assert_array_equal(y.numpy(), np.arange(16, dtype="float32") * (1.0 + j + 3 * i))


def test_a_single_module_goes_through_tvms_export(tmp_path):
    lib = tvm.compile(tvm.IRModule({"one": _scale("one", 2.0)}), target=tvm.target.Target("llvm"))
    export_library(lib, tmp_path / "one.so")
    y = tvm.runtime.tensor(np.zeros(16, "float32"))
    tvm.runtime.load_module(str(tmp_path / "one.so"))["one"](tvm.runtime.tensor(np.ones(16, "float32")), y)
    assert (y.numpy() == 2.0).all()
