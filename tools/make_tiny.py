"""`dayzero make-tiny MODEL_TYPE -o DIR`: write a tiny, faithful checkpoint of a transformers MoE decoder.

The tiny model is the published architecture with every special feature left on (shared experts, group-limited
routing, hash-routed MoE layers, indexer top-k, compressed / sliding attention, attention sinks, hyper-connections,
dense first layers, vision tower...) but small sizes: hidden 64, 4 heads, head_dim 16, 8 routed experts, top-2,
vocab 256 and just enough layers for every per-layer type to appear once.

How it works, generically (no per-model branches):
  1. ``AutoConfig.for_model(model_type)`` gives the published full-size configuration; every field is shrunk by
     its *name* (``_shrink_value``), per-layer lists are re-scheduled to the new layer count (``_schedule``),
     lists of layer indices are rescaled, token ids are moved inside the tiny vocabulary, and rope scaling is
     kept consistent (``original_max_position_embeddings = max_position_embeddings / factor``).
  2. ``AutoModelForCausalLM.from_config(cfg, experts_implementation="batched_mm")`` builds it with a fixed seed;
     then parameters are re-drawn so that the model looks like a trained checkpoint (``_fill_parameters``):
     fan-in scaled weights (activations stay O(1)), norm weights near 1, small random biases, attention sinks
     and correction biases, and random distinct expert ids in hash-routing tables (``tid2eid``).
  3. Routed-expert weights are rounded to the requested storage format (bf16, MXFP4 or FP8-block), *in the
     model*, so the in-memory reference and the checkpoint agree exactly; ``save_pretrained`` writes the
     published key names (it splits transformers' fused experts back to per-expert tensors where the published
     checkpoints have them); then the expert tensors in ``model.safetensors`` are replaced by their
     low-precision encoding (see ``EXPERT_KEYS_DOC``) and ``quantization_config`` is added to ``config.json``.
  4. A forward pass on a few tokens checks that the tiny model runs.
  5. A tiny byte-level BPE tokenizer and a ChatML chat template are written next to the weights
     (``tools/tiny_tokenizer.py``: trained on a fixed text, its special tokens at the ids the config names).

Same arguments give byte-identical files.
"""

from __future__ import annotations

import contextlib

import json
import math
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import click
import numpy as np

from dayzero import InternalError, UserError
from dayzero.frontend import lowprec
from dayzero.tools.tiny_tokenizer import write_tokenizer

EXPERT_FORMATS = ("fp32", "bf16", "mxfp4", "fp8")

# Target sizes of the tiny model.
HIDDEN = 64
HEADS = 4
HEAD_DIM = 16
INTERMEDIATE = 128
MOE_INTERMEDIATE = 32
EXPERTS = 8
TOP_K = 2
VOCAB = 256
MAX_POS = 4096
WINDOW = 8
ROTARY_MIN = 8  # rotary dims kept at least this many (partial rotary archs get a wider head_dim)
VISION_HIDDEN = 32
VISION_HEADS = 2
VISION_DEPTH = 2
MAX_PARAMS = 20_000_000
CHECK_SEQ = 16  # tokens of the build check (a multiple of every compression rate, >= every index top-k)

EXPERT_KEYS_DOC = """\
Low-precision routed-expert keys written by make-tiny (everything else stays fp32):
  fused experts as published (gpt-oss: `model.layers.{i}.mlp.experts.gate_up_proj` [E, H, 2I] and `down_proj`
  [E, I, H], stored input-major): NAME -> NAME_blocks uint8 [E, out, in/32, 16] + NAME_scales uint8 [E, out, in/32]
  (mxfp4, exactly the gpt-oss layout), or NAME (float8_e4m3fn, same shape as NAME) + NAME_scale_inv fp32 [E,
  ceil(dim1/128), ceil(dim2/128)] (fp8); `*_bias` stay unquantised.
  per-expert linears as published (qwen/mixtral/deepseek: `...experts.{j}.{gate,up,down}_proj.weight` [out, in],
  deepseek-v4: `...experts.{j}.w{1,2,3}.weight`): mxfp4 -> `....weight_blocks` uint8 [out, in/32, 16] +
  `....weight_scales` uint8 [out, in/32] (same packing as gpt-oss); fp8 -> `....weight` float8_e4m3fn [out, in] +
  `....weight_scale_inv` fp32 [ceil(out/128), ceil(in/128)] (DeepSeek-V3 layout).
  Fused tensors are blocked over [E, out, in] whatever their parameter layout; the NAMEs whose parameter layout
  is input-major [E, in, out] (gpt-oss, llama4; transformers transposes them back) are listed in the
  safetensors metadata key `dayzero.mxfp4_in_major` (JSON list). Other fused layouts (qwen3_vl_moe, hy_v4,
  granitemoe_swa...) are [E, out, in] already.
  MXFP4: E2M1 codes, low nibble = even element; value = LUT[code] * 2^(scale - 127).
  FP8: value = fp8 * scale_inv per 128x128 block.
"""


