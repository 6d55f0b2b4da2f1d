"""A checkpoint is untrusted input: what dayzero accepts, and the one-line errors (exit 2) for what it does not.

Spec:
- safetensors headers are validated before anything maps the file (``read_header``): overlapping byte ranges, a
  byte size that disagrees with dtype x shape, gaps, bytes past the last tensor, unknown dtypes, bad shapes,
  repeated keys, an oversized length prefix: each a UserError naming the file and the tensor. An index whose
  weight_map names a file outside the directory, a missing file or the wrong file, and a tensor in two files, are
  refused too.
- compile: a tensor the model reads that the checkpoint lacks, a checkpoint tensor the model never reads, a
  wrong-shape expert tensor (MXFP4 and FP8 storage) and NaN weights are exit 2 naming the tensor, nothing
  written; ``--allow-nonfinite`` compiles the NaN checkpoint (recorded in the artifact). Tensors transformers
  itself ignores for the model class (DeepSeek's MTP layer) are not reported.
- run: the checkpoint's fingerprint and every bound tensor's dtype and shape are checked at load; a reshaped or
  transposed tensor, a deleted file, NaN written into the data (header unchanged) and out-of-range copy runs in
  weights.json are exit 2 naming the file / tensor.
- compare: NaN outputs are a mismatch (exit 1), even when the upstream reference is NaN too.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from dayzero import UserError
from dayzero.frontend.checkpoint import read_header
from dayzero.tools.cli import main

from _artifact_edit import rehash
from _lowprec_ref import compile_fails, rewrite_checkpoint
from conftest import LOWPREC_MAX_SEQ

MODEL = "qwen3_moe"
NORM = "model.norm.weight"
Q = "model.layers.0.self_attn.q_proj.weight"  # [64, 64] in the tiny model
K = "model.layers.0.self_attn.k_proj.weight"  # [32, 64]


# ---- headers ----------------------------------------------------------------------------------------------------

def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write(path: Path, header: dict, data: bytes, length: int | None = None) -> None:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)


def _small(path: Path) -> tuple[dict, bytes]:
    """A valid two-tensor safetensors file written by safetensors itself; its header and data."""
    from safetensors.torch import save_file

    save_file({"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.int64)},
              str(path))
    return _header(path)


def _edit(fn):
    def apply(h, data):
        fn(h)
        return h, data
    return apply


@pytest.mark.parametrize("mutate,needles", [
    (_edit(lambda h: h["a"].update(data_offsets=[h["a"]["data_offsets"][0] - 8, h["a"]["data_offsets"][1] - 8])),
     ("tensor a", "overlap tensor b")),
    (_edit(lambda h: h["a"].update(shape=[3, 3])), ("tensor a", "needs 36")),
    (_edit(lambda h: h["a"].update(dtype="F16")), ("tensor a", "needs 12")),
    (_edit(lambda h: h["a"].update(dtype="Q4")), ("tensor a", "unknown dtype")),
    (_edit(lambda h: h["a"].update(shape=[-2, -3])), ("tensor a", "non-negative")),
    (_edit(lambda h: h["a"].update(shape=[2.0, 3])), ("tensor a", "non-negative")),
    (_edit(lambda h: h["b"].update(data_offsets=[32, 24])), ("tensor b", "0 <= begin <= end")),
    (_edit(lambda h: h["a"].pop("dtype")), ("tensor a", "exactly dtype, shape and data_offsets")),
    (lambda h, data: (h, data + b"\0" * 8), ("8 bytes after the last tensor a",)),
    (lambda h, data: (h, data[:-8]), ("tensor a", "truncated")),
    (_edit(lambda h: h.update(__metadata__={"format": 1})), ("__metadata__",)),
])
def test_bad_header_names_file_and_tensor(tmp_path, mutate, needles):
    f = tmp_path / "model.safetensors"
    h, data = mutate(*_small(f))
    _write(f, h, data)
    with pytest.raises(UserError) as e:
        read_header(str(f))
    for s in (str(f), *needles):
        assert s in str(e.value), str(e.value)


def test_header_gap_repeated_key_and_length(tmp_path):
    f = tmp_path / "model.safetensors"
    h, data = _small(f)
    assert set(read_header(str(f)).tensors) == {"a", "b"}  # safetensors' own files pass
    assert h["b"]["data_offsets"] == [0, 32] and h["a"]["data_offsets"] == [32, 56]  # safetensors' order
    h["a"]["data_offsets"] = [40, 64]
    _write(f, h, data + b"\0" * 8)
    with pytest.raises(UserError, match="tensor a starts at byte 40 of the data, leaving a gap after b"):
        read_header(str(f))
    h, data = _small(f)
    text = json.dumps(h).encode()
    text = text[:-1] + b', "a": ' + json.dumps(h["a"]).encode() + b"}"
    f.write_bytes(struct.pack("<Q", len(text)) + text + data)
    with pytest.raises(UserError, match="key 'a' appears twice"):
        read_header(str(f))
    _write(f, h, data, length=1 << 40)
    with pytest.raises(UserError, match="exceeds the"):
        read_header(str(f))
    f.write_bytes(b"\x01\x02")
    with pytest.raises(UserError, match="shorter than its 8-byte header length"):
        read_header(str(f))


@pytest.mark.parametrize("weight_map,needle", [
    ({"a": "../outside.safetensors", "b": "model.safetensors"}, "not a .safetensors file name"),
    ({"a": "other.safetensors", "b": "model.safetensors"}, "names other.safetensors, which is not in"),
    ({"a": "model.safetensors", "b": "model.safetensors", "c": "model.safetensors"}, "maps tensor c"),
    ({"a": ["model.safetensors"]}, "weight_map must map tensor names to file names"),
])
def test_bad_index_is_refused(tmp_path, weight_map, needle):
    from dayzero.frontend.checkpoint import Checkpoint

    _small(tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(UserError, match=needle):
        Checkpoint(tmp_path)


def test_tensor_in_two_files_is_refused(tmp_path):
    from dayzero.frontend.checkpoint import Checkpoint

    _small(tmp_path / "a.safetensors")
    _small(tmp_path / "b.safetensors")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UserError, match="tensor [ab] is in both a.safetensors and b.safetensors"):
        Checkpoint(tmp_path)


def _raw_edit(ckpt: Path, fn) -> None:
    """Edit model.safetensors' header in place (fn(header dict)), keeping its data bytes."""
    f = ckpt / "model.safetensors"
    h, data = _header(f)
    fn(h)
    _write(f, h, data)


