"""`dayzero serve`: the engine (continuous batching) and the OpenAI-compatible server, against offline generation.

Servers run in-process on 127.0.0.1 on a free port (runtime/server.py ``start_in_thread``) over the shared tiny
artifacts (conftest ``tiny_compiled``: max_seq 128, 3 request slots), given a real tiny tokenizer
(tests/_tiny_tokenizer.py). Clients: the real ``openai`` package and raw HTTP (``http.client``). The reference for
every generated token is ``Runtime.generate`` of the same prompt on its own, in a second Runtime of the artifact.
"""

from __future__ import annotations

import http.client
import json
import queue
import subprocess
import sys
import threading
import time

import pytest
import torch

from dayzero import UserError
from dayzero.runtime import load
from dayzero.runtime.engine import Engine, QueueFull, Request, batched_decode
from dayzero.runtime.server import Server, start_in_thread, validate

from _http import Http
from _tiny_tokenizer import add_tiny_tokenizer

ARCHS = ["qwen3_moe", "deepseek_v4"]




class Served(Http):
    """A server over an artifact (given the tiny tokenizer) and a second Runtime of it for the reference."""

    def __init__(self, ckpt, art, **kw):
        add_tiny_tokenizer(art)
        self.ckpt, self.art = ckpt, art
        self.server = Server(art, model="tiny", **kw)
        self.http, port = start_in_thread(self.server)
        super().__init__(port)
        self.offline = load(art)  # the reference: its own arena, requests one at a time

    def close(self):
        self.http.should_exit = True
        self.server.close()

    def generate(self, ids, n, **kw) -> list[int]:
        return self.offline.generate(ids, n, stop_ids=self.offline.eos_ids, **kw)

    def client(self):
        import openai

        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module", params=ARCHS)
def served(request, tiny_compiled):
    ckpt, art, _ = tiny_compiled(request.param)
    s = Served(ckpt, art)
    yield s
    s.close()


def _prompt(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _tokens(choice) -> list[int]:
    return list(choice.model_extra["token_ids"])


# -- greedy output equals offline generation ------------------------------------------------------------------------

@pytest.mark.slow
def test_completions_equal_offline_generate(served):
    cl = served.client()
    prompt = _prompt(9, 1)
    r = cl.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
    ref = served.generate(prompt, 24)
    assert _tokens(r.choices[0]) == ref
    assert r.usage.prompt_tokens == 9 and r.usage.completion_tokens == len(ref)
    assert r.choices[0].finish_reason == ("stop" if len(ref) < 24 else "length")
    # streamed: the same tokens, one per chunk, then usage
    chunks = list(cl.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True))
    streamed = [t for c in chunks for ch in c.choices for t in (ch.model_extra.get("token_ids") or [])]
    assert streamed == ref
    assert chunks[-1].usage.completion_tokens == len(ref)
    assert "".join(ch.text for c in chunks for ch in c.choices) == r.choices[0].text