def _roundtrip(fmt: str, w_out_in: np.ndarray) -> np.ndarray:
    """Values of W [..., out, in] after storage in FMT (what a loader reads back), by lowprec's quantisers (the
    codebase's one MXFP4 and one FP8 rounding rule); the values are fixed points of them, so the stored encoding
    written from them later is exact."""
    import ml_dtypes

    if fmt == "fp32":
        return w_out_in.astype(np.float32)
    if fmt == "bf16":
        return w_out_in.astype(ml_dtypes.bfloat16).astype(np.float32)
    if fmt == "mxfp4":
        return np.asarray(lowprec.dequant_mxfp4(*lowprec.quantize_mxfp4(w_out_in)), dtype=np.float32)
    if fmt == "fp8":
        return np.asarray(lowprec.dequant_fp8_block(*lowprec.quantize_fp8_block(w_out_in)), dtype=np.float32)
    raise InternalError(fmt)


# ============================================================================================================
# Config shrinking
# ============================================================================================================

_EXPERT_COUNT_KEYS = ("n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts")
_TOPK_KEYS = ("num_experts_per_tok", "moe_topk", "moe_k", "top_k", "num_selected_experts")
_LAYER_COUNT_KEYS = ("num_hidden_layers", "num_layers", "n_layers", "depth")
_DROP_KEYS = {"model_type", "transformers_version", "_name_or_path", "architectures", "id2label", "label2id",
              "_attn_implementation_autoset", "torch_dtype", "dtype"}


def _is_vision(d: dict) -> bool:
    return "patch_size" in d and ("depth" in d or "num_hidden_layers" in d) and "vocab_size" not in d


def _n_layers(d: dict):
    for k in _LAYER_COUNT_KEYS:
        if isinstance(d.get(k), int):
            return k, d[k]
    return None, None


