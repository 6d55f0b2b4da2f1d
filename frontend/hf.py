"""Upstream transformers models, unmodified, from their checkpoint directories.

dayzero never copies or edits modeling code: the model is built by transformers from ``config.json`` and traced.
Choices made here for every model (see README, "Upstream models"):

* experts run through transformers' ``batched_mm`` implementation while tracing: the default ``grouped_mm`` exports
  as an opaque custom op and the ``eager`` per-expert loop does not export (a Python loop over ``nonzero``);
  ``batched_mm`` computes the same function with plain ATen ops, which the moe pattern pass then recognises;
* the traced forward passes an explicit all-ones attention mask (without one transformers runs a bool ``cumsum``);
* the model is built on the ``meta`` device for tracing: no weight is read until the runtime binds it;
* in float32, whatever the config's ``torch_dtype`` or the checkpoint's stored dtype (a published bfloat16
  config would otherwise trace bf16 parameters: ``from_config`` follows it; ``from_pretrained`` follows the
  stored tensors).
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from dayzero import UserError
from .checkpoint import Checkpoint

EXPORT_EXPERTS = "batched_mm"


@contextlib.contextmanager
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import transformers

        old = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        try:
            yield
        finally:
            transformers.logging.set_verbosity(old)


def _config(ckpt: Checkpoint):
    return config_at(ckpt.dir)


def config_at(directory):
    """transformers' config of the checkpoint directory (its config.json only)."""
    from transformers import AutoConfig

    try:
        with _quiet():
            return AutoConfig.from_pretrained(str(directory))
    except (ValueError, KeyError, OSError) as e:
        raise UserError(f"{directory}/config.json: transformers cannot read it: {str(e).splitlines()[0]}") from None


def load_upstream(directory, dtype=None, experts: str | None = None, complete: bool = True):
    """The upstream model with its checkpoint weights, eager, for reference numerics: in float32 unless ``dtype``
    says otherwise (transformers 5 otherwise follows the stored tensors: a bf16 checkpoint ran in bf16).

    Where transformers' loader leaves parameters missing (it initialises them at random: DeepSeek-V4's MXFP4
    experts, whose ``weight_blocks``/``weight_scales`` pairs it has no converter for), the model is filled the way
    the streamed reference fills it instead (``reference.StreamedUpstream``: transformers' own key mapping learned on
    the checkpoint dequantised, every low-precision pair decoded), unless ``complete`` is false (the loader that
    learns that mapping)."""
    from transformers import AutoModelForCausalLM

    kw = {"experts_implementation": experts} if experts else {}
    with _quiet():
        model, info = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype or torch.float32,
                                                           output_loading_info=True, **kw)
    if complete and info.get("missing_keys"):
        from .reference import StreamedUpstream

        del model
        model = StreamedUpstream(directory, experts=experts).whole()
        if dtype not in (None, torch.float32):
            model = model.to(dtype)
    return model.eval()


class CausalLMPrefill(torch.nn.Module):
    """``input_ids -> logits`` of an upstream causal LM, with the explicit all-ones attention mask."""

    def __init__(self, upstream: torch.nn.Module):
        super().__init__()
        self.upstream = upstream

    def forward(self, input_ids):
        out = self.upstream(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False)
        return out.logits


def meta_model(ckpt: Checkpoint):
    from transformers import AutoModelForCausalLM

    cfg = _config(ckpt)
    try:
        with _quiet(), torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, experts_implementation=EXPORT_EXPERTS, dtype=torch.float32)
    except (ValueError, KeyError) as e:
        raise UserError(f"{ckpt.dir}: transformers cannot build model_type "
                        f"{ckpt.config.get('model_type')!r}: {str(e).splitlines()[0]}") from None
    return model.eval(), cfg


def load_for_recipes(directory, dtype):
    return load_upstream(directory, dtype=dtype, experts=EXPORT_EXPERTS, complete=False)
