"""The trace cache (frontend/trace_cache.py): a hit skips torch.export and compiles the same artifact; an entry
that is damaged, inconsistent or for another key is refused with a warning and the model is traced again."""

from __future__ import annotations

import json
import math

import pytest
import sympy

from dayzero.frontend import trace_cache
from dayzero.frontend.torch_export import Traced
from dayzero.passes.ir.node import Graph, Node, TensorType, structurally_equal
from dayzero.passes.ir.text import parse_graph, print_graph
from dayzero.passes.ir.shape_expr import make_symbol

SEQ = make_symbol("seq")
FLOOR = sympy.floor((SEQ + 22) / 8)  # DeepSeek-V4's compressor: (seq + 22) // 8 entries; sympy distributes it


def _graph(dim) -> Graph:
    x = Node.make("input", (), {"name": "input_ids"}, [TensorType("int64", (1, SEQ))])
    y = Node.make("arange.start_step", (), {"start": 0, "end": dim, "step": 1, "dtype": None},
                  [TensorType("int64", (dim,))])
    return Graph("main", (x,), (x, y), (("seq", 1, 64),))


LAYOUT = [{"layer": 0, "kind": "keys", "buffer": "cache_0_keys", "shape": (1, 2, 64, 8), "dtype": "float32",
           "position_dim": 2, "layer_type": "full_attention", "sliding_window": None, "compress_rate": None}]


class _Tracer:
    """A stand-in for torch.export: counts its calls."""

    def __init__(self, dim=FLOOR):
        self.calls, self.dim = 0, dim

    def __call__(self):
        self.calls += 1
        return Traced(_graph(self.dim)), Traced(_graph(1)), LAYOUT


def _cached(root, tracer, config=None, **options):
    return trace_cache.cached(root, config or {"model_type": "t"}, tracer, **({"max_seq": 64} | options))


def test_floor_dimensions_read_back_from_text_and_lower_to_floordiv():
    """torch's FloorDiv is written as floor(a/b), which sympy distributes (floor(seq/8 + 11/4)); the text form
    reads it back as the same expression and the lowering turns any such floor into one integer floordiv."""
    from tvm import sym

    from dayzero.codegen.lower.common import Ctx, sym_to_tir

    g = _graph(FLOOR)
    assert structurally_equal(parse_graph(print_graph(g)), g)
    an = sym.Analyzer()
    for n in (1, 2, 9, 10, 63):
        got = an.simplify(sym_to_tir(FLOOR, Ctx(bind={"seq": n})))
        assert int(got) == math.floor((n + 22) / 8)


def test_a_hit_skips_the_trace_and_gives_the_same_graphs(tmp_path):
    tracer = _Tracer()
    cold = _cached(tmp_path, tracer)
    warm = _cached(tmp_path, tracer)
    assert tracer.calls == 1
    for a, b in zip(cold[:2], warm[:2]):
        assert structurally_equal(a.graph, b.graph)
    assert cold[2] == warm[2] == json.loads(json.dumps(LAYOUT))
    # another config or option is another key
    _cached(tmp_path, tracer, max_seq=32)
    _cached(tmp_path, tracer, config={"model_type": "t", "hidden_size": 8})
    assert tracer.calls == 3 and len(list(tmp_path.glob("*.json"))) == 3


def test_off_and_unwritable_cache(tmp_path, monkeypatch):
    tracer = _Tracer()
    _cached(None, tracer)
    _cached(None, tracer)
    assert tracer.calls == 2
    monkeypatch.setenv(trace_cache.ENV_DIR, "off")
    assert trace_cache.cache_root() is None
    assert trace_cache.cache_root(str(tmp_path)) == tmp_path
    monkeypatch.setenv(trace_cache.ENV_DIR, str(tmp_path / "env"))
    assert trace_cache.cache_root() == tmp_path / "env"
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.warns(trace_cache.TraceCacheWarning, match="not written"):
        _cached(blocker / "sub", tracer)  # a cache under a regular file cannot be created: the trace still returns


def test_a_graph_without_an_exact_text_form_is_not_cached(tmp_path):
    tracer = _Tracer(dim=sympy.Function("Unknown")(SEQ))  # prints, but does not read back
    with pytest.warns(trace_cache.TraceCacheWarning):
        _cached(tmp_path, tracer)
    assert not list(tmp_path.glob("*.json"))


