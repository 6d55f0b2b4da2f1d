"""The OpenAI-compatible HTTP server: a thin FastAPI layer over the engine (runtime/engine.py).

    POST /v1/completions        prompt: text or token ids; ``stream: true`` -> server-sent events, ``data: [DONE]``
    POST /v1/chat/completions   messages through the artifact's chat template; ``image_url`` parts (a ``data:`` URI
                                or a file path) on a multimodal artifact
    GET  /v1/models             the one model served
    GET  /health                503 until the artifact is loaded and the startup probe passed, then 200
    GET  /metrics               Prometheus: running / waiting requests, KV blocks in use, generated tokens, TTFT and
                                inter-token latency histograms

Startup (``Server.load``, in a thread while HTTP already answers /health): load the artifact; with
``validate=CHECKPOINT`` compare the probe's prefill and decode logits with the upstream model run eagerly (refuse
to start outside tolerance); start the engine; run the probe through the engine (prefill, decode and, on a
multimodal artifact, an image); then ready. A bad request gets OpenAI's error JSON with status 400 and the server
keeps serving the others; a full queue is 429; a body over ``max_body`` bytes is 413. Responses carry the
generated ``token_ids`` beside the text (as vLLM's ``return_token_ids`` does), which clients without a tokenizer
need.

Long prompts (a 1M-token prompt is ~7 MB of JSON and an hour of prefill here): a large body is parsed and its
prompt checked in a worker thread, not on the event loop; until a request's first token (a non-streaming one: until
its last), the handler watches its client (one that went away is aborted: its slot and blocks are back within an
engine iteration; a streaming one's is seen at its next write), and a streaming
request whose first token takes longer than ``keepalive`` seconds gets its response headers then and an SSE
comment line every ``keepalive`` seconds (``: prefill N/M``), so clients and proxies see a live connection.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import signal
import threading
import time
import uuid
from collections import deque
from pathlib import Path

import torch
import uvicorn
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from dayzero import UserError

from .engine import Engine, EngineMetrics, Event, QueueFull, Request

log = logging.getLogger("dayzero.serve")

PROBE_TOKENS = 16
VALIDATE_ATOL = 1e-3  # fp32 kernels against fp32 eager; the prefill comparisons of tools/compare.py hold 1e-4
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
MAX_BODY = 64_000_000  # bytes (--max-body 64M): a 1M-token prompt is ~7 MB of JSON as token ids
OFF_LOOP_BYTES = 256 * 2**10  # bodies above this are parsed (and their prompts checked) in a worker thread
KEEPALIVE_S = 15.0  # an SSE comment this often while a streaming request's prefill runs
WATCH_S = 0.2  # how often a request waiting for events (a streaming one: its first) checks its client is there


class Stream:
    """One request's events, from the engine thread to the request's handler on the event loop."""

    __slots__ = ("loop", "events", "ready")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.events, self.ready = loop, deque(), asyncio.Event()

    async def next(self) -> list[Event]:
        """Every event that arrived since the last call (at least one): one or more engine iterations'."""
        while not self.events:
            self.ready.clear()
            await self.ready.wait()
        return [self.events.popleft() for _ in range(len(self.events))]


class Outbox:
    """Hands the engine's events to the event loop once per engine iteration, not once per token.

    ``emit`` (engine thread) only queues the event; ``flush`` (the engine's ``on_iteration``) wakes the loop once
    for every request that got events: one self-pipe write per iteration at most, none while the loop has not
    yet run the last one. Each wake-up is a point where the two threads hand the GIL over (a thread waiting for
    it gets it after ``sys.getswitchinterval()``, 5 ms, unless the holder blocks first), so waking the loop per
    token made the engine's 0.2-0.4 ms iterations take 3 ms on
    average with 8 streams (tiny Qwen3-MoE). The engine does not wait for the loop: while the loop is behind,
    a stream's wake-up carries several iterations' tokens, in one socket write."""

    def __init__(self):
        self._lock = threading.Lock()
        self._dirty: dict = {}  # event loop -> streams with events it has not been woken for
        self._woken: set = set()  # loops woken and not yet run _deliver: no second self-pipe write

    def emitter(self, stream: Stream):
        def emit(ev: Event) -> None:
            stream.events.append(ev)
            with self._lock:
                self._dirty.setdefault(stream.loop, set()).add(stream)
        return emit

    def flush(self) -> None:
        with self._lock:
            wake = [loop for loop in self._dirty if loop not in self._woken]
            self._woken.update(wake)
        for loop in wake:
            try:
                loop.call_soon_threadsafe(self._deliver, loop)
            except RuntimeError:  # the loop is closed (the server is shutting down): nobody reads these
                with self._lock:
                    self._dirty.pop(loop, None)
                    self._woken.discard(loop)

    def _deliver(self, loop) -> None:
        with self._lock:
            streams = self._dirty.pop(loop, ())
            self._woken.discard(loop)
        for st in streams:
            st.ready.set()


