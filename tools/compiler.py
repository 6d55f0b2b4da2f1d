"""The dayzero compiler on one screen: MODEL + ``CompileOptions`` -> artifact directory, every step in order.

    trace            frontend/trace.py: MODEL -> Frontend (the traced prefill, decode and vision_* graphs, the
                     checkpoint and its recipes); a checkpoint's non-finite weights are refused here
    programs         prefill, decode (a model whose KV cache dayzero owns), decode_batch (the prefill graph with
                     one token per request; DeepSeek-V4: the traced row step, its states as inputs and outputs),
                     vision_TxHxW (multimodal): each goes through GRAPH_STEPS, the phases
                     canonicalize -> identify patterns (cache writes made in place first: the attention
                     patterns read them) -> specialise -> lay out state -> fuse (``dayzero dump-ir`` writes
                     the graph after every step as <program>/NNN_<step>.ir)
    lower            codegen/program.py: graph -> Program (kernel nodes, steps, buffers)
    schedule         codegen/schedule.py + build.py, per kernel the first that applies: hand-scheduled -> tuned
                     (a tuning record; ``--tune`` makes missing ones) -> default; one compiled library
    plan memory      codegen/memory.py: every program's buffers -> one arena
    write            codegen/artifact.py: kernels.so, program.json, weights.json, report.json (atomic)

Every step returns what it produced; ``compile_artifact`` and ``run_steps`` merge it (no shared context written
by one step and read by another). Nothing is written until every step before ``write`` succeeded.
"""

from __future__ import annotations

import logging
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from dayzero import InternalError, UserError
from dayzero.codegen import artifact, tuning
from dayzero.codegen.build import build_library, export_library
from dayzero.codegen.kernels.dequant.gemv_int8 import int8_mode
from dayzero.codegen.memory import plan_programs
from dayzero.codegen.program import Program, build_program, program_json
from dayzero.codegen.tuner import tune_kernels
from dayzero.frontend.checkpoint import bound_tensors, first_nonfinite
from dayzero.frontend.trace import DEFAULT_MAX_SEQ, Frontend, batched_decode_input, trace_model
from dayzero.frontend.trace_cache import cache_root
from dayzero.passes import expert_workspace as ew
from dayzero.passes.compressed_attention import compressed_attention
from dayzero.passes.dequant import dequant
from dayzero.passes.dequant_bf16 import dequant_bf16
from dayzero.passes.fold_constants import fold_constants
from dayzero.passes.fold_empty import fold_empty
from dayzero.passes.fuse import fuse
from dayzero.passes.inplace_input import inplace_input
from dayzero.passes.inplace_state import inplace_state
from dayzero.passes.last_position import LAST_PROGRAM, last_position
from dayzero.passes.ir.collective import Mesh
from dayzero.passes.ir.dayzero_ops import BLOCK_TABLE
from dayzero.passes.ir.node import Graph, Node, users
from dayzero.passes.ir.text import print_graph
from dayzero.passes.ir.verify import verify as verify_graph
from dayzero.passes.memory_plan import PER_REQUEST_ZONES
from dayzero.passes.moe import moe
from dayzero.passes.paged_kv import ZONE as PAGED_ZONE, paged_kv
from dayzero.passes.pipeline import Found
from dayzero.passes.shard import shard
from dayzero.passes.sparse_attention import sparse_attention
from dayzero.passes.token_positions import first_position_reads, token_positions
from dayzero.targets.host import host_target_dict
from dayzero.targets.spec import COMPUTE_DTYPES, HOST_COMPUTE_DTYPE, load_target_spec

DEFAULT_PREFILL_CHUNK = 512  # tokens per prefill call (capped at max_seq): the prefill arena is sized by it
DEFAULT_KV_BLOCK = 16  # tokens per KV-cache block (passes/paged_kv.py)
DECODE_PROGRAMS = ("decode", "decode_batch")  # the programs --int8-activations applies to (prefill stays exact)

logger = logging.getLogger(__name__)


# ---- the options, validated once ------------------------------------------------------------------------------

