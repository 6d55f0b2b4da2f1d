"""Serving long prompts (issues 18 and 16): prefill fair share, requests that can never fit the KV pool, errors that
name the flag that bounds a request, large bodies (413, parsed off the event loop), SSE keepalives while a long
prefill runs, and a client that goes away during its prefill.

The artifacts are the shared tiny ones (conftest ``tiny_compiled``: max_seq 128, 3 request slots) and one tiny
Qwen3-MoE compiled with a KV pool smaller than one full-length request (``--kv-blocks``). A long prefill is made
long by slowing the runtime's prefill call (a sleep per engine chunk), not by a long prompt: the behaviour under
test is the engine's and the server's, which see only chunks and time. The reference for every generated token
is ``Runtime.generate`` of the same prompt alone, in a second Runtime of the artifact (whose numerics the compare
tests check against upstream transformers run eagerly).
"""

from __future__ import annotations

import http.client
import json
import queue
import re
import socket
import threading
import time

import pytest
import torch

from dayzero import UserError
from dayzero.runtime import load
from dayzero.runtime.engine import Engine, EngineMetrics, Request
from dayzero.runtime import server as server_mod
from dayzero.runtime.server import Server, start_in_thread

from _http import Http


def _prompt(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _collect(q: queue.Queue, timeout=300):
    toks = []
    while True:
        ev = q.get(timeout=timeout)
        if ev.kind != "token":
            return toks, ev
        toks.append(ev.token)


class _Counted(EngineMetrics):
    def __init__(self):
        self.prefilled_by = {}

    def prefilled(self, req, tokens):
        self.prefilled_by[req.id] = self.prefilled_by.get(req.id, 0) + tokens


def _step(eng: Engine) -> None:
    eng._drain(block=False)
    eng.step()


def test_prefill_goes_to_the_fewest_tokens_left_first(tiny_compiled):
    """A long prompt admitted first does not hold the prefill budget: a short one that arrives after it is
    prefilled in the next iteration and decodes between the long one's chunks, which take what it leaves; both
    give offline generate's tokens, and the metrics hook counts every prompt token once."""
    _, art, _ = tiny_compiled("qwen3_moe")
    rt, offline = load(art), load(art)
    metrics = _Counted()
    eng = Engine(rt, prefill_chunk=16, metrics=metrics)  # stepped by hand, not started
    long_p, short_p = _prompt(100, 1), _prompt(5, 2)
    ql, qs = queue.Queue(), queue.Queue()
    long_r = eng.submit(Request(long_p, ql.put, max_tokens=6, ignore_eos=True))
    _step(eng)
    assert long_r.prefilled == 16
    short_r = eng.submit(Request(short_p, qs.put, max_tokens=4, ignore_eos=True))
    _step(eng)
    assert short_r.prefilled == 5 and long_r.prefilled == 16 + 11  # the short one first, the long one the rest
    assert qs.qsize() == 1  # its first token came out in that iteration
    for _ in range(3):
        _step(eng)
    toks, ev = _collect(qs, timeout=1)
    assert ev.kind == "done" and long_r.prefilled < 100  # the short one ended while the long one still prefilled
    assert toks == offline.generate(short_p, 4)
    while not long_r.finished:
        _step(eng)
    toks, ev = _collect(ql, timeout=1)
    assert ev.kind == "done" and toks == offline.generate(long_p, 6)
    assert metrics.prefilled_by == {long_r.id: 100, short_r.id: 5}


def test_the_prefill_budget_defaults_to_the_artifacts_compiled_chunk(tiny_compiled):
    """Without --prefill-chunk an iteration prefills as many prompt tokens as one call of the compiled prefill
    program takes (the shared artifact: 128), not a fixed 64 that would split every longer prompt of a
    --prefill-chunk 512 artifact into 8 calls."""
    _, art, _ = tiny_compiled("qwen3_moe")
    rt = load(art)
    eng = Engine(rt)
    assert rt.prefill_chunk == 128 and eng.prefill_chunk == 128
    r = eng.submit(Request(_prompt(100, 4), lambda ev: None, max_tokens=2, ignore_eos=True))
    _step(eng)
    assert r.prefilled == 100  # in one iteration


def test_errors_name_the_flag_that_bounds_the_request(tiny_compiled):
    _, art, _ = tiny_compiled("qwen3_moe")
    rt = load(art)
    with pytest.raises(UserError, match=r"length budget of 128 tokens \(the artifact's --max-seq\)"):
        Engine(rt).submit(Request([1, 2], lambda ev: None, max_tokens=127))
    eng = Engine(rt, prefill_chunk=8)
    q = queue.Queue()
    eng.submit(Request(_prompt(40, 3), q.put, max_tokens=4, timeout=0.5))
    _step(eng)
    time.sleep(0.6)
    _step(eng)
    _, ev = _collect(q, timeout=1)
    assert ev.kind == "error" and ev.status == 408
    assert "--timeout" in ev.error and "8 of 40 prompt tokens prefilled" in ev.error, ev.error


# -- a KV pool smaller than one full-length request -----------------------------------------------------------------

SMALL_POOL = 6  # blocks of 16 tokens, one of them the scratch block: 80 tokens of one request at most


@pytest.fixture(scope="module")
def small_pool(tmp_path_factory):
    from dayzero.tools.driver import compile_model
    from dayzero.tools.make_tiny import make_tiny

    d = tmp_path_factory.mktemp("small_pool")
    make_tiny("qwen3_moe", d / "ckpt", seed=0)
    compile_model(str(d / "ckpt"), d / "art", max_seq=128, max_batch=2, kv_blocks=SMALL_POOL)
    return d / "art"


@pytest.mark.slow
def test_a_request_the_pool_can_never_hold_is_400_naming_kv_blocks(small_pool):
    """While another request runs (so blocks will free up), a request whose budget needs more blocks than the
    whole pool is refused at once, naming --kv-blocks, instead of waiting for blocks that can never be enough;
    the running one completes, and a request that fits is served."""
    s = Server(small_pool, model="tiny", prefill_chunk=16)
    http_srv, port = start_in_thread(s)
    real = s.rt.decode

    def slow(*a, **kw):  # the running request's 60 steps take 3 s or more
        time.sleep(0.05)
        return real(*a, **kw)
    s.rt.decode = slow
    try:
        offline = load(small_pool)
        prompt = _prompt(5, 4)
        got = {}

        def run():
            got["r"] = Http(port).request("POST", "/v1/completions",
                                {"prompt": prompt, "max_tokens": 60, "temperature": 0, "ignore_eos": True})
        t = threading.Thread(target=run)
        t.start()
        deadline = time.monotonic() + 60
        while Http(port).metric("dayzero_requests_running") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        status, r = Http(port).request("POST", "/v1/completions", {"prompt": _prompt(50, 5), "max_tokens": 60},
                             timeout=30)
        assert status == 400, r
        assert "--kv-blocks" in r["error"]["message"] and "holds 5" in r["error"]["message"], r
        assert t.is_alive()  # refused at once, not when the running request ended
        t.join(300)
        status, r = got["r"]
        assert status == 200 and r["choices"][0]["token_ids"] == offline.generate(prompt, 60)
    finally:
        http_srv.should_exit = True
        s.close()


@pytest.fixture
def slow_server(tiny_compiled, request):
    """A server over tiny Qwen3-MoE whose engine prefills 8 tokens per iteration, each chunk 0.1 s slower than it
    is (a long prompt's prefill, made long in time); keepalive comments every 0.2 s."""
    _, art, _ = tiny_compiled("qwen3_moe")
    s = Server(art, model="tiny", prefill_chunk=8, keepalive=0.2, max_body=1_000_000)
    http_srv, port = start_in_thread(s)
    real = s.rt.prefill

    def slow(*a, **kw):
        time.sleep(0.1)
        return real(*a, **kw)
    s.rt.prefill = slow  # the engine thread calls it through the runtime object
    s.port, s.offline = port, load(art)
    yield s
    http_srv.should_exit = True
    s.close()


def test_sse_keepalive_comments_while_a_long_prefill_runs(slow_server):
    """A streaming request whose prefill outlasts the keepalive gets its headers and `: prefill N/M` comment lines
    (N growing) until its first token, then the tokens offline generate gives, and [DONE]."""
    prompt = _prompt(100, 6)  # 13 chunks: ~1.3 s of prefill
    c = http.client.HTTPConnection("127.0.0.1", slow_server.port, timeout=60)
    c.request("POST", "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": 5, "temperature": 0,
                                                      "ignore_eos": True, "stream": True}),
              {"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200
    lines = [ln.decode().rstrip("\n") for ln in r if ln.strip()]
    c.close()
    comments = [ln for ln in lines if ln.startswith(":")]
    progress = [int(m.group(1)) for ln in comments if (m := re.fullmatch(r": prefill (\d+)/100", ln))]
    assert len(progress) == len(comments) >= 3 and progress == sorted(progress) and progress[-1] > progress[0]
    assert all(ln.startswith(":") for ln in lines[:len(comments)])  # every comment before the first token
    tokens = [t for ln in lines if ln.startswith("data: {")
              for ch in json.loads(ln[6:])["choices"] for t in ch.get("token_ids", [])]
    assert tokens == slow_server.offline.generate(prompt, 5)
    assert lines[-1] == "data: [DONE]"


def _hang_up_after(c: http.client.HTTPConnection, port: int, metric: str, reaches: float, aborted: float) -> None:
    """Close connection ``c`` once ``metric`` reaches ``reaches``, then wait until the server has aborted one more
    request than ``aborted`` (30 s in all)."""
    deadline = time.monotonic() + 30
    while Http(port).metric(metric) < reaches:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    c.sock.shutdown(socket.SHUT_RDWR)
    c.close()
    while Http(port).metric('dayzero_requests_finished_total{reason="abort"}') == aborted:
        assert time.monotonic() < deadline, "the server never saw the disconnect"
        time.sleep(0.02)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_gone_during_its_prefill_is_aborted_and_its_blocks_freed(slow_server, stream):
    """The client closes its connection while its prompt is still prefilling (streaming: after the keepalive
    headers; non-streaming: while the handler waits): the request ends as aborted before its prefill would have
    ended, and its KV blocks and slot are back."""
    port = slow_server.port
    aborted = Http(port).metric('dayzero_requests_finished_total{reason="abort"}')
    base = Http(port).metric("dayzero_prefilled_tokens_total")
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("POST", "/v1/completions", json.dumps({"prompt": _prompt(120, 7), "max_tokens": 4,
                                                      "stream": stream}),
              {"Content-Type": "application/json"})  # 15 chunks: ~1.5 s of prefill
    if stream:
        r = c.getresponse()
        assert r.status == 200 and r.readline().startswith(b": prefill")
    _hang_up_after(c, port, "dayzero_prefilled_tokens_total", base + 16, aborted)
    assert Http(port).metric("dayzero_prefilled_tokens_total") - base < 120  # ended during its prefill
    assert Http(port).metric("dayzero_kv_blocks_used") == 0 and Http(port).metric("dayzero_requests_running") == 0
    assert slow_server.engine.kv_blocks()[0] == 0


def test_a_non_streaming_client_gone_while_decoding_is_aborted(slow_server):
    """A non-streaming client that closes its connection after its first tokens (decode made slow: 0.05 s a
    step) is aborted then, not after its max_tokens: its slot and blocks are back while it still had tokens to go."""
    port, engine = slow_server.port, slow_server.engine
    real = engine.rt.decode

    def slow(*a, **kw):
        time.sleep(0.05)
        return real(*a, **kw)
    engine.rt.decode = slow  # a lone request steps through rt.decode (engine._decode)
    aborted = Http(port).metric('dayzero_requests_finished_total{reason="abort"}')
    base = Http(port).metric("dayzero_generated_tokens_total")
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("POST", "/v1/completions", json.dumps({"prompt": [1, 2, 3], "max_tokens": 100, "ignore_eos": True}),
              {"Content-Type": "application/json"})  # 100 steps: ~5 s
    _hang_up_after(c, port, "dayzero_generated_tokens_total", base + 3, aborted)
    assert Http(port).metric("dayzero_generated_tokens_total") - base < 50  # ended well before its 100 tokens
    assert Http(port).metric("dayzero_kv_blocks_used") == 0 and Http(port).metric("dayzero_requests_running") == 0


def test_a_body_over_max_body_is_413_and_the_server_goes_on(slow_server):
    status, r = Http(slow_server.port).request("POST", "/v1/completions", {"prompt": [1] * 400_000, "max_tokens": 1})
    assert status == 413 and "--max-body of 1000000 bytes" in r["error"]["message"], r
    status, r = Http(slow_server.port).request("POST", "/v1/completions",
                         {"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0, "ignore_eos": True})
    assert status == 200 and r["choices"][0]["token_ids"] == slow_server.offline.generate([1, 2, 3], 2)


def test_a_large_body_is_parsed_off_the_event_loop(slow_server, monkeypatch):
    """While a large body is parsed (made slow: 2 s), /health still answers at once."""
    real = server_mod.parse_json

    def slow_parse(raw):
        time.sleep(2.0)
        return real(raw)
    monkeypatch.setattr(server_mod, "parse_json", slow_parse)
    got = {}
    body = {"prompt": [1] * 100_000, "max_tokens": 1}  # ~300 KB: over OFF_LOOP_BYTES, within max_body

    def post():
        got["r"] = Http(slow_server.port).request("POST", "/v1/completions", body)
    t = threading.Thread(target=post)
    t.start()
    time.sleep(0.5)  # the body is in and being parsed
    t0 = time.monotonic()
    assert Http(slow_server.port).request("GET", "/health", timeout=10)[0] == 200
    assert time.monotonic() - t0 < 1.0
    t.join(60)
    status, r = got["r"]
    assert status == 400 and "the artifact's --max-seq" in r["error"]["message"], r


@pytest.mark.parametrize("value, needle", [("0", "must be positive"), ("8X", "expected a number like")])
def test_serve_max_body_is_checked_on_the_command_line(tmp_path, value, needle):
    from click.testing import CliRunner

    from dayzero.tools.cli import main

    r = CliRunner().invoke(main, ["serve", str(tmp_path), "--port", "0", "--max-body", value])
    line = r.output.strip()
    assert r.exit_code == 2 and len(line.splitlines()) == 1 and "--max-body" in line and needle in line, line
    assert "--max-body" in CliRunner().invoke(main, ["serve", "--help"]).output


@pytest.mark.slow
def test_serve_long_measures_a_prompt_through_a_served_artifact(tiny_compiled, tmp_path):
    """tools/serve_long.py (the 1M-token run's driver) on tiny V4 at 100 tokens: the streamed tokens are offline
    generate's, with its figures (TTFT, prefill rate, RSS) and progress samples written, and its server stopped."""
    from click.testing import CliRunner

    from dayzero.tools.serve_long import main

    _, art, _ = tiny_compiled("deepseek_v4")
    out = tmp_path / "r.json"
    r = CliRunner().invoke(main, [str(art), "--tokens", "100", "--max-tokens", "4", "--prefill-chunk", "8",
                                  "--every", "0.2", "--out", str(out)])
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    import random

    rng = random.Random(0)
    prompt = [rng.randrange(256) for _ in range(100)]
    assert res["status"] == 200 and res["generated"] == load(art).generate(prompt, 4)
    assert res["ttft_s"] > 0 and res["prefill_tokens_per_s"] > 0 and res["rss_end"]["VmHWM"] > 0
    assert res["samples"] and res["short_during_status"] == 200
