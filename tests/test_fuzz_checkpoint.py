"""Fuzz: seeded random corruptions of a tiny checkpoint's safetensors header, each through `dayzero compile`.

Spec: every corrupted checkpoint is compiled by ``dayzero compile`` in a child process (one for all the cases,
each in its own checkpoint folder: tests/_fuzz_child.py; a crash by a signal, or an exception escaping the CLI,
ends it without an answer). The outcome is exit 2 with one line and no traceback, or exit 0 only when the
artifact's prefill logits equal the upstream model's on the ORIGINAL checkpoint (a corruption transformers and dayzero both read the
same way, e.g. whitespace). Nothing is written outside the output path: HOME, TMPDIR, the working directory and
the checkpoint are inside the test's tmp dir and snapshotted before and after each run.

The corruptions: a random byte of the header replaced; one tensor's shape changed (a dim +-1, doubled, zeroed,
or the dims reversed, which keeps the byte size); its dtype replaced (same-size I32 for F32 included); one end of
its data_offsets moved; the entry deleted, renamed or duplicated under a new name; the 8-byte length prefix
moved; the header cut short.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

MODEL = "qwen3_moe"
SEED = 7
CASES = 8
MAX_SEQ = 16
TOL = 1e-4


def _split(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _pack(text: bytes, length: int | None = None) -> bytes:
    return struct.pack("<Q", len(text) if length is None else length) + text


def corrupt(rng: random.Random, raw: bytes) -> tuple[str, bytes]:
    """(what was done, the corrupted file bytes) for the safetensors file ``raw``."""
    n = struct.unpack("<Q", raw[:8])[0]
    text, data = raw[8:8 + n], raw[8 + n:]
    header = json.loads(text)
    keys = sorted(k for k in header if k != "__metadata__")
    key = rng.choice(keys)
    e = header[key]
    kind = rng.choice(["byte", "shape", "dtype", "offsets", "drop", "rename", "dup", "length", "cut"])
    if kind == "byte":
        i = rng.randrange(len(text))
        b = bytearray(text)
        b[i] = rng.choice([c for c in range(256) if c != b[i]])
        return f"byte {i} -> {b[i]:#x}", _pack(bytes(b)) + data
    if kind == "length":
        d = rng.choice([-1, 1]) * rng.randint(1, 64)
        return f"length prefix {d:+d}", _pack(text, n + d) + data
    if kind == "cut":
        i = rng.randrange(1, len(text))
        return f"header cut at {i}", _pack(text[:i]) + data
    if kind == "shape":
        how = rng.choice(["+1", "-1", "x2", "0", "reverse"])
        s = list(e["shape"])
        j = rng.randrange(len(s))
        s[j] = {"+1": s[j] + 1, "-1": s[j] - 1, "x2": 2 * s[j], "0": 0, "reverse": s[j]}[how]
        e["shape"] = s[::-1] if how == "reverse" else s
    elif kind == "dtype":
        e["dtype"] = rng.choice(["I32", "F16", "BF16", "F64", "U8", "I64", "F8_E4M3", "Q4"])
    elif kind == "offsets":
        j = rng.randrange(2)
        e["data_offsets"][j] += rng.choice([-1, 1]) * rng.randint(1, 64)
    elif kind == "drop":
        del header[key]
    elif kind == "rename":
        header[key[:-1] + rng.choice("xyz0")] = header.pop(key)
    elif kind == "dup":
        header[key + ".copy"] = dict(e)
    out = json.dumps(header).encode()
    out += b" " * (-len(out) % 8)
    return f"{kind} {key}", _pack(out) + data


def _snapshot(root: Path, skip: Path) -> dict[str, tuple[int, int] | None]:
    """Every path under root except skip's tree: a file's (size, mtime), a directory's existence (its mtime
    changes when a temporary entry comes and goes)."""
    out = {}
    for p in root.rglob("*"):
        if p == skip or skip in p.parents:
            continue
        st = p.lstat()
        out[str(p.relative_to(root))] = None if p.is_dir() else (st.st_size, st.st_mtime_ns)
    return out


def _logits(art: Path, ids: torch.Tensor) -> torch.Tensor:
    from dayzero.runtime import load

    return load(art).prefill(ids)


class _Child:
    """The test's one ``dayzero`` process (tests/_fuzz_child.py): ``compile(args)`` -> (exit code, its stdout and
    stderr), or None when the process ended without answering (a crash: ``returncode`` says how)."""

    def __init__(self, cwd: Path, env: dict, io_dir: Path):
        self.err = io_dir / "child.stderr"
        with self.err.open("w") as err:
            self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("_fuzz_child.py")),
                                          str(io_dir)], cwd=cwd, env=env, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, text=True)

    def compile(self, args: list[str]) -> tuple[int, str] | None:
        self.proc.stdin.write(json.dumps(["compile", *args]) + "\n")
        self.proc.stdin.flush()
        timer = threading.Timer(900, self.proc.kill)  # as the per-process timeout this replaced
        timer.start()
        try:
            line = self.proc.stdout.readline()
        finally:
            timer.cancel()
        if not line:
            self.proc.wait()
            return None
        answer = json.loads(line)
        return answer["code"], answer["output"]

    def close(self) -> int:
        self.proc.stdin.close()
        return self.proc.wait(timeout=300)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def died(self) -> str:
        return f"the child ended with {self.proc.returncode}: {self.err.read_text()[-2000:]}"


@pytest.mark.slow
def test_corrupted_headers_never_pass_silently(lowprec_tiny, tmp_path, tmp_path_factory):
    from dayzero.frontend.hf import load_upstream

    src = lowprec_tiny(MODEL, "fp32")
    original = (src / "model.safetensors").read_bytes()
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = load_upstream(src)(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
    rng = random.Random(SEED)
    env = dict(os.environ)
    for d in ("home", "tmp", "cwd"):
        (tmp_path / d).mkdir()
    env.update(HOME=str(tmp_path / "home"), TMPDIR=str(tmp_path / "tmp"), DAYZERO_TUNING_DIR=str(tmp_path / "home"))
    child = None
    try:
        for case in range(CASES):
            # a fresh checkpoint folder per case: nothing the child process keeps in memory from one compile can be
            # keyed by the path of the next one
            ck = tmp_path / f"ck{case}"
            shutil.copytree(src, ck)
            what, raw = corrupt(rng, original)
            (ck / "model.safetensors").write_bytes(raw)
            out = tmp_path / "out"
            before = _snapshot(tmp_path, out)
            if child is None:  # started inside the first case's snapshots: its imports write nothing either
                child = _Child(tmp_path / "cwd", env, tmp_path_factory.mktemp("fuzz_child_io"))
            answer = child.compile([str(ck), "-o", str(out), "--max-seq", str(MAX_SEQ)])
            assert answer is not None, (case, what, child.died())  # never a signal, never an escaped exception
            code, msg = answer[0], answer[1].strip()
            assert code in (0, 2), (case, what, code, msg[-2000:])  # never exit 3
            if case == CASES - 1:  # the child's exit inside the last case's snapshots
                assert child.close() == 0, (case, what, child.died())
            assert _snapshot(tmp_path, out) == before, (case, what)  # nothing written but the output path
            if code == 2:
                assert "Traceback" not in msg and len(msg.splitlines()) == 1, (case, what, msg)
                assert not out.exists(), (case, what)
            else:
                err = float((_logits(out, ids) - want).abs().max())
                assert err <= TOL, (case, what, err)
                shutil.rmtree(out)
            shutil.rmtree(ck)
    finally:
        if child is not None:
            child.kill()
