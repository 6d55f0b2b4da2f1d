"""The compiler, on one screen: every pass in order, each named as in the IR dumps (``NNN_<pass>.ir``).

Passes are functions ``(graph, ctx) -> graph``; ``ctx`` carries what passes share with the rest of the compile
(the constants they fold, the patterns they find). The verifier runs after every pass when ``verify=True``
(tests, ``dayzero dump-ir``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from dayzero.passes.ir.node import Graph
from dayzero.passes.ir.text import print_graph
from dayzero.passes.ir.verify import verify as verify_graph
from .fold_constants import fold_constants
from .fold_empty import fold_empty
from .inplace_state import inplace_state
from .moe import moe


@dataclass
class PassContext:
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    patterns: dict[str, int] = field(default_factory=dict)  # pattern name -> matches
    # paged KV cache (passes/paged_kv.py): {"block_size", "blocks" (None: max_batch requests' worth), "max_batch"};
    # None or block_size 0: caches stay contiguous per request
    kv_pages: dict | None = None
    # the batched decode program (tools/driver.py): its tokens are different requests' next tokens, each at its own
    # position (passes/token_positions.py) with its own block tables (passes/paged_kv.py)
    token_positions: bool = False


Pass = Callable[[Graph, PassContext], Graph]

def _inplace_state(g: Graph, ctx: PassContext) -> Graph:
    g, n = inplace_state(g)
    if n:
        ctx.patterns["inplace_kv_write"] = ctx.patterns.get("inplace_kv_write", 0) + n
    return g


PIPELINE: list[tuple[str, Pass]] = [
    # -- canonicalize ----------------------------------------------------------------------------------------
    ("fold_empty", lambda g, ctx: fold_empty(g)),  # before fold_constants, which leaves empty values alone
    ("fold_constants", lambda g, ctx: fold_constants(g, ctx.constants)),
    # -- identify patterns (dequant, moe, sparse attention, cross-layer state) plug in here ------------------
    ("moe", moe),
    ("dequant", __import__("dayzero.passes.dequant", fromlist=["dequant"]).dequant),  # MXFP4 chain -> fused kernel
    # -- state -------------------------------------------------------------------------------------------------
    ("inplace_state", _inplace_state),
    ("sparse_attention", __import__("dayzero.passes.sparse_attention", fromlist=["x"]).sparse_attention),  # after inplace_state
    ("compressed_attention", __import__("dayzero.passes.compressed_attention", fromlist=["x"]).compressed_attention),  # after sparse_attention
    # batched decode only (PassContext.token_positions): each token at its own position
    ("token_positions", __import__("dayzero.passes.token_positions", fromlist=["x"]).token_positions),
    ("paged_kv", __import__("dayzero.passes.paged_kv", fromlist=["x"]).paged_kv),  # after the attention ops exist
]


def run_pipeline(g: Graph, ctx: PassContext, verify: bool = False, dump_dir: str | Path | None = None) -> Graph:
    dump = Path(dump_dir) if dump_dir is not None else None
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
        (dump / "000_input.ir").write_text(print_graph(g))
    if verify:
        verify_graph(g)
    for k, (name, fn) in enumerate(PIPELINE, start=1):
        g = fn(g, ctx)
        if verify:
            verify_graph(g)
        if dump is not None:
            (dump / f"{k:03d}_{name}.ir").write_text(print_graph(g))
    return g
