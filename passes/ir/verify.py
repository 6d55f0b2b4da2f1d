"""The IR verifier: invariants as code. Runs after every pass in tests (and on request with --verify).

Structural checks (always): every op is registered and its inputs/attrs fit its signature; dtypes are known;
every dimension is a non-negative int or an expression over declared symbols; input names are unique;
``getitem`` picks an existing output with its type; views keep the element count.

Shape check (``check_shapes``): evaluates every op's reference on ``meta`` tensors at concrete symbol values and
compares the inferred dtypes and shapes with the node's types. That is ATen's own shape rule for ATen ops.
"""

from __future__ import annotations

import sympy
import torch

from dayzero import InternalError
from . import ops
from .collective import COLLECTIVES, MESH_AXES
from .node import Graph, Node, TensorType


class VerifyError(InternalError):
    def __init__(self, node: Node | None, msg: str):
        where = f" [{node.op} at {node.span}]" if node is not None else ""
        super().__init__(f"IR verification failed{where}: {msg}")
        self.node = node


def _numel(shape):
    return sympy.Mul(*shape) if shape else sympy.Integer(1)


def verify(g: Graph) -> None:
    symbols = {s for s, _, _ in g.symbols}
    for s, lo, hi in g.symbols:
        if not (0 <= lo <= hi):
            raise VerifyError(None, f"symbol {s} has bounds [{lo}, {hi}]")
    names = set()
    for n in g.inputs:
        if n.op != "input":
            raise VerifyError(n, "graph input is not an input node")
        nm = n.attr["name"]
        if nm in names:
            raise VerifyError(n, f"input name {nm!r} used twice")
        names.add(nm)
    for n in g.nodes():
        try:
            od = ops.get(n.op)
        except InternalError as e:
            raise VerifyError(n, str(e)) from None
        if not n.types:
            raise VerifyError(n, "node has no output type")
        for t in n.types:
            if t.dtype not in ops.DTYPE_BYTES:
                raise VerifyError(n, f"unknown dtype {t.dtype}")
            for d in t.shape:
                if isinstance(d, int):
                    if d < 0:
                        raise VerifyError(n, f"negative dimension {d}")
                elif not {s.name for s in d.free_symbols} <= symbols:
                    raise VerifyError(n, f"dimension {d} uses undeclared symbols")
        if n.op == "input" and n not in g.inputs:
            raise VerifyError(n, "input node not listed among the graph's inputs")
        if n.op in ("input", "weight"):
            if n.inputs or not isinstance(n.attr.get("name"), str):
                raise VerifyError(n, f"{n.op} needs a name and no inputs")
            continue
        if n.op == "getitem":
            idx = n.attr.get("index")
            if len(n.inputs) != 1 or not isinstance(idx, int) or not 0 <= idx < len(n.inputs[0].types):
                raise VerifyError(n, "getitem picks an output that does not exist")
            if n.types[0] != n.inputs[0].types[idx]:
                raise VerifyError(n, "getitem type differs from the output it picks")
            continue
        if n.op == "fused":
            _verify_body(n)
        if od.aten is not None:
            try:
                od.unflatten([None] * len(n.inputs), n.attr)  # type: ignore[list-item]
            except (KeyError, StopIteration) as e:
                raise VerifyError(n, f"inputs/attrs do not fit {od.doc}: {e}") from None
            expected = _count_inputs(od, n.attr)
            if expected != len(n.inputs):
                raise VerifyError(n, f"{len(n.inputs)} inputs, signature takes {expected}")
        if n.op in COLLECTIVES:
            _check_collective(n)
        if od.view and n.op != "getitem":
            if sympy.simplify(_numel(n.inputs[0].shape) - _numel(n.shape)) != 0:
                raise VerifyError(n, "view changes the number of elements")


