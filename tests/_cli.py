"""Test helper for the compile options a user gets wrong: one line, exit 2, nothing written."""

from __future__ import annotations

from click.testing import CliRunner


def assert_compile_refused(tmp_path, args: list[str], needle: str) -> None:
    """``dayzero compile`` of the tiny dense example with ARGS: exit 2, one line naming NEEDLE, no traceback, no
    artifact."""
    from dayzero.tools.cli import main

    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["compile", "dayzero.tools.examples:tiny_dense", "-o", str(out), *args])
    assert r.exit_code == 2, r.output
    line = r.output.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in line and needle in line, line
    assert not out.exists()
