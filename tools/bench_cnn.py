"""``dayzero bench cnn``: ResNet-50 through ONNX on dayzero's default route (no tuning) vs onnxruntime, and each of
its convolution shapes as one kernel vs torch eager's ``F.conv2d`` (issue 21 items 2 and 6).

The model is the standard ResNet-50 (v1.5: the bottleneck's stride on its 3x3 conv; stages of 3, 4, 6, 3
bottlenecks of 64, 128, 256, 512 channels, expansion 4; a 7x7 s2 stem and a 3x3 s2 max pool; global average pool
and a 2048 -> 1000 Gemm), written as an ONNX graph with ``onnx.helper`` (torchvision cannot be installed here: its
wheel needs a CUDA torch) with fixed-seed random weights: He-normal convolutions, BatchNormalization with random
statistics after every conv (the importer folds it to a scale and shift), batch 1, 224 x 224.

Rows (the DESIGN.md bench schema):

* ``resnet50_onnx_b1``: one image, the compiled artifact's ``run`` vs an onnxruntime session (all graph
  optimisations; its idle threads do not spin, so they take no core from dayzero's next call) in the same
  process, timed interleaved (one call of each per round) and the median of each taken; the outputs are compared
  first (``max_rel_err``). ``bound``: the model's convolution and Gemm FLOPs / the peak.
* ``conv_<shape>``: every distinct convolution of the model (``count`` times in it) as its IR node through the
  route a compiled model takes (``schedule_kernel``), vs ``F.conv2d`` (torch on all its threads or one, the
  better); ``bound`` FLOPs / peak.

The peak is the best fp32 FLOP rate this machine showed in this run: torch's ``mm`` of 2048^3, or any conv
row's (dayzero's or torch's) where higher, so no bound exceeds a measured time. ``--threads N`` runs dayzero's
thread pool, onnxruntime and torch on N threads (default: every core); on a host shared with other jobs one
thread each is the steadier comparison (a two-thread pool waits for a core another job holds).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import click
import numpy as np

from .bench_dequant import best_time, best_torch_time

STAGES = ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2))  # (bottleneck width, blocks, first block's stride)
EXPANSION = 4
IMAGE = 224
CLASSES = 1000


def resnet50_onnx(path: Path, seed: int = 0) -> list[tuple]:
    """Write ResNet-50 (module docstring) to ``path``; returns its convolutions as (cin, h, w, cout, k, stride,
    pad), input size first, in graph order."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes, inits, convs = [], [], []

    def param(name, arr):
        inits.append(numpy_helper.from_array(arr.astype(np.float32), name))
        return name

    def conv_bn(x, hw, cin, cout, k, stride, relu, name):
        pad = k // 2
        w = param(f"{name}.w", rng.standard_normal((cout, cin, k, k)) * np.sqrt(2.0 / (cin * k * k)))
        nodes.append(helper.make_node("Conv", [x, w], [f"{name}.c"], name=f"{name}.conv", kernel_shape=[k, k],
                                      strides=[stride, stride], pads=[pad] * 4))
        bn = [param(f"{name}.bn.{p}", v) for p, v in (
            ("scale", rng.uniform(0.5, 1.5, cout)), ("bias", rng.uniform(-0.1, 0.1, cout)),
            ("mean", rng.uniform(-0.1, 0.1, cout)), ("var", rng.uniform(0.5, 1.5, cout)))]
        nodes.append(helper.make_node("BatchNormalization", [f"{name}.c", *bn], [f"{name}.bn"], name=f"{name}.bn",
                                      epsilon=1e-5))
        convs.append((cin, hw, hw, cout, k, stride, pad))
        out = (hw + 2 * pad - k) // stride + 1
        if not relu:
            return f"{name}.bn", out
        nodes.append(helper.make_node("Relu", [f"{name}.bn"], [f"{name}.r"], name=f"{name}.relu"))
        return f"{name}.r", out

    x, hw = conv_bn("x", IMAGE, 3, 64, 7, 2, True, "stem")
    nodes.append(helper.make_node("MaxPool", [x], ["pool"], name="maxpool", kernel_shape=[3, 3], strides=[2, 2],
                                  pads=[1, 1, 1, 1]))
    x, hw, cin = "pool", (hw + 2 - 3) // 2 + 1, 64
    for si, (width, blocks, first_stride) in enumerate(STAGES):
        for bi in range(blocks):
            name, stride, cout = f"s{si}.b{bi}", (first_stride if bi == 0 else 1), width * EXPANSION
            a, _ = conv_bn(x, hw, cin, width, 1, 1, True, f"{name}.a")
            b, out_hw = conv_bn(a, hw, width, width, 3, stride, True, f"{name}.b")
            c, _ = conv_bn(b, out_hw, width, cout, 1, 1, False, f"{name}.c")
            short = x
            if stride != 1 or cin != cout:
                short, _ = conv_bn(x, hw, cin, cout, 1, stride, False, f"{name}.down")
            nodes.append(helper.make_node("Add", [c, short], [f"{name}.sum"], name=f"{name}.add"))
            nodes.append(helper.make_node("Relu", [f"{name}.sum"], [f"{name}.out"], name=f"{name}.relu"))
            x, hw, cin = f"{name}.out", out_hw, cout
    nodes.append(helper.make_node("GlobalAveragePool", [x], ["gap"], name="gap"))
    nodes.append(helper.make_node("Flatten", ["gap"], ["flat"], name="flatten", axis=1))
    fc_w = param("fc.w", rng.standard_normal((CLASSES, cin)) * np.sqrt(1.0 / cin))
    fc_b = param("fc.b", rng.uniform(-0.1, 0.1, CLASSES))
    nodes.append(helper.make_node("Gemm", ["flat", fc_w, fc_b], ["logits"], name="fc", transB=1))
    graph = helper.make_graph(
        nodes, "resnet50", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, IMAGE, IMAGE])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, CLASSES])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return convs


