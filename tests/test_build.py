"""codegen/build.py: kernels compiled as several modules in threads, joined by import, written as one library
whose objects are emitted in parallel: the same bytes as TVM's own export, every kernel callable; on a CPU target
each kernel its own object, kept in the kernel cache and linked again without compiling."""

from __future__ import annotations

import types

import numpy as np
import pytest
import tvm
from tvm import te

from dayzero.codegen import build
from dayzero.codegen.build import KernelCacheWarning, build_library, export_library


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


def _programs(*kernels):
    """Stand-in programs whose kernel k scales by k (``schedule_kernel`` is replaced by ``_scheduled``)."""
    return [types.SimpleNamespace(kernels=dict(ks), symbols=()) for ks in kernels]


def _scheduled(k, target, db, symbols):
    return tvm.IRModule({"main": _scale("main", k)})


def _runs(path, scales):
    m = tvm.runtime.load_module(str(path))
    x = tvm.runtime.tensor(np.arange(16, dtype="float32"))
    for name, k in scales.items():
        y = tvm.runtime.tensor(np.zeros(16, "float32"))
        m[name](x, y)
        np.testing.assert_array_equal(y.numpy(), np.arange(16, dtype="float32") * k)


def test_the_kernel_cache_compiles_each_kernel_once(tmp_path, monkeypatch):
    """Programs sharing a kernel compile it once; a second build takes every object from the cache and links the
    same library byte for byte; a kernel whose body changed is the only one compiled again."""
    monkeypatch.setattr(build, "schedule_kernel", _scheduled)
    progs = _programs({"a": 1.0, "b": 2.0}, {"b": 2.0, "c": 3.0})
    cache = tmp_path / "kernels"
    cold, s1 = build_library(progs, {"kind": "llvm"}, cache=cache)
    export_library(cold, tmp_path / "cold.so")
    assert (s1["kernels"], s1["cached_kernels"]) == (3, 0) and len(list(cache.glob("*.o"))) == 3
    warm, s2 = build_library(progs, {"kind": "llvm"}, cache=cache)
    export_library(warm, tmp_path / "warm.so")
    assert s2["cached_kernels"] == 3 and (tmp_path / "warm.so").read_bytes() == (tmp_path / "cold.so").read_bytes()
    _runs(tmp_path / "warm.so", {"a": 1.0, "b": 2.0, "c": 3.0})
    changed, s3 = build_library(_programs({"a": 1.0, "b": 2.0}, {"c": 5.0}), {"kind": "llvm"}, cache=cache)
    export_library(changed, tmp_path / "changed.so")
    assert s3["cached_kernels"] == 2
    _runs(tmp_path / "changed.so", {"a": 1.0, "b": 2.0, "c": 5.0})
    nocache, s4 = build_library(progs, {"kind": "llvm"}, cache=None)
    export_library(nocache, tmp_path / "nocache.so")
    assert s4["cached_kernels"] == 0 and (tmp_path / "nocache.so").read_bytes() == (tmp_path / "cold.so").read_bytes()


