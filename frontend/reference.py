"""The upstream model one module at a time: reference numerics for a checkpoint larger than memory.

``StreamedUpstream(dir)`` builds transformers' model from ``config.json`` on the ``meta`` device (fp32, upstream's
default attention and experts code) and materialises one submodule at a time on CPU (``materialised``), its
parameters read from the same checkpoint, then returns it to ``meta``: a decoder layer of gpt-oss-20b in fp32 is
~3.2 GB while the whole model is ~84 GB.

Which checkpoint elements fill which parameter is transformers' own loader's answer (``learn_recipes`` on the
checkpoint as transformers sees it dequantised, ``_Dequantised``), and low-precision tensors are dequantised the
way transformers loads them: MXFP4 expert blocks through ``convert_moe_packed_tensors`` (gpt-oss's fused,
input-major layout; other MXFP4 tensors through ``lowprec.dequant_mxfp4``), FP8 blocks through transformers'
``_dequantize_fp8_weight`` with the published 128 x 128 block. Buffers the checkpoint does not hold (rotary
inverse frequencies) come from the model's own ``_init_weights`` on their owning module, as transformers' loader
computes them.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from dayzero import UserError
from . import hf, lowprec
from .checkpoint import Checkpoint, _Dequantised, learn_recipes, low_precision_groups


def dequantised(ckpt: Checkpoint, groups: dict, key: str) -> torch.Tensor:
    """Checkpoint tensor ``key`` as transformers' loader holds it, fp32: a low-precision group (by its dequantised
    name) decoded, any other tensor read and cast."""
    g = groups.get(key)
    if g is None:
        t = ckpt.get(key)
        return t.float() if t.is_floating_point() else t
    if g.fmt == "fp8":
        from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

        return _dequantize_fp8_weight(ckpt.get(g.data_key), ckpt.get(g.scale_key), list(lowprec.FP8_BLOCK),
                                      torch.float32)
    blocks, scales = ckpt.get(g.data_key), ckpt.get(g.scale_key)
    if g.in_major and blocks.dim() == 4:  # gpt-oss's fused experts: transformers' own decoder (transposes)
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors

        return convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    w = torch.from_numpy(np.ascontiguousarray(lowprec.dequant_mxfp4(blocks.numpy(), scales.numpy(), name=key)))
    return w.transpose(-1, -2).contiguous() if g.in_major else w


class StreamedUpstream:
    """The upstream causal LM of checkpoint ``directory`` on ``meta``; ``materialised(name)`` holds one of its
    submodules on CPU with the checkpoint's weights for the duration of a ``with`` block."""

    def __init__(self, directory):
        from transformers import AutoModelForCausalLM

        self.ckpt = Checkpoint(directory)
        self.groups = low_precision_groups(self.ckpt)
        cfg = hf._config(self.ckpt)
        if getattr(cfg, "quantization_config", None) is not None:
            del cfg.quantization_config  # dequantised here, as transformers' loader would
        try:
            with hf._quiet(), torch.device("meta"):
                self.model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        except (ValueError, KeyError) as e:
            raise UserError(f"{directory}: transformers cannot build model_type "
                            f"{self.ckpt.config.get('model_type')!r}: {str(e).splitlines()[0]}") from None
        view = _Dequantised(self.ckpt, self.groups) if self.groups else self.ckpt
        self.recipes, _ = learn_recipes(view, hf.load_for_recipes)
        # tied parameters: the recipe may be under any of the names of one tensor
        self._alias: dict[str, list[str]] = {}
        by_id: dict[int, list[str]] = {}
        for n, p in self.model.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(p), []).append(n)
        for names in by_id.values():
            for n in names:
                self._alias[n] = names

    def param_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def _recipe(self, name: str):
        for n in self._alias.get(name, [name]):
            if n in self.recipes:
                return self.recipes[n]
        return None

    @contextlib.contextmanager
    def materialised(self, *names: str):
        """Submodules ``names`` (module paths) on CPU with their checkpoint weights; back on ``meta`` after."""
        mods = [(n, self.model.get_submodule(n)) for n in names]
        try:
            with torch.no_grad():
                for n, m in mods:
                    self._fill(n, m)
            yield [m for _, m in mods]
        finally:
            for _, m in mods:
                m.to("meta")

    def _fill(self, prefix: str, module: torch.nn.Module) -> None:
        module.to_empty(device="cpu")
        tensors = [(f"{prefix}.{n}", t) for n, t in [*module.named_parameters(), *module.named_buffers()]]
        computed = []
        for name, t in tensors:
            if t.is_floating_point():
                t.fill_(float("nan"))
            if self._recipe(name) is None:
                computed.append(name)
        with hf._quiet():
            for owner in sorted({n.rpartition(".")[0] for n in computed}):
                self.model._init_weights(self.model.get_submodule(owner))
        cache: dict[str, torch.Tensor] = {}
        for name, t in tensors:
            runs = self._recipe(name)
            if runs is None:
                if t.is_floating_point() and bool(torch.isnan(t).any()):
                    raise UserError(f"{self.ckpt.dir}: the model reads {name}, which the checkpoint lacks and the "
                                    "model's own initialisation does not compute")
                continue
            flat = t.view(-1)
            for d0, key, s0, n in runs:
                if key not in cache:
                    cache.clear()  # keys come grouped by parameter: keep one decoded tensor at a time
                    cache[key] = dequantised(self.ckpt, self.groups, key).reshape(-1)
                flat[d0:d0 + n] = cache[key][s0:s0 + n].to(t.dtype)
