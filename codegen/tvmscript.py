"""Parsing dayzero's TVMScript kernels without TVM's full stack walks.

TVM's parser walks the Python stack with ``inspect``: every ``@T.prim_func`` calls ``inspect.stack()`` and every
``T.macro`` call ``inspect.getouterframes``. Both read the source context of every frame and, for a frame whose
file is not on disk (``<frozen runpy>``, an importlib frame, ``<string>``), ``inspect.getmodule`` scans all of
``sys.modules`` (thousands of modules once torch and transformers are imported). The parser reads only the first
three frames' context (``utils.is_defined_in_class`` looks for a class or decorator line there) and the frames
themselves (their globals and locals: ``resolve_closure_vars``, ``_find_parser_def``). ``shallow_frames`` gives
those three their full ``FrameInfo`` where their file is on disk and every other frame its ``FrameInfo`` without
source context, so the same functions parse: tiny Qwen3-MoE's two MoE kernels took 2.4 s of a cold compile."""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
from contextlib import contextmanager
from types import FrameType

_lock = threading.RLock()  # inspect's functions are swapped process-wide: one parse at a time, nesting allowed


def frame_infos(frame: FrameType | None, context: int = 1) -> list[inspect.FrameInfo]:
    """``inspect.getouterframes(frame, context)``, with source context for the first three frames only (and
    only where their file is on disk)."""
    frames = []
    while frame is not None:
        if len(frames) < 3 and os.path.isfile(frame.f_code.co_filename):
            info = inspect.getframeinfo(frame, context)
            frames.append(inspect.FrameInfo(frame, *info, positions=info.positions))
        else:
            code = frame.f_code
            frames.append(inspect.FrameInfo(frame, code.co_filename, frame.f_lineno, code.co_name, None, None))
        frame = frame.f_back
    return frames


def _stack(context: int = 1) -> list[inspect.FrameInfo]:
    return frame_infos(sys._getframe(1), context)


@contextmanager
def shallow_frames():
    """Within: ``inspect.stack`` and ``inspect.getouterframes`` are ``frame_infos``'s (see the module's doc)."""
    with _lock:
        saved = inspect.stack, inspect.getouterframes
        inspect.stack, inspect.getouterframes = _stack, frame_infos
        try:
            yield
        finally:
            inspect.stack, inspect.getouterframes = saved


def parsed_shallow(fn):
    """``fn`` (which parses TVMScript) run within ``shallow_frames``."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with shallow_frames():
            return fn(*args, **kwargs)
    return run


@functools.lru_cache(maxsize=256)
def from_source(src: str):
    """``tvm.script.from_source(src)``, parsed once per text: the kernels written as TVMScript text (attention,
    indexer, state, compressed attention) are asked for again when scheduled for the target and by every program
    that shares the shape (tiny DeepSeek-V3.2: 21 parses of 15 texts, 1.5 of their 3.2 CPU seconds). A PrimFunc is
    immutable: one shared object serves every caller."""
    import tvm.script

    return tvm.script.from_source(src)


def prefetch_l2(element):
    """The TVMScript statement that prefetches (to L2, for reading) the cache line of ``element``, a buffer load
    (the MoE tiles' and the bf16 GEMV's weight streams)."""
    from tvm.script import tirx as T

    return T.evaluate(T.call_intrin("void", "tirx.prefetch", T.address_of(element), 0, 2, 1))