def conv_flops(cin, h, w, cout, k, stride, pad) -> float:
    oh, ow = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
    return 2.0 * cout * oh * ow * cin * k * k


def _interleaved(fns: dict, rounds: int) -> dict:
    """Median seconds of each fn, one call of each per round (a shared host's load hits all alike)."""
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def model_row(rounds: int, threads: int, workdir: Path) -> tuple[dict, list[tuple]]:
    import onnxruntime as ort

    from ..runtime.executor import load
    from .driver import compile_model

    path = workdir / "resnet50.onnx"
    convs = resnet50_onnx(path)
    t = time.perf_counter()
    compile_model(str(path), workdir / "art")
    compile_s = time.perf_counter() - t
    rt = load(workdir / "art")
    x = np.random.default_rng(1).standard_normal((1, 3, IMAGE, IMAGE)).astype(np.float32)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    ref = sess.run(None, {"x": x})[0]
    got = rt.run(x)[0].numpy()
    err = float(np.abs(got - ref).max() / max(float(np.abs(ref).max()), 1e-30))
    med = _interleaved({"dayzero": lambda: rt.run(x), "onnxruntime": lambda: sess.run(None, {"x": x})}, rounds)
    flops = sum(conv_flops(*c) for c in convs) + 2.0 * CLASSES * 2048  # the bound is set once the peak is known
    click.echo(f"resnet50: dayzero {med['dayzero'] * 1e3:.1f} ms, onnxruntime {med['onnxruntime'] * 1e3:.1f} ms",
               err=True)
    return {"case": "resnet50_onnx_b1", "unit": "s", "dayzero": med["dayzero"],
            "baselines": {"onnxruntime": med["onnxruntime"]}, "bound": flops, "bound_name": "flops/peak",
            "ratio_vs_onnxruntime": med["dayzero"] / med["onnxruntime"], "gflops": flops / med["dayzero"] / 1e9,
            "max_rel_err": err, "compile_s": round(compile_s, 1), "rounds": rounds}, convs


