"""Traces kept on disk, so compiling the same model again skips torch.export (half of a compile's time).

A checkpoint's prefill and decode traces (``trace._trace_with_cache``) depend only on:

* its ``config.json`` (the upstream model is built from the config; no weight value reaches the graph),
* the trace's own options (``max_seq``, ``prefill_chunk``),
* the versions of torch and transformers (the modeling code and the exporter),
* dayzero's frontend and IR code (``frontend/``, ``passes/ir/``: the translator and the text form).

Those make the key (sha256). The entry is ``<root>/<key>.json``: the graphs in the IR's text form
(``passes/ir/text.py``, parsed back by its grammar, never evaluated) and the cache layout. An entry is untrusted
input like any file: it is size-bounded, parsed, its key and layout fields checked; one that fails any check is
ignored with a warning and the model is traced again (and the entry rewritten). Writes are atomic.

The same folder keeps each checkpoint layout's weight recipes (``checkpoint.learn_recipes``: which checkpoint
elements fill which parameter, transformers' loader run on a stand-in of element ids, a few seconds a compile): they
depend on the config, the checkpoint's header (tensor names, dtypes, shapes), the loader and the same versions and
code, never on a weight value. A recipe entry is checked against the header it is read for (every run inside its
key and its parameter) before anything uses it.

root: the compile option (``--trace-cache DIR``), else ``$DAYZERO_TRACE_CACHE``, else
``~/.cache/dayzero/traces``; ``off`` disables the cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Callable

from dayzero import UserError
from dayzero.frontend.decode_export import CacheTensor
from dayzero.frontend.torch_export import Traced
from dayzero.passes.ir.node import structurally_equal
from dayzero.passes.ir.text import parse_graph, print_graph

ENV_DIR = "DAYZERO_TRACE_CACHE"
FORMAT = "dayzero-trace-cache/1"
MAX_ENTRY_BYTES = 512 << 20  # a full-width model's graphs are a few MB of text


class TraceCacheWarning(UserWarning):
    """An entry of the trace cache was unreadable or inconsistent and is being replaced."""


def cache_root(option: str | None = None) -> Path | None:
    """Where entries live, or None when the cache is off."""
    value = option if option is not None else os.environ.get(ENV_DIR)
    if value is None or value == "":
        return Path.home() / ".cache" / "dayzero" / "traces"
    return None if value == "off" else Path(value).expanduser()


@lru_cache(maxsize=1)
def _code_digest() -> str:
    """sha256 over dayzero's frontend and IR sources (a change to the translator invalidates every entry)."""
    pkg = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for sub in ("frontend", "passes/ir"):
        for f in sorted((pkg / sub).rglob("*.py")):
            h.update(str(f.relative_to(pkg)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def trace_key(config: dict, **options) -> str:
    import torch
    import transformers

    payload = {"format": FORMAT, "config": config, "options": options, "torch": torch.__version__,
               "transformers": transformers.__version__, "code": _code_digest()}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


_LAYOUT_FIELDS = {f.name for f in dataclasses.fields(CacheTensor)}


_INT, _STR, _OPT_INT = (lambda v: type(v) is int), (lambda v: isinstance(v, str)), (lambda v: v is None or type(v) is int)
_LAYOUT_TYPES = {"layer": _INT, "kind": _STR, "buffer": _STR, "dtype": _STR, "position_dim": _OPT_INT,
                 "layer_type": _STR, "sliding_window": _OPT_INT, "compress_rate": _OPT_INT,
                 "shape": lambda v: isinstance(v, list) and all(type(d) is int and d >= 0 for d in v)}


def _check_layout(c: dict) -> None:
    bad = [k for k, ok in _LAYOUT_TYPES.items() if not ok(c[k])]
    if bad:
        raise ValueError(f"cache_layout entry {c.get('buffer')!r}: bad {', '.join(bad)}")


def _read(path: Path, key: str):
    """(prefill, decode, cache_layout) from an entry, or None (absent, or refused with a warning)."""
    try:
        size = path.stat().st_size
    except OSError:  # absent (or the root is no directory: the write says so)
        return None
    try:
        if size > MAX_ENTRY_BYTES:
            raise ValueError(f"{size} bytes, over the {MAX_ENTRY_BYTES} limit")
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("key") != key:
            raise ValueError("not an entry for this key")
        layout = doc.get("cache_layout")
        if not isinstance(layout, list) or not all(isinstance(c, dict) and set(c) == _LAYOUT_FIELDS
                                                   for c in layout):
            raise ValueError("cache_layout is not a list of cache tensors")
        for c in layout:
            _check_layout(c)
        graphs = []
        for name in ("prefill", "decode"):
            text = doc.get(name)
            if not isinstance(text, str):
                raise ValueError(f"{name} is not IR text")
            graphs.append(Traced(parse_graph(text)))
    except (OSError, ValueError, TypeError, UserError) as e:
        warnings.warn(f"trace cache entry {path} ignored ({str(e)[:200]}); tracing again", TraceCacheWarning,
                      stacklevel=3)
        return None
    return graphs[0], graphs[1], layout


def _write(path: Path, key: str, prefill: Traced, decode: Traced, layout: list[dict]) -> None:
    """Keep the entry, unless a graph does not read back as itself (a dimension form the text has no exact
    spelling for): such a model is traced each time."""
    doc = {"format": FORMAT, "key": key, "cache_layout": layout}
    for name, t in (("prefill", prefill), ("decode", decode)):
        try:
            doc[name] = print_graph(t.graph)
            same = structurally_equal(parse_graph(doc[name]), t.graph)
        except (UserError, TypeError, ValueError):
            same = False
        if not same:
            warnings.warn(f"the {name} trace does not read back from its text form; not cached", TraceCacheWarning,
                          stacklevel=3)
            return
    _write_doc(path, doc)


def _write_doc(path: Path, doc: dict) -> None:
    """``doc`` as JSON at ``path``, atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cached(root: Path | None, config: dict, trace: Callable[[], tuple], **options) -> tuple:
    """``trace()`` -> (prefill, decode, cache_layout), through the cache at ``root`` (None: straight through).

    Only complete results are kept: a model without a static cache (``(None, None, [])``) is traced each time."""
    if root is None:
        return trace()
    key = trace_key(config, **options)
    path = root / f"{key}.json"
    hit = _read(path, key)
    if hit is not None:
        return hit
    prefill, decode, layout = trace()
    layout = json.loads(json.dumps(layout))  # the types an entry gives back (lists, not tuples), hit or miss
    if prefill is not None and decode is not None:
        try:
            _write(path, key, prefill, decode, layout)
        except OSError as e:  # a read-only or full cache directory costs the next compile time, nothing else
            warnings.warn(f"trace cache {root} not written: {e}", TraceCacheWarning, stacklevel=2)
    return prefill, decode, layout


def cached_graph(root: Path | None, config: dict, name: str, trace: Callable[[], Traced], **options) -> Traced:
    """One more trace of a checkpoint (``name``: the batched decode step's ``decode_rows``) through the cache at
    ``root`` (None: straight through), in its own entry (key: ``name`` + the options); the same checks as
    ``cached``: an unreadable entry is traced again, a graph that does not read back is not kept."""
    if root is None:
        return trace()
    key = trace_key(config, graph=name, **options)
    path = root / f"{key}.json"
    try:
        if path.stat().st_size <= MAX_ENTRY_BYTES:
            doc = json.loads(path.read_text())
            if isinstance(doc, dict) and doc.get("format") == FORMAT and doc.get("key") == key and \
                    isinstance(doc.get(name), str):
                return Traced(parse_graph(doc[name]))
            raise ValueError("not an entry for this key")
    except FileNotFoundError:
        pass
    except (OSError, ValueError, TypeError, UserError) as e:
        warnings.warn(f"trace cache entry {path} ignored ({str(e)[:200]}); tracing again", TraceCacheWarning,
                      stacklevel=2)
    t = trace()
    try:
        text = print_graph(t.graph)
        same = structurally_equal(parse_graph(text), t.graph)
    except (UserError, TypeError, ValueError):
        same = False
    if not same:
        warnings.warn(f"the {name} trace does not read back from its text form; not cached", TraceCacheWarning,
                      stacklevel=2)
        return t
    try:
        _write_doc(path, {"format": FORMAT, "key": key, name: text})
    except OSError as e:
        warnings.warn(f"trace cache {root} not written: {e}", TraceCacheWarning, stacklevel=2)
    return t


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _check_recipes(doc: dict, tensors: dict) -> tuple[dict, set, dict]:
    """(recipes, missing, shapes) of a recipe entry, each run checked against the checkpoint header ``tensors``
    (name -> TensorInfo) and its parameter's shape; ValueError on anything else."""
    recipes, missing, shapes = doc.get("recipes"), doc.get("missing"), doc.get("shapes")
    if not (isinstance(recipes, dict) and isinstance(missing, list) and isinstance(shapes, dict)):
        raise ValueError("recipes, missing or shapes of the wrong type")
    if not all(isinstance(m, str) for m in missing):
        raise ValueError("missing is not a list of names")
    out_shapes = {}
    for name, shape in shapes.items():
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise ValueError(f"shape of {name!r} is not a list of sizes")
        out_shapes[name] = tuple(shape)
    out = {}
    for name, runs in recipes.items():
        if name not in out_shapes or not isinstance(runs, list):
            raise ValueError(f"recipe of {name!r}: no shape, or not a list of runs")
        size, checked = _numel(out_shapes[name]), []
        for run in runs:
            if not (isinstance(run, list) and len(run) == 4 and type(run[0]) is int and isinstance(run[1], str)
                    and type(run[2]) is int and type(run[3]) is int):
                raise ValueError(f"recipe of {name!r}: a run is not [dst, key, src, length]")
            dst, key, src, n = run
            info = tensors.get(key)
            if info is None or min(dst, src) < 0 or n < 1 or dst + n > size or src + n > _numel(info.shape):
                raise ValueError(f"recipe of {name!r}: run {run} outside its parameter or key")
            checked.append((dst, key, src, n))
        out[name] = checked
    return out, set(missing), out_shapes


def cached_recipes(root: Path | None, ckpt, loader: str, learn: Callable[[dict], tuple[dict, set]]) -> tuple:
    """``learn(shapes)`` -> (recipes, missing) (filling ``shapes``) through the cache at ``root`` (None: straight
    through); returns (recipes, missing, shapes). ``ckpt`` gives the config and the header (``tensors``) that make
    the key with ``loader``, the qualified name of the loader function. Only successful learns are kept."""
    if root is None:
        shapes: dict = {}
        recipes, missing = learn(shapes)
        return recipes, missing, shapes
    header = sorted((k, i.dtype, list(i.shape)) for k, i in ckpt.tensors.items())
    key = trace_key(ckpt.config, graph="recipes", loader=loader, header=header)
    path = root / f"{key}.json"
    try:
        if path.stat().st_size > MAX_ENTRY_BYTES:
            raise ValueError("over the size limit")
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("key") != key:
            raise ValueError("not an entry for this key")
        return _check_recipes(doc, ckpt.tensors)
    except FileNotFoundError:
        pass
    except (OSError, ValueError, TypeError) as e:
        warnings.warn(f"trace cache entry {path} ignored ({str(e)[:200]}); learning the recipes again",
                      TraceCacheWarning, stacklevel=2)
    shapes = {}
    recipes, missing = learn(shapes)
    doc = {"format": FORMAT, "key": key, "recipes": {n: [list(r) for r in runs] for n, runs in recipes.items()},
           "missing": sorted(missing), "shapes": {n: [int(d) for d in s] for n, s in shapes.items()}}
    try:
        _write_doc(path, doc)
    except OSError as e:
        warnings.warn(f"trace cache {root} not written: {e}", TraceCacheWarning, stacklevel=2)
    return recipes, missing, shapes
