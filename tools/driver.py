"""``dayzero.compile``'s keyword API over the compiler (tools/compiler.py), for Python callers and tests.

``compile_model(model, out, max_seq=..., ...)`` builds one ``CompileOptions`` from its keywords (validated there)
and runs ``compile_artifact``; ``optimize`` runs a traced model's prefill through the graph steps.
"""

from __future__ import annotations

from dayzero.frontend.trace import Frontend, trace_model
from dayzero.passes.ir.node import Graph
from dayzero.passes.pipeline import Found
from dayzero.tools.compiler import CompileOptions, compile_artifact, resolve_compute_dtype, run_pipeline

__all__ = ["compile_model", "optimize", "trace_model", "resolve_compute_dtype"]


def compile_model(model, out, **options) -> dict:
    """Compile MODEL into the artifact directory OUT; returns the report. The keywords are ``CompileOptions``'
    fields (target, max_seq, max_batch, prefill_chunk, kv_block_size, kv_blocks, image_grids, verify, tune,
    tune_minutes, tuning_dir, compute_dtype, expert_route, expert_cache_bytes, int8_activations, allow_nonfinite)."""
    return compile_artifact(model, out, CompileOptions(**options))


def optimize(fe: Frontend, verify: bool = False, kv_pages: dict | None = None) -> tuple[Graph, Found]:
    """The prefill graph after the graph steps (experts fused), with what they found."""
    return run_pipeline(fe.traced.graph, kv_pages, verify=verify)