class BadRequest(UserError):
    """A request the server refuses (HTTP ``status``, OpenAI error ``code``)."""

    def __init__(self, message: str, status: int = 400, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


class PrometheusMetrics(EngineMetrics):
    """The engine's figures as Prometheus metrics, in the server's own registry."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.running = Gauge("dayzero_requests_running", "requests holding a slot (prefill or decode)", registry=r)
        self.waiting = Gauge("dayzero_requests_waiting", "requests queued for a slot", registry=r)
        self.kv_used = Gauge("dayzero_kv_blocks_used", "KV-cache blocks held by requests", registry=r)
        self.kv_total = Gauge("dayzero_kv_blocks_total", "KV-cache blocks in the pools", registry=r)
        self.tokens = Counter("dayzero_generated_tokens", "tokens generated", registry=r)
        self.prefilled_tokens = Counter("dayzero_prefilled_tokens", "prompt tokens prefilled", registry=r)
        self.requests = Counter("dayzero_requests_finished", "requests ended, by reason", ["reason"], registry=r)
        self.ttft = Histogram("dayzero_time_to_first_token_seconds", "submission to first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("dayzero_inter_token_latency_seconds", "between consecutive tokens of a request",
                             buckets=ITL_BUCKETS, registry=r)

    def iteration(self, running, waiting, kv_used, kv_total):
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_used.set(kv_used)
        self.kv_total.set(kv_total)

    def token(self, req, now):
        self.tokens.inc()
        if req.first_token_at is None:
            self.ttft.observe(now - req.submitted)
        else:
            self.itl.observe(now - req.last_token_at)

    def prefilled(self, req, tokens):
        self.prefilled_tokens.inc(tokens)

    def finished(self, req, reason):
        self.requests.labels(reason).inc()


# -- request parsing ----------------------------------------------------------------------------------------------

def _number(body: dict, key: str, default, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadRequest(f"{key} must be a number, got {json.dumps(v)}", param=key)
    if not (lo < v if lo_open else lo <= v) or v > hi:
        raise BadRequest(f"{key} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v}", param=key)
    return float(v)


def _int(body: dict, key: str, default):
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"{key} must be an integer, got {json.dumps(v)}", param=key)
    return v


def sampling(body: dict, prompt_tokens: int, budget: int, chat: bool) -> dict:
    """The request's sampling settings, checked: a bad value is a 400 naming the field."""
    for key, ok in (("n", lambda v: v in (None, 1)), ("best_of", lambda v: v in (None, 1)),
                    ("logprobs", lambda v: v in (None, False)), ("echo", lambda v: v in (None, False)),
                    ("top_logprobs", lambda v: v is None)):
        if not ok(body.get(key)):
            raise BadRequest(f"{key}={json.dumps(body.get(key))} is not supported (one choice, no logprobs)",
                             param=key)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)  # OpenAI's default
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    seed = _int(body, "seed", 0)
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, key, None)
    if max_tokens is not None and max_tokens < 1:
        raise BadRequest(f"{key} must be at least 1, got {max_tokens}", param=key)
    if max_tokens is None:
        max_tokens = budget - prompt_tokens
        if max_tokens < 1:
            raise BadRequest(f"the prompt ({prompt_tokens} tokens) fills the length budget of {budget} tokens "
                             "(the artifact's --max-seq)",
                             param="messages" if chat else "prompt")
    elif prompt_tokens + max_tokens > budget:
        raise BadRequest(f"prompt ({prompt_tokens} tokens) + {key} ({max_tokens}) exceeds the length budget of "
                         f"{budget} tokens (the artifact's --max-seq)", param=key)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop must be a non-empty string or a list of them", param="stop")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise BadRequest("stop_token_ids must be a list of integers", param="stop_token_ids")
    if not isinstance(body.get("ignore_eos", False), bool):
        raise BadRequest("ignore_eos must be true or false", param="ignore_eos")
    return {"temperature": temperature, "top_p": top_p, "seed": seed, "max_tokens": max_tokens,
            "stop": tuple(stop), "stop_ids": tuple(stop_ids), "ignore_eos": bool(body.get("ignore_eos", False))}


