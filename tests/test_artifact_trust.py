"""Issue 20 items 5, 7 (and 8's artifact errors): an artifact is checked (format, file hashes, schema, bounds,
alignment, overlap, KV pools) before any kernel runs, and ``compile -o`` replaces only a previous artifact, with no
way to lose both the old and the new one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

from dayzero import UserError
from dayzero.codegen.artifact import FORMAT, MANIFEST, ArtifactWriter
from dayzero.runtime import load
from dayzero.tools.cli import main

from _artifact_edit import copy_artifact, edit_json, rehash, run_cli


@pytest.fixture
def dense(compiled_factory, tmp_path):
    """A private copy of the tiny dense artifact (prefill only)."""
    art, _, _ = compiled_factory("tiny_dense")
    return copy_artifact(art, tmp_path / "art")


def _prefill(d):
    return load(d).prefill([1, 2, 3]).argmax(-1).tolist()


# ---- format and files ------------------------------------------------------------------------------------------

def test_unknown_format_version_is_named_with_the_supported_one(dense):
    edit_json(dense, MANIFEST, lambda m: m.update(format="dayzero-artifact/99"), rehash_manifest=False)
    with pytest.raises(UserError, match=r"'dayzero-artifact/99' is not supported .*'dayzero-artifact/1'"):
        load(dense)


def test_unknown_program_format_is_refused(dense):
    edit_json(dense, "program.json", lambda p: p.update(format="dayzero-artifact/2"))
    with pytest.raises(UserError, match="program.json: artifact format 'dayzero-artifact/2' is not supported"):
        load(dense)


@pytest.mark.slow
def test_truncated_kernels_so_is_a_user_error_not_sigbus(dense, tmp_path):
    data = (dense / "kernels.so").read_bytes()
    (dense / "kernels.so").write_bytes(data[: len(data) // 3])
    r = run_cli(["run", str(dense), "--input-ids", "1,2,3"], tmp_path)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "kernels.so" in r.stderr and "truncated" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_changed_bytes_fail_the_hash(dense):
    data = bytearray((dense / "kernels.so").read_bytes())
    data[len(data) // 2] ^= 0x10
    (dense / "kernels.so").write_bytes(bytes(data))
    with pytest.raises(UserError, match="kernels.so: sha256 differs"):
        load(dense)


@pytest.mark.parametrize("name", ["kernels.so", "weights.json", "program.json"])
def test_missing_files_and_bad_json_exit_2(dense, name):
    (dense / name).unlink()
    r = CliRunner().invoke(main, ["run", str(dense), "--input-ids", "1"])
    assert r.exit_code == 2 and f"{name} is missing" in r.output, r.output


def test_bad_json_in_program_json_exits_2(dense):
    (dense / "program.json").write_text('{"programs": ')
    rehash(dense)
    r = CliRunner().invoke(main, ["run", str(dense), "--input-ids", "1"])
    assert r.exit_code == 2 and "program.json: not valid JSON" in r.output, r.output


def test_artifact_without_manifest_is_refused_but_replaceable(dense, tmp_path):
    """An artifact written before artifact.json: load asks for a recompile; compile -o may replace it."""
    (dense / MANIFEST).unlink()
    with pytest.raises(UserError, match=r"no artifact.json \(compiled by an older dayzero, or not an artifact\): "
                                        r"recompile"):
        load(dense)
    src = copy_artifact(dense, tmp_path / "src")
    _write_artifact(dense, src, "new")
    assert json.loads((dense / "report.json").read_text()) == {"marker": "new"} and (dense / MANIFEST).is_file()


# ---- program.json: bounds, alignment, overlap ------------------------------------------------------------------

def _activation(prog, i):
    b = prog["buffers"][i]
    return b["zone"] == "activations" and b["weight"] is None and b["state"] is None


def _root(prog, i):
    a = prog["buffers"][i]["alias_of"]
    return i if a is None else a


def _live_pair(prog):
    """(input, output) roots of one step: two activation buffers live at the same step."""
    for st in prog["steps"]:
        n_in = len(st["args"]) - st["outputs"]
        for a in (_root(prog, x) for x in st["args"][:n_in]):
            for o in (_root(prog, x) for x in st["args"][n_in:]):
                if a != o and _activation(prog, a) and _activation(prog, o):
                    return a, o
    raise AssertionError("no step reads and writes activations")


def _move(prog, bid, off):
    """Buffer BID and its views to offset OFF."""
    for b in prog["buffers"]:
        if b["id"] == bid or b["alias_of"] == bid:
            prog["memory"]["offsets"][str(b["id"])] = off


def test_negative_offset_is_refused(dense):
    edit_json(dense, "program.json", lambda p: _move(p["programs"]["prefill"], _live_pair(
        p["programs"]["prefill"])[1], -128))
    with pytest.raises(UserError, match=r"program.json: programs.prefill.memory.offsets.\d+: -128 is below 0"):
        load(dense)


def test_unaligned_offset_is_refused(dense):
    def shift(p):
        prog = p["programs"]["prefill"]
        o = _live_pair(prog)[1]
        _move(prog, o, prog["memory"]["offsets"][str(o)] + 8)
    edit_json(dense, "program.json", shift)
    with pytest.raises(UserError, match="is not 64-byte aligned"):
        load(dense)


def test_overlapping_live_buffers_are_refused(dense):
    """Before: the runtime ran a step whose output shares bytes with its input, and gave wrong tokens."""
    def overlap(p):
        prog = p["programs"]["prefill"]
        a, o = _live_pair(prog)
        _move(prog, o, prog["memory"]["offsets"][str(a)])
    edit_json(dense, "program.json", overlap)
    with pytest.raises(UserError, match="overlap while both are live"):
        load(dense)


def test_buffer_past_the_arena_is_refused(dense):
    def shrink(p):
        for prog in p["programs"].values():
            prog["memory"]["arena_bytes"] //= 2
    edit_json(dense, "program.json", shrink)
    with pytest.raises(UserError, match="ends past the arena"):
        load(dense)


def test_schema_errors_name_the_field(dense):
    def bad(p):
        p["programs"]["prefill"]["buffers"][3]["dtype"] = "float33"
    edit_json(dense, "program.json", bad)
    with pytest.raises(UserError, match=r"programs.prefill.buffers\[3\].dtype: 'float33' is not a known dtype"):
        load(dense)


def test_shape_expressions_are_parsed_never_evaluated(dense):
    def bad(p):
        prog = p["programs"]["prefill"]
        b = next(b for b in prog["buffers"] if any(isinstance(d, str) for d in b["shape"]))
        b["shape"] = [("__import__('os').system('touch pwned') or seq" if isinstance(d, str) else d)
                      for d in b["shape"]]
    edit_json(dense, "program.json", bad)
    with pytest.raises(UserError, match="dimension expression"):
        load(dense)
    assert not os.path.exists("pwned")


def test_a_view_larger_than_checked_is_refused(dense):
    """Sizes are checked at the corners of the symbols' ranges; a shape expression that is larger in between
    (seq*(65-seq)//32 is 2 at seq=1 and 64, 5 at seq=3) is caught when the runtime makes the view."""
    def bulge(p):
        prog = p["programs"]["prefill"]
        a, _ = _live_pair(prog)
        b = prog["buffers"][a]
        assert "seq" in b["shape"]
        b["shape"] = ["seq*(65-seq)//32" if d == "seq" else d for d in b["shape"]]
    edit_json(dense, "program.json", bulge)
    rt = load(dense)
    with pytest.raises(UserError, match="its memory plan was checked for"):
        rt.prefill([1, 2, 3])


def test_step_kernel_missing_from_the_library(dense):
    def rename(p):
        prog = p["programs"]["prefill"]
        k = prog["steps"][0]["kernel"]
        prog["kernels"]["k999_gone"] = prog["kernels"].pop(k)
        for st in prog["steps"]:
            if st["kernel"] == k:
                st["kernel"] = "k999_gone"
    edit_json(dense, "program.json", rename)
    with pytest.raises(UserError, match="kernels.so has no function 'k999_gone'"):
        load(dense)


def test_weight_entry_must_match_its_buffer(dense):
    def reshape(w):
        name = next(n for n, e in sorted(w["tensors"].items()) if len(e["shape"]) == 2)
        w["tensors"][name]["shape"] = w["tensors"][name]["shape"][::-1] + [1]
    edit_json(dense, "weights.json", reshape)
    with pytest.raises(UserError, match=r"weights.json: tensors\..*\.shape"):
        load(dense)


def test_kv_blocks_beyond_the_pool_are_refused(tiny_compiled, tmp_path):
    """Before: the block manager handed out block ids past the pool buffer, and decode wrote past the arena."""
    _, art, _ = tiny_compiled("qwen3_moe")
    d = copy_artifact(art, tmp_path / "art")
    edit_json(d, "program.json", lambda p: p["kv_pages"]["tables"][0].update(blocks=p["kv_pages"]["tables"][0][
        "blocks"] * 4))
    with pytest.raises(UserError, match=r"kv_pages.tables\[0\].blocks: \d+ blocks of 16 rows do not match the pool"):
        load(d)


@pytest.mark.slow
@pytest.mark.parametrize("entries, match", [
    ({"cache_1_compressor_entries": 0}, r"kv_pages.row_entries\['cache_1_compressor_entries'\]: 0 is below 1"),
    ({"cache_1_compressor_entries": "4"}, r"kv_pages.row_entries\['cache_1_compressor_entries'\]: expected an int"),
    ({"cache_0_keys": 8}, r"kv_pages.row_entries names 'cache_0_keys', no per-request \[rows, width\] state"),
])
def test_row_entries_must_name_per_request_entries_with_a_rate(tiny_compiled, tmp_path, entries, match):
    """kv_pages.row_entries tells the runtime which states of DeepSeek-V4's batched step it gathers only up to
    each request's entry row: a rate that is no positive int, or a name that is no per-request [rows, width]
    state (a paged K=V pool), is one line."""
    _, art, _ = tiny_compiled("deepseek_v4")
    d = copy_artifact(art, tmp_path / "art")
    edit_json(d, "program.json", lambda p: p["kv_pages"].update(row_entries=entries))
    with pytest.raises(UserError, match=match):
        rt = load(d)
        rt.prefill([1, 2, 3], slot=0)
        rt.decode_batch([4], [0])


def test_copy_run_past_its_destination_is_refused(tiny_compiled, tmp_path):
    _, art, _ = tiny_compiled("qwen3_moe")
    d = copy_artifact(art, tmp_path / "art")

    def longer(w):
        e = next(e for _, e in sorted(w["tensors"].items()) if e["source"] == "checkpoint")
        e["runs"][-1][3] += 1
    edit_json(d, "weights.json", longer)
    with pytest.raises(UserError, match=r"weights.json: tensors\..*\.runs\[\d+\]: copies \["):
        load(d)


# ---- compile -o: replace only an artifact, never lose both -----------------------------------------------------

def _write_artifact(out, src, marker: str):
    """An artifact written by ArtifactWriter from SRC's files, with report.json marked."""
    with ArtifactWriter(out) as d:
        for p in src.iterdir():
            if p.name != MANIFEST:
                shutil.copy(p, d / p.name)
        (d / "report.json").write_text(json.dumps({"marker": marker}))


def test_compile_onto_a_non_artifact_dir_is_refused_untouched(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "program.json").write_text("{}")  # before: this file alone made compile delete the directory
    (out / "thesis.tex").write_text("years of work")
    r = CliRunner().invoke(main, ["compile", "dayzero.tools.examples:tiny_dense", "-o", str(out)])
    assert r.exit_code == 2 and "is not a dayzero artifact" in r.output and "refusing" in r.output, r.output
    assert sorted(p.name for p in out.iterdir()) == ["program.json", "thesis.tex"]
    assert (out / "thesis.tex").read_text() == "years of work"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def test_an_artifact_with_a_foreign_file_is_not_replaced(dense, tmp_path):
    (dense / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="holds 'notes.txt', which is not part of the artifact"):
        ArtifactWriter(dense)
    assert (dense / "notes.txt").read_text() == "mine"


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_replacing_an_artifact_cleans_stale_temp_dirs(dense, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(dense, src)
    out = tmp_path / "out"
    _write_artifact(out, src, "one")
    dead = tmp_path / f".out.dz-tmp.{_dead_pid()}.0badf00d"
    dead.mkdir()
    (dead / "kernels.so").write_bytes(b"half")
    live = tmp_path / f".out.dz-tmp.{os.getpid()}.12345678"  # a compile still running (this process)
    live.mkdir()
    _write_artifact(out, src, "two")
    assert not dead.exists() and live.exists()
    assert json.loads((out / "report.json").read_text()) == {"marker": "two"}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["art", "src", "out", live.name])
    assert _prefill(out) == _prefill(src)


_KILL_BETWEEN_RENAMES = textwrap.dedent("""
    import os, shutil, signal, sys
    from pathlib import Path
    from dayzero.codegen import artifact

    out, src, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    if mode == "renames":  # a filesystem without RENAME_EXCHANGE: killed between its two renames
        artifact.exchange = lambda a, b: False
        real, calls = os.rename, []
        def rename(a, b):
            calls.append(a)
            if len(calls) == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            real(a, b)
        os.rename = rename
    else:  # killed right after the exchange, before the old artifact is deleted
        shutil.rmtree = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    with artifact.ArtifactWriter(out) as d:
        for p in src.iterdir():
            if p.name != artifact.MANIFEST:
                shutil.copy(p, d / p.name)
        (d / "report.json").write_text('{"marker": "new"}')
""")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["renames", "exchange"])
def test_a_kill_during_the_swap_leaves_a_loadable_artifact(dense, tmp_path, mode):
    src = tmp_path / "src"
    shutil.copytree(dense, src)
    out = tmp_path / "out"
    _write_artifact(out, src, "old")
    r = subprocess.run([sys.executable, "-c", _KILL_BETWEEN_RENAMES, str(out), str(src), mode],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == -9, r.stderr[-2000:]  # it was killed where intended
    if mode == "renames":
        assert not out.exists() and list(tmp_path.glob(".out.dz-old.*"))  # the state the issue describes
    assert _prefill(out) == _prefill(src)  # load restores the old artifact, or finds the new one in place
    marker = json.loads((out / "report.json").read_text())["marker"]
    assert marker == ("old" if mode == "renames" else "new")
    _write_artifact(out, src, "next")  # the next compile cleans what the killed one left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art", "out", "src"]
    assert json.loads((out / "report.json").read_text())["marker"] == "next"


def test_artifact_json_lists_every_file_with_its_hash(dense):
    from dayzero.codegen.artifact import file_digest

    man = json.loads((dense / MANIFEST).read_text())
    assert man["format"] == FORMAT
    assert sorted(man["files"]) == sorted(p.name for p in dense.iterdir() if p.name != MANIFEST)
    for name, e in man["files"].items():
        assert e == {"bytes": (dense / name).stat().st_size, "sha256": file_digest(dense / name)}


def test_overlap_sweep_agrees_with_the_planners_verifier():
    """validate.overlapping_live (a sweep over byte offsets, fast enough for every load) finds a clash exactly when
    passes/memory_plan.verify (every pair) does, on random placements."""
    import random

    from dayzero import InternalError
    from dayzero.passes.memory_plan import Buffer, Plan, verify
    from dayzero.runtime.validate import overlapping_live

    rng = random.Random(0)
    clashes = 0
    for _ in range(300):
        bufs, offs = [], {}
        for i in range(rng.randint(1, 12)):
            start = rng.randint(0, 10)
            bufs.append(Buffer(i, rng.choice([0, 64, 128, 192, 256]), start, start + rng.randint(0, 5)))
            offs[i] = 64 * rng.randint(0, 12)
        try:
            verify(bufs, Plan(offs, 1 << 20, 0, "random", {}), 64)
            expected = False
        except InternalError:
            expected = True
        got = overlapping_live([(offs[b.id], b.size, b.start, b.end, b.id) for b in bufs]) is not None
        assert got == expected, (bufs, offs)
        clashes += expected
    assert 50 < clashes < 250  # both outcomes were exercised


def test_a_buffers_size_is_checked_at_the_corners_of_its_own_symbols_only(monkeypatch):
    # a batched decode program declares a symbol per request and cache (tiny DeepSeek-V4 --max-batch 2: 18); its
    # buffers each name one or two, and checking every buffer at all 2^18 corners kept `load` busy for minutes
    from dayzero.runtime import validate

    symbols = {f"s{k}": (1, 2) for k in range(16)} | {"n": (1, 1 << 20)}
    calls = []
    real = validate.shape_dim
    monkeypatch.setattr(validate, "shape_dim", lambda d, env: calls.append(d) or real(d, env))
    where = validate._Where("program.json")
    buf = {"shape": ["n", "s3 * 4", 8], "dtype": "float32"}
    assert validate.buffer_max_bytes(buf, symbols, where, "b") == (1 << 20) * 2 * 4 * 8 * 4
    assert len(calls) <= 3 * 4  # 3 dims at the 4 corners of (n, s3)
    with pytest.raises(UserError, match=r"dimension 's3 - 2' is -1"):
        validate.buffer_max_bytes({"shape": ["s3 - 2"], "dtype": "int8"}, symbols, where, "b")
