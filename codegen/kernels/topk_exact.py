"""torch.topk's exact CPU selection (ties included), as straight-line TIR text.

Why: torch.topk on CPU (ATen ``topk_impl_loop``, TopKImpl.h) fills a vector of (value, index) pairs and runs
libstdc++'s ``std::partial_sort`` (when ``k * 64 <= n``) or ``std::nth_element`` followed by ``std::sort`` of the
first ``k - 1`` pairs (``sorted=True``), with a comparator that looks at the VALUE only (NaN first, then ``>``).
Among equal values the result is therefore whatever those algorithms leave where: not the lowest index, not
stable. The DSA indexer produces exact ties (ReLU zeros; rows of -inf past the causal limit), and which of the
tied rows the top-k keeps changes the attention output (UPSTREAM_NOTES: a 0.1 logit difference). To select
exactly the rows upstream selects, the kernel runs the same algorithms on the same array: introselect
(median-of-three pivot, unguarded partition, heap-select fallback at depth 2*lg(n), insertion sort below 4
elements), heap select + sort_heap, introsort (threshold 16, heapsort fallback) + final insertion sort, written
after libstdc++'s ``bits/stl_algo.h`` / ``bits/stl_heap.h`` (GCC 12/13; unchanged for years). The recursion of
introsort becomes an explicit stack (its sub-ranges are disjoint, so the processing order does not change the
result).

``program(...)`` returns the statements as text in a small subset shared by TVMScript and Python: buffers ``V``
(values) and ``I`` (int64 indices) hold the row, ``r`` is an int64 scratch buffer of ``SLOTS`` named registers,
``hv``/``hi`` hold one moved pair; ``TDIV`` is C's truncating division and ``ISNAN`` the NaN test.
``python_topk`` runs the same text in Python (a development aid: it is how the text was checked against
torch.topk before it was compiled); the kernels substitute the TIR spellings.
"""

from __future__ import annotations

THRESHOLD = 16  # libstdc++ _S_threshold
STACK = 128  # introsort stack entries (3 registers each); depth is bounded by 2*lg(n) + 1 <= 127 for n < 2^63


class _Emit:
    def __init__(self):
        self.lines: list[str] = []
        self.depth = 0
        self.slots: dict[str, int] = {}

    def reg(self, name: str) -> str:
        if name not in self.slots:
            self.slots[name] = len(self.slots)
        return f"r[{self.slots[name]}]"

    def __call__(self, line: str) -> None:
        self.lines.append("    " * self.depth + line)

    def block(self, head: str):
        emit = self

        class _B:
            def __enter__(self_):
                emit(head)
                emit.depth += 1

            def __exit__(self_, *a):
                emit.depth -= 1
        return _B()


def _less(a: str, b: str) -> str:
    """The torch comparator for largest=True: a before b iff (isnan(a) and not isnan(b)) or a > b."""
    return f"((ISNAN({a}) and not ISNAN({b})) or {a} > {b})"


def _move(e: _Emit, dst: str, src: str) -> None:
    e(f"V[{dst}] = V[{src}]")
    e(f"I[{dst}] = I[{src}]")


def _swap(e: _Emit, a: str, b: str) -> None:
    t = e.reg("swp")
    e("hv2[0] = V[" + a + "]")
    e(f"{t} = I[{a}]")
    _move(e, a, b)
    e("V[" + b + "] = hv2[0]")
    e(f"I[{b}] = {t}")


