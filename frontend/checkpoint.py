"""Checkpoint directories as published: ``config.json`` + ``*.safetensors`` (+ ``model.safetensors.index.json``).

Tensors are read on demand through safetensors' memory map, one at a time: the checkpoint is never in RAM whole.

Module parameters are not always checkpoint tensors one to one: transformers renames keys and merges per-expert
tensors into one ``[E, ...]`` parameter while loading (``conversion_mapping.py``). Rather than copy those rules,
dayzero asks transformers' own loader: it loads a stand-in checkpoint whose every element holds its own global
index (``ID_BASE + i``, float64 or int64), and reads back in each parameter which checkpoint elements landed
where. The result is a *recipe* per parameter, a list of copy runs ``(dst, key, src, length)`` over flattened
tensors, that the runtime replays from the real checkpoint at load time. Stacking, concatenation, chunking and
renaming all come out as a few long runs.

Every file is untrusted input: each safetensors header is parsed and validated here (``read_header``: bounded
length, JSON, known dtypes, byte ranges that tile the data section exactly) before safetensors maps the file;
the checkpoint's tensors must be exactly those the model reads (``check_coverage``), float weights finite
(``first_nonfinite``), and the runtime checks the same headers, by fingerprint and per tensor, before binding
(``check_bound_files``).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import struct
import tempfile
import types
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dayzero import InternalError, UserError
from dayzero.frontend.trace_cache import cached_recipes
from dayzero.passes.ir.formats import E8M0_NAN, FP8_BLOCK_SIZE

ID_BASE = 2 ** 40  # far above any value an initialiser writes, exact in float64


@dataclass(frozen=True)
class TensorInfo:
    key: str
    file: str  # absolute path
    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, int] = (0, 0)  # byte range within the file's data section


@dataclass(frozen=True)
class Header:
    """One validated safetensors header: its tensors, metadata, and the file's fingerprint."""

    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    size: int  # bytes of the whole file
    sha256: str  # of the header's JSON bytes

    @property
    def fingerprint(self) -> dict:
        return {"bytes": self.size, "header_sha256": self.sha256}


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
        weight_map = _read_index(index) if index.is_file() else None
        if weight_map is not None:
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.dir.glob("*.safetensors"))
        if not files:
            raise UserError(f"{directory}: no *.safetensors files")
        self.files = [str(self.dir / f) for f in files]
        self.headers: dict[str, Header] = {}
        self.tensors: dict[str, TensorInfo] = {}
        for f in self.files:
            if not os.path.isfile(f):
                raise UserError(f"{index}: names {os.path.basename(f)}, which is not in {self.dir}")
            self.headers[f] = read_header(f)
            for key, info in self.headers[f].tensors.items():
                if key in self.tensors:
                    raise UserError(f"{self.dir}: tensor {key} is in both {os.path.basename(self.tensors[key].file)} "
                                    f"and {os.path.basename(f)}")
                self.tensors[key] = info
        if weight_map is not None:
            for key, name in sorted(weight_map.items()):
                info = self.tensors.get(key)
                if info is None or os.path.basename(info.file) != name:
                    raise UserError(f"{index}: maps tensor {key} to {name}, which does not hold it")

    def get(self, key: str) -> torch.Tensor:
        info = self.tensors.get(key)
        if info is None:
            raise UserError(f"checkpoint {self.dir} has no tensor {key!r}")
        with safe_open(info.file, framework="pt") as f:
            return f.get_tensor(key)

    def fingerprints(self) -> dict[str, dict]:
        """Per file: size and the sha256 of its safetensors header (names, dtypes, shapes, offsets).

        Hashing the header identifies the tensor layout in O(header) instead of reading terabytes."""
        return {f: self.headers[f].fingerprint for f in self.files}


# safetensors dtype code -> (torch dtype name, bytes per element)
_ST_DTYPES = {"F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
              "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1),
              "U64": ("uint64", 8), "U32": ("uint32", 4), "U16": ("uint16", 2), "U8": ("uint8", 1),
              "BOOL": ("bool", 1), "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
              "F8_E8M0": ("float8_e8m0fnu", 1)}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit on the JSON header


