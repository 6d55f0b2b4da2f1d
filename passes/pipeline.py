"""What a pass reads besides its graph: ``PassContext``. Passes are functions ``(graph, ctx) -> graph``.

The order the passes run in, and the rest of the compiler, is one list in tools/compiler.py (``GRAPH_STEPS``);
it gives every pass a context of its own and collects what the pass left there (pattern counts, folded
constants, the paged KV layout) as that step's result.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PassContext:
    constants: dict[str, torch.Tensor] = field(default_factory=dict)  # folded tensors, read by the pattern passes
    patterns: dict[str, int] = field(default_factory=dict)  # pattern name -> matches
    # paged KV cache (passes/paged_kv.py): {"block_size", "blocks" (None: max_batch requests' worth), "max_batch"};
    # None or block_size 0: caches stay contiguous per request
    kv_pages: dict | None = None
    # the batched decode program (tools/compiler.py): its tokens are different requests' next tokens, each at its
    # own position (passes/token_positions.py) with its own block tables (passes/paged_kv.py)
    token_positions: bool = False
