"""The tokenizer and chat template `dayzero make-tiny` writes next to a tiny checkpoint.

A byte-level BPE (GPT-2 style: ByteLevel pre-tokenizer and decoder) trained with ``tokenizers`` on the fixed
``TRAINING_TEXT``, so the same configuration always gives the same files, sized to the tiny model's vocabulary:

    ids   [special tokens at the ids the config names | the text's byte symbols + merges | free specials on top]

- The config's token ids keep their meaning: ``bos_token_id`` is ``<|begin_of_text|>`` (and the tokenizer adds it
  in front of a prompt, as DeepSeek's do), ``eos_token_id`` is ``<|im_end|>`` (the end of a chat turn, so a chat
  reply stops at the model's eos), ``pad_token_id`` is ``<|endoftext|>``, and every other ``*_token_id`` /
  ``*_token_index`` (Qwen3-VL's image / video / vision start-end ids) is ``<|NAME|>``. Specials the config does
  not place (``<|im_start|>``, ``<|im_end|>``, ``<|endoftext|>``, ``<unk>``) take the highest free ids.
- Byte-level BPE needs all 256 byte symbols, more than a tiny vocabulary holds: the alphabet is the bytes of the
  training text (printable ASCII, tab, newline and a few multi-byte characters: é, ü, —, “”, 日本語, an emoji), and
  a byte outside it encodes as ``<unk>``, so nothing is dropped silently.
- The chat template is ChatML (``<|im_start|>role\\ncontent<|im_end|>\\n``, generation prompt
  ``<|im_start|>assistant\\n``), content a string or a list of OpenAI parts; an image part becomes
  ``<|vision_start|><|image|><|vision_end|>`` when the config names image tokens, else the template refuses it.

Written with transformers' ``PreTrainedTokenizerFast.save_pretrained``: ``tokenizer.json``,
``tokenizer_config.json`` and ``chat_template.jinja``, loadable by ``AutoTokenizer.from_pretrained``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from dayzero import InternalError

TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs!
Sphinx of black quartz, judge my vow? Hello, world: how are you today?
A sparse mixture-of-experts model routes every token to a few of its experts; the router scores each expert,
keeps the top two, and the shared expert sees every token. Attention reads the key and value cache.
The user asks a question and the assistant answers it. The system message sets the rules.
Numbers: 0 1 2 3 4 5 6 7 8 9, 10, 42, 100, 256, 512, 2026, 3.14159, -7, +8, 50% and $12.
Symbols: ! " # $ % & ' ( ) * + , - . / : ; < = > ? @ [ \\ ] ^ _ ` { | } ~
def main(x):\n\treturn {"key": [1, 2, 3], 'value': x * 2 + 1}  # a comment
Unicode: café, naïve, über, — “quoted”, 日本語, and a smile 😀.
UPPER CASE WORDS: THE MODEL, THE EXPERTS, THE TOKENS, JUMPS, QUIZ, VEX, ZEBRA.
Short lines.
And the end.
"""

BOS, EOS, PAD, START, UNK = "<|begin_of_text|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>", "<unk>"
_ROLE = {"bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD}

_IMAGE_PART = "{{- '<|vision_start|><|image|><|vision_end|>' }}"
_NO_IMAGE = "{{- raise_exception('this model takes no images') }}"
CHAT_TEMPLATE = """\
{%- if bos_token %}{{- bos_token }}{%- endif %}
{%- for message in messages %}
{{- '<|im_start|>' + message['role'] + '\\n' }}
{%- if message['content'] is string %}{{- message['content'] }}
{%- else %}{%- for part in message['content'] %}
{%- if part['type'] == 'text' %}{{- part['text'] }}
{%- elif part['type'] in ['image', 'image_url'] %}IMAGE_PART
{%- else %}{{- raise_exception('unsupported content part type ' ~ part['type']) }}
{%- endif %}{%- endfor %}{%- endif %}
{{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def _named_ids(cfg) -> dict[int, str]:
    """id -> special token for every token id the config (and its text config) names."""
    levels = [cfg.to_dict()]
    levels += [v for v in levels[0].values() if isinstance(v, dict) and "model_type" in v]  # sub-configs
    out: dict[int, str] = {}
    for level in levels:
        for k, v in sorted((k, v) for k, v in level.items() if isinstance(k, str)):
            if not re.search(r"token_ids?$|token_index$", k):
                continue
            name = _ROLE.get(k) or "<|" + re.sub(r"_token_(ids?|index)$", "", k) + "|>"
            for x in v if isinstance(v, list) else [v]:
                if isinstance(x, int) and not isinstance(x, bool) and x >= 0 and x not in out \
                        and name not in out.values():
                    out[x] = name
    return out


def _vocab_size(cfg) -> int:
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return int(text.vocab_size)


def build_tokenizer(cfg):
    """The tiny tokenizer of transformers config ``cfg``: a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    vocab_size = _vocab_size(cfg)
    named = _named_ids(cfg)
    if any(i >= vocab_size for i in named):
        raise InternalError(f"a token id of the config is outside its vocabulary of {vocab_size}: {named}")
    specials = dict(named)
    free = [i for i in range(vocab_size - 1, -1, -1) if i not in specials]
    for tok in (START, EOS, PAD, UNK):
        if tok not in specials.values():
            specials[free.pop(0)] = tok
    base = Tokenizer(models.BPE())
    base.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    base.train_from_iterator([TRAINING_TEXT], trainers.BpeTrainer(
        vocab_size=vocab_size - len(specials), initial_alphabet=[], show_progress=False, special_tokens=[]))
    trained = json.loads(base.to_str())["model"]
    ordered = sorted(trained["vocab"].items(), key=lambda kv: kv[1])
    ids = iter(i for i in range(vocab_size) if i not in specials)
    vocab = {t: i for i, t in specials.items()}
    for t, _ in ordered:
        vocab[t] = next(ids)
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=UNK))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([specials[i] for i in sorted(specials)])
    bos = BOS if BOS in specials.values() else None
    if bos is not None:
        bos_id = vocab[BOS]
        tk.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                          special_tokens=[(BOS, bos_id)])
    image = "<|image|>" in specials.values() and {"<|vision_start|>", "<|vision_end|>"} <= set(specials.values())
    template = CHAT_TEMPLATE.replace("IMAGE_PART", _IMAGE_PART if image else _NO_IMAGE)
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=bos, eos_token=EOS, pad_token=PAD,
                                   unk_token=UNK, chat_template=template)


def write_tokenizer(cfg, out_dir: str | Path) -> None:
    """Write the tiny tokenizer of ``cfg`` (tokenizer.json, tokenizer_config.json, chat_template.jinja) into
    ``out_dir``."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        build_tokenizer(cfg).save_pretrained(str(out_dir))
    finally:
        hf_logging.set_verbosity(verbosity)