def _adjust_heap(e: _Emit, first: str, hole0: str, length: str) -> None:
    """std::__adjust_heap(first, hole0, length, value=(hv[0], hi)) followed by std::__push_heap."""
    hole, top, sec, par = e.reg("ah_hole"), e.reg("ah_top"), e.reg("ah_sec"), e.reg("ah_par")
    e(f"{hole} = {hole0}")
    e(f"{top} = {hole}")
    e(f"{sec} = {hole}")
    with e.block(f"while {sec} < TDIV({length} - 1, 2):"):
        e(f"{sec} = 2 * ({sec} + 1)")
        with e.block(f"if {_less(f'V[{first} + {sec}]', f'V[{first} + {sec} - 1]')}:"):
            e(f"{sec} = {sec} - 1")
        _move(e, f"{first} + {hole}", f"{first} + {sec}")
        e(f"{hole} = {sec}")
    with e.block(f"if ({length} % 2) == 0 and {sec} == TDIV({length} - 2, 2):"):
        e(f"{sec} = 2 * ({sec} + 1)")
        _move(e, f"{first} + {hole}", f"{first} + {sec} - 1")
        e(f"{hole} = {sec} - 1")
    e(f"{par} = TDIV({hole} - 1, 2)")
    with e.block(f"while {hole} > {top} and {_less(f'V[{first} + {par}]', 'hv[0]')}:"):
        _move(e, f"{first} + {hole}", f"{first} + {par}")
        e(f"{hole} = {par}")
        e(f"{par} = TDIV({hole} - 1, 2)")
    e(f"V[{first} + {hole}] = hv[0]")
    e(f"I[{first} + {hole}] = {e.reg('hi')}")


def _hold(e: _Emit, src: str) -> None:
    e(f"hv[0] = V[{src}]")
    e(f"{e.reg('hi')} = I[{src}]")


def _make_heap(e: _Emit, first: str, last: str) -> None:
    length, par, go = e.reg("mh_len"), e.reg("mh_par"), e.reg("mh_go")
    e(f"{length} = {last} - {first}")
    with e.block(f"if {length} >= 2:"):
        e(f"{par} = TDIV({length} - 2, 2)")
        e(f"{go} = 1")
        with e.block(f"while {go} == 1:"):
            _hold(e, f"{first} + {par}")
            _adjust_heap(e, first, par, length)
            with e.block(f"if {par} == 0:"):
                e(f"{go} = 0")
            with e.block("else:"):
                e(f"{par} = {par} - 1")


def _pop_heap(e: _Emit, first: str, last: str, result: str) -> None:
    _hold(e, result)
    _move(e, result, first)
    _adjust_heap(e, first, "0", f"({last} - {first})")


def _heap_select(e: _Emit, first: str, middle: str, last: str) -> None:
    i = e.reg("hs_i")
    _make_heap(e, first, middle)
    e(f"{i} = {middle}")
    with e.block(f"while {i} < {last}:"):
        with e.block(f"if {_less(f'V[{i}]', f'V[{first}]')}:"):
            _pop_heap(e, first, middle, i)
        e(f"{i} = {i} + 1")


def _sort_heap(e: _Emit, first: str, last0: str) -> None:
    last = e.reg("sh_last")
    e(f"{last} = {last0}")
    with e.block(f"while {last} - {first} > 1:"):
        e(f"{last} = {last} - 1")
        _pop_heap(e, first, last, last)


def _swap_first_case(e, first, cases, otherwise) -> None:
    """``if c0: swap(first, p0) elif c1: swap(first, p1) ... else: swap(first, otherwise)`` for cases (c, p)."""
    for i, (cond, pick) in enumerate(cases):
        with e.block(f"{'if' if i == 0 else 'elif'} {cond}:"):
            _swap(e, first, pick)
    with e.block("else:"):
        _swap(e, first, otherwise)


