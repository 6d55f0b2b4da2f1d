"""Helpers for tests that damage artifacts: copy one, edit a JSON file (re-hashing artifact.json, as a hostile but
consistent edit would, so the schema and bounds checks are what is tested rather than the hashes), run the CLI."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from dayzero.codegen.artifact import MANIFEST, manifest_of, write_json


def copy_artifact(art: Path, dst: Path) -> Path:
    shutil.copytree(art, dst)
    return dst


def rehash(d: Path) -> None:
    """Rewrite artifact.json for the files as they are now."""
    write_json(d / MANIFEST, manifest_of(d))


def edit_json(d: Path, name: str, fn, rehash_manifest: bool = True) -> None:
    """Apply FN to the parsed JSON file NAME of artifact D (FN edits in place) and write it back."""
    obj = json.loads((d / name).read_text())
    fn(obj)
    (d / name).write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")
    if rehash_manifest:
        rehash(d)


def run_cli(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """``dayzero ARGS`` in a subprocess (a crash shows as a negative return code, not a dead test run)."""
    return subprocess.run([sys.executable, "-m", "dayzero.tools.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)
