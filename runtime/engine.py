"""The serving engine: a bounded request queue and continuous batching over one Runtime, in one thread.

    submit(request) ─► inbox ─► waiting (FIFO, bounded: a full queue raises QueueFull)
                                   │ admitted when a request slot is free and the KV-block pool holds the
                                   ▼ blocks of its whole budget (prompt + max_tokens) beside the running ones
    each iteration:   aborts / timeouts  ─► their slots reset, blocks back in the pool
                      prefill chunks     ─► new requests, ``prefill_chunk`` tokens in all per iteration, the
                                            request with the fewest prompt tokens left first (a 1M-token prompt
                                            takes what short ones leave; running requests decode between its
                                            chunks); later chunks: ``Runtime.prefill(..., append=True)``
                      sample             ─► one token per request with fresh logits (temperature, top_p, seed;
                                            greedy requests of a batched step: one argmax over its [B, V])
                                            streamed out; stop ids, stop strings, max_tokens, the length budget
                                            end a request and free its slot
                      one decode step    ─► ``rt.decode_batch(tokens, slots) -> [B, V]`` when the runtime has
                                            it, else ``rt.decode(token, slot)`` per request
                      on_iteration()     ─► the iteration's events go out together (the server wakes its event
                                            loop once per iteration, not once per token)

The engine thread is the only one that touches the Runtime. Each request carries ``emit(event)``, called from
the engine thread with :class:`Event` objects (``token``, then one ``done`` or ``error``); the server turns them
into HTTP responses. Sampling is ``executor._pick``, with a generator seeded per request, so a request's tokens
equal ``Runtime.generate`` of the same prompt and settings, whatever else runs beside it.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from dayzero import InternalError, UserError

from .executor import _pick


def batched_decode(rt):
    """``rt.decode_batch`` when the artifact has a batched decode program (``has_batched_decode``), else None."""
    fn = getattr(rt, "decode_batch", None)
    return fn if fn is not None and getattr(rt, "has_batched_decode", True) else None


class QueueFull(UserError):
    """The engine's waiting queue is full (HTTP 429)."""


@dataclass
class Event:
    kind: str  # "token" | "done" | "error"
    token: int | None = None
    text: str = ""
    finish_reason: str | None = None  # done: "stop" | "length" | "abort"
    error: str | None = None
    status: int = 200  # error: the HTTP status it answers (400 bad request, 408 timeout, 500 internal)


@dataclass(eq=False)
class Request:
    """One generation. ``prompt`` is token ids; ``images`` joins them on a multimodal artifact."""

    prompt: list[int]
    emit: Callable[[Event], None]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_ids: tuple = ()
    stop: tuple = ()  # stop strings (need a tokenizer)
    ignore_eos: bool = False  # the tokenizer's end-of-sequence token does not end the request
    images: list = field(default_factory=list)
    timeout: float | None = None  # seconds from submission
    id: int = field(default_factory=itertools.count().__next__)
    # engine state
    tokens: list[int] = field(default_factory=list)
    slot: int | None = None
    prefilled: int = 0
    logits: torch.Tensor | None = None
    submitted: float = 0.0
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished: bool = False
    gen: torch.Generator | None = None
    detok: object = None  # runtime/text.py Detokenizer when the artifact has a tokenizer
    text: str = ""  # detokenized output so far
    sent: int = 0  # characters of ``text`` streamed out

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)


class EngineMetrics:
    """What the engine reports each iteration; the server exports it (Prometheus). No-op by default."""

    def iteration(self, running: int, waiting: int, kv_used: int, kv_total: int) -> None:
        pass

    def token(self, req: Request, now: float) -> None:
        pass

    def prefilled(self, req: Request, tokens: int) -> None:
        """``tokens`` more of the request's prompt went through prefill (a long prompt's progress)."""

    def finished(self, req: Request, reason: str) -> None:
        pass