def _no_duplicates(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key {k!r} appears twice")
        out[k] = v
    return out


def _reject_constant(name):
    raise ValueError(f"{name} is not a JSON number")


def _is_uint(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def read_header(path: str) -> Header:
    """The validated header of a safetensors file; every violation a UserError naming the file (and tensor).

    Checked: the 8-byte length is within the file and ``MAX_HEADER_BYTES``; the header is a JSON object without
    repeated keys; ``__metadata__`` maps strings to strings; every tensor has a known dtype, a shape of
    non-negative ints and ``data_offsets`` [begin, end] with end - begin = numel * itemsize; and the tensors'
    byte ranges tile the data section exactly (no overlap, no gap, nothing past the end): what safetensors
    itself requires before mapping, so a file that passes here maps without error."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            raw = fh.read(8)
            if len(raw) < 8:
                raise UserError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            n = struct.unpack("<Q", raw)[0]
            if n > MAX_HEADER_BYTES:
                raise UserError(f"{path}: safetensors header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
            if n > size - 8:
                raise UserError(f"{path}: safetensors header length {n} runs past the end of the file (truncated?)")
            text = fh.read(n)
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        header = json.loads(text.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as e:
        raise UserError(f"{path}: safetensors header is not valid JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(header, dict):
        raise UserError(f"{path}: safetensors header is not a JSON object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise UserError(f"{path}: safetensors __metadata__ must map strings to strings")
    data = size - 8 - n
    tensors: dict[str, TensorInfo] = {}
    for key, m in header.items():
        where = f"{path}: tensor {key}"
        if not isinstance(m, dict) or set(m) != {"dtype", "shape", "data_offsets"}:
            raise UserError(f"{where}: header entry must have exactly dtype, shape and data_offsets")
        code, shape, offs = m["dtype"], m["shape"], m["data_offsets"]
        if not isinstance(code, str) or code not in _ST_DTYPES:
            raise UserError(f"{where}: unknown dtype {code!r} (known: {', '.join(_ST_DTYPES)})")
        if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
            raise UserError(f"{where}: shape {shape!r} is not a list of non-negative integers")
        if not isinstance(offs, list) or len(offs) != 2 or not all(_is_uint(o) for o in offs) or offs[0] > offs[1]:
            raise UserError(f"{where}: data_offsets {offs!r} is not [begin, end] with 0 <= begin <= end")
        dtype, itemsize = _ST_DTYPES[code]
        nbytes = _numel(shape) * itemsize
        if offs[1] - offs[0] != nbytes:
            raise UserError(f"{where}: data_offsets {offs} span {offs[1] - offs[0]} bytes but {code} {shape} "
                            f"needs {nbytes}")
        tensors[key] = TensorInfo(key, str(path), dtype, tuple(shape), (offs[0], offs[1]))
    end, last = 0, None
    for info in sorted(tensors.values(), key=lambda i: (i.offsets, i.key)):
        b, e = info.offsets
        if b < end:
            raise UserError(f"{path}: tensor {info.key} bytes [{b}, {e}) overlap tensor {last} (ends at {end})")
        if b > end:
            raise UserError(f"{path}: tensor {info.key} starts at byte {b} of the data, leaving a gap after "
                            f"{last or 'the header'} (ends at {end})")
        end, last = e, info.key
    if end > data:
        raise UserError(f"{path}: tensor {last} runs past the end of the file (truncated?)")
    if end < data:
        raise UserError(f"{path}: {data - end} bytes after the last tensor {last} that no tensor claims")
    return Header(tensors, dict(meta), size, hashlib.sha256(text).hexdigest())


def _read_index(index: Path) -> dict[str, str]:
    """model.safetensors.index.json's weight_map, validated: tensor name -> a file name inside the directory."""
    try:
        doc = json.loads(index.read_text(), object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"{index}: not a valid index ({str(e).splitlines()[0]})") from None
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise UserError(f"{index}: weight_map must map tensor names to file names")
    for v in set(wm.values()):
        if v in ("", ".", "..") or "/" in v or "\\" in v or not v.endswith(".safetensors"):
            raise UserError(f"{index}: {v!r} is not a .safetensors file name in the checkpoint directory")
    return wm


def check_bound_files(files: dict, tensors: dict[str, dict]) -> dict[str, Header]:
    """At load: every checkpoint file the artifact binds from still has the fingerprint recorded at compile
    (``files``: path -> {bytes, header_sha256}) and a valid header, and every source tensor (``tensors``: key ->
    {file, dtype, shape}) its recorded dtype and shape. Returns the headers by path; any difference is a
    UserError naming the file (and tensor), asking for a recompile."""
    headers = {}
    for f, want in sorted(files.items()):
        if not os.path.isfile(f):
            raise UserError(f"checkpoint file missing: {f} (the artifact was compiled from it)")
        h = read_header(f)
        if h.fingerprint != want:
            raise UserError(f"{f}: checkpoint file changed since compile (size or safetensors header differ); "
                            "recompile the artifact")
        headers[f] = h
    for key, want in sorted(tensors.items()):
        h = headers.get(want.get("file"))
        info = h.tensors.get(key) if h is not None else None
        if info is None:
            raise UserError(f"{want.get('file')}: tensor {key}, bound by the artifact, is not in the checkpoint")
        if info.dtype != want.get("dtype") or list(info.shape) != list(want.get("shape", ())):
            raise UserError(f"{info.file}: tensor {key} is {info.dtype} {list(info.shape)}, compiled for "
                            f"{want.get('dtype')} {want.get('shape')}; recompile the artifact")
    return headers


LOAD_CHUNK = 1 << 24  # elements per read (binding weights, scanning for non-finite values)


class TensorReader:
    """A safetensors file read with plain reads (its header validated by ``read_header``): never a memory map, whose
    pages would stay in the resident set until the file closed (a whole checkpoint's worth at full size)."""

    def __init__(self, path: str):
        self.path = path
        self.file = open(path, "rb")
        self.data = 8 + int.from_bytes(self.file.read(8), "little")  # the data section follows the header

    def read_into(self, dst: torch.Tensor, info, start: int) -> None:
        """Elements [start, start + dst.numel()) of tensor ``info`` into the contiguous 1-D ``dst``, converted to
        dst's dtype where they differ."""
        src = getattr(torch, info.dtype)
        size = src.itemsize
        pos = self.data + info.offsets[0] + start * size
        for part in dst.split(LOAD_CHUNK):
            n = part.numel() * size
            buf = part if part.dtype == src else torch.empty(part.numel(), dtype=src)
            got = self.file.readinto(memoryview(buf.view(torch.uint8).numpy())) if self.file.seek(pos) == pos else 0
            if got != n:
                raise UserError(f"{self.path}: tensor {info.key} ends early ({got} of {n} bytes read at {pos}); "
                                "the file is truncated")
            if buf is not part:
                part.copy_(buf)
            pos += n

    def close(self) -> None:
        self.file.close()


_FLOAT_DTYPES = {"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"}


def first_nonfinite(ckpt: Checkpoint, keys) -> str | None:
    """A one-line description of the first float tensor among ``keys`` holding NaN or Inf, else None.

    Streamed: each tensor is read ``LOAD_CHUNK`` elements at a time by a ``TensorReader``, with
    plain reads, not a memory map, whose pages would stay in this process's resident set until the file closes
    (a whole file's worth at full size): never the checkpoint, nor a large tensor, in memory at once."""
    by_file: dict[str, list[TensorInfo]] = {}
    for k in sorted(keys):
        info = ckpt.tensors[k]
        if info.dtype in _FLOAT_DTYPES and _numel(info.shape):
            by_file.setdefault(info.file, []).append(info)
    for f in sorted(by_file):
        reader = TensorReader(f)
        try:
            for info in by_file[f]:
                n = _numel(info.shape)
                buf = torch.empty(min(n, LOAD_CHUNK), dtype=getattr(torch, info.dtype))
                for start in range(0, n, LOAD_CHUNK):
                    part = buf[:min(LOAD_CHUNK, n - start)]
                    reader.read_into(part, info, start)
                    bad = (~torch.isfinite(part.float())).nonzero()
                    if len(bad):
                        flat = start + int(bad[0, 0])
                        first = list(torch.unravel_index(torch.tensor(flat), info.shape)) if info.shape else []
                        return (f"{f}: tensor {info.key} holds non-finite values (NaN/Inf), first at index "
                                f"{[int(i) for i in first]}; pass --allow-nonfinite to compile it anyway")
        finally:
            reader.close()
    return None


Run = tuple[int, str, int, int]  # (dst offset, checkpoint key, src offset, length), in elements


def learn_recipes(ckpt: Checkpoint, load_model, shapes: dict | None = None,
                  cache: Path | None = None) -> tuple[dict[str, list[Run]], set[str]]:
    """Recipes for every module tensor transformers fills from the checkpoint.

    ``load_model(dir, dtype)`` must load the upstream model from a checkpoint dir (it is called on a stand-in
    checkpoint of element ids). Returns (recipes by state-dict name, names the checkpoint does not provide);
    ``shapes``, when given, is filled with every state-dict tensor's shape.

    Modules transformers keeps in float32 whatever the load dtype (``_keep_in_fp32_modules``: MoE routers,
    DeepSeek-V4's hyper-connections) receive the ids cast to float32, which cannot hold ``ID_BASE + i`` exactly:
    those tensors are learned again from a second stand-in whose ids start at 2**20 (exact in float32 while the
    checkpoint has under 15M elements), else matched by name and shape.

    ``cache``: the trace cache's folder (``trace_cache.cached_recipes``; None: learned each time).

    A checkpoint of more than ``LEARN_ELEMENTS`` elements (a full-size model: its stand-in would be 8 bytes per
    element) is learned on its narrow twin instead (``_learn_narrow``)."""
    def learn(into: dict):
        if sum(_numel(i.shape) for i in ckpt.tensors.values()) > LEARN_ELEMENTS:
            return _learn_narrow(ckpt, load_model, into)
        return _learn_direct(ckpt, load_model, into)
    loader = f"{load_model.__module__}.{getattr(load_model, '__qualname__', type(load_model).__qualname__)}"
    recipes, missing, learned_shapes = cached_recipes(cache, ckpt, loader, learn)
    if shapes is not None:
        shapes.update(learned_shapes)
    return recipes, missing


def _learn_direct(ckpt, load_model, shapes: dict | None) -> tuple[dict[str, list[Run]], set[str]]:
    recipes, missing, lowp = _learn(ckpt, load_model, ID_BASE, None, shapes)
    if lowp:
        total = sum(_numel(i.shape) for i in ckpt.tensors.values())
        if FP32_ID_BASE + total < 2 ** 24:
            r2, _, _ = _learn(ckpt, load_model, FP32_ID_BASE, lowp, None)
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
LEARN_ELEMENTS = 50_000_000  # largest element-id stand-in learned directly (400 MB of float64)

# The narrow twin of a configuration: these width fields shrunk (everything else, layer and expert counts, layer
# types, head dims, kept); token ids moved inside the narrow vocabulary.
_NARROW = {"hidden_size": 64, "vocab_size": 256, "q_lora_rank": 48, "kv_lora_rank": 32, "o_lora_rank": 16,
           "o_groups": 2}
_NARROW_HEADS = ("num_attention_heads", "index_n_heads")


def narrow_config(config: dict) -> dict:
    """CONFIG (a config.json dict) with its widths shrunk: the same checkpoint keys, small tensors."""
    out = dict(config)
    heads = config.get("num_attention_heads")
    for k, v in config.items():
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            continue
        if k in _NARROW:
            out[k] = min(v, _NARROW[k])
        elif "intermediate_size" in k:
            out[k] = min(v, 64)
        elif k in _NARROW_HEADS:
            out[k] = min(v, 4)
        elif k == "num_key_value_heads" and isinstance(heads, int):
            out[k] = v if v == 1 else (min(heads, 4) if v == heads else min(v, 2))
        elif (k.endswith("token_id") or k.endswith("token_index")) and v >= _NARROW["vocab_size"]:
            out[k] = _NARROW["vocab_size"] - 1
    for k, v in config.items():
        if k.endswith("token_ids") and isinstance(v, list):
            out[k] = [min(x, _NARROW["vocab_size"] - 1) if isinstance(x, int) else x for x in v]
    return out


def _meta_layout(config: dict) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """(checkpoint key -> shape as saved, state-dict name -> shape) of the causal LM CONFIG describes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from .hf import _quiet

    d = {k: v for k, v in config.items() if k not in ("model_type", "quantization_config")}
    with _quiet(), torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **d))
    saved = {k: tuple(int(x) for x in v.shape) for k, v in saved_layout(model).items()}
    return saved, {k: tuple(int(x) for x in v.shape) for k, v in model.state_dict().items()}


def _learn_narrow(ckpt, load_model, shapes: dict | None):
    """Recipes of a full-size checkpoint from its narrow twin: the same keys at narrow widths (``narrow_config``)
    are learned by ``learn_recipes``; every parameter must be whole checkpoint tensors laid end to end there (a
    rename, a stack of experts, a concatenation), and then is so at full size with each key's full length.
    Anything else (a parameter taking part of a key, a transpose) is a UserError naming the parameter."""
    model_type = ckpt.config.get("model_type")
    try:
        narrow = narrow_config(ckpt.config)
        twin_layout, _ = _meta_layout(narrow)
        _, full_shapes = _meta_layout(ckpt.config)
    except Exception as e:  # noqa: BLE001 - transformers raises many types on configs it cannot build
        raise UserError(f"{ckpt.dir}: {model_type} is too large to learn its weight layout directly and has no "
                        f"narrow twin: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    if set(twin_layout) != set(ckpt.tensors):
        diff = sorted(set(twin_layout) ^ set(ckpt.tensors))
        raise UserError(f"{ckpt.dir}: the checkpoint's tensors are not those transformers saves for its config "
                        f"(differ: {_names(diff)})")
    twin = types.SimpleNamespace(dir=ckpt.dir, config=narrow, tensors={
        k: TensorInfo(k, "", ckpt.tensors[k].dtype, twin_layout[k]) for k in sorted(twin_layout)})
    narrow_recipes, missing = _learn_direct(twin, load_model, None)
    recipes = {}
    for name, runs in narrow_recipes.items():
        full, at, end = [], 0, 0
        for d0, key, s0, n in runs:
            if d0 != end or s0 != 0 or n != _numel(twin_layout[key]):
                raise UserError(f"{ckpt.dir}: parameter {name} takes part of checkpoint tensor {key}; its layout "
                                f"cannot be learned at full size")
            end += n
            full.append((at, key, 0, _numel(ckpt.tensors[key].shape)))
            at += full[-1][3]
        if at != _numel(full_shapes.get(name, ())):
            raise UserError(f"{ckpt.dir}: parameter {name} {list(full_shapes.get(name, ()))} is not the checkpoint "
                            f"tensors {', '.join(k for _, k, _, _ in full)} end to end")
        recipes[name] = full
    if shapes is not None:
        shapes.update(full_shapes)
    return recipes, missing


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _learn(ckpt: Checkpoint, load_model, id_base: int, only: set[str] | None, shapes: dict | None):
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
        try:
            model = load_model(tmp, torch.float64)
        except (RuntimeError, ValueError) as e:  # transformers' loader refused the tensors (shapes, conversion)
            raise UserError(_load_failure(ckpt, tmp, e)) from None
    recipes, missing, lowp = {}, set(), set()
    for name, t in model.state_dict().items():
        if shapes is not None:
            shapes[name] = tuple(int(d) for d in t.shape)
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
            ints = sorted(k for k in _keys_of(flat, starts) if ckpt.tensors[k].dtype not in _FLOAT_DTYPES)
            if ints:  # transformers would cast the integers: a float weight stored as int is a broken header
                k = ints[0]
                raise UserError(f"{getattr(ckpt, 'dir', '')}: tensor {k} is {ckpt.tensors[k].dtype}, but it fills "
                                f"the floating-point parameter {name}")
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


def _keys_of(ids: torch.Tensor, starts) -> set[str]:
    """The checkpoint keys whose element ids occur in ``ids`` (int64)."""
    bases = torch.tensor([b for b, _ in starts], dtype=torch.int64)
    pos = torch.bucketize(ids, bases, right=True) - 1
    return {starts[int(i)][1] for i in torch.unique(pos)}


def expected_layout(config_dir) -> dict[str, tuple[int, ...]] | None:
    """Checkpoint key -> shape as transformers would save this causal LM (its own reverse weight conversion on a
    meta model built from the config; tied weights left out, as save_pretrained does). A diagnosis aid only:
    None when transformers cannot say (another model class, a conversion without a reverse)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from .hf import _quiet

    try:
        with _quiet(), torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(config_dir)))
        return {k: tuple(int(d) for d in v.shape) for k, v in saved_layout(model).items()}
    except Exception:  # noqa: BLE001 - best effort: the caller falls back to transformers' own message
        return None


