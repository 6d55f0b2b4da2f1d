"""Compile every kernel of a program into one library for the target."""

from __future__ import annotations

import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import tvm

from dayzero import InternalError
from .program import Program
from .schedule import schedule_kernel

MAX_COMPILE_THREADS = 4  # measured (tiny DeepSeek-V4, 507 kernels, 2 cores): 1 thread 64.8 s, 2: 32.3 s, 4: 36.1 s


def build_library(programs: list[Program], target: dict, db=None) -> tuple[tvm.runtime.Module, dict]:
    """Schedule each distinct kernel once (programs share kernels by name) and compile them into one module.

    On a CPU target the kernels are compiled as one module per core, in threads (TVM's lowering and LLVM release
    the GIL), and the modules are joined by import: ``export_library`` links them into one kernels.so."""
    t = tvm.target.Target(target)
    funcs = {}
    t0 = time.perf_counter()
    for prog in programs:
        for name, k in prog.kernels.items():
            if name in funcs:
                continue
            mod = schedule_kernel(k, t, db, {s: (lo, hi) for s, lo, hi in prog.symbols})
            funcs[name] = mod["main"].with_attr("global_symbol", name)
    t1 = time.perf_counter()
    parts = 1 if t.kind.name != "llvm" else max(1, min(len(os.sched_getaffinity(0)), MAX_COMPILE_THREADS,
                                                        len(funcs) // 16))
    items = sorted(funcs.items())
    try:
        with ThreadPoolExecutor(parts) as pool:
            libs = list(pool.map(lambda chunk: tvm.compile(tvm.IRModule(dict(chunk)), target=t),
                                 [items[i::parts] for i in range(parts)]))
    except Exception as e:
        raise InternalError(f"TVM failed to compile the kernels: {type(e).__name__}: {str(e)[:500]}") from e
    lib = libs[0]
    for other in libs[1:]:
        lib.mod.import_module(other.mod)
    return lib, {"schedule_s": t1 - t0, "compile_s": time.perf_counter() - t1, "kernels": len(funcs),
                 "compile_threads": parts}


def export_library(lib, path: str | Path) -> None:
    """``lib.export_library(path)``, with each compiled module's machine code emitted in its own thread.

    LLVM's code generation runs when a module is written (``write_to_file``: ~27 s of tiny DeepSeek-V4's compile,
    serial in TVM's export). This does what ``export_library`` does for a tree of LLVM modules (one object per
    module, the import tree packed into ``devc.o``, linked into one shared library) with the objects written in
    parallel. Any other tree (a CUDA device module) goes through TVM's own export."""
    from tvm.runtime import _ffi_api
    from tvm.support import cc

    modules = lib.mod._collect_dso_modules()
    if len(modules) < 2 or any(m.kind != "llvm" for m in modules):
        lib.export_library(str(path))
        return
    with tempfile.TemporaryDirectory(prefix="dayzero-link-") as ws:
        files = [os.path.join(ws, f"lib{i}.o") for i in range(len(modules))]
        with ThreadPoolExecutor(len(modules)) as pool:
            list(pool.map(lambda mf: mf[0].write_to_file(mf[1]), zip(modules, files)))
        target = modules[0].get_function("_get_target_string")()
        devc = os.path.join(ws, "devc.o")
        _ffi_api.ModulePackImportsToLLVM(lib.mod, False, target, "").write_to_file(devc)
        cc.create_shared(str(path), files + [devc])
