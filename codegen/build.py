"""Compile every kernel of a program into one library for the target.

On a CPU (LLVM) target each distinct kernel is compiled to an object file of its own, in threads (TVM's lowering
and LLVM release the GIL), and ``export_library`` links the objects into kernels.so. The objects are kept in the
kernel cache (``cache``: ``<compile cache>/kernels``, the folder of the trace cache), keyed by the sha256 of the
scheduled kernel (TVM's JSON of the PrimFunc, its symbol included), the target and TVM's version: compiling a
model again, or with other options (batch, ranks, a longer context), compiles only the kernels that changed.
An entry is ``<key>.o`` with ``<key>.json`` (format, key, size, sha256); one whose object does not match is
refused with a warning and compiled again. The cache holds machine code that is linked into artifacts: it is the
user's own folder, trusted like the installation (artifacts themselves are checked by ``runtime/validate.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import tvm

from dayzero import InternalError
from .program import Program
from .schedule import schedule_kernel

MAX_COMPILE_THREADS = 4  # measured (tiny DeepSeek-V4, 507 kernels, 2 cores): 1 thread 64.8 s, 2: 32.3 s, 4: 36.1 s
KERNEL_CACHE_FORMAT = "dayzero-kernel-cache/1"


class KernelCacheWarning(UserWarning):
    """An entry of the kernel cache was damaged and is being compiled again."""


@dataclass
class Kernels:
    """What ``build_library`` made: one object file per kernel (LLVM), or a TVM module (any other target)."""

    objects: list[Path] = field(default_factory=list)
    lib: tvm.runtime.Module | None = None
    workspace: tempfile.TemporaryDirectory | None = None  # objects of kernels compiled without a cache

    def close(self) -> None:
        """Remove the workspace's objects now (once linked they are not needed), not when the object is
        collected: a process ended by a signal (``demo --serve`` stopped with Ctrl-C) left them in /tmp."""
        if self.workspace is not None:
            self.workspace.cleanup()
            self.workspace = None


def kernel_key(func, target: tvm.target.Target) -> str:
    """sha256 of a scheduled kernel (its PrimFunc as TVM's JSON), the target and TVM's version."""
    h = hashlib.sha256()
    for part in (KERNEL_CACHE_FORMAT, tvm.__version__, str(target), tvm.ir.save_json(func)):
        h.update(part.encode() + b"\0")
    return h.hexdigest()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _cached_object(cache: Path | None, key: str) -> Path | None:
    """The cached object of ``key``, after its size and sha256 are checked; None when absent or refused."""
    if cache is None:
        return None
    obj, meta = cache / f"{key}.o", cache / f"{key}.json"
    try:
        doc = json.loads(meta.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        warnings.warn(f"kernel cache entry {meta} ignored ({e}); compiling again", KernelCacheWarning, stacklevel=3)
        return None
    try:
        if not isinstance(doc, dict) or doc.get("format") != KERNEL_CACHE_FORMAT or doc.get("key") != key:
            raise ValueError("not an entry for this key")
        if obj.stat().st_size != doc.get("bytes") or _sha256(obj) != doc.get("sha256"):
            raise ValueError("the object's size or sha256 differs from its record")
    except (OSError, ValueError) as e:
        warnings.warn(f"kernel cache entry {obj} ignored ({e}); compiling again", KernelCacheWarning, stacklevel=3)
        return None
    return obj


def _keep(cache: Path, key: str, obj: Path) -> Path:
    """Copy a compiled object into the cache (object first, then its record; each atomic); returns the cached
    path, or ``obj`` when the cache cannot be written."""
    try:
        cache.mkdir(parents=True, exist_ok=True)
        for dst, write in ((cache / f"{key}.o", lambda f: f.write(obj.read_bytes())),
                           (cache / f"{key}.json", lambda f: f.write(json.dumps(
                               {"format": KERNEL_CACHE_FORMAT, "key": key, "bytes": obj.stat().st_size,
                                "sha256": _sha256(obj)}).encode()))):
            fd, tmp = tempfile.mkstemp(dir=cache, prefix=f".{key}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    write(f)
                os.replace(tmp, dst)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
    except OSError as e:  # a read-only or full cache costs the next compile time, nothing else
        warnings.warn(f"kernel cache {cache} not written: {e}", KernelCacheWarning, stacklevel=3)
        return obj
    return cache / f"{key}.o"


def build_library(programs: list[Program], target: dict, db=None, cache: Path | None = None) -> tuple[Kernels, dict]:
    """Schedule each distinct kernel once (programs share kernels by name) and compile it, or take its object
    from the kernel cache (``cache``; None: no cache)."""
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
    stats = {"schedule_s": t1 - t0, "kernels": len(funcs)}
    if t.kind.name != "llvm":
        try:
            lib = tvm.compile(tvm.IRModule(funcs), target=t)
        except Exception as e:
            raise InternalError(f"TVM failed to compile the kernels: {type(e).__name__}: {str(e)[:500]}") from e
        return Kernels(lib=lib), stats | {"compile_s": time.perf_counter() - t1, "compile_threads": 1}
    keys = {name: kernel_key(f, t) for name, f in funcs.items()}
    objects = {name: _cached_object(cache, keys[name]) for name in sorted(funcs)}
    misses = [name for name, obj in objects.items() if obj is None]
    parts = max(1, min(len(os.sched_getaffinity(0)), MAX_COMPILE_THREADS, len(misses)))
    ws = tempfile.TemporaryDirectory(prefix="dayzero-kernels-")

    def compile_one(name: str) -> Path:
        obj = Path(ws.name) / f"{name}.o"
        tvm.compile(tvm.IRModule({name: funcs[name]}), target=t).mod.write_to_file(str(obj))
        return obj if cache is None else _keep(cache, keys[name], obj)
    try:
        with ThreadPoolExecutor(parts) as pool:
            for name, obj in zip(misses, pool.map(compile_one, misses)):
                objects[name] = obj
    except Exception as e:
        ws.cleanup()
        raise InternalError(f"TVM failed to compile the kernels: {type(e).__name__}: {str(e)[:500]}") from e
    return Kernels(objects=list(objects.values()), workspace=ws), stats | {
        "compile_s": time.perf_counter() - t1, "compile_threads": parts, "cached_kernels": len(funcs) - len(misses)}


def export_library(lib, path: str | Path) -> None:
    """``build_library``'s kernels as one shared library at ``path``: the per-kernel objects linked; or, for a TVM
    module (``Kernels.lib``, or a module given directly), ``lib.export_library(path)`` with each compiled module's
    machine code emitted in its own thread.

    For a tree of LLVM modules this does what ``export_library`` does (one object per module, the import tree
    packed into ``devc.o``, linked into one shared library) with the objects written in parallel. Any other tree
    (a CUDA device module) goes through TVM's own export."""
    from tvm.runtime import _ffi_api
    from tvm.support import cc

    if isinstance(lib, Kernels):
        if lib.lib is None:  # one object per kernel: no import tree to pack, the symbols are the kernels
            cc.create_shared(str(path), [str(o) for o in lib.objects])
            return
        lib = lib.lib
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
