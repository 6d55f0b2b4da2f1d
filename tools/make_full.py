"""`dayzero make-full MODEL_TYPE -o DIR`: write a full-width checkpoint of a published MoE model, synthetic weights.

The configuration is the published ``config.json`` of the model's reference checkpoint (``PUBLISHED``, written out
as data), unchanged except the layer count: ``--layers N`` keeps the first N layers and cuts every per-layer list
(layer types, MLP types) to the same N. The weights are synthetic but look trained (the statistics of make-tiny's
``_fill_parameters``): fan-in scaled matrices (activations stay O(1)), norm weights near 1, small biases and
attention sinks, routers whose logits are O(1) so tokens spread over the experts, distinct random expert ids in
hash-routing tables. They are written in the published on-disk format:

  * key names, shapes and dtypes of ``save_pretrained`` (transformers' reverse weight conversion run on the model
    built on the ``meta`` device: ``checkpoint.saved_layout``), non-expert parameters in bfloat16 (the published
    ``torch_dtype``), persistent buffers (``e_score_correction_bias``, ``tid2eid``) in the model's own dtype;
  * routed experts in ``--experts`` (default: the published format): MXFP4 ``NAME_blocks`` / ``NAME_scales``,
    FP8 ``weight`` + ``weight_scale_inv`` (128x128 blocks), or bf16, exactly as make-tiny writes them
    (``make_tiny.EXPERT_KEYS_DOC``), with ``quantization_config`` in config.json;
  * sharded safetensors ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``.

Nothing is ever materialised whole: the shard plan (every stored tensor's dtype, shape and byte range) comes from
shapes alone, each shard's header is written first and its tensors are generated and encoded one source tensor at a
time, in slices of at most ``CHUNK_ELEMENTS`` values (one expert of a fused expert tensor, a band of rows
otherwise). Each source tensor draws from its own generator seeded by (seed, sha256 of its name), so the same
arguments give byte-identical files and peak memory is a few chunks, whatever the checkpoint's size.
The tokenizer files are make-tiny's (``tools/tiny_tokenizer.py``), at the published vocabulary size.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np

from dayzero import InternalError, UserError
from dayzero.frontend import lowprec

FULL_EXPERT_FORMATS = ("mxfp4", "fp8", "bf16")
SHARD_BYTES = 4 * 2 ** 30  # the published gpt-oss-20b / Qwen3 / DeepSeek shards are 4-5 GB
CHUNK_ELEMENTS = 1 << 24  # values generated at once (64 MiB of fp32)
DTYPE = "bfloat16"  # published torch_dtype of every model below

# The published config.json values (architecture fields) of each model_type's reference checkpoint. DeepSeek-V4's
# are transformers' DeepseekV4Config defaults, which its docstring gives as DeepSeek-V4-Flash's.
_GPT_OSS_20B = {
    "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002, "experts_per_token": 4,
    "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999, "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088,
}
_QWEN3_30B_A3B = {
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643, "decoder_sparse_step": 1,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "sliding_window": None, "tie_word_embeddings": False, "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}
_DEEPSEEK_V3 = {
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02,
    "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
    "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "tie_word_embeddings": False, "topk_group": 4,
    "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}
PUBLISHED: dict[str, dict] = {
    "gpt_oss": {"checkpoint": "openai/gpt-oss-20b", "experts": "mxfp4", "config": _GPT_OSS_20B},
    "qwen3_moe": {"checkpoint": "Qwen/Qwen3-30B-A3B", "experts": "bf16", "config": _QWEN3_30B_A3B},
    "deepseek_v3": {"checkpoint": "deepseek-ai/DeepSeek-V3", "experts": "fp8", "config": _DEEPSEEK_V3},
    "deepseek_v32": {"checkpoint": "deepseek-ai/DeepSeek-V3.2-Exp", "experts": "fp8",
                     "config": {**_DEEPSEEK_V3, "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048}},
    "deepseek_v4": {"checkpoint": "deepseek-ai/DeepSeek-V4-Flash", "experts": "mxfp4", "config": {}},
}


# ============================================================================================================
# Configuration
# ============================================================================================================

def full_config(model_type: str, layers: int | None = None, overrides: dict | None = None):
    """The published configuration of MODEL_TYPE (a transformers config object) with its first LAYERS layers.

    ``overrides`` (tests only, no CLI option): config fields replaced before the cut, e.g. a narrow width."""
    from transformers import AutoConfig

    if model_type not in PUBLISHED:
        raise UserError(f"make-full knows no published configuration for {model_type!r} "
                        f"(known: {', '.join(sorted(PUBLISHED))})")
    try:
        base = AutoConfig.for_model(model_type, **{**PUBLISHED[model_type]["config"], **(overrides or {})})
    except (ValueError, KeyError) as e:  # transformers of another version may lack the model
        raise UserError(f"transformers cannot build the {model_type} configuration: {str(e).splitlines()[0]}") \
            from None
    d = {k: v for k, v in base.to_dict().items() if k not in ("model_type", "transformers_version")}
    n_orig = d["num_hidden_layers"]
    if layers is not None:
        if not 1 <= layers <= n_orig:
            raise UserError(f"--layers must be between 1 and {n_orig} (the published {model_type} has {n_orig} "
                            f"layers), got {layers}")
        for k, v in list(d.items()):
            if isinstance(v, list) and len(v) == n_orig and k != "num_hidden_layers":
                d[k] = v[:layers]  # per-layer lists: the first LAYERS entries
            elif k == "mlp_only_layers" and isinstance(v, list):
                d[k] = [i for i in v if i < layers]
            elif k == "max_window_layers" and isinstance(v, int):
                d[k] = min(v, layers)
        d["num_hidden_layers"] = layers
    return AutoConfig.for_model(model_type, **d)


# ============================================================================================================
# What is stored: one Source per tensor of the saved state dict, one or two stored tensors each
# ============================================================================================================

_ST_CODE = {"float32": "F32", "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3", "uint8": "U8", "int64": "I64",
            "int32": "I32"}
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float8_e4m3fn": 1, "uint8": 1, "int64": 8, "int32": 4}


@dataclass(frozen=True)
class Stored:
    key: str
    dtype: str  # numpy / ml_dtypes name, a key of _ST_CODE
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class Source:
    """One saved tensor (name and shape as save_pretrained writes it) and how it is drawn and stored.

    kind: 'embed' | 'matrix' | 'expert' | 'ones' | 'sink' | 'small' | 'expert_ids'; fan_in for matrices;
    fmt: storage ('bfloat16', 'float32', 'int64', or for experts 'mxfp4' | 'fp8' | 'bf16'); in_major: a fused
    expert tensor stored [E, in, out] (gpt-oss), encoded over [E, out, in]."""

    key: str
    shape: tuple[int, ...]
    kind: str
    fmt: str
    fan_in: int = 1
    in_major: bool = False
    n_experts: int = 0

    def stored(self) -> list[Stored]:
        s = self.shape
        if self.fmt == "mxfp4":
            out_in = (*s[:-2], s[-1], s[-2]) if self.in_major else s
            g = out_in[-1] // lowprec.MXFP4_BLOCK if out_in[-1] % lowprec.MXFP4_BLOCK == 0 else None
            if g is None:
                raise InternalError(f"{self.key}: input dim {out_in[-1]} is not a multiple of 32 (MXFP4)")
            return [Stored(self.key + "_blocks", "uint8", (*out_in[:-1], g, lowprec.MXFP4_BYTES_PER_BLOCK)),
                    Stored(self.key + "_scales", "uint8", (*out_in[:-1], g))]
        if self.fmt == "fp8":
            sk = self.key[: -len("weight")] + "weight_scale_inv" if self.key.endswith(".weight") \
                else self.key + "_scale_inv"
            r, c = lowprec.FP8_BLOCK
            return [Stored(self.key, "float8_e4m3fn", s),
                    Stored(sk, "float32", (*s[:-2], -(-s[-2] // r), -(-s[-1] // c)))]
        return [Stored(self.key, "bfloat16" if self.fmt == "bf16" else self.fmt, s)]


def _natural(key: str):
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", key)]


def plan_sources(cfg, experts: str) -> tuple[list[Source], dict]:
    """Every saved tensor of the model CFG describes, in checkpoint key order, and the meta model's
    ``quantization_config`` for EXPERTS (None for bf16)."""
    import torch

    from dayzero.frontend.checkpoint import saved_layout
    from dayzero.frontend.hf import _quiet
    from dayzero.tools.make_tiny import _EXPERT_COUNT_KEYS, _expert_keys, _experts_modules, _quant_config, \
        auto_class

    with _quiet(), torch.device("meta"):
        model = auto_class(cfg).from_config(cfg)
    layout = saved_layout(model)
    modules = _experts_modules(model)
    in_major = {n: im for n, _, im in modules}
    kinds = _expert_keys(layout.keys(), [n for n, _, _ in modules])
    if not kinds:
        raise UserError(f"{cfg.model_type} with {cfg.num_hidden_layers} layer(s) has no routed experts (its first "
                        f"layers are dense): pass more --layers")
    embeds = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    buffers = {id(b) for b in model.buffers()}
    n_exp = next((getattr(cfg, k) for k in _EXPERT_COUNT_KEYS if isinstance(getattr(cfg, k, None), int)), 0)
    out = []
    for key in sorted(layout, key=_natural):
        t = layout[key]
        shape = tuple(int(d) for d in t.shape)
        if not shape:
            raise InternalError(f"{key}: a 0-d tensor; make-full writes tensors of at least one dimension")
        leaf = key.rsplit(".", 1)[-1]
        if not t.dtype.is_floating_point:
            if len(shape) != 2 or not 0 < shape[1] <= n_exp:
                raise InternalError(f"{key}: integer tensor {list(shape)} of unknown meaning")
            out.append(Source(key, shape, "expert_ids", "int64", n_experts=n_exp))
        elif key in kinds:
            owner, kind = kinds[key]
            im = kind == "fused" and in_major[owner]
            fan_in = shape[-2] if im else shape[-1]
            out.append(Source(key, shape, "expert", experts, fan_in=fan_in, in_major=im))
        else:
            fmt = "float32" if id(t) in buffers else "bfloat16"
            if id(t) in embeds or "embed" in key:
                kind = "embed"
            elif len(shape) >= 2:
                kind = "matrix"
            elif "norm" in key.lower() or "scale" in leaf:
                kind = "ones"
            elif "sink" in leaf:
                kind = "sink"
            else:
                kind = "small"
            out.append(Source(key, shape, kind, fmt, fan_in=math.prod(shape[1:]) if len(shape) >= 2 else 1))
    return out, _quant_config(experts, model, cfg) if experts != "bf16" else None


# ============================================================================================================
# Drawing and encoding, a chunk at a time
# ============================================================================================================

def _rng(seed: int, key: str) -> np.random.Generator:
    digest = int.from_bytes(hashlib.sha256(key.encode()).digest()[:16], "little")
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, digest])))


def _chunks(src: Source):
    """(start, stop) along dim 0 of the saved shape: one expert of a fused tensor, else bands of rows."""
    n0 = src.shape[0]
    row = src.n_experts if src.kind == "expert_ids" else math.prod(src.shape[1:])  # values drawn per row
    step = max(1, CHUNK_ELEMENTS // max(row, 1))
    if src.kind == "expert" and len(src.shape) == 3:
        step = 1  # blocks never cross experts
    elif src.fmt == "fp8":
        step = max(lowprec.FP8_BLOCK[0], step // lowprec.FP8_BLOCK[0] * lowprec.FP8_BLOCK[0])
    for a in range(0, n0, step):
        yield a, min(n0, a + step)


def _draw(src: Source, rng: np.random.Generator, shape) -> np.ndarray:
    """fp32 (or int64) values of a slice of SRC of SHAPE, drawn next from RNG."""
    if src.kind == "expert_ids":  # hash routing table [vocab, k]: k distinct expert ids per row
        return np.argsort(rng.random((shape[0], src.n_experts), dtype=np.float32), axis=1)[:, : shape[1]] \
            .astype(np.int64)
    x = rng.standard_normal(shape, dtype=np.float32)
    if src.kind == "embed":
        return x
    if src.kind in ("matrix", "expert"):
        return x * np.float32(1 / math.sqrt(src.fan_in))
    if src.kind == "ones":
        return 1 + np.float32(0.05) * x
    if src.kind == "sink":
        return np.float32(0.5) * x
    return np.float32(0.05) * x


def _encode(src: Source, w: np.ndarray) -> list[np.ndarray]:
    """The stored arrays (as in ``Source.stored``) of a dim-0 slice W of SRC."""
    import ml_dtypes

    if src.fmt == "mxfp4":
        out_in = np.swapaxes(w, -1, -2) if src.in_major else w
        return list(lowprec.quantize_mxfp4(out_in, name=src.key))
    if src.fmt == "fp8":
        return list(lowprec.quantize_fp8_block(w, name=src.key))
    if src.fmt in ("bf16", "bfloat16"):
        return [w.astype(ml_dtypes.bfloat16)]
    return [w]


# ============================================================================================================
# Streamed sharded writer
# ============================================================================================================

def plan_shards(sources: list[Source], max_bytes: int) -> list[list[Source]]:
    """Sources in order, cut into shards of at most MAX_BYTES (a larger single source gets its own shard)."""
    shards, cur, size = [], [], 0
    for s in sources:
        b = sum(t.nbytes for t in s.stored())
        if cur and size + b > max_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(s)
        size += b
    if cur:
        shards.append(cur)
    return shards


def _header(shard: list[Source], meta: dict) -> tuple[bytes, dict[str, int]]:
    header, offsets, off = {"__metadata__": {"format": "pt", **meta}}, {}, 0
    for s in shard:
        for t in s.stored():
            header[t.key] = {"dtype": _ST_CODE[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + t.nbytes]}
            offsets[t.key] = off
            off += t.nbytes
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return len(h).to_bytes(8, "little") + h, offsets


def write_shard(path: Path, shard: list[Source], seed: int, meta: dict, progress=None) -> int:
    """Write one safetensors file: its header, then each source drawn and encoded slice by slice (``progress(n)``
    after each source, n its stored bytes). Returns the file's size."""
    head, offsets = _header(shard, meta)
    with open(path, "wb") as f:
        f.write(head)
        for s in shard:
            rng = _rng(seed, s.key)
            stored = s.stored()
            written = [0] * len(stored)
            for a, b in _chunks(s):
                arrays = _encode(s, _draw(s, rng, (b - a, *s.shape[1:])))
                for i, (t, arr) in enumerate(zip(stored, arrays)):
                    data = np.ascontiguousarray(arr).tobytes()
                    f.seek(len(head) + offsets[t.key] + written[i])
                    f.write(data)
                    written[i] += len(data)
            for t, n in zip(stored, written):
                if n != t.nbytes:
                    raise InternalError(f"{t.key}: wrote {n} bytes, planned {t.nbytes}")
            if progress is not None:
                progress(sum(t.nbytes for t in stored))
        f.seek(0, os.SEEK_END)
        return f.tell()