def load_image_url(url: str):
    """An ``image_url`` (``data:image/...;base64,`` or a file path / ``file://`` URL) -> a PIL image."""
    from PIL import Image, UnidentifiedImageError

    if url.startswith("data:"):
        head, _, data = url.partition(",")
        if not head.endswith(";base64"):
            raise BadRequest("an image data: URI must be base64 (data:image/png;base64,...)", param="image_url")
        try:
            with Image.open(io.BytesIO(base64.b64decode(data, validate=True))) as im:
                im.load()
                return im.copy()
        except (ValueError, OSError, UnidentifiedImageError, Image.DecompressionBombError) as e:
            raise BadRequest(f"unreadable image in the data: URI ({type(e).__name__})", param="image_url") from None
    if url.startswith(("http://", "https://")):
        raise BadRequest("image URLs are not fetched: send a data: URI or a file path", param="image_url")
    from .multimodal import Multimodal

    try:
        return Multimodal.load_image(url.removeprefix("file://"))
    except UserError as e:
        raise BadRequest(str(e), param="image_url") from None


IMAGE_MARK = "\ue000image\ue000"  # a private-use marker where an image joins the templated text


def chat_prompt(rt, messages) -> tuple[list[int], list]:
    """Chat messages -> (prompt ids through the chat template, images in order). An image is one image token
    (the multimodal runtime expands it): rendered by the model's own template when it knows image parts, else the
    templated text is split at each image and the pieces tokenized around the image token."""
    from .text import encode_chat

    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", param="messages")
    tok = rt.tokenizer
    if tok is None:
        raise BadRequest("the artifact has no tokenizer: send token ids to /v1/completions", param="messages")
    flat, structured, images = [], [], []
    mm = rt.multimodal
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest("each message must be an object with a role", param="messages")
        content = m.get("content")
        if content is None or isinstance(content, str):
            flat.append({"role": m["role"], "content": content or ""})
            structured.append(flat[-1])
            continue
        if not isinstance(content, list):
            raise BadRequest("message content must be a string or a list of parts", param="messages")
        text, parts = "", []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                text += part["text"]
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image_url":
                if mm is None:
                    raise BadRequest("this artifact takes text only (no vision program): remove the image",
                                     param="messages")
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str):
                    raise BadRequest("image_url needs a url", param="messages")
                images.append(load_image_url(url))
                text += IMAGE_MARK
                parts.append({"type": "image"})
            else:
                raise BadRequest(f"unsupported content part {json.dumps(part)[:80]}", param="messages")
        flat.append({"role": m["role"], "content": text})
        structured.append({"role": m["role"], "content": parts})
    try:
        ids = encode_chat(tok, flat)
    except UserError as e:
        raise BadRequest(str(e), param="messages") from None
    if not images:
        return ids, images
    try:
        own = encode_chat(tok, structured)
        if own.count(mm.image_token_id) == len(images):
            return own, images
    except UserError:
        pass  # a template that does not render image parts
    text = tok.apply_chat_template(flat, tokenize=False, add_generation_prompt=True)
    ids = []
    for k, piece in enumerate(text.split(IMAGE_MARK)):
        ids += ([mm.image_token_id] if k else []) + list(tok(piece, add_special_tokens=False)["input_ids"])
    return ids, images


