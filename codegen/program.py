"""From an optimised graph to an executable program: buffers, kernels and steps.

    Graph ──► buffers   one per value; views (reshape, getitem, ...) alias their source's buffer
          ──► kernels   one PrimFunc per distinct (op, attrs, types): the two layers of a model share kernels
          ──► steps     [(kernel, argument buffers)] in topological order

A value with no elements at any binding (a static 0 in its shape, see passes/fold_empty.py) gets a buffer of 0
bytes and no kernel: nothing computes it, nothing reads its bytes.

Every buffer has a symbolic shape and a zone (``weights``, ``io``, ``activations``); the memory plan (the last
pass) gives it an offset in the arena, sized at the symbols' declared upper bounds.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import sympy
import tvm
from tvm import te

from dayzero import InternalError, UnsupportedOpsError
from dayzero.passes.ir import ops
from dayzero.passes.ir.collective import COLLECTIVES
from dayzero.passes.ir.node import Graph, Node, TensorType
from dayzero.passes.ir.text import _value
from . import lower
from .kernels.table import KERNELS


@dataclass
class BufferInfo:
    id: int
    dtype: str
    shape: tuple  # ints and sympy expressions
    zone: str  # weights | io | activations
    alias_of: int | None = None  # views share the bytes of another buffer
    weight: str | None = None  # weights: the manifest name
    state: str | None = None  # persistent state (KV cache, cross-layer state): its name
    name: str | None = None  # io: input name / output index
    input_kind: str | None = None  # io: an input the runtime passes, not the caller (dayzero_ops.INPUT_KINDS)

    def max_bytes(self, bounds: dict[str, int]) -> int:
        n = 1
        for d in self.shape:
            n *= d if isinstance(d, int) else int(d.subs({s: bounds[s.name] for s in d.free_symbols}))
        return n * ops.DTYPE_BYTES[self.dtype]


@dataclass
class Kernel:
    name: str
    op: str
    func: tvm.tirx.PrimFunc
    key: str
    span: str = ""
    route: str = "default"  # hand-scheduled | tuned | default | generic (set by codegen/schedule.py)
    node: Node | None = None  # the first node that uses it (to re-lower it specialised)
    tuned: dict | None = None  # where tuned: {"default_s", "tuned_s", "trials"} from the tuning record


@dataclass
class Step:
    kernel: str
    args: list[int]  # buffer ids: inputs then outputs
    node: str  # op and span, for reports and errors
    symbols: list[str] = field(default_factory=list)  # trailing scalar arguments: symbol values
    outputs: int = 1  # the last `outputs` of args are written
    layer: tuple[str, int] | None = None  # the repeated block (decoder layer) of its node's span, if any
    # a collective the runtime runs with torch.distributed (passes/ir/collective.py), no kernel:
    # {"op": ..., and the node's attrs (group, size, ...)}; kernel is "" then
    collective: dict | None = None


@dataclass
class Program:
    name: str
    symbols: list[tuple[str, int, int]]
    buffers: list[BufferInfo] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    inputs: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    kernels: dict[str, Kernel] = field(default_factory=dict)
    input_ranges: dict[str, list[int]] = field(default_factory=dict)  # input name -> [lo, hi) of its values


def check_supported(g: Graph) -> None:
    """Raise one error naming every op that has no lowering, with its upstream source line."""
    bad = []
    seen = set()
    for n in g.nodes():
        if n.op in ("input", "weight", "state", *COLLECTIVES) or ops.get(n.op).view or _no_kernel(n):
            continue
        if n.op not in lower.LOWERINGS and n.op not in KERNELS and (n.op, str(n.span)) not in seen:
            seen.add((n.op, str(n.span)))
            bad.append((n.op, str(n.span) or "<unknown>"))
    if bad:
        raise UnsupportedOpsError(bad)


def _no_kernel(n: Node) -> bool:
    """Every output is statically empty: there is nothing to compute (an in-place op still has its write)."""
    return not ops.get(n.op).inplace and all(t.is_empty for t in n.types)


def _kernel_key(n: Node, symbols: dict[str, tuple[int, int]]) -> str:
    """op, attributes, input and output types; for a kernel whose schedule reads them (``KERNELS[op].bounded``),
    the program's bounds on the symbols of those types."""
    ins = ";".join(f"{i.dtype}{list(map(str, i.shape))}" for i in n.inputs)
    outs = ";".join(f"{t.dtype}{list(map(str, t.shape))}" for t in n.types)
    attrs = ",".join(f"{k}={_value(v)}" for k, v in n.attrs)
    key = f"{n.op}|{attrs}|{ins}|{outs}"
    hand = KERNELS.get(n.op)
    if hand is not None and hand.bounded:
        used = set().union(*(t.free_symbols() for t in (*(i.type for i in n.inputs), *n.types)))
        key += "|" + ",".join(f"{s}={list(symbols[s])}" for s in sorted(used) if s in symbols)
    return key


