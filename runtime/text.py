"""Text in, text out: the checkpoint's own tokenizer and chat template, carried in the artifact.

    dayzero compile:  CHECKPOINT/{tokenizer.json, tokenizer_config.json, chat_template.jinja, ...}
                      -> ART/tokenizer/   (carry_tokenizer; loadable by AutoTokenizer.from_pretrained)
    runtime:          load_tokenizer(ART) -> transformers' own tokenizer class (never a hand-written BPE)
                      encode_prompt(tok, "text")            -> ids (the tokenizer's special tokens, e.g. BOS)
                      encode_chat(tok, [{"role", "content"}]) -> ids of the model's chat template
                      Detokenizer(tok).add(id) -> text delta  (streaming; whole characters only; the
                                            tokenizers backend's DecodeStream on a fast tokenizer)
                      eos_ids(ART, tok)                     -> ids that end a generation

Files are parsed by transformers / tokenizers (JSON, sentencepiece protobuf), never evaluated; no remote code.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from dayzero import UserError

TOKENIZER_DIR = "tokenizer"
# what a checkpoint's tokenizer consists of (any subset); config.json lets AutoTokenizer resolve the class of a
# tokenizer_config.json that names none, generation_config.json holds the end-of-sequence ids
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "vocab.txt")
CONTEXT_FILES = ("config.json", "generation_config.json")
PART_TYPES = ("text", "image_url", "image")


def carry_tokenizer(checkpoint_dir: str | Path, dst: str | Path) -> bool:
    """Copy the checkpoint's tokenizer files into ``dst`` (an artifact's ``tokenizer/``) and check that
    transformers loads them. Returns False (nothing written) when the checkpoint has no tokenizer."""
    src = Path(checkpoint_dir)
    files = [f for f in TOKENIZER_FILES if (src / f).is_file()]
    if not files:
        return False
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in files + [f for f in CONTEXT_FILES if (src / f).is_file()]:
        shutil.copyfile(src / f, dst / f)
    _load(dst, f"{src}: its tokenizer")
    return True


def _load(path: Path, what: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many types on broken tokenizer files
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise UserError(f"{what} cannot be loaded by transformers: {type(e).__name__}: {msg}") from None


def load_tokenizer(artifact_dir: str | Path):
    """The artifact's tokenizer (a transformers ``PreTrainedTokenizerBase``), or None when it carries none."""
    path = Path(artifact_dir) / TOKENIZER_DIR
    if not path.is_dir():
        return None
    return _load(path, f"{path}: the artifact's tokenizer")


def eos_ids(artifact_dir: str | Path, tok=None) -> list[int]:
    """End-of-sequence ids: the checkpoint's generation config ``eos_token_id`` (an id or a list) and the
    tokenizer's eos token."""
    ids: set[int] = set()
    gc = Path(artifact_dir) / TOKENIZER_DIR / "generation_config.json"
    if gc.is_file():
        try:
            v = json.loads(gc.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, AttributeError, UnicodeDecodeError):
            raise UserError(f"{gc}: not a JSON object") from None
        for x in v if isinstance(v, list) else [v]:
            if isinstance(x, int) and not isinstance(x, bool) and x >= 0:
                ids.add(x)
            elif x is not None:
                raise UserError(f"{gc}: eos_token_id {x!r} is not a token id")
    if tok is not None and tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    return sorted(ids)


def _need(tok):
    if tok is None:
        raise UserError("the artifact carries no tokenizer (its checkpoint has none): give token ids instead")
    return tok


def encode_prompt(tok, text: str) -> list[int]:
    """Token ids of a plain prompt, with the special tokens the tokenizer adds itself (e.g. BOS)."""
    _need(tok)
    if not isinstance(text, str):
        raise UserError(f"a prompt must be a string, got {type(text).__name__}")
    if not text:
        raise UserError("empty prompt: give some text")
    return [int(i) for i in tok(text).input_ids]


def _check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise UserError("messages must be a non-empty list of {role, content} objects")
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise UserError(f"message {k}: an object with a string role is required")
        c = m.get("content")
        if isinstance(c, str):
            continue
        if not isinstance(c, list):
            raise UserError(f"message {k}: content must be a string or a list of parts")
        for j, p in enumerate(c):
            if not isinstance(p, dict) or p.get("type") not in PART_TYPES:
                raise UserError(f"message {k} part {j}: a part is an object of type "
                                f"{' | '.join(PART_TYPES)}")
            if p["type"] == "text" and not isinstance(p.get("text"), str):
                raise UserError(f"message {k} part {j}: a text part needs a string 'text'")


