"""Tuning-record traces are untrusted input: ``check_trace`` validates one before it is replayed.

A trace (MetaSchedule's ``Trace.as_json``) is ``[instructions, decisions]``:

    instruction = [kind, inputs, attrs, outputs]     ["Split", ["l2", "v5", "v6"], [true, false], ["l9", "l10"]]
    decision    = [instruction index, value]         [4, [1, 1, 16, 2]]

Replaying runs every instruction on a schedule, and some would plant native code in kernels.so: an ``Annotate``
with ``pragma_import_llvm`` / ``pragma_import_c`` links the annotation's text as LLVM IR / C into the module, and
``TransformLayout`` & co. load objects from their inputs. So a trace is accepted only when:

* every instruction kind is one of the schedule primitives MetaSchedule's default CPU (llvm) and GPU (cuda) design
  spaces and postprocessors emit (``INSTRUCTIONS``: measured by generating the design spaces of matmul, bmm,
  softmax, row-sum and elementwise kernels on both targets and applying the postprocessors);
* every ``Annotate`` / ``Unannotate`` key is in ``ANNOTATIONS``, and an annotation's value is of its key's plain
  type (an int, a list of ints, a sampled variable, or for ``meta_schedule.tiling_structure`` a string of S/R);
* inputs are variables defined by an earlier instruction, numbers, ``None`` or lists of those; attrs are numbers,
  booleans, lists, and strings only where the kind takes a name (block / function names, storage scopes, thread
  axes); outputs are fresh variable names; decisions point at sampling instructions and hold ints;
* sizes are bounded (instructions, nesting, integers, unroll steps).

Anything else raises ``TraceRefused`` (a ``UserError``) naming the instruction or annotation.
"""

from __future__ import annotations

import math
import re

from dayzero import UserError

INSTRUCTIONS = frozenset({
    # sampling
    "SampleCategorical", "SamplePerfectTile", "SampleComputeLocation",
    # getters
    "GetSBlock", "GetLoops", "GetChildBlocks", "GetProducers", "GetConsumers",
    # loop transformations
    "Split", "Fuse", "Reorder", "Parallel", "Vectorize", "Unroll", "Bind",
    # caches, compute location, reductions
    "CacheRead", "CacheWrite", "SetScope", "ComputeAt", "ReverseComputeAt", "ComputeInline", "ReverseComputeInline",
    "DecomposeReduction", "RFactor",
    # annotations (keys checked below) and the postprocessing marker
    "Annotate", "Unannotate", "EnterPostproc",
})
SAMPLING = frozenset({"SampleCategorical", "SamplePerfectTile", "SampleComputeLocation"})

MAX_UNROLL = 4096
MAX_INT = 2**31 - 1


def _count(v, rv: bool = False, hi: int = MAX_INT) -> bool:
    return (rv and isinstance(v, str) and _RV.match(v) is not None) or (
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= hi)


def _int_list(v) -> bool:
    return isinstance(v, list) and len(v) <= 64 and all(_count(x, hi=64) for x in v)


# annotation key -> does this value fit (ints, sampled variables "v12", the S/R tiling string)
ANNOTATIONS = {
    "meta_schedule.tiling_structure": lambda v: isinstance(v, str) and re.fullmatch(r'"[SR]{1,16}"', v) is not None,
    "meta_schedule.parallel": lambda v: _count(v),
    "meta_schedule.vectorize": lambda v: _count(v),
    "meta_schedule.unroll_explicit": lambda v: _count(v, rv=True, hi=MAX_UNROLL),
    "meta_schedule.unroll_implicit": lambda v: _count(v, rv=True, hi=MAX_UNROLL),
    "meta_schedule.cooperative_fetch": lambda v: _count(v, rv=True),
    "meta_schedule.random_compute_producer": lambda v: _count(v),
    "meta_schedule.thread_extent_low_inclusive": lambda v: _count(v),
    "meta_schedule.thread_extent_high_inclusive": lambda v: _count(v),
    "pragma_auto_unroll_max_step": lambda v: _count(v, hi=MAX_UNROLL),
    "pragma_unroll_explicit": lambda v: _count(v, hi=1),
    "software_pipeline_stage": _int_list,
    "software_pipeline_order": _int_list,
    "software_pipeline_async_stages": _int_list,
}
# strings an attr may hold outside GetSBlock (block and function names) and Annotate (the key)
STRING_ATTRS = frozenset({"global", "shared", "shared.dyn", "local", "warp", "vthread",
                          *(f"{a}.{x}" for a in ("blockIdx", "threadIdx", "vthread") for x in "xyz")})

