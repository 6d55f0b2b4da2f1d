"""The runtime: load an artifact, allocate one arena, bind the weights, run programs.

    arena = torch.empty(arena_bytes, uint8)     one allocation; every buffer is a 64-byte-aligned view into it
    weights zone  <- checkpoint recipes (copy runs from memory-mapped safetensors) / weights.safetensors
    prefill(input_ids) -> logits                symbols (seq) from the input's shape, then the steps in order

Kernels take DLPack views of the arena (TVM_NOTES: byte_offset must be 0 and the pointer 64-byte aligned, which
the planner guarantees). Argument lists are prepared once per distinct symbol binding and cached.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import sympy
import torch
import tvm
from safetensors import safe_open

from dayzero import InternalError, UserError
from dayzero.passes.ir.ops import DTYPE_BYTES, torch_dtype

from .kv_pages import KVPages

ALIGN = 64
PER_REQUEST_ZONES = ("kv_cache", "cross_layer_state")  # replicated per request slot (codegen/memory.py)


class _Program:
    def __init__(self, pj: dict, lib, arena: torch.Tensor):
        self.name = pj["name"]
        self.symbols = {s: (lo, hi) for s, lo, hi in pj["symbols"]}
        self.buffers = pj["buffers"]
        self.offsets = {int(k): v for k, v in pj["memory"]["offsets"].items()}
        self.state_slots = pj["memory"].get("state_slots", 1)
        self.state_stride = pj["memory"].get("state_stride", 0)
        self.inputs = pj["inputs"]
        self.input_ranges = pj.get("input_ranges", {})
        self.outputs = pj["outputs"]
        self.arena = arena

        def root(b):
            a = self.buffers[b]["alias_of"]
            return b if a is None else a
        # outputs that are the new contents of a state (a KV cache written in place) are not returned
        self.user_outputs = [o for o in self.outputs if self.buffers[root(o)].get("state") is None]
        # block-table inputs (passes/paged_kv.py: block_table, block_table_w{W}), last: the runtime passes them
        self.table_inputs = [self.buffers[b]["name"] for b in self.inputs
                             if self.buffers[b]["name"].startswith("block_table")]
        self.states = {b["state"]: b["id"] for b in self.buffers if b.get("state") and b["alias_of"] is None
                       and b["zone"] in PER_REQUEST_ZONES}
        # states of every request (the dequant workspace and its expert cache): one copy, zeroed at load only
        self.shared_states = {b["state"]: b["id"] for b in self.buffers if b.get("state") and b["alias_of"] is None
                              and b["zone"] not in PER_REQUEST_ZONES}
        self._in_state = {b["id"] for b in self.buffers if self.buffers[root(b["id"])].get("state")
                          and self.buffers[root(b["id"])]["zone"] in PER_REQUEST_ZONES}
        syms = {s: sympy.Symbol(s, integer=True, positive=True) for s in self.symbols}
        order = list(syms)
        self._shape_fns = []
        for b in self.buffers:
            dims = []
            for d in b["shape"]:
                if isinstance(d, int):
                    dims.append(d)
                else:
                    dims.append(sympy.lambdify([syms[s] for s in order], sympy.sympify(d, locals=syms), "math"))
            self._shape_fns.append(dims)
        self._order = order
        self._funcs = {}
        self.steps = []
        for st in pj["steps"]:
            f = self._funcs.get(st["kernel"])
            if f is None:
                f = self._funcs[st["kernel"]] = lib[st["kernel"]]
            self.steps.append((f, st["args"], st.get("symbols", []), st["node"], st["outputs"]))
        # argument lists per (symbol binding, request slot); the views they hold of buffers outside the request
        # slots are shared by every slot of a binding, so a server's first call in a new slot makes only that
        # slot's state views (a DeepSeek-V4 program has thousands of views)
        self._shared_views = lru_cache(maxsize=16)(lambda env: {})
        self._cache = lru_cache(maxsize=64)(self._prepare)

    def shape(self, bid: int, env: tuple) -> tuple[int, ...]:
        return tuple(d if isinstance(d, int) else int(d(*env)) for d in self._shape_fns[bid])

    def view(self, bid: int, env: tuple, slot: int = 0) -> torch.Tensor:
        """A buffer as a tensor view of the arena; state buffers (and their views) of request slot ``slot``."""
        b = self.buffers[bid]
        shape = self.shape(bid, env)
        n = int(np.prod(shape)) if shape else 1
        off = self.offsets[bid] + (slot * self.state_stride if bid in self._in_state else 0)
        nbytes = n * DTYPE_BYTES[b["dtype"]]
        if off % ALIGN:
            raise InternalError(f"buffer {bid} at unaligned offset {off}")
        return self.arena[off:off + nbytes].view(torch_dtype(b["dtype"])).view(shape)

    def _prepare(self, env: tuple, slot: int = 0):
        shared, own = self._shared_views(env), {}

        def v(bid):
            views = own if bid in self._in_state else shared
            if bid not in views:
                views[bid] = self.view(bid, env, slot)
            return views[bid]
        values = dict(zip(self._order, env))
        calls = [(f, [v(a) for a in args] + [values[s] for s in syms]) for f, args, syms, _, _ in self.steps]
        return calls, [v(i) for i in self.inputs], [v(o) for o in self.user_outputs]

    def bind(self, inputs: list[torch.Tensor]) -> tuple:
        for bid, t in zip(self.inputs, inputs):
            name = self.buffers[bid]["name"]
            if name in self.input_ranges and t.numel():
                lo, hi = self.input_ranges[name]
                bad = (t < lo) | (t >= hi)
                if bool(bad.any()):
                    raise UserError(f"{name}: value {int(t[bad][0])} is outside [{lo}, {hi}) (vocabulary size {hi})")
        env = {}
        for bid, t in zip(self.inputs, inputs):
            for d, size in zip(self.buffers[bid]["shape"], t.shape):
                if isinstance(d, str) and d in self.symbols:
                    env[d] = int(size)
                elif isinstance(d, str):  # a linear dimension of one symbol (8*seq_blocks): solve for it
                    e = sympy.sympify(d)
                    free = list(e.free_symbols)
                    if len(free) == 1 and free[0].name in self.symbols and free[0].name not in env:
                        poly = sympy.Poly(e, free[0])
                        if poly.degree() == 1:
                            a, b = (int(c) for c in poly.all_coeffs())
                            if (int(size) - b) % a:
                                raise UserError(f"dimension {int(size)} is not of the compiled form {d}")
                            env[free[0].name] = (int(size) - b) // a
        for s, (lo, hi) in self.symbols.items():
            if s not in env:
                raise InternalError(f"symbol {s} is not bound by any input dimension")
            if not lo <= env[s] <= hi:
                raise UserError(f"{s}={env[s]} is outside the compiled range [{lo}, {hi}]")
        return tuple(env[s] for s in self._order)

    def pad(self, inputs: list[torch.Tensor]) -> tuple[list[torch.Tensor], dict[str, int]]:
        """Pad inputs on the right up to the nearest length the program was compiled for.

        A symbolic input dimension may be constrained (traced as ``8*seq_blocks`` with seq_blocks >= 2, or
        ``seq`` >= 4): a shorter or unaligned length is padded with zeros (token id 0) to the smallest size the
        expression takes at or above it. For a causal LM, tokens appended on the right do not change the logits
        of the tokens before them, so the outputs are sliced back (``run`` does it). Returns the padded inputs and
        {dimension expression: original size} for the dimensions that were padded."""
        padded, orig = [], {}
        for bid, t in zip(self.inputs, inputs):
            for axis, d in enumerate(self.buffers[bid]["shape"]):
                if not isinstance(d, str) or d in self.symbols or axis >= t.dim():
                    continue
                e = sympy.sympify(d)
                free = list(e.free_symbols)
                if len(free) != 1 or free[0].name not in self.symbols:
                    continue
                lo, hi = self.symbols[free[0].name]
                size = int(t.shape[axis])
                a, b = sympy.Poly(e, free[0]).all_coeffs() if sympy.Poly(e, free[0]).degree() == 1 else (None, None)
                if a is None or int(a) <= 0:
                    continue
                v = max(lo, -(-(size - int(b)) // int(a)))
                if v > hi:
                    continue  # bind() reports the out-of-range length
                target = int(a) * v + int(b)
                if target != size:
                    pad = [0, 0] * (t.dim() - axis - 1) + [0, target - size]
                    t = torch.nn.functional.pad(t, pad)
                    orig[d] = size
            padded.append(t)
        # a bare symbol with a lower bound (seq >= 4): pad up to it
        for k, (bid, t) in enumerate(zip(self.inputs, padded)):
            for axis, d in enumerate(self.buffers[bid]["shape"]):
                if isinstance(d, str) and d in self.symbols and axis < t.dim():
                    lo, _ = self.symbols[d]
                    size = int(t.shape[axis])
                    if 0 < size < lo:
                        t = torch.nn.functional.pad(t, [0, 0] * (t.dim() - axis - 1) + [0, lo - size])
                        orig[d] = size
            padded[k] = t
        return padded, orig

    def run(self, inputs: list[torch.Tensor], observe=None, slot: int = 0) -> list[torch.Tensor]:
        """Run the steps; ``observe(step_index, node, output_views)`` (debugging, compare) sees each step's
        outputs right after it ran, before the arena reuses their bytes. Inputs shorter than (or not aligned to)
        what the program accepts are padded on the right and the outputs sliced back (see ``pad``)."""
        inputs, orig = self.pad(inputs)
        outs = self._run(inputs, observe, slot)
        if orig:
            res = []
            for bid, o in zip(self.user_outputs, outs):
                for axis, d in enumerate(self.buffers[bid]["shape"]):
                    if isinstance(d, str) and d in orig:
                        o = o.narrow(axis, 0, orig[d])
                res.append(o.contiguous())
            outs = res
        return outs

    def _run(self, inputs: list[torch.Tensor], observe=None, slot: int = 0) -> list[torch.Tensor]:
        if not 0 <= slot < self.state_slots:
            raise InternalError(f"request slot {slot} outside [0, {self.state_slots})")
        env = self.bind(inputs)
        calls, in_views, out_views = self._cache(env, slot)
        for view, t in zip(in_views, inputs):
            if tuple(view.shape) != tuple(t.shape):
                raise UserError(f"input shape {tuple(t.shape)} does not match the program's {tuple(view.shape)}")
            view.copy_(t)
        if observe is None:
            for f, args in calls:
                f(*args)
        else:
            for k, ((f, args), (_, bids, _, node, n_out)) in enumerate(zip(calls, self.steps)):
                f(*args)
                n_in = len(bids) - n_out
                observe(k, node, args[n_in:n_in + n_out])
        return [o.clone() for o in out_views]


def use_all_cores() -> int:
    """TVM's CPU thread pool starts with half the CPUs on x86 (it assumes 2-way SMT), so on a host with one
    thread per core compiled kernels ran on one of two cores. Size it to every CPU this process may use, unless
    the user set TVM_NUM_THREADS. Returns the thread count."""
    import os

    if "TVM_NUM_THREADS" in os.environ:
        return int(tvm.get_global_func("runtime.NumThreads")())
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    tvm.get_global_func("runtime.config_threadpool")(0, n)  # 0: big cores (all of them on a homogeneous CPU)
    return n


class Runtime:
    """A loaded artifact: ``prefill(input_ids) -> logits``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        pfile = self.path / "program.json"
        if not pfile.is_file():
            raise UserError(f"{path}: not a dayzero artifact (no program.json)")
        self.program_json = json.loads(pfile.read_text())
        self.manifest = json.loads((self.path / "weights.json").read_text())
        self.lib = tvm.runtime.load_module(str(self.path / "kernels.so"))
        self.threads = use_all_cores()
        progs = self.program_json["programs"]
        arena_bytes = max(p["memory"]["arena_bytes"] for p in progs.values())
        # torch's CPU allocator aligns large allocations to 64 bytes; checked, since kernels require it
        self.arena = torch.empty(arena_bytes + ALIGN, dtype=torch.uint8)
        shift = (-self.arena.data_ptr()) % ALIGN
        self.arena = self.arena[shift:shift + arena_bytes]
        self.programs = {name: _Program(pj, self.lib, self.arena) for name, pj in progs.items()}
        self._bind_weights()
        for prog in self.programs.values():  # shared states start empty (an expert cache with no valid slot)
            for bid in prog.shared_states.values():
                prog.view(bid, ()).zero_()
        self.lengths: dict[int, int] = {}
        self.pending: dict[int, int | None] = {}  # per slot: the last generated token, not yet in the cache
        # the paged KV pools' free list and block tables (runtime/kv_pages.py); None: contiguous caches
        self.kv = KVPages.of(self.program_json, self.max_batch) if self.stateful else None
        from .multimodal import attach  # image + text artifacts (multimodal.json): runtime/multimodal.py
        self.multimodal = attach(self)
        if self.stateful:
            self.reset()

    def _bind_weights(self) -> None:
        tensors = self.manifest["tensors"]
        ck = self.manifest.get("checkpoint")
        own = self.path / "weights.safetensors"
        handles = {}
        done = set()  # a weight is placed once by name; programs may read different weights (vision, text)
        try:
            for prog, bid, b in ((p, i, b) for p in self.programs.values() for i, b in enumerate(p.buffers)):
                name = b.get("weight")
                if name is None or b.get("alias_of") is not None or name in done:
                    continue
                done.add(name)
                entry = tensors[name]
                dst = prog.view(bid, ())
                if entry["source"] == "artifact":
                    if "own" not in handles:
                        handles["own"] = safe_open(str(own), framework="pt")
                    dst.copy_(handles["own"].get_tensor(name).reshape(dst.shape))
                    continue
                flat = dst.reshape(-1)
                for d0, key, s0, length in entry["runs"]:
                    f = ck["keys"][key]
                    if f not in handles:
                        handles[f] = safe_open(f, framework="pt")
                    src = handles[f].get_slice(key)
                    shape = src.get_shape()
                    row = int(np.prod(shape[1:])) if len(shape) > 1 else 1
                    # read only the rows the run covers (safetensors slices the leading dim without reading more)
                    r0, r1 = s0 // row, -(-(s0 + length) // row)
                    part = src[r0:r1].reshape(-1)
                    off = s0 - r0 * row
                    flat[d0:d0 + length].copy_(part[off:off + length])
        except FileNotFoundError as e:
            raise UserError(f"checkpoint file missing: {e.filename}") from None
        finally:
            handles.clear()

    # -- serving ------------------------------------------------------------------------------------------------
    @property
    def stateful(self) -> bool:
        """True when the artifact has a decode program sharing a KV cache with prefill."""
        return "decode" in self.programs

    @property
    def max_length(self) -> int:
        """Tokens a request may hold in total (prompt + generated): the compiled cache length."""
        prog = self.programs["prefill"]
        return max(hi for lo, hi in prog.symbols.values()) if prog.symbols else 0

    @property
    def max_batch(self) -> int:
        """Requests that can be in flight at once (each has its own KV-cache slot)."""
        return self.programs["prefill"].state_slots

    def reset(self, slot: int | None = None) -> None:
        """Forget the request in a cache slot (all slots when None): states are zero when a request starts."""
        slots = range(self.max_batch) if slot is None else [slot]
        prog = self.programs["prefill"]
        for k in slots:
            for bid in prog.states.values():
                prog.view(bid, (), k).zero_()
            if self.kv is not None:
                self.kv.release(k)
            self.lengths[k] = 0
            self.pending[k] = None

    def run_program(self, name: str, inputs: list[torch.Tensor], slot: int, tokens: int) -> list[torch.Tensor]:
        """Run a program of the request in ``slot``, which holds ``tokens`` positions once it ran: their KV blocks
        are taken first (runtime/kv_pages.py; a full pool is a UserError for this request), and the slot's block
        table is passed to a program that reads paged caches."""
        prog = self.programs[name]
        if self.kv is None or not prog.table_inputs:
            return prog.run(inputs, slot=slot)
        self.kv.ensure(slot, tokens)
        out = prog.run(list(inputs) + [self.kv.table(t, slot) for t in prog.table_inputs], slot=slot)
        self.kv.trim(slot, tokens)  # sliding-window pools: blocks the next query cannot see go back
        return out

    @property
    def tokenizer(self):
        """The artifact's tokenizer (runtime/text.py), None when it carries none; loaded on first use."""
        if not hasattr(self, "_tokenizer"):
            from .text import load_tokenizer

            self._tokenizer = load_tokenizer(self.path)
        return self._tokenizer

    @property
    def eos_ids(self) -> list[int]:
        """Token ids that end a generation: the tokenizer's end-of-sequence token ([] without a tokenizer)."""
        tok = self.tokenizer
        return [] if tok is None or tok.eos_token_id is None else [int(tok.eos_token_id)]

    @property
    def length(self) -> int:
        return self.lengths.get(0, 0)

    @staticmethod
    def _ids(input_ids) -> torch.Tensor:
        ids = torch.as_tensor(np.asarray(input_ids) if not isinstance(input_ids, torch.Tensor) else input_ids)
        if ids.dim() == 0:
            ids = ids[None]
        if ids.dim() == 1:
            ids = ids[None]
        ids = ids.to(torch.int64)
        if ids.numel() == 0:
            raise UserError("empty prompt: give at least one token id")
        return ids

    def prefill(self, input_ids, slot: int = 0, append: bool = False) -> torch.Tensor:
        """Logits [1, P, V] of the prompt; on a stateful artifact it also starts a request in cache slot
        ``slot`` (fills its cache). ``append=True`` adds the tokens to the request already in the slot (a second
        turn of a conversation): positions continue after its history, which is read from the cache, never
        prefilled again."""
        if self.multimodal is not None:
            return self.multimodal.prefill(input_ids, slot=slot)
        ids = self._ids(input_ids)
        prog = self.programs["prefill"]
        if not self.stateful:
            return prog.run([ids])[0]
        n = ids.shape[1]
        start = self.lengths.get(slot, 0) if append else 0
        if append and start == 0:
            raise UserError("nothing to append to: start the request with prefill(prompt_ids)")
        if start + n > self.max_length:
            raise UserError(f"prompt of {n} tokens after {start} cached ones is longer than the compiled "
                            f"maximum {self.max_length}")
        (padded, _), _ = prog.pad([ids, torch.zeros(n, dtype=torch.int64)])
        # padding tokens sit at positions after the prompt (written to the cache, never attended: decode
        # overwrites them)
        width = padded.shape[-1]
        if start + width > self.max_length:
            raise UserError(f"the request reached the cache budget of {self.max_length} tokens")
        padded_ids = torch.nn.functional.pad(ids, [0, width - n])
        if not append:
            self.reset(slot)
        logits = self.run_program("prefill", [padded_ids, torch.arange(start, start + width)], slot,
                                  start + n)[0][:, :n]
        self.lengths[slot] = start + n
        return logits.contiguous()

    def decode(self, token_id, slot: int = 0) -> torch.Tensor:
        """Logits [1, 1, V] after appending one token to the request in ``slot``; reads and extends its cache."""
        if not self.stateful:
            raise UserError("this artifact has no decode program (its model's cache has no static form): "
                            "generation is not available for it")
        length = self.lengths.get(slot, 0)
        if length == 0:
            raise UserError("decode before prefill: start a request with prefill(prompt_ids)")
        if length >= self.max_length:
            raise UserError(f"the request reached the cache budget of {self.max_length} tokens")
        if self.multimodal is not None:
            return self.multimodal.decode(token_id, slot=slot)
        ids = self._ids(token_id).reshape(1, 1)
        out = self.run_program("decode", [ids, torch.tensor([length])], slot, length + 1)[0]
        self.lengths[slot] = length + 1
        return out

    def generate(self, prompt_ids, max_new_tokens: int = 32, stop_ids=(), temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, images=None, slot: int = 0, append: bool = False) -> list[int]:
        """Prefill the prompt, then decode up to ``max_new_tokens`` tokens (greedy when temperature is 0, else
        temperature + nucleus sampling with a seeded generator); stops after a token in ``stop_ids``.
        ``images`` (paths, PIL images, arrays) join the prompt at its image tokens (multimodal artifacts).
        ``append=True`` continues the conversation in ``slot``: its history (including the last generated token)
        stays in the cache and only the new turn is prefilled."""
        if self.multimodal is not None:
            return self.multimodal.generate(prompt_ids, max_new_tokens, images or (), stop_ids, temperature,
                                            top_p, seed)
        if images:
            raise UserError("this artifact has no vision program: images need a multimodal checkpoint")
        if max_new_tokens < 0:
            raise UserError("max_new_tokens must be >= 0")
        ids = self._ids(prompt_ids)
        if append and self.pending.get(slot) is not None:  # the last generated token is not in the cache yet
            ids = torch.cat([torch.tensor([[self.pending[slot]]]), ids], dim=1)
        history = self.lengths.get(slot, 0) if append else 0
        if history + ids.shape[1] + max_new_tokens > self.max_length:
            raise UserError(f"prompt ({ids.shape[1]}) + max_new_tokens ({max_new_tokens}) exceeds the compiled "
                            f"maximum of {self.max_length} tokens")
        gen = torch.Generator().manual_seed(seed)
        logits = self.prefill(ids, slot=slot, append=append)[0, -1]
        self.pending[slot] = None
        out: list[int] = []
        stops = set(int(s) for s in stop_ids)
        for k in range(max_new_tokens):
            tok = _pick(logits, temperature, top_p, gen)
            out.append(tok)
            if tok in stops or k == max_new_tokens - 1:
                self.pending[slot] = tok  # sampled, not yet written to the cache
                break
            logits = self.decode(tok, slot=slot)[0, -1]
        return out

    def run(self, *inputs) -> list[torch.Tensor]:
        """Run the prefill program on generic inputs (ONNX models: any names, dtypes, ranks), given in the
        program's input order; symbols bind from their shapes. Returns every output."""
        prog = self.programs["prefill"]
        if len(inputs) != len(prog.inputs):
            raise UserError(f"the program takes {len(prog.inputs)} inputs, got {len(inputs)}")
        ts = [x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x)) for x in inputs]
        return prog.run(ts)

