"""``dayzero bench ops``: each op family at the shapes real models use, on dayzero's default route (no tuning) vs
torch eager, side by side in one run, with the FLOP or byte bound (issue 21 item 6).

Families and shapes:

* ``linear`` fp32: projections 2880 x 2880 (gpt-oss), 7168 -> 2048 and 2048 -> 7168 (DeepSeek-V3's hidden and
  expert widths) at T = 1 (decode: T static, as the decode program compiles it), 16 and 512 (prefill: T the
  symbol ``seq``, as the prefill program compiles it); ``linear`` bf16: 2880 x 2880 at the same T;
* ``dequant_linear_bf16``: fp32 activations times a bf16 weight read as the checkpoint stores it (what a bf16
  checkpoint's projections and LM head compile to), 2880 x 2880 at the same T and a 32768-row slice of gpt-oss's
  LM head at T = 1; torch eager is ``F.linear`` on the activations rounded to bf16 (the same weight bytes; its
  ``max_rel_err`` is that rounding);
* ``bmm``: attention's scores and weighted sum when not hand-scheduled, 64 heads of 64 at 512 positions
  (q k^T [64, 512, 64] x [64, 64, 512] and p v [64, 512, 512] x [64, 512, 64]);
* ``softmax`` rows of 4K (attention) and 201,088 (gpt-oss's vocabulary); ``rms_norm`` rows of 2880 and 7168.

Each kernel is the op's IR node through ``schedule_kernel`` (the route a compiled model takes: hand-scheduled,
else the CPU default tier of ``codegen/cpu_rules.py``, then parallelism by work size) on the runtime's thread pool
(every core); ``route`` and ``cpu_rule`` say which schedule it got. torch eager runs on all its threads or one, the
better (``best_torch_time``). Each figure is the best of ``repeats`` timings (noise on a shared host only adds time).

``bound`` is the physical lower bound measured in this run: the larger of FLOPs / peak (the peak is torch's fp32
``mm`` of 2048^3 here, the best this machine showed) and bytes / read bandwidth (a torch sum over an array of the
case's own byte count, so a working set that stays in cache gets the cache's bandwidth).
ResNet-50 and its convolutions: ``dayzero bench cnn`` (tools/bench_cnn.py). Not here yet: the tuned route.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

import click

from .bench_dequant import best_time, best_torch_time, read_bandwidth

TOKENS = (1, 16, 512)
PROJECTIONS = ((2880, 2880), (2048, 7168), (7168, 2048))  # (out N, in K)


@dataclass
class Case:
    """One op at one shape: its IR node, inputs for the run, the torch eager call, its FLOPs and bytes."""
    name: str
    family: str
    node: object
    inputs: Callable[[object], list]  # generator -> input tensors (the sizes of the run, symbols bound)
    eager: Callable[[list], object]
    flops: float
    nbytes: float


def _sym():
    import sympy

    return sympy.Symbol("seq", integer=True, positive=True)


def _inputs(*specs):
    """Node inputs ``x0, x1, ..`` of (dtype, shape)."""
    from ..passes.ir.node import Node, TensorType

    return [Node.make("input", (), {"name": f"x{i}"}, [TensorType(d, s)]) for i, (d, s) in enumerate(specs)]


def _randn(gen, shape, dtype="float32", scale=1.0):
    import torch

    return (torch.randn(*shape, generator=gen) * scale).to(getattr(torch, dtype))


def linear_case(tokens: int, n: int, k: int, dtype: str = "float32") -> Case:
    import torch

    from ..passes.ir.node import Node, TensorType

    rows = 1 if tokens == 1 else _sym()  # decode compiles T = 1; prefill the symbol seq
    node = Node.make("linear", _inputs((dtype, (rows, k)), (dtype, (n, k))), {"bias": False},
                     [TensorType(dtype, (rows, n))])
    esize = 2 if dtype == "bfloat16" else 4
    return Case(f"linear_{dtype}_{n}x{k}_T{tokens}", "linear", node,
                lambda g: [_randn(g, (tokens, k), dtype), _randn(g, (n, k), dtype, k ** -0.5)],
                lambda xs: torch.nn.functional.linear(*xs), 2.0 * tokens * n * k,
                esize * (tokens * k + n * k + tokens * n))


def bf16_weight_case(tokens: int, n: int, k: int) -> Case:
    import torch

    from ..passes.ir.node import Node, TensorType

    rows = 1 if tokens == 1 else _sym()
    node = Node.make("dequant_linear_bf16", _inputs(("float32", (rows, k)), ("bfloat16", (n, k))), {"N": n, "K": k},
                     [TensorType("float32", (rows, n))])
    return Case(f"dequant_linear_bf16_{n}x{k}_T{tokens}", "linear", node,
                lambda g: [_randn(g, (tokens, k)), _randn(g, (n, k), "bfloat16", k ** -0.5)],
                lambda xs: torch.nn.functional.linear(xs[0].bfloat16(), xs[1]).float(), 2.0 * tokens * n * k,
                4 * tokens * (k + n) + 2 * n * k)


def bmm_case(name: str, b: int, m: int, k: int, n: int) -> Case:
    import torch

    from ..passes.ir.node import Node, TensorType

    node = Node.make("bmm", _inputs(("float32", (b, m, k)), ("float32", (b, k, n))), {},
                     [TensorType("float32", (b, m, n))])
    return Case(f"bmm_{name}_{b}x{m}x{k}x{n}", "bmm", node,
                lambda g: [_randn(g, (b, m, k)), _randn(g, (b, k, n))], lambda xs: torch.bmm(*xs),
                2.0 * b * m * n * k, 4 * b * (m * k + k * n + m * n))


def softmax_case(rows: int, width: int) -> Case:
    import torch

    from ..passes.ir.node import Node, TensorType

    node = Node.make("softmax.int", _inputs(("float32", (rows, width))), {"dim": -1, "dtype": None},
                     [TensorType("float32", (rows, width))])
    return Case(f"softmax_{rows}x{width}", "softmax", node, lambda g: [_randn(g, (rows, width))],
                lambda xs: torch.softmax(xs[0], -1), 4.0 * rows * width, 8 * rows * width)


def rms_norm_case(rows: int, width: int) -> Case:
    import torch

    from ..passes.ir.node import Node, TensorType

    node = Node.make("rms_norm", _inputs(("float32", (rows, width)), ("float32", (width,))),
                     {"normalized_shape": [width], "weight": True, "eps": 1e-6}, [TensorType("float32", (rows, width))])
    return Case(f"rms_norm_{rows}x{width}", "rms_norm", node, lambda g: [_randn(g, (rows, width)), _randn(g, (width,))],
                lambda xs: torch.nn.functional.rms_norm(xs[0], [width], xs[1], 1e-6), 4.0 * rows * width,
                4 * (2 * rows * width + width))


def cases(quick: bool = False) -> list[Case]:
    if quick:
        return [linear_case(t, 2880, 2880) for t in (1, 16)] + [softmax_case(512, 4096), rms_norm_case(16, 2880),
                                                                bmm_case("qk", 8, 128, 64, 128)]
    out = [linear_case(t, n, k) for n, k in PROJECTIONS for t in TOKENS]
    out += [linear_case(t, 2880, 2880, "bfloat16") for t in TOKENS]
    out += [bf16_weight_case(t, 2880, 2880) for t in TOKENS] + [bf16_weight_case(1, 32768, 2880)]
    out += [bmm_case("qk", 64, 512, 64, 512), bmm_case("pv", 64, 512, 512, 64)]
    out += [softmax_case(512, 4096), softmax_case(16, 201088), softmax_case(1, 201088)]
    out += [rms_norm_case(512, 2880), rms_norm_case(512, 7168), rms_norm_case(16, 7168)]
    return out


def compile_case(case: Case, target) -> tuple:
    """(compiled kernel, route, CPU default rule) of the case's node on the route a compiled model takes."""
    import tvm

    from ..codegen import program
    from ..codegen.cpu_rules import cpu_default_rule
    from ..codegen.program import Kernel
    from ..codegen.schedule import schedule_kernel
    from ..codegen.tuning import normalize

    func = program.make_prim_func(case.node, "k")
    kernel = Kernel("k", case.node.op, func, "key", node=case.node)
    mod = schedule_kernel(kernel, target, None)
    rule = cpu_default_rule(normalize(func), target)[0] if kernel.route == "default" else None
    return tvm.compile(mod, target=target)["main"], kernel.route, rule