@dataclass(frozen=True)
class CompileOptions:
    """Everything a compile depends on besides MODEL and OUT (the ``dayzero compile`` flags).

    ``prefill_chunk`` tokens at most per prefill call (default ``min(max_seq, 512)``) of a model whose KV cache
    dayzero owns: the runtime prefills a longer prompt chunk by chunk, and the arena is sized by the chunk.
    ``kv_block_size`` tokens per KV-cache block (0: one contiguous cache per request slot) and ``kv_blocks``
    blocks per pool (default: ``max_batch`` requests of ``max_seq`` tokens, plus the scratch block).
    ``compute_dtype`` (fp32 | bf16 | fp8_e4m3 | a target spec), ``expert_route`` (auto | fused | workspace) and
    ``expert_cache_bytes`` (LRU budget of converted experts) choose how MXFP4 experts run (expert_workspace).
    ``int8_activations``: the decode programs' MXFP4 experts (fused route) run on integers (x and the GEMMs'
    intermediate rounded to int8 per 32-block; codegen/kernels/moe.py), on a target with an integer mode.
    A checkpoint float weight holding NaN/Inf is an error unless ``allow_nonfinite``.

    Construction validates every value (one ``UserError`` line naming the flag) and resolves the derived ones:
    ``target_dict``, ``expert_dtype`` (the resolved compute dtype), ``route`` and ``chunk``."""

    target: str | dict = "host"
    max_seq: int = DEFAULT_MAX_SEQ
    max_batch: int = 4
    prefill_chunk: int | None = None
    kv_block_size: int = DEFAULT_KV_BLOCK
    kv_blocks: int | None = None
    image_grids: tuple | None = None
    verify: bool = False
    tune: int | None = None
    tune_minutes: float | None = None
    tuning_dir: str | None = None
    trace_cache: str | None = None
    compute_dtype: str | None = None
    expert_route: str = "auto"
    expert_cache_bytes: int = 0
    int8_activations: bool = False
    allow_nonfinite: bool = False
    tp: int = 1
    ep: int = 1
    target_dict: dict = field(init=False, repr=False)
    expert_dtype: str = field(init=False, repr=False)
    route: str = field(init=False, repr=False)
    chunk: int = field(init=False, repr=False)

    def __post_init__(self):
        if self.max_seq < 1:
            raise UserError("--max-seq must be at least 1")
        if self.tune_minutes is not None and self.tune_minutes <= 0:
            raise UserError("--tune-minutes must be positive")
        if self.tune and self.tune < 1:
            raise UserError("--tune needs at least 1 trial")
        tgt = resolve_target(self.target)
        dtype = resolve_compute_dtype(self.compute_dtype, tgt)
        route = ew.route_for(compute_dtype=ew.compute_dtype_of(dtype), cache_bytes=int(self.expert_cache_bytes),
                             route=self.expert_route, target_kind=tgt.get("kind", "llvm"))
        if self.int8_activations:
            if route != "fused":
                raise UserError("--int8-activations runs the fused MXFP4 expert kernel: drop --expert-route "
                                "workspace / --expert-cache / a non-fp32 --compute-dtype")
            if int8_mode(tgt) is None:
                raise UserError(f"--int8-activations needs a host CPU target with AVX2 or AVX512-VNNI, got {tgt}")
        if self.max_batch < 1:
            raise UserError("--max-batch must be at least 1")
        Mesh.of(tp=self.tp, ep=self.ep)  # positive sizes
        if self.kv_block_size < 0:
            raise UserError("--kv-block-size must be >= 0 (0: contiguous caches)")
        if self.kv_blocks is not None and self.kv_blocks < 2:
            raise UserError("--kv-blocks must be at least 2 (block 0 is the scratch block)")
        if self.prefill_chunk is not None and not 1 <= self.prefill_chunk <= self.max_seq:
            raise UserError(f"--prefill-chunk must be in [1, --max-seq={self.max_seq}], got {self.prefill_chunk}")
        for name, value in (("target_dict", tgt), ("expert_dtype", dtype), ("route", route),
                            ("chunk", self.prefill_chunk or min(self.max_seq, DEFAULT_PREFILL_CHUNK)),
                            ("image_grids", tuple(self.image_grids) if self.image_grids else None),
                            ("expert_cache_bytes", int(self.expert_cache_bytes))):
            object.__setattr__(self, name, value)

    @property
    def mesh(self) -> Mesh:
        """The device mesh the artifact is sharded over (passes/shard.py): tp x ep ranks."""
        return Mesh.of(tp=self.tp, ep=self.ep)

    def experts(self) -> dict:
        """The report's ``experts`` entry (before the routes each program took)."""
        return {"compute_dtype": self.expert_dtype, "route": self.expert_route, "cache_bytes": self.expert_cache_bytes,
                "int8_activations": bool(self.int8_activations)}

    def kv_pages(self, fe: Frontend) -> dict | None:
        """passes/paged_kv.py's configuration, or None: caches stay contiguous (no decode, or block size 0)."""
        if fe.decode is None or not self.kv_block_size:
            return None
        return {"block_size": self.kv_block_size, "blocks": self.kv_blocks, "max_batch": self.max_batch,
                "chunk": self.chunk}