def test_compile_rejects_inconsistent_header(lowprec_tiny, tmp_path):
    """Overlapping offsets and a byte size that disagrees with the shape: exit 2 at compile, nothing written."""
    src = lowprec_tiny(MODEL, "fp32")
    shutil.copytree(src, tmp_path / "ov")

    def overlap(h):
        b, e = h[NORM]["data_offsets"]
        h[NORM]["data_offsets"] = [b - 4, e - 4]
    _raw_edit(tmp_path / "ov", overlap)
    compile_fails(tmp_path / "ov", tmp_path / "out1", "model.safetensors", NORM, "overlap")
    shutil.copytree(src, tmp_path / "sz")
    _raw_edit(tmp_path / "sz", lambda h: h[NORM].update(shape=[65]))
    compile_fails(tmp_path / "sz", tmp_path / "out2", "model.safetensors", NORM, "needs 260")


# ---- compile: coverage, shapes, non-finite values ------------------------------------------------------------------

def test_missing_tensor_is_a_compile_error(lowprec_tiny, tmp_path):
    ckpt = rewrite_checkpoint(lowprec_tiny(MODEL, "fp32"), tmp_path / "ck", lambda t: t.pop(Q))
    compile_fails(ckpt, tmp_path / "out", "lacks", Q)


def test_missing_expert_tensor_is_a_compile_error(lowprec_tiny, tmp_path):
    key = "model.layers.1.mlp.experts.5.down_proj.weight"
    ckpt = rewrite_checkpoint(lowprec_tiny(MODEL, "fp32"), tmp_path / "ck", lambda t: t.pop(key))
    compile_fails(ckpt, tmp_path / "out", key)


