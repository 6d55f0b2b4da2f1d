"""Checkpoint directories as published: ``config.json`` + ``*.safetensors`` (+ ``model.safetensors.index.json``).

Tensors are read on demand through safetensors' memory map, one at a time: the checkpoint is never in RAM whole.

Module parameters are not always checkpoint tensors one to one: transformers renames keys and merges per-expert
tensors into one ``[E, ...]`` parameter while loading (``conversion_mapping.py``). Rather than copy those rules,
dayzero asks transformers' own loader: it loads a stand-in checkpoint whose every element holds its own global
index (``ID_BASE + i``, float64 or int64), and reads back in each parameter which checkpoint elements landed
where. The result is a *recipe* per parameter, a list of copy runs ``(dst, key, src, length)`` over flattened
tensors, that the runtime replays from the real checkpoint at load time. Stacking, concatenation, chunking and
renaming all come out as a few long runs.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dayzero import UserError

ID_BASE = 2 ** 40  # far above any value an initialiser writes, exact in float64


@dataclass(frozen=True)
class TensorInfo:
    key: str
    file: str  # absolute path
    dtype: str
    shape: tuple[int, ...]


class Checkpoint:
    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory).resolve()
        if not self.dir.is_dir():
            raise UserError(f"{directory}: not a checkpoint directory")
        cfg = self.dir / "config.json"
        if not cfg.is_file():
            raise UserError(f"{directory}: no config.json")
        try:
            self.config = json.loads(cfg.read_text())
        except json.JSONDecodeError as e:
            raise UserError(f"{cfg}: invalid JSON ({e.msg} at line {e.lineno})") from None
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.dir.glob("*.safetensors"))
        if not files:
            raise UserError(f"{directory}: no *.safetensors files")
        self.files = [str(self.dir / f) for f in files]
        self.tensors: dict[str, TensorInfo] = {}
        for f in self.files:
            for key, (dtype, shape) in read_header(f).items():
                self.tensors[key] = TensorInfo(key, f, dtype, tuple(shape))

    def get(self, key: str) -> torch.Tensor:
        info = self.tensors.get(key)
        if info is None:
            raise UserError(f"checkpoint {self.dir} has no tensor {key!r}")
        with safe_open(info.file, framework="pt") as f:
            return f.get_tensor(key)

    def fingerprints(self) -> dict[str, dict]:
        """Per file: size and the sha256 of its safetensors header (names, dtypes, shapes, offsets).

        Hashing the header identifies the tensor layout in O(header) instead of reading terabytes."""
        out = {}
        for f in self.files:
            with open(f, "rb") as fh:
                n = struct.unpack("<Q", fh.read(8))[0]
                header = fh.read(n)
            out[f] = {"bytes": os.path.getsize(f), "header_sha256": hashlib.sha256(header).hexdigest()}
        return out


_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
              "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def read_header(path: str) -> dict[str, tuple[str, list[int]]]:
    """The tensors a safetensors file declares, checked against the file's size (a truncated file is an error)."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as fh:
            raw = fh.read(8)
            if len(raw) < 8:
                raise ValueError("shorter than its 8-byte header length")
            n = struct.unpack("<Q", raw)[0]
            if n > size - 8:
                raise ValueError("header runs past the end of the file")
            header = json.loads(fh.read(n))
    except (ValueError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: not a valid safetensors file ({e})") from None
    out = {}
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        begin, end = meta["data_offsets"]
        if 8 + n + end > size:
            raise UserError(f"{path}: tensor {key} runs past the end of the file (truncated?)")
        out[key] = (_ST_DTYPES.get(meta["dtype"], meta["dtype"]), meta["shape"])
    return out


Run = tuple[int, str, int, int]  # (dst offset, checkpoint key, src offset, length), in elements


def learn_recipes(ckpt: Checkpoint, load_model) -> tuple[dict[str, list[Run]], set[str]]:
    """Recipes for every module tensor transformers fills from the checkpoint.

    ``load_model(dir, dtype)`` must load the upstream model from a checkpoint dir (it is called on a stand-in
    checkpoint of element ids). Returns (recipes by state-dict name, names the checkpoint does not provide).

    Modules transformers keeps in float32 whatever the load dtype (``_keep_in_fp32_modules``: MoE routers,
    DeepSeek-V4's hyper-connections) receive the ids cast to float32, which cannot hold ``ID_BASE + i`` exactly:
    those tensors are learned again from a second stand-in whose ids start at 2**20 (exact in float32 while the
    checkpoint has under 15M elements), else matched by name and shape."""
    recipes, missing, lowp = _learn(ckpt, load_model, ID_BASE, None)
    if lowp:
        total = sum(_numel(i.shape) for i in ckpt.tensors.values())
        if FP32_ID_BASE + total < 2 ** 24:
            r2, _, _ = _learn(ckpt, load_model, FP32_ID_BASE, lowp)
            for name in list(lowp):
                if name in r2:
                    recipes[name] = r2[name]
                    lowp.discard(name)
        for name in lowp:
            info = ckpt.tensors.get(name)
            if info is not None:
                recipes[name] = [(0, name, 0, _numel(info.shape))]
            else:
                missing.add(name)
    return recipes, missing


FP32_ID_BASE = 2 ** 20


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _learn(ckpt: Checkpoint, load_model, id_base: int, only: set[str] | None):
    keys = sorted(ckpt.tensors)
    base, ids, sizes = {}, {}, {}
    offset = id_base
    for k in keys:
        info = ckpt.tensors[k]
        numel = _numel(info.shape)
        base[k], sizes[k] = offset, numel
        is_int = info.dtype.startswith(("int", "uint")) or info.dtype == "bool"
        ids[k] = (torch.arange(numel, dtype=torch.int64) + offset).to(
            torch.int64 if is_int else torch.float64).reshape(info.shape)
        offset += numel
    starts = sorted((b, k) for k, b in base.items())
    with tempfile.TemporaryDirectory(prefix="dayzero-ids-") as tmp:
        cfg = dict(ckpt.config)
        cfg.pop("quantization_config", None)
        cfg["torch_dtype"] = cfg["dtype"] = "float64"
        Path(tmp, "config.json").write_text(json.dumps(cfg))
        save_file(ids, str(Path(tmp, "model.safetensors")))
        del ids
        model = load_model(tmp, torch.float64)
    recipes, missing, lowp = {}, set(), set()
    for name, t in model.state_dict().items():
        if only is not None and name not in only:
            continue
        flat = t.detach().reshape(-1)
        if flat.numel() == 0:
            missing.add(name)
            continue
        if only is None and flat.dtype.is_floating_point and flat.dtype != torch.float64:
            lowp.add(name)  # kept in another dtype: ids lost precision (see learn_recipes)
            continue
        if flat.dtype.is_floating_point:
            if not torch.all((flat >= id_base) & (flat == flat.round())):
                missing.add(name)
                continue
            flat = flat.to(torch.int64)
        elif not torch.all(flat >= id_base):
            missing.add(name)
            continue
        flat = flat.tolist()
        runs: list[Run] = []
        i = 0
        while i < len(flat):
            b, key = starts[bisect.bisect_right(starts, (flat[i], "\uffff")) - 1]
            end = b + sizes[key]
            j = i + 1
            while j < len(flat) and flat[j] == flat[j - 1] + 1 and flat[j] < end:
                j += 1
            runs.append((i, key, flat[i] - b, j - i))
            i = j
        recipes[name] = runs
    return recipes, missing, lowp
