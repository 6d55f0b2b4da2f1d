"""A real tiny tokenizer for compiled tiny artifacts: byte-level BPE trained with ``tokenizers`` on a fixed text
(deterministic), vocabulary within the model's 256 ids, saved with a chat template into ``ART/tokenizer/``."""

from __future__ import annotations

from pathlib import Path

TEXT = ("the quick brown fox jumps over the lazy dog. a sparse model routes every token to a few experts; "
        "the compiler plans one arena and the runtime serves requests in batches. hello world! 0123456789 "
        "what is the capital of france? paris is. how many experts are active? two of eight.") * 4

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def add_tiny_tokenizer(artifact, vocab_size: int = 200) -> Path:
    """Write ``artifact/tokenizer/`` unless the artifact carries one already (compile copies the checkpoint's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out = Path(artifact) / "tokenizer"
    if out.is_dir():
        return out
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False)
    tok.train_from_iterator([TEXT], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|end|>")
    fast.chat_template = CHAT_TEMPLATE
    tmp = out.with_name("tokenizer.tmp")
    fast.save_pretrained(str(tmp))
    tmp.rename(out)
    return out
