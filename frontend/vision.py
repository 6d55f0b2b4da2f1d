"""Multimodal checkpoints (Qwen3-VL-MoE): the vision encoder and an image-aware text step, both traced from the
upstream modules, unmodified.

Programs of a multimodal artifact:

* ``vision_TxHxW`` (one per image grid declared at compile time, in patches: ``--image-grid 1x4x4``):
  ``pixel_values [T*H*W, C*tp*p*p] -> visual [1 + D, T*H*W / m^2, out_hidden]``: row 0 is the merger output (the
  image tokens), rows 1..D the deepstack features (``deepstack_visual_indexes``). The upstream
  ``Qwen3VLMoeVisionModel`` exports only with the grid fixed: the interpolation indices/weights of the learned
  position table, the 2D rotary position ids and ``cu_seqlens`` are computed by transformers' own ``vision_utils``
  at export time for that grid and passed through the encoder's ``kwargs`` (its documented pre-compute hook), so
  ``torch.split(..., lengths.tolist())`` sees Python ints and the graph is static. The tables become weights of
  the program (``vision_TxHxW.interp_indices`` ...), carried by the artifact.
* ``prefill`` / ``decode``: one stateful step (:class:`MultimodalStep`, a :class:`CacheStep`) traced twice,
  ``(input_ids [1, seq], position_ids [3, 1, seq], cache_position [seq], visual [1 + D, seq, hidden],
  image_mask [1, seq]) -> logits``. It does what upstream's ``Qwen3VLMoeModel.forward`` does after the encoder,
  with dense tensors instead of data-dependent ones: the image features, scattered by the runtime to their token
  positions (zeros elsewhere), replace the embeddings where ``image_mask`` is set (``torch.where`` instead of
  ``masked_scatter``: same values). The mask is an input, not ``input_ids == image_token_id`` in the graph:
  upstream scatters only when pixel values are passed, so an image token in a text-only prompt or a generated
  one keeps its embedding (a generated 255 did, in the tiny model). Then deepstack feature ``k`` is added to the output of text layer ``k``
  (a forward hook; upstream adds it at the visual positions only; adding the zeros elsewhere leaves those rows
  bit-identical). ``position_ids`` are the 3D M-RoPE ids computed by upstream's ``get_rope_index`` (runtime);
  decode continues at ``cache_len + rope_delta`` on all three axes, as upstream's ``compute_3d_position_ids``.
"""

from __future__ import annotations

import re

import torch

from dayzero import UserError
from dayzero.frontend.decode_export import CacheStep


def is_multimodal(config: dict) -> bool:
    return bool(config.get("vision_config")) and "image_token_id" in config


def parse_grid(text: str) -> tuple[int, int, int]:
    """``"1x4x4"`` (or ``"4x4"``: T=1) -> (T, H, W) in patches."""
    m = re.fullmatch(r"\s*(?:(\d+)\s*[xX]\s*)?(\d+)\s*[xX]\s*(\d+)\s*", str(text))
    if not m:
        raise UserError(f"--image-grid {text!r}: expected TxHxW in patches, e.g. 1x4x4")
    t, h, w = int(m.group(1) or 1), int(m.group(2)), int(m.group(3))
    if min(t, h, w) < 1:
        raise UserError(f"--image-grid {text!r}: every dimension must be positive")
    return t, h, w


def grid_name(grid) -> str:
    return "vision_" + "x".join(str(int(x)) for x in grid)


def check_grid(grid, vcfg) -> None:
    m = vcfg.spatial_merge_size
    if grid[1] % m or grid[2] % m:
        raise UserError(f"--image-grid {'x'.join(map(str, grid))}: H and W must be multiples of the spatial merge "
                        f"size {m}")
    if grid[0] != 1:
        raise UserError("--image-grid: only images (T=1) are supported, not video grids")


def vision_config_of(model) -> object:
    return model.config.vision_config


class VisionStep(torch.nn.Module):
    """``pixel_values [N, C*tp*p*p] -> [1 + D, N / m^2, out_hidden]`` for one fixed image grid."""

    def __init__(self, visual: torch.nn.Module, grid: tuple[int, int, int]):
        super().__init__()
        from transformers import vision_utils as vu

        self.visual = visual
        g = torch.tensor([list(grid)], dtype=torch.int64)
        self.grid = g
        cfg = visual.config
        ii, iw = vu.get_vision_interpolation_indices_and_weights(
            g, num_grid_per_side=visual.num_grid_per_side, mode=visual.interpolation_mode,
            align_corners=visual.interpolation_align_corners, spatial_merge_size=cfg.spatial_merge_size)
        # registered as buffers: they become named weights of the program, carried by the artifact
        self.register_buffer("interp_indices", ii, persistent=False)
        self.register_buffer("interp_weights", iw, persistent=False)
        self.register_buffer("position_ids", vu.get_vision_position_ids(g, visual.spatial_merge_size),
                             persistent=False)
        # cu_seqlens stays a plain (constant) tensor: the attention reads it with .tolist(), which must see values
        self.cu_seqlens, self.max_seqlen = vu.get_vision_attention_seqlens(g, cfg)
        self.n_patches = int(g.prod())
        self.patch_dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        out = self.visual(pixel_values, grid_thw=self.grid, return_dict=True, interp_indices=self.interp_indices,
                          interp_weights=self.interp_weights, position_ids=self.position_ids,
                          cu_seqlens=self.cu_seqlens, max_seqlen=self.max_seqlen)
        return torch.stack([out.pooler_output, *out.deepstack_features])


