"""dayzero: compiler-driven bring-up of sparse LLMs on PyTorch and Apache TVM.

    checkpoint dir / nn.Module / model.onnx
        -> frontend (torch.export) -> Graph IR -> passes -> codegen (TVM) -> artifact dir -> runtime
"""

__version__ = "0.1.0"


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
