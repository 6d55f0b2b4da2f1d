"""Scratch probe: MetaSchedule trials per minute, default LocalBuilder/LocalRunner vs dayzero's in-process ones.

    python -m dayzero.tools.bench_tuning_probe --mode default --kernel matmul --trials 8
    python -m dayzero.tools.bench_tuning_probe --mode inproc  --kernel matmul --trials 64
    python -m dayzero.tools.bench_tuning_probe --mode inproc  --kernel reduction --trials 64

The one-time ``import tvm.s_tir.tensor_intrin`` (17-30 s, paid once per process by MetaSchedule's TuneContext) is
done before the clock starts in both modes. Prints one JSON line: kernel, mode, wall seconds, candidates measured, valid ones, trials per minute (valid), and
for `inproc` the default-schedule and tuned times. Not a test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time


def make_kernel(name: str, n: int = 256):
    from tvm import te

    if name == "matmul":
        a = te.placeholder((n, n), "float32", name="A")
        b = te.placeholder((n, n), "float32", name="B")
        k = te.reduce_axis((0, n), "k")
        c = te.compute((n, n), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="C")
        return te.create_prim_func([a, b, c])
    if name == "reduction":  # row sum of a (n*4, n*16) matrix
        a = te.placeholder((n * 4, n * 16), "float32", name="A")
        k = te.reduce_axis((0, n * 16), "k")
        c = te.compute((n * 4,), lambda i: te.sum(a[i, k], axis=k), name="C")
        return te.create_prim_func([a, c])
    raise SystemExit(f"unknown kernel {name!r} (matmul, reduction)")


def run_default(func, target, trials: int, per_iter: int, strategy: str) -> dict:
    """Stock ms.tune_tir: LocalBuilder (popen workers, 30 s build timeout) + LocalRunner."""
    from tvm.s_tir import meta_schedule as ms

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as work_dir:
        db = ms.tune_tir(
            func, target, work_dir, max_trials_global=trials, num_trials_per_iter=per_iter, strategy=strategy,
            cost_model="random", task_scheduler="round-robin", database="memory", seed=0,
        )
        records = db.get_all_tuning_records()
    wall = time.perf_counter() - t0
    valid = [r for r in records if r.run_secs is not None and len(r.run_secs) > 0 and min(float(x) for x in r.run_secs) < 1e9]
    return {"wall_s": wall, "measured": len(records), "valid": len(valid)}


def run_inproc(func, target, trials: int, per_iter: int, strategy: str) -> dict:
    from dayzero.codegen import tuner, tuning

    with tempfile.TemporaryDirectory() as root:
        db = tuning.TuningDatabase(root)
        t0 = time.perf_counter()
        res = tuner.tune(func, target, trials=trials, minutes=None, db=db, trials_per_iter=per_iter,
                          strategy=strategy)
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "measured": res.trials_done, "valid": res.valid_trials,
            "default_s": res.default_s, "tuned_s": res.tuned_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["default", "inproc"], default="inproc")
    p.add_argument("--kernel", default="matmul")
    p.add_argument("--trials", type=int, default=32)
    p.add_argument("--per-iter", type=int, default=16, help="candidates per MetaSchedule batch")
    p.add_argument("--strategy", default="evolutionary", help="evolutionary | replay-trace")
    args = p.parse_args()
    import tvm
    import tvm.s_tir.tensor_intrin  # noqa: F401 - one-time 17-30 s import (TuneContext does it); not timed


    from dayzero.targets.host import host_target_dict

    target = tvm.target.Target(host_target_dict())
    func = make_kernel(args.kernel)
    out = (run_default if args.mode == "default" else run_inproc)(func, target, args.trials, args.per_iter, args.strategy)
    out.update(kernel=args.kernel, mode=args.mode, strategy=args.strategy, per_iter=args.per_iter, trials_per_min=60.0 * out["valid"] / out["wall_s"])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