class MultimodalStep(CacheStep):
    """``(input_ids, position_ids [3, B, seq], cache_position, visual [1 + D, seq, H]) -> logits``; see the module
    docstring. ``model`` is the upstream ``Qwen3VLMoeForConditionalGeneration``."""

    def __init__(self, model: torch.nn.Module, max_cache_len: int, batch_size: int = 1):
        self._deep = None
        super().__init__(model, max_cache_len, batch_size)
        lm = model.model.language_model
        self.image_token_id = int(model.config.image_token_id)
        self.n_deep = len(getattr(model.config.vision_config, "deepstack_visual_indexes", []) or [])
        for k in range(min(self.n_deep, len(lm.layers))):
            lm.layers[k].register_forward_hook(self._deepstack_hook(k))

    def _deepstack_hook(self, k: int):
        def hook(module, args, output):
            if self._deep is None:
                return None
            return output + self._deep[k].unsqueeze(0).to(output.dtype)
        return hook

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache_position: torch.Tensor,
                visual: torch.Tensor, image_mask: torch.Tensor) -> torch.Tensor:
        for i, attr, name in self.names:
            setattr(self.cache.layers[i], attr, getattr(self, name))
        self._bind_offset(cache_position)
        lm = self.model.model.language_model
        emb = lm.embed_tokens(input_ids)
        is_image = (image_mask != 0).unsqueeze(-1)
        emb = torch.where(is_image, visual[0].unsqueeze(0).to(emb.dtype), emb)
        self._deep = visual[1:1 + self.n_deep]
        try:
            out = lm(inputs_embeds=emb, position_ids=position_ids, cache=self.cache, use_cache=True)
        finally:
            self._deep = None
        return self.model.lm_head(out.last_hidden_state)


def trace_multimodal(ckpt, max_seq: int, image_grids) -> dict:
    """Traces of a multimodal checkpoint: {"prefill", "decode", "vision_TxHxW"...} -> Traced, plus "info"."""
    from transformers import AutoModelForImageTextToText

    from dayzero.frontend import hf
    from dayzero.frontend.torch_export import export_module, symbol_names_from, to_graph
    from dayzero.frontend.trace import _rename_states

    cfg = hf._config(ckpt)
    with hf._quiet():
        cpu = AutoModelForImageTextToText.from_config(cfg, experts_implementation=hf.EXPORT_EXPERTS).eval()
    vcfg = cfg.vision_config
    hidden = cfg.get_text_config(decoder=True).hidden_size
    step = MultimodalStep(cpu, max_cache_len=max_seq)
    rows = 1 + step.n_deep
    n = min(32, max_seq)
    seq = torch.export.Dim("seq", min=1, max=max_seq)
    ex = (torch.zeros(1, n, dtype=torch.int64), torch.arange(n).view(1, 1, n).expand(3, 1, n).contiguous(),
          torch.arange(n), torch.zeros(rows, n, hidden), torch.zeros(1, n, dtype=torch.int64))
    dyn = {"input_ids": {1: seq}, "position_ids": {2: seq}, "cache_position": {0: seq}, "visual": {1: seq},
           "image_mask": {1: seq}}
    ep = export_module(step, ex, dyn)
    names = symbol_names_from(ep, {"input_ids": {1: "seq"}})
    out = {"prefill": to_graph(ep, names, strip_prefix="model.")}
    ex1 = (torch.zeros(1, 1, dtype=torch.int64), torch.zeros(3, 1, 1, dtype=torch.int64),
           torch.zeros(1, dtype=torch.int64), torch.zeros(rows, 1, hidden), torch.zeros(1, 1, dtype=torch.int64))
    out["decode"] = to_graph(export_module(step, ex1, None), {}, strip_prefix="model.")
    for t in (out["prefill"], out["decode"]):
        t.graph = _rename_states(t.graph)
    grids = []
    for grid in image_grids:
        grid = tuple(int(x) for x in grid)
        check_grid(grid, vcfg)
        vs = VisionStep(cpu.model.visual, grid)
        with torch.no_grad():
            ep_v = export_module(vs, (torch.zeros(vs.n_patches, vs.patch_dim),), None)
        name = grid_name(grid)
        t = to_graph(ep_v, {}, strip_prefix="")
        t.graph = _prefix_tables(t.graph, name)
        t.weights = {(f"{name}.{k}" if k in _TABLES else "model." + k): v for k, v in t.weights.items()}
        out[name] = t
        grids.append(list(grid))
    info = {"kind": "qwen3_vl", "model_type": cfg.model_type, "image_token_id": int(cfg.image_token_id),
            "vision_start_token_id": getattr(cfg, "vision_start_token_id", None),
            "vision_end_token_id": getattr(cfg, "vision_end_token_id", None),
            "video_token_id": getattr(cfg, "video_token_id", None),
            "grids": grids, "visual_rows": rows, "hidden": hidden,
            "patch_size": vcfg.patch_size, "temporal_patch_size": vcfg.temporal_patch_size,
            "merge_size": vcfg.spatial_merge_size, "in_channels": vcfg.in_channels,
            "processor": processor_config(ckpt, vcfg, grids)}
    return {"traces": out, "info": info}


