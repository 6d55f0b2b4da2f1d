"""Text in, text out: the artifact's own tokenizer (``ART/tokenizer/``, transformers' classes) and chat template.

    load_tokenizer(artifact_dir) -> tokenizer | None     None when the artifact carries no tokenizer
    encode_prompt(tok, text)     -> [ids]                the tokenizer's own special-token rules
    encode_chat(tok, messages)   -> [ids]                the chat template, with the assistant's turn opened
    Detokenizer(tok).add(id)     -> str                  the text this token adds (held back while a UTF-8
                                                         sequence is incomplete); .flush() -> the rest
"""

from __future__ import annotations

from pathlib import Path

from dayzero import UserError

TOKENIZER_DIR = "tokenizer"


def load_tokenizer(artifact_dir):
    """The tokenizer saved in ``artifact_dir/tokenizer`` (AutoTokenizer), or None when there is none."""
    d = Path(artifact_dir) / TOKENIZER_DIR
    if not d.is_dir():
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(d))
    except (OSError, ValueError) as e:
        raise UserError(f"{d}: cannot load the tokenizer ({str(e).splitlines()[0]})") from None


def encode_prompt(tok, text: str) -> list[int]:
    return list(tok(text)["input_ids"])


def encode_chat(tok, messages: list[dict]) -> list[int]:
    if not getattr(tok, "chat_template", None):
        raise UserError("the artifact's tokenizer has no chat template: use /v1/completions with a prompt")
    try:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - jinja raises its own exception types for malformed messages
        raise UserError(f"the chat template rejected the messages: {str(e).splitlines()[0]}") from None
    return list(tok(text, add_special_tokens=False)["input_ids"])


class Detokenizer:
    """Incremental decoding of one request's generated ids (special tokens skipped)."""

    def __init__(self, tok):
        self.tok = tok
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already returned

    def add(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # a multi-byte character split over tokens: wait for the rest
            return ""
        delta, self.sent = text[self.sent:], len(text)
        return delta

    def flush(self) -> str:
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        delta, self.sent = text[self.sent:], len(text)
        return delta
