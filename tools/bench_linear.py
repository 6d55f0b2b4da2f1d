"""``dayzero bench linear``: the ``linear`` kernel on its default route, before and after the CPU default tier
(issue 21 items 2 and 3), vs torch eager, side by side in one run.

Cases: square projections N = K = 2880 (gpt-oss width) and 64 (a tiny model's), at T = 1 (decode: T static, as
the decode program compiles it), 16 and 512 (prefill: T the symbol ``seq``, as the prefill program compiles it).
Contenders, all in this process on the runtime's thread pool (every core):

* ``dayzero``: the kernel through ``schedule_kernel`` today (``cpu_rules.dense_linear``, then parallelism by
  work size, ``parallel.py``);
* ``default_before``: the previous default, dlight's CPU reduction rule then parallel loops, every parallel
  loop kept (what the route gave before this tier);
* ``torch_eager``: ``torch.nn.functional.linear`` on all its threads or one, the better (``best_torch_time``).

Each figure is the best of ``repeats`` timings (noise on a shared host only adds time). ``bound`` is the byte
bound: the bytes the op must read and write (x, w, out in fp32) over the read bandwidth measured in this run;
``gflops`` is 2 T N K over the time.
"""

from __future__ import annotations

import json

import click

from .bench_dequant import best_time, best_torch_time, read_bandwidth

WIDTHS = (2880, 64)
TOKENS = (1, 16, 512)


def _kernel(node, route):
    """The compiled kernel of ``node`` on ``route``: "now" (the schedule chain) or "before"."""
    import tvm

    from ..codegen import cpu_rules, program
    from ..codegen.program import Kernel
    from ..codegen.schedule import schedule_kernel
    from ..codegen.tuning import normalize
    from ..targets.host import host_target_dict

    t = tvm.target.Target(host_target_dict())
    func = program.make_prim_func(node, "k")
    if route == "now":
        mod = schedule_kernel(Kernel("k", "linear", func, "key", node=node), t, None)
    else:
        mod = cpu_rules.dlight_reduction(normalize(func), t) or cpu_rules.parallel_loops(normalize(func), t)
    return tvm.compile(mod, target=t)["main"]


def _linear_node(tokens, width):
    """linear(x [tokens, width], w [width, width]); tokens None: the symbol ``seq``."""
    import sympy

    from ..passes.ir.node import Node, TensorType

    t = sympy.Symbol("seq", integer=True, positive=True) if tokens is None else tokens
    ins = [Node.make("input", (), {"name": "x"}, [TensorType("float32", (t, width))]),
           Node.make("input", (), {"name": "w"}, [TensorType("float32", (width, width))])]
    return Node.make("linear", ins, {"bias": False}, [TensorType("float32", (t, width))])


def run_bench(quick: bool = False) -> dict:
    import torch

    from ..runtime.executor import use_all_cores
    from ..targets.host import host_target_dict
    from .bench import machine_info

    threads = use_all_cores()
    bw = read_bandwidth(256 << 20)
    gen = torch.Generator().manual_seed(0)
    results = []
    for width in WIDTHS:
        kernels = {}
        for tokens in TOKENS[:2] if quick else TOKENS:
            static = 1 if tokens == 1 else None  # decode compiles T = 1; prefill the symbol seq
            if static not in kernels:
                node = _linear_node(static, width)
                kernels[static] = {r: _kernel(node, r) for r in ("now", "before")}
            x = torch.randn(tokens, width, generator=gen)
            w = torch.randn(width, width, generator=gen) / width ** 0.5
            y = torch.empty(tokens, width)
            ref = torch.nn.functional.linear(x, w)
            err = {}
            for r, f in kernels[static].items():
                y.zero_()
                f(x, w, y)
                err[r] = float((y - ref).abs().max() / ref.abs().max())
            rep = 3 if tokens * width * width > 10 ** 8 else 20
            inner = 1 if tokens * width * width > 10 ** 6 else 50
            now, before = (best_time(lambda f=kernels[static][r]: f(x, w, y), rep, inner) for r in ("now", "before"))
            eager, eager_threads = best_torch_time(lambda: torch.nn.functional.linear(x, w), rep,
                                                   timer=lambda fn, n: best_time(fn, n, inner))
            nbytes = 4 * (tokens * width * 2 + width * width)
            results.append({
                "case": f"linear_{width}x{width}_T{tokens}", "unit": "s", "dayzero": now,
                "baselines": {"default_before": before, "torch_eager": eager},
                "bound": nbytes / bw, "bound_name": "bytes/read_bandwidth",
                "gflops": 2 * tokens * width * width / now / 1e9,
                "speedup_vs_default_before": before / now, "ratio_vs_torch_eager": eager / now,
                "torch_threads": eager_threads, "max_rel_err": err,
            })
    return {"suite": "linear", "machine": dict(machine_info(), target=host_target_dict(), tvm_threads=threads,
                                               read_bandwidth_GBps=round(bw / 1e9, 2)), "results": results}


@click.command("linear")
@click.option("--json", "as_json", is_flag=True, help="Print the bench JSON object.")
@click.option("--quick", is_flag=True, help="T = 1 and 16 only.")
def linear_command(as_json: bool, quick: bool):
    """The linear kernel's default route, before and after the CPU default tier, vs torch eager."""
    out = run_bench(quick=quick)
    click.echo(json.dumps(out, indent=1) if as_json else "\n".join(_line(r) for r in out["results"]))


def _line(r: dict) -> str:
    b = r["baselines"]
    return (f"{r['case']:24s} {r['dayzero'] * 1e6:10.1f} us  before {b['default_before'] * 1e6:10.1f} us  "
            f"eager {b['torch_eager'] * 1e6:10.1f} us  x{r['speedup_vs_default_before']:.1f} vs before, "
            f"{r['ratio_vs_torch_eager']:.2f}x eager, {r['gflops']:.1f} GFLOP/s, bound {r['bound'] * 1e6:.1f} us")


if __name__ == "__main__":
    linear_command()
