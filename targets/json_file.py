"""Reading a JSON file a user hands dayzero (a model config, a target spec): parsed, never evaluated; a missing,
unreadable or invalid file is one ``UserError`` naming it."""

from __future__ import annotations

import json
from pathlib import Path

from dayzero import UserError


def read_json_file(path: str | Path, kind: str):
    """The JSON value in PATH; KIND names the file in messages ("config", "target spec")."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{kind} file not found: {path}")
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise UserError(f"{kind} {path}: cannot read JSON ({e})") from None