def _kv_heads(orig_kv, orig_heads, heads):
    if not isinstance(orig_kv, int) or orig_kv <= 0:
        return orig_kv
    if orig_kv == 1:
        return 1  # MQA stays MQA
    if isinstance(orig_heads, int) and orig_kv == orig_heads:
        return heads  # MHA stays MHA
    return min(orig_kv, max(1, heads // 2))


def _schedule(values: list, n: int, extra=()):
    """Re-schedule a per-layer list to N layers keeping every distinct value (in order of first appearance,
    plus EXTRA allowed values): block-structured lists (each value one contiguous run, e.g. dense then sparse)
    keep that shape with the last value extended; interleaved lists cycle."""
    distinct = []
    for v in list(values) + list(extra):
        if v not in distinct:
            distinct.append(v)
    runs = 1 + sum(1 for a, b in zip(values, values[1:]) if a != b)
    if runs == len(set(map(repr, values))) and not extra:
        return [distinct[min(i, len(distinct) - 1)] for i in range(n)]
    return [distinct[i % len(distinct)] for i in range(n)]


def _allowed_values(config_cls, values) -> list:
    """Values a per-layer list may take beyond those the default config uses: module-level constants of the
    configuration module that contain every value present (e.g. DeepSeek-V4's attention layer types)."""
    mod = sys.modules.get(config_cls.__module__)
    present = set(values)
    if not mod or not all(isinstance(v, str) for v in values):
        return []
    best = []
    for name, obj in vars(mod).items():
        if name.startswith("_") or not isinstance(obj, (tuple, list, frozenset, set)):
            continue
        if obj and all(isinstance(v, str) for v in obj) and present <= set(obj) and len(obj) > len(best):
            best = list(obj) if isinstance(obj, (tuple, list)) else sorted(obj)
    return [v for v in best if v not in present]


def _shrink_rope(rp, new_max, pf):
    if not isinstance(rp, dict):
        return rp
    out = {}
    for k, v in rp.items():
        if isinstance(v, dict):
            out[k] = _shrink_rope(v, new_max, pf)
        elif k == "original_max_position_embeddings" and isinstance(v, int):
            factor = rp.get("factor") or 1
            out[k] = max(16, int(new_max // factor))
        elif k == "partial_rotary_factor" and pf is not None:
            out[k] = pf
        elif k == "mrope_section" and isinstance(v, list):
            out[k] = v  # fixed below once the rotary dim is known
        else:
            out[k] = v
    return out


def _mrope_section(rotary_dim: int, n: int = 3):
    half = rotary_dim // 2
    t = half // 4
    rest = half - t
    return [t, rest // 2, rest - rest // 2][:n]


def _shrink_level(d: dict, cfg_obj, layers_req, top: dict) -> dict:
    """Shrink one (sub-)configuration dict D (cfg_obj: its config object, for its class and computed fields)."""
    d = {k: v for k, v in d.items() if k not in _DROP_KEYS}
    vision = _is_vision(d)
    hidden = VISION_HIDDEN if vision else HIDDEN
    heads = VISION_HEADS if vision else HEADS
    lkey, n_orig = _n_layers(d)

    # ---- partial rotary: keep at least ROTARY_MIN rotary dims
    pf = d.get("partial_rotary_factor")
    head_dim = HEAD_DIM
    if isinstance(pf, (int, float)) and 0 < pf < 1 and pf * HEAD_DIM < ROTARY_MIN:
        head_dim = 2 * HEAD_DIM
        pf = max(pf, ROTARY_MIN / head_dim)
        d["partial_rotary_factor"] = pf
    elif not isinstance(pf, (int, float)):
        pf = None

    new = dict(d)
    for k, v in d.items():
        if isinstance(v, bool) or v is None:
            continue
        if isinstance(v, int):
            new[k] = _shrink_int(k, v, d, hidden, heads, head_dim, vision)
    # kv heads follow the head count
    for k in ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num"):
        if isinstance(d.get(k), int):
            oh = d.get("num_attention_heads", d.get("num_heads"))
            new[k] = _kv_heads(d[k], oh, new.get("num_attention_heads", new.get("num_heads", heads)))
    if "qk_rope_head_dim" in d and isinstance(d["qk_rope_head_dim"], int):
        if "qk_nope_head_dim" in d:  # MLA: head_dim follows the rope part
            new["qk_rope_head_dim"] = ROTARY_MIN
            if "head_dim" in d:
                new["head_dim"] = ROTARY_MIN
            if "qk_head_dim" in d:
                new["qk_head_dim"] = new["qk_nope_head_dim"] + ROTARY_MIN
        elif "head_dim" in d and pf is not None:  # partial rotary written as a rope dim (DeepSeek-V4)
            new["qk_rope_head_dim"] = int(new["head_dim"] * pf)
    # groups of experts must divide the expert count and leave >= top_k experts per selected group
    if isinstance(d.get("n_group"), int) and d["n_group"] > 1:
        new["n_group"] = 2
        if isinstance(d.get("topk_group"), int):
            new["topk_group"] = 1
    # compression rates (dict per attention type)
    for k, v in d.items():
        if isinstance(v, dict) and "compress" in k and all(isinstance(x, int) for x in v.values()):
            new[k] = {a: min(x, WINDOW) for a, x in v.items()}
    if isinstance(d.get("max_position_embeddings"), int):
        new["max_position_embeddings"] = min(d["max_position_embeddings"], MAX_POS)
    mp = new.get("max_position_embeddings", MAX_POS)
    for k in ("rope_parameters", "rope_scaling"):
        if isinstance(d.get(k), dict):
            new[k] = _shrink_rope(d[k], mp, pf)
    rp = new.get("rope_parameters")
    ignore = getattr(type(cfg_obj), "ignore_keys_at_rope_validation", None) or ()
    if isinstance(rp, dict) and ("mrope_section" in rp or "mrope_section" in ignore):
        hd = new.get("head_dim", head_dim)
        new["rope_parameters"] = {**rp, "mrope_section": _mrope_section(int(hd * (pf or 1.0)))}

    # ---- layers: per-layer lists, index lists, counts
    if lkey is not None and n_orig and n_orig > 1:
        per_layer = {k: v for k, v in d.items() if isinstance(v, list) and len(v) == n_orig and k != lkey
                     and all(isinstance(x, (str, int, bool)) for x in v)}
        extras = {k: _allowed_values(type(cfg_obj), v) for k, v in per_layer.items()}
        need = max([2] + [len(set(map(repr, v))) + len(extras[k]) for k, v in per_layer.items()])
        if vision:
            n = VISION_DEPTH
        elif layers_req is None:
            n = need
        else:
            if layers_req < need:
                raise UserError(f"--layers {layers_req} is too few for {top['model_type']}: it needs {need} "
                                f"to keep every layer type ({', '.join(sorted(per_layer)) or 'dense + MoE'})")
            n = layers_req
        new[lkey] = n
        for k, v in per_layer.items():
            new[k] = _schedule(v, n, extras[k])
        for k, v in d.items():
            if k in per_layer or not isinstance(v, list) or not v or not all(isinstance(x, int) for x in v):
                continue
            if re.search(r"(layers|indexes|indices|layer_ids)$", k) and max(v) < n_orig:
                new[k] = sorted({round(x * (n - 1) / max(1, n_orig - 1)) for x in v})
        if isinstance(d.get("first_k_dense_replace"), int) and d["first_k_dense_replace"] > 0:
            new["first_k_dense_replace"] = 1
        for k in ("max_window_layers",):
            if isinstance(d.get(k), int):
                new[k] = min(d[k], n)
    # nested sub-configurations (vision towers, encoders inside sub-configs, ...)
    for k, v in d.items():
        if isinstance(v, dict) and "model_type" in v:
            sub = getattr(cfg_obj, k, None)
            sub = sub if hasattr(sub, "to_dict") else cfg_obj
            new[k] = _shrink_level(v, sub, None if _is_vision(v) else layers_req, top)
    return new


def _shrink_int(k: str, v: int, d: dict, hidden, heads, head_dim, vision) -> int:
    if v <= 0:
        return v
    if k in _EXPERT_COUNT_KEYS and v > 1:
        return EXPERTS
    if k in _TOPK_KEYS:
        return min(v, TOP_K)
    if re.search(r"n_shared_experts|num_shared_experts|shared_expert_count", k):
        return 1
    if k in ("hidden_size", "d_model", "embed_dim", "n_embd"):
        return hidden
    if k in ("out_hidden_size",):
        return HIDDEN
    if k in ("num_attention_heads", "num_heads", "n_head", "n_heads"):
        return min(v, heads)
    if k == "head_dim" or k == "v_head_dim" or k == "qk_nope_head_dim":
        return head_dim
    if k.endswith("head_dim") or k.endswith("head_size"):
        return HEAD_DIM
    if re.fullmatch(r"index_n_heads|index_num_heads|n_index_heads", k):
        return 8  # 8 indexer heads: fewer gave exact top-k ties (UPSTREAM_NOTES)
    if k.endswith("heads") and k not in ("num_key_value_heads",):
        return min(v, heads)
    if re.fullmatch(r"index_topk|index_top_k|indexer_topk", k):
        return 2 if "compress_rates" in d else 4
    if "intermediate_size" in k or k in ("ffn_dim", "ffn_hidden_size"):
        if vision:
            return 2 * VISION_HIDDEN
        if "shared" in k:
            return 2 * MOE_INTERMEDIATE
        if k.startswith("moe") or "expert" in k:
            return MOE_INTERMEDIATE
        # no separate MoE width: intermediate_size *is* the experts' width (mixtral, gpt-oss)
        if not any("moe_intermediate" in kk or "expert_intermediate" in kk for kk in d):
            return MOE_INTERMEDIATE
        return INTERMEDIATE
    if k == "q_lora_rank":
        return 48
    if k.endswith("lora_rank") or k.endswith("_rank"):
        return 32 if k == "kv_lora_rank" else 16
    if k == "o_groups":
        return 2
    if "window" in k and "layers" not in k:
        return min(v, WINDOW)
    if k == "vocab_size":
        return VOCAB
    if k == "num_position_embeddings" and math.isqrt(v) ** 2 == v:
        return min(v, 256)
    return v


def _remap_token_ids(d: dict, vocab: int, used: set) -> dict:
    """Move every `*_token_id(s)` / `*_token_index` outside the tiny vocabulary to distinct ids from the top."""
    out = {}
    free = [i for i in range(vocab - 1, -1, -1) if i not in used]
    seen = {}

    def fix(x):
        if not isinstance(x, int) or isinstance(x, bool) or x < vocab:
            return x
        if x not in seen:
            seen[x] = free.pop(0)
        return seen[x]

    for k, v in d.items():
        if re.search(r"token_ids?$|token_index$", k):
            out[k] = [fix(x) for x in v] if isinstance(v, list) else fix(v)
        else:
            out[k] = v
    return out


def _small_ids(d: dict, vocab: int) -> set:
    s = set()
    for k, v in d.items():
        if re.search(r"token_ids?$|token_index$", k):
            for x in v if isinstance(v, list) else [v]:
                if isinstance(x, int) and 0 <= x < vocab:
                    s.add(x)
    return s


def _subconfig_keys(cfg) -> list[str]:
    return [k for k, v in vars(cfg).items() if hasattr(v, "to_dict") and hasattr(v, "model_type")]


def shrink_config(model_type: str, layers: int | None = None):
    """The published configuration of MODEL_TYPE, shrunk to a tiny size (a transformers config object)."""
    from transformers import AutoConfig

    try:
        full = AutoConfig.for_model(model_type)
    except (ValueError, KeyError) as e:
        raise UserError(f"unknown model_type {model_type!r} (not a transformers configuration)") from e
    top = full.to_dict()
    subs = _subconfig_keys(full)
    d = _shrink_level(top, full, layers if not subs else None, top)
    text_like = None
    for sk in subs:
        sub = getattr(full, sk)
        sd = _shrink_level(sub.to_dict(), sub, layers if not _is_vision(sub.to_dict()) else None, top)
        if not _is_vision(sd):
            text_like = sd
        d[sk] = sd
    vocab_holder = text_like if text_like is not None else d
    used = _small_ids(d, VOCAB) | _small_ids(vocab_holder, VOCAB)
    d = _remap_token_ids(d, VOCAB, used)
    if text_like is not None:
        for sk in subs:
            if d[sk] is text_like:
                d[sk] = _remap_token_ids(text_like, VOCAB, used)
    if not _is_moe(d, subs):
        raise UserError(f"{model_type} is not a MoE decoder (no routed-expert count in its configuration)")
    try:
        return AutoConfig.for_model(model_type, **d)
    except Exception as e:  # noqa: BLE001 - transformers raises many types on bad configs
        raise UserError(f"cannot shrink {model_type}: {type(e).__name__}: {str(e).splitlines()[0]}") from e


def _is_moe(d: dict, subs) -> bool:
    levels = [d] + [d[s] for s in subs if isinstance(d.get(s), dict)]
    return any(isinstance(lv.get(k), int) and lv[k] > 1 for lv in levels for k in _EXPERT_COUNT_KEYS)


# ============================================================================================================
# Parameters that look trained
# ============================================================================================================

def _experts_modules(model):
    """[(module_name, module, in_major)] for every fused routed-experts module (3-D down_proj parameter).
    in_major: stored [E, in, out] (gpt-oss) rather than [E, out, in]: the module's own ``is_transposed`` flag
    (transformers' ``use_experts_implementation``), else decided from down_proj, whose output dim is the hidden
    size (ambiguous when the experts' width equals it, as in the published gpt-oss: 2880 both)."""
    import torch

    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    hidden = getattr(cfg, "hidden_size", None)
    out = []
    for name, mod in model.named_modules():
        dp = getattr(mod, "down_proj", None)
        if not (isinstance(dp, torch.nn.Parameter) and dp.dim() == 3):
            continue
        flag = getattr(mod, "is_transposed", None)
        in_major = flag if isinstance(flag, bool) else (dp.shape[2] == hidden and dp.shape[1] != hidden)
        out.append((name, mod, in_major))
    return out


def _fill_parameters(model, cfg, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    hidden = getattr(text_cfg, "hidden_size", HIDDEN)
    tied = bool(getattr(text_cfg, "tie_word_embeddings", False) or getattr(cfg, "tie_word_embeddings", False))
    experts = {n: in_major for n, _, in_major in _experts_modules(model)}
    embeds = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}

    def randn(shape):
        return torch.randn(shape, generator=g, dtype=torch.float32)

    with torch.no_grad():
        seen = set()
        for name, p in sorted(model.named_parameters(remove_duplicate=True), key=lambda t: t[0]):
            if id(p) in seen:
                continue
            seen.add(id(p))
            leaf = name.rsplit(".", 1)[-1]
            owner = name.rsplit(".", 1)[0] if "." in name else ""
            if id(p) in embeds:
                std = hidden ** -0.25 if tied else 1.0
                p.copy_(randn(p.shape) * std)
            elif owner in experts and p.dim() == 3:
                fan_in = p.shape[1] if experts[owner] else p.shape[2]
                p.copy_(randn(p.shape) / math.sqrt(fan_in))
            elif p.dim() >= 2:
                fan_in = math.prod(p.shape[1:])
                p.copy_(randn(p.shape) / math.sqrt(fan_in))
            elif "norm" in name.lower() or "scale" in leaf or bool((p == 1).all()):
                p.copy_(1.0 + 0.05 * randn(p.shape))
            elif "sink" in leaf:
                p.copy_(0.5 * randn(p.shape))
            elif "bias" in leaf or bool((p == p.flatten()[0]).all()):
                p.copy_(0.05 * randn(p.shape))
            # else: a meaningful 1-D init (A_log, dt ranges, ...) - keep it
        _fill_buffers(model, cfg, g)


def _fill_buffers(model, cfg, g):
    import torch

    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    n_exp = next((getattr(text_cfg, k) for k in _EXPERT_COUNT_KEYS if isinstance(getattr(text_cfg, k, None), int)),
                 None)
    for name, b in sorted(model.named_buffers(), key=lambda t: t[0]):
        if b is None or b.numel() == 0 or "inv_freq" in name:
            continue
        if (not b.dtype.is_floating_point and b.dim() == 2 and n_exp and b.shape[1] <= n_exp
                and bool((b == 0).all())):
            # hash routing table [vocab, k]: distinct random expert ids per row
            rows = torch.argsort(torch.rand(b.shape[0], n_exp, generator=g), dim=1)[:, : b.shape[1]]
            b.copy_(rows.to(b.dtype))
        elif b.dtype.is_floating_point and "bias" in name and bool((b == 0).all()):
            b.copy_(0.05 * torch.randn(b.shape, generator=g))


def _round_experts(model, fmt: str):
    """Replace routed-expert weights by the values they will have once stored in FMT."""
    import torch

    if fmt == "fp32":
        return
    with torch.no_grad():
        for _name, mod, in_major in _experts_modules(model):
            for pname in ("gate_up_proj", "down_proj"):
                p = getattr(mod, pname, None)
                if p is None or p.dim() != 3:
                    continue
                w = p.detach().cpu().numpy()
                w = np.swapaxes(w, 1, 2) if in_major else w  # -> [E, out, in]
                r = _roundtrip(fmt, w)  # per expert [out, in]: blocks never cross experts
                r = np.swapaxes(r, 1, 2) if in_major else r
                p.copy_(torch.from_numpy(np.ascontiguousarray(r)))


# ============================================================================================================
# Writing the checkpoint
# ============================================================================================================

def _expert_keys(state_keys, expert_module_names) -> dict[str, tuple[str, str]]:
    """Saved key -> (expert module name, kind 'fused' | 'per_expert') for routed-expert weights. Saved (published)
    names differ from module paths (DeepSeek-V4: `layers.{i}.ffn.experts.{j}.w1.weight` for module
    `model.layers.{i}.mlp.experts`; VLM prefixes), so a key matches on its layer index and an `experts` segment
    (never `shared_experts`)."""
    by_layer = {}
    for n in expert_module_names:
        m = re.search(r"(?:^|\.)layers\.(\d+)\.", n)
        by_layer[m.group(1) if m else None] = n
    out = {}
    for k in state_keys:
        if k.endswith("bias"):
            continue
        m = re.search(r"(?:^|\.)layers\.(\d+)\.(?:\w+\.)*?experts\.", k)
        if m is None or ".shared_experts." in k or m.group(1) not in by_layer:
            continue
        out[k] = (by_layer[m.group(1)], "per_expert" if re.search(r"\.experts\.\d+\.", k) else "fused")
    return out


def _rewrite_experts(ckpt: Path, model, fmt: str):
    """Replace the routed-expert tensors of CKPT/model.safetensors by their FMT encoding."""
    import ml_dtypes

    if fmt == "fp32":
        return {}
    files = sorted(ckpt.glob("*.safetensors"))
    experts = _experts_modules(model)
    names = [n for n, _, _ in experts]
    in_major = {n: im for n, _, im in experts}
    key_kinds, transposed = {}, []
    for f in files:
        tensors = _load_np(f)
        kinds = _expert_keys(tensors.keys(), names)
        new = {}
        for k, v in tensors.items():
            if k not in kinds:
                new[k] = v
                continue
            owner, kind = kinds[k]
            fused = kind == "fused"
            flip = fused and in_major[owner]
            if flip:
                transposed.append(k)
            w = np.swapaxes(v, -1, -2) if flip else v  # -> [..., out, in]
            key_kinds[k] = kind
            if fmt == "bf16":
                new[k] = v.astype(ml_dtypes.bfloat16)
            elif fmt == "mxfp4":
                blocks, scales = lowprec.quantize_mxfp4(w, name=k)
                if not np.array_equal(lowprec.dequant_mxfp4(blocks, scales, name=k), w):
                    raise InternalError(f"mxfp4 encoding of {k} is not exact")
                new[k + "_blocks"] = blocks  # NAME_blocks (fused, gpt-oss) / ....weight_blocks (per expert)
                new[k + "_scales"] = scales
            elif fmt == "fp8":
                q, sinv = lowprec.quantize_fp8_block(v, name=k)
                if not np.array_equal(lowprec.dequant_fp8_block(q, sinv, name=k), v):
                    raise InternalError(f"fp8 encoding of {k} is not exact")
                new[k] = q
                new[k[: -len("weight")] + "weight_scale_inv" if k.endswith(".weight") else k + "_scale_inv"] = sinv
        meta = {IN_MAJOR_META: json.dumps(sorted(transposed))} if fmt == "mxfp4" and transposed else None
        _save_np(new, f, meta)
    if not key_kinds:
        raise UserError(f"no routed-expert weights found among the saved keys of {ckpt.name}: cannot store them "
                        f"as {fmt}")
    return key_kinds


def dequantize_checkpoint(src, dst) -> Path:
    """Copy the make-tiny checkpoint SRC to DST with low-precision expert tensors decoded back to fp32 and
    `quantization_config` dropped: a plain checkpoint every transformers loader reads (used to check that the
    stored encoding reproduces the reference model exactly, for archs transformers cannot dequantise itself).
    MXFP4 blocks are [.., out, in/32, 16]; NAMEs listed in the file's `dayzero.mxfp4_in_major` metadata go
    back to the input-major parameter layout [E, in, out] (gpt-oss), as transformers' loader does."""
    import torch
    from safetensors import safe_open

    src, dst = Path(src), Path(dst)
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    for f in sorted(dst.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            t = {k: h.get_tensor(k) for k in h.keys()}
            flip = set(json.loads((h.metadata() or {}).get(IN_MAJOR_META, "[]")))
        out = {}
        for k, v in t.items():
            if k.endswith("_scales") and k[: -len("_scales")] + "_blocks" in t:
                continue
            if k.endswith("_scale_inv"):
                continue
            if k.endswith("_blocks"):
                base = k[: -len("_blocks")]
                w = lowprec.dequant_mxfp4(v.numpy(), t[base + "_scales"].numpy(), name=base)
                out[base] = np.ascontiguousarray(np.swapaxes(w, -1, -2) if base in flip else w)
            elif v.dtype == torch.float8_e4m3fn:
                sk = k + "_scale_inv" if not k.endswith(".weight") else k[: -len("weight")] + "weight_scale_inv"
                q = v.view(torch.uint8).numpy().view(_ml().float8_e4m3fn)
                out[k] = lowprec.dequant_fp8_block(q, t[sk].numpy(), name=k)
            else:
                out[k] = v.float().numpy() if v.dtype == torch.bfloat16 else v.numpy()
        _save_np(out, f)
    cj = dst / "config.json"
    c = json.loads(cj.read_text())
    c.pop("quantization_config", None)
    cj.write_text(json.dumps(c, indent=2, sort_keys=True) + "\n")
    return dst


def _ml():
    import ml_dtypes

    return ml_dtypes


def _load_np(path: Path) -> dict:
    from safetensors import safe_open

    out = {}
    with safe_open(str(path), "np") as f:
        for k in f.keys():
            out[k] = f.get_tensor(k)
    return out


IN_MAJOR_META = "dayzero.mxfp4_in_major"  # safetensors metadata: fused NAMEs whose fp32 layout is [E, in, out]


def _save_np(tensors: dict, path: Path, meta: dict | None = None):
    """safetensors writer accepting ml_dtypes arrays (bf16 / fp8), sorted keys, deterministic metadata."""
    import ml_dtypes

    dt = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(ml_dtypes.bfloat16): "BF16",
          np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3", np.dtype(np.uint8): "U8", np.dtype(np.int8): "I8",
          np.dtype(np.int64): "I64", np.dtype(np.int32): "I32", np.dtype(np.bool_): "BOOL",
          np.dtype(ml_dtypes.float8_e8m0fnu): "F8_E8M0"}
    header, blobs, off = {"__metadata__": {"format": "pt", **(meta or {})}}, [], 0
    for k in sorted(tensors):
        a = np.ascontiguousarray(tensors[k])
        if a.dtype not in dt:
            raise InternalError(f"cannot write dtype {a.dtype} of {k}")
        b = a.tobytes()
        header[k] = {"dtype": dt[a.dtype], "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little"))
        f.write(h)
        for b in blobs:
            f.write(b)


def _quant_config(fmt: str, model, cfg) -> dict | None:
    names = [n for n, _, _ in _experts_modules(model)]
    if fmt == "mxfp4":
        # gpt-oss publishes: {"modules_to_not_convert": [...non-expert modules...], "quant_method": "mxfp4"}
        return {"modules_to_not_convert": _not_converted(model, names), "quant_method": "mxfp4"}
    if fmt == "fp8":
        return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                "weight_block_size": list(lowprec.FP8_BLOCK),
                "modules_to_not_convert": _not_converted(model, names)}
    return None


def _not_converted(model, expert_names) -> list[str]:
    """Every module owning a weight matrix (Linear, Embedding, router) outside the routed experts, in gpt-oss
    wildcard style (model.layers.*.xxx)."""
    import torch

    out = set()
    for n, m in model.named_modules():
        w = getattr(m, "weight", None)
        owns_matrix = isinstance(w, torch.nn.Parameter) and w.dim() == 2  # Linear, Embedding, routers
        if owns_matrix and not any(
                n == e or n.startswith(e + ".") for e in expert_names):
            out.add(re.sub(r"\.\d+\.", ".*.", n))
    return sorted(out)


def check_inputs(cfg, seq: int = CHECK_SEQ, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed + 7)
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    vocab = getattr(text_cfg, "vocab_size", VOCAB)
    ids = torch.randint(0, min(vocab, 200), (1, seq), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def auto_class(cfg):
    """The transformers auto class generating text for CFG: AutoModelForCausalLM, or for vision-language models
    (qwen3_vl_moe) AutoModelForImageTextToText."""
    import transformers

    for name in ("AutoModelForCausalLM", "AutoModelForImageTextToText"):
        cls = getattr(transformers, name)
        if type(cfg) in cls._model_mapping:
            return cls
    raise UserError(f"{cfg.model_type} has no causal-LM / image-text-to-text model class in transformers")


def build_model(cfg, seed: int = 0, experts: str = "fp32"):
    """Build the tiny model from CFG with trained-looking parameters, experts rounded to EXPERTS's format."""
    import torch

    cls = auto_class(cfg)
    with torch.device("meta"):  # refuse configurations that did not shrink (would exhaust memory)
        n_params = sum(p.numel() for p in cls.from_config(cfg).parameters())
    if n_params > MAX_PARAMS:
        raise UserError(f"{cfg.model_type} did not shrink enough: {n_params / 1e6:.0f}M parameters "
                        f"(> {MAX_PARAMS / 1e6:.0f}M); some size field has an unknown name")
    torch.manual_seed(seed)
    try:
        model = cls.from_config(cfg, experts_implementation="batched_mm")
    except ValueError as e:
        if "experts_implementation" not in str(e):
            raise
        model = cls.from_config(cfg)
    model.eval()
    _fill_parameters(model, cfg, seed)
    _round_experts(model, experts)
    return model


@contextlib.contextmanager
def staged_dir(out: Path, prefix: str):
    """A fresh directory beside ``out`` to write into; on success it replaces ``out`` (one rename), on any error
    it is removed and ``out`` is left as it was (no half-written checkpoint)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=out.parent))
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def make_tiny(model_type: str, out_dir, layers: int | None = None, experts: str = "fp32", seed: int = 0) -> Path:
    """Write a tiny checkpoint of MODEL_TYPE to OUT_DIR (config.json + model.safetensors [+ generation_config]
    + tokenizer.json, tokenizer_config.json, chat_template.jinja).

    experts: storage of the routed experts: fp32 | bf16 | mxfp4 | fp8 (see EXPERT_KEYS_DOC)."""
    import torch

    if experts not in EXPERT_FORMATS:
        raise UserError(f"--experts must be one of {', '.join(EXPERT_FORMATS)}, got {experts!r}")
    if layers is not None and layers < 1:
        raise UserError(f"--layers must be >= 1, got {layers}")
    out = Path(out_dir)
    cfg = shrink_config(model_type, layers)
    n_threads = torch.get_num_threads()
    torch.set_num_threads(min(n_threads, 2))
    try:
        try:
            model = build_model(cfg, seed, experts)
            with torch.no_grad():
                logits = model(**check_inputs(cfg)).logits
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001
            raise UserError(f"tiny {model_type} does not build/run: {type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''}") from e
        if not _experts_modules(model):
            raise UserError(f"{model_type}: no fused routed-experts module (gate_up_proj/down_proj) in the model")
        if not torch.isfinite(logits).all():
            raise InternalError(f"tiny {model_type} gives non-finite logits")
        with staged_dir(out, ".make_tiny.") as tmp:
            from transformers.utils import logging as hf_logging

            bar = hf_logging.is_progress_bar_enabled()
            hf_logging.disable_progress_bar()  # keep the CLI output to one line
            try:
                model.save_pretrained(tmp)
            except Exception as e:  # noqa: BLE001 - upstream save hooks (vocab padding, renames) may reject it
                raise UserError(f"tiny {model_type} cannot be saved by transformers: {type(e).__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else ''}") from e
            finally:
                if bar:
                    hf_logging.enable_progress_bar()
            _rewrite_experts(tmp, model, experts)
            write_tokenizer(cfg, tmp)
            qc = _quant_config(experts, model, cfg)
            cj = tmp / "config.json"
            c = json.loads(cj.read_text())
            if qc:
                c["quantization_config"] = qc
            cj.write_text(json.dumps(c, indent=2, sort_keys=True) + "\n")
    finally:
        torch.set_num_threads(n_threads)
    return out


def list_moe_model_types() -> list[str]:
    """transformers model types whose configuration has a routed-expert count."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    out = []
    for mt in sorted(CONFIG_MAPPING_NAMES):
        try:
            from transformers import AutoConfig

            d = AutoConfig.for_model(mt).to_dict()
        except Exception:  # noqa: BLE001
            continue
        subs = [k for k, v in d.items() if isinstance(v, dict) and "model_type" in v]
        if _is_moe(d, subs):
            out.append(mt)
    return out


@click.command("make-tiny")
@click.argument("model_type")
@click.option("-o", "--out", "out_dir", required=True, type=click.Path(file_okay=False), help="checkpoint dir")
@click.option("--layers", type=int, default=None, help="layer count (default: the fewest keeping every type)")
@click.option("--experts", type=click.Choice(EXPERT_FORMATS), default="fp32", show_default=True,
              help="storage of the routed experts' weights")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def make_tiny_cmd(model_type, out_dir, layers, experts, seed, as_json):
    """Write a tiny random checkpoint of a transformers MoE decoder MODEL_TYPE (published on-disk format)."""
    path = make_tiny(model_type, out_dir, layers=layers, experts=experts, seed=seed)
    cfg = json.loads((path / "config.json").read_text())
    info = {"model_type": model_type, "out": str(path), "experts": experts, "seed": seed,
            "files": sorted(p.name for p in path.iterdir()),
            "num_hidden_layers": (cfg.get("text_config") or cfg).get("num_hidden_layers")}
    click.echo(json.dumps(info, sort_keys=True) if as_json else f"wrote tiny {model_type} ({experts} experts) "
               f"to {path}")


__all__ = ["make_tiny", "make_tiny_cmd", "shrink_config", "build_model", "check_inputs", "auto_class",
           "dequantize_checkpoint", "list_moe_model_types", "EXPERT_KEYS_DOC"]
