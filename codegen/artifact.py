"""The artifact: one directory, written into a temp dir beside OUT and swapped into place.

    OUT/program.json         programs (buffers, steps, memory plan), symbols, the target
    OUT/kernels.so           every kernel, one library for the target
    OUT/weights.json         the weights manifest: checkpoint recipes (file fingerprints + copy runs) or a key
                             into weights.safetensors (module weights, folded constants)
    OUT/weights.safetensors  what the checkpoint does not hold
    OUT/report.json          routes, patterns, memory, timings
    OUT/final.ir             the optimised IR, in text form
    OUT/artifact.json        written last: the format version and every other file's size and sha256, checked by
                             the runtime before it parses or dlopens anything (runtime/validate.py)

No pickle anywhere. The same inputs give the same bytes (sorted keys, no timestamps in program.json).

Replacing OUT (``compile -o OUT`` onto an existing directory):

* only a previous dayzero artifact is replaced: a directory (not a link) whose artifact.json has a dayzero format
  and which holds nothing but the files it lists (or, written before artifact.json, whose program.json has a
  dayzero format and which holds only artifact files); anything else is a UserError and nothing is touched;
* the new artifact is written into ``.OUT.dz-tmp.PID.RAND`` beside OUT, then swapped with OUT by
  ``renameat2(RENAME_EXCHANGE)`` (one atomic step: a kill at any moment leaves OUT old or new, never absent), and
  the old one (now under the temp name) deleted. Where the filesystem cannot exchange, OUT is renamed to
  ``.OUT.dz-old.PID`` and the temp dir to OUT: a kill between the two renames leaves OUT absent, and the next
  compile or load of OUT (``recover_interrupted_swap``) renames the old artifact back;
* temp and old dirs of a compile whose process is gone (killed) are deleted by the next compile of OUT.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from dayzero import InternalError, UserError

FORMAT = "dayzero-artifact/1"
FORMAT_PREFIX = "dayzero-artifact/"
MANIFEST = "artifact.json"
_TMP, _OLD = "dz-tmp", "dz-old"
_HASH_CHUNK = 1 << 20


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")


def save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file({k: v.detach().contiguous().clone() for k, v in sorted(tensors.items())}, str(path))


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_HASH_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def _artifact_files(d: Path) -> list[Path]:
    """Every file of artifact directory D but artifact.json: plain files, and the plain files of its plain
    subdirectories one level down (the tokenizer's), sorted by their relative path."""
    out = []
    for p in sorted(Path(d).iterdir()):
        if p.name == MANIFEST:
            continue
        if p.is_dir() and not p.is_symlink():
            for q in sorted(p.iterdir()):
                if q.is_symlink() or not q.is_file():
                    raise InternalError(f"{q}: an artifact holds only plain files")
                out.append(q)
        elif p.is_symlink() or not p.is_file():
            raise InternalError(f"{p}: an artifact holds only plain files")
        else:
            out.append(p)
    return out


def manifest_of(d: Path) -> dict:
    """artifact.json's content for directory D: every file in it (but artifact.json), by its relative path
    (``tokenizer/tokenizer.json``), with size and sha256."""
    d = Path(d)
    files = {p.relative_to(d).as_posix(): {"bytes": p.stat().st_size, "sha256": file_digest(p)}
             for p in _artifact_files(d)}
    return {"format": FORMAT, "files": files}


def is_artifact(d: Path) -> str | None:
    """None if D is a dayzero artifact dayzero may replace, else why not (one phrase)."""
    d = Path(d)
    if d.is_symlink() or not d.is_dir():
        return "not a directory"
    try:
        man = json.loads((d / MANIFEST).read_text())
    except FileNotFoundError:
        return _legacy_artifact(d)
    except (OSError, ValueError, RecursionError):
        return f"unreadable {MANIFEST}"
    if not (isinstance(man, dict) and isinstance(man.get("format"), str) and man["format"].startswith(FORMAT_PREFIX)
            and isinstance(man.get("files"), dict)):
        return f"{MANIFEST} is not a dayzero manifest"
    listed = set(man["files"])
    tops = {n.split("/", 1)[0] for n in listed if isinstance(n, str)}
    foreign = sorted(p.name for p in d.iterdir() if p.name != MANIFEST and p.name not in listed
                     and not (p.is_dir() and not p.is_symlink() and p.name in tops
                              and all(f"{p.name}/{q.name}" in listed for q in p.iterdir())))
    if foreign:
        return f"holds {foreign[0]!r}, which is not part of the artifact"
    return None


# what an artifact held before artifact.json listed its files
_LEGACY_FILES = {"program.json", "kernels.so", "weights.json", "weights.safetensors", "report.json", "final.ir",
                 "multimodal.json"}


def _legacy_artifact(d: Path) -> str | None:
    """None if D is an artifact of a dayzero before artifact.json (its program.json's format, only its files)."""
    try:
        fmt = json.loads((d / "program.json").read_text()).get("format")
    except (OSError, ValueError, RecursionError, AttributeError):
        return f"no {MANIFEST}"
    names = {p.name for p in d.iterdir()}
    if not (isinstance(fmt, str) and fmt.startswith(FORMAT_PREFIX)) or not names <= _LEGACY_FILES:
        return f"no {MANIFEST}"
    return None


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _leftovers(out: Path, tag: str) -> list[tuple[Path, int]]:
    """(dir, pid) of the temp (tag dz-tmp) or old (dz-old) dirs compiles of OUT left beside it."""
    pat = re.compile(rf"\.{re.escape(out.name)}\.{tag}\.(\d+)(\.[0-9a-f]+)?")
    found = []
    for p in out.parent.iterdir():
        m = pat.fullmatch(p.name)
        if m and p.is_dir() and not p.is_symlink():
            found.append((p, int(m.group(1))))
    return sorted(found)


def recover_interrupted_swap(out: str | os.PathLike) -> None:
    """OUT absent and a previous artifact left under ``.OUT.dz-old.PID`` by a compile that is gone (killed between
    its two renames): rename it back to OUT."""
    out = Path(os.path.abspath(out))
    if out.exists() or out.is_symlink() or not out.parent.is_dir():
        return
    for old, pid in _leftovers(out, _OLD):
        if not _pid_alive(pid) and is_artifact(old) is None:
            os.rename(old, out)
            return


def clean_stale(out: Path) -> None:
    """Delete the temp and old dirs of compiles of OUT whose process is gone."""
    for tag in (_TMP, _OLD):
        for d, pid in _leftovers(out, tag):
            if not _pid_alive(pid):
                shutil.rmtree(d, ignore_errors=True)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange(a: Path, b: Path) -> bool:
    """Atomically swap directories A and B (Linux renameat2 RENAME_EXCHANGE); False where it is not available."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def swap_into_place(new: Path, out: Path) -> None:
    """Make directory NEW be OUT; an existing OUT (a checked artifact) is replaced and deleted. No kill loses both."""
    if not (out.exists() or out.is_symlink()):
        os.rename(new, out)
        return
    if exchange(new, out):
        shutil.rmtree(new, ignore_errors=True)  # NEW's name now holds the old artifact
        return
    old = out.with_name(f".{out.name}.{_OLD}.{os.getpid()}")
    os.rename(out, old)
    try:
        os.rename(new, out)  # a kill before this line: recover_interrupted_swap renames OLD back
    except BaseException:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


class ArtifactWriter:
    """``with ArtifactWriter(out) as d: ...write files into d...`` -- OUT changes only if the block succeeds, and
    only from one artifact to the other."""

    def __init__(self, out: str | os.PathLike):
        self.out = Path(os.path.abspath(out))
        if not self.out.parent.is_dir():
            raise UserError(f"{self.out.parent}: no such directory")
        recover_interrupted_swap(self.out)
        self._check_replaceable(out)
        clean_stale(self.out)

    def _check_replaceable(self, shown) -> None:
        if self.out.exists() or self.out.is_symlink():
            why = is_artifact(self.out)
            if why is not None:
                raise UserError(f"{shown} exists and is not a dayzero artifact ({why}): refusing to replace it")

    def __enter__(self) -> Path:
        self.tmp = self.out.with_name(f".{self.out.name}.{_TMP}.{os.getpid()}.{secrets.token_hex(4)}")
        self.tmp.mkdir()
        return self.tmp

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return False
        try:
            write_json(self.tmp / MANIFEST, manifest_of(self.tmp))
            self._check_replaceable(self.out)  # OUT may have changed while the model compiled
            swap_into_place(self.tmp, self.out)
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        return False