class Engine:
    """Continuous batching over ``rt`` (a loaded Runtime with a decode program), in a background thread."""

    def __init__(self, rt, max_queue: int = 64, prefill_chunk: int | None = None,
                 metrics: EngineMetrics | None = None, on_iteration: Callable[[], None] | None = None):
        """``prefill_chunk``: prompt tokens prefilled per iteration, all requests together (default: the artifact's
        compiled prefill chunk, the most one prefill call takes). ``on_iteration()`` is called from the engine
        thread after every iteration (and once more when the engine stops on an error), after the iteration's events
        were emitted: a consumer that buffers events hands them on there, in one go."""
        if not rt.stateful:
            raise UserError(f"{rt.path}: the artifact has no decode program, it cannot serve generation")
        if prefill_chunk is None:
            prefill_chunk = rt.prefill_chunk
        if prefill_chunk < 1:
            raise UserError("the prefill chunk must be at least 1 token")
        self.rt = rt
        self.max_queue = int(max_queue)
        self.prefill_chunk = int(prefill_chunk)
        self.metrics = metrics or EngineMetrics()
        self.on_iteration = on_iteration or (lambda: None)
        self.tokenizer = rt.tokenizer
        self.eos_ids = tuple(rt.eos_ids)
        self._inbox: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # guards _queued (the waiting count seen by submit)
        self._queued = 0
        self.waiting: deque[Request] = deque()
        self.active: dict[int, Request] = {}  # slot -> request (prefilling or decoding)
        self.free_slots = list(range(rt.max_batch - 1, -1, -1))
        self._reserved: dict[int, dict[str, int]] = {}  # slot -> KV blocks its budget may take, per class
        self._aborts: set[int] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.iterations = 0
        self.decode_steps = 0
        self.error: BaseException | None = None
        self._decode_batch = batched_decode(rt)
        self._step_rows: tuple[torch.Tensor, list[int]] | None = None  # the last batched step's logits, request ids

    # -- the client side (any thread) ----------------------------------------------------------------------------
    def submit(self, req: Request) -> Request:
        """Queue a request; raises QueueFull when ``max_queue`` requests are waiting already."""
        if self.error is not None:
            raise InternalError(f"the engine stopped: {self.error}")
        budget = self.rt.max_length
        if req.prompt_tokens + req.max_tokens > budget:
            raise UserError(f"prompt ({req.prompt_tokens} tokens) + max_tokens ({req.max_tokens}) exceeds the "
                            f"length budget of {budget} tokens (the artifact's --max-seq)")
        self._check_pool(req)
        with self._lock:
            if self._queued >= self.max_queue:
                raise QueueFull(f"the request queue is full ({self.max_queue} waiting): retry later")
            self._queued += 1
        req.submitted = time.monotonic()
        self._inbox.put(("submit", req))
        return req

    def abort(self, req: Request) -> None:
        """End a request (its client went away); its slot and blocks are free after the next iteration."""
        self._inbox.put(("abort", req))

    def start(self) -> "Engine":
        self._thread = threading.Thread(target=self._loop, name="dayzero-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def running(self) -> int:
        return len(self.active)

    @property
    def queued(self) -> int:
        return self._queued

    # -- the engine thread ---------------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                idle = not self.waiting and not self.active
                self._drain(block=idle)
                self.step()
        except BaseException as e:  # noqa: BLE001 - a dayzero bug: fail every request, refuse new ones
            self.error = e
            for req in list(self.waiting) + list(self.active.values()):
                self._fail(req, f"internal error: {e}", 500)
            self.on_iteration()
            raise

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.2) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, req = item
            if kind == "submit":
                self.waiting.append(req)
            elif kind == "abort":
                self._aborts.add(req.id)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def step(self) -> None:
        """One iteration: aborts and timeouts, admission, prefill chunks, sampling, one decode step."""
        self.iterations += 1
        now = time.monotonic()
        for req in list(self.waiting) + list(self.active.values()):
            if req.id in self._aborts:
                self._finish(req, "abort")
            elif req.timeout is not None and now - req.submitted > req.timeout:
                self._fail(req, f"the request timed out after {req.timeout:g} s (the server's --timeout; "
                                f"{req.prefilled} of {req.prompt_tokens} prompt tokens prefilled)", 408)
        self._aborts.clear()
        self._admit()
        self._prefill()
        picks = self._greedy_picks()
        batch = []
        for req in sorted(self.active.values(), key=lambda r: r.slot):
            if req.logits is not None:
                tok = self._sample(req, picks.get(req.id) if req.temperature <= 0 else None)
                if tok is not None:
                    batch.append((tok, req))
        if batch:
            self._decode(batch)
        self._report()
        self.on_iteration()

    def _admit(self) -> None:
        while self.waiting and self.free_slots:
            req = self.waiting[0]
            need = self._blocks_needed(req.prompt_tokens + req.max_tokens)
            if not self._fits(need):
                if not self.active:  # nothing will free blocks: it can never run
                    self.waiting.popleft()
                    self._dequeued()
                    self._fail(req, "the request needs more KV-cache blocks than the pool holds (compile with a "
                                    "larger --kv-blocks)", 400)
                    continue
                return
            self.waiting.popleft()
            self._dequeued()
            req.slot = self.free_slots.pop()
            self._reserved[req.slot] = need
            self.active[req.slot] = req
            req.gen = torch.Generator().manual_seed(int(req.seed))
            if self.tokenizer is not None:
                from .text import Detokenizer

                req.detok = Detokenizer(self.tokenizer, skip_special_tokens=True)  # as `run` and OpenAI servers

    def _dequeued(self) -> None:
        with self._lock:
            self._queued -= 1

    def _blocks_needed(self, tokens: int) -> dict[str, int]:
        kv = self.rt.kv
        if kv is None:
            return {}
        bs = kv.block_size
        need = {}
        for c in kv.classes:
            n = -(-tokens // bs)
            if c.window:  # a sliding window holds the blocks the window spans, plus the one being written
                n = min(n, -(-c.window // bs) + 1)
            need[c.name] = n
        return need

    def _check_pool(self, req: Request) -> None:
        """A request whose budget (prompt + max_tokens) needs more blocks than a whole pool holds can never be
        admitted, whatever ends: a UserError now (HTTP 400) instead of a wait that never ends."""
        if self.rt.kv is None:
            return
        need = self._blocks_needed(req.prompt_tokens + req.max_tokens)
        for c in self.rt.kv.classes:
            if need[c.name] > c.blocks - 1:
                bs = self.rt.kv.block_size
                raise UserError(f"prompt ({req.prompt_tokens} tokens) + max_tokens ({req.max_tokens}) needs "
                                f"{need[c.name]} KV-cache blocks of {bs} tokens in {c.name}, but its pool holds "
                                f"{c.blocks - 1} (compile with a larger --kv-blocks, or ask for fewer tokens)")

    def _fits(self, need: dict[str, int]) -> bool:
        for c in self.rt.kv.classes if self.rt.kv is not None else ():
            held = sum(r.get(c.name, 0) for r in self._reserved.values())
            if held + need[c.name] > c.blocks - 1:
                return False
        return True

    def _prefill(self) -> None:
        """This iteration's prefill: ``prefill_chunk`` tokens in all, the request with the fewest prompt tokens
        left first (ties: the older one), so short prompts are not stuck behind a long one's thousands of chunks;
        the long one takes the rest of the budget, and every running request decodes once per iteration."""
        budget = self.prefill_chunk
        for req in sorted(self.active.values(), key=lambda r: (r.prompt_tokens - r.prefilled, r.id)):
            if budget <= 0:
                return
            if req.prefilled >= req.prompt_tokens:
                continue
            try:
                if self.rt.multimodal is not None:  # image + text: one prefill (positions come from the images)
                    logits = self.rt.multimodal.prefill(req.prompt, images=req.images, slot=req.slot)
                    req.prefilled = req.prompt_tokens
                else:
                    n = min(budget, req.prompt_tokens - req.prefilled)
                    chunk = req.prompt[req.prefilled:req.prefilled + n]
                    logits = self.rt.prefill(chunk, slot=req.slot, append=req.prefilled > 0, last=True)
                    req.prefilled += n
                    budget -= n
                    self.metrics.prefilled(req, n)
            except UserError as e:
                self._fail(req, str(e), 400)
                continue
            if req.prefilled >= req.prompt_tokens:
                req.logits = logits[0, -1]

    def _greedy_picks(self) -> dict[int, int]:
        """Request id -> its greedy token, for the requests of the last batched decode step: one argmax over the
        step's [B, V] logits, not one per request (each a torch call and a tensor-to-int conversion)."""
        step, self._step_rows = self._step_rows, None
        if step is None:
            return {}
        logits, ids = step
        return dict(zip(ids, logits.argmax(-1).tolist()))

    def _sample(self, req: Request, tok: int | None = None) -> int | None:
        """Pick the request's next token from its logits (``tok``: already picked, greedy) and stream it; None
        when the request ended."""
        if tok is None:
            tok = _pick(req.logits, req.temperature, req.top_p, req.gen)
        req.logits = None
        req.tokens.append(tok)
        now = time.monotonic()
        self.metrics.token(req, now)
        if req.first_token_at is None:
            req.first_token_at = now
        req.last_token_at = now
        reason = None
        if tok in req.stop_ids or (tok in self.eos_ids and not req.ignore_eos):
            reason = "stop"
        delta = ""
        if req.detok is not None:
            req.text += req.detok.add(tok) if reason is None else ""
            delta, reason = self._release_text(req, reason)
        if reason is None and len(req.tokens) >= req.max_tokens:
            reason = "length"
            if req.detok is not None:
                req.text += req.detok.flush()
                delta += req.text[req.sent:]
                req.sent = len(req.text)
        req.emit(Event("token", token=tok, text=delta))
        if reason is not None:
            self._finish(req, reason)
            return None
        return tok

    @staticmethod
    def _release_text(req: Request, reason: str | None) -> tuple[str, str | None]:
        """The text that can go out now: up to a stop string (which ends the request), holding back a tail that
        may still become one."""
        if req.stop:
            hits = [req.text.find(s, max(0, req.sent - len(s) + 1)) for s in req.stop]
            hits = [h for h in hits if h >= 0]
            if hits:
                end = min(hits)
                delta = req.text[req.sent:end]
                req.text, req.sent = req.text[:end], end
                return delta, "stop"
            hold = 0
            for s in req.stop:
                for k in range(min(len(s) - 1, len(req.text) - req.sent), 0, -1):
                    if req.text.endswith(s[:k]):
                        hold = max(hold, k)
                        break
            end = len(req.text) - hold if reason is None else len(req.text)
        else:
            end = len(req.text)
        delta = req.text[req.sent:end]
        req.sent = end
        return delta, reason

    def _decode(self, batch: list[tuple[int, Request]]) -> None:
        self.decode_steps += 1
        # a lone request steps through the decode program: the batched program pays for its generality at B = 1
        # (DeepSeek-V4's row program gathers the request's states in and scatters them back: 0.84 vs 0.39 ms a step
        # on tiny V4, max-seq 128, a lightly loaded host)
        if self._decode_batch is not None and len(batch) > 1:
            try:
                logits = self._decode_batch([t for t, _ in batch], [r.slot for _, r in batch])
                for k, (_, req) in enumerate(batch):
                    req.logits = logits[k]
                self._step_rows = (logits, [r.id for _, r in batch])
                return
            except UserError:
                pass  # a request over its budget (a full pool): find it, one request at a time
        for tok, req in batch:
            try:
                req.logits = self.rt.decode(tok, slot=req.slot)[0, -1]
            except UserError as e:
                self._fail(req, str(e), 400)

    def _finish(self, req: Request, reason: str) -> None:
        if req.finished:
            return
        self._release(req)
        req.emit(Event("done", finish_reason=reason))
        self.metrics.finished(req, reason)

    def _fail(self, req: Request, message: str, status: int) -> None:
        if req.finished:
            return
        self._release(req)
        req.emit(Event("error", error=message, status=status))
        self.metrics.finished(req, "error")

    def _release(self, req: Request) -> None:
        req.finished = True
        if req.slot is not None and self.active.get(req.slot) is req:
            del self.active[req.slot]
            self._reserved.pop(req.slot, None)
            self.rt.reset(req.slot)  # its KV blocks go back to the pool now
            self.free_slots.append(req.slot)
        elif req in self.waiting:
            self.waiting.remove(req)
            self._dequeued()

    def kv_blocks(self) -> tuple[int, int]:
        """(blocks in use, blocks in the pool) over every KV pool class."""
        if self.rt.kv is None:
            return 0, 0
        stats = self.rt.kv.stats().values()
        return sum(s["used"] for s in stats), sum(s["blocks"] for s in stats)

    def _report(self) -> None:
        used, total = self.kv_blocks()
        self.metrics.iteration(len(self.active), len(self.waiting), used, total)