def saved_layout(model) -> dict[str, torch.Tensor]:
    """Checkpoint key -> tensor (meta tensors for a meta MODEL: shape and dtype only) as ``save_pretrained`` would
    write MODEL: its state dict without tied weights, through transformers' own reverse weight conversion."""
    from transformers.core_model_loading import revert_weight_conversion

    sd = model.state_dict()
    for k in getattr(model, "all_tied_weights_keys", None) or {}:
        sd.pop(k, None)
    return revert_weight_conversion(model, sd)


def _load_failure(ckpt, config_dir, err: Exception) -> str:
    """One line naming the checkpoint tensor transformers' loader could not place (else its own message)."""
    where = getattr(ckpt, "dir", config_dir)
    layout = expected_layout(config_dir)
    if layout is not None:
        for k, info in sorted(ckpt.tensors.items()):
            if k in layout and tuple(info.shape) != layout[k]:
                return f"{where}: tensor {k} has shape {list(info.shape)}, the model expects {list(layout[k])}"
        lacking = _absent(ckpt, layout)
        if lacking:
            return f"{where}: the checkpoint lacks tensor(s) {_names(lacking)}"
    first = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), type(err).__name__)
    return f"{where}: transformers cannot load the checkpoint's tensors: {first}"


def _absent(ckpt, layout: dict) -> list[str]:
    """The keys of ``expected_layout`` the checkpoint lacks (dense names: an MXFP4 NAME is stored as NAME_blocks)."""
    return sorted(k for k in set(layout) - set(ckpt.tensors) if k + "_blocks" not in ckpt.tensors)


