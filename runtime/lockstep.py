"""Serving a sharded artifact: every rank steps together, rank 0 decides what the step is.

``torchrun --nproc-per-node N -m dayzero serve ART`` loads ART on every rank (runtime/dist.py joins the process
groups). Rank 0 serves HTTP and runs the engine (runtime/engine.py, unchanged) over a :class:`Lockstep` stand-in
for its Runtime: each call that runs programs or changes cache state (``prefill``, ``decode``, ``decode_batch``,
``reset``) is first sent to the other ranks, then run; the other ranks (:func:`follow`) run the same calls in the
same order on their own Runtime and open no socket. The runtime is deterministic, so every rank takes the same KV
blocks for the same calls; the calls' token ids, slots and prefill flags (append; last, which runs the
``prefill_last`` program, whose collectives differ) are all a step needs. A multimodal
artifact's image request is parsed on rank 0 alone (runtime/multimodal.py ``parse``: the image files or bytes, the
processor, the positions; a bad image fails there, before any rank hears of it), and the parsed request (ids,
M-RoPE positions, rope delta, each image's grid and pixel values, bit for bit) goes out as one ``MM_PREFILL`` call
that every rank runs: the vision programs, then prefill, together (their collectives need every rank).

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

from dayzero import InternalError, UserError

from . import request_checks
from .dist import DEFAULT_TIMEOUT_S, RankFailure, first_line

HEARTBEAT_S = 1.0  # rank 0 idle this long sends a heartbeat
INLINE = 64  # call arguments carried in the header itself; longer ones follow in a second message
NOOP, PREFILL, DECODE, DECODE_BATCH, RESET, STOP, MM_PREFILL = range(7)
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

    def send(self, op: int, slot: int = -1, append: int = 0, args=()) -> None:
        """``args``: int64s (a list, or a tensor for a long payload such as an image's pixels)."""
        self.seq += 1
        args = torch.as_tensor(args, dtype=torch.int64).reshape(-1)
        n = args.numel()
        head = torch.zeros(HEADER + INLINE, dtype=torch.int64)
        head[:HEADER] = torch.tensor([op, slot, append, n, self.seq])
        if n <= INLINE:
            head[HEADER:HEADER + n] = args
        self._reduce(head)
        if n > INLINE:
            self._reduce(args.clone())

    def receive(self) -> tuple[int, int, int, torch.Tensor]:
        self.seq += 1
        head = self._reduce(torch.zeros(HEADER + INLINE, dtype=torch.int64))
        op, slot, append, n, seq = head[:HEADER].tolist()
        if seq != self.seq:
            raise RankFailure(f"rank {self.rank}: the ranks' calls diverged (message {seq}, expected {self.seq})")
        if n <= INLINE:
            args = head[HEADER:HEADER + n]
        else:
            args = self._reduce(torch.zeros(n, dtype=torch.int64))
        return op, slot, append, args


def pack_parsed(p) -> torch.Tensor:
    """A parsed multimodal request (runtime/multimodal.Parsed) as int64s: [n, images, delta, grids (3 each),
    pixel shapes (2 each), ids (n), positions (3n), pixels (their float32 bits)]."""
    n = p.ids.shape[1]
    head = [n, len(p.grids), p.delta, *(int(x) for g in p.grids for x in g),
            *(int(x) for pv in p.pixels for x in pv.shape)]
    parts = [torch.tensor(head, dtype=torch.int64), p.ids.reshape(-1).to(torch.int64),
             p.positions.reshape(-1).to(torch.int64),
             *(pv.to(torch.float32).contiguous().reshape(-1).view(torch.int32).to(torch.int64) for pv in p.pixels)]
    return torch.cat(parts)


def unpack_parsed(args: torch.Tensor):
    """``pack_parsed``'s int64s -> the runtime/multimodal.Parsed request."""
    from .multimodal import Parsed

    n, k, delta = (int(x) for x in args[:3])
    at = 3
    grids = [tuple(int(x) for x in args[at + 3 * i:at + 3 * i + 3]) for i in range(k)]
    at += 3 * k
    shapes = [tuple(int(x) for x in args[at + 2 * i:at + 2 * i + 2]) for i in range(k)]
    at += 2 * k
    ids = args[at:at + n].reshape(1, n).clone()
    at += n
    positions = args[at:at + 3 * n].reshape(3, 1, n).clone()
    at += 3 * n
    pixels = []
    for rows, cols in shapes:
        pixels.append(args[at:at + rows * cols].to(torch.int32).view(torch.float32).reshape(rows, cols).clone())
        at += rows * cols
    if at != args.numel():
        raise RankFailure(f"an image prefill message of {args.numel()} values, {at} expected: the ranks diverged")
    return Parsed(ids, positions, delta, pixels, grids)


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
        # a multimodal artifact: image requests parsed here, then run by every rank (MM_PREFILL)
        self.multimodal = None if rt.multimodal is None else _Multimodal(self, rt.multimodal)
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

    def prefill(self, input_ids, slot: int = 0, append: bool = False, last: bool = False) -> torch.Tensor:
        ids = _ints(input_ids, "input_ids")
        # every rank runs the same program (``last`` picks prefill_last, whose collectives differ): both flags go
        return self._call(PREFILL, int(slot), int(bool(append)) | int(bool(last)) << 1, ids,
                          lambda: self._rt.prefill(ids, slot=slot, append=bool(append), last=bool(last)))

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

    def mm_prefill(self, mm, parsed, slot: int) -> torch.Tensor:
        return self._call(MM_PREFILL, slot, 0, pack_parsed(parsed), lambda: mm.run(parsed, slot))

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


class _Multimodal:
    """Rank 0's multimodal driver (runtime/multimodal.Multimodal's attributes): ``prefill`` parses the request
    here, then every rank runs it. What would run programs on rank 0 alone is refused (the other ranks would not
    join its collectives): requests go through ``prefill`` and the Lockstep's ``decode`` / ``decode_batch``."""

    _RANK0_ONLY = ("encode", "features", "prepare", "inputs", "run", "_prefill", "generate", "generate_batch")

    def __init__(self, lockstep: Lockstep, mm):
        self._lockstep, self._mm = lockstep, mm

    def __getattr__(self, name):
        if name in self._RANK0_ONLY:
            raise InternalError(f"Multimodal.{name} on rank 0 of a sharded artifact would run programs without "
                                "the other ranks")
        return getattr(self._mm, name)

    def prefill(self, input_ids, images=(), slot: int = 0, fit: bool = False) -> torch.Tensor:
        slot = request_checks.slot(slot, self._mm.rt.max_batch)
        return self._lockstep.mm_prefill(self._mm, self._mm.parse(input_ids, images, fit), slot)

    def decode(self, token_id, slot: int = 0) -> torch.Tensor:
        return self._lockstep.decode(token_id, slot)


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
            if op == MM_PREFILL:
                rt.multimodal.run(unpack_parsed(args), slot)
                continue
            args = args.tolist()
            if op == PREFILL:
                rt.prefill(args, slot=slot, append=bool(append & 1), last=bool(append & 2))
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
        follow(rt, timeout_s)
        return
    held = []

    def open_runtime(path, progress):
        rt = load(path, progress, dist_timeout_s=timeout_s)
        held.append(Lockstep(rt, timeout_s))
        return held[0]

    try:
        serve(artifact, host=host, port=port, open_runtime=open_runtime, **server_kwargs)
    finally:
        if held:
            held[0].close()

