"""In-place writes into persistent state (the KV cache): kernels TE cannot express, written as TIR.

    state_index_put(state [d0..dn], idx [S], values [d0..S..dn])   state[.., idx[s], ..] = values[.., s, ..]
    assign(state, value)                                             state[...] = value[...]
    scatter_inplace(x, index, src) {dim}                             x[.., index[i], ..] = src[i] along dim

All take their inputs only and write input 0's bytes (``OpDef.inplace``): the runtime passes the state buffer
itself (scatter_inplace: the program input's own buffer, passes/inplace_input.py). Symbolic dimensions (``seq``)
are bound from the argument shapes. Written scheduled: the outermost loop is parallel.
"""

from __future__ import annotations

import sympy
import tvm

from dayzero.codegen.tvmscript import from_source
from dayzero.passes.ir.node import Node


class _Dims:
    """Names every symbolic dimension expression ``d0, d1, ...`` (declared with T.int64())."""

    def __init__(self):
        self.names: dict = {}

    def __call__(self, d) -> str:
        if isinstance(d, int):
            return f"T.int64({d})"
        key = sympy.srepr(d)
        if key not in self.names:
            self.names[key] = f"d{len(self.names)}"
        return self.names[key]

    def decls(self) -> str:
        return "".join(f"    {n} = T.int64()\n" for n in self.names.values())


def _shape(dims: _Dims, shape) -> str:
    return "(" + ", ".join(dims(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def _func(params: list[str], matches: list[str], body: str, dims: _Dims) -> tvm.tirx.PrimFunc:
    src = (f"@T.prim_func\ndef main({', '.join(p + ': T.handle' for p in params)}):\n"
           '    T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})\n'
           + dims.decls() + "".join(f"    {m}\n" for m in matches) + body)
    return from_source(src)


def _loops(shape, dims: _Dims, indent: str = "    ") -> tuple[str, list[str]]:
    """A parallel outer loop and a grid over the rest; returns (code, loop variable names)."""
    names = [f"a{k}" for k in range(len(shape))]
    if not shape:
        return "", []
    code = f"{indent}for {names[0]} in T.parallel({dims(shape[0])}):\n"
    if len(shape) > 1:
        code += f"{indent}    for {', '.join(names[1:])} in T.grid({', '.join(dims(d) for d in shape[1:])}):\n"
    return code, names


def _row_write(state, idx, values, dim: int, table=None, block_size: int = 0):
    """state[.., row(idx[s]), ..] = values[.., s, ..] along ``dim``: row(p) = p, or through a paged cache's block
    table, table[p // bs] * bs + p % bs (passes/paged_kv.py), or with a per-token table [S, NT] (value row s
    through table row s) table[s, p // bs] * bs + p % bs."""
    dims = _Dims()
    ty = state.dtype
    matches = [f's = T.match_buffer(s_, {_shape(dims, state.shape)}, "{ty}")',
               f'p = T.match_buffer(p_, {_shape(dims, idx.shape)}, "{idx.dtype}")',
               f'v = T.match_buffer(v_, {_shape(dims, values.shape)}, "{values.dtype}")']
    loops, a = _loops(values.shape, dims)
    target = list(a)
    target[dim] = f"p[{a[dim]}]"
    if table is not None:
        matches.append(f't = T.match_buffer(t_, {_shape(dims, table.shape)}, "{table.dtype}")')
        pos, bs = f'T.Cast("int64", p[{a[dim]}])', f"T.int64({block_size})"
        # a per-token table [S, NT] (the batched decode step): value row s goes through table row s
        entry = f"{a[dim]}, {pos} // {bs}" if table.type.ndim == 2 else f"{pos} // {bs}"
        target[dim] = f'T.Cast("int64", t[{entry}]) * {bs} + {pos} % {bs}'
    indent = "            " if len(a) > 1 else "        "
    body = loops + f"{indent}s[{', '.join(target)}] = T.Cast(\"{ty}\", v[{', '.join(a)}])\n"
    return _func(["s_", "p_", "v_"] + (["t_"] if table is not None else []), matches, body, dims)


def state_index_put(n: Node):
    state, *idx, values = n.inputs
    present = list(n.attr["indices"])
    pos = [k for k, p in enumerate(present) if p]
    if len(pos) != 1 or len(idx) != 1 or idx[0].type.ndim != 1 or values.type.ndim != state.type.ndim:
        return None  # passes/inplace_state.py only creates the one-index-dim form
    return _row_write(state, idx[0], values, pos[0])


def paged_state_index_put(n: Node):
    """state[.., table[idx[s] // bs] * bs + idx[s] % bs, ..] = values[.., s, ..] (passes/paged_kv.py); a
    per-token table [S, NT]: table[s, idx[s] // bs]."""
    state, idx, values, table = n.inputs
    return _row_write(state, idx, values, int(n.attr["dim"]), table, int(n.attr["block_size"]))


def assign(n: Node):
    state, value = n.inputs
    dims = _Dims()
    matches = [f's = T.match_buffer(s_, {_shape(dims, state.shape)}, "{state.dtype}")',
               f'v = T.match_buffer(v_, {_shape(dims, value.shape)}, "{value.dtype}")']
    loops, a = _loops(state.shape, dims)
    indent = "            " if len(a) > 1 else "        "
    body = loops + f"{indent}s[{', '.join(a)}] = T.Cast(\"{state.dtype}\", v[{', '.join(a)}])\n"
    return _func(["s_", "v_"], matches, body, dims)


def scatter_inplace(n: Node):
    """x[i0, .., index[i], .., in] = src[i] along ``dim`` for every i of index's shape (torch's scatter_ with a
    src); an index outside [0, x.shape[dim]) writes nothing (torch would raise; no kernel writes out of bounds)."""
    x, index, src = n.inputs
    dim = int(n.attr["dim"]) % x.type.ndim
    dims = _Dims()
    matches = [f'x = T.match_buffer(x_, {_shape(dims, x.shape)}, "{x.dtype}")',
               f'p = T.match_buffer(p_, {_shape(dims, index.shape)}, "{index.dtype}")',
               f'v = T.match_buffer(v_, {_shape(dims, src.shape)}, "{src.dtype}")']
    loops, a = _loops(index.shape, dims)
    target = list(a)
    target[dim] = "r"
    indent = "            " if len(a) > 1 else "        "
    body = (loops + f'{indent}r = T.Cast("int64", p[{", ".join(a)}])\n'
            f"{indent}if r >= T.int64(0) and r < {dims(x.shape[dim])}:\n"
            f'{indent}    x[{", ".join(target)}] = T.Cast("{x.dtype}", v[{", ".join(a)}])\n')
    return _func(["x_", "p_", "v_"], matches, body, dims)