def _names(keys, most: int = 5) -> str:
    keys = sorted(keys)
    more = f" and {len(keys) - most} more" if len(keys) > most else ""
    return ", ".join(keys[:most]) + more


def transformers_reports(model, unexpected=(), missing=()) -> tuple[set[str], set[str]]:
    """(unexpected, missing) keys transformers' loader still reports for ``model``'s class: it drops those its
    ``_keys_to_ignore_on_load_unexpected`` / ``_missing`` patterns match (real DeepSeek checkpoints ship MTP
    layers it skips), and old rotary ``inv_freq`` / ``position_ids`` entries (``_adjust_missing_and_unexpected_keys``,
    called here on the model itself so the rule is transformers' own)."""
    info = types.SimpleNamespace(unexpected_keys=set(unexpected), missing_keys=set(missing))
    adjust = getattr(model, "_adjust_missing_and_unexpected_keys", None)
    if adjust is None:
        raise InternalError(f"{type(model).__name__} has no _adjust_missing_and_unexpected_keys: this transformers "
                            "version loads differently from the one dayzero mirrors")
    adjust(info)
    return set(info.unexpected_keys), set(info.missing_keys)


def check_coverage(ckpt: Checkpoint, recipes: dict[str, list[Run]], missing: set[str], model) -> None:
    """The checkpoint holds exactly the model's tensors: every state-dict tensor ``learn_recipes`` found no
    checkpoint elements for (``missing``) and every checkpoint tensor no recipe reads is a UserError naming it,
    unless transformers' loader itself accepts it for ``model``'s class (``transformers_reports``).
    Non-persistent buffers (rotary inv_freq) are not in the state dict: the config computes them."""
    persistent = {k for k, v in model.state_dict().items() if v.numel()}
    _, lacking = transformers_reports(model, missing=set(missing) & persistent)
    if lacking:
        keys = _absent(ckpt, expected_layout(ckpt.dir) or {}) or sorted(lacking)
        raise UserError(f"{ckpt.dir}: the checkpoint lacks tensor(s) {_names(keys)} (the model's "
                        f"{_names(lacking, 3)})")
    used = {key for runs in recipes.values() for _, key, _, _ in runs}
    unused = set(ckpt.tensors) - used
    if unused:
        unused, _ = transformers_reports(model, unexpected=unused)
    if unused:
        raise UserError(f"{ckpt.dir}: {len(unused)} checkpoint tensor(s) the model never reads: {_names(unused)}")