def _partition_pivot(e: _Emit, first: str, last: str, cut: str) -> None:
    """cut = std::__unguarded_partition_pivot(first, last): median of (first+1, mid, last-1) to first, then the
    unguarded partition of [first+1, last) around it."""
    a, b, c = e.reg("pp_a"), e.reg("pp_b"), e.reg("pp_c")
    e(f"{a} = {first} + 1")
    e(f"{b} = {first} + TDIV({last} - {first}, 2)")
    e(f"{c} = {last} - 1")
    lt = lambda x, y: _less(f"V[{x}]", f"V[{y}]")  # noqa: E731
    with e.block(f"if {lt(a, b)}:"):
        _swap_first_case(e, first, [(lt(b, c), b), (lt(a, c), c)], a)
    with e.block("else:"):
        _swap_first_case(e, first, [(lt(a, c), a), (lt(b, c), c)], b)
    lo, hi, go = e.reg("up_lo"), e.reg("up_hi"), e.reg("up_go")
    e(f"{lo} = {first} + 1")
    e(f"{hi} = {last}")
    e(f"{go} = 1")
    with e.block(f"while {go} == 1:"):
        with e.block(f"while {lt(lo, first)}:"):
            e(f"{lo} = {lo} + 1")
        e(f"{hi} = {hi} - 1")
        with e.block(f"while {lt(first, hi)}:"):
            e(f"{hi} = {hi} - 1")
        with e.block(f"if {lo} < {hi}:"):
            _swap(e, lo, hi)
            e(f"{lo} = {lo} + 1")
        with e.block("else:"):
            e(f"{go} = 0")
    e(f"{cut} = {lo}")


def _linear_insert(e: _Emit, at: str) -> None:
    """std::__unguarded_linear_insert(at)."""
    last, nxt = e.reg("li_last"), e.reg("li_next")
    _hold(e, at)
    e(f"{last} = {at}")
    e(f"{nxt} = {at} - 1")
    with e.block(f"while {_less('hv[0]', f'V[{nxt}]')}:"):
        _move(e, last, nxt)
        e(f"{last} = {nxt}")
        e(f"{nxt} = {nxt} - 1")
    e(f"V[{last}] = hv[0]")
    e(f"I[{last}] = {e.reg('hi')}")


def _insertion_sort(e: _Emit, first: str, last: str) -> None:
    i, j = e.reg("is_i"), e.reg("is_j")
    e(f"{i} = {first} + 1")
    with e.block(f"while {i} < {last}:"):
        with e.block(f"if {_less(f'V[{i}]', f'V[{first}]')}:"):
            _hold(e, i)
            e(f"{j} = {i}")
            with e.block(f"while {j} > {first}:"):
                _move(e, j, f"{j} - 1")
                e(f"{j} = {j} - 1")
            e(f"V[{first}] = hv[0]")
            e(f"I[{first}] = {e.reg('hi')}")
        with e.block("else:"):
            _linear_insert(e, i)
        e(f"{i} = {i} + 1")


def _lg(e: _Emit, n: str, out: str) -> None:
    t = e.reg("lg_t")
    e(f"{out} = 0")
    e(f"{t} = {n}")
    with e.block(f"while {t} > 1:"):
        e(f"{t} = TDIV({t}, 2)")
        e(f"{out} = {out} + 1")


def program(n: str, k: int, sorted_: bool, scan: str | None = None) -> tuple[list[str], int]:
    """Statements that leave torch.topk(V[0:n], k, largest=True, sorted=sorted_) in V[0:k] / I[0:k] (n >= k,
    I[j] = j on entry). Returns (lines, registers used). Uses buffers V, I, r, hv [1], hv2 [1], stk [3*STACK].

    ``scan`` (k <= scan <= n): every V[j] with j >= scan is -inf, and only V[0:scan] / I[0:scan] need be set. On
    the partial_sort path the heap select then stops at ``scan``, with the same result: the heap holds k
    elements from its start, and a -inf never compares before one of them (the comparator is NaN first, then
    ``>``), so the rest of the row would never enter it. The nth_element path depends on the whole row's layout
    and reads all n."""
    e = _Emit()
    first, last, nth, dep, cut = e.reg("first"), e.reg("last"), e.reg("nth"), e.reg("depth"), e.reg("cut")
    with e.block(f"if {k} * 64 <= {n}:"):  # std::partial_sort(0, k, n)
        e(f"{first} = 0")
        _heap_select(e, first, str(k), scan or n)
        _sort_heap(e, first, str(k))
    with e.block("else:"):  # std::nth_element(0, k - 1, n), then std::sort(0, k - 1)
        e(f"{first} = 0")
        e(f"{last} = {n}")
        e(f"{nth} = {k - 1}")
        _lg(e, n, dep)
        e(f"{dep} = 2 * {dep}")
        go = e.reg("is_go")
        e(f"{go} = 1")
        with e.block(f"while {go} == 1 and {last} - {first} > 3:"):
            with e.block(f"if {dep} == 0:"):
                _heap_select(e, first, f"({nth} + 1)", last)
                _swap(e, first, nth)
                e(f"{go} = 0")
            with e.block("else:"):
                e(f"{dep} = {dep} - 1")
                _partition_pivot(e, first, last, cut)
                with e.block(f"if {cut} <= {nth}:"):
                    e(f"{first} = {cut}")
                with e.block("else:"):
                    e(f"{last} = {cut}")
        with e.block(f"if {go} == 1 and {first} < {last}:"):
            _insertion_sort(e, first, last)
        if sorted_ and k - 1 > 0:
            _introsort(e, k - 1)
    return e.lines, len(e.slots)


