"""Small model factories for ``dayzero compile module.path:factory`` (each returns ``(nn.Module, inputs)``).

``tiny_dense`` and ``tiny_moe`` are transformers' own Llama and Qwen3-MoE code at toy sizes, fixed seed:
embedding, RMSNorm, RoPE, causal GQA attention, SwiGLU MLP, LM head; and a softmax-router top-k MoE block.
``unsupported`` uses ops dayzero has no lowering for, to show the error.
"""

from __future__ import annotations

import torch


class LogitsOnly(torch.nn.Module):
    """input_ids -> logits of a transformers causal LM (explicit all-ones mask, no cache)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False).logits


def _build(model_type: str, **kw):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, vocab_size=256, hidden_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, **kw)
    extra = {"experts_implementation": "batched_mm"} if "num_experts" in kw else {}
    model = AutoModelForCausalLM.from_config(cfg, **extra).eval()
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    return LogitsOnly(model), (ids,)


def tiny_dense():
    return _build("llama", intermediate_size=128)


def tiny_moe():
    return _build("qwen3_moe", intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                  num_experts_per_tok=2, norm_topk_prob=True)


class _Unsupported(torch.nn.Module):
    def forward(self, x):
        y = torch.special.i0(x)  # no lowering: Bessel function
        return torch.atan2(y, x)  # no lowering either


def unsupported():
    return _Unsupported(), (torch.randn(2, 8),)


class _Projection(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(64, 128)

    def forward(self, x):
        return torch.nn.functional.silu(self.proj(x))


def tiny_projection():
    """One linear layer and an activation: the smallest model with a kernel worth tuning."""
    return _Projection().eval(), (torch.randn(1, 8, 64),)