def peak_flops() -> float:
    """fp32 FLOP/s of torch's ``mm`` at 2048^3 (all threads or one, the better): the compute bound's peak."""
    import torch

    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    return 2 * 2048 ** 3 / best_torch_time(lambda: torch.mm(a, b), 3)[0]


def run_bench(quick: bool = False, only: str | None = None) -> dict:
    import torch
    import tvm

    from ..runtime.executor import use_all_cores
    from ..targets.host import host_target_dict
    from .bench import machine_info

    threads = use_all_cores()
    target = tvm.target.Target(host_target_dict())
    peak = peak_flops()
    gen = torch.Generator().manual_seed(0)
    results = []
    for case in cases(quick):
        if only is not None and only not in case.name:
            continue
        lib, route, rule = compile_case(case, target)
        xs = case.inputs(gen)
        ref = case.eager(xs)
        out = torch.empty_like(ref)
        lib(*xs, out)
        err = float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))
        once = best_time(lambda: lib(*xs, out), 1)  # the timing loops' sizes from one call: ~20 ms a timing
        rep, inner = (3, 1) if once > 0.05 else (10, max(1, min(20, int(0.02 / max(once, 1e-6)))))
        now = best_time(lambda: lib(*xs, out), rep, inner)
        eager, eager_threads = best_torch_time(lambda: case.eager(xs), rep, timer=lambda fn, n: best_time(fn, n, inner))
        bw = read_bandwidth(max(int(case.nbytes), 1 << 20))
        t_flops, t_bytes = case.flops / peak, case.nbytes / bw
        click.echo(f"{case.name}: {now * 1e3:.3f} ms, eager {eager * 1e3:.3f} ms", err=True)
        results.append({
            "case": case.name, "family": case.family, "unit": "s", "dayzero": now,
            "baselines": {"torch_eager": eager}, "bound": max(t_flops, t_bytes),
            "bound_name": "flops/peak" if t_flops >= t_bytes else "bytes/read_bandwidth",
            "ratio_vs_torch_eager": eager / now, "gflops": case.flops / now / 1e9, "route": route, "cpu_rule": rule,
            "torch_threads": eager_threads, "max_rel_err": err, "read_bandwidth_GBps": round(bw / 1e9, 2),
        })
    return {"suite": "ops", "machine": dict(machine_info(), target=host_target_dict(), tvm_threads=threads,
                                            peak_GFLOPs=round(peak / 1e9, 1)),
            "results": results}


@click.command("ops")
@click.option("--json", "as_json", is_flag=True, help="Print the bench JSON object.")
@click.option("--quick", is_flag=True, help="A few small cases only.")
@click.option("--case", "only", default=None, help="Only the cases whose name contains this text.")
def ops_command(as_json: bool, quick: bool, only: str | None):
    """Each op family at real models' shapes: dayzero's default route vs torch eager, with the FLOP / byte bound."""
    out = run_bench(quick=quick, only=only)
    click.echo(json.dumps(out, indent=1) if as_json else "\n".join(_line(r) for r in out["results"]))


def _line(r: dict) -> str:
    return (f"{r['case']:34s} {r['dayzero'] * 1e6:10.1f} us  eager {r['baselines']['torch_eager'] * 1e6:10.1f} us  "
            f"{r['ratio_vs_torch_eager']:5.2f}x eager  {r['gflops']:7.1f} GFLOP/s  bound {r['bound'] * 1e6:9.1f} us "
            f"({r['bound_name']})  {r['route']}{'/' + r['cpu_rule'] if r['cpu_rule'] else ''}")


if __name__ == "__main__":
    ops_command()
