"""The kernel table: every op that has a hand-written kernel, in one explicit table.

    KERNELS[op] = Kernel(compute, schedule, supports, bounded)

* ``compute(node) -> PrimFunc``: the kernel for the host CPU, built from the node's shapes and attrs (TE cannot
  express these: data-dependent loop bounds, in-place writes, weights decoded as they are read). It is either
  written scheduled (``tirx.is_scheduled``) or carries its parameters as a function attr for ``schedule``.
* ``schedule(kernel, target) -> IRModule | None``: the first rule of the schedule chain (``codegen/schedule.py``):
  the same kernel rebuilt for the compile target; None when the kernel is not its own (then tuned / default).
* ``supports(target_kind, node) -> bool``: whether the kernel takes this node on this target kind; the answers
  are ``targets/capabilities.py``'s, which the pattern passes ask before they create the op.
* ``bounded``: ``schedule`` reads the program's bounds on the node's symbols, so they join the kernel's key
  (``codegen/program.py``): programs share the kernel only where those bounds agree.

Every other op is lowered from its TE compute (``codegen/lower``). An op here is declared in
``passes/ir/dayzero_ops.py`` like every dayzero op.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

import tvm

from dayzero.passes.ir.node import Node
from dayzero.targets import capabilities as cap
from . import attention, compressed_attention, dequant_linear, expert_workspace, indexer, moe, state

Compute = Callable[[Node], "tvm.tirx.PrimFunc"]
# (codegen.program.Kernel, tvm.target.Target, the program's symbol bounds {name: (lo, hi)})
ScheduleRule = Callable[..., "tvm.IRModule | None"]


@dataclass(frozen=True)
class Kernel:
    compute: Compute
    schedule: ScheduleRule | None
    supports: Callable[[str, Node], bool]
    # see the module docstring (dequant_linear: a batched step's T <= --max-batch takes another tile than a prefill's)
    bounded: bool = False


def param_kernel(params: Callable[[Node], dict], build: Callable[[dict, str], "tvm.tirx.PrimFunc"],
                 key: str) -> tuple[Compute, ScheduleRule]:
    """(compute, schedule) of a kernel written per target kind from a parameter dict (the TVMScript-text kernels:
    attention, indexer): compute builds the host-CPU kernel from ``params(node)`` and carries the parameters as
    the function attr ``key``; the schedule rule rebuilds it for the compile target (``build(p, "llvm" |
    "cuda")``)."""

    def compute(node: Node):
        p = params(node)
        return build(p, "llvm").with_attr(key, json.dumps(p, sort_keys=True))

    def rule(kernel, target: tvm.target.Target, symbols: dict | None = None):
        attrs = kernel.func.attrs
        if attrs is None or key not in attrs:
            return None
        f = build(json.loads(str(attrs[key])), "cuda" if target.kind.name == "cuda" else "llvm")
        f = f.with_attr("global_symbol", attrs["global_symbol"]).with_attr("tirx.is_scheduled", True)
        return tvm.IRModule({"main": f})

    return compute, rule


def _every_kind(kind: str, node: Node) -> bool:
    return kind in cap.KINDS


def _moe_supports(params: Callable[[Node], dict], fits: Callable[[dict], bool]) -> Callable[[str, Node], bool]:
    return lambda kind, node: kind in cap.KINDS and fits(params(node))


def _int4_supports(kind: str, node: Node) -> bool:
    return kind in cap.KINDS and (node.op != "dequant_linear_int4"
                                  or cap.dequant_linear_int4_problem(dict(node.attr)) is None)


_attention = param_kernel(attention.params, attention.build, "dayzero.attention_params")
_indexer = param_kernel(indexer.params, indexer.build, "dayzero.indexer_params")
_compressed = param_kernel(compressed_attention.params, compressed_attention.build,
                           "dayzero.compressed_attention_params")

KERNELS: dict[str, Kernel] = {
    # grouped expert GEMMs over the routed experts only (passes/moe.py, passes/dequant.py)
    "moe_experts": Kernel(moe.prim_func, moe.schedule_rule, _moe_supports(
        moe.params, lambda p: cap.moe_experts(p["H"], p["GU"], p["I"], p["wt_dtype"], p["wd_dtype"]))),
    "moe_experts_mxfp4": Kernel(moe.prim_func_mxfp4, moe.schedule_rule, _moe_supports(
        moe.params_mxfp4, lambda p: cap.moe_experts_mxfp4(p["H"], p["GU"], p["I"]))),
    "moe_experts_fp8": Kernel(moe.prim_func_fp8, moe.schedule_rule, _moe_supports(
        moe.params_fp8, lambda p: cap.moe_experts_fp8(p["H"], p["GU"], p["I"]))),
    # MXFP4 experts converted into a workspace (passes/expert_workspace.py): host CPU, written scheduled
    "moe_experts_mxfp4_ws": Kernel(expert_workspace.prim_func, None, lambda kind, node: (
        kind in cap.WORKSPACE_KINDS and cap.moe_experts_mxfp4_ws(*expert_workspace.geometry(node)))),
    # dense linear over stored low-precision weights (passes/dequant.py)
    **{op: Kernel(dequant_linear.prim_func, dequant_linear.schedule_rule, _int4_supports, bounded=True)
       for op in dequant_linear.OPS},
    # attention reading only the cache rows a query sees (passes/sparse_attention.py)
    **{op: Kernel(*_attention, _every_kind)
       for op in ("cache_attention", "sparse_attention", "mla_sparse_attention", "mla_attention")},
    "dsa_indexer_topk": Kernel(*_indexer, _every_kind),
    "compressed_attention": Kernel(*_compressed, _every_kind),  # passes/compressed_attention.py
    # in-place writes into persistent state (passes/inplace_state.py, passes/paged_kv.py): written scheduled
    "state_index_put": Kernel(state.state_index_put, None, _every_kind),
    "paged_state_index_put": Kernel(state.paged_state_index_put, None, _every_kind),
    "assign": Kernel(state.assign, None, _every_kind),
    "scatter_inplace": Kernel(state.scatter_inplace, None, _every_kind),  # passes/inplace_input.py
}