def _introsort(e: _Emit, m: int) -> None:
    """std::sort(0, m): the introsort loop over an explicit stack, then the final insertion sort."""
    sp, f, l, d, cut = e.reg("st_sp"), e.reg("st_f"), e.reg("st_l"), e.reg("st_d"), e.reg("st_cut")
    e(f"{sp} = 1")
    e("stk[0] = 0")
    e(f"stk[1] = {m}")
    _lg(e, str(m), d)
    e(f"stk[2] = 2 * {d}")
    with e.block(f"while {sp} > 0:"):
        e(f"{sp} = {sp} - 1")
        e(f"{f} = stk[3 * {sp}]")
        e(f"{l} = stk[3 * {sp} + 1]")
        e(f"{d} = stk[3 * {sp} + 2]")
        with e.block(f"while {l} - {f} > {THRESHOLD}:"):
            with e.block(f"if {d} == 0:"):  # std::__partial_sort(f, l, l): heapsort
                _heap_select(e, f, l, l)
                _sort_heap(e, f, l)
                e(f"{l} = {f}")
            with e.block("else:"):
                e(f"{d} = {d} - 1")
                _partition_pivot(e, f, l, cut)
                e(f"stk[3 * {sp}] = {cut}")
                e(f"stk[3 * {sp} + 1] = {l}")
                e(f"stk[3 * {sp} + 2] = {d}")
                e(f"{sp} = {sp} + 1")
                e(f"{l} = {cut}")
    # std::__final_insertion_sort(0, m)
    if m > THRESHOLD:
        _insertion_sort(e, "0", str(THRESHOLD))
        i = e.reg("fi_i")
        e(f"{i} = {THRESHOLD}")
        with e.block(f"while {i} < {m}:"):
            _linear_insert(e, i)
            e(f"{i} = {i} + 1")
    else:
        _insertion_sort(e, "0", str(m))


def tir_text(n: str, k: int, sorted_: bool, indent: str, scan: str | None = None) -> tuple[str, int]:
    """The program in TVMScript spelling, each line prefixed with ``indent``."""
    lines, nreg = program(n, k, sorted_, scan)
    out = "\n".join(indent + ln.replace("TDIV(", "T.truncdiv(").replace("ISNAN(", "T.isnan(") for ln in lines)
    return out + "\n", nreg


def python_topk(values, k: int, sorted_: bool = True, scan: int | None = None) -> list[int]:
    """Run the same program in Python on a list of float32 values: the indices torch.topk returns (``scan``: as
    ``program``'s, the row past it is -inf)."""
    import math

    import numpy as np

    lines, nreg = program("n", k, sorted_, None if scan is None else "scan")
    src = "def _run(V, I, r, hv, hv2, stk, n, scan):\n" + "".join("    " + ln + "\n" for ln in lines)
    env = {"TDIV": lambda a, b: int(a / b) if (a < 0) != (b < 0) and a % b else a // b,
           "ISNAN": math.isnan}
    exec(src, env)
    V = [float(x) for x in np.asarray(values, dtype=np.float32)]
    I = list(range(len(V)))
    env["_run"](V, I, [0] * nreg, [0.0], [0.0], [0] * (3 * STACK), len(V), scan)
    return I[:k]