def resolve_target(target: str | dict) -> dict:
    if isinstance(target, dict):
        return target
    if target in ("host", "llvm", "cpu"):
        return host_target_dict()
    if target.startswith("cuda"):
        arch = target.partition(":")[2] or "sm_90"
        return {"kind": "cuda", "arch": arch}
    raise UserError(f"unknown target {target!r} (use host or cuda[:sm_90])")


def resolve_compute_dtype(compute_dtype: str | None, target: dict) -> str:
    """The dtype low-precision experts are computed in: given (fp32 | bf16 | fp8_e4m3, or a target spec name /
    path whose ``compute_dtype`` is taken), else the compile target's own (the host CPU: fp32)."""
    if compute_dtype is None:
        return HOST_COMPUTE_DTYPE
    if compute_dtype in COMPUTE_DTYPES:
        return compute_dtype
    try:
        return load_target_spec(compute_dtype).compute_dtype
    except UserError as e:
        raise UserError(f"--compute-dtype {compute_dtype!r} is neither one of {', '.join(COMPUTE_DTYPES)} nor a "
                        f"usable target spec ({e})") from None


# ---- the graph steps of every program -------------------------------------------------------------------------

@dataclass(frozen=True)
class StepEnv:
    """What a program's graph steps read: fixed for the program, except ``constants`` (the folded tensors so far,
    which ``run_steps`` extends between steps; steps never write it)."""
    constants: Mapping[str, torch.Tensor]
    kv_pages: dict | None = None  # passes/paged_kv.py's configuration (None: contiguous caches)
    token_positions: bool = False  # decode_batch: each token is another request's, at its own position
    route: str = "fused"  # MXFP4 experts: "workspace" rewrites them (expert_workspace)
    expert_dtype: str = HOST_COMPUTE_DTYPE
    expert_cache_bytes: int = 0
    int8_activations: bool = False  # MXFP4 experts on the integer tiles (the decode programs, --int8-activations)
    mesh: Mesh = Mesh()  # the device mesh (passes/shard.py); one rank by default


Step = Callable[[Graph, StepEnv], "tuple[Graph, Found]"]


def _expert_workspace(g: Graph, env: StepEnv) -> tuple[Graph, Found]:
    if env.route != "workspace":
        return g, Found()
    return ew.expert_workspace(g, compute_dtype=ew.compute_dtype_of(env.expert_dtype),
                               cache_bytes=env.expert_cache_bytes)


# every step: (graph, env) -> (graph, what the pass found), calling the pass with what it reads from env
GRAPH_STEPS: tuple[tuple[str, Step], ...] = (
    # -- canonicalize ----------------------------------------------------------------------------------------------
    ("fold_empty", lambda g, env: (fold_empty(g), Found())),  # before fold_constants: it leaves empties alone
    ("fold_constants", lambda g, env: fold_constants(g)),
    # -- identify patterns ---------------------------------------------------------------------------------------
    ("moe", lambda g, env: moe(g, env.constants)),  # routed experts -> moe_experts (grouped GEMM, routed only)
    ("dequant", lambda g, env: dequant(g, env.constants)),  # MXFP4 / FP8 chains -> fused dequant kernels
    # -- distribute over the device mesh ---------------------------------------------------------------------------
    ("shard", lambda g, env: shard(g, env.mesh, env.constants)),  # experts over ep, heads / MLPs / vocab over tp
    ("dequant_bf16", lambda g, env: dequant_bf16(g)),  # after shard: each rank's bf16 slices read as stored
    # -- lay out state: cache writes in place ----------------------------------------------------------------------
    ("inplace_state", lambda g, env: inplace_state(g)),
    ("inplace_input", lambda g, env: inplace_input(g)),  # scatters into a program input's own copy
    # -- identify patterns that read the in-place cache ----------------------------------------------------------
    ("sparse_attention", lambda g, env: sparse_attention(g, env.constants)),  # after inplace_state
    ("compressed_attention", lambda g, env: compressed_attention(g, env.constants)),  # after sparse_attention
    # -- specialise ----------------------------------------------------------------------------------------------
    ("expert_workspace", _expert_workspace),  # MXFP4 experts on the workspace route (--expert-route)
    ("int8_activations", lambda g, env: ew.int8_activations(g) if env.int8_activations else (g, Found())),
    # -- lay out state: positions and pages ----------------------------------------------------------------------
    # decode_batch only: each token at its own position
    ("token_positions", lambda g, env: token_positions(g, env.token_positions)),
    ("paged_kv", lambda g, env: paged_kv(g, env.kv_pages, env.token_positions)),  # after the attention ops exist
    # -- fuse: one kernel per element-wise / reduction group ------------------------------------------------------
    ("fuse", lambda g, env: fuse(g)),  # last: every pattern pass above matches the unfused ops
)