def completion_prompt(rt, prompt, vocab: int) -> list[int]:
    from .text import encode_prompt

    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if rt.tokenizer is None:
            raise BadRequest("the artifact has no tokenizer: send the prompt as token ids", param="prompt")
        ids = encode_prompt(rt.tokenizer, prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
    else:
        raise BadRequest("prompt must be a string or a list of token ids (one prompt per request)", param="prompt")
    if not ids:
        raise BadRequest("the prompt is empty", param="prompt")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise BadRequest(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="prompt")
    return ids


# -- the server ---------------------------------------------------------------------------------------------------

class _Watch:
    """A request's client, looked at every ``WATCH_S`` while its handler waits for the request's events (also when
    events keep coming, as a decoding request's do): a client that went away has its request aborted (its slot and
    blocks go back within an iteration)."""

    def __init__(self, request, engine, req: Request):
        self.request, self.engine, self.req = request, engine, req
        self.loop = asyncio.get_running_loop()
        self.due = self.loop.time() + WATCH_S

    async def events(self, events: Stream, wait: float | None = None) -> list[Event] | None:
        """The request's next events; [] when none came within ``wait`` seconds (None: no limit); None when the
        client disconnected first (the request is aborted)."""
        deadline = None if wait is None else self.loop.time() + wait
        while True:
            now = self.loop.time()
            if now >= self.due:
                self.due = now + WATCH_S
                if await self.request.is_disconnected():
                    self.engine.abort(self.req)
                    return None
            if deadline is not None and now >= deadline:
                return []
            step = self.due - now if deadline is None else min(self.due, deadline) - now
            try:
                return await asyncio.wait_for(events.next(), step)
            except TimeoutError:
                pass


class Server:
    """An artifact served over HTTP: ``app`` (FastAPI); ``load()`` readies it (the CLI runs it in a thread)."""

    def __init__(self, artifact, model: str | None = None, max_queue: int = 64, prefill_chunk: int | None = None,
                 timeout: float | None = None, validate=None, load_progress=None, open_runtime=None,
                 max_body: int = MAX_BODY, keepalive: float = KEEPALIVE_S):
        self.artifact = Path(artifact)
        self.max_body, self.keepalive = int(max_body), float(keepalive)
        self.model = model or self.artifact.name
        self.max_queue, self.prefill_chunk, self.timeout = max_queue, prefill_chunk, timeout
        self.validate_ckpt = validate
        self.load_progress = load_progress  # progress(bytes_bound, bytes_total) while the weights load
        # open_runtime(artifact, progress) -> the Runtime to serve (default: load it); a sharded artifact's rank 0
        # serves a stand-in that steps the other ranks with it (runtime/lockstep.py)
        self.open_runtime = open_runtime
        self.metrics = PrometheusMetrics()
        self.rt = self.engine = None
        self.outbox = Outbox()
        self.ready = threading.Event()
        self.failed: BaseException | None = None
        self.probe_result: dict | None = None
        self.validation: dict | None = None
        self.app = self._app()

    # -- startup ------------------------------------------------------------------------------------------------
    def load(self) -> None:
        """Load, validate (optional), start the engine, probe; then ready. A failure is kept in ``failed``."""
        try:
            from . import load

            rt = (self.open_runtime or load)(self.artifact, self.load_progress)
            if not rt.stateful:
                raise UserError(f"{self.artifact}: the artifact has no decode program, it cannot serve generation")
            self.rt = rt
            if self.validate_ckpt is not None:
                self.validation = validate(rt, self.validate_ckpt)
            self.engine = Engine(rt, self.max_queue, self.prefill_chunk, self.metrics,
                                 on_iteration=self.outbox.flush).start()
            self.probe_result = run_probe(self.engine, rt)
            self.ready.set()
            log.warning("dayzero serve: %s ready (probe %s)", self.model, self.probe_result)
        except BaseException as e:  # noqa: BLE001 - reported by the CLI (exit 2 / 3) and on /health
            self.failed = e
            raise

    def close(self) -> None:
        if self.engine is not None:
            self.engine.stop()

    @property
    def vocab(self) -> int:
        lo_hi = self.rt.programs["prefill"].input_ranges.get("input_ids")
        return int(lo_hi[1]) if lo_hi else int(self.rt.programs["prefill"].buffers[
            self.rt.programs["prefill"].user_outputs[0]]["shape"][-1])

    # -- HTTP ---------------------------------------------------------------------------------------------------
    def _app(self):
        app = FastAPI(title="dayzero", docs_url=None, redoc_url=None)

        def error(status: int, message: str, code=None, param=None, kind=None):
            kind = kind or {400: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                            503: "service_unavailable", 408: "timeout"}.get(status, "server_error")
            return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                                status_code=status)

        async def body_of(request: HttpRequest) -> dict:
            raw = await read_body(request, self.max_body)
            body = await asyncio.to_thread(parse_json, raw) if len(raw) > OFF_LOOP_BYTES else parse_json(raw)
            model = body.get("model")
            if model is not None and model != self.model:
                raise BadRequest(f"unknown model {json.dumps(model)}: this server serves {json.dumps(self.model)}",
                                 code="model_not_found", param="model")
            if not isinstance(body.get("stream", False), bool):
                raise BadRequest("stream must be true or false", param="stream")
            return body

        @app.exception_handler(BadRequest)
        async def _bad(request, e: BadRequest):
            return error(e.status, str(e), e.code, e.param)

        @app.get("/health")
        async def health():
            if self.failed is not None or (self.engine is not None and self.engine.error is not None):
                return JSONResponse({"status": "failed", "error": str(self.failed or self.engine.error)}, 503)
            if not self.ready.is_set():
                return JSONResponse({"status": "loading"}, 503)
            return {"status": "ok"}

        @app.get("/metrics")
        async def metrics():
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0,
                                                 "owned_by": "dayzero"}]}

        @app.post("/v1/completions")
        async def completions(request: HttpRequest):
            return await self._generate(request, body_of, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: HttpRequest):
            return await self._generate(request, body_of, chat=True)

        self._error = error
        return app

    async def _generate(self, request, body_of, chat: bool):
        if not self.ready.is_set():
            return self._error(503, "the server is starting (the startup probe has not passed)")
        body = await body_of(request)
        rt = self.rt
        if chat:
            ids, images = await asyncio.to_thread(chat_prompt, rt, body.get("messages"))
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, (str, list)) and len(prompt) > OFF_LOOP_BYTES // 8:  # a long prompt's check
                ids = await asyncio.to_thread(completion_prompt, rt, prompt, self.vocab)
            else:
                ids = completion_prompt(rt, prompt, self.vocab)
            images = []
        params = sampling(body, len(ids), rt.max_length, chat)
        events = Stream(asyncio.get_running_loop())
        req = Request(ids, self.outbox.emitter(events), images=images, timeout=self.timeout, **params)
        try:
            self.engine.submit(req)
        except QueueFull as e:
            return self._error(429, str(e))
        except UserError as e:
            return self._error(400, str(e))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        # until the first token (a long prompt's prefill), and to the last one of a non-streaming request: watch the
        # client, abort the request if it went away
        watch = _Watch(request, self.engine, req)
        first = await watch.events(events, self.keepalive if body.get("stream") else None)
        if first is None:
            return Response(status_code=499)  # nobody reads it
        if body.get("stream"):
            # an error before the first token is still an HTTP error, unless the headers went out for keepalives
            if first and first[0].kind == "error":
                return self._error(first[0].status, first[0].error)
            return StreamingResponse(self._sse(req, first, events, rid, created, chat), media_type="text/event-stream")
        try:
            text, tokens = [], []
            ev = None
            batch = first
            while ev is None:
                for e in batch:
                    if e.kind == "token":
                        text.append(e.text)
                        tokens.append(e.token)
                    else:
                        ev = e
                        break
                if ev is None:  # decoding: a client that went away is aborted here too, not at the end
                    batch = await watch.events(events)
                    if batch is None:
                        return Response(status_code=499)
        finally:
            if not req.finished:
                self.engine.abort(req)
        if ev.kind == "error":
            return self._error(ev.status, ev.error)
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(tokens), "total_tokens": len(ids) + len(tokens)}
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": "".join(text)},
                      "finish_reason": ev.finish_reason, "token_ids": tokens}
        else:
            choice = {"index": 0, "text": "".join(text), "logprobs": None, "finish_reason": ev.finish_reason,
                      "token_ids": tokens}
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": self.model, "choices": [choice], "usage": usage}

    async def _sse(self, req: Request, first: list[Event], events: Stream, rid: str, created: int, chat: bool):
        """Server-sent events, one per token; the events that arrived since the last write go out as one write."""
        obj = "chat.completion.chunk" if chat else "text_completion"
        # the fields every chunk repeats, encoded once
        head = (f'data: {{"id": {json.dumps(rid)}, "object": "{obj}", "created": {created}, '
                f'"model": {json.dumps(self.model)}, "choices": [')
        n = 0

        def chunk(choice: dict | None, usage=None) -> str:
            tail = "]" if usage is None else f'], "usage": {json.dumps(usage)}'
            return head + ("" if choice is None else json.dumps(choice)) + tail + "}\n\n"

        try:
            while not first:  # a long prefill: a comment line now and then keeps clients and proxies waiting
                yield f": prefill {req.prefilled}/{req.prompt_tokens}\n\n"
                try:
                    first = await asyncio.wait_for(events.next(), self.keepalive)
                except TimeoutError:
                    pass
            if chat:
                yield chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
            batch, ended = first, False
            while not ended:
                out = []
                for ev in batch:
                    if ev.kind == "token":
                        n += 1
                        if chat:
                            c = {"index": 0, "delta": {"content": ev.text}, "finish_reason": None,
                                 "token_ids": [ev.token]}
                        else:
                            c = {"index": 0, "text": ev.text, "logprobs": None, "finish_reason": None,
                                 "token_ids": [ev.token]}
                        out.append(chunk(c))
                        continue
                    if ev.kind == "done":
                        c = {"index": 0, "finish_reason": ev.finish_reason}
                        c.update({"delta": {}} if chat else {"text": "", "logprobs": None})
                        out.append(chunk(c))
                    else:  # an error after tokens went out: OpenAI's error object as an event, then the end
                        out.append(f"data: {json.dumps({'error': {'message': ev.error, 'type': 'server_error'}})}\n\n")
                    out.append(chunk(None, {"prompt_tokens": req.prompt_tokens, "completion_tokens": n,
                                            "total_tokens": req.prompt_tokens + n}))
                    out.append("data: [DONE]\n\n")
                    ended = True
                    break
                yield "".join(out)
                if not ended:
                    batch = await events.next()
        finally:
            if not req.finished:  # the client went away mid-stream: its slot and blocks go back
                self.engine.abort(req)