@pytest.mark.parametrize("damage", ["object-bytes", "object-truncated", "record-json", "record-key", "no-object"])
def test_a_damaged_kernel_cache_entry_is_compiled_again(tmp_path, monkeypatch, damage):
    """An object whose size or sha256 is not its record's, or a record that does not parse or is for another
    key, is refused with a warning and the kernel compiled again (and the entry rewritten)."""
    monkeypatch.setattr(build, "schedule_kernel", _scheduled)
    progs, cache = _programs({"a": 1.0}), tmp_path / "kernels"
    export_library(build_library(progs, {"kind": "llvm"}, cache=cache)[0], tmp_path / "cold.so")
    (obj,), (record,) = cache.glob("*.o"), cache.glob("*.json")
    if damage == "object-bytes":
        data = bytearray(obj.read_bytes())
        data[len(data) // 2] ^= 0xFF
        obj.write_bytes(bytes(data))
    elif damage == "object-truncated":
        obj.write_bytes(obj.read_bytes()[:100])
    elif damage == "record-json":
        record.write_text("{not json")
    elif damage == "record-key":
        record.write_text(record.read_text().replace(record.stem, "0" * 64))
    else:
        obj.unlink()
    with pytest.warns(KernelCacheWarning, match="ignored"):
        again, stats = build_library(progs, {"kind": "llvm"}, cache=cache)
    assert stats["cached_kernels"] == 0
    export_library(again, tmp_path / "again.so")
    assert (tmp_path / "again.so").read_bytes() == (tmp_path / "cold.so").read_bytes()
    assert build_library(progs, {"kind": "llvm"}, cache=cache)[1]["cached_kernels"] == 1  # rewritten


def _chain(*ops: str):
    """A graph x -> op -> op ... of element-wise ops on [5, 16] fp32, as the frontend writes them."""
    from dayzero.passes.ir.node import Graph, Node, TensorType

    t = TensorType("float32", (5, 16))
    x = Node.make("input", (), {"name": "x"}, [t])
    y = x
    for op in ops:
        y = Node.make(op, (y,), {}, [t])
    return Graph("prefill", (x,), (y,))


def test_a_kernel_is_named_after_what_it_computes_not_where_it_comes():
    """A kernel's name (its symbol, part of its kernel-cache key) comes from its op and types alone: a compile of
    the same model with one more kernel in front (a sharded or otherwise varied compile) names every other kernel
    as before, so the cache hands them back; distinct kernels are named apart, equal ones share one name."""
    from dayzero.codegen.program import build_program

    a = build_program(_chain("relu", "neg", "exp"))
    b = build_program(_chain("sigmoid", "relu", "neg", "exp"))
    names = lambda p: {k.op: name for name, k in p.kernels.items()}  # noqa: E731
    assert len(a.kernels) == 3 and len(b.kernels) == 4
    assert {op: names(b)[op] for op in names(a)} == names(a)
    assert len(set(names(b).values())) == 4
    assert len(build_program(_chain("relu", "relu", "relu")).kernels) == 1


@pytest.mark.slow
def test_a_compile_leaves_no_kernel_objects_behind(tmp_path, monkeypatch):
    """The objects of kernels compiled without a cache go with the compile that linked them, not when the
    garbage collector gets to them: a checkpoint's compile keeps them in a reference cycle, and a caller ended by
    a signal before a collection (``demo --serve``) left one folder of objects in the temporary directory per run."""
    import gc
    import tempfile

    from dayzero.tools.driver import compile_model
    from dayzero.tools.make_tiny import make_tiny

    ckpt = make_tiny("qwen3_moe", tmp_path / "ckpt", seed=0)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    gc.disable()  # whether the cycle still holds the folder must not depend on when gc runs
    try:
        compile_model(str(ckpt), tmp_path / "art", max_seq=16, trace_cache="off")
        assert (tmp_path / "art" / "kernels.so").is_file()
        assert not list(tmp.glob("dayzero-kernels-*"))
    finally:
        gc.enable()


def _bf16_linear(max_seq: int):
    """x [seq, 64] -> dequant_linear_bf16 (48 x 64) -> relu, with seq in [1, max_seq]."""
    from dayzero.passes.ir.node import Graph, Node, TensorType
    from dayzero.passes.ir.text import make_symbol

    seq = make_symbol("seq")
    x = Node.make("input", (), {"name": "x"}, [TensorType("float32", (seq, 64))])
    w = Node.make("weight", (), {"name": "w"}, [TensorType("bfloat16", (48, 64))])
    y = Node.make("dequant_linear_bf16", (x, w), {"N": 48, "K": 64}, [TensorType("float32", (seq, 48))])
    return Graph("prefill", (x,), (Node.make("relu", (y,), {}, [TensorType("float32", (seq, 48))]),),
                 (("seq", 1, max_seq),))


def test_a_kernel_whose_schedule_reads_symbol_bounds_is_not_shared_across_different_bounds():
    """dequant_linear's tile depends on the program's bound on T (a batched decode step of at most 8 requests
    takes 8-lane vectors, a prefill of up to 512 tokens both tiles): two programs with other bounds get a kernel
    each (they shared the first one's, and gpt-oss's batched decode ran the prefill chunk's tile); a kernel whose
    schedule does not read them (relu) is still shared, and equal bounds share."""
    from dayzero.codegen.program import build_program

    shared = {}
    rows = build_program(_bf16_linear(8), "decode_batch", shared)
    chunk = build_program(_bf16_linear(512), "prefill", shared)
    again = build_program(_bf16_linear(8), "decode_batch_again", shared)
    lin = [{k for k in p.kernels if k.startswith("dequant_linear")} for p in (rows, chunk, again)]
    relu = [{k for k in p.kernels if k.startswith("relu")} for p in (rows, chunk, again)]
    assert len(lin[0]) == len(lin[1]) == 1 and lin[0] != lin[1] and lin[2] == lin[0]
    assert relu[0] == relu[1] == relu[2] and len(relu[0]) == 1
