"""Text in, text out (runtime/text.py, tools/tiny_tokenizer.py, `dayzero run --prompt`).

Spec:
- make-tiny's tokenizer, per architecture: loadable by ``AutoTokenizer``, every id inside the model's vocabulary,
  the config's token ids keep their meaning (bos / eos, Qwen3-VL's image tokens), text round-trips (multi-byte
  characters included; a byte outside the tiny alphabet is ``<unk>``, never dropped), and the chat template writes
  ChatML with the generation prompt (an image part is the image placeholder on Qwen3-VL-MoE, refused elsewhere).
- ``Detokenizer``: the deltas concatenate to ``tok.decode(all)`` and never end inside a character.
- ``dayzero compile`` carries the tokenizer into ``ART/tokenizer``; ``dayzero run ART --prompt/--chat --json``
  gives upstream ``generate()``'s greedy tokens (stopping at the model's eos ids) and their decoded text; the
  prompt ids are the checkpoint tokenizer's own (loaded independently by transformers).
- An artifact without a tokenizer has ``Runtime.tokenizer`` None, and ``--prompt`` on it is one line, exit 2.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from dayzero import UserError
from dayzero.runtime.text import Detokenizer, chat_images, encode_chat, encode_prompt, eos_ids
from dayzero.tools.cli import main
from dayzero.tools.make_tiny import shrink_config
from dayzero.tools.tiny_tokenizer import write_tokenizer

FIVE = ["deepseek_v4", "deepseek_v32", "gpt_oss", "qwen3_moe", "qwen3_vl_moe"]
TEXT = "Hello, world! The experts route café — “日本語” 😀 tokens.\n\tdone"


def _tok(model_type, tmp_path):
    from transformers import AutoTokenizer

    cfg = shrink_config(model_type)
    write_tokenizer(cfg, tmp_path / "tok")
    return cfg, AutoTokenizer.from_pretrained(str(tmp_path / "tok"))


@pytest.mark.parametrize("model_type", FIVE)
def test_tiny_tokenizer_per_architecture(model_type, tmp_path):
    cfg, tok = _tok(model_type, tmp_path)
    text_cfg = cfg.get_text_config()
    assert len(tok) == text_cfg.vocab_size and max(tok.get_vocab().values()) < text_cfg.vocab_size
    for key in ("bos_token_id", "eos_token_id"):  # the config's ids keep their meaning
        if getattr(text_cfg, key, None) is not None:
            assert getattr(tok, key) == getattr(text_cfg, key)
    ids = encode_prompt(tok, TEXT)
    assert tok.decode(ids, skip_special_tokens=True) == TEXT
    assert (ids[0] == text_cfg.bos_token_id) == (text_cfg.bos_token_id is not None)
    unk = encode_prompt(tok, "a\x07b")  # BEL is not in the tiny alphabet: <unk>, not dropped
    assert tok.unk_token_id in unk
    chat = encode_chat(tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}])
    start, end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert chat.count(start) == 3 and chat.count(end) == 2
    assert tok.decode(chat, skip_special_tokens=True) == "system\nBe brief.\nuser\nHi there\nassistant\n"
    assert tok.decode(chat).endswith("Hi there<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(encode_chat(tok, [{"role": "user", "content": "Hi"}], add_generation_prompt=False)) \
        .endswith("<|im_start|>user\nHi<|im_end|>\n")
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a.png"}},
                                          {"type": "text", "text": "What is it?"}]}]
    if getattr(cfg, "image_token_id", None) is not None:
        ids = encode_chat(tok, image)
        assert ids.count(cfg.image_token_id) == 1
        k = ids.index(cfg.image_token_id)
        assert ids[k - 1:k + 2] == [cfg.vision_start_token_id, cfg.image_token_id, cfg.vision_end_token_id]
        assert chat_images(image) == ["a.png"]
    else:
        with pytest.raises(UserError, match="no images"):
            encode_chat(tok, image)


def test_bad_text_requests(tmp_path):
    _, tok = _tok("qwen3_moe", tmp_path)
    with pytest.raises(UserError, match="empty prompt"):
        encode_prompt(tok, "")
    for bad in ([], [{"content": "x"}], [{"role": "user", "content": 3}],
                [{"role": "user", "content": [{"type": "audio"}]}], [{"role": "user", "content": [{"type": "text"}]}]):
        with pytest.raises(UserError):
            encode_chat(tok, bad)
    with pytest.raises(UserError, match="no tokenizer"):
        encode_prompt(None, "hi")


@pytest.mark.parametrize("skip", [False, True])
def test_detokenizer_deltas_concatenate_to_decode(tmp_path, skip):
    _, tok = _tok("deepseek_v4", tmp_path)
    g = torch.Generator().manual_seed(0)
    cases = [encode_prompt(tok, TEXT) + [tok.eos_token_id],
             # byte tokens in random order: partial UTF-8 sequences, replacement characters, specials
             torch.randint(0, len(tok), (300,), generator=g).tolist()]
    for ids in cases:
        d = Detokenizer(tok, skip_special_tokens=skip)
        deltas = [d.add(i) for i in ids]
        deltas.append(d.flush())
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
    calls = []
    counted = type("Counted", (), {"decode": lambda self, ids, **kw: calls.append(1) or tok.decode(ids, **kw)})()
    d = Detokenizer(counted)
    ids = encode_prompt(tok, TEXT)
    assert "".join([d.add(i) for i in ids] + [d.flush()]) == tok.decode(ids)
    assert len(calls) <= 1.2 * len(ids) + 2  # streaming costs about one decode per token (the window is kept)
    d = Detokenizer(tok)
    for i in encode_prompt(tok, "日本語😀"):  # multi-byte characters split over byte tokens come out whole
        delta = d.add(i)
        assert "\ufffd" not in delta
    assert d.flush() == ""


@pytest.mark.parametrize("model_type", FIVE)
def test_detokenizer_streams_through_the_tokenizers_backend(model_type, tmp_path):
    """A fast tokenizer's deltas come from the backend's DecodeStream: transformers' ``decode`` (~6-33 us a call
    against ~1 us a streamed token) runs once per request, at ``flush``, not once per token."""
    _, tok = _tok(model_type, tmp_path)
    g = torch.Generator().manual_seed(1)
    for skip in (False, True):
        for ids in (encode_prompt(tok, TEXT) + [tok.eos_token_id],
                    torch.randint(0, len(tok), (200,), generator=g).tolist()):
            calls = []
            real = tok.decode
            tok.decode = lambda ids, **kw: calls.append(1) or real(ids, **kw)
            d = Detokenizer(tok, skip_special_tokens=skip)
            deltas = [d.add(i) for i in ids]
            deltas.append(d.flush())
            del tok.decode
            assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
            assert len(calls) <= 1


def test_eos_ids_from_generation_config(tmp_path):
    _, tok = _tok("qwen3_moe", tmp_path)
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert eos_ids(tmp_path, tok) == sorted({7, 9, tok.convert_tokens_to_ids("<|im_end|>")})
    (tmp_path / "tokenizer" / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(UserError, match="eos_token_id"):
        eos_ids(tmp_path, tok)


def _upstream_generate(ckpt, ids, n, eos):
    from dayzero.frontend.hf import load_upstream

    ref = load_upstream(ckpt)
    x = torch.tensor([ids])
    with torch.no_grad():
        out = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                           eos_token_id=eos)
    return out[0, len(ids):].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v4"])
def test_run_prompt_and_chat_give_upstream_text(tiny_compiled, model_type):
    from transformers import AutoTokenizer

    from dayzero.runtime import load

    ckpt, art, report = tiny_compiled(model_type)
    assert report["tokenizer"] and (art / "tokenizer" / "tokenizer.json").is_file()
    ref_tok = AutoTokenizer.from_pretrained(str(ckpt))  # the checkpoint's tokenizer, independently of dayzero
    rt = load(art)
    assert rt.eos_ids == [ref_tok.eos_token_id]  # make-tiny's eos: the config's id, or <|im_end|>
    prompt = "Hello, world! How are the experts today?"
    msgs = [{"role": "user", "content": prompt}]
    texts = []
    for flags, ids in ((["--prompt", prompt], ref_tok(prompt).input_ids),
                       (["--prompt", prompt, "--chat"],
                        ref_tok(ref_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                                add_special_tokens=False).input_ids)):
        r = CliRunner().invoke(main, ["run", str(art), *flags, "--max-new-tokens", "12", "--json"])
        assert r.exit_code == 0, r.output
        res = json.loads(r.stdout)
        want = _upstream_generate(ckpt, ids, 12, rt.eos_ids)
        assert res["prompt_tokens"] == len(ids) and res["tokens"] == want
        assert res["text"] == ref_tok.decode(want, skip_special_tokens=True)
        texts.append(res["text"])
    r = CliRunner().invoke(main, ["run", str(art), "--prompt", prompt, "--max-new-tokens", "12"])
    assert r.exit_code == 0 and r.stdout == texts[0] + "\n"  # without --json: the text alone


def test_artifact_without_tokenizer(compiled_factory):
    from dayzero.runtime import load

    out, _, _ = compiled_factory("tiny_moe")
    rt = load(out)
    assert rt.tokenizer is None and rt.eos_ids == []
    r = CliRunner().invoke(main, ["run", str(out), "--prompt", "hi"])
    assert r.exit_code == 2 and "no tokenizer" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(main, ["run", str(out)])
    assert r.exit_code == 2 and "exactly one of --input-ids and --prompt" in r.output