MAX_INSTRUCTIONS = 20000
MAX_DEPTH = 4
_RV = re.compile(r"[blv]\d{1,7}\Z")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]{0,127}\Z")


class TraceRefused(UserError):
    """A tuning trace holds something outside the allowlist; the record must not be replayed."""


def _short(v) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _plain(v, where: str, strings, depth: int = 0) -> None:
    """Numbers, booleans, None, lists of those; strings only if ``strings(s)`` allows them."""
    if depth > MAX_DEPTH:
        raise TraceRefused(f"{where}: nested deeper than {MAX_DEPTH}")
    if v is None or isinstance(v, bool):
        return
    if isinstance(v, int):
        if abs(v) > 2**63:
            raise TraceRefused(f"{where}: integer {_short(v)} out of range")
        return
    if isinstance(v, float):
        if not math.isfinite(v):
            raise TraceRefused(f"{where}: non-finite number")
        return
    if isinstance(v, list):
        for x in v:
            _plain(x, where, strings, depth + 1)
        return
    if isinstance(v, str) and strings(v):
        return
    raise TraceRefused(f"{where}: value {_short(v)} is not allowed")


def check_trace(trace) -> None:
    """Raise ``TraceRefused`` unless ``trace`` (``[instructions, decisions]``) passes the allowlist above."""
    if not (isinstance(trace, list) and len(trace) == 2 and isinstance(trace[0], list)
            and isinstance(trace[1], list)):
        raise TraceRefused("trace is not [instructions, decisions]")
    insts, decisions = trace
    if len(insts) > MAX_INSTRUCTIONS:
        raise TraceRefused(f"trace has more than {MAX_INSTRUCTIONS} instructions")
    defined: set[str] = set()
    for k, inst in enumerate(insts):
        if not (isinstance(inst, list) and len(inst) == 4 and isinstance(inst[0], str)
                and all(isinstance(x, list) for x in inst[1:])):
            raise TraceRefused(f"instruction {k} is not [kind, inputs, attrs, outputs]")
        kind, inputs, attrs, outputs = inst
        where = f"instruction {k} ({_short(kind)})"
        if kind not in INSTRUCTIONS:
            raise TraceRefused(f"{where}: {_short(kind)} is not an allowed schedule instruction")
        if kind in ("Annotate", "Unannotate"):
            if not (len(attrs) == 1 and isinstance(attrs[0], str)):
                raise TraceRefused(f"{where}: attrs are not [annotation key]")
            key = attrs[0]
            if key not in ANNOTATIONS:
                raise TraceRefused(f"{where}: annotation {_short(key)} is not allowed")
            want = 2 if kind == "Annotate" else 1
            if len(inputs) != want or not (isinstance(inputs[0], str) and inputs[0] in defined):
                raise TraceRefused(f"{where}: inputs of annotation {key} are not [block or loop"
                                   f"{', value' if want == 2 else ''}]")
            if kind == "Annotate":
                val = inputs[1]
                if not ANNOTATIONS[key](val) or (isinstance(val, str) and _RV.match(val) and val not in defined):
                    raise TraceRefused(f"{where}: annotation {key} has value {_short(val)}")
        else:
            _plain(inputs, where, lambda s: s in defined or s == "None")
            if kind == "GetSBlock":
                _plain(attrs, where, lambda s: _NAME.match(s) is not None)
            else:
                _plain(attrs, where, lambda s: s in STRING_ATTRS)
        for o in outputs:
            if not (isinstance(o, str) and _RV.match(o)) or o in defined:
                raise TraceRefused(f"{where}: output {_short(o)} is not a fresh variable name")
            defined.add(o)
    for dec in decisions:
        if not (isinstance(dec, list) and len(dec) == 2 and isinstance(dec[0], int)
                and not isinstance(dec[0], bool) and 0 <= dec[0] < len(insts)):
            raise TraceRefused(f"decision {_short(dec)} is not [instruction index, value]")
        if insts[dec[0]][0] not in SAMPLING:
            raise TraceRefused(f"decision {_short(dec)} is for a non-sampling instruction")
        if not (isinstance(dec[1], int) or (isinstance(dec[1], list) and all(isinstance(x, int) for x in dec[1]))):
            raise TraceRefused(f"decision {_short(dec)} does not hold ints")
        _plain(dec[1], f"decision {dec[0]}", lambda s: False)


__all__ = ["ANNOTATIONS", "INSTRUCTIONS", "TraceRefused", "check_trace"]