# Qwen3-VL's published preprocessor_config.json (Qwen2VLImageProcessor rules), used when the checkpoint has none
QWEN3_VL_PROCESSOR = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True,
                      "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_resize": True}


def processor_config(ckpt, vcfg, grids) -> dict:
    """The image processor's settings for the artifact: the checkpoint's ``preprocessor_config.json`` when it has
    one, else Qwen3-VL's; patch/merge sizes from the vision config; the resize bounds (``size.shortest_edge`` /
    ``longest_edge``, smart_resize's min/max pixels) are the smallest / largest compiled grid area, so the
    upstream processor never produces more patches than the largest compiled program takes."""
    import json
    from pathlib import Path

    cfg = dict(QWEN3_VL_PROCESSOR)
    f = Path(ckpt.dir) / "preprocessor_config.json"
    if f.is_file():
        try:
            own = json.loads(f.read_text())
        except ValueError as e:
            raise UserError(f"{f}: not JSON: {e}") from None
        for k in ("image_mean", "image_std", "do_convert_rgb", "do_rescale", "rescale_factor", "do_normalize",
                  "do_resize"):
            if k in own:
                cfg[k] = own[k]
    p = vcfg.patch_size
    areas = [g[1] * g[2] for g in grids]
    cfg.update(patch_size=p, temporal_patch_size=vcfg.temporal_patch_size, merge_size=vcfg.spatial_merge_size,
               size={"shortest_edge": min(areas) * p * p, "longest_edge": max(areas) * p * p})
    return cfg


_TABLES = ("interp_indices", "interp_weights", "position_ids", "cu_seqlens")


def _prefix_tables(g, name: str):
    """Weight names of the vision program: the encoder's parameters under the checkpoint's ``model.visual.``
    prefix; the per-grid tables under the program's name (two grids have different tables)."""
    from dayzero.passes.ir.node import rewrite

    def fix(n):
        if n.op != "weight":
            return None
        w = n.attr["name"]
        new = f"{name}.{w}" if w in _TABLES else "model." + w
        return n.replace(attrs=dict(n.attr, name=new))
    return rewrite(g, fix)


DEFAULT_IMAGE_GRIDS = ((1, 4, 4),)


def load_for_recipes(directory, dtype):
    """The upstream image-text model from a checkpoint dir (``learn_recipes``' loader for multimodal models)."""
    from transformers import AutoModelForImageTextToText

    from dayzero.frontend import hf

    with hf._quiet():
        model = AutoModelForImageTextToText.from_pretrained(str(directory), dtype=dtype,
                                                            experts_implementation=hf.EXPORT_EXPERTS)
    return model.eval()


def trace_frontend(ckpt, max_seq: int, image_grids, frontend_cls, cache=None):
    """``trace_model`` for a multimodal checkpoint: prefill/decode + one vision program per declared grid.

    Weights the checkpoint holds are read through recipes (as for text models); everything else the programs
    read (rotary inverse frequencies, the per-grid interpolation / position tables) comes from the traced CPU
    model and is carried by the artifact. ``cache``: the trace cache's folder, for the weight recipes."""
    from dayzero.frontend.checkpoint import learn_recipes

    grids = [parse_grid(g) if isinstance(g, str) else tuple(int(x) for x in g)
             for g in (image_grids or DEFAULT_IMAGE_GRIDS)]
    if len(set(grids)) != len(grids):
        raise UserError("--image-grid: a grid is declared twice")
    recipes, _ = learn_recipes(ckpt, load_for_recipes, cache=cache)
    res = trace_multimodal(ckpt, max_seq, grids)
    traces = res["traces"]
    own = {}
    for t in traces.values():
        names = {n.attr["name"] for n in t.graph.nodes() if n.op == "weight"}
        for name in names - set(recipes):
            if name not in t.weights:
                raise UserError(f"{ckpt.dir}: the model reads {name}, which neither the checkpoint nor the "
                                "model's own initialisation provides")
            own[name] = t.weights[name].detach().clone()
    for t in traces.values():
        t.weights = own
    extra = {k: v for k, v in traces.items() if k not in ("prefill", "decode")}
    return frontend_cls(traces["prefill"], ckpt, recipes, str(ckpt.config.get("model_type", "")),
                        decode=traces["decode"], extra=extra, multimodal=res["info"])
