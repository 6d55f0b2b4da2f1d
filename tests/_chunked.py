"""What the chunked-prefill tests share (test_chunked_prefill.py: the artifacts compiled with --prefill-chunk;
test_chunked_prefill_shared.py: the session's shared DeepSeek artifacts fed a chunk per call, in their own file so
that xdist's ``--dist loadfile`` can put them on another worker)."""

from __future__ import annotations

import torch

CHUNK = 16
MAX_SEQ = 128  # as the shared session artifacts (conftest.tiny_compiled), so the arenas compare
NEW = 8
TOL = 1e-4


def upstream_model(ckpt):
    """The upstream transformers model of the checkpoint, generating exactly NEW tokens (no stop ids)."""
    from dayzero.frontend.hf import load_upstream

    ref = load_upstream(ckpt)
    ref.generation_config.eos_token_id = None  # exactly NEW tokens, as rt.generate without stop ids
    return ref


def make_prompt(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefill_in_chunks(rt, ids, chunk):
    """The prompt as consecutive prefill calls of ``chunk`` tokens (the first starts the request)."""
    logits = [rt.prefill(ids[k:k + chunk], append=k > 0) for k in range(0, len(ids), chunk)]
    return torch.cat(logits, dim=1)


def check_matches_upstream(rt, ref, by_hand):
    """Prompts of 70 and 33 tokens prefilled a chunk at a time (by the runtime, or ``by_hand`` tokens per call):
    the logits equal upstream's eager forward on the whole prompt, and greedy decoding after it upstream
    ``generate()``."""
    assert rt.max_length == MAX_SEQ
    assert rt.prefill_chunk == (CHUNK if by_hand is None else MAX_SEQ)
    for n in (70, 33):
        ids = make_prompt(n, n)
        x = torch.tensor([ids])
        with torch.no_grad():
            want = ref(input_ids=x, attention_mask=torch.ones_like(x)).logits
            upstream = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW,
                                    do_sample=False)[0, n:].tolist()
        if by_hand is None:
            got = rt.prefill(ids)
            # what generation reads: the last chunk's last position only, not every chunk's logits kept
            last = rt.prefill(ids, last=True)
            assert last.shape == (1, 1, got.shape[-1]) and torch.equal(last[0, 0], got[0, -1])
            tokens = rt.generate(ids, NEW)
        else:
            got = prefill_in_chunks(rt, ids, by_hand)
            head = (n - 1) // by_hand * by_hand  # every chunk but the last, then the last one and the decode
            prefill_in_chunks(rt, ids[:head], by_hand)
            tokens = rt.generate(ids[head:], NEW, append=True)
        assert got.shape == want.shape
        assert float((got - want).abs().max()) <= TOL
        assert tokens == upstream
