"""The artifact: one directory, written atomically (a temp dir beside OUT, renamed into place).

    OUT/program.json         programs (buffers, steps, memory plan), symbols, the target
    OUT/kernels.so           every kernel, one library for the target
    OUT/weights.json         the weights manifest: checkpoint recipes (file fingerprints + copy runs) or a key
                             into weights.safetensors (module weights, folded constants)
    OUT/weights.safetensors  what the checkpoint does not hold
    OUT/report.json          routes, patterns, memory, timings
    OUT/final.ir             the optimised IR, in text form

No pickle anywhere. The same inputs give the same bytes (sorted keys, no timestamps in program.json).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from dayzero import UserError

FORMAT = "dayzero-artifact/1"


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")


class ArtifactWriter:
    """``with ArtifactWriter(out) as d: ...write files into d...`` -- OUT appears only if the block succeeds."""

    def __init__(self, out: str | os.PathLike):
        self.out = Path(out).resolve()
        if self.out.exists() and not (self.out / "program.json").is_file():
            raise UserError(f"{out} exists and is not a dayzero artifact: refusing to replace it")
        if not self.out.parent.is_dir():
            raise UserError(f"{self.out.parent}: no such directory")

    def __enter__(self) -> Path:
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.", dir=self.out.parent))
        return self.tmp

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return False
        old = None
        if self.out.exists():
            old = self.out.with_name(f".{self.out.name}.old.{os.getpid()}")
            os.rename(self.out, old)
        os.rename(self.tmp, self.out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return False


def save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file({k: v.detach().contiguous().clone() for k, v in sorted(tensors.items())}, str(path))