def bound_tensors(ckpt: Checkpoint, recipes: dict[str, list[Run]]) -> dict[str, dict]:
    """key -> {file, dtype, shape} of every checkpoint tensor the recipes read: what the runtime checks."""
    used = {key for runs in recipes.values() for _, key, _, _ in runs}
    return {k: {"file": ckpt.tensors[k].file, "dtype": ckpt.tensors[k].dtype, "shape": list(ckpt.tensors[k].shape)}
            for k in sorted(used)}


# ---------------------------------------------------------------------------------------------------------------
# Low-precision checkpoints (MXFP4 gpt-oss layout, FP8-block DeepSeek layout), bound in their stored form.
#
# transformers only reads these dequantised (or, without `accelerate`, not at all), so the recipes are learned on
# the checkpoint *as if dequantised*: every low-precision group (NAME_blocks + NAME_scales, or an fp8 NAME +
# NAME_scale_inv) stands in as one fp32 key NAME of its dequantised shape, exactly what
# ``tools/make_tiny.dequantize_checkpoint`` and transformers' ``Mxfp4Config(dequantize=True)`` produce. A
# parameter whose runs all come from such keys is then re-expressed over the stored tensors: the blocks / scales
# get copy runs of their own (rows of [.., out, in] map to rows of [.., out, G, 16] and [.., out, G]; FP8 scales
# are re-expressed per row block of the parameter, see ``_fp8_param``), and the frontend rebuilds the fp32
# parameter in the graph with an explicit dequant subgraph (``lowprec``).