def test_unused_tensor_is_a_compile_error(lowprec_tiny, tmp_path):
    extra = "model.layers.0.mlp.not_a_module.weight"
    ckpt = rewrite_checkpoint(lowprec_tiny(MODEL, "fp32"), tmp_path / "ck",
                              lambda t: t.update({extra: torch.ones(3)}))
    compile_fails(ckpt, tmp_path / "out", "never reads", extra)


def test_int_tensor_for_a_float_weight_is_a_compile_error(lowprec_tiny, tmp_path):
    """I32 and F32 have the same size: a dtype byte flipped in the header must not reinterpret the weights."""
    ckpt = rewrite_checkpoint(lowprec_tiny(MODEL, "fp32"), tmp_path / "ck", lambda t: None)
    _raw_edit(ckpt, lambda h: h[K].update(dtype="I32"))
    compile_fails(ckpt, tmp_path / "out", K, "int32", "floating-point")


def test_transformers_ignored_keys_are_not_unused():
    """DeepSeek-V3 checkpoints ship the MTP layer 61, which transformers skips for the class: not reported."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dayzero.frontend.checkpoint import transformers_reports

    cfg = AutoConfig.for_model("deepseek_v3", num_hidden_layers=1, hidden_size=64, intermediate_size=64,
                               moe_intermediate_size=32, n_routed_experts=4, num_attention_heads=2,
                               num_key_value_heads=2, vocab_size=64, q_lora_rank=16, kv_lora_rank=16,
                               qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, first_k_dense_replace=0)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    unexpected, missing = transformers_reports(
        model, unexpected={"model.layers.61.mlp.gate.weight", "model.layers.0.extra.weight"},
        missing={"model.norm.weight"})
    assert unexpected == {"model.layers.0.extra.weight"}
    assert missing == {"model.norm.weight"}


@pytest.mark.parametrize("experts,key,fn", [
    ("fp8", "model.layers.0.mlp.experts.3.up_proj.weight", lambda t, k: t.update({k: t[k].reshape(64, 32)})),
    ("mxfp4", "model.layers.0.mlp.experts.gate_up_proj", lambda t, k: t.update({
        k + "_blocks": t[k + "_blocks"].reshape(8, 32, 4, 16).contiguous(),
        k + "_scales": t[k + "_scales"].reshape(8, 32, 4).contiguous()})),
])
def test_wrong_shape_expert_tensor_is_a_user_error(lowprec_tiny, tmp_path, experts, key, fn):
    model = MODEL if experts == "fp8" else "gpt_oss"
    ckpt = rewrite_checkpoint(lowprec_tiny(model, experts), tmp_path / "ck", lambda t: fn(t, key))
    compile_fails(ckpt, tmp_path / "out", key, "shape", "expects")


def _with_nan(src, dst):
    def fn(t):
        t[K] = t[K].clone()
        t[K][3, 5] = float("nan")
    return rewrite_checkpoint(src, dst, fn)


@pytest.fixture(scope="module")
def nan_artifact(lowprec_tiny, tmp_path_factory):
    """A checkpoint with one NaN weight, compiled with --allow-nonfinite: (checkpoint, artifact, cli result)."""
    d = tmp_path_factory.mktemp("nan")
    ckpt = _with_nan(lowprec_tiny(MODEL, "fp32"), d / "ck")
    r = CliRunner().invoke(main, ["compile", str(ckpt), "-o", str(d / "art"), "--max-seq", str(LOWPREC_MAX_SEQ),
                                  "--allow-nonfinite"])
    return ckpt, d / "art", r


def test_nan_weight_is_a_compile_error(lowprec_tiny, tmp_path):
    ckpt = _with_nan(lowprec_tiny(MODEL, "fp32"), tmp_path / "ck")
    compile_fails(ckpt, tmp_path / "out", K, "non-finite", "[3, 5]", "--allow-nonfinite")


def test_allow_nonfinite_compiles_and_compare_reports_nan(nan_artifact):
    ckpt, art, r = nan_artifact
    assert r.exit_code == 0, r.output
    assert json.loads((art / "report.json").read_text())["allow_nonfinite"] is True
    assert json.loads((art / "weights.json").read_text())["allow_nonfinite"] is True
    res = CliRunner().invoke(main, ["compare", str(ckpt), str(art), "--json", "--seq-len", "8"])
    assert res.exit_code == 1, res.output
    out = json.loads(res.output)
    assert out["ok"] is False and not out["logits_ok"] and out["max_abs_diff"] == float("inf")


# ---- run: the checkpoint changed after compile ------------------------------------------------------------------

def _relocated(ckpt: Path, art: Path, tmp: Path) -> tuple[Path, Path]:
    """Copies of a checkpoint and its artifact, the artifact pointing at the copy (so a test may damage it)."""
    new_ck, new_art = tmp / "ck", tmp / "art"
    shutil.copytree(ckpt, new_ck)
    shutil.copytree(art, new_art)
    w = new_art / "weights.json"
    w.write_text(w.read_text().replace(str(Path(ckpt).resolve()), str(new_ck.resolve())))
    rehash(new_art)  # a consistent edit: the checkpoint checks are under test here, not artifact.json's hashes
    return new_ck, new_art


def _run_fails(art: Path, *needles) -> None:
    r = CliRunner().invoke(main, ["run", str(art), "--input-ids", "1,2,3"])
    assert r.exit_code == 2, r.output
    line = r.output.strip()
    assert "Traceback" not in line and len(line.splitlines()) == 1, line
    for s in needles:
        assert s in line, line


@pytest.fixture(scope="module")
def base(tiny_compiled):
    ckpt, art, _ = tiny_compiled(MODEL)
    return Path(ckpt), Path(art)


def test_unchanged_copy_runs(base, tmp_path):
    ck, art = _relocated(*base, tmp_path)
    r = CliRunner().invoke(main, ["run", str(art), "--input-ids", "1,2,3", "--json"])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("change", [
    lambda t: t.update({K: t[K].reshape(64, 32).contiguous()}),  # reshaped
    lambda t: t.update({K: t[K].t().contiguous()}),  # transposed
])
def test_changed_checkpoint_is_refused_at_load(base, tmp_path, change):
    ck, art = _relocated(*base, tmp_path)
    shutil.rmtree(ck)
    rewrite_checkpoint(base[0], ck, change)
    _run_fails(art, str(ck / "model.safetensors"), "changed since compile")


def test_missing_checkpoint_file_is_named(base, tmp_path):
    ck, art = _relocated(*base, tmp_path)
    (ck / "model.safetensors").unlink()
    _run_fails(art, f"checkpoint file missing: {ck / 'model.safetensors'}")


def test_nan_written_into_data_is_refused_at_load(base, tmp_path):
    """The header (and so the fingerprint) is unchanged; the bound weight's values are not finite."""
    ck, art = _relocated(*base, tmp_path)
    f = ck / "model.safetensors"
    h = read_header(str(f))
    start = f.stat().st_size - sum(i.offsets[1] - i.offsets[0] for i in h.tensors.values())
    raw = bytearray(f.read_bytes())
    at = start + h.tensors[K].offsets[0]
    raw[at:at + 4] = np.array([np.nan], dtype="<f4").tobytes()
    f.write_bytes(bytes(raw))
    _run_fails(art, K, "NaN/Inf")


def test_tampered_runs_and_shapes_in_manifest(base, tmp_path):
    ck, art = _relocated(*base, tmp_path)
    w = art / "weights.json"
    m = json.loads(w.read_text())
    name = next(n for n, e in m["tensors"].items() if e["source"] == "checkpoint")
    good = json.dumps(m)
    m["tensors"][name]["runs"][0][3] += 10 ** 6
    w.write_text(json.dumps(m))
    rehash(art)
    _run_fails(art, name, "into a tensor of")
    m = json.loads(good)
    m["tensors"][name]["runs"][0][2] = "0"
    w.write_text(json.dumps(m))
    rehash(art)
    _run_fails(art, name, "expected an integer")
    m = json.loads(good)
    m["checkpoint"]["tensors"][K]["shape"] = [32, 64 * 2]
    w.write_text(json.dumps(m))
    rehash(art)
    _run_fails(art, K, "compiled for")