def _entry(tmp_path):
    (path,) = tmp_path.glob("*.json")
    return path, json.loads(path.read_text())


@pytest.mark.parametrize("damage", [
    "truncated", "not-json", "other-key", "layout-field", "layout-type", "ir-text", "graph-type"])
def test_a_damaged_entry_is_refused_and_replaced(tmp_path, damage):
    tracer = _Tracer()
    _cached(tmp_path, tracer)
    path, doc = _entry(tmp_path)
    if damage == "truncated":
        path.write_text(path.read_text()[:200])
    elif damage == "not-json":
        path.write_text("__import__('os').system('true')")
    else:
        if damage == "other-key":
            doc["key"] = "0" * 64
        elif damage == "layout-field":
            doc["cache_layout"][0]["extra"] = 1
        elif damage == "layout-type":
            doc["cache_layout"][0]["shape"] = [1, -2, 64, 8]
        elif damage == "ir-text":
            doc["prefill"] = doc["prefill"].replace("int64[", "int64[`__import__('os')`, ", 1)
        elif damage == "graph-type":
            doc["decode"] = {"nodes": []}
        path.write_text(json.dumps(doc))
    with pytest.warns(trace_cache.TraceCacheWarning, match="ignored"):
        again = _cached(tmp_path, tracer)
    assert tracer.calls == 2
    assert structurally_equal(again[0].graph, _graph(FLOOR))
    _cached(tmp_path, tracer)  # the entry was rewritten: a hit again
    assert tracer.calls == 2


@pytest.mark.slow
def test_a_cached_trace_compiles_the_same_programs(tiny_compiled, monkeypatch):
    """tiny DeepSeek-V4 (its compressor's dimensions are floor divisions): the session's compile left its traces in
    the session cache; the compiler run again with torch.export unavailable builds the same programs (every
    buffer, step and kernel of prefill, decode and decode_batch, as program.json records them), the same final IR
    and the same weights manifest. (Code generation, a function of the programs, is not run again: the
    kernels' routes, which it decides, are left out.)"""
    import os

    from dayzero.codegen.program import program_json
    from dayzero.frontend import trace as trace_mod
    from dayzero.tools import compiler
    from conftest import SHARED_MAX_BATCH, SHARED_MAX_SEQ

    ckpt, art, _ = tiny_compiled("deepseek_v4")
    assert list(trace_cache.cache_root(os.environ[trace_cache.ENV_DIR]).glob("*.json"))

    def no_export(*a, **k):
        raise AssertionError("traced again although the cache holds this config")
    monkeypatch.setattr(trace_mod, "_trace_with_cache", no_export)
    monkeypatch.setattr(trace_mod, "_trace_rows", no_export)
    options = compiler.CompileOptions(max_seq=SHARED_MAX_SEQ, max_batch=SHARED_MAX_BATCH)
    fe = compiler.trace(str(ckpt), options)
    ps = compiler.build_programs(fe, options)
    saved = json.loads((art / "program.json").read_text())["programs"]
    assert sorted(saved) == sorted(p.name for p in ps.programs) and "decode_batch" in saved
    def same_parts(pj: dict) -> dict:  # without what code generation and memory planning add
        pj = {k: v for k, v in pj.items() if k != "memory"}
        pj["kernels"] = {k: {f: v for f, v in kernel.items() if f != "route"} for k, kernel in pj["kernels"].items()}
        return pj
    for p in ps.programs:
        assert same_parts(json.loads(json.dumps(program_json(p)))) == same_parts(saved[p.name]), p.name
    assert print_graph(ps.graphs["prefill"]) == (art / "final.ir").read_text()
    manifest, _ = compiler.weights_manifest(fe, list(ps.graphs.values()), ps.constants)
    assert json.loads(json.dumps(manifest)) == {k: v for k, v in json.loads((art / "weights.json").read_text()).items()
                                                if k != "allow_nonfinite"}


