"""capacity: plan a full-size model's memory on paper, from its config.json alone (no weights).

    config.json --validate--> transformers config --meta device--> every parameter's name and shape
        --> parameters by category (total, active per token)  --> resident bytes per weight format
        --> KV cache bytes per token and per sequence, per attention layer type
        --> split over N devices (experts: expert parallel; attention, dense MLP, shared experts: tensor parallel)
        --> fits on the target? largest batch at the given context

What is counted (the conventions the published figures use):

* ``params_total`` is exactly the parameters of the transformers model built on the meta device (no memory is
  allocated): the main model, without multi-token-prediction (MTP) modules, which transformers does not build.
  That is the convention of the published totals: DeepSeek-V3's README_WEIGHTS counts the main model as 671B and
  its MTP module apart (11.5B unique parameters; 685B on the hub with the module and its copies of embedding and
  head).  ``params_mtp`` counts the ``num_nextn_predict_layers`` modules separately (resident only when serving
  with MTP speculative decoding): each is one decoder layer shaped like the model's last one, the ``eh_proj``
  projection of [embedding; hidden] (2h x h) and three RMSNorms (enorm, hnorm, the shared head's norm); embedding
  and head are shared with the main model.  ``mtp_module_params`` is one such module.
* ``params_active`` = every parameter a token's forward pass multiplies with: all of ``params_total``, less the
  input embedding table (a row lookup, no matmul), less the routed experts a token does not use
  (routed x (1 - k/E)).  Hash-routed layers (DeepSeek-V4 ``hash_moe``) also send a token to k experts, so they
  count the same.  It agrees with DeepSeek-V3's detailed figure (36.7B) and OpenAI's gpt-oss table (5.13B).  The
  figure with the embedding table is ``params_active_incl_embedding``.
* The plan states this under ``param_convention``.
* Weight formats: ``bf16`` (2 bytes everywhere); ``fp8_block`` (matmul weights of attention / MLP / experts as FP8
  E4M3 plus one fp32 scale per 128x128 block, the rest bf16); ``mxfp4`` (routed-expert matrices as 4-bit E2M1 plus
  one E8M0 byte per 32 values = 4.25 bits, the rest bf16); ``mxfp4_fp8`` (mxfp4 experts, fp8_block for the other
  matmul weights: DeepSeek-V4's native checkpoint).  ``auto`` reads the config's ``quantization_config``.

KV cache per layer and token (``kv_dtype`` bytes per element, bf16 by default):

* dense MHA/GQA: ``2 * num_key_value_heads * head_dim``; layers whose ``layer_types`` entry is
  ``sliding_attention`` keep only the last ``sliding_window`` tokens (gpt-oss alternates the two).
* MLA (DeepSeek-V3, Kimi-K2): the compressed latent plus the shared rope key, ``kv_lora_rank + qk_rope_head_dim``
  (the absorbed-MLA cache production engines keep; transformers' eager cache stores decompressed K/V instead).
* DSA (DeepSeek-V3.2): MLA plus the indexer's key cache, ``index_head_dim`` values we assume stored as FP8 E4M3
  with one fp32 scale per 128 values (DeepSeek's reference inference code), i.e. ``index_head_dim + 4`` bytes.
* DeepSeek-V4 (from transformers' ``modeling_deepseek_v4``): every layer keeps a sliding window of
  ``sliding_window`` shared K=V entries of ``head_dim`` (one tensor, K and V are the same).  A
  ``compressed_sparse_attention`` layer adds one ``head_dim`` entry per ``m`` tokens
  (``compress_rates["compressed_sparse_attention"]``) and one indexer key of ``index_head_dim`` per ``m`` tokens
  (fp8 + scale as above); a ``heavily_compressed_attention`` layer adds one ``head_dim`` entry per ``m'`` tokens.
  The compressors' carry-over (at most one window of kv and gate projections, plus CSA's overlap slice) is a
  per-sequence constant reported as ``state_bytes``, an upper bound.

Workspace: one step of at most ``step_tokens`` tokens: residual streams (times ``hc_mult`` for mHC), q / kv
projections and the widest MLP (``k`` routed + shared experts, or the dense MLP) in bf16, fp32 logits for those
rows (split over devices with the vocab-parallel head), and, when the weight format is not native on the target
(mxfp4 without fp4 compute, fp8 without fp8 compute), a double-buffered bf16 dequant workspace the size of the
largest single weight matrix converted on line.

``--target host`` plans dayzero's own CPU runtime, so that it can be checked against a compiled artifact
(``dayzero report``'s ``plan`` section): every weight not stored low-precision is held in fp32 (the host computes
in fp32), except a bf16 checkpoint's matrices read as linear weights or embedding tables, held bf16 as stored (the
kernels convert as they read), and low-precision experts as stored; the workspace is one prefill of the whole
context (or of ``--prefill-chunk`` tokens) in fp32 (the fused MoE / MLP kernels keep no intermediates: the peak is
at q's rotary embedding, the residual, its normed copy and the residual kept across layers, q and two rotated
copies, the cos and sin rows) and fp32 logits; no dequant workspace (the fused low-precision kernels decode in
registers). A quantised checkpoint's ``modules_to_not_convert`` stay as stored (``unconverted_modules``).

Parallelism on N devices: routed experts are split by expert (ceil(E/N) per device); embeddings and lm_head by
vocab; attention, dense MLP and shared experts by tensor parallelism; norms, routers and hyper-connections are
replicated.  Attention is ``tp`` (KV heads split; a device keeps at least one) or ``dp`` (attention weights
replicated, sequences split across devices, as engines do for single-KV-head MLA/V4); ``auto`` picks ``dp`` when
the cache has one KV head.
"""