def _safe(op: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in op)


def kernel_name(op: str, key: str) -> str:
    """A kernel's symbol: its op and a digest of its key (``_kernel_key``: op, attributes, input and output types,
    and the symbol bounds a ``bounded`` kernel's schedule reads), so the same
    kernel has the same name in every compile (the kernel cache keys on the scheduled function, name included: a
    name numbered by position changed whenever an earlier kernel was added or removed, and a sharded or otherwise
    varied compile of a model found almost none of its kernels in the cache)."""
    return f"{_safe(op)}_{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def make_prim_func(n: Node, name: str, bind: dict[str, int] | None = None) -> tvm.tirx.PrimFunc:
    """The node's kernel: a hand-written PrimFunc (``codegen/kernels/table.py``) or the TE compute of its lowering.

    Argument order is always the node's inputs, then its outputs, then any symbol passed as a scalar.
    ``bind`` specialises symbols to values (a static-shape copy for tuning or a decode-sized kernel)."""
    hand = KERNELS.get(n.op)
    if hand is not None:
        f = hand.compute(n)
        if f is not None:
            extra = f.attrs.get("dayzero.scalar_symbols", []) if f.attrs is not None else []
            return f.with_attr("global_symbol", name).with_attr("dayzero.scalar_symbols", list(extra))
    ctx = lower.Ctx(bind)
    phs = [te.placeholder(ctx.shape(i.shape), dtype=i.dtype, name=f"in{k}") for k, i in enumerate(n.inputs)]
    outs = lower.lower_node(ctx, n.op, phs, n.attr, n.types)
    if len(outs) != len(n.types):
        raise InternalError(f"lowering of {n.op} gave {len(outs)} outputs for {len(n.types)}")
    for o, t in zip(outs, n.types):
        if o.dtype != t.dtype:
            raise InternalError(f"lowering of {n.op} gives {o.dtype}, the node is {t.dtype}")
    # a symbol used by the compute but not bare in any argument's shape (it only appears inside an
    # expression, or not at all) is passed as a trailing int64 scalar argument
    bare = {str(d) for t in phs + outs for d in t.shape if isinstance(d, tvm.tirx.Var)}
    extra = [v for s, v in sorted(ctx.vars.items()) if s not in bare]
    f = te.create_prim_func(phs + outs + extra)
    if n.op == "fused":
        f = lower.fused.inline_members(f)
    return f.with_attr("global_symbol", name).with_attr("dayzero.scalar_symbols", [v.name for v in extra])


