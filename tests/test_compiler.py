"""tools/compiler.py: the options are validated once (one UserError line naming the flag), frozen, and resolved
(target, compute dtype, expert route, prefill chunk); the graph steps are one named list, run in that order."""

from __future__ import annotations

import dataclasses

import pytest

from dayzero import UserError
from dayzero.tools.compiler import GRAPH_STEPS, CompileOptions


@pytest.mark.parametrize("kwargs, message", [
    ({"max_seq": 0}, "--max-seq must be at least 1"),
    ({"max_batch": 0}, "--max-batch must be at least 1"),
    ({"kv_block_size": -1}, "--kv-block-size must be >= 0 (0: contiguous caches)"),
    ({"kv_blocks": 1}, "--kv-blocks must be at least 2 (block 0 is the scratch block)"),
    ({"max_seq": 64, "prefill_chunk": 65}, "--prefill-chunk must be in [1, --max-seq=64], got 65"),
    ({"tune_minutes": 0}, "--tune-minutes must be positive"),
    ({"tune": -1}, "--tune needs at least 1 trial"),
    ({"target": "tpu"}, "unknown target 'tpu' (use host or cuda[:sm_90])"),
    ({"expert_route": "fused", "expert_cache_bytes": 1 << 20}, "the fused MXFP4 expert route computes in fp32"),
])
def test_bad_options_are_one_line(kwargs, message):
    with pytest.raises(UserError) as e:
        CompileOptions(**kwargs)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_options_resolve_once_and_stay_frozen():
    o = CompileOptions(max_seq=64, image_grids=["1x4x4"], compute_dtype="h200")
    assert (o.chunk, o.expert_dtype, o.route, o.image_grids) == (64, "bf16", "workspace", ("1x4x4",))
    assert o.target_dict["kind"] == "llvm"
    assert CompileOptions(max_seq=4096).chunk == 512  # the default chunk caps the prefill arena
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.max_seq = 128


def test_graph_steps_in_phase_order():
    names = [n for n, _ in GRAPH_STEPS]
    assert len(set(names)) == len(names)
    # the ordering rules the passes' docstrings state
    order = ["fold_empty", "fold_constants", "moe", "dequant", "shard", "dequant_bf16", "inplace_state",
             "inplace_input", "sparse_attention", "compressed_attention", "expert_workspace", "paged_kv", "fuse"]
    assert sorted(order, key=names.index) == order
    assert names[-1] == "fuse"  # every pattern pass matches the unfused ops


def test_compile_reports_every_phase_in_seconds(tmp_path):
    """``seconds`` names where a compile's time went: the phases, the parts of passes and codegen, the total."""
    from dayzero.tools import examples
    from dayzero.tools.driver import compile_model

    s = compile_model(examples.tiny_projection(), tmp_path / "out", max_seq=16)["seconds"]
    phases = ["trace_s", "passes_s", "codegen_s", "plan_s", "write_s"]
    assert set(phases + ["graph_steps_s", "lower_s", "schedule_s", "compile_s", "total_s"]) <= set(s)
    assert all(v >= 0 for v in s.values())
    assert s["graph_steps_s"] + s["lower_s"] <= s["passes_s"]
    assert s["schedule_s"] + s["compile_s"] <= s["codegen_s"]
    assert sum(s[p] for p in phases) <= s["total_s"]


def test_a_second_compile_takes_every_kernel_from_the_kernel_cache(tmp_path):
    """Compiling the same model again (another output, the same compile cache) compiles no kernel: every object
    comes from ``<cache>/kernels`` and kernels.so is the same bytes; with the cache off every kernel compiles."""
    from dayzero.tools import examples
    from dayzero.tools.driver import compile_model

    model, cache = examples.tiny_projection(), str(tmp_path / "cache")
    first = compile_model(model, tmp_path / "a", max_seq=16, trace_cache=cache)["build"]
    second = compile_model(model, tmp_path / "b", max_seq=16, trace_cache=cache)["build"]
    off = compile_model(model, tmp_path / "c", max_seq=16, trace_cache="off")["build"]
    assert first["cached_kernels"] == 0 and second["cached_kernels"] == second["kernels"] == first["kernels"] > 0
    assert off["cached_kernels"] == 0
    so = [(tmp_path / d / "kernels.so").read_bytes() for d in "abc"]
    assert so[0] == so[1] == so[2]


def test_compressed_entries_read_by_a_generic_op_stay_whole():
    """rows_entries lists a row-program state only when its readers stop at the causal bound: an entries state
    that a generic op reads (every row) is not listed, so the runtime gathers and writes it back whole."""
    from dayzero.passes.ir.text import parse_graph
    from dayzero.tools.compiler import rows_entries

    text = """
    graph main symbols(batch in [1, 4]) {
      %0 = input {name="cache_0_compressor_entries"} : float32[batch, 9, 8]
      %1 = input {name="rows"} : int64[batch, 1, 8]
      %2 = input {name="new"} : float32[batch, 1, 8]
      %3 = scatter_inplace(%0, %1, %2) {dim=1} : float32[batch, 9, 8]
      %4 = sum.dim_IntList(%3) {dim=[1]} : float32[batch, 8]
      return %4, %3
    }
    """
    layout = [{"buffer": "cache_0_compressor_entries", "compress_rate": 4}]
    assert rows_entries(parse_graph(text), layout) == {}