def encode_chat(tok, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of ``messages`` (OpenAI form: content a string or a list of parts ``{"type": "text", "text"}`` /
    ``{"type": "image_url", "image_url": {"url"}}``) through the model's own chat template; an image part becomes
    the model's image placeholder (the runtime expands it, runtime/multimodal.py)."""
    from jinja2 import TemplateError

    _need(tok)
    _check_messages(messages)
    if not getattr(tok, "chat_template", None):
        raise UserError("the model's tokenizer has no chat template: send a plain prompt")
    try:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except TemplateError as e:
        raise UserError(f"chat template: {str(e).strip().splitlines()[0] if str(e).strip() else e!r}") from None
    # the template writes the special tokens (BOS...) itself: do not add them twice
    return [int(i) for i in tok(text, add_special_tokens=False).input_ids]


def chat_images(messages: list[dict]) -> list[str]:
    """The image references of ``messages`` in order (an ``image_url`` part's url: a data: URI or a path), one
    per image placeholder ``encode_chat`` wrote."""
    _check_messages(messages)
    out = []
    for m in messages:
        for p in m["content"] if isinstance(m["content"], list) else []:
            if p["type"] == "text":
                continue
            ref = p.get(p["type"])
            url = ref.get("url") if isinstance(ref, dict) else ref
            if not isinstance(url, str) or not url:
                raise UserError(f"an {p['type']} part needs a url (a data: URI or a file path)")
            out.append(url)
    return out


class Detokenizer:
    """Streaming detokenization: ``add(token_id)`` returns the text the new token completes.

    With a tokenizer backed by ``tokenizers`` (every fast tokenizer; transformers' decode adds nothing to the
    backend's decode unless it cleans up tokenization spaces), each token is one step of the backend's own
    ``DecodeStream`` (Rust: it keeps the prefix window and holds back an unfinished character), ~1 us a token
    against ~6-33 us for a transformers ``decode`` of a window. Otherwise (a slow tokenizer) a window of tokens
    starting a few tokens before the unread ones is decoded with the new ones, and only whole characters past the
    window's text so far come out; an unfinished character (U+FFFD at the end) waits for the next token. The
    window's text so far is the previous call's decode of the same ids, kept, so a token costs one decode; the
    window restarts ``CONTEXT`` tokens back once it holds ``2 * CONTEXT`` read tokens (one more decode then).
    ``flush()`` returns what is left. The deltas concatenate to ``tok.decode(all_ids, skip_special_tokens=...)``.
    """

    CONTEXT = 6  # tokens decoded before the unread ones, so that merges across the boundary are seen

    def __init__(self, tok, skip_special_tokens: bool = False):
        self.tok = _need(tok)
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # start of the window
        self.read = 0  # tokens whose text was returned
        self._before: str | None = ""  # the window's text up to ``read`` (None: not decoded yet)
        self._backend = _stream_backend(tok)
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            self._out: list[str] = []  # every delta returned

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def _window_text(self) -> str:
        if self._before is None:
            self._before = self._decode(self.ids[self.prefix:self.read])
        return self._before

    def add(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        if self._backend is not None:
            try:
                delta = self._stream.step(self._backend, self.ids[-1])
            except Exception:  # noqa: BLE001 - an id the backend does not know: decode() says how it reads
                delta = None
            if delta:
                self._out.append(delta)
            return delta or ""
        before = self._window_text()
        text = self._decode(self.ids[self.prefix:])
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""  # no new whole character yet
        self.read = len(self.ids)
        if self.read - self.prefix >= 2 * self.CONTEXT:
            self.prefix, self._before = self.read - self.CONTEXT, None
        else:
            self._before = text
        return text[len(before):]

    def flush(self) -> str:
        """The text of tokens not returned yet (an unfinished character as U+FFFD, as ``decode`` gives it)."""
        if self._backend is not None:  # one decode of the whole output, at the end
            sent = "".join(self._out)
            whole = self._decode(self.ids)
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=self.skip)
            self.ids, self._out = [], []
            return whole[len(sent):]
        before = self._window_text()
        text = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        self._before = ""
        return text[len(before):]


def _stream_backend(tok):
    """The ``tokenizers.Tokenizer`` behind ``tok`` when its deltas can be streamed by it: a fast tokenizer whose
    ``decode`` is the backend's decode (no clean-up of tokenization spaces); else None."""
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - transformers' fast tokenizers need it
        return None
    backend = getattr(tok, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer) or getattr(tok, "clean_up_tokenization_spaces", False):
        return None
    return backend