@pytest.mark.slow
def test_text_and_chat_equal_offline_generate(served):
    from dayzero.runtime.text import encode_chat, encode_prompt

    tok = served.offline.tokenizer
    cl = served.client()
    r = cl.completions.create(model="tiny", prompt="the quick brown fox", max_tokens=16, temperature=0)
    ids = encode_prompt(tok, "the quick brown fox")
    ref = served.generate(ids, 16)
    assert _tokens(r.choices[0]) == ref
    assert r.choices[0].text == tok.decode(ref, skip_special_tokens=True)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    ref = served.generate(encode_chat(tok, messages), 16)
    r = cl.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
    assert _tokens(r.choices[0]) == ref
    assert r.choices[0].message.content == tok.decode(ref, skip_special_tokens=True)
    chunks = list(cl.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0,
                                             stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert [t for c in chunks for ch in c.choices for t in (ch.model_extra.get("token_ids") or [])] == ref


@pytest.mark.slow
def test_raw_sse_stream_ends_with_done_and_usage(served):
    c = http.client.HTTPConnection("127.0.0.1", served.port, timeout=120)
    c.request("POST", "/v1/completions", json.dumps({"prompt": [5, 6, 7], "max_tokens": 5, "temperature": 0,
                                                     "stream": True}), {"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200 and r.getheader("content-type").startswith("text/event-stream")
    events = [e for e in r.read().decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    usage = json.loads(events[-2].removeprefix("data: "))["usage"]
    assert usage["prompt_tokens"] == 3 and usage["total_tokens"] == 3 + usage["completion_tokens"]
    ref = served.generate([5, 6, 7], 5)
    assert usage["completion_tokens"] == len(ref)


@pytest.mark.slow
def test_sampled_output_is_seeded_like_offline(served):
    prompt = _prompt(7, 3)
    status, r = served.request("POST", "/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0.8,
                                                           "top_p": 0.9, "seed": 5})
    assert status == 200
    assert r["choices"][0]["token_ids"] == served.generate(prompt, 12, temperature=0.8, top_p=0.9, seed=5)


@pytest.mark.slow
def test_sixteen_concurrent_requests_each_get_what_they_get_alone(served):
    cl = served.client()
    cases = [(_prompt(2 + 5 * k, 100 + k), 4 + (k * 7) % 20) for k in range(16)]
    out: dict[int, object] = {}

    def run(k, prompt, n):
        try:
            out[k] = _tokens(cl.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0)
                             .choices[0])
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            out[k] = e
    threads = [threading.Thread(target=run, args=(k, p, n)) for k, (p, n) in enumerate(cases)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    for k, (prompt, n) in enumerate(cases):
        assert out[k] == served.generate(prompt, n), f"request {k}"
    assert served.metric("dayzero_kv_blocks_used") == 0 and served.metric("dayzero_requests_running") == 0


# -- aborts and bad input -------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_disconnect_mid_stream_frees_its_blocks(served):
    aborted = served.metric('dayzero_requests_finished_total{reason="abort"}')
    c = http.client.HTTPConnection("127.0.0.1", served.port, timeout=120)
    budget = served.offline.max_length
    c.request("POST", "/v1/completions", json.dumps({"prompt": [3, 1, 4, 1, 5], "max_tokens": budget - 5,
                                                     "temperature": 0, "ignore_eos": True, "stream": True}),
              {"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200
    assert r.readline().startswith(b"data: ")  # the first token arrived
    c.sock.shutdown(2)
    c.close()
    deadline = time.monotonic() + 60
    while served.metric('dayzero_requests_finished_total{reason="abort"}') == aborted:
        assert time.monotonic() < deadline, "the server never saw the disconnect"
        time.sleep(0.05)
    assert served.metric("dayzero_kv_blocks_used") == 0
    assert served.metric("dayzero_requests_running") == 0


BAD = [
    ("/v1/completions", '{"prompt": [1, 2,', "not valid JSON"),
    ("/v1/completions", {"model": "gpt-4", "prompt": [1]}, "unknown model"),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 127}, "length budget"),
    ("/v1/completions", {"prompt": [1, 256]}, "outside the vocabulary"),
    ("/v1/completions", {"prompt": [1, -1]}, "outside the vocabulary"),
    ("/v1/completions", {"prompt": [1], "temperature": -0.5}, "temperature"),
    ("/v1/completions", {"prompt": [1], "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": [1], "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": [1], "n": 2}, "n=2"),
    ("/v1/completions", {"prompt": []}, "empty"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]}, "text only"),
    ("/v1/chat/completions", {"messages": "hello"}, "messages"),
]


@pytest.mark.slow
def test_bad_requests_get_400_while_a_good_one_completes(served):
    prompt = _prompt(11, 9)
    good = {}

    def run():
        good["r"] = served.request("POST", "/v1/completions", {"prompt": prompt, "max_tokens": 40, "temperature": 0})
    t = threading.Thread(target=run)
    t.start()
    for path, body, words in BAD:
        status, r = served.request("POST", path, body)
        assert status == 400, (body, r)
        assert set(r["error"]) >= {"message", "type", "param", "code"} and words in r["error"]["message"], r
    t.join(600)
    status, r = good["r"]
    assert status == 200 and r["choices"][0]["token_ids"] == served.generate(prompt, 40)
    assert served.request("GET", "/health") == (200, {"status": "ok"})


@pytest.mark.slow
def test_a_prompt_longer_than_the_chunk_is_served_within_the_length_budget(served):
    """A prompt of most of --max-seq is prefilled over several engine iterations (64 tokens each: on V4 across its
    compressor windows and sliding window) and completes as offline generate does; one token past the artifact's
    length budget (its --max-seq) is one 400 that names the budget."""
    n = served.offline.max_length
    prompt = _prompt(n - 20, 21)
    status, r = served.request("POST", "/v1/completions", {"prompt": prompt, "max_tokens": 20, "temperature": 0})
    assert status == 200 and r["choices"][0]["token_ids"] == served.generate(prompt, 20), r
    assert r["usage"]["prompt_tokens"] == n - 20
    status, r = served.request("POST", "/v1/completions", {"prompt": prompt, "max_tokens": 21, "temperature": 0})
    assert status == 400 and f"exceeds the length budget of {n} tokens" in r["error"]["message"], r


@pytest.mark.slow
def test_stop_strings_and_stop_ids(served):
    prompt = _prompt(6, 4)
    ref = served.generate(prompt, 20)
    status, r = served.request("POST", "/v1/completions", {"prompt": prompt, "max_tokens": 20, "temperature": 0,
                                                           "stop_token_ids": [ref[4]]})
    assert r["choices"][0]["token_ids"] == ref[:ref.index(ref[4]) + 1]
    assert r["choices"][0]["finish_reason"] == "stop"
    tok = served.offline.tokenizer
    full = tok.decode(ref, skip_special_tokens=True)
    stop = full[len(full) // 2:len(full) // 2 + 2]
    for stream in (False, True):
        body = {"prompt": prompt, "max_tokens": 20, "temperature": 0, "stop": [stop], "stream": stream}
        if stream:
            chunks = list(served.client().completions.create(model="tiny", **body))
            text = "".join(ch.text for c in chunks for ch in c.choices)
            reason = [ch.finish_reason for c in chunks for ch in c.choices][-1]
        else:
            status, r = served.request("POST", "/v1/completions", body)
            text, reason = r["choices"][0]["text"], r["choices"][0]["finish_reason"]
        assert text == full[:full.index(stop)] and reason == "stop"


def test_models_lists_the_served_model(served):
    status, r = served.request("GET", "/v1/models")
    assert status == 200 and [m["id"] for m in r["data"]] == ["tiny"]
    assert [m.id for m in served.client().models.list().data] == ["tiny"]


# -- the engine on its own ------------------------------------------------------------------------------------------

def _collect(q: queue.Queue):
    toks = []
    while True:
        ev = q.get(timeout=300)
        if ev.kind != "token":
            return toks, ev
        toks.append(ev.token)


@pytest.mark.slow
def test_prompt_lengths_seen_before_make_no_views(tiny_compiled, monkeypatch):
    """A server's prompts take many lengths (one prefill binding each) in every slot: the views of every length
    seen are kept, so 24 lengths x 3 slots (more than the 64 argument lists kept per (length, slot)) prefilled
    again make no view but the slots' own states'. Tiny DeepSeek-V4's prompts, cycling through more lengths than
    a 16-entry cache held, rebuilt ~1700 views (0.4 s) on every prefill."""
    from dayzero.runtime.executor import _Program

    _, art, _ = tiny_compiled("qwen3_moe")
    rt = load(art)
    lengths = range(1, 25)
    assert rt.prefill_chunk >= len(lengths) and rt.max_batch >= 3
    for n in lengths:
        for slot in range(3):
            rt.prefill(_prompt(n, n), slot=slot)
    made = []
    view = _Program.view
    monkeypatch.setattr(_Program, "view", lambda self, bid, *a, **k: made.append(bid) or view(self, bid, *a, **k))
    for n in lengths:
        for slot in range(3):
            rt.prefill(_prompt(n, n), slot=slot)
    assert [b for b in made if b not in rt.programs["prefill"]._in_state] == []


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_equals_one_prefill(tiny_compiled, arch):
    """A 70-token prompt prefilled 16 tokens per iteration while two short requests decode beside it."""
    _, art, _ = tiny_compiled(arch)
    rt, ref = load(art), load(art)
    eng = Engine(rt, prefill_chunk=16).start()
    try:
        prompts = [_prompt(70, 1), _prompt(5, 2), _prompt(9, 3)]
        qs = [queue.Queue() for _ in prompts]
        for p, q in zip(prompts, qs):
            eng.submit(Request(p, q.put, max_tokens=12))
        for p, q in zip(prompts, qs):
            toks, ev = _collect(q)
            assert ev.kind == "done" and toks == ref.generate(p, 12, stop_ids=ref.eos_ids)
    finally:
        eng.stop()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v4"])
def test_running_requests_step_in_one_batched_decode(tiny_compiled, arch):
    """With a batched decode program, one engine iteration is one ``decode_batch`` call over every running request
    (DeepSeek-V4: its row program, the requests' states gathered in and scattered back)."""
    _, art, _ = tiny_compiled(arch)
    rt, ref = load(art), load(art)
    if batched_decode(rt) is None:
        pytest.skip("this artifact has no batched decode program")
    sizes = []
    real = rt.decode_batch

    def counted(tokens, slots):
        sizes.append(len(slots))
        return real(tokens, slots)
    rt.decode_batch = counted
    eng = Engine(rt)
    prompts = [_prompt(n, n) for n in (3, 12, 21)]
    qs = [queue.Queue() for _ in prompts]
    for p, q in zip(prompts, qs):
        eng.submit(Request(p, q.put, max_tokens=10))
    eng._drain(block=False)
    while eng.active or eng.waiting:
        eng.step()
    for p, q in zip(prompts, qs):
        toks, ev = _collect(q)
        assert ev.kind == "done" and toks == ref.generate(p, 10, stop_ids=ref.eos_ids)
    assert max(sizes) == len(prompts) and eng.decode_steps == len(sizes)
    batched_steps = len(sizes)
    q = queue.Queue()  # a lone request takes the decode program
    eng.submit(Request(prompts[1], q.put, max_tokens=4))
    eng._drain(block=False)
    while eng.active or eng.waiting:
        eng.step()
    toks, ev = _collect(q)
    assert ev.kind == "done" and toks == ref.generate(prompts[1], 4, stop_ids=ref.eos_ids)
    assert len(sizes) == batched_steps and eng.decode_steps > batched_steps


def test_outbox_wakes_the_event_loop_once_per_iteration():
    """The engine's events reach the request handlers a whole iteration at a time: emitting only queues, the
    iteration's flush wakes the loop once for every stream, and no second wake-up goes out while the loop has not
    run the first (each one is a GIL hand-over between the engine thread and the loop)."""
    import asyncio

    from dayzero.runtime.engine import Event
    from dayzero.runtime.server import Outbox, Stream

    async def main():
        loop = asyncio.get_running_loop()
        wakes = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *args: wakes.append(args) or real(*args)
        box = Outbox()
        a, b = Stream(loop), Stream(loop)
        emit_a, emit_b = box.emitter(a), box.emitter(b)
        box.flush()
        assert wakes == []  # nothing emitted: nothing to wake for
        for k in range(3):
            emit_a(Event("token", token=k))
        emit_b(Event("token", token=7))
        box.flush()
        emit_a(Event("done", finish_reason="length"))
        box.flush()  # the loop has not run the first wake-up yet: it takes this iteration's events too
        assert len(wakes) == 1
        got = await a.next()
        assert [e.kind for e in got] == ["token"] * 3 + ["done"] and [e.token for e in got[:3]] == [0, 1, 2]
        assert [e.token for e in await b.next()] == [7]
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(b.next(), 0.05)  # drained: it waits for the next iteration
        emit_b(Event("token", token=8))
        box.flush()
        assert len(wakes) == 2 and [e.token for e in await b.next()] == [8]

    asyncio.run(main())


def test_engine_hands_on_each_iteration_after_its_events(tiny_compiled):
    _, art, _ = tiny_compiled("qwen3_moe")
    seen = []
    eng = Engine(load(art), on_iteration=lambda: seen.append(len(events)))
    events = []
    eng.submit(Request([1, 2, 3], events.append, max_tokens=3))
    eng._drain(block=False)
    while eng.active or eng.waiting:
        eng.step()
    assert [e.kind for e in events] == ["token"] * 3 + ["done"]
    assert seen == [1, 2, 4] and eng.iterations == 3  # called once per iteration, after what it emitted


def test_engine_queue_bound_timeout_and_budget(tiny_compiled):
    _, art, _ = tiny_compiled("qwen3_moe")
    rt = load(art)
    eng = Engine(rt, max_queue=2)  # not started: nothing leaves the queue
    eng.submit(Request([1, 2], lambda ev: None, max_tokens=4))
    eng.submit(Request([1, 2], lambda ev: None, max_tokens=4))
    with pytest.raises(QueueFull, match="queue is full"):
        eng.submit(Request([1, 2], lambda ev: None, max_tokens=4))
    with pytest.raises(UserError, match="length budget"):
        Engine(rt).submit(Request([1, 2], lambda ev: None, max_tokens=rt.max_length - 1))
    eng = Engine(rt).start()
    try:
        q = queue.Queue()
        eng.submit(Request([1, 2, 3], q.put, max_tokens=100, timeout=0.0))
        toks, ev = _collect(q)
        assert ev.kind == "error" and ev.status == 408 and "timed out" in ev.error
        q = queue.Queue()
        req = eng.submit(Request([1, 2, 3], q.put, max_tokens=120))
        eng.abort(req)
        toks, ev = _collect(q)
        assert ev.kind == "done" and ev.finish_reason == "abort" and len(toks) < 120
        deadline = time.monotonic() + 30
        while eng.running or eng.kv_blocks()[0]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        eng.stop()


def test_request_slots_share_the_prepared_views(tiny_compiled):
    """A request's first call in another slot builds only that slot's state views; every other view (weights,
    activations, paged pools) is shared with the slots before it (a miss cost ~0.5 s per slot on tiny V4)."""
    _, art, _ = tiny_compiled("deepseek_v4")
    rt = load(art)
    checked_state = 0
    for prog in rt.programs.values():
        env = tuple(prog.symbols[s][0] for s in prog._order)
        calls0, calls1 = prog._cache(env, 0)[0], prog._cache(env, 1)[0]
        for (_, args, _, _, _), (_, a0), (_, a1) in zip(prog.steps, calls0, calls1):
            for bid, v0, v1 in zip(args, a0, a1):
                if bid in prog._in_state:
                    assert v1.data_ptr() - v0.data_ptr() == prog.state_stride
                    checked_state += 1
                else:
                    assert v1 is v0
    assert checked_state  # DeepSeek-V4 keeps per-request states outside the paged pools


def test_a_program_without_request_state_prepares_one_argument_list_for_every_slot(tiny_compiled):
    """Qwen3-MoE's prefill keeps nothing per request (its caches are paged): a prompt length prefilled in several
    slots reuses one prepared argument list, so a 16-slot server's prompt lengths do not overflow the lists kept
    and rebuild them (every view converted to a TVM tensor again) on later prefills."""
    _, art, _ = tiny_compiled("qwen3_moe")
    rt = load(art)
    prog = rt.programs["prefill"]
    assert not prog._in_state and rt.max_batch >= 3
    prog._prepared.cache_clear()
    for slot in range(3):
        rt.prefill(_prompt(7, 1), slot=slot)
    info = prog._prepared.cache_info()
    assert info.misses == 1 and info.hits == 2, info


def test_serve_cli_help_and_a_missing_artifact(tmp_path):
    from click.testing import CliRunner

    from dayzero.tools.cli import main

    r = CliRunner().invoke(main, ["serve", "--help"])
    assert r.exit_code == 0 and "--validate" in r.output
    r = CliRunner().invoke(main, ["bench", "serve", "--help"])
    assert r.exit_code == 0 and "--concurrency" in r.output
    r = CliRunner().invoke(main, ["serve", str(tmp_path / "nothing"), "--port", "0"])
    assert r.exit_code == 2 and "not a dayzero artifact" in r.output and "Traceback" not in r.output


@pytest.mark.slow
def test_ctrl_c_stops_the_server_with_interrupted_and_exit_130(tiny_compiled):
    """SIGINT (Ctrl-C) to ``dayzero serve``: uvicorn shuts down gracefully, then the CLI says "interrupted" and exits
    130 every time (uvicorn re-raises the signal, and whether asyncio's own handler turned that into an exception
    depended on timing: a loaded 2-rank run exited 0)."""
    import signal

    from _http import free_port, wait_until_healthy

    _, art, _ = tiny_compiled("qwen3_moe")
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "dayzero", "serve", str(art), "--port", str(port)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_healthy([p], port, timeout_s=120)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
        assert p.returncode == 130 and err.strip().splitlines()[-1] == "interrupted", err[-2000:]
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()


# -- startup -------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_health_is_503_until_the_probe_passed_and_a_full_queue_is_429(tiny_compiled, monkeypatch):
    from dayzero.runtime import server as server_mod

    _, art, _ = tiny_compiled("qwen3_moe")
    add_tiny_tokenizer(art)
    gate = threading.Event()
    real_probe = server_mod.run_probe

    def gated_probe(engine, rt):
        gate.wait(120)
        return real_probe(engine, rt)
    monkeypatch.setattr(server_mod, "run_probe", gated_probe)
    srv = Server(art, model="tiny", max_queue=1)
    http_srv, port = start_in_thread(srv, load=False)
    s = Http(port)
    try:
        loader = threading.Thread(target=srv.load)
        loader.start()
        time.sleep(0.5)
        assert s.request("GET", "/health") == (503, {"status": "loading"})
        status, r = s.request("POST", "/v1/completions", {"prompt": [1, 2], "max_tokens": 2})
        assert status == 503 and "probe" in r["error"]["message"]
        gate.set()
        loader.join(300)
        assert s.request("GET", "/health") == (200, {"status": "ok"})
        assert srv.probe_result["text"]["tokens"]
        # a full queue: with the engine stopped the first request waits, the second is refused
        srv.engine.stop()
        def wait_in_queue():  # never answered while the engine is stopped: its client gives up
            with pytest.raises(TimeoutError):
                s.request("POST", "/v1/completions", {"prompt": [1], "max_tokens": 2}, timeout=3)
        waiting = threading.Thread(target=wait_in_queue)
        waiting.start()
        time.sleep(0.5)
        status, r = s.request("POST", "/v1/completions", {"prompt": [1], "max_tokens": 2})
        assert status == 429 and "queue is full" in r["error"]["message"]
        waiting.join(30)
    finally:
        http_srv.should_exit = True
        srv.close()


@pytest.mark.slow
def test_validate_accepts_the_checkpoint_and_refuses_another(tiny_compiled, tmp_path):
    from dayzero.tools.make_tiny import make_tiny

    ckpt, art, _ = tiny_compiled("qwen3_moe")
    rt = load(art)
    res = validate(rt, ckpt)
    assert res["prefill_max_abs_diff"] <= res["atol"] and res["decode_max_abs_diff"] <= res["atol"]
    other = make_tiny("qwen3_moe", tmp_path / "other", seed=1)
    with pytest.raises(UserError, match="differ from upstream"):
        validate(rt, other)
    # the CLI refuses to start: one line, exit 2
    p = subprocess.run([sys.executable, "-m", "dayzero.tools.cli", "serve", str(art), "--port", "0",
                        "--validate", str(other)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 2, p.stderr
    err = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "refusing to serve" in err[0] and "Traceback" not in p.stderr


# -- images (multimodal artifacts) ---------------------------------------------------------------------------------

def _png_data_uri(w: int = 64, h: int = 64) -> tuple[str, object]:
    import base64
    import io

    import numpy as np
    from PIL import Image

    a = (np.indices((h, w)).sum(0) * 5 % 256).astype(np.uint8)
    img = Image.fromarray(np.stack([a, a[::-1], 255 - a], -1))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode(), img


@pytest.mark.slow
def test_chat_with_an_image_equals_offline_generate(tiny_compiled):
    """Tiny Qwen3-VL-MoE: the image joins the chat at its place in the template; tokens as rt.generate with it."""
    ckpt, art, _ = tiny_compiled("qwen3_vl_moe")
    s = Served(ckpt, art)
    try:
        assert set(s.server.probe_result) == {"text", "image"}  # the startup probe took the image path
        uri, img = _png_data_uri()
        tok = s.offline.tokenizer
        image_id = s.offline.multimodal.image_token_id
        # the prompt as the model's own chat template renders it (transformers' apply_chat_template), the image
        # part at its place: one image token, which the runtime expands
        text = tok.apply_chat_template([{"role": "user", "content": [
            {"type": "text", "text": "what is "}, {"type": "image"}, {"type": "text", "text": " this"}]}],
            tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids.count(image_id) == 1
        ref = s.generate(ids, 12, images=[img])
        r = s.client().chat.completions.create(model="tiny", max_tokens=12, temperature=0, messages=[
            {"role": "user", "content": [{"type": "text", "text": "what is "},
                                         {"type": "image_url", "image_url": {"url": uri}},
                                         {"type": "text", "text": " this"}]}])
        assert _tokens(r.choices[0]) == ref
        bad = {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]}
        status, err = s.request("POST", "/v1/chat/completions", bad)
        assert status == 400 and "unreadable image" in err["error"]["message"]
        status, err = s.request("POST", "/v1/completions", {"prompt": [5, image_id, 7], "max_tokens": 2})
        assert status == 400 and "no image was given" in err["error"]["message"]
    finally:
        s.close()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt_oss", "deepseek_v3", "deepseek_v32"])
def test_other_architectures_answer_the_openai_client(tiny_compiled, arch):
    ckpt, art, _ = tiny_compiled(arch)
    s = Served(ckpt, art)
    try:
        prompts = [_prompt(n, n) for n in (4, 13, 30)]
        out = {}

        def run(k):
            out[k] = _tokens(s.client().completions.create(model="tiny", prompt=prompts[k], max_tokens=10,
                                                           temperature=0).choices[0])
        threads = [threading.Thread(target=run, args=(k,)) for k in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        assert [out.get(k) for k in range(len(prompts))] == [s.generate(p, 10) for p in prompts]
    finally:
        s.close()