LOWP_METHODS = ("mxfp4", "fp8")
IN_MAJOR_META = "dayzero.mxfp4_in_major"  # safetensors metadata (make-tiny): fused NAMEs stored input-major


@dataclass(frozen=True)
class LowPrecGroup:
    """One low-precision checkpoint tensor as published: NAME (the dequantised key) -> its stored pieces."""

    name: str
    fmt: str  # "mxfp4" | "fp8"
    data_key: str  # NAME_blocks (uint8 [.., out, G, 16]) | NAME (float8_e4m3fn [.., out, in])
    scale_key: str  # NAME_scales (uint8 [.., out, G]) | NAME_scale_inv (fp32 [.., ceil(out/128), ceil(in/128)])
    stored: tuple[int, ...]  # dequantised shape in storage order [.., out, in]
    in_major: bool  # the dequantised key is [.., in, out] (transformers transposes fused gpt-oss experts)

    @property
    def shape(self) -> tuple[int, ...]:
        s = self.stored
        return (*s[:-2], s[-1], s[-2]) if self.in_major else s


@dataclass(frozen=True)
class LowPrecParam:
    """A module parameter bound from low-precision storage: IR weights ``data_name`` / ``scale_name`` bound by
    their own copy runs (element offsets into the stored tensors), dequantised in the graph."""

    param: str
    fmt: str  # "mxfp4" | "fp8"
    in_major: bool  # parameter = transpose(-1, -2) of the dequantised [.., out, in]
    data_runs: tuple
    scale_runs: tuple
    row_block: int = FP8_BLOCK_SIZE  # fp8: rows of the parameter sharing one scale row (a power of two dividing 128)

    @property
    def data_name(self) -> str:
        return f"{self.param}.{'blocks' if self.fmt == 'mxfp4' else 'fp8'}"

    @property
    def scale_name(self) -> str:
        return f"{self.param}.{'scales' if self.fmt == 'mxfp4' else 'scale_inv'}"

    def stored_shape(self, param_shape) -> tuple[int, ...]:
        """[.., out, in] of the dequantised values, in storage order."""
        s = tuple(int(d) for d in param_shape)
        return (*s[:-2], s[-1], s[-2]) if self.in_major else s

    def types(self, param_shape) -> tuple[tuple[str, tuple], tuple[str, tuple]]:
        """((data dtype, shape), (scale dtype, shape)) of the two IR weights."""
        st = self.stored_shape(param_shape)
        if self.fmt == "mxfp4":
            G = st[-1] // 32
            return ("uint8", (*st[:-1], G, 16)), ("uint8", (*st[:-1], G))
        return ("float8_e4m3fn", st), ("float32", fp8_scale_shape(st, self.row_block))


