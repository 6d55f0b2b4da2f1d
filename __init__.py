"""dayzero: compiler-driven bring-up of sparse LLMs on PyTorch and Apache TVM.

    checkpoint dir / nn.Module / model.onnx
        -> frontend (torch.export) -> Graph IR -> passes -> codegen (TVM) -> artifact dir -> runtime
"""

import os as _os

__version__ = "0.1.0"

# TVM's CPU thread pool pins the thread that starts it (the caller runs task 0) to the first core, and every thread
# or process started from it afterwards inherits that one core: torch's OpenMP pool, an eager reference in the same
# process, the server's threads, a CLI's subprocesses. Measured on a 2-core host after loading an artifact: a
# 2000x2000 torch matmul took 2x as long (1742 vs 842 ms for 10), and three test workers shared core 0 while core
# 1 idled. Unpinned, TVM's kernels run as fast (tiny DeepSeek-V4 prefill of 100 tokens: 3.6 ms both). Set before
# any pool starts; a user's TVM_BIND_THREADS=1 is kept.
_os.environ.setdefault("TVM_BIND_THREADS", "0")
# TVM's pool is sized once, when it starts, from TVM_NUM_THREADS (else OMP_NUM_THREADS, else half the CPUs on x86:
# it assumes 2-way SMT), and ``runtime.config_threadpool`` cannot grow it past that size afterwards. On a host with
# one thread per core every kernel therefore ran on one core of two (a 512 x 4096 softmax: 1.0 ms and 1.0 s of CPU
# per s of wall; 0.45 ms and 2.0 on both). So the pool gets every CPU this process may use, unless the user sized
# it (either variable); set before any pool starts.
if "TVM_NUM_THREADS" not in _os.environ and "OMP_NUM_THREADS" not in _os.environ:
    _os.environ["TVM_NUM_THREADS"] = str(len(_os.sched_getaffinity(0)) if hasattr(_os, "sched_getaffinity")
                                         else (_os.cpu_count() or 1))


def compile(model, out, **kwargs):  # noqa: A001 - the public name users expect
    """Compile MODEL (checkpoint dir, ``module:factory`` or (nn.Module, inputs)) into artifact dir OUT."""
    from .tools.driver import compile_model

    return compile_model(model, out, **kwargs)


class DayzeroError(Exception):
    """Base of every error dayzero raises on purpose."""


class UserError(DayzeroError):
    """Bad input from the user (a model, checkpoint, flag or file): reported as one line, exit code 2."""


class UnsupportedOpsError(UserError):
    """The model uses ops dayzero cannot lower; lists every one with its upstream source line."""

    def __init__(self, entries):
        self.entries = list(entries)  # [(op, where)]
        lines = "; ".join(f"{op} at {where}" for op, where in self.entries)
        super().__init__(f"{len(self.entries)} unsupported op(s): {lines}")


class InternalError(DayzeroError):
    """A bug in dayzero (a broken invariant): reported with a hint to rerun with --debug."""