def test_one_more_graph_has_its_own_entry(tmp_path):
    """``cached_graph`` (DeepSeek-V4's batched decode step): its own key beside the prefill/decode entry, a hit
    skips the trace, a damaged entry is traced again with a warning and rewritten."""
    calls = []

    def rows():
        calls.append(1)
        return Traced(_graph(FLOOR))

    def get():
        return trace_cache.cached_graph(tmp_path, {"model_type": "t"}, "decode_rows", rows, max_seq=64, max_batch=4)
    _cached(tmp_path, _Tracer())
    first, again = get(), get()
    assert len(calls) == 1 and structurally_equal(first.graph, again.graph)
    assert len(list(tmp_path.glob("*.json"))) == 2
    path = next(p for p in tmp_path.glob("*.json") if "decode_rows" in json.loads(p.read_text()))
    path.write_text(path.read_text()[:50])
    with pytest.warns(trace_cache.TraceCacheWarning, match="ignored"):
        get()
    assert len(calls) == 2 and structurally_equal(get().graph, first.graph) and len(calls) == 2


class _Loader:
    """A stand-in for transformers' loader (``learn_recipes``' ``load_model``): parameter w is keys a and b end to
    end, v is key c transposed; counts its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, directory, dtype):
        import torch
        from safetensors.torch import load_file

        self.calls += 1
        t = load_file(f"{directory}/model.safetensors")
        m = torch.nn.Module()
        m.register_buffer("w", torch.cat([t["a"], t["b"]]).to(dtype))
        m.register_buffer("v", t["c"].t().contiguous().to(dtype))
        return m


def _header(c_dtype="float32"):
    import types

    from dayzero.frontend.checkpoint import TensorInfo

    tensors = {"a": TensorInfo("a", "", "float32", (2, 3)), "b": TensorInfo("b", "", "float32", (1, 3)),
               "c": TensorInfo("c", "", c_dtype, (2, 4))}
    return types.SimpleNamespace(dir="ckpt", config={"model_type": "t"}, tensors=tensors)


def _learn(root, loader, ckpt=None):
    from dayzero.frontend.checkpoint import learn_recipes

    shapes: dict = {}
    recipes, missing = learn_recipes(ckpt or _header(), loader, shapes, cache=root)
    return recipes, missing, shapes


def test_weight_recipes_are_kept_beside_the_traces(tmp_path):
    """The recipes (which checkpoint elements fill which parameter: the loader run on a stand-in of element ids)
    are read back instead of running the loader again, for the same config, header and loader; another header
    (a dtype) is another entry."""
    loader = _Loader()
    cold = _learn(tmp_path, loader)
    assert cold[0]["w"] == [(0, "a", 0, 6), (6, "b", 0, 3)]  # a then b, end to end
    assert cold[0]["v"][:2] == [(0, "c", 0, 1), (1, "c", 4, 1)] and cold[2] == {"w": (3, 3), "v": (4, 2)}
    assert _learn(tmp_path, loader) == cold and loader.calls == 1
    _learn(tmp_path, loader, _header("bfloat16"))
    assert loader.calls == 2 and len(list(tmp_path.glob("*.json"))) == 2
    assert _learn(None, loader) == cold and loader.calls == 3  # the cache off: learned each time


@pytest.mark.parametrize("damage", ["past-key", "past-parameter", "unknown-key", "negative", "run-type",
                                    "shape-type", "no-shape", "truncated"])
def test_a_damaged_recipe_entry_is_refused_and_learned_again(tmp_path, damage):
    """A recipe entry is untrusted input: every run must lie inside its checkpoint key and its parameter before
    anything reads through it; one that does not is refused with a warning, learned again and rewritten."""
    loader = _Loader()
    cold = _learn(tmp_path, loader)
    path, doc = _entry(tmp_path)
    runs = doc["recipes"]["w"]
    if damage == "past-key":
        runs[1][3] = 4  # b holds 3 elements
    elif damage == "past-parameter":
        runs[0][0] = 4  # w holds 9: 4 + 6 runs past it
    elif damage == "unknown-key":
        runs[0][1] = "../../etc/passwd"
    elif damage == "negative":
        runs[0][2] = -1
    elif damage == "run-type":
        runs[0] = [0, "a", 0, "6"]
    elif damage == "shape-type":
        doc["shapes"]["w"] = [3, -3]
    elif damage == "no-shape":
        del doc["shapes"]["w"]
    path.write_text(json.dumps(doc)[:100] if damage == "truncated" else json.dumps(doc))
    with pytest.warns(trace_cache.TraceCacheWarning, match="ignored"):
        assert _learn(tmp_path, loader) == cold
    assert loader.calls == 2
    assert _learn(tmp_path, loader) == cold and loader.calls == 2  # rewritten: a hit again