def _verify_body(n: Node) -> None:
    """A ``fused`` body (passes/fuse.py): registered ops, each reading only the inputs and earlier entries, the
    last entry typed as the node."""
    body = n.attr.get("body")
    if not isinstance(body, tuple) or not body:
        raise VerifyError(n, "fused node without a body")
    for k, entry in enumerate(body):
        if not (isinstance(entry, tuple) and len(entry) == 5):
            raise VerifyError(n, f"fused body entry {k} is not (op, args, attrs, dtype, shape)")
        op, args, _attrs, dtype, shape = entry
        try:
            ops.get(op)
        except InternalError as e:
            raise VerifyError(n, f"fused body entry {k}: {e}") from None
        if any(not isinstance(a, int) or not 0 <= a < len(n.inputs) + k for a in args):
            raise VerifyError(n, f"fused body entry {k} ({op}) reads a value not defined before it")
    if (body[-1][3], tuple(body[-1][4])) != (n.dtype, tuple(n.shape)):
        raise VerifyError(n, "fused body's last entry is not typed as the node")


def _check_collective(n: Node) -> None:
    """A collective names a mesh axis and that group's size; its dtype and shape follow from its input."""
    a = n.attr
    size = a.get("size")
    if a.get("group") not in MESH_AXES or isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise VerifyError(n, f"group {a.get('group')!r} of size {size!r}: expected a mesh axis "
                             f"({', '.join(MESH_AXES)}) and a positive size")
    if n.op == "group_rank":
        if n.inputs or n.types[0] != TensorType("int64", (1,)):
            raise VerifyError(n, "group_rank takes no input and gives int64 [1]")
        return
    x, out = n.inputs[0].type, n.type
    if out.dtype != x.dtype:
        raise VerifyError(n, f"{x.dtype} in, {out.dtype} out")
    if n.op == "all_gather":
        d = a.get("dim")
        if not isinstance(d, int) or not 0 <= d < len(x.shape) or len(out.shape) != len(x.shape) or \
                sympy.simplify(out.shape[d] - size * x.shape[d]) != 0:
            raise VerifyError(n, f"all_gather along dim {d!r}: out {out.shape} is not {size}x {x.shape}")
    elif out.shape != x.shape:
        raise VerifyError(n, f"{n.op} keeps its input's shape {x.shape}, declared {out.shape}")
    elif n.op == "all_to_all" and (not x.shape or not isinstance(x.shape[0], int) or x.shape[0] % size):
        raise VerifyError(n, f"all_to_all: dim 0 of {x.shape} is not a static multiple of {size}")
    elif n.op == "all_reduce" and a.get("reduce") != "sum":
        raise VerifyError(n, f"all_reduce {a.get('reduce')!r}: only sum")


def _count_inputs(od: ops.OpDef, attrs) -> int:
    k = 0
    for name, kind in od.args:
        if kind == ops.TENSOR:
            k += 1
        elif kind == ops.OPT_TENSOR:
            k += bool(attrs.get(name))
        elif kind == ops.TENSOR_LIST:
            k += attrs[name]
        elif kind == ops.OPT_TENSOR_LIST:
            k += sum(bool(p) for p in attrs[name])
    return k


def concrete_shape(shape, env: dict[str, int]) -> tuple[int, ...]:
    out = []
    for d in shape:
        if isinstance(d, int):
            out.append(d)
        else:
            out.append(int(d.subs({sympy.Symbol(k, integer=True, positive=True): v for k, v in env.items()})))
    return tuple(out)


def check_shapes(g: Graph, env: dict[str, int]) -> None:
    """Propagate meta tensors through the graph at symbol values ``env`` and compare with the declared types."""
    vals: dict[int, object] = {}
    for n in g.nodes():
        declared = [(t.dtype, concrete_shape(t.shape, env)) for t in n.types]
        od = ops.get(n.op)
        if n.op in ("input", "weight") or not od.meta_ok:
            vals[id(n)] = tuple(torch.empty(s, dtype=ops.torch_dtype(d), device="meta") for d, s in declared)
            if len(declared) == 1:
                vals[id(n)] = vals[id(n)][0]
            continue
        args = [vals[id(i)] for i in n.inputs]
        try:
            with torch.device("meta"):  # factories (arange, full) follow the default device
                out = od.call(args, n.attr, env)
        except Exception as e:  # noqa: BLE001 - report any shape-rule failure on this node
            raise VerifyError(n, f"shape rule failed: {type(e).__name__}: {e}") from None
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        got = [(ops.dtype_name(o.dtype), tuple(o.shape)) for o in outs]
        if got != declared:
            raise VerifyError(n, f"declared {declared}, the op computes {got}")
        vals[id(n)] = out if len(outs) > 1 else outs[0]
