"""``dayzero report``: routes, op counts, patterns, unsupported ops and the memory plan, from the artifact alone.

Specification:
* ``--json`` has every kernel with a route in {hand-scheduled, tuned, default, generic}, per-step op counts that
  sum to the step count, patterns, ``unsupported`` (a list), and per program ``memory`` with ``arena_bytes``,
  ``peak_live_bytes`` and ``zones``;
* report.json carries every planned buffer ``[offset, bytes, first, last, zone]``, enough to redraw the plan: no
  two buffers live at the same step share a byte
  (except one weight placed once by name), every offset is 64-byte aligned, all fit in the arena;
* ``--plot`` writes a PNG of sensible size.
"""

from __future__ import annotations

import json
import struct

from click.testing import CliRunner

from dayzero.tools.cli import main
from dayzero.tools.report import ROUTES


def test_report_json_keys(compiled_factory):
    art, _, _ = compiled_factory("tiny_moe")
    r = CliRunner().invoke(main, ["report", str(art), "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output)
    for key in ("kernels", "routes", "op_counts", "patterns", "unsupported", "programs", "target"):
        assert key in rep
    assert rep["unsupported"] == []
    assert rep["kernels"] and all(k["route"] in ROUTES and k["op"] for k in rep["kernels"].values())
    assert sum(rep["routes"].values()) == len(rep["kernels"])
    p = rep["programs"]["prefill"]
    assert sum(rep["op_counts"].values()) == p["steps"]
    assert rep["op_counts"]["topk"] == 2  # one router per MoE layer
    m = p["memory"]
    assert m["arena_bytes"] >= m["peak_live_total_bytes"] > 0
    assert set(m["zones"]) == set(m["peak_live_bytes"]) >= {"weights", "activations", "io"}
    assert sum(m["zones"].values()) == m["arena_bytes"]


def test_report_json_buffers_redraw_a_valid_plan(compiled_factory):
    art, _, _ = compiled_factory("tiny_moe")
    m = json.loads((art / "report.json").read_text())["programs"]["prefill"]["memory"]
    bufs, arena = m["buffers"], m["arena_bytes"]
    assert len(bufs) > 10 and m["steps"] > 0
    for off, size, first, last, zone in bufs:
        assert off % 64 == 0 and off + size <= arena and 0 <= first <= last <= m["steps"] and zone in m["zones"]
    for i, (oa, sa, fa, la, za) in enumerate(bufs):
        for ob, sb, fb, lb, zb in bufs[i + 1:]:
            if (oa, sa, za) == (ob, sb, zb) and za == "weights":
                continue  # one weight read by several nodes is placed once, by name
            if sa and sb and fa <= lb and fb <= la:  # live at a common step
                assert oa + sa <= ob or ob + sb <= oa


def test_report_plot_png(compiled_factory, tmp_path):
    art, _, _ = compiled_factory("tiny_moe")
    png = tmp_path / "arena.png"
    r = CliRunner().invoke(main, ["report", str(art), "--plot", str(png)])
    assert r.exit_code == 0, r.output
    assert "routes:" in r.output and "peak-live" in r.output and str(png) in r.output
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and 20_000 < len(data) < 2_000_000
    width, height = struct.unpack(">II", data[16:24])
    assert 800 <= width <= 3000 and 400 <= height <= 2000


def test_report_user_errors(tmp_path):
    r = CliRunner().invoke(main, ["report", str(tmp_path / "nothing")])
    assert r.exit_code == 2 and "not a dayzero artifact" in r.output
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "report.json").write_text(json.dumps({"programs": {"prefill": {"memory": {}}}}))
    r = CliRunner().invoke(main, ["report", str(tmp_path / "old"), "--plot", str(tmp_path / "x.png")])
    assert r.exit_code == 2 and "recompile" in r.output
