"""Image + text requests on a multimodal artifact (Qwen3-VL-MoE; see ``frontend/vision.py``).

A request is token ids plus images (paths, PIL images or HxWxC / HxW arrays). Per request:

1. every image goes through the upstream image processor (transformers' ``Qwen2VLImageProcessorPil``, the
   artifact's settings in ``multimodal.json``: convert to RGB, smart_resize to multiples of patch * merge within
   the compiled min/max pixels, rescale, normalise, patchify) -> ``pixel_values`` and its grid ``(1, H, W)``;
2. the compiled ``vision_1xHxW`` program of that grid encodes it (an image whose grid was not compiled is a
   UserError naming the compiled grids, unless ``fit=True``, which first resizes it to the compiled grid of
   nearest aspect ratio);
3. each image placeholder in the ids (``image_token_id``) is expanded to the image's token count, as upstream's
   processor expands ``<|image_pad|>`` (ids already expanded are taken as they are);
4. the 3D M-RoPE position ids come from upstream's own ``Qwen3VLMoeModel.get_rope_index`` (mm_token_type_ids = 1 at
   image tokens), the image features are laid out densely at their token positions, and ``prefill`` runs;
5. decode continues at ``cache_len + rope_delta`` on all three axes (upstream's ``compute_3d_position_ids``);
   running requests step together through ``Runtime.decode_batch``, each token at its own request's positions.

A failing request (unreadable file, empty image, a grid not compiled, too many tokens) raises a UserError; in
``generate_batch`` it is reported for that request while the others keep going.

Steps 1, 3 and 4 (``parse``: files, the processor, the placeholders, the positions) need only the request; steps 2
and 5 (``run``: the vision programs, then prefill) run the compiled programs. A sharded artifact served under
torchrun parses on rank 0 alone and sends the :class:`Parsed` request to every rank, which all run it together
(runtime/lockstep.py): the vision programs hold collectives too.
"""

from __future__ import annotations

import functools
import json
import types
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dayzero import UserError

from . import request_checks


@dataclass
class Parsed:
    """A request as ``Multimodal.parse`` leaves it: what ``Multimodal.run`` needs on every rank."""
    ids: torch.Tensor  # [1, n] int64, image placeholders expanded
    positions: torch.Tensor  # [3, 1, n] int64 M-RoPE position ids
    delta: int  # the rope delta decode continues with
    pixels: list  # per image: pixel_values [T*H*W, C*tp*p*p] float32
    grids: list  # per image: its (T, H, W) grid, a compiled one