def run_steps(g: Graph, env: StepEnv, verify: bool = False, dump_dir: str | Path | None = None
              ) -> tuple[Graph, Found]:
    """GRAPH_STEPS on one program's graph; the verifier after every step when ``verify``; ``dump_dir`` gets
    ``000_trace.ir`` and ``NNN_<step>.ir`` after each."""
    dump = Path(dump_dir) if dump_dir is not None else None
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
        (dump / "000_trace.ir").write_text(print_graph(g))
    if verify:
        verify_graph(g)
    found = Found()
    constants = dict(env.constants)  # what the steps so far folded: each step reads it, the loop extends it
    env = replace(env, constants=constants)
    for k, (name, step) in enumerate(GRAPH_STEPS, start=1):
        g, made = step(g, env)
        found.merge(made)
        constants.update(made.constants)
        if verify:
            verify_graph(g)
        if dump is not None:
            (dump / f"{k:03d}_{name}.ir").write_text(print_graph(g))
    return g, found


def run_pipeline(g: Graph, kv_pages: dict | None = None, verify: bool = False) -> tuple[Graph, Found]:
    """GRAPH_STEPS on ``g`` with the default options (experts stay fused, caches contiguous unless ``kv_pages``):
    for tests of the passes. Returns the graph and what the steps found."""
    return run_steps(g, StepEnv({}, kv_pages), verify)


def per_request_states(g: Graph) -> str:
    """Why ``g`` cannot serve several requests in one run: the states it keeps per request slot ("" if none)."""
    names = sorted(n.attr["name"] for n in g.nodes()
                   if n.op == "state" and n.attr.get("zone", "kv_cache") in PER_REQUEST_ZONES)
    return f"states kept per request slot, not paged: {', '.join(names[:4])}" if names else ""


def batched_refusal(g: Graph) -> str:
    """Why the batched decode graph (after its steps) cannot be the ``decode_batch`` program ("" if it can): a
    state kept per request slot, a read of the first position other than through the cache, no paged cache."""
    why = per_request_states(g)
    if why:
        return why
    if first_position_reads(g):
        return "the step reads the first token's position outside the cache ops"
    if not any(n.attr.get("kind") == BLOCK_TABLE for n in g.inputs):
        return "no paged KV cache"
    return ""


def rows_refusal(g: Graph, decode: Graph) -> str:
    """Why ``g`` (after its steps) cannot be the row-batched ``decode_batch`` program of the decode program
    ``decode`` ("" if it can): it must keep no state, take ``input_ids``, ``positions`` and then exactly the
    decode program's states (the runtime gathers each request's into its row) and return one new value each."""
    if any(n.op == "state" for n in g.nodes()):
        return "the batched step keeps states of its own"
    names = [n.attr.get("name") for n in g.inputs]
    states = sorted(n.attr["name"] for n in decode.nodes()
                    if n.op == "state" and n.attr.get("zone", "kv_cache") in (*PER_REQUEST_ZONES, PAGED_ZONE))
    if names[:2] != ["input_ids", "positions"] or sorted(names[2:]) != states or len(g.outputs) != len(names) - 1:
        return "the batched step's inputs are not the decode program's states"
    return ""


def rows_held(g: Graph, kv_pages: dict) -> int:
    """The rows of a paged state the row-batched step takes per request (frontend/decode_export.py
    ``RowDecodeStep``: the window ending at its token), the same for every paged state."""
    paged = {s for t in kv_pages["tables"] for s in t["states"]}
    held = {int(n.shape[2]) for n in g.inputs if n.attr.get("name") in paged}
    if len(held) != 1:
        raise InternalError(f"the row-batched decode step holds {sorted(held)} rows of its paged states")
    return held.pop()


# the kernels that read a compressed-entries state only below the causal bound (entry e for a query at position p
# iff e < (p + 1) // rate), by the argument they read it as; and the ops a state passes through on the way
ENTRY_READERS = {"compressed_attention": 3, "dsa_indexer_topk": 2}
_ENTRY_PATH = {"scatter_inplace": 0, "scatter.src": 0, "clone": 0, "unsqueeze": 0}


