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
             "sparse_attention", "compressed_attention", "expert_workspace", "paged_kv", "fuse"]
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
