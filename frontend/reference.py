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
import math
import mmap
import platform
import sys

import numpy as np
import torch
from safetensors import safe_open

from dayzero import UserError
from . import hf, lowprec
from .checkpoint import Checkpoint, _Dequantised, learn_recipes, low_precision_groups
from .trace_cache import cache_root


CHUNK_ELEMENTS = 1 << 25  # decoded at a time: 128 MB of fp32
# mmap's MAP_NORESERVE where Python does not name it (before 3.13): Linux on x86-64 and AArch64
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if platform.machine() in ("x86_64", "aarch64") else None)


def untouched(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor whose pages take memory only once written: anonymous memory mapped without a
    reservation, so a stack larger than the machine can hold the few rows that are filled (DeepSeek-V3.2's gate/up
    experts in fp32 are 30 GB, which ``torch.empty`` refuses on a 24 GB host). ``torch.empty`` where Linux's
    MAP_NORESERVE is not known."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if not sys.platform.startswith("linux") or MAP_NORESERVE is None or nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
    return torch.frombuffer(buf, dtype=dtype).view(shape)


def dequantised(ckpt: Checkpoint, groups: dict, key: str):
    """Checkpoint tensor ``key`` as transformers' loader holds it, fp32, in slices along its first dimension:
    yields (first flat element, flat fp32 slice), at most ``CHUNK_ELEMENTS`` at a time where the layout allows
    (a published expert stack decodes one expert at a time). A low-precision group (by its dequantised name) is
    decoded, any other tensor read and cast."""
    g = groups.get(key)
    if g is None:
        info = ckpt.tensors[key]
        if len(info.shape) < 2:
            t = ckpt.get(key)
            yield 0, (t.float() if t.is_floating_point() else t).reshape(-1)
            return
        row = math.prod(info.shape[1:])
        step = max(1, CHUNK_ELEMENTS // max(1, row))
        with safe_open(info.file, framework="pt") as f:  # rows read a slice at a time, never the whole tensor
            sl = f.get_slice(key)
            for a in range(0, info.shape[0], step):
                part = sl[a:a + step]
                yield a * row, (part.float() if part.is_floating_point() else part).reshape(-1)
        return
    data, scale = ckpt.get(g.data_key), ckpt.get(g.scale_key)
    if g.fmt == "fp8":
        from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

        if data.dim() == 2:  # one matrix: whole row blocks at a time
            rows = max(1, CHUNK_ELEMENTS // data.shape[1] // lowprec.FP8_BLOCK[0]) * lowprec.FP8_BLOCK[0]
            for a in range(0, data.shape[0], rows):
                w = _dequantize_fp8_weight(data[a:a + rows], scale[a // lowprec.FP8_BLOCK[0]:
                                                                    -(-(a + rows) // lowprec.FP8_BLOCK[0])],
                                           list(lowprec.FP8_BLOCK), torch.float32)
                yield a * data.shape[1], w.reshape(-1)
            return
        for e in range(data.shape[0]):  # a stack: one matrix at a time
            w = _dequantize_fp8_weight(data[e], scale[e], list(lowprec.FP8_BLOCK), torch.float32)
            yield e * w.numel(), w.reshape(-1)
        return
    if g.in_major and data.dim() == 4:  # gpt-oss's fused experts: transformers' own decoder (transposes)
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors

        for e in range(data.shape[0]):
            w = convert_moe_packed_tensors(data[e:e + 1], scale[e:e + 1], dtype=torch.float32)
            yield e * w.numel(), w.reshape(-1)
        return
    w = torch.from_numpy(np.ascontiguousarray(lowprec.dequant_mxfp4(data.numpy(), scale.numpy(), name=key)))
    yield 0, (w.transpose(-1, -2).contiguous() if g.in_major else w).reshape(-1)


class StreamedUpstream:
    """The upstream causal LM of checkpoint ``directory`` on ``meta``; ``materialised(name)`` holds one of its
    submodules on CPU with the checkpoint's weights for the duration of a ``with`` block."""

    def __init__(self, directory, experts: str | None = None):
        from transformers import AutoModelForCausalLM

        self.ckpt = Checkpoint(directory)
        self.groups = low_precision_groups(self.ckpt)
        cfg = hf._config(self.ckpt)
        if getattr(cfg, "quantization_config", None) is not None:
            del cfg.quantization_config  # dequantised here, as transformers' loader would
        try:
            with hf._quiet(), torch.device("meta"):
                kw = {"experts_implementation": experts} if experts else {}
                self.model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, **kw).eval()
        except (ValueError, KeyError) as e:
            raise UserError(f"{directory}: transformers cannot build model_type "
                            f"{self.ckpt.config.get('model_type')!r}: {str(e).splitlines()[0]}") from None
        view = _Dequantised(self.ckpt, self.groups) if self.groups else self.ckpt
        self.recipes, _ = learn_recipes(view, hf.load_for_recipes, cache=cache_root())
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

    def whole(self) -> torch.nn.Module:
        """The whole model on CPU with the checkpoint's weights (for a model that fits in memory), kept there."""
        with torch.no_grad():
            for name, child in self.model.named_children():
                self._fill(name, child)
        return self.model

    @contextlib.contextmanager
    def materialised(self, *names: str):
        """Submodules ``names`` (module paths) on CPU with their checkpoint weights; back on ``meta`` after.

        Routed experts are filled on demand: a module taking ``top_k_index`` (transformers' experts interface) gets
        its expert stacks allocated ``untouched`` (mapped, no page committed until written), and each expert's slices
        are decoded from the checkpoint the first time a forward routes a token to it. One MoE layer of
        DeepSeek-V3.2 in fp32 is 45 GB, the experts a few prompt tokens reach a few GB."""
        mods = [(n, self.model.get_submodule(n)) for n in names]
        hooks: list = []
        try:
            with torch.no_grad():
                for n, m in mods:
                    self._fill(n, m, hooks)
            yield [m for _, m in mods]
        finally:
            for h in hooks:
                h.remove()
            for _, m in mods:
                m.to("meta")

    def _fill(self, prefix: str, module: torch.nn.Module, lazy: list | None = None) -> None:
        """Module ``prefix`` on CPU with its checkpoint weights; with ``lazy`` (a list that receives the hook
        handles) routed experts are filled on demand (``materialised``)."""
        experts = {} if lazy is None else {
            ".".join(p for p in (prefix, n) if p): m for n, m in module.named_modules() if _routed_experts(m)}
        for m in module.modules():
            if any(m is x for x in experts.values()):  # the stacks' pages are committed expert by expert
                for n, p in m.named_parameters(recurse=False):
                    m._parameters[n] = torch.nn.Parameter(untouched(p.shape, p.dtype), requires_grad=p.requires_grad)
                for n, b in m.named_buffers(recurse=False):
                    m._buffers[n] = torch.empty(b.shape, dtype=b.dtype)
            else:
                m.to_empty(device="cpu", recurse=False)
        tensors = [(f"{prefix}.{n}", t) for n, t in [*module.named_parameters(), *module.named_buffers()]]
        deferred = {name for name, _ in tensors if name.rpartition(".")[0] in experts}
        computed = []
        for name, t in tensors:
            if name in deferred:
                continue
            if t.is_floating_point():
                t.fill_(float("nan"))
            if self._recipe(name) is None:
                computed.append(name)
        with hf._quiet():
            for owner in sorted({n.rpartition(".")[0] for n in computed}):
                self.model._init_weights(self.model.get_submodule(owner))
        for name, t in tensors:
            if name in deferred:
                continue
            if self._recipe(name) is None:
                if t.is_floating_point() and bool(torch.isnan(t).any()):
                    raise UserError(f"{self.ckpt.dir}: the model reads {name}, which the checkpoint lacks and the "
                                    "model's own initialisation does not compute")
                continue
            self._fill_range(name, t)
        for path, m in experts.items():
            lazy.append(m.register_forward_pre_hook(self._expert_filler(path, m), with_kwargs=True))

    def _expert_filler(self, path: str, module: torch.nn.Module):
        stacks = [(f"{path}.{n}", t) for n, t in module.named_parameters()]
        count = stacks[0][1].shape[0]
        filled: set[int] = set()

        def pre(_m, args, kwargs):
            index = kwargs["top_k_index"] if "top_k_index" in kwargs else args[1]
            for e in sorted(set(index.reshape(-1).tolist()) - filled):
                if not 0 <= e < count:
                    continue  # transformers' "no expert" slot
                with torch.no_grad():
                    for name, t in stacks:
                        if self._recipe(name) is None:
                            raise UserError(f"{self.ckpt.dir}: the model reads {name}, which the checkpoint lacks")
                        per = t[0].numel()
                        self._fill_range(name, t, e * per, (e + 1) * per)
                filled.add(e)
        return pre

    def _fill_range(self, name: str, t: torch.Tensor, lo: int = 0, hi: int | None = None) -> None:
        """Elements [lo, hi) of tensor ``name`` (flat) from the checkpoint, by its recipe."""
        hi = t.numel() if hi is None else hi
        flat = t.view(-1)
        by_key: dict[str, list] = {}
        for run in self._recipe(name):
            d0, key, s0, n = run
            if d0 < hi and d0 + n > lo:
                a = max(d0, lo) - d0  # the part of the run inside [lo, hi), as (destination, source, count)
                by_key.setdefault(key, []).append((d0 + a, s0 + a, min(d0 + n, hi) - d0 - a))
        for key, key_runs in by_key.items():  # each key decoded once, a slice at a time
            for first, part in dequantised(self.ckpt, self.groups, key):
                last = first + part.numel()
                for d0, s0, n in key_runs:
                    a, b = max(s0, first), min(s0 + n, last)
                    if a < b:
                        flat[d0 + a - s0:d0 + b - s0] = part[a - first:b - first].to(t.dtype)


def _routed_experts(module: torch.nn.Module) -> bool:
    """transformers' routed-experts interface: ``forward(hidden_states, top_k_index, top_k_weights)`` over
    parameter stacks with one leading row per expert."""
    import inspect

    params = list(module.parameters(recurse=False))
    try:
        sig = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return "top_k_index" in sig and bool(params) and all(p.dim() >= 2 and p.shape[0] == params[0].shape[0]
                                                          for p in params)
