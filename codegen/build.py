"""Compile every kernel of a program into one library for the target."""

from __future__ import annotations

import time

import tvm

from dayzero import InternalError
from .program import Program
from .schedule import schedule_kernel


def build_library(programs: list[Program], target: dict, db=None) -> tuple[tvm.runtime.Module, dict]:
    """Schedule each distinct kernel once (programs share kernels by name) and compile them into one module."""
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
    try:
        lib = tvm.compile(tvm.IRModule(funcs), target=t)
    except Exception as e:
        raise InternalError(f"TVM failed to compile the kernels: {type(e).__name__}: {str(e)[:500]}") from e
    return lib, {"schedule_s": t1 - t0, "compile_s": time.perf_counter() - t1, "kernels": len(funcs)}
