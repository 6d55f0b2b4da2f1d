"""Several ranks: the process groups of a sharded artifact's mesh, on torch.distributed, and its collective steps.

A sharded artifact (``dayzero compile --ep E``) runs as ``torchrun --nproc-per-node N -m dayzero run ART ...``:
torchrun sets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, ``setup`` joins the default process group (gloo on
CPU, NCCL for a CUDA target) with a timeout and makes one group per mesh axis (passes/ir/collective.py), and each
collective step of a program runs on the arena views of its buffers between kernels (``step``). ``torchrun ...
-m dayzero serve ART`` serves one (runtime/lockstep.py: rank 0 serves, every rank steps with it).

Failures give one line on every rank instead of a hang: a world size other than the artifact's is refused before
any rank connects (each rank reads WORLD_SIZE), and a collective whose peer died or stalled fails after the
process group's timeout (``timeout_s``) with a UserError naming the step.
"""

from __future__ import annotations

import atexit
import os
from datetime import timedelta

import torch

from dayzero import UserError
from dayzero.passes.ir.collective import Mesh, run_collective, use_groups

DEFAULT_TIMEOUT_S = 120.0  # seconds a collective (and the rendezvous) may wait for the other ranks


class RankFailure(UserError):
    """A collective failed: a peer rank died or stalled past the process group's timeout. Serving ends the rank
    on it (runtime/lockstep.py) instead of failing one request."""


def _leave() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.barrier()  # every rank done with its last collective before any tears the group down
        except RuntimeError:  # a peer already gone: nothing to wait for
            pass
        dist.destroy_process_group()


def exit_rank(code) -> None:
    """End this process now if it is a rank of a process group: leave the group, flush, ``os._exit(code)``.
    The C++ destructors that a normal interpreter exit runs after that (gloo's and the kernels' thread pools)
    abort a rank now and then on a loaded host ("terminate called without an active exception", SIGABRT), after
    its work and output are done. A process outside a process group returns (and exits normally)."""
    import sys

    import torch.distributed as dist

    if not dist.is_initialized():
        return
    _leave()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else (0 if code is None else 1))


def launch_hint(mesh: Mesh) -> str:
    return f"torchrun --nproc-per-node {mesh.world} -m dayzero run ART ..."


def setup(mesh: Mesh, target_kind: str = "llvm", timeout_s: float = DEFAULT_TIMEOUT_S) -> int:
    """Join (or reuse) the default process group for ``mesh`` and register one group per axis of more than one
    rank; returns this process's rank (0 for a 1-rank mesh, which needs no torch.distributed at all)."""
    import torch.distributed as dist

    axes = ", ".join(f"{a} {s}" for a, s in mesh.axes if s > 1)
    if mesh.world == 1:
        use_groups({})
        return 0
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
            raise UserError(f"this artifact is sharded over {mesh.world} ranks ({axes}): run it under "
                            f"`{launch_hint(mesh)}`")
        world = os.environ["WORLD_SIZE"]
        if world != str(mesh.world):
            raise UserError(f"this artifact is sharded over {mesh.world} ranks ({axes}) but WORLD_SIZE is "
                            f"{world[:20]}: launch `{launch_hint(mesh)}`")
        backend = "nccl" if target_kind == "cuda" else "gloo"
        try:
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        except (RuntimeError, ValueError) as e:
            raise UserError(f"rank {os.environ['RANK'][:8]}: joining the {mesh.world}-rank process group failed: "
                            f"{first_line(e)}") from None
        # torn down before the interpreter exits: a process group left to the C++ destructors aborts the rank
        # ("terminate called without an active exception", SIGABRT) after its work is done
        atexit.register(_leave)
    elif dist.get_world_size() != mesh.world:
        raise UserError(f"this artifact is sharded over {mesh.world} ranks ({axes}) but the process group has "
                        f"{dist.get_world_size()}")
    rank = dist.get_rank()
    groups = {}
    for axis, size in mesh.axes:
        if size == 1:
            continue
        for ranks in mesh.groups(axis):  # every rank creates every group (torch.distributed's rule)
            pg = dist.group.WORLD if len(ranks) == mesh.world else \
                dist.new_group(ranks, timeout=timedelta(seconds=timeout_s))
            if rank in ranks:
                groups[axis] = (pg, size, ranks.index(rank))
    use_groups(groups)
    return rank


def step(op: str, attrs: dict, node: str):
    """The callable of a collective step: ``f(*arena views)`` (the input, if any, then the output)."""
    def run(*views: torch.Tensor) -> None:
        try:
            run_collective(op, attrs, views[0] if len(views) > 1 else None, views[-1])
        except RuntimeError as e:  # gloo / NCCL: a peer closed the connection, or the timeout passed
            import torch.distributed as dist

            rank = dist.get_rank() if dist.is_initialized() else 0
            raise RankFailure(f"rank {rank}: {node} failed (a rank died or stalled past the timeout): "
                            f"{first_line(e)}") from None
    run.torch_views = True  # the executor hands it torch views of the arena, not TVM tensors
    return run


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:200]