from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path

from dayzero import InternalError, UserError
from dayzero.targets.host import HOST_TARGET
from dayzero.targets.json_file import read_json_file

FORMATS = ("bf16", "fp8_block", "mxfp4", "mxfp4_fp8")
BF16_BYTES, FP32_BYTES = 2, 4
KV_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
CATEGORIES = (
    "embeddings",
    "attention",
    "dense_mlp",
    "shared_experts",
    "routed_experts",
    "router",
    "hyper_connections",
    "norms",
    "lm_head",
    "other",
)


# ---- input --------------------------------------------------------------------------------------------------------


def parse_count(value: int | str, what: str = "context") -> int:
    """``1000`` / ``"128k"`` / ``"1M"`` / ``"1.5M"`` -> int (decimal: k = 10^3, M = 10^6, G = 10^9)."""
    if isinstance(value, bool):
        raise UserError(f"{what}: expected a number like 1000, 128k or 1M, got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*", str(value))
        if not m:
            raise UserError(f"{what}: expected a number like 1000, 128k or 1M, got {value!r}")
        n = int(float(m.group(1)) * {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[m.group(2).lower()])
    if n <= 0:
        raise UserError(f"{what}: must be positive, got {value!r}")
    return n


def load_config(path: str | Path) -> dict:
    """Read a config.json (or the config.json inside a checkpoint directory)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    data = read_json_file(p, "config")
    if not isinstance(data, dict):
        raise UserError(f"{p}: expected a JSON object")
    return data


def _int_field(cfg: dict, name: str, *, required: bool = True, minimum: int = 1):
    v = cfg.get(name)
    if v is None:
        if required:
            raise UserError(f"config: field '{name}' is missing")
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise UserError(f"config: field '{name}' must be an integer >= {minimum}, got {v!r}")
    return v


def num_experts(cfg: dict) -> tuple[str | None, int]:
    """The routed-expert count and the field it came from (0 for a dense model)."""
    for name in ("n_routed_experts", "num_local_experts", "num_experts"):
        if cfg.get(name) is not None:
            return name, _int_field(cfg, name, minimum=0)
    return None, 0


def validate_config(cfg: dict) -> dict:
    """Check the fields capacity planning reads; a missing or contradictory one is a UserError naming it."""
    if not isinstance(cfg.get("model_type"), str):
        raise UserError("config: field 'model_type' is missing (transformers needs it to know the architecture)")
    hidden = _int_field(cfg, "hidden_size")
    layers = _int_field(cfg, "num_hidden_layers")
    heads = _int_field(cfg, "num_attention_heads")
    _int_field(cfg, "vocab_size")
    head_dim = _int_field(cfg, "head_dim", required=False)
    if head_dim is None and hidden % heads:
        raise UserError(
            f"config: field 'head_dim' is missing and num_attention_heads ({heads}) does not divide "
            f"hidden_size ({hidden})"
        )
    kv_heads = _int_field(cfg, "num_key_value_heads", required=False) or heads
    if heads % kv_heads:
        raise UserError(
            f"config: field 'num_key_value_heads' ({kv_heads}) must divide num_attention_heads ({heads})"
        )
    field, experts = num_experts(cfg)
    k = _int_field(cfg, "num_experts_per_tok", required=False, minimum=0)
    if experts and not k:
        raise UserError(f"config: field 'num_experts_per_tok' is missing ({field} = {experts} routed experts)")
    if experts and k > experts:
        raise UserError(f"config: field 'num_experts_per_tok' ({k}) exceeds {field} ({experts})")
    first_dense = _int_field(cfg, "first_k_dense_replace", required=False, minimum=0)
    if first_dense is not None and first_dense > layers:
        raise UserError(
            f"config: field 'first_k_dense_replace' ({first_dense}) exceeds num_hidden_layers ({layers})"
        )
    if cfg.get("kv_lora_rank") is not None:
        _int_field(cfg, "kv_lora_rank")
        _int_field(cfg, "qk_rope_head_dim", minimum=0)
    layer_types = cfg.get("layer_types")
    if layer_types is not None and (not isinstance(layer_types, list) or len(layer_types) != layers):
        raise UserError(f"config: field 'layer_types' must list one entry per layer ({layers})")
    return cfg


# ---- parameters ---------------------------------------------------------------------------------------------------


def _category(name: str) -> str:
    """Which part of the model a parameter belongs to, from the attribute names transformers' modeling code uses."""
    parts = name.split(".")
    s = set(parts)
    if s & {"embed_tokens", "wte", "word_embeddings", "embed_in"}:
        return "embeddings"
    if s & {"lm_head", "embed_out"}:
        return "lm_head"
    if s & {"shared_experts", "shared_expert", "shared_expert_gate"}:
        return "shared_experts"
    if "experts" in s:
        return "routed_experts"
    if s & {"gate", "router"} and s & {"mlp", "block_sparse_moe", "feed_forward"}:
        return "router"
    if s & {"self_attn", "attn", "attention", "self_attention"}:
        return "attention"
    if s & {"mlp", "feed_forward", "ffn"}:
        return "dense_mlp"
    if any(p.endswith("_hc") or p.startswith("hc_") for p in parts):
        return "hyper_connections"
    if any("norm" in p for p in parts):
        return "norms"
    return "other"


@functools.lru_cache(maxsize=16)
def _meta_parameters(config_json: str) -> tuple:
    """(name, category, shape) of every parameter of the transformers model, built on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads(config_json)
    model_type = cfg.pop("model_type")
    for key in ("quantization_config", "transformers_version", "auto_map", "architectures"):
        cfg.pop(key, None)
    try:
        hf_config = AutoConfig.for_model(model_type, **cfg)
    except ValueError as e:
        if "Unrecognized model" in str(e) or model_type in str(e):
            raise UserError(f"config: field 'model_type' = {model_type!r} is not known to transformers") from None
        raise UserError(f"config: transformers rejected it: {e}") from None
    except (TypeError, KeyError) as e:
        raise UserError(f"config: transformers rejected it: {e}") from None
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
    except (ValueError, TypeError, KeyError) as e:
        raise UserError(f"config: cannot build a {model_type} model from it: {e}") from None
    return tuple((n, _category(n), tuple(p.shape)) for n, p in model.named_parameters())


def _is_matrix(name: str, category: str, shape: tuple) -> bool:
    """A matmul weight that low-precision checkpoints quantize (not embeddings, norms, biases, routers)."""
    return (
        category in ("attention", "dense_mlp", "shared_experts", "routed_experts")
        and len(shape) >= 2
        and not name.endswith("bias")
    )


def _bytes(shape: tuple, fmt: str) -> int:
    """Bytes of one matrix (leading dims are stacked experts) in ``fmt``."""
    *lead, rows, cols = shape
    n = math.prod(lead)
    if fmt == "fp8_block":
        return n * (rows * cols + 4 * math.ceil(rows / 128) * math.ceil(cols / 128))
    if fmt == "mxfp4":
        return n * (math.ceil(rows * cols / 2) + rows * math.ceil(cols / 32))
    return 2 * n * rows * cols


def _param_format(fmt: str, category: str, is_matrix: bool) -> str:
    if not is_matrix:
        return "bf16"
    if fmt in ("mxfp4", "mxfp4_fp8") and category == "routed_experts":
        return "mxfp4"
    if fmt in ("fp8_block", "mxfp4_fp8"):
        return "fp8_block"
    return "bf16"


PARAM_CONVENTION = {
    "total": "the transformers model's parameters (main model; MTP modules excluded, counted in params_mtp)",
    "active": "total less the input embedding table and less the routed experts a token does not use (k of E)",
    "mtp": "num_nextn_predict_layers x (one decoder layer shaped like the last + eh_proj 2h*h + 3 norms of h); "
           "embedding and head shared",
}

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def mtp_module_params(cfg: dict) -> int:
    """Parameters of one multi-token-prediction module (DeepSeek-V3 README_WEIGHTS structure): a decoder layer
    like the main model's last one, ``eh_proj`` (2h -> h) and enorm / hnorm / shared-head norm.  The layer is
    counted from the meta-device model, so whatever that layer holds (experts, indexer, hyper-connections) is in."""
    params = _meta_parameters(json.dumps(cfg, sort_keys=True))
    idx = [int(m.group(1)) for n, _, _ in params if (m := _LAYER.search(n))]
    if not idx:
        raise InternalError(f"capacity: no decoder layers found in the {cfg['model_type']} model")
    last = max(idx)
    layer = sum(math.prod(s) for n, _, s in params if (m := _LAYER.search(n)) and int(m.group(1)) == last)
    h = cfg["hidden_size"]
    return layer + 2 * h * h + 3 * h


def _bf16_on_host(name: str, category: str, shape: tuple) -> bool:
    """A parameter the host keeps as a bf16 checkpoint stores it: a matrix read only as a linear's weight or an
    embedding's table (frontend/lowprec.bind_bf16): projections, dense / shared MLPs, routers, embeddings, LM head."""
    return category in ("embeddings", "lm_head", "attention", "dense_mlp", "shared_experts", "router") and \
        len(shape) == 2 and not name.endswith("bias")


def unconverted_modules(cfg: dict) -> list[str]:
    """The config's ``quantization_config.modules_to_not_convert``: module patterns a quantised checkpoint stores
    unquantised (transformers' own matching, ``should_convert_module``). DeepSeek's FP8 checkpoints list the LM
    head and gates; one whose projections stay bf16 lists those too."""
    q = cfg.get("quantization_config") or {}
    pats = q.get("modules_to_not_convert") if isinstance(q, dict) else None
    if pats is None:
        return []
    if not isinstance(pats, list) or not all(isinstance(x, str) for x in pats):
        raise UserError(f"quantization_config.modules_to_not_convert must be a list of module names, got {pats!r}")
    for x in pats:
        try:
            re.compile(x)
        except re.error as e:
            raise UserError(f"quantization_config.modules_to_not_convert: {x!r} is not a pattern ({e})") from None
    return pats


def count_parameters(cfg: dict, dense_bytes: int = 2, stored_bf16: bool = False, head_split: set | None = None,
                     unconverted: list[str] | None = None) -> dict:
    """Parameters and bytes by category: ``{"params": {cat: n}, "bytes": {fmt: {cat: b}}, "largest_matrix": ...}``;
    what a format does not store low-precision takes ``dense_bytes`` per value (bf16: 2, the host CPU: fp32, 4),
    except, with ``stored_bf16`` (the checkpoint is bf16), the matrices the host keeps bf16 (``_bf16_on_host``).
    ``head_split`` (attention module names, ``_head_split_modules``): ``"head_split_bytes"`` {fmt: bytes} of the
    attention parameters split over tensor-parallel heads. ``unconverted`` (``unconverted_modules``): matrices of
    these modules stay unquantised in every format, as the checkpoint stores them."""
    from transformers.quantizers.quantizers_utils import should_convert_module

    params = dict.fromkeys(CATEGORIES, 0)
    nbytes = {fmt: dict.fromkeys(CATEGORIES, 0) for fmt in FORMATS}
    split = dict.fromkeys(FORMATS, 0)
    largest = {fmt: 0 for fmt in ("bf16", "fp8_block", "mxfp4")}  # bf16 bytes of the largest matrix stored as fmt
    for name, cat, shape in _meta_parameters(json.dumps(cfg, sort_keys=True)):
        params[cat] += math.prod(shape)
        matrix = _is_matrix(name, cat, shape)
        convert = should_convert_module(name.rpartition(".")[0], unconverted or None)
        for fmt in FORMATS:
            pf = _param_format(fmt, cat, matrix and convert)
            per = BF16_BYTES if stored_bf16 and _bf16_on_host(name, cat, shape) else dense_bytes
            b = _bytes(shape, pf) if matrix and pf != "bf16" else per * math.prod(shape)
            nbytes[fmt][cat] += b
            if cat == "attention" and head_split and _split_by_heads(name, head_split):
                split[fmt] += b
            one = 2 * math.prod(shape[-2:]) if matrix else 0  # one expert's matrix, or the whole matrix
            largest[pf] = max(largest[pf], one)
    return {"params": params, "bytes": nbytes, "largest_matrix_bf16": largest, "head_split_bytes": split}


# ---- attention over tensor-parallel ranks (as passes/shard.py splits it) ------------------------------------------

# the attention modules whose parameters hold the query heads: split over the tp ranks; the others (MLA's latent
# KV down-projection and norms, DeepSeek-V4's K=V projection, the indexers and compressors, q LoRA down-projections,
# per-head-dim q/k norms) stay whole on every rank
_HEAD_MODULES = {
    "mla": {"q_proj", "q_b_proj", "kv_b_proj", "o_proj"},  # DeepSeek-V3 / V3.2, Kimi-K2: the latent KV is shared
    "v4": {"q_b_proj", "o_a_proj", "o_b_proj", "sinks"},  # DeepSeek-V4: one K=V head, grouped output projection
    "kv_heads": {"q_proj", "k_proj", "v_proj", "o_proj", "sinks"},  # GQA, the kv heads split too
    "one_kv_head": {"q_proj", "o_proj", "sinks"},  # MQA: the one kv head stays whole
}


def _head_split_modules(cfg: dict, tp: int) -> tuple[str | None, set]:
    """How passes/shard.py splits the attention over ``tp`` ranks: (kind, the module names split by heads), kind
    None when the attention stays replicated (a head count tp does not divide)."""
    heads = cfg["num_attention_heads"]
    if tp == 1 or heads % tp:
        return None, set()
    if cfg.get("kv_lora_rank"):
        kind = "mla"
    elif isinstance(cfg.get("compress_rates"), dict):
        kind = "v4" if (cfg.get("o_groups") or 1) % tp == 0 else None
    else:
        kv = cfg.get("num_key_value_heads") or heads
        kind = "kv_heads" if kv % tp == 0 else "one_kv_head" if kv == 1 else None
    return kind, (_HEAD_MODULES[kind] if kind else set())


def _split_by_heads(name: str, modules: set) -> bool:
    parts = name.split(".")
    if {"indexer", "compressor"} & set(parts):
        return False
    return (parts[-2] if parts[-1] in ("weight", "bias") and len(parts) > 1 else parts[-1]) in modules


# ---- KV cache -----------------------------------------------------------------------------------------------------


def _head_dim(cfg: dict) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def _index_key_bytes(cfg: dict, index_dtype: str = "fp8") -> int:
    """One indexer key: ``index_head_dim`` fp8 values + one fp32 scale per 128 of them (DeepSeek's layout), or
    ``index_head_dim`` values of another ``index_dtype`` (a cache that keeps the keys unquantised, e.g. fp32)."""
    if index_dtype != "fp8":
        return cfg["index_head_dim"] * KV_DTYPE_BYTES[index_dtype]
    return cfg["index_head_dim"] + 4 * math.ceil(cfg["index_head_dim"] / 128)


def _kv_entry(layers, entry_bytes=0.0, rate=1, window=None, window_bytes=0, state=0, formula=""):
    return {"layers": layers, "bytes_per_token": entry_bytes / rate, "entry_bytes": entry_bytes,
            "compress_rate": rate, "window": window, "window_bytes_per_token": window_bytes,
            "state_bytes": state, "formula": formula}


def kv_layout(cfg: dict, kv_dtype: str = "bf16", index_dtype: str = "fp8") -> dict:
    """Per attention layer type, one layer's cache: ``{type: {"layers": n, "bytes_per_token": growth per token
    of context, "entry_bytes": bytes per cache entry, "compress_rate": tokens per entry, "window": tokens kept by
    the windowed part (or None), "window_bytes_per_token", "state_bytes": per-sequence constant, "formula"}}``.
    ``index_dtype``: how the DSA / CSA indexer keys are stored (fp8 + scale as DeepSeek does, or e.g. fp32)."""
    for d in (kv_dtype, index_dtype):
        if d not in KV_DTYPE_BYTES:
            raise UserError(f"kv dtype {d!r}: choose one of {', '.join(KV_DTYPE_BYTES)}")
    b = KV_DTYPE_BYTES[kv_dtype]
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or ["full_attention"] * layers
    counts = {t: types.count(t) for t in dict.fromkeys(types)}
    out = {}
    if isinstance(cfg.get("compress_rates"), dict):  # DeepSeek-V4: sliding window + CSA / HCA compression
        hd, win, rates, ihd = _head_dim(cfg), cfg["sliding_window"], cfg["compress_rates"], cfg["index_head_dim"]
        idx = _index_key_bytes(cfg, index_dtype)
        window = dict(window=win, window_bytes=hd * b)
        sliding = f"window {win} x head_dim {hd} x {b}B (K=V)"
        for t, n in counts.items():
            if t == "sliding_attention":
                out[t] = _kv_entry(n, formula=sliding, **window)
            elif t == "compressed_sparse_attention":
                m = rates[t]
                # carry-over: < m tokens of kv and gate projections (2 series of hd each) + the overlap slice
                # (m x hd of kv and gate), for the compressor and for the indexer's own compressor
                state = m * (4 * hd + 2 * hd) * b + m * (4 * ihd + 2 * ihd) * b
                out[t] = _kv_entry(n, hd * b + idx, m, state=state, **window,
                                   formula=f"{sliding} + (head_dim {hd} x {b}B + indexer key {idx}B) per {m} tokens")
            elif t == "heavily_compressed_attention":
                m = rates[t]
                out[t] = _kv_entry(n, hd * b, m, state=m * 2 * hd * b, **window,
                                   formula=f"{sliding} + head_dim {hd} x {b}B per {m} tokens")
            else:
                raise UserError(f"config: field 'layer_types' has {t!r}, not a DeepSeek-V4 attention type")
        return out
    if cfg.get("kv_lora_rank"):  # MLA latent cache, plus the DSA indexer keys when there is an indexer
        per = (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * b
        formula = f"(kv_lora_rank {cfg['kv_lora_rank']} + qk_rope_head_dim {cfg['qk_rope_head_dim']}) x {b}B"
        if not cfg.get("index_head_dim"):
            return {"mla": _kv_entry(layers, per, formula=formula)}
        idx = _index_key_bytes(cfg, index_dtype)
        return {"mla+indexer": _kv_entry(layers, per + idx, formula=f"{formula} + indexer key {idx}B ({index_dtype}"
                                                      + (" + scale)" if index_dtype == "fp8" else ")"))}
    kvh, hd = cfg.get("num_key_value_heads") or cfg["num_attention_heads"], _head_dim(cfg)
    per = 2 * kvh * hd * b
    formula = f"2 x kv_heads {kvh} x head_dim {hd} x {b}B"
    for t, n in counts.items():
        if t == "sliding_attention" and cfg.get("sliding_window"):
            win = cfg["sliding_window"]
            out[t] = _kv_entry(n, window=win, window_bytes=per, formula=f"window {win} x {formula}")
        else:
            out[t] = _kv_entry(n, per, formula=formula)
    return out


def kv_bytes_per_sequence(layout: dict, context: int) -> int:
    """Exact bytes one sequence of ``context`` tokens holds, over all layers (one entry per full ``rate`` tokens)."""
    total = 0
    for e in layout.values():
        windowed = min(context, e["window"]) * e["window_bytes_per_token"] if e["window"] else 0
        total += e["layers"] * (e["state_bytes"] + windowed + (context // e["compress_rate"]) * e["entry_bytes"])
    return int(total)


# ---- the plan -----------------------------------------------------------------------------------------------------


def _auto_format(cfg: dict) -> str:
    q = cfg.get("quantization_config") or {}
    method = str(q.get("quant_method", "")).lower()
    if method == "mxfp4":
        return "mxfp4"
    if method == "fp8":
        return "mxfp4_fp8" if str(q.get("expert_dtype", "")).lower() in ("fp4", "mxfp4") else "fp8_block"
    return "bf16"


def _mesh_axes(mesh: dict | None, devices: int) -> tuple[int, int]:
    """(tp, ep): both ``devices`` without a mesh (every device splits experts and dense layers alike)."""
    if mesh is None:
        return devices, devices
    if not isinstance(mesh, dict) or set(mesh) - {"tp", "ep"} or any(
            isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in mesh.values()):
        raise UserError(f"mesh must give tp and ep as positive integers, got {mesh!r}")
    tp, ep = mesh.get("tp", 1), mesh.get("ep", 1)
    if tp * ep != devices:
        raise UserError(f"--tp {tp} x --ep {ep} is {tp * ep} ranks, not --devices {devices}")
    return tp, ep


def plan_capacity(
    config: dict,
    target,
    devices: int = 1,
    context: int | str = 1_000_000,
    batch: int | None = None,
    *,
    weight_format: str = "auto",
    kv_dtype: str = "bf16",
    attention: str = "auto",
    step_tokens: int = 8192,
    mesh: dict | None = None,
    prefill_chunk: int | None = None,
) -> dict:
    """Memory plan of a full-size model on ``devices`` x ``target`` at ``context`` tokens per sequence.

    Returns a JSON-ready dict; the main fields: ``params_total``, ``params_active``, ``resident_bytes`` (per
    format), ``kv_bytes_per_token`` (per layer type and total), ``kv_bytes_per_sequence``, ``workspace_bytes``,
    ``per_device`` (weights / kv / workspace / total / usable), ``fits`` (at ``batch``, or 1 when None) and
    ``max_batch`` (the most sequences of ``context`` tokens the devices hold together).

    ``mesh`` ({"tp": T, "ep": E}, T x E = ``devices``) plans one rank of a sharded artifact (``dayzero compile
    --tp T --ep E``, passes/shard.py) instead: routed experts split over the E ranks only; embeddings, LM head,
    dense MLPs and shared experts over the T ranks; the attention's query heads over the T ranks (its parameters
    that hold heads, ``_HEAD_MODULES``), with the KV cache when the KV heads divide by T; MLA's latent cache and
    DeepSeek-V4's K=V cache, the indexers and compressors stay whole on every rank (a head count T does not
    divide: the whole attention); on the host the logits are gathered whole on each rank.

    ``prefill_chunk`` (host): the most tokens one prefill call takes (``dayzero compile --prefill-chunk``); the
    workspace is one prefill of that many tokens, not of the whole context.
    """
    validate_config(config)
    context = parse_count(context)
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise UserError(f"devices must be a positive integer, got {devices!r}")
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        raise UserError(f"batch must be a positive integer, got {batch!r}")
    fmt = _auto_format(config) if weight_format == "auto" else weight_format
    if fmt not in FORMATS:
        raise UserError(f"weight format {weight_format!r}: choose auto or one of {', '.join(FORMATS)}")
    notes = []

    host = target.name == HOST_TARGET
    stored = config.get("dtype") or config.get("torch_dtype")
    tp, ep = _mesh_axes(mesh, devices)
    head_kind, head_modules = _head_split_modules(config, tp) if mesh is not None else (None, set())
    counted = count_parameters(config, FP32_BYTES if host else BF16_BYTES, stored_bf16=stored == "bfloat16",
                               head_split=head_modules,
                               unconverted=unconverted_modules(config) if weight_format == "auto" else None)
    params = counted["params"]
    total = sum(params.values())
    _, n_exp = num_experts(config)
    k = config.get("num_experts_per_tok") or 0
    if n_exp and not params["routed_experts"]:
        raise InternalError(f"capacity: found no routed-expert parameters in the {config['model_type']} model; "
                            "_category needs a rule for its module names")
    routed_unused = params["routed_experts"] * (n_exp - k) // n_exp if n_exp else 0
    active_with_embed = total - routed_unused
    active = active_with_embed - params["embeddings"]
    mtp_layers = _int_field(config, "num_nextn_predict_layers", required=False, minimum=0) or 0
    mtp_module = mtp_module_params(config)
    if mtp_layers:
        notes.append(f"{mtp_layers} MTP module(s) of {mtp_module / 1e9:.2f}B parameters each are counted in "
                     "params_mtp, not in params_total, and not planned as resident (serving without MTP)")

    layout = kv_layout(config, kv_dtype, index_dtype=kv_dtype if host else "fp8")  # the host keeps index keys as kv
    kv_per_token = {t: e["bytes_per_token"] for t, e in layout.items()}
    kv_total_per_token = sum(e["layers"] * e["bytes_per_token"] for e in layout.values())
    kv_seq = kv_bytes_per_sequence(layout, context)
    max_pos = config.get("max_position_embeddings")
    if max_pos and context > max_pos:
        notes.append(f"context {context} exceeds max_position_embeddings {max_pos}")

    # parallel split
    kv_heads = 1 if (config.get("kv_lora_rank") or isinstance(config.get("compress_rates"), dict)) else (
        config.get("num_key_value_heads") or config["num_attention_heads"])
    if mesh is not None:  # a sharded artifact's rank: attention splits only where passes/shard.py splits it
        attention = "tp" if head_kind else "replicated"
        kv_split = 1 / tp if head_kind == "kv_heads" else 1.0  # MLA's latent, V4's K=V head: whole on every rank
    else:
        if attention == "auto":
            attention = "dp" if kv_heads == 1 and devices > 1 else "tp"
        if attention not in ("tp", "dp"):
            raise UserError(f"attention parallelism {attention!r}: choose auto, tp or dp")
        kv_split = 1.0 if attention == "dp" else math.ceil(kv_heads / devices) / kv_heads
    tp_share = 1 / tp
    share = {c: 1.0 for c in CATEGORIES}
    share.update(embeddings=tp_share, lm_head=tp_share, dense_mlp=tp_share, shared_experts=tp_share)
    share["attention"] = tp_share if attention == "tp" and mesh is None else 1.0
    share["routed_experts"] = math.ceil(n_exp / ep) / n_exp if n_exp else 1.0
    weights_dev = int(sum(b * share[c] for c, b in counted["bytes"][fmt].items()))
    if mesh is not None:  # a rank of a sharded artifact: the attention parameters that hold heads are split
        weights_dev -= int(counted["head_split_bytes"][fmt] * (1 - tp_share))

    # workspace: one step of step_tokens tokens (host: one prefill of the whole context or of a chunk, in fp32)
    if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                      or prefill_chunk < 1):
        raise UserError(f"prefill chunk must be a positive integer, got {prefill_chunk!r}")
    if host:
        step_tokens = min(context, prefill_chunk or context)
    hidden, hd = config["hidden_size"], _head_dim(config)
    # a query head: MLA's nope + rope parts; else head_dim (DeepSeek-V4's rope is the last qk_rope_head_dim of it)
    q_width = config["num_attention_heads"] * (
        config["qk_nope_head_dim"] + (config.get("qk_rope_head_dim") or 0) if config.get("qk_nope_head_dim") else hd)
    ffn_moe = 2 * (k + (config.get("n_shared_experts") or 0)) * (config.get("moe_intermediate_size") or 0)
    ffn_dense = 2 * (config.get("intermediate_size") or 0) if (not n_exp or config.get("first_k_dense_replace")) else 0
    residual = (config.get("hc_mult") or 1) * hidden
    if head_kind == "kv_heads":
        # this rank's heads; not where the KV stays whole (MLA, V4): the host peak is then in the replicated
        # latent / indexer work (measured, tiny DeepSeek-V3.2 --tp 2: workspace x1.03 of this plan, x1.27 halved)
        q_width //= tp
    if host:  # dayzero's fused MoE / MLP kernels keep no intermediates; the peak is at q's rotary embedding: the
        # residual, its normed copy and the residual kept across layers, q and two rotated copies, cos and sin
        per_token = FP32_BYTES * (3 * residual + 3 * q_width + 2 * hd)
    else:
        per_token = BF16_BYTES * (2 * residual + q_width + 2 * kv_heads * hd + max(ffn_moe, ffn_dense))
    activations = step_tokens * per_token
    # a sharded artifact's ranks each hold the logits gathered whole (the runtime returns them on every rank)
    logits = step_tokens * config["vocab_size"] * 4 // (1 if host and mesh is not None else devices)
    native = {"bf16": True, "fp8_block": target.fp8_compute, "mxfp4": target.fp4_compute}
    dequant = 0 if host else 2 * max((b for f, b in counted["largest_matrix_bf16"].items() if not native[f]), default=0)
    workspace = activations + logits + dequant

    # what fits
    usable = target.usable_bytes
    kv_dev_per_seq = kv_seq * kv_split
    free = usable - weights_dev - workspace
    if free <= 0 or kv_dev_per_seq <= 0:
        max_batch = 0 if free <= 0 else None
    elif attention == "dp":
        max_batch = int(free // kv_dev_per_seq) * devices
    else:
        max_batch = int(free // kv_dev_per_seq)
    want = batch or 1
    seqs_per_dev = math.ceil(want / devices) if attention == "dp" else want
    kv_dev = int(seqs_per_dev * kv_dev_per_seq)
    total_dev = weights_dev + kv_dev + workspace

    return {
        "model_type": config["model_type"],
        "target": target.name,
        "devices": devices,
        "context": context,
        "batch": batch,
        "parallelism": {"routed_experts": "expert", "attention": attention, "dense": "tensor"},
        "mesh": {"tp": tp, "ep": ep} if mesh is not None else None,
        "params_total": total,
        "params_active": active,
        "params_active_incl_embedding": active_with_embed,
        "params_by_category": params,
        "params_mtp": mtp_layers * mtp_module,
        "mtp_module_params": mtp_module,
        "param_convention": PARAM_CONVENTION,
        "weight_format": fmt,
        "resident_bytes": {f: sum(v.values()) for f, v in counted["bytes"].items()},
        "resident_bytes_by_category": counted["bytes"][fmt],
        "kv_dtype": kv_dtype,
        "kv_layer_types": layout,
        "kv_bytes_per_token": {"by_layer_type": kv_per_token, "total": kv_total_per_token},
        "kv_bytes_per_sequence": kv_seq,
        "workspace_bytes": {"activations": activations, "logits": logits, "dequant": dequant, "total": workspace},
        "per_device": {"weights": weights_dev, "kv": kv_dev, "workspace": workspace, "total": total_dev,
                       "usable": usable},
        "fits": total_dev <= usable,
        "max_batch": max_batch,
        "notes": notes,
    }