def rows_entries(g: Graph, layout: list[dict]) -> dict[str, int]:
    """{input: compress rate} for the row-batched step's compressed-entries states (``layout``: the frontend's
    cache layout) that are read only by ENTRY_READERS, written by one scatter along the entry dim and returned: a
    request at position p then needs only the rows [0, p // rate] of such a state gathered, and back only row
    p // rate (the one its step wrote). Any other reader (a generic op over every row) keeps the state whole."""
    rates = {d["buffer"]: int(d["compress_rate"]) for d in layout if d.get("compress_rate")}
    use = users(g)
    returned = {id(o) for o in g.outputs}
    return {n.attr["name"]: rates[n.attr["name"]] for n in g.inputs
            if n.attr.get("name") in rates and n.type.ndim == 3 and _entries_read_bounded(n, use, returned)}


def _entries_read_bounded(n: Node, use: dict, returned: set) -> bool:
    """Every path from ``n`` runs through _ENTRY_PATH ops (one scatter along dim 1) into ENTRY_READERS, and the
    scattered value is returned."""
    writes, is_returned, todo = 0, False, [n]
    while todo:
        v = todo.pop()
        is_returned |= id(v) in returned and v is not n
        for u in use.get(id(v), []):
            at = [i for i, x in enumerate(u.inputs) if x is v]
            if u.op in ENTRY_READERS and at == [ENTRY_READERS[u.op]]:
                continue
            if u.op not in _ENTRY_PATH or at != [_ENTRY_PATH[u.op]]:
                return False
            if u.op.startswith("scatter"):
                if u.attr.get("dim") not in (1, -2):
                    return False
                writes += 1
            todo.append(u)
    return writes == 1 and is_returned


@dataclass
class Programs:
    """The compiler's programs after their graph steps and lowering, in build order."""
    graphs: dict[str, Graph]
    programs: list[Program]
    constants: dict[str, torch.Tensor]
    patterns: dict[str, dict[str, int]]  # program -> pattern -> matches
    kv_pages: dict | None  # the resolved paged KV layout (report, program.json)
    decode_batch: dict | None  # {"built", "reason"} when a batched decode program was considered
    seconds: dict[str, float] = field(default_factory=lambda: {"graph_steps_s": 0.0, "lower_s": 0.0})


def build_programs(fe: Frontend, options: CompileOptions, verify: bool = False, dump_dir: str | Path | None = None
                   ) -> Programs:
    """Every program of the artifact through GRAPH_STEPS, then lowered (an unsupported op raises here, before
    anything is written). ``dump_dir``: <dump_dir>/<program>/NNN_<step>.ir."""
    cfg = options.kv_pages(fe)
    res = Programs({}, [], {}, {}, None, None)
    shared: dict = {}  # kernels shared by the programs

    def build(name: str, g: Graph, kv_pages: dict | None = None, per_token: bool = False,
              accept: Callable[[Graph], str] | None = None) -> str:
        env = StepEnv(res.constants, kv_pages, per_token, options.route, options.expert_dtype,
                      options.expert_cache_bytes, options.int8_activations and name in DECODE_PROGRAMS, options.mesh)
        with _timed(res.seconds, "graph_steps_s", add=True):
            g, found = run_steps(g, env, verify, Path(dump_dir) / name if dump_dir is not None else None)
        res.constants.update(found.constants)
        why = accept(g) if accept is not None else ""
        if why:
            return why
        res.patterns[name] = found.patterns
        if not per_token and found.kv_pages is not None:
            res.kv_pages = found.kv_pages
        res.graphs[name] = g
        with _timed(res.seconds, "lower_s", add=True):
            res.programs.append(build_program(g, name, shared))
        return ""

    build("prefill", fe.traced.graph, cfg)
    if fe.decode is not None and not fe.extra:  # generation's prefill: the last position's logits only
        last, why = last_position(fe.traced.graph)
        if last is not None:
            build(LAST_PROGRAM, last, cfg)
        else:
            logger.info("no %s program: %s", LAST_PROGRAM, why)
    if fe.decode is not None:
        build("decode", fe.decode.graph, cfg)
    if fe.decode is not None and cfg:
        why = per_request_states(res.graphs["decode"])  # the decode step's own states already tell (DeepSeek-V4)
        if why and fe.decode_rows is not None:  # DeepSeek-V4: its states pass through the batched step's rows
            decode = res.graphs["decode"]
            why = build("decode_batch", fe.decode_rows.graph, accept=lambda g: rows_refusal(g, decode))
            if not why and res.kv_pages is not None:
                res.kv_pages = dict(res.kv_pages, row_window=rows_held(res.graphs["decode_batch"], res.kv_pages),
                                    row_entries=rows_entries(res.graphs["decode_batch"], fe.cache_layout))
        elif why and fe.decode_rows_error:
            why = f"{why}; the batched row step did not trace: {fe.decode_rows_error}"
        elif not why:
            gb, why = batched_decode_input(fe.traced.graph, options.max_batch)
            if gb is not None:
                why = build("decode_batch", gb, cfg, per_token=True, accept=batched_refusal)
        res.decode_batch = {"built": not why, "reason": why or None}
    for name, t in fe.extra.items():  # vision programs of a multimodal checkpoint, one per image grid
        build(name, t.graph)
    return res


