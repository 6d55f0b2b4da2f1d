"""The device mesh and the collective ops' semantics: what the sharding pass (passes/shard.py) and the runtime
(runtime/dist.py) agree on.

A mesh is named axes with sizes, ``(("tp", T), ("ep", E))``, over T*E ranks; rank r has coordinate
``r // (product of the later axes) % size`` on each axis (the last axis varies fastest). The group of axis ``a``
for rank r is the ranks that differ from r on ``a`` only; a collective names its group by its axis (attr
``group``) and carries the group's size (attr ``size``) so its shape rule needs no process group.

The ops (declared in ``dayzero_ops.py``), each over the ranks of its group, every rank with the same shape:

    all_reduce(x) [..]            sum of x over the group (attr ``reduce``: "sum")
    all_gather(x) [.., n*size, ..] the group's x concatenated along attr ``dim`` in group-rank order
    all_to_all(x) [n*size, ..]    chunk j of x (dim 0, ``size`` chunks) goes to group rank j; out chunk i came
                                  from group rank i
    group_rank()  int64 [1]       this rank's index in the group

They run with torch.distributed through the process groups the runtime registered here (``use_groups``); with
none registered a group of size 1 is the identity (a 1-rank mesh, and meta tensors for the shape rule).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dayzero import InternalError, UserError

MESH_AXES = ("tp", "ep")  # the axes dayzero's mesh has, outermost first
COLLECTIVES = ("all_reduce", "all_gather", "all_to_all", "group_rank")


@dataclass(frozen=True)
class Mesh:
    """Named axes and their sizes, outermost first; the last axis varies fastest over the ranks."""
    axes: tuple[tuple[str, int], ...] = ()

    @staticmethod
    def of(**sizes: int) -> "Mesh":
        """``Mesh.of(tp=1, ep=2)``: axes in MESH_AXES order; every size a positive int."""
        for name, size in sizes.items():
            if name not in MESH_AXES:
                raise UserError(f"mesh axis {name!r} is not one of {', '.join(MESH_AXES)}")
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise UserError(f"--{name} must be a positive integer, got {size!r}")
        return Mesh(tuple((a, sizes.get(a, 1)) for a in MESH_AXES))

    @staticmethod
    def from_json(obj) -> "Mesh":
        """program.json's ``mesh`` ({"tp": T, "ep": E}; absent or null: one rank), checked (untrusted input)."""
        if obj is None:
            return Mesh.of()
        if not isinstance(obj, dict) or set(obj) - set(MESH_AXES) or \
                not all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 1 << 16 for v in obj.values()):
            raise UserError(f"program.json: mesh {str(obj)[:80]} is not {{axis: size}} over {', '.join(MESH_AXES)}")
        return Mesh.of(**obj)

    def json(self) -> dict:
        return dict(self.axes)

    def size(self, axis: str) -> int:
        return dict(self.axes).get(axis, 1)

    @property
    def world(self) -> int:
        return math.prod(s for _, s in self.axes)

    def coord(self, rank: int, axis: str) -> int:
        """Rank's index on ``axis`` (its rank within that axis's group)."""
        inner = 1
        for name, size in reversed(self.axes):
            if name == axis:
                return rank // inner % size
            inner *= size
        raise InternalError(f"mesh has no axis {axis!r}")

    def group_ranks(self, rank: int, axis: str) -> list[int]:
        """The ranks of ``rank``'s group on ``axis``, in group-rank order."""
        return [r for r in range(self.world) if all(self.coord(r, a) == self.coord(rank, a)
                                                     for a, _ in self.axes if a != axis)]

    def groups(self, axis: str) -> list[list[int]]:
        """Every group on ``axis`` (torch.distributed.new_group must be called for each on every rank)."""
        seen: list[list[int]] = []
        for r in range(self.world):
            g = self.group_ranks(r, axis)
            if g not in seen:
                seen.append(g)
        return seen


# ---- the process groups of this process (registered by runtime/dist.py) -------------------------------------

_GROUPS: dict[str, tuple[object, int, int]] = {}  # axis -> (torch process group, size, this rank's index)


def use_groups(groups: dict[str, tuple[object, int, int]]) -> None:
    """Register this process's groups: axis -> (torch.distributed ProcessGroup, size, group rank)."""
    _GROUPS.clear()
    _GROUPS.update(groups)


def _group(name: str, size: int):
    """(process group or None for a 1-rank group, its rank of this process)."""
    g = _GROUPS.get(name)
    if g is None:
        if size != 1:
            raise InternalError(f"collective over group {name!r} of {size} ranks, but no process group is set up "
                                "(runtime/dist.py)")
        return None, 0
    pg, n, me = g
    if n != size:
        raise InternalError(f"collective over group {name!r} of {size} ranks; the process group has {n}")
    return pg, me


def run_collective(op: str, attrs: dict, x: torch.Tensor | None, out: torch.Tensor) -> None:
    """Run collective ``op`` reading ``x`` and writing ``out`` (preallocated, contiguous, the op's type): the
    runtime's step on arena views and the references below."""
    import torch.distributed as dist

    pg, me = _group(attrs["group"], attrs["size"])
    if op == "group_rank":
        out.fill_(me)
    elif op == "all_reduce":
        if attrs.get("reduce", "sum") != "sum":
            raise InternalError(f"all_reduce {attrs.get('reduce')!r}: only sum is supported")
        out.copy_(x)
        if pg is not None:
            dist.all_reduce(out, group=pg)
    elif op == "all_gather":
        if pg is None:
            out.copy_(x)
        else:
            parts = [torch.empty_like(x) for _ in range(attrs["size"])]
            dist.all_gather(parts, x.contiguous(), group=pg)
            torch.cat(parts, dim=attrs["dim"], out=out)
    elif op == "all_to_all":
        if pg is None:
            out.copy_(x)
        else:
            dist.all_to_all_single(out, x.contiguous(), group=pg)
    else:
        raise InternalError(f"{op} is not a collective")


def _reference(op: str):
    def ref(ins, attrs):
        x = ins[0] if ins else None
        if op == "group_rank":
            out = torch.empty(1, dtype=torch.int64, device=torch.get_default_device() if x is None else x.device)
        elif op == "all_gather":
            out = torch.cat([x] * attrs["size"], dim=attrs["dim"])
        else:
            if op == "all_to_all" and x.shape[0] % attrs["size"]:
                raise InternalError(f"all_to_all: dim 0 ({x.shape[0]}) is not a multiple of {attrs['size']}")
            out = torch.empty_like(x)
        if out.device.type != "meta":
            run_collective(op, attrs, x, out)
        return out
    return ref


all_reduce_reference = _reference("all_reduce")
all_gather_reference = _reference("all_gather")
all_to_all_reference = _reference("all_to_all")
group_rank_reference = _reference("group_rank")
