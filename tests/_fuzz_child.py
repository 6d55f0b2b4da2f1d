"""A ``dayzero`` process that runs several commands, one after another (test_fuzz_checkpoint.py).

``python _fuzz_child.py IO_DIR``: each line of stdin is a JSON list of CLI arguments; the command runs in this
process as ``dayzero ARGS`` would (the CLI's own ``main``, its exit code from its SystemExit) with file
descriptors 1 and 2 (Python's and native code's output alike) sent to ``IO_DIR/output``, and one JSON line
``{"code": exit code, "output": stdout and stderr}`` is written to the original stdout. An exception that escapes
the CLI ends this process with its traceback on the original stderr, and a crash by a signal ends it too: the
parent sees no answer. One Python start (torch, TVM, transformers imported once) instead of one per command.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def _run(args: list[str]) -> int:
    from dayzero.tools.cli import main

    try:
        main(args, prog_name="dayzero")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


def serve(io_dir: Path) -> None:
    answers = os.fdopen(os.dup(1), "w")
    for line in sys.stdin:
        captured = io_dir / "output"
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        with open(captured, "wb") as f:
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
            try:
                code = _run(json.loads(line))
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                for fd, old in zip((1, 2), saved):
                    os.dup2(old, fd)
                    os.close(old)
        answers.write(json.dumps({"code": code, "output": captured.read_text(errors="replace")}) + "\n")
        answers.flush()


if __name__ == "__main__":
    serve(Path(sys.argv[1]))