# ---- the whole compiler ----------------------------------------------------------------------------------------

def trace(model: Any, options: CompileOptions) -> Frontend:
    """MODEL -> Frontend; refuses a checkpoint whose float weights hold NaN/Inf unless ``allow_nonfinite``."""
    fe = trace_model(model, options.max_seq, image_grids=options.image_grids, prefill_chunk=options.chunk,
                     trace_cache=options.trace_cache, max_batch=options.max_batch)
    if fe.checkpoint is not None and not options.allow_nonfinite:
        bad = first_nonfinite(fe.checkpoint, {k for runs in fe.recipes.values() for _, k, _, _ in runs})
        if bad is not None:
            raise UserError(bad)
    return fe


@contextmanager
def _timed(times: dict, key: str, add: bool = False):
    """``times[key]``: the seconds the block took (``add``: added to what is there)."""
    t0 = time.perf_counter()
    yield
    times[key] = (times[key] if add else 0.0) + time.perf_counter() - t0


def compile_artifact(model: Any, out: str | Path, options: CompileOptions) -> dict:
    """Compile MODEL into the artifact directory OUT; returns the report, whose ``seconds`` are the phases in order:
    trace_s (torch.export, or the trace cache), passes_s (graph_steps_s + lower_s: every program's GRAPH_STEPS,
    then its kernels as TIR), [tune_s], codegen_s (schedule_s + compile_s: each distinct kernel scheduled, then
    compiled to machine code, or taken from the kernel cache), plan_s (memory), write_s (the link of kernels.so,
    the JSON and weight files) and total_s."""
    times: dict[str, Any] = {}
    t_start = time.perf_counter()
    writer = artifact.ArtifactWriter(out)  # refuses an OUT that is not a previous artifact before any work
    with _timed(times, "trace_s"):
        fe = trace(model, options)
    with _timed(times, "passes_s"):  # canonicalize -> identify patterns -> specialise -> lay out state -> lower
        ps = build_programs(fe, options, verify=options.verify)
        check_shared_states(ps.programs)
    times.update(ps.seconds)
    db = tuning.TuningDatabase(options.tuning_dir)  # schedule: hand-scheduled -> tuned -> default
    if options.tune:
        t0 = time.perf_counter()
        times["tuned_kernels"] = tune_program(ps.programs[0], options.target_dict, db, options.tune,
                                              options.tune_minutes)
        times["tune_s"] = time.perf_counter() - t0
    with _timed(times, "codegen_s"):
        compile_cache = cache_root(options.trace_cache)
        lib, build_stats = build_library(ps.programs, options.target_dict, db,
                                         compile_cache / "kernels" if compile_cache is not None else None)
    times.update(schedule_s=build_stats["schedule_s"], compile_s=build_stats["compile_s"])
    try:
        with _timed(times, "plan_s"):
            layout = plan_programs(ps.programs, slots=options.max_batch if fe.decode is not None else 1)
        with _timed(times, "write_s"):
            report = write_artifact(writer, fe, options, ps, lib, build_stats, layout)
    finally:
        lib.close()
    times["total_s"] = time.perf_counter() - t_start
    report["seconds"] = times
    return report


def check_shared_states(progs: list[Program]) -> None:
    """A state is one tensor shared by the programs: the same zone and shape in each."""
    states: dict[str, tuple] = {}
    for p in progs:
        for b in p.buffers:
            if b.state is not None and b.alias_of is None:
                seen = states.setdefault(b.state, (b.zone, tuple(b.shape), p.name))
                if seen[:2] != (b.zone, tuple(b.shape)):
                    raise InternalError(f"state {b.state} is {seen[0]}{list(seen[1])} in {seen[2]} but "
                                        f"{b.zone}{list(b.shape)} in {p.name}")