def generate_batch(rt: "Runtime", prompts: list, max_new_tokens: int = 32, stop_ids=(), temperature: float = 0.0,
                   top_p: float = 1.0, seed: int = 0) -> list[dict]:
    """Serve several requests at once, each in its own KV-cache slot, decode steps interleaved.

    A request that fails (empty prompt, a token outside the vocabulary, a prompt longer than the compiled maximum,
    a request beyond the cache budget) gets its error; the others keep going. Returns per request
    ``{"tokens": [...], "error": str | None}``."""
    if len(prompts) > rt.max_batch:
        raise UserError(f"{len(prompts)} requests but the artifact serves {rt.max_batch} at once (--max-batch)")
    results = [{"tokens": [], "error": None} for _ in prompts]
    logits: dict[int, torch.Tensor] = {}
    gens = {}
    for k, prompt in enumerate(prompts):
        try:
            ids = rt._ids(prompt)
            if ids.shape[1] + max_new_tokens > rt.max_length:
                raise UserError(f"prompt ({ids.shape[1]}) + max_new_tokens ({max_new_tokens}) exceeds the "
                                f"cache budget of {rt.max_length} tokens")
            logits[k] = rt.prefill(ids, slot=k)[0, -1]
            gens[k] = torch.Generator().manual_seed(seed + k)
        except UserError as e:
            results[k]["error"] = str(e)
            if rt.stateful:
                rt.reset(k)  # its KV blocks go back to the pool for the others
    def step(tok, k):
        try:
            return rt.decode(tok, slot=k)[0, -1]
        except UserError:
            rt.reset(k)  # a request that failed (the KV pool is full) frees its blocks for the others
            raise
    decode_interleaved(results, logits, gens, step, max_new_tokens, stop_ids, temperature, top_p)
    return results


def decode_interleaved(results: list[dict], logits: dict, gens: dict, step, max_new_tokens: int, stop_ids,
                       temperature: float, top_p: float, raise_errors: bool = False) -> None:
    """One decode step per live request in turn until each stops; ``step(token, k) -> next logits`` of request k.
    A request whose step raises a UserError records it and drops out (others keep going)."""
    stops = set(int(s) for s in stop_ids)
    active = sorted(k for k in logits if max_new_tokens > 0)
    while active:
        still = []
        for k in active:
            tok = _pick(logits[k], temperature, top_p, gens[k])
            results[k]["tokens"].append(tok)
            if tok in stops or len(results[k]["tokens"]) >= max_new_tokens:
                continue
            try:
                logits[k] = step(tok, k)
                still.append(k)
            except UserError as e:
                if raise_errors:
                    raise
                results[k]["error"] = str(e)
        active = still


def _pick(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < top_p  # the smallest prefix whose mass reaches top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=gen))


def load(path: str | Path) -> Runtime:
    return Runtime(path)