def conv_rows(convs: list[tuple]) -> list[dict]:
    import torch
    import tvm

    from ..passes.ir.node import Node, TensorType
    from ..targets.host import host_target_dict
    from .bench_ops import Case, _inputs, compile_case

    target = tvm.target.Target(host_target_dict())
    gen = torch.Generator().manual_seed(0)
    counts: dict[tuple, int] = {}
    for c in convs:
        counts[c] = counts.get(c, 0) + 1
    rows = []
    for (cin, h, w, cout, k, stride, pad), count in counts.items():
        oh, ow = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
        attrs = {"bias": True, "stride": [stride, stride], "padding": [pad, pad], "dilation": [1, 1],
                 "transposed": False, "output_padding": [0, 0], "groups": 1}
        node = Node.make("convolution", _inputs(("float32", (1, cin, h, w)), ("float32", (cout, cin, k, k)),
                                                ("float32", (cout,))), attrs, [TensorType("float32", (1, cout, oh, ow))])
        flops = conv_flops(cin, h, w, cout, k, stride, pad)
        case = Case(f"conv_{cin}x{h}x{w}_{cout}_k{k}s{stride}", "conv", node, None, None, flops, 0.0)
        lib, route, rule = compile_case(case, target)
        xs = [torch.randn(1, cin, h, w, generator=gen), torch.randn(cout, cin, k, k, generator=gen) * (cin * k * k) ** -0.5,
              torch.randn(cout, generator=gen)]
        ref = torch.nn.functional.conv2d(xs[0], xs[1], xs[2], stride, pad)
        out = torch.empty_like(ref)
        lib(*xs, out)
        err = float((out - ref).abs().max() / ref.abs().max())
        now = best_time(lambda: lib(*xs, out), 10)
        eager, threads = best_torch_time(lambda: torch.nn.functional.conv2d(xs[0], xs[1], xs[2], stride, pad), 10)
        click.echo(f"{case.name}: {now * 1e3:.3f} ms, eager {eager * 1e3:.3f} ms", err=True)
        rows.append({"case": case.name, "family": "conv", "unit": "s", "dayzero": now,
                     "baselines": {"torch_eager": eager}, "bound": flops, "bound_name": "flops/peak",
                     "ratio_vs_torch_eager": eager / now, "gflops": flops / now / 1e9, "count": count,
                     "route": route, "cpu_rule": rule, "torch_threads": threads, "max_rel_err": err})
    return rows


def run_bench(rounds: int = 20, convs_only: bool = False, threads: int | None = None) -> dict:
    import torch
    import tvm

    from ..runtime.executor import use_all_cores
    from ..targets.host import host_target_dict
    from .bench import machine_info
    from .bench_ops import peak_flops

    if threads is None:
        threads = use_all_cores()
    else:
        tvm.get_global_func("runtime.config_threadpool")(0, threads)
        torch.set_num_threads(threads)
    results = []
    with tempfile.TemporaryDirectory(prefix="dayzero-bench-cnn-") as tmp:
        if convs_only:
            convs = resnet50_onnx(Path(tmp) / "resnet50.onnx")
        else:
            row, convs = model_row(rounds, threads, Path(tmp))
            results.append(row)
    results += conv_rows(convs)
    rates = [r["bound"] / t for r in results for t in (r["dayzero"], *r["baselines"].values())]
    peak = max([peak_flops()] + rates)
    for r in results:  # "bound" held the FLOPs until the peak was known
        r["bound"] = r["bound"] / peak
    return {"suite": "cnn", "machine": dict(machine_info(), target=host_target_dict(), tvm_threads=threads,
                                            peak_GFLOPs=round(peak / 1e9, 1)),
            "results": results}


@click.command("cnn")
@click.option("--json", "as_json", is_flag=True, help="Print the bench JSON object.")
@click.option("--rounds", default=20, show_default=True, help="Interleaved timing rounds of the whole model.")
@click.option("--convs-only", is_flag=True, help="Only the per-convolution rows (no model compile).")
@click.option("--threads", type=click.IntRange(1, 1024), default=None,
              help="Threads for dayzero, onnxruntime and torch alike (default: every core).")
def cnn_command(as_json: bool, rounds: int, convs_only: bool, threads: int | None):
    """ResNet-50 via ONNX: dayzero's default route vs onnxruntime, and each conv shape vs torch eager."""
    out = run_bench(rounds, convs_only, threads)
    click.echo(json.dumps(out, indent=1) if as_json else "\n".join(_line(r) for r in out["results"]))


def _line(r: dict) -> str:
    base = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in r["baselines"].items())
    return (f"{r['case']:30s} dayzero {r['dayzero'] * 1e3:8.2f} ms | {base} | {r['gflops']:6.1f} GFLOP/s  "
            f"bound {r['bound'] * 1e3:.2f} ms")
