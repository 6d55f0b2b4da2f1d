"""expert_workspace: MXFP4 routed experts take the convert -> compute -> reclaim -> reuse route.

Runs per program after the pattern passes (dequant makes the moe_experts_mxfp4 it rewrites) and before the
state-layout steps (its states are in their own zone, which paged_kv leaves as they are), when the compile
options / target choose the workspace route for it (``route_for``; the docstring of the kernel table's ``moe_experts_mxfp4_ws`` kernel gives the measurements behind
the choice)::

    moe_experts_mxfp4(x, ids, w, B_gu, S_gu, [b_gu], B_d, S_d, [b_d])
        ==>  moe_experts_mxfp4_ws(x, ids, w, B_gu, S_gu, [b_gu], B_d, S_d, [b_d], layer, WS, META)

    layer  weight int32 [1] = this layer's index (a constant carried in the artifact), so one kernel serves every
           layer and the cache key (layer, expert) is an argument, not a compile-time constant
    WS     state CD [S, GU*H + H*I], zone dequant_workspace: S converted-expert slots in the compute dtype CD
    META   state int64 [4 + 2S], zone dequant_workspace: tick, hits, conversions, slot tags, last-use ticks

WS and META are named by the expert shape, compute dtype and slot count, so every layer and every program
(prefill, decode) of the artifact reads the same bytes: the workspace is reused across experts and layers, and
cached experts persist across steps and programs. The dequant_workspace zone is placed once (not per request
slot) and zeroed when the artifact is loaded, never when a request starts (the memory plan,
``runtime/executor.py``). Layer indices are the moe nodes' positions in graph order (no names are read): MoE
layers lie on one dependency chain (a layer's input depends on the layer before), so every topological order of a
program, the prefill's and the decode's alike, numbers them the same way.

Slots: without a cache, one (every routed expert is converted into it, computed, and the slot reclaimed); with a
cache budget of B bytes, max(1, B // slot bytes) slots under LRU, at most one per (layer, expert) of the shape.
The resident bytes are the MXFP4 experts as stored (4.25 bits per weight, zone low_precision_weights) + S slots,
never a converted copy of every expert.
"""

from __future__ import annotations

import torch

from dayzero import UserError
from dayzero.passes.ir.dayzero_ops import (WORKSPACE_STORAGE, workspace_meta_len, workspace_slot_bytes,
                                          workspace_slot_elems)
from dayzero.passes.ir.node import Graph, Node, TensorType, rewrite
from dayzero.passes.pipeline import Found, counted
from dayzero.targets import capabilities
from dayzero.targets.spec import COMPUTE_DTYPES

OP_IN = "moe_experts_mxfp4"
OP = "moe_experts_mxfp4_ws"
ZONE = "dequant_workspace"
ROUTES = ("auto", "fused", "workspace")


def compute_dtype_of(name: str) -> str:
    """A compute dtype as targets/spec.py spells it (fp32 | bf16 | fp8_e4m3) -> the IR dtype."""
    if name not in COMPUTE_DTYPES:
        raise UserError(f"compute dtype {name!r} is not one of {', '.join(COMPUTE_DTYPES)}")
    return COMPUTE_DTYPES[name]


def route_for(*, compute_dtype: str, cache_bytes: int, route: str = "auto", target_kind: str = "llvm") -> str:
    """"workspace" or "fused" for the MXFP4 experts of every program of the artifact (the kernel's docstring says
    why); one answer for all, since a cache persists across programs only if they all read it."""
    if route not in ROUTES:
        raise UserError(f"expert route {route!r} is not one of {', '.join(ROUTES)}")
    if cache_bytes < 0:
        raise UserError(f"expert cache budget must be >= 0 bytes, got {cache_bytes}")
    if target_kind not in capabilities.WORKSPACE_KINDS:
        if route == "workspace" or cache_bytes or compute_dtype != "float32":
            raise UserError(f"the expert workspace route is written for the host CPU only, not {target_kind}")
        return "fused"
    if route != "auto":
        if route == "fused" and (cache_bytes or compute_dtype != "float32"):
            raise UserError("the fused MXFP4 expert route computes in fp32 without a cache: drop --expert-cache / "
                            "use compute dtype fp32, or take the workspace route")
        return route
    if compute_dtype != "float32" or cache_bytes:
        return "workspace"
    return "fused"  # fp32, no cache: since the fused kernel decodes 16 codes per lookup it is faster everywhere


def expert_workspace(g: Graph, *, compute_dtype: str = "float32", cache_bytes: int = 0) -> tuple[Graph, Found]:
    """Rewrite every moe_experts_mxfp4 node to the workspace route; ``Found`` holds the layer constants and counts
    ``expert_workspace``."""
    nodes = [n for n in g.nodes() if n.op == OP_IN]
    if not nodes:
        return g, Found()
    constants: dict[str, torch.Tensor] = {}
    count = seen = 0

    def fn(n: Node):
        nonlocal count, seen
        if n.op != OP_IN:
            return None
        # rewrite visits g.nodes() in order, so the i-th moe node it meets is nodes[i]: layer i
        layer, seen = seen, seen + 1
        a = n.attr
        x, gb = n.inputs[0], n.inputs[3]
        E, GU, H, I = int(gb.shape[0]), int(gb.shape[1]), int(x.shape[1]), int(a["inter"])
        if not capabilities.moe_experts_mxfp4_ws(H, GU, I):
            return None
        cache = cache_bytes > 0
        # no more slots than there are (layer, expert) keys of this shape: a larger budget could never be used
        keys = E * sum(1 for m in nodes if tuple(m.inputs[3].shape[:2]) == (E, GU) and int(m.attr["inter"]) == I)
        slots = min(max(1, cache_bytes // workspace_slot_bytes(H, GU, I, compute_dtype)), keys) if cache else 1
        tag = f"{compute_dtype}.gu{GU}.h{H}.i{I}.s{slots}"
        lname = f"expert_workspace.layer{layer}"
        constants[lname] = torch.tensor([layer], dtype=torch.int32)
        lnode = Node.make("weight", (), {"name": lname}, [TensorType("int32", (1,))], n.span)
        ws = Node.make("state", (), {"name": f"expert_workspace.{tag}", "zone": ZONE},
                       [TensorType(WORKSPACE_STORAGE[compute_dtype], (slots, workspace_slot_elems(H, GU, I)))], n.span)
        meta = Node.make("state", (), {"name": f"expert_cache.{tag}", "zone": ZONE},
                         [TensorType("int64", (workspace_meta_len(slots),))], n.span)
        count += 1
        return Node.make(OP, [*n.inputs, lnode, ws, meta], dict(a, compute_dtype=compute_dtype, cache=cache),
                         n.types, n.span)

    out, found = rewrite(g, fn), counted("expert_workspace", count)
    found.constants = constants
    return out, found


def int8_activations(g: Graph) -> tuple[Graph, Found]:
    """Every moe_experts_mxfp4 node (fused route) takes the integer tiles: attr ``int8`` (x and the activation
    between the GEMMs rounded to int8 per 32-block, integer dot products on the E2M1 codes; the op reference
    rounds the same way). Counts ``int8_activations``. The compile option ``--int8-activations`` asks for it in the
    decode programs (tools/compiler.py); the target's integer mode is the kernel's concern (codegen)."""
    count = 0

    def fn(n: Node):
        nonlocal count
        if n.op != OP_IN or n.attr.get("int8"):
            return None
        count += 1
        return Node.make(OP_IN, list(n.inputs), dict(n.attr, int8=True), n.types, n.span)
    return rewrite(g, fn), counted("int8_activations", count)