def tune_program(prog: Program, target: dict, db, trials: int, minutes: float | None) -> int:
    """Tune the program's tunable kernels that have no record, with a rich progress bar on stderr."""
    import logging

    import tvm
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    logging.getLogger("tvm.s_tir.meta_schedule").setLevel(logging.WARNING)
    symbols = {s: (lo, hi) for s, lo, hi in prog.symbols}
    with Progress(TextColumn("tuning {task.fields[kernel]}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("best {task.fields[best]}"), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("tune", total=trials, kernel="", best="-")

        def progress(kernel, n, best):
            bar.update(task, completed=min(n, trials), kernel=kernel,
                       best=f"{best * 1e6:.1f} us" if best else "-")
        done = tune_kernels(list(prog.kernels.values()), tvm.target.Target(target), db, symbols, trials, minutes,
                            progress)
    return len(done)


def weights_manifest(fe: Frontend, graphs: list[Graph], constants: Mapping[str, torch.Tensor]
                     ) -> tuple[dict, dict[str, torch.Tensor]]:
    """name -> where its bytes come from; plus the tensors the artifact must carry itself."""
    entries, own, shards = {}, {}, {}
    for n in (n for g in graphs for n in g.nodes()):
        if n.op != "weight":
            continue
        name = n.attr["name"]
        meta = {"dtype": n.dtype, "shape": list(n.shape)}
        if name in shards and shards[name] != n.attr.get("shard"):  # a rank binds one slice for every program
            raise InternalError(f"weight {name} is split {shards[name]} in one program and {n.attr.get('shard')} "
                                "in another (passes/shard.py matched a block in one program only)")
        shards[name] = n.attr.get("shard")
        if name in fe.recipes and "shard" in n.attr:  # each group rank binds its own slice (passes/shard.py)
            group, dim, parts, *blocks = n.attr["shard"]  # blocks: a fused projection's (passes/shard._sliced)
            full = tuple(d * parts if k == dim else d for k, d in enumerate(n.shape))
            sh = {"group": group, "dim": dim, "parts": parts, **({"blocks": blocks[0]} if blocks else {})}
            runs = [[list(r) for r in shard_runs(fe.recipes[name], full, dim, parts, i, *blocks)] for i in range(parts)]
            entries[name] = dict(meta, source="checkpoint", shard=sh, shard_runs=runs)
        elif "shard" in n.attr:
            raise InternalError(f"weight {name} is split over ranks but is no checkpoint tensor (only checkpoint "
                                "tensors are read in slices)")
        elif name in fe.recipes:
            entries[name] = dict(meta, source="checkpoint", runs=[list(r) for r in fe.recipes[name]])
        elif name in constants or name in fe.traced.weights:
            t = constants.get(name, fe.traced.weights.get(name))
            own[name] = t.to(getattr(torch, n.dtype)) if str(t.dtype).removeprefix("torch.") != n.dtype else t
            entries[name] = dict(meta, source="artifact")
        else:
            raise UserError(f"weight {name} is neither in the checkpoint nor computable from the config")
    manifest = {"format": artifact.FORMAT, "tensors": entries}
    if fe.checkpoint is not None:
        ck = fe.checkpoint
        manifest["checkpoint"] = {"dir": str(ck.dir), "files": ck.fingerprints(),
                                  "keys": {k: v.file for k, v in sorted(ck.tensors.items())},
                                  "tensors": bound_tensors(ck, fe.recipes)}
    return manifest, own


def shard_runs(runs, shape: tuple[int, ...], dim: int, parts: int, index: int, blocks: int = 1) -> list[tuple]:
    """The copy runs ([dst, key, src, length], over the flat full tensor of ``shape``) that fill slice ``index`` of
    ``parts`` equal slices along ``dim`` (of each of its ``blocks`` equal blocks, in order), with dst offsets in
    the slice: only the slice's source elements are read (each rank reads its shard of the checkpoint, nothing
    else)."""
    if blocks > 1:  # [.., blocks * n, ..] as [.., blocks, n, ..], sliced on n
        shape, dim = (*shape[:dim], blocks, shape[dim] // blocks, *shape[dim + 1:]), dim + 1
    inner = math.prod(shape[dim + 1:])
    chunk = shape[dim] // parts * inner  # contiguous elements of the slice per index of the dims before dim
    row = shape[dim] * inner
    out = []
    for o in range(math.prod(shape[:dim])):
        lo_full, base = o * row + index * chunk, o * chunk
        for d0, key, s0, length in runs:
            lo, hi = max(d0, lo_full), min(d0 + length, lo_full + chunk)
            if lo < hi:
                out.append((base + lo - lo_full, key, s0 + lo - d0, hi - lo))
    return out


def mesh_report(ps: Programs, manifest: dict, mesh: Mesh) -> dict:
    """The report's ``mesh``: the axes, and per rank the weight bytes it binds (its shards and the replicated
    weights) beside the whole model's."""
    from dayzero.passes.ir.ops import DTYPE_BYTES

    per_rank = full = 0
    for name, e in manifest["tensors"].items():
        nbytes = math.prod(e["shape"]) * DTYPE_BYTES[e["dtype"]]
        per_rank += nbytes
        full += nbytes * (e["shard"]["parts"] if "shard" in e else 1)
    collectives = {p.name: sum(1 for s in p.steps if s.collective) for p in ps.programs}
    return {"axes": mesh.json(), "world": mesh.world, "weight_bytes_per_rank": per_rank,
            "weight_bytes_total": full, "collectives": collectives}


def write_artifact(writer: artifact.ArtifactWriter, fe: Frontend, options: CompileOptions, ps: Programs, lib,
                   build_stats: dict, layout: dict) -> dict:
    """The artifact directory (kernels.so, program.json, weights.json / .safetensors, report.json, ...), written
    atomically; returns the report."""
    progs = ps.programs
    manifest, own = weights_manifest(fe, list(ps.graphs.values()), ps.constants)
    manifest["allow_nonfinite"] = bool(options.allow_nonfinite)
    mesh = options.mesh
    report = {
        "format": artifact.FORMAT,
        "model_type": fe.model_type,
        "target": options.target_dict,
        "programs": {p.name: {"steps": len(p.steps), "kernels": len(p.kernels),
                              "memory": {k: v for k, v in layout["programs"][p.name].items() if k != "offsets"}}
                     for p in progs},
        "routes": {k.name: k.route for p in progs for k in p.kernels.values()},
        "tuned": {k.name: k.tuned for p in progs for k in p.kernels.values() if k.tuned},
        "kernel_ops": {k.name: k.op for p in progs for k in p.kernels.values()},
        "patterns": dict(ps.patterns["prefill"]),
        "experts": dict(options.experts(), routes={p.name: sorted({k.op for k in p.kernels.values()
                                                                   if k.op.startswith("moe_experts_mxfp4")})
                                                   for p in progs},
                        int8_layers={name: pat.get("int8_activations", 0) for name, pat in ps.patterns.items()
                                     if pat.get("int8_activations")}),
        "unsupported": [],
        "build": build_stats,
        "kv_cache_layout": fe.cache_layout,
        "kv_pages": ps.kv_pages,
        "allow_nonfinite": bool(options.allow_nonfinite),
        "decode_batch": ps.decode_batch,
        "mesh": mesh_report(ps, manifest, mesh),
    }
    pjs = {}
    for p in progs:
        mem = layout["programs"][p.name]
        pjs[p.name] = program_json(p)
        pjs[p.name]["memory"] = {"arena_bytes": layout["arena_bytes"], "zones": mem["zones"],
                                 "offsets": {str(k): v for k, v in mem["offsets"].items()},
                                 "state_slots": layout["state_slots"], "state_stride": layout["state_stride"]}
    with writer as d:
        export_library(lib, d / "kernels.so")
        artifact.write_json(d / "program.json", {"format": artifact.FORMAT, "target": options.target_dict,
                                                 "programs": pjs, "kv_pages": report["kv_pages"],
                                                 "mesh": mesh.json() if mesh.world > 1 else None,
                                                 "max_seq": options.max_seq if fe.decode is not None else None})
        artifact.write_json(d / "weights.json", manifest)
        artifact.save_tensors(d / "weights.safetensors", own)
        (d / "final.ir").write_text(print_graph(ps.graphs["prefill"]))
        if fe.checkpoint is not None:  # text in, text out: the checkpoint's tokenizer (runtime/text.py)
            from dayzero.runtime.text import TOKENIZER_DIR, carry_tokenizer

            report["tokenizer"] = carry_tokenizer(fe.checkpoint.dir, d / TOKENIZER_DIR)
        artifact.write_json(d / "report.json", report)
        if fe.multimodal is not None:
            artifact.write_json(d / "multimodal.json", fe.multimodal)
    return report


def dump_ir(model: Any, out_dir: str | Path, options: CompileOptions) -> list[Path]:
    """``dayzero dump-ir``: the compiler up to lowering, every program's graph after every step in
    <out_dir>/<program>/NNN_<step>.ir, verified after each; returns the files written."""
    fe = trace(model, options)
    build_programs(fe, options, verify=True, dump_dir=out_dir)
    return sorted(Path(out_dir).glob("*/*.ir"))