def make_full(model_type: str, out_dir, layers: int | None = None, experts: str | None = None, seed: int = 0,
              *, overrides: dict | None = None, shard_bytes: int = SHARD_BYTES, progress=None) -> Path:
    """Write a full-width synthetic checkpoint of MODEL_TYPE to OUT_DIR: config.json, the sharded safetensors,
    model.safetensors.index.json and the tokenizer files. ``experts``: mxfp4 | fp8 | bf16 (default: the published
    format). ``progress(done, total)``: called with stored bytes as the shards fill. ``overrides`` /
    ``shard_bytes``: for tests (a narrow width, small shards); no CLI option."""
    from dayzero.frontend.checkpoint import IN_MAJOR_META
    from dayzero.tools.make_tiny import staged_dir
    from dayzero.tools.tiny_tokenizer import write_tokenizer

    if model_type not in PUBLISHED:
        full_config(model_type)  # raises the UserError naming the known types
    experts = experts or PUBLISHED[model_type]["experts"]
    if experts not in FULL_EXPERT_FORMATS:
        raise UserError(f"--experts must be one of {', '.join(FULL_EXPERT_FORMATS)}, got {experts!r}")
    cfg = full_config(model_type, layers, overrides)
    sources, qc = plan_sources(cfg, experts)
    shards = plan_shards(sources, shard_bytes)
    n = len(shards)
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    total_bytes = sum(t.nbytes for s in sources for t in s.stored())
    done = [0]

    def advance(nbytes):
        done[0] += nbytes
        if progress is not None:
            progress(done[0], total_bytes)
    out = Path(out_dir)
    with staged_dir(out, ".make_full.") as tmp:
        weight_map, total = {}, 0
        for name, shard in zip(names, shards):
            flip = sorted(s.key for s in shard if s.fmt == "mxfp4" and s.in_major)
            meta = {IN_MAJOR_META: json.dumps(flip)} if flip else {}
            write_shard(tmp / name, shard, seed, meta, advance)
            for s in shard:
                for t in s.stored():
                    weight_map[t.key] = name
                    total += t.nbytes
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        c = cfg.to_dict()
        c["architectures"] = [type_name(cfg)]
        c["dtype"] = DTYPE  # as published (the frontend traces in fp32 whatever it says)
        if qc:
            c["quantization_config"] = qc
        (tmp / "config.json").write_text(json.dumps(c, indent=2, sort_keys=True) + "\n")
        write_tokenizer(cfg, tmp)
    return out