class Multimodal:
    """Drives a multimodal artifact's programs for one :class:`~dayzero.runtime.executor.Runtime`."""

    def __init__(self, rt, info: dict):
        self.rt = rt
        self.info = info
        self.image_token_id = int(info["image_token_id"])
        self.rows = int(info["visual_rows"])
        self.hidden = int(info["hidden"])
        self.grids = {tuple(g): "vision_" + "x".join(map(str, g)) for g in info["grids"]}
        self.deltas: dict[int, int] = {}
        self._processor = None

    # -- images -------------------------------------------------------------------------------------------------
    @property
    def processor(self):
        if self._processor is None:
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

            self._processor = Qwen2VLImageProcessorPil(**self.info["processor"])
        return self._processor

    @staticmethod
    def load_image(image):
        """A path, PIL image or array -> something the upstream processor takes (PIL image or array)."""
        from PIL import Image, UnidentifiedImageError

        if isinstance(image, (str, Path)):
            try:
                with Image.open(image) as im:
                    im.load()
                    img = im.copy()
            except (OSError, UnidentifiedImageError, Image.DecompressionBombError, ValueError) as e:
                raise UserError(f"image {image}: cannot read it ({type(e).__name__}: {str(e).splitlines()[0]})") \
                    from None
            size = img.size
        elif isinstance(image, Image.Image):
            img, size = image, image.size
        elif isinstance(image, (np.ndarray, torch.Tensor)):
            img = np.asarray(image.detach().cpu() if isinstance(image, torch.Tensor) else image)
            if img.ndim not in (2, 3) or (img.ndim == 3 and img.shape[-1] not in (1, 3, 4)
                                          and img.shape[0] not in (1, 3, 4)):
                raise UserError(f"image array of shape {img.shape}: expected HxW, HxWxC or CxHxW with C in 1, 3, 4")
            last = img.ndim == 2 or img.shape[-1] in (1, 3, 4)
            size = img.shape[:2] if last else img.shape[1:]
            if img.ndim == 3 and last and img.dtype == np.uint8:  # HxWxC bytes: a PIL image, unambiguous
                img = Image.fromarray(img[..., 0] if img.shape[-1] == 1 else img)
            elif img.ndim == 3:  # float arrays: the processor's own rules, channel layout stated
                img = (img, "channels_last" if last else "channels_first")
            if isinstance(img, np.ndarray) and img.ndim == 2:  # a grayscale array: the processor's RGB conversion needs PIL (as for a gray file)
                img = Image.fromarray(img if img.dtype == np.uint8 else np.clip(img, 0, 255).astype(np.uint8))
        else:
            raise UserError(f"an image must be a path, a PIL image or an array, not {type(image).__name__}")
        if min(size) <= 0:
            raise UserError(f"image of size {tuple(size)}: zero-size image")
        return img

    def preprocess(self, image, fit: bool = False) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """-> (pixel_values [T*H*W, C*tp*p*p] float32, grid (T, H, W)) by the upstream processor's rules."""
        img = self.load_image(image)
        kw = {}
        if isinstance(img, tuple):
            img, kw["input_data_format"] = img
        try:
            out = self.processor(images=[img], return_tensors="pt", **kw)
        except (ValueError, TypeError) as e:  # smart_resize's aspect-ratio limit, unsupported channel layouts
            raise UserError(f"image preprocessing failed: {str(e).splitlines()[0]}") from None
        grid = tuple(int(x) for x in out["image_grid_thw"][0])
        if grid not in self.grids and fit:
            grid = self._nearest_grid(grid)
            from PIL import Image

            pil = img if isinstance(img, Image.Image) else Image.fromarray(np.asarray(img))
            p = self.info["patch_size"]
            out = self.processor(images=[pil.resize((grid[2] * p, grid[1] * p), Image.BICUBIC)],
                                 return_tensors="pt")
            grid = tuple(int(x) for x in out["image_grid_thw"][0])
        if grid not in self.grids:
            known = ", ".join("x".join(map(str, g)) for g in self.grids)
            raise UserError(f"image grid {'x'.join(map(str, grid))} (patches) was not compiled (compiled: {known}); "
                            f"compile with --image-grid {'x'.join(map(str, grid))} or resize the image")
        return out["pixel_values"].to(torch.float32), grid

    def _nearest_grid(self, grid) -> tuple[int, int, int]:
        ratio = grid[1] / grid[2]
        return min(self.grids, key=lambda g: (abs(np.log(g[1] / g[2] / ratio)), -g[1] * g[2]))

    def encode(self, image, fit: bool = False) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """One image -> (features [rows, tokens, hidden] from the compiled vision program, grid)."""
        pv, grid = self.preprocess(image, fit)
        return self.features(pv, grid), grid

    def features(self, pixels: torch.Tensor, grid) -> torch.Tensor:
        """One preprocessed image -> its features [rows, tokens, hidden]: the compiled vision program of its
        grid. Every image a request carries is encoded here."""
        return self.rt.programs[self.grids[tuple(grid)]].run([pixels])[0]

    # -- the text/image join ------------------------------------------------------------------------------------
    def _expand(self, ids: torch.Tensor, grids: list) -> torch.Tensor:
        m = int(self.info["merge_size"])
        counts = [g[0] * g[1] * g[2] // (m * m) for g in grids]
        n_img = int((ids == self.image_token_id).sum())
        if n_img == sum(counts):
            return ids
        if n_img != len(grids):
            raise UserError(f"the prompt has {n_img} image tokens ({self.image_token_id}) for {len(grids)} images: "
                            f"give one placeholder per image (or {sum(counts)} already expanded)")
        out, k = [], 0
        for t in ids[0].tolist():
            if t == self.image_token_id:
                out.extend([t] * counts[k])
                k += 1
            else:
                out.append(t)
        return torch.tensor([out], dtype=torch.int64)

    def rope_index(self, ids: torch.Tensor, grids: list) -> tuple[torch.Tensor, int]:
        """Upstream's ``Qwen3VLMoeModel.get_rope_index`` on this prompt -> (position_ids [3, 1, n], rope delta)."""
        from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeModel

        if not grids:  # text only: upstream's positions are arange on every axis
            n = ids.shape[1]
            return torch.arange(n).view(1, 1, n).expand(3, 1, n).contiguous(), 0
        shim = types.SimpleNamespace(
            config=types.SimpleNamespace(vision_config=types.SimpleNamespace(
                spatial_merge_size=int(self.info["merge_size"]))),
            get_vision_position_ids=functools.partial(Qwen3VLMoeModel.get_vision_position_ids, None))
        tt = (ids == self.image_token_id).to(torch.int32)
        pos, delta = Qwen3VLMoeModel.get_rope_index(shim, ids, tt, image_grid_thw=torch.tensor(grids))
        return pos.contiguous(), int(delta.reshape(-1)[0])

    def parse(self, input_ids, images=(), fit: bool = False) -> Parsed:
        """The request without running a program: images read and preprocessed, placeholders expanded, positions."""
        ids = self.rt._ids(input_ids)
        if images is not None and not isinstance(images, (list, tuple)):
            raise UserError(f"images: expected a list of images (paths, PIL images, arrays), got "
                            f"{type(images).__name__}")
        images = list(images or [])
        pre = [self.preprocess(im, fit) for im in images]
        grids = [list(g) for _, g in pre]
        if not images and bool((ids == self.image_token_id).any()):
            raise UserError(f"the prompt has image tokens ({self.image_token_id}) but no image was given")
        ids = self._expand(ids, grids)
        n = ids.shape[1]
        if n > self.rt.max_length:
            raise UserError(f"prompt of {n} tokens (with image tokens) is longer than the compiled maximum "
                            f"{self.rt.max_length}")
        pos, delta = self.rope_index(ids, grids)
        return Parsed(ids, pos, delta, [pv for pv, _ in pre], [tuple(g) for g in grids])

    def inputs(self, p: Parsed):
        """-> (ids [1, n], position_ids [3, 1, n], visual [rows, n, hidden], image mask [1, n], rope delta): the
        vision programs run on ``p``'s images."""
        ids, n = p.ids, p.ids.shape[1]
        feats = [self.features(pv, g) for pv, g in zip(p.pixels, p.grids)]
        visual = torch.zeros(self.rows, n, self.hidden)
        mask = torch.zeros(1, n, dtype=torch.int64)
        if feats:  # upstream scatters image features only when images are given (get_placeholder_mask)
            mask = (ids == self.image_token_id).to(torch.int64)
            visual[:, mask[0] != 0] = torch.cat(feats, dim=1)
        return ids, p.positions, visual, mask, p.delta

    def prepare(self, input_ids, images=(), fit: bool = False):
        """-> (ids [1, n], position_ids [3, 1, n], visual [rows, n, hidden], image mask [1, n], rope delta)."""
        return self.inputs(self.parse(input_ids, images, fit))

    def run(self, p: Parsed, slot: int) -> torch.Tensor:
        """Logits [1, n, V] of a parsed request, started in cache slot ``slot`` (its vision programs, then prefill)."""
        return self._prefill(*self.inputs(p), request_checks.slot(slot, self.rt.max_batch))

    # -- serving ------------------------------------------------------------------------------------------------
    def prefill(self, input_ids, images=(), slot: int = 0, fit: bool = False) -> torch.Tensor:
        """Logits [1, n, V] of the prompt (image tokens expanded) and start the request in cache slot ``slot``."""
        slot = request_checks.slot(slot, self.rt.max_batch)
        return self.run(self.parse(input_ids, images, fit), slot)

    def _prefill(self, ids, pos, visual, mask, delta, slot):
        rt = self.rt
        rt.reset(slot)
        n = ids.shape[1]
        logits = rt.run_program("prefill", [ids, pos, torch.arange(n), visual, mask], slot, n)[0]
        rt.lengths[slot] = n
        self.deltas[slot] = delta
        return logits

    def decode(self, token_id, slot: int = 0) -> torch.Tensor:
        rt = self.rt
        slot = request_checks.slot(slot, rt.max_batch)
        length = rt.lengths.get(slot, 0)
        if length == 0:
            raise UserError("decode before prefill: start a request with prefill(prompt_ids)")
        if length >= rt.max_length:
            raise UserError(f"the request reached the cache budget of {rt.max_length} tokens")
        out = rt.run_program("decode", self.decode_inputs(rt._token(token_id), torch.tensor([length]), [slot]),
                             slot, length + 1)[0]
        rt.lengths[slot] = length + 1
        return out

    def decode_inputs(self, ids: torch.Tensor, positions: torch.Tensor, slots: list[int]) -> list[torch.Tensor]:
        """The text-decode inputs of one token per request (``ids`` [1, B], cache ``positions`` [B] of the requests
        in ``slots``): each token's M-RoPE position is its cache position + its request's rope delta on all three
        axes (upstream's ``compute_3d_position_ids``), no image features."""
        n = ids.shape[1]
        delta = torch.tensor([self.deltas.get(s, 0) for s in slots], dtype=torch.int64)
        mrope = (positions + delta).view(1, 1, n).expand(3, 1, n).contiguous()
        return [ids, mrope, positions, torch.zeros(self.rows, n, self.hidden), torch.zeros(1, n, dtype=torch.int64)]

    def generate(self, prompt_ids, max_new_tokens: int = 32, images=(), stop_ids=(), temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, fit: bool = False) -> list[int]:
        res = self.generate_batch([{"input_ids": prompt_ids, "images": images}], max_new_tokens, stop_ids,
                                  temperature, top_p, seed, fit, raise_errors=True)
        return res[0]["tokens"]

    def generate_batch(self, requests: list, max_new_tokens: int = 32, stop_ids=(), temperature: float = 0.0,
                       top_p: float = 1.0, seed: int = 0, fit: bool = False, raise_errors: bool = False) -> list:
        """Several requests at once, each in its own cache slot, decode steps interleaved. A request is token ids
        or ``{"input_ids": ..., "images": [...]}``. A failing request gets ``{"error": str}``; the others go on."""
        from dayzero.runtime.executor import decode_interleaved

        rt = self.rt
        request_checks.sampling(max_new_tokens, temperature, top_p, seed)
        stops = rt._stops(stop_ids)
        request_checks.batch(requests, rt.max_batch, "requests", "a list")
        results = [{"tokens": [], "error": None} for _ in requests]
        logits, gens = {}, {}
        for k, req in enumerate(requests):
            try:
                if isinstance(req, dict):
                    if set(req) - {"input_ids", "images"} or "input_ids" not in req:
                        raise UserError(f"a request is token ids or {{'input_ids': ..., 'images': [...]}}; got a "
                                        f"dict with keys {sorted(map(str, req))}")
                    ids, images = req["input_ids"], req.get("images") or []
                else:
                    ids, images = req, []
                ids, pos, visual, mask, delta = self.prepare(ids, images, fit)
                if ids.shape[1] + max_new_tokens > rt.max_length:
                    raise UserError(f"prompt ({ids.shape[1]} tokens with image tokens) + max_new_tokens "
                                    f"({max_new_tokens}) exceeds the cache budget of {rt.max_length} tokens")
                logits[k] = self._prefill(ids, pos, visual, mask, delta, k)[0, -1]
                gens[k] = torch.Generator().manual_seed(seed + k)
                results[k]["prompt_tokens"] = int(ids.shape[1])
            except UserError as e:
                if raise_errors:
                    raise
                results[k]["error"] = str(e)
        decode_interleaved(results, logits, gens, lambda tok, k: self.decode(tok, slot=k)[0, -1], max_new_tokens,
                           stops, temperature, top_p, raise_errors,
                           batch_step=rt.decode_batch if rt.has_batched_decode else None)
        return results


def attach(rt) -> Multimodal | None:
    """The multimodal driver of an artifact that has ``multimodal.json`` (else None)."""
    f = Path(rt.path) / "multimodal.json"
    if not f.is_file():
        return None
    return Multimodal(rt, json.loads(f.read_text()))