def build_program(g: Graph, name: str = "prefill", shared: dict[str, Kernel] | None = None) -> Program:
    """``shared`` (kernel key -> Kernel) is passed to every program of one artifact, so they share kernels."""
    check_supported(g)
    prog = Program(name, [tuple(s) for s in g.symbols])
    buf_of: dict[int, list[int]] = {}  # node id -> buffer id per output
    by_key: dict[str, Kernel] = shared if shared is not None else {}
    names = {k.name: key for key, k in by_key.items()}

    def new_buffer(t: TensorType, zone: str, **kw) -> int:
        b = BufferInfo(len(prog.buffers), t.dtype, t.shape, zone, **kw)
        prog.buffers.append(b)
        return b.id

    out_nodes = {id(o) for o in g.outputs}
    bounds = g.symbol_bounds
    for n in g.nodes():
        if n.op == "input":
            bid = new_buffer(n.type, "io", name=n.attr["name"], input_kind=n.attr.get("kind"))
            prog.inputs.append(bid)
            buf_of[id(n)] = [bid]
            continue
        if n.op == "weight":
            buf_of[id(n)] = [new_buffer(n.type, n.attr.get("zone") or "weights", weight=n.attr["name"])]
            continue
        if n.op == "state":
            buf_of[id(n)] = [new_buffer(n.type, n.attr.get("zone") or "kv_cache", state=n.attr["name"])]
            continue
        od = ops.get(n.op)
        if od.view:
            src = buf_of[id(n.inputs[0])][n.attr["index"] if n.op == "getitem" else 0]
            root = prog.buffers[src].alias_of if prog.buffers[src].alias_of is not None else src
            buf_of[id(n)] = [new_buffer(n.type, prog.buffers[root].zone, alias_of=root)]
            continue
        if od.inplace:  # the kernel writes input 0's bytes; the output is a view of them
            src = buf_of[id(n.inputs[0])][0]
            root = prog.buffers[src].alias_of if prog.buffers[src].alias_of is not None else src
            outs = []
            buf_of[id(n)] = [new_buffer(n.type, prog.buffers[root].zone, alias_of=root)]
        else:
            zone = "io" if id(n) in out_nodes else "activations"
            outs = [new_buffer(t, zone) for t in n.types]
            buf_of[id(n)] = outs
            if _no_kernel(n):
                continue
        if n.op in COLLECTIVES:  # run by the runtime between kernels, on the same arena views
            args = [buf_of[id(i)][0] for i in n.inputs]
            prog.steps.append(Step("", args + outs, f"{n.op} at {n.span}", [], len(outs), n.span.layer,
                                   dict(n.attr, op=n.op)))
            continue
        key = _kernel_key(n, bounds)
        kernel = by_key.get(key)
        if kernel is None:
            kname = kernel_name(n.op, key)
            if kname in names:
                raise InternalError(f"two kernels named {kname}: {names[kname]!r} and {key!r}")
            names[kname] = key
            kernel = by_key[key] = Kernel(kname, n.op, make_prim_func(n, kname), key, str(n.span), node=n)
        kname = kernel.name
        prog.kernels[kname] = kernel
        syms = [str(x) for x in kernel.func.attrs["dayzero.scalar_symbols"]]
        args = [buf_of[id(i)][0] if len(i.types) == 1 else None for i in n.inputs]
        if None in args:
            raise InternalError(f"{n.op} reads a multi-output node directly")
        prog.steps.append(Step(kname, args + outs, f"{n.op} at {n.span}", syms, len(outs), n.span.layer))
    for o in g.outputs:
        prog.outputs.append(buf_of[id(o)][0])
    # an input used as embedding indices must be in [0, rows): checked by the runtime before any kernel reads
    for n in g.nodes():
        if n.op == "embedding" and n.inputs[1].op == "input":
            prog.input_ranges[n.inputs[1].attr["name"]] = [0, int(n.inputs[0].shape[0])]
    return prog


def structural_key(func: tvm.tirx.PrimFunc) -> str:
    return hashlib.sha256(str(tvm.ir.structural_hash(func)).encode()).hexdigest()[:16]


def dim_json(d) -> int | str:
    return d if isinstance(d, int) else sympy.sstr(d)


def program_json(prog: Program) -> dict:
    return {
        "name": prog.name,
        "symbols": [list(s) for s in prog.symbols],
        "inputs": prog.inputs,
        "input_ranges": prog.input_ranges,
        "outputs": prog.outputs,
        "buffers": [{"id": b.id, "dtype": b.dtype, "shape": [dim_json(d) for d in b.shape], "zone": b.zone,
                     "alias_of": b.alias_of, "weight": b.weight, "state": b.state, "name": b.name,
                     **({"input_kind": b.input_kind} if b.input_kind else {})}
                    for b in prog.buffers],
        "steps": [{"kernel": s.kernel, "args": s.args, "node": s.node, "symbols": s.symbols,
                   "outputs": s.outputs, **({"collective": s.collective} if s.collective else {})}
                  for s in prog.steps],
        "kernels": {k.name: {"op": k.op, "route": k.route, "span": k.span} for k in prog.kernels.values()},
    }


def dumps(obj) -> str:
    return json.dumps(obj, indent=1, sort_keys=True)

