"""One error taxonomy for requests (issue 20, item 8): every bad value a user hands the runtime is a UserError
naming the parameter and the value, in Python and in the CLI (exit 2, one line, the option named); in a batch a
malformed request fails alone and the others return what they return when run alone.

The artifact is the shared tiny Qwen3-MoE (stateful, paged KV cache, 3 request slots) of tests/conftest.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from dayzero import UserError
from dayzero.runtime import generate_batch, load, request_checks
from dayzero.tools.cli import main

PROMPT = [5, 17, 99, 3]
OTHER = [42, 8, 120, 7, 11]
NEW = 4


@pytest.fixture(scope="module")
def qwen(tiny_compiled):
    _, art, _ = tiny_compiled("qwen3_moe")
    return art, load(art)


# ---- the CLI: exit 2, one line, the option named ----------------------------------------------------------------

BIG = str(2 ** 63)  # one past int64
CLI_CASES = {
    "temperature nan": (["--max-new-tokens", "2", "--temperature", "nan"], "--temperature", "nan"),
    "temperature inf": (["--max-new-tokens", "2", "--temperature", "inf"], "--temperature", "inf"),
    "temperature negative": (["--max-new-tokens", "2", "--temperature", "-0.5"], "--temperature", "-0.5"),
    "top-p 0": (["--max-new-tokens", "2", "--temperature", "1", "--top-p", "0"], "--top-p", "0"),
    "top-p above 1": (["--max-new-tokens", "2", "--top-p", "1.5"], "--top-p", "1.5"),
    "max-new-tokens negative": (["--max-new-tokens", "-1"], "--max-new-tokens", "-1"),
    "seed beyond 2**63": (["--max-new-tokens", "2", "--seed", BIG], "--seed", BIG),
    "input id 2**63": (["--input-ids", f"1,{BIG}"], "--input-ids", BIG),
    "input id 2**70": (["--input-ids", str(2 ** 70)], "--input-ids", str(2 ** 70)),
    "input id negative": (["--input-ids", "1,-3"], "--input-ids", "-3"),
    "input id beyond vocab": (["--input-ids", "1,1000000"], "--input-ids", "1000000"),
    "input ids not ints": (["--input-ids", "1,x"], "--input-ids", "'1,x'"),
    "stop ids not ints": (["--max-new-tokens", "2", "--stop-ids", "x"], "--stop-ids", "'x'"),
    "stop id 2**63": (["--max-new-tokens", "2", "--stop-ids", BIG], "--stop-ids", BIG),
    "stop id beyond vocab": (["--max-new-tokens", "2", "--stop-ids", "3,1000000"], "--stop-ids", "1000000"),
}


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_cli_run_bad_values_are_user_errors_naming_the_option(qwen, case):
    art, _ = qwen
    args, option, value = CLI_CASES[case]
    if "--input-ids" not in args:
        args = ["--input-ids", ",".join(map(str, PROMPT))] + args
    r = CliRunner().invoke(main, ["run", str(art), *args])
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    assert option in lines[0] and value in lines[0], lines[0]
    if option != "--input-ids":
        assert "--input-ids" not in lines[0]


@pytest.mark.slow
def test_cli_run_bad_value_in_a_real_process_is_one_stderr_line(qwen):
    """The same through a real process: stderr holds exactly the error line (no traceback, no warning)."""
    import subprocess
    import sys

    art, _ = qwen
    r = subprocess.run([sys.executable, "-m", "dayzero.tools.cli", "run", str(art), "--input-ids", "1,2",
                        "--max-new-tokens", "2", "--temperature", "nan"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == ["error: --temperature must be a finite number >= 0 (0: greedy), got nan"]


@pytest.mark.parametrize("args,needle", [
    (["run", "art", "--temperature", "abc"], "'--temperature': 'abc' is not a valid float"),
    (["run", "art", "--bogus"], "No such option '--bogus'"),
    (["run"], "Missing argument 'ARTIFACT'"),
    (["compile", "ckpt", "-o", "out", "--max-seq", "x"], "--max-seq: expected a number like 1000, 128k or 1M, got 'x'"),
    (["frobnicate"], "No such command 'frobnicate'"),
])
def test_cli_usage_errors_are_one_line(tmp_path, args, needle):
    """What click itself refuses (a value of the wrong type, an unknown option or command, a missing argument) is
    bad input like any other: one line naming it, exit 2, no usage block."""
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.output


def test_cli_run_good_values_still_run(qwen):
    art, rt = qwen
    r = CliRunner().invoke(main, ["run", str(art), "--input-ids", ",".join(map(str, PROMPT)), "--max-new-tokens",
                                  str(NEW), "--stop-ids", "0", "--json"])
    assert r.exit_code == 0, r.output
    assert '"tokens"' in r.output


# ---- Python: UserError naming the parameter and the value -------------------------------------------------------

def _prefill(rt, ids, **kw):
    return lambda: rt.prefill(ids, **kw)


def _generate(rt, **kw):
    return lambda: rt.generate(PROMPT, **{"max_new_tokens": NEW, **kw})


def _decode(rt, tok, **kw):
    def call():
        rt.prefill(PROMPT)
        return rt.decode(tok, **kw)
    return call


PY_CASES = {
    "str ids": (lambda rt: _prefill(rt, "abc"), ["input_ids", "str", "'abc'"]),
    "None ids": (lambda rt: _prefill(rt, None), ["input_ids", "None"]),
    "dict ids": (lambda rt: _prefill(rt, {"input_ids": PROMPT}), ["input_ids", "dict"]),
    "str inside ids": (lambda rt: _prefill(rt, [1, "2"]), ["input_ids", "'2'"]),
    "float ids": (lambda rt: _prefill(rt, [1, 2.5]), ["input_ids", "float", "2.5"]),
    "integral float ids": (lambda rt: _prefill(rt, [1.0, 2.0]), ["input_ids", "float", "1.0"]),
    "bool ids": (lambda rt: _prefill(rt, [True, False]), ["input_ids", "bool", "True"]),
    "float tensor": (lambda rt: _prefill(rt, torch.tensor([1.0, 2.0])), ["input_ids", "dtype", "float32"]),
    "bool array": (lambda rt: _prefill(rt, np.array([True])), ["input_ids", "dtype", "bool"]),
    "two rows": (lambda rt: _prefill(rt, [[1, 2], [3, 4]]), ["input_ids", "2 rows"]),
    "three deep": (lambda rt: _prefill(rt, [[[1, 2]]]), ["input_ids", "nested"]),
    "rank 3 tensor": (lambda rt: _prefill(rt, torch.ones(1, 1, 2, dtype=torch.int64)), ["input_ids", "(1, 1, 2)"]),
    "id 2**70": (lambda rt: _prefill(rt, [1, 2 ** 70]), ["input_ids", str(2 ** 70)]),
    "uint64 id 2**63": (lambda rt: _prefill(rt, np.array([2 ** 63], dtype=np.uint64)), ["input_ids", str(2 ** 63)]),
    "negative id": (lambda rt: _prefill(rt, [-1]), ["input_ids", "-1"]),
    "id = vocab": (lambda rt: _prefill(rt, [rt.vocab_size]), ["input_ids", "VOCAB"]),
    "empty": (lambda rt: _prefill(rt, []), ["input_ids", "empty"]),
    "slot out of range": (lambda rt: _prefill(rt, PROMPT, slot=3), ["slot 3", "0..2"]),
    "negative slot": (lambda rt: _prefill(rt, PROMPT, slot=-1), ["slot -1"]),
    "str slot": (lambda rt: _prefill(rt, PROMPT, slot="0"), ["slot '0'"]),
    "decode two ids": (lambda rt: _decode(rt, [1, 2]), ["token_id", "one token", "got 2"]),
    "decode str": (lambda rt: _decode(rt, "a"), ["token_id", "'a'"]),
    "decode float": (lambda rt: _decode(rt, 3.0), ["token_id", "3.0"]),
    "decode bad slot": (lambda rt: _decode(rt, 1, slot=7), ["slot 7"]),
    "temperature nan": (lambda rt: _generate(rt, temperature=math.nan), ["temperature", "nan"]),
    "temperature negative": (lambda rt: _generate(rt, temperature=-1.0), ["temperature", "-1.0"]),
    "top_p 0": (lambda rt: _generate(rt, temperature=1.0, top_p=0.0), ["top_p", "0.0"]),
    "top_p nan": (lambda rt: _generate(rt, temperature=1.0, top_p=math.nan), ["top_p", "nan"]),
    "max_new_tokens negative": (lambda rt: _generate(rt, max_new_tokens=-2), ["max_new_tokens", "-2"]),
    "max_new_tokens float": (lambda rt: _generate(rt, max_new_tokens=2.0), ["max_new_tokens", "2.0"]),
    "seed 2**64": (lambda rt: _generate(rt, seed=2 ** 64), ["seed", str(2 ** 64)]),
    "stop id str": (lambda rt: _generate(rt, stop_ids=["x"]), ["stop_ids", "'x'"]),
    "stop id 2**63": (lambda rt: _generate(rt, stop_ids=[2 ** 63]), ["stop_ids", str(2 ** 63)]),
    "generate bad slot": (lambda rt: _generate(rt, slot=3), ["slot 3"]),
}


@pytest.mark.parametrize("case", sorted(PY_CASES))
def test_python_bad_values_are_user_errors_naming_the_value(qwen, case):
    _, rt = qwen
    make, words = PY_CASES[case]
    with pytest.raises(UserError) as e:
        make(rt)()
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert (str(rt.vocab_size) if w == "VOCAB" else w) in msg, msg


def test_good_ids_of_every_accepted_form_give_the_same_logits(qwen):
    _, rt = qwen
    ref = rt.prefill(PROMPT)
    for form in (tuple(PROMPT), [PROMPT], np.array(PROMPT, dtype=np.int32), torch.tensor([PROMPT]),
                 [np.int64(t) for t in PROMPT], np.array(PROMPT, dtype=np.uint8)):
        assert torch.equal(rt.prefill(form), ref)
    rt.prefill(PROMPT)
    a = rt.decode(np.int64(7))
    rt.prefill(PROMPT)
    assert torch.equal(rt.decode(torch.tensor([7])), a)
    full = rt.generate(PROMPT, NEW)
    assert rt.generate(PROMPT, NEW, stop_ids=np.array([], dtype=np.int64)) == full
    assert rt.generate(PROMPT, NEW, stop_ids={full[0]}) == full[:1]  # a set of stop ids
    assert rt.generate(PROMPT, NEW, stop_ids=full[0]) == full[:1]  # one stop id


@pytest.mark.parametrize("bad,words", [("abc", ["'abc'"]), (None, ["None"]), (2 ** 70, [str(2 ** 70)]),
                                       ({"ids": PROMPT}, ["dict"]), ([1, 2.5], ["2.5"]), ([], ["empty"])])
def test_generate_batch_a_malformed_request_fails_alone(qwen, bad, words):
    _, rt = qwen
    alone = [rt.generate(p, NEW) for p in (PROMPT, OTHER)]
    res = generate_batch(rt, [PROMPT, bad, OTHER], max_new_tokens=NEW)
    assert [res[0]["tokens"], res[2]["tokens"]] == alone
    assert res[0]["error"] is None and res[2]["error"] is None
    assert res[1]["tokens"] == [] and "input_ids" in res[1]["error"]
    for w in words:
        assert w in res[1]["error"], res[1]["error"]


def test_generate_batch_bad_shared_parameters_raise_before_any_request(qwen):
    _, rt = qwen
    for kw, word in ((dict(temperature=math.nan), "temperature"), (dict(top_p=0), "top_p"),
                     (dict(max_new_tokens=-1), "max_new_tokens"), (dict(stop_ids=["x"]), "stop_ids")):
        with pytest.raises(UserError, match=word):
            generate_batch(rt, [PROMPT], **{"max_new_tokens": NEW, **kw})
    with pytest.raises(UserError, match="list of requests"):
        generate_batch(rt, "abc")


def test_validate_rules():
    assert request_checks.token_ids([3, 4], 10).tolist() == [[3, 4]]
    assert request_checks.token_ids(7, 10).tolist() == [[7]]
    assert request_checks.token_ids([], 10, allow_empty=True).shape == (1, 0)
    with pytest.raises(UserError, match="outside the vocabulary"):
        request_checks.token_ids([10], 10)
    with pytest.raises(UserError, match=r"outside \[0, 2\*\*63\)"):
        request_checks.token_ids([2 ** 63], None)
    request_checks.sampling(0, 0.0, 1.0, 0)
    request_checks.sampling(5, 0.7, 0.9, 2 ** 63 - 1)
    with pytest.raises(UserError, match="--top-p"):
        request_checks.sampling(1, 1.0, 0.0, 0, cli=True)
    with pytest.raises(UserError, match="temperature"):
        request_checks.sampling(1, True, 1.0, 0)
    assert request_checks.slot(np.int64(1), 2) == 1
    with pytest.raises(UserError, match="slot 2"):
        request_checks.slot(2, 2)
    request_checks.batch([[1], [2]], 2, "prompts", "a list of requests")
    with pytest.raises(UserError, match="^prompts: expected a list of requests, got str$"):
        request_checks.batch("abc", 2, "prompts", "a list of requests")
    with pytest.raises(UserError, match=r"^3 requests but the artifact serves 2 at once \(--max-batch\)$"):
        request_checks.batch([[1]] * 3, 2, "requests", "a list")


@pytest.mark.slow
def test_multimodal_requests_are_validated_alike(tiny_compiled):
    """The image + text driver (runtime/multimodal.py) takes the same checks, and a malformed request in its batch
    fails alone."""
    _, art, _ = tiny_compiled("qwen3_vl_moe")
    rt = load(art)
    mm = rt.multimodal
    alone = rt.generate(PROMPT, NEW)
    res = mm.generate_batch([{"ids": PROMPT}, PROMPT, {"input_ids": PROMPT, "images": "x.png"}], NEW)
    assert "keys ['ids']" in res[0]["error"] and "images" in res[2]["error"] and "str" in res[2]["error"]
    assert res[1]["error"] is None and res[1]["tokens"] == alone
    res = mm.generate_batch(["abc", PROMPT, [2 ** 70]], NEW)
    assert "'abc'" in res[0]["error"] and str(2 ** 70) in res[2]["error"] and res[1]["tokens"] == alone
    for call, word in ((lambda: mm.prefill(PROMPT, slot=3), "slot 3"), (lambda: rt.generate(PROMPT, -1), "max_new"),
                       (lambda: mm.generate_batch([PROMPT], NEW, top_p=0.0), "top_p"),
                       (lambda: rt.generate(PROMPT, NEW, temperature=math.inf), "temperature")):
        with pytest.raises(UserError, match=word):
            call()
    rt.prefill(PROMPT)
    with pytest.raises(UserError, match="one token id"):
        rt.decode([1, 2])
