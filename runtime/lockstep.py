"""Serving a sharded artifact: every rank steps together, rank 0 decides what the step is.

``torchrun --nproc-per-node N -m dayzero serve ART`` loads ART on every rank (runtime/dist.py joins the process
groups). Rank 0 serves HTTP and runs the engine (runtime/engine.py, unchanged) over a :class:`Lockstep` stand-in
for its Runtime: each call that runs programs or changes cache state (``prefill``, ``decode``, ``decode_batch``,
``reset``) is first sent to the other ranks, then run; the other ranks (:func:`follow`) run the same calls in the
same order on their own Runtime and open no socket. The runtime is deterministic, so every rank takes the same KV
blocks for the same calls; the calls' token ids, slots and append flags are all a step needs.

The calls travel on a control group of their own (gloo, CPU tensors whatever the target), as an ``all_reduce`` of
int64s where the other ranks add zeros: a sum needs every rank, so rank 0 learns of a dead rank on its next
message. While idle rank 0 sends a heartbeat every ``HEARTBEAT_S``, so a dead or stalled rank (either side) is
noticed within the group's timeout even with no traffic. Any such failure ends the rank with one line on stderr
(``error: rank R: ...``, exit 2); rank 0 stopping (Ctrl-C, SIGTERM) tells the others to stop, and they exit 0.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch

from dayzero import UserError

from .dist import DEFAULT_TIMEOUT_S, RankFailure, first_line

HEARTBEAT_S = 1.0  # rank 0 idle this long sends a heartbeat
INLINE = 64  # call arguments carried in the header itself; longer ones follow in a second message
NOOP, PREFILL, DECODE, DECODE_BATCH, RESET, STOP = range(6)
HEADER = 5  # op, slot, append, argument count, a sequence number (a mismatch means the ranks diverged)


def _fatal(message: str) -> None:
    """One line, then leave now: a peer is gone, so no barrier or teardown that would wait for it."""
    sys.stdout.flush()
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    os._exit(2)


def _ints(values, what: str) -> list[int]:
    """Token ids / slots as Python ints, checked before anything is sent: a value a rank would read differently
    (a bool, a float) is refused on rank 0 alone, before the other ranks see the call."""
    if isinstance(values, torch.Tensor):
        if values.dtype.is_floating_point or values.dtype == torch.bool:
            raise UserError(f"{what} must be integers, got a {values.dtype} tensor")
        values = values.reshape(-1).tolist()
    if isinstance(values, int) and not isinstance(values, bool):
        values = [values]
    if not isinstance(values, (list, tuple)):
        raise UserError(f"{what} must be a list of integers")
    flat = []
    for v in values:
        if isinstance(v, (list, tuple)):  # [1, n]
            flat += _ints(v, what)
        elif isinstance(v, int) and not isinstance(v, bool):
            flat.append(v)
        else:
            raise UserError(f"{what} must be integers, got {type(v).__name__}")
    return flat


class _Channel:
    """The control group and the message format: a header of INLINE + HEADER int64s, summed over the ranks."""

    def __init__(self, timeout_s: float):
        import torch.distributed as dist

        self.dist = dist
        self.rank = dist.get_rank()
        try:
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        except RuntimeError as e:  # a rank that failed to load never joins
            raise RankFailure(f"rank {self.rank}: the ranks did not all start serving: {first_line(e)}") from None
        self.seq = 0

    def _reduce(self, t: torch.Tensor) -> torch.Tensor:
        try:
            self.dist.all_reduce(t, group=self.group)
        except RuntimeError as e:
            raise RankFailure(f"rank {self.rank}: the ranks lost each other (a rank died or stalled past the "
                              f"timeout): {first_line(e)}") from None
        return t

    def send(self, op: int, slot: int = -1, append: int = 0, args: list[int] = ()) -> None:
        self.seq += 1
        head = torch.zeros(HEADER + INLINE, dtype=torch.int64)
        head[:HEADER] = torch.tensor([op, slot, append, len(args), self.seq])
        if len(args) <= INLINE:
            head[HEADER:HEADER + len(args)] = torch.tensor(args, dtype=torch.int64)
        self._reduce(head)
        if len(args) > INLINE:
            self._reduce(torch.tensor(args, dtype=torch.int64))

    def receive(self) -> tuple[int, int, int, list[int]]:
        self.seq += 1
        head = self._reduce(torch.zeros(HEADER + INLINE, dtype=torch.int64))
        op, slot, append, n, seq = head[:HEADER].tolist()
        if seq != self.seq:
            raise RankFailure(f"rank {self.rank}: the ranks' calls diverged (message {seq}, expected {self.seq})")
        if n <= INLINE:
            args = head[HEADER:HEADER + n].tolist()
        else:
            args = self._reduce(torch.zeros(n, dtype=torch.int64)).tolist()
        return op, slot, append, args


class Lockstep:
    """Rank 0's Runtime for the engine and server: the same attributes, and every call that steps the model or
    changes cache state is sent to the other ranks before it runs here. A lost rank ends the process (one line)."""

    def __init__(self, rt, timeout_s: float = DEFAULT_TIMEOUT_S, heartbeat_s: float = HEARTBEAT_S):
        self._rt = rt
        self._channel = _Channel(timeout_s)
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._stopped = threading.Event()
        self._heartbeat_s = heartbeat_s
        threading.Thread(target=self._heartbeat, name="dayzero-heartbeat", daemon=True).start()

    def __getattr__(self, name):
        return getattr(self._rt, name)

    def _call(self, op: int, slot: int, append: int, args: list[int], run):
        with self._lock:
            if self._stopped.is_set():
                raise UserError("the server is stopping")
            try:
                self._channel.send(op, slot, append, args)
                return run()
            except RankFailure as e:
                _fatal(str(e))
            finally:
                self._last = time.monotonic()

    def prefill(self, input_ids, slot: int = 0, append: bool = False) -> torch.Tensor:
        ids = _ints(input_ids, "input_ids")
        return self._call(PREFILL, int(slot), int(bool(append)), ids,
                          lambda: self._rt.prefill(ids, slot=slot, append=bool(append)))

    def decode(self, token_id, slot: int = 0) -> torch.Tensor:
        ids = _ints(token_id, "token_id")
        if len(ids) != 1:
            raise UserError(f"token_id must be one integer, got {len(ids)}")
        tok = ids[0]
        return self._call(DECODE, int(slot), 0, [tok], lambda: self._rt.decode(tok, slot=slot))

    def decode_batch(self, tokens, slots) -> torch.Tensor:
        toks, sl = _ints(tokens, "tokens"), _ints(slots, "slots")
        if len(toks) != len(sl):
            raise UserError(f"decode_batch: {len(toks)} tokens for {len(sl)} slots")
        return self._call(DECODE_BATCH, -1, 0, toks + sl, lambda: self._rt.decode_batch(toks, sl))

    def reset(self, slot: int | None = None) -> None:
        k = -1 if slot is None else _ints(slot, "slot")[0]
        return self._call(RESET, k, 0, [], lambda: self._rt.reset(slot))

    def _heartbeat(self) -> None:
        while not self._stopped.wait(self._heartbeat_s / 4):
            if time.monotonic() - self._last < self._heartbeat_s:
                continue
            with self._lock:
                if self._stopped.is_set():
                    return
                try:
                    self._channel.send(NOOP)
                except RankFailure as e:
                    _fatal(str(e))
                self._last = time.monotonic()

    def close(self) -> None:
        """Tell the other ranks to stop (they exit 0); a rank already gone is no error now."""
        with self._lock:
            if self._stopped.is_set():
                return
            self._stopped.set()
            try:
                self._channel.send(STOP)
            except RankFailure:
                pass


def follow(rt, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """A rank other than 0: run rank 0's calls on ``rt`` until it says stop. A call's UserError is rank 0's too
    (the same state, the same check), which answers it; the ranks go on. A lost rank 0 ends this one (one line)."""
    channel = _Channel(timeout_s)
    rank = channel.rank
    stop = lambda *_: _fatal(f"rank {rank}: stopped by a signal")  # noqa: E731 - no barrier with the others
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while True:
        try:
            op, slot, append, args = channel.receive()
        except RankFailure as e:
            _fatal(str(e))
        if op == STOP:
            return
        try:
            if op == PREFILL:
                rt.prefill(args, slot=slot, append=bool(append))
            elif op == DECODE:
                rt.decode(args[0], slot=slot)
            elif op == DECODE_BATCH:
                half = len(args) // 2
                rt.decode_batch(args[:half], args[half:])
            elif op == RESET:
                rt.reset(None if slot < 0 else slot)
        except RankFailure as e:
            _fatal(str(e))
        except UserError:
            pass


def serve_sharded(artifact, host: str, port: int, timeout_s: float = DEFAULT_TIMEOUT_S, **server_kwargs) -> None:
    """``dayzero serve`` of a sharded artifact on this rank (under torchrun): rank 0 serves, the others follow."""
    from . import load
    from .server import serve

    from dayzero.passes.ir.collective import Mesh

    from . import validate

    mesh = Mesh.from_json(validate.read_json(os.path.join(artifact, "program.json")).get("mesh"))
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:  # before any socket opens
        raise UserError(f"{artifact} is sharded over {mesh.world} ranks: serve it under `torchrun --nproc-per-node "
                        f"{mesh.world} -m dayzero serve ART`")
    rank = int(os.environ["RANK"])
    if rank != 0:
        rt = load(artifact, dist_timeout_s=timeout_s)
        _refuse_multimodal(rt)
        follow(rt, timeout_s)
        return
    held = []

    def open_runtime(path, progress):
        rt = load(path, progress, dist_timeout_s=timeout_s)
        _refuse_multimodal(rt)
        held.append(Lockstep(rt, timeout_s))
        return held[0]

    try:
        serve(artifact, host=host, port=port, open_runtime=open_runtime, **server_kwargs)
    finally:
        if held:
            held[0].close()


def _refuse_multimodal(rt) -> None:
    if rt.multimodal is not None:
        raise UserError(f"{rt.path}: serving a sharded multimodal artifact is not supported (its image prefill is "
                        "not sent to the other ranks): serve it unsharded")