# -- request bodies ----------------------------------------------------------------------------------------------

async def read_body(request: HttpRequest, limit: int) -> bytes:
    """The request body, at most ``limit`` bytes: a larger one (by its Content-Length, or counted as it arrives)
    is a 413 before it is all in memory."""
    def too_large(size: str):
        return BadRequest(f"the request body ({size}) is larger than the server's --max-body of {limit} bytes",
                          status=413, code="request_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large(f"{int(length)} bytes")
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise too_large(f"over {limit} bytes")
        parts.append(part)
    return b"".join(parts)


def parse_json(raw: bytes) -> dict:
    """A request body -> its JSON object (a 400 for anything else)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON ({e.msg if hasattr(e, 'msg') else e})") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


# -- startup checks -----------------------------------------------------------------------------------------------

def probe_prompt(rt, n: int = PROBE_TOKENS) -> list[int]:
    """A fixed prompt of n ids spread over the vocabulary."""
    vocab = int(rt.programs["prefill"].input_ranges.get("input_ids", (0, 256))[1])
    return [(37 * k + 11) % vocab for k in range(n)]


def run_probe(engine: Engine, rt, max_tokens: int = 3, timeout: float = 600.0) -> dict:
    """A request through the engine (prefill, then decode steps; an image on a multimodal artifact). Raises an
    InternalError when it does not end with ``max_tokens`` tokens."""
    import queue as queue_mod

    from dayzero import InternalError

    cases = [("text", probe_prompt(rt), [])]
    if rt.multimodal is not None:
        import numpy as np

        mm = rt.multimodal
        t, h, w = next(iter(mm.grids))
        p = int(mm.info["patch_size"])
        img = (np.indices((h * p, w * p)).sum(0) * 7 % 256).astype(np.uint8)
        img = np.stack([img, img[::-1], img[:, ::-1]], -1)
        cases.append(("image", probe_prompt(rt, 4) + [mm.image_token_id] + probe_prompt(rt, 3), [img]))
    out = {}
    for name, prompt, images in cases:
        q = queue_mod.Queue()
        engine.submit(Request(prompt, q.put, max_tokens=max_tokens, temperature=0.0, images=images))
        toks, t0 = [], time.monotonic()
        while True:
            ev = q.get(timeout=timeout)
            if ev.kind != "token":
                break
            toks.append(ev.token)
        if ev.kind == "error" or not toks:
            raise InternalError(f"the startup probe ({name}) failed: {ev.error or 'no token generated'}")
        out[name] = {"tokens": toks, "seconds": round(time.monotonic() - t0, 3)}
    return out


def validate(rt, checkpoint, atol: float = VALIDATE_ATOL) -> dict:
    """The probe's prefill logits and one decode step against the upstream model run eagerly on CHECKPOINT; a
    UserError (the server refuses to start) outside ``atol`` (relative to the logits' scale)."""
    from dayzero.frontend.hf import load_upstream

    prompt = probe_prompt(rt)
    logits = rt.prefill(prompt, slot=0)[0]
    nxt = int(logits[-1].argmax())
    step = rt.decode(nxt, slot=0)[0, -1]
    rt.reset(0)
    try:
        ref_model = load_upstream(checkpoint)
    except (OSError, ValueError, ImportError) as e:
        raise UserError(f"--validate {checkpoint}: transformers cannot load it ({str(e).splitlines()[0]})") from None
    ids = torch.tensor([prompt + [nxt]])
    with torch.no_grad():
        ref = ref_model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[0].float()
    scale = float(ref.abs().max())
    d_prefill = float((logits - ref[:-1]).abs().max())
    d_decode = float((step - ref[-1]).abs().max())
    res = {"prefill_max_abs_diff": d_prefill, "decode_max_abs_diff": d_decode, "atol": atol * max(1.0, scale)}
    if not max(d_prefill, d_decode) <= res["atol"]:
        raise UserError(f"--validate {checkpoint}: the artifact's logits differ from upstream's (prefill max |diff| "
                        f"{d_prefill:.3g}, decode {d_decode:.3g}, tolerance {res['atol']:.3g}): refusing to serve")
    return res


def start_in_thread(server: Server, host: str = "127.0.0.1", port: int = 0, load: bool = True):
    """Serve ``server.app`` from a background thread (uvicorn) on HOST:PORT (0: a free port), then ``load()`` it
    in this thread unless ``load`` is False. Returns (the uvicorn server, the port); ``should_exit = True`` stops
    it. Tests and ``dayzero bench serve`` run servers this way."""
    import socket

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    http = uvicorn.Server(uvicorn.Config(server.app, log_level="warning", lifespan="off"))
    threading.Thread(target=http.run, kwargs={"sockets": [sock]}, name="dayzero-http", daemon=True).start()
    deadline = time.monotonic() + 60
    while not http.started:
        if time.monotonic() > deadline:
            raise UserError(f"the HTTP server did not start on {host}:{port}")
        time.sleep(0.01)
    if load:
        server.load()
    return http, sock.getsockname()[1]


def serve(artifact, host: str = "127.0.0.1", port: int = 8000, **kwargs) -> None:
    """Run the server until interrupted: HTTP first (/health answers 503 while loading), then load + probe."""
    if not (Path(artifact) / "program.json").is_file():
        raise UserError(f"{artifact}: not a dayzero artifact (no program.json)")
    server = Server(artifact, **kwargs)
    config = uvicorn.Config(server.app, host=host, port=port, log_level="warning", lifespan="off")
    http = _Http(config)

    def load_or_stop():
        try:
            server.load()
        except BaseException:  # noqa: BLE001 - kept in server.failed; stop serving
            http.should_exit = True

    threading.Thread(target=load_or_stop, name="dayzero-load", daemon=True).start()
    try:
        http.run()
    finally:
        server.close()
    if server.failed is not None:
        raise server.failed
    if http.interrupted:  # uvicorn stopped gracefully on Ctrl-C: the CLI says "interrupted" and exits 130
        raise KeyboardInterrupt


class _Http(uvicorn.Server):
    """uvicorn's server, remembering a Ctrl-C: uvicorn shuts down gracefully on SIGINT and then re-raises it, but
    whether that reaches ``serve`` as KeyboardInterrupt depends on when asyncio's own SIGINT handler sees it (a
    2-rank server under load returned normally, exit 0); the flag makes the outcome one."""

    interrupted = False

    def handle_exit(self, sig, frame):
        if sig == signal.SIGINT:
            self.interrupted = True
        super().handle_exit(sig, frame)