def type_name(cfg) -> str:
    """The model class name config.json's ``architectures`` lists (e.g. GptOssForCausalLM)."""
    from dayzero.tools.make_tiny import auto_class

    return auto_class(cfg)._model_mapping[type(cfg)].__name__


@click.command("make-full")
@click.argument("model_type")
@click.option("-o", "--out", "out_dir", required=True, type=click.Path(file_okay=False), help="checkpoint dir")
@click.option("--layers", type=int, default=None, help="keep the first N layers (default: all, as published)")
@click.option("--experts", type=click.Choice(FULL_EXPERT_FORMATS), default=None,
              help="storage of the routed experts' weights (default: the published format)")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def make_full_cmd(model_type, out_dir, layers, experts, seed, as_json):
    """Write a full-width synthetic checkpoint of the published MODEL_TYPE (gpt_oss, qwen3_moe, deepseek_v3,
    deepseek_v32, deepseek_v4) in its published on-disk format, streamed shard by shard."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn(), disable=as_json, transient=True) as bar:
        task = bar.add_task(f"make-full {model_type}", total=None)
        path = make_full(model_type, out_dir, layers=layers, experts=experts, seed=seed,
                         progress=lambda done, total: bar.update(task, completed=done, total=total))
        experts = json.loads((path / "config.json").read_text()).get("quantization_config", {}).get(
            "quant_method", "bf16")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    cfg = json.loads((path / "config.json").read_text())
    info = {"model_type": model_type, "out": str(path), "experts": experts, "seed": seed,
            "checkpoint": PUBLISHED[model_type]["checkpoint"], "num_hidden_layers": cfg["num_hidden_layers"],
            "bytes": index["metadata"]["total_size"], "shards": len(set(index["weight_map"].values()))}
    click.echo(json.dumps(info, sort_keys=True) if as_json else
               f"wrote full-width {model_type} ({cfg['num_hidden_layers']} layers, {experts} experts, "
               f"{info['bytes'] / 1e9:.2f} GB in {info['shards']} shards) to {path}")


__all__ = ["make_full", "make_full_cmd", "full_config", "plan_sources", "plan_shards",
           "PUBLISHED", "FULL_EXPERT_FORMATS"]
