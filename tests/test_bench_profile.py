"""``dayzero bench profile``: one decode step of a compiled artifact timed kernel by kernel."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from dayzero.tools.cli import main


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 2])
def test_profile_times_every_step_of_the_decode_program(tiny_compiled, batch):
    """One request profiles ``decode``, several ``decode_batch``: every program step is timed and attributed to its
    op (the op sums are the time spent in the program), the slowest steps carry their source span and argument
    shapes, and what the runtime spends outside the program is the rest of the step."""
    _, art, _ = tiny_compiled("qwen3_moe")
    r = CliRunner().invoke(main, ["bench", "profile", str(art), "--batch", str(batch), "--context", "9",
                                  "--steps", "2", "--top", "5", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    name = "decode_batch" if batch > 1 else "decode"
    program = json.loads((art / "program.json").read_text())["programs"][name]
    ops = {s["node"].split(" at ", 1)[0] for s in program["steps"]}
    assert out["program"] == name and len(out["step_s"]) == 2 and set(out["by_op"]) == ops
    assert sum(out["by_op"].values()) == pytest.approx(out["in_program_s"], rel=1e-6)
    assert out["outside_program_s"] == pytest.approx(sum(out["step_s"]) / 2 - out["in_program_s"])
    assert len(out["top"]) == 5 and out["top"][0]["s"] >= out["top"][-1]["s"]
    assert all(row["op"] in ops and row["span"] and row["args"] for row in out["top"])
    text = CliRunner().invoke(main, ["bench", "profile", str(art), "--batch", str(batch), "--context", "9",
                                     "--steps", "1"])
    assert text.exit_code == 0 and f"{name}: {batch} request(s) at context 9" in text.output


@pytest.mark.slow
def test_profile_refuses_a_batch_or_context_the_artifact_cannot_take(tiny_compiled):
    _, art, _ = tiny_compiled("qwen3_moe")
    r = CliRunner().invoke(main, ["bench", "profile", str(art), "--batch", "99"])
    assert r.exit_code == 2 and "--batch 99" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(main, ["bench", "profile", str(art), "--context", "100000"])
    assert r.exit_code == 2 and "--context 100000" in r.output


@pytest.mark.slow
def test_profile_keeps_one_row_of_prefill_logits(tiny_compiled, monkeypatch):
    """Full-width DeepSeek-V3.2 profiled at context 4000 was killed for memory: each prompt's logits (3999 x 129280
    fp32, 2 GB) were kept beside a 19 GB arena. The profile prefills for the cache and reads no logits: one row
    a request."""
    from dayzero.runtime.executor import Runtime

    _, art, _ = tiny_compiled("qwen3_moe")
    shapes, real = [], Runtime.prefill

    def spy(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        shapes.append(tuple(out.shape))
        return out
    monkeypatch.setattr(Runtime, "prefill", spy)
    r = CliRunner().invoke(main, ["bench", "profile", str(art), "--batch", "2", "--context", "9", "--steps", "1"])
    assert r.exit_code == 0, r.output
    assert len(shapes) == 2 and all(s[:2] == (1, 1) for s in shapes), shapes