def fp8_scale_shape(stored, row_block: int) -> tuple[int, ...]:
    """Shape of an FP8 parameter's bound scales: one fp32 per (row_block rows, 128 columns) block of each [R, C]
    slice, [.., ceil(R/row_block), ceil(C/128)] (row_block 128: exactly the published weight_scale_inv)."""
    *lead, r, c = (int(d) for d in stored)
    return (*lead, -(-r // row_block), -(-c // FP8_BLOCK_SIZE))


def quant_method(ckpt: Checkpoint) -> str | None:
    q = ckpt.config.get("quantization_config") or {}
    m = str(q.get("quant_method", "")).lower()
    return m if m in LOWP_METHODS else None


def low_precision_groups(ckpt: Checkpoint, check_values: bool = True) -> dict[str, LowPrecGroup]:
    """The checkpoint's low-precision tensors, by dequantised name; validated (shapes from the headers, and the
    scale values: NaN E8M0 codes, NaN/Inf scale_inv), each error a UserError naming the tensor."""
    from . import lowprec

    if quant_method(ckpt) is None:
        return {}
    t = ckpt.tensors
    in_major: dict[str, set | None] = {}
    for f in ckpt.files:
        meta = ckpt.headers[f].metadata
        in_major[f] = _name_list(f, meta[IN_MAJOR_META]) if IN_MAJOR_META in meta else None
    out = {}
    for k, info in sorted(t.items()):
        if k.endswith("_blocks"):
            base = k[: -len("_blocks")]
            sk = base + "_scales"
            if sk not in t:
                raise UserError(f"{k}: MXFP4 blocks without their scales tensor {sk}")
            b, s = info, t[sk]
            if b.dtype not in ("uint8", "int8") or s.dtype not in ("uint8", "int8"):
                raise UserError(f"{base}: MXFP4 blocks/scales must be uint8, got {b.dtype}/{s.dtype}")
            if len(b.shape) < 3 or b.shape[-1] != lowprec.MXFP4_BYTES_PER_BLOCK:
                raise UserError(f"{k}: MXFP4 blocks must be [..., out, G, 16] uint8, got shape {list(b.shape)}")
            if tuple(b.shape[:-1]) != tuple(s.shape):
                raise UserError(f"{base}: blocks shape {list(b.shape)} does not match scales shape {list(s.shape)} "
                                f"(expected scales {list(b.shape[:-1])})")
            stored = (*b.shape[:-2], b.shape[-2] * lowprec.MXFP4_BLOCK)
            listed = in_major.get(info.file)
            # transformers' own rule (convert_moe_packed_tensors) transposes every fused [E, out, G, 16] tensor
            flip = (base in listed) if listed is not None else len(b.shape) == 4
            if check_values:
                _check_e8m0(ckpt.get(sk), base)
            out[base] = LowPrecGroup(base, "mxfp4", k, sk, stored, flip)
        elif info.dtype == "float8_e4m3fn":
            sk = (k[: -len("weight")] + "weight_scale_inv") if k.endswith(".weight") else k + "_scale_inv"
            if sk not in t:
                raise UserError(f"{k}: FP8 weight without its block scales {sk}")
            want = (*info.shape[:-2], -(-info.shape[-2] // lowprec.FP8_BLOCK[0]),
                    -(-info.shape[-1] // lowprec.FP8_BLOCK[1]))
            if tuple(t[sk].shape) != want or t[sk].dtype != "float32":
                raise UserError(f"{k}: weight shape {list(info.shape)} needs float32 {sk} of shape {list(want)}, "
                                f"got {t[sk].dtype} {list(t[sk].shape)}")
            if check_values:
                s = ckpt.get(sk)
                bad = ~torch.isfinite(s)
                if bad.any():
                    raise UserError(f"{sk}: {int(bad.sum())} NaN/Inf scale value(s), first at index "
                                    f"{[int(i) for i in bad.nonzero()[0]]}")
            out[k] = LowPrecGroup(k, "fp8", k, sk, tuple(info.shape), False)
    return out


def _name_list(path: str, text: str) -> set[str]:
    try:
        names = json.loads(text)
    except ValueError:
        names = None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise UserError(f"{path}: metadata {IN_MAJOR_META} must be a JSON list of tensor names")
    return set(names)


def _check_e8m0(scales: torch.Tensor, name: str) -> None:
    bad = scales.view(torch.uint8) == E8M0_NAN
    if bad.any():
        raise UserError(f"{name}_scales: {int(bad.sum())} NaN E8M0 scale code(s) 0xFF, first at index "
                        f"{[int(i) for i in bad.nonzero()[0]]}")


class _Dequantised:
    """The checkpoint as transformers' loader would see it dequantised (only ``tensors`` and ``config``)."""

    def __init__(self, ckpt: Checkpoint, groups: dict[str, LowPrecGroup]):
        self.dir = ckpt.dir
        self.config = {k: v for k, v in ckpt.config.items() if k != "quantization_config"}
        hidden = {g.scale_key for g in groups.values()} | {g.data_key for g in groups.values()}
        self.tensors = {k: v for k, v in ckpt.tensors.items() if k not in hidden}
        for g in groups.values():
            self.tensors[g.name] = TensorInfo(g.name, "", "float32", g.shape)


def learn_recipes_low_precision(ckpt: Checkpoint, load_model, cache: Path | None = None):
    """``learn_recipes`` for a checkpoint with low-precision tensors.

    Returns (recipes of the parameters stored in full precision, {param: LowPrecParam}, missing). A parameter
    built from low-precision keys whose runs cannot be re-expressed over the stored rows (a run splitting a
    row, an input-major parameter assembled from several keys) is a UserError naming it: dayzero never falls back to a silent full-precision copy."""
    groups = low_precision_groups(ckpt)
    if not groups:
        recipes, missing = learn_recipes(ckpt, load_model, cache=cache)
        return recipes, {}, missing
    shapes: dict = {}
    recipes, missing = learn_recipes(_Dequantised(ckpt, groups), load_model, shapes, cache=cache)
    dense, lowp = {}, {}
    for param, runs in recipes.items():
        used = {key for _, key, _, _ in runs}
        if not used & set(groups):
            dense[param] = runs
            continue
        if not used <= set(groups) or len({groups[k].fmt for k in used}) != 1 or \
                len({groups[k].in_major for k in used}) != 1:
            raise UserError(f"{param}: built from low-precision and other checkpoint tensors at once "
                            f"({', '.join(sorted(used))}); not supported")
        lowp[param] = _lowp_param(param, runs, groups, shapes.get(param))
    return dense, lowp, missing


def _lowp_param(param: str, runs, groups, shape=None) -> LowPrecParam:
    g0 = groups[runs[0][1]]
    fmt, flip, inner = g0.fmt, g0.in_major, g0.stored[-1]
    if flip:  # transpose(dequant(stored)) of one whole key
        if len(runs) != 1 or runs[0][0] != 0 or runs[0][2] != 0 or runs[0][3] != _numel(g0.shape):
            raise UserError(f"{param}: an input-major low-precision parameter must be one whole checkpoint tensor")
        runs = [(0, runs[0][1], 0, _numel(g0.stored))]
    for d0, k, s0, n in runs:
        if groups[k].stored[-1] != inner:
            raise UserError(f"{param}: low-precision pieces of different row lengths")
        if d0 % inner or s0 % inner or n % inner:
            raise UserError(f"{param}: a copy run splits a row of {k}; cannot bind it in low precision")
    if fmt == "mxfp4":  # a row of `inner` values = inner/2 block bytes = inner/32 scales
        def per(r, k):
            return tuple((d0 // inner * k, getattr(groups[key], r), s0 // inner * k, n // inner * k)
                         for d0, key, s0, n in runs)
        return LowPrecParam(param, fmt, flip, per("data_key", inner // 2), per("scale_key", inner // 32))
    if shape is None or len(shape) < 2 or shape[-1] != inner:
        raise InternalError(f"{param}: FP8 parameter shape {shape} unknown or not [.., R, {inner}]")
    return _fp8_param(param, runs, groups, int(shape[-2]), inner)


def _fp8_param(param: str, runs, groups, R: int, C: int) -> LowPrecParam:
    """An FP8 parameter [.., R, C]: the weight binds element for element; its scales are re-expressed per block
    of ``g`` rows of the parameter, g the largest power of two (<= 128) such that every g-row block of every
    [R, C] slice comes from the rows of ONE 128-row scale block of one checkpoint tensor. Each such block copies
    that tensor's scale row, so W[.., r, c] = E4M3(weight[.., r, c]) * scale[.., r // g, c // 128] exactly.

    Published DeepSeek experts (each expert's gate / up / down its own [out, in] tensor with its own
    weight_scale_inv, out a multiple of 128) give g = 128: the stored scales one to one, as few runs as keys. A
    tiny model's 32-row experts stacked into [E, 2I, H] give g = 32 (each scale row copied once per 32-row
    block: 4 bytes per 32 x 128 weights). The runs are split at [R, C]-slice boundaries of the parameter and of
    each checkpoint tensor first, so stacked [E, ..] keys with their own [E, ., .] scales are handled alike."""
    nb = -(-C // FP8_BLOCK_SIZE)
    segs = []  # (dst row, key, src row, rows) within one slice on both sides
    for d0, k, s0, n in runs:
        dr, sr, left, rk = d0 // C, s0 // C, n // C, groups[k].stored[-2]
        while left:
            take = min(left, R - dr % R, rk - sr % rk)
            segs.append((dr, k, sr, take))
            dr, sr, left = dr + take, sr + take, left - take

    def fits(g):
        return all(dr % R % g == 0 and sr % groups[k].stored[-2] % g == 0 and
                   (n % g == 0 or (dr + n) % R == 0) for dr, k, sr, n in segs)
    g = next(g for g in (128, 64, 32, 16, 8, 4, 2, 1) if fits(g))
    nr = -(-R // g)
    scale_runs: list = []
    for dr, k, sr, n in segs:
        rk = groups[k].stored[-2]
        for j in range(0, n, g):
            src_row = sr + j  # scale row of key k: [.., ceil(rk/128), nb] flattened
            s_idx = (src_row // rk) * -(-rk // FP8_BLOCK_SIZE) + (src_row % rk) // FP8_BLOCK_SIZE
            d_idx = (dr + j) // R * nr + (dr + j) % R // g
            run = (d_idx * nb, groups[k].scale_key, s_idx * nb, nb)
            if scale_runs and scale_runs[-1][1] == run[1] and \
                    scale_runs[-1][0] + scale_runs[-1][3] == run[0] and scale_runs[-1][2] + scale_runs[-1][3] == run[2]:
                last = scale_runs.pop()
                run = (last[0], last[1], last[2], last[3] + nb)
            scale_runs.append(run)
    return LowPrecParam(param, "fp8", False, tuple(runs), tuple(scale_runs), g)
