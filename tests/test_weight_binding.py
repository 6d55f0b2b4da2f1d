"""runtime/executor.py binds checkpoint weights with plain reads into the arena (frontend/checkpoint.py TensorReader): element ranges of
any dtype, converted where the arena's dtype differs, in bounded chunks; a file cut short is one UserError."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from dayzero import UserError
from dayzero.frontend.checkpoint import read_header
from dayzero.frontend import checkpoint
from dayzero.frontend.checkpoint import TensorReader


@pytest.fixture
def ckpt(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(37, 11, generator=g), "b": torch.randn(5, 300, generator=g).to(torch.bfloat16),
               "c": torch.randint(0, 255, (4, 64), generator=g, dtype=torch.uint8),
               "d": torch.randn(7, 32, generator=g).to(torch.float8_e4m3fn)}
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path))
    return str(path), tensors


@pytest.mark.parametrize("key,dst_dtype", [("a", torch.float32), ("b", torch.float32), ("b", torch.bfloat16),
                                           ("c", torch.uint8), ("d", torch.float8_e4m3fn), ("d", torch.float32)])
@pytest.mark.parametrize("chunk", [7, 1 << 24])
def test_ranges_read_back_as_safetensors_loads_them(ckpt, key, dst_dtype, chunk, monkeypatch):
    monkeypatch.setattr(checkpoint, "LOAD_CHUNK", chunk)
    path, tensors = ckpt
    info = read_header(path).tensors[key]
    want = tensors[key].reshape(-1).to(dst_dtype)
    src = TensorReader(path)
    try:
        for start, length in ((0, want.numel()), (3, 50), (want.numel() - 9, 9), (5, 0)):
            arena = torch.zeros(length + 16, dtype=dst_dtype)
            src.read_into(arena[8:8 + length], info, start)
            assert torch.equal(arena[8:8 + length].view(torch.uint8), want[start:start + length].view(torch.uint8))
            assert not arena[:8].view(torch.uint8).any() and not arena[8 + length:].view(torch.uint8).any()
    finally:
        src.close()


def test_a_file_cut_short_is_one_user_error(ckpt, tmp_path):
    path, tensors = ckpt
    info = read_header(path).tensors["a"]
    data = open(path, "rb").read()
    cut = tmp_path / "cut.safetensors"
    start = 8 + int.from_bytes(data[:8], "little") + info.offsets[0]
    cut.write_bytes(data[:start + 40])  # the file ends 10 elements into tensor a
    src = TensorReader(str(cut))
    try:
        with pytest.raises(UserError, match="tensor a ends early.*truncated"):
            src.read_into(torch.zeros(tensors["a"].numel()), info, 0)
    finally:
        src.close()


def test_load_reports_progress_up_to_the_weight_bytes(compiled_factory):
    """``load(..., progress=)`` sees bound bytes grow to the total: every weight buffer's bytes."""
    from dayzero.runtime import load

    art, _, _ = compiled_factory("tiny_moe")
    seen = []
    rt = load(art, lambda done, total: seen.append((done, total)))
    totals = {t for _, t in seen}
    assert len(totals) == 1
    (total,) = totals
    weights = {b["weight"]: rt.programs[p].max_bytes[i] for p in rt.programs
               for i, b in enumerate(rt.programs[p].buffers) if b.get("weight") and b.get("alias_of") is None}
    assert total == sum(weights.values()) > 0
    assert [d for d, _ in seen] == sorted(d for d, _ in seen) and seen[0][0] == 0 and seen[-1] == (total, total)


def test_the_cli_bar_shows_only_for_large_loads():
    from dayzero.tools.cli import LoadProgress

    small = LoadProgress(min_bytes=100)
    small(0, 99)
    small(99, 99)
    assert small.bar is None
    big = LoadProgress(min_bytes=100)
    big(0, 1000)
    assert big.bar is not None
    big(1000, 1000)
    assert big.bar is None
