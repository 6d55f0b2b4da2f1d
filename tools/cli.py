"""The ``dayzero`` command line.

Every command: ``--help``; ``--json`` for one machine-readable object on stdout; exit code 0 only on success.
Errors are one line on stderr: a user error (bad model, flag, file) exits 2, an internal error (a dayzero bug)
exits 3 with a hint; ``--debug`` (before the command) shows the traceback instead.
"""

from __future__ import annotations

import collections
import functools
import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path

import click

from dayzero import DayzeroError, InternalError, UserError


def _emit(obj, as_json: bool, human=None) -> None:
    if as_json:
        click.echo(json.dumps(obj, indent=1, sort_keys=True, default=str))
    elif human is not None:
        human(obj)
    else:
        for k, v in obj.items():
            click.echo(f"{k}: {v}")


class DayzeroGroup(click.Group):
    """Turns errors into one line and an exit code (2 user, 3 internal) unless --debug."""

    def main(self, *args, **kwargs):
        """A usage error (an unknown option, a value of the wrong type, a missing argument) is bad input too: one
        line naming it and exit 2, instead of click's usage block."""
        if kwargs.pop("standalone_mode", True) is False:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            self._main(*args, **kwargs)
        except SystemExit as e:  # a rank of a sharded run leaves its process group and exits past C++ teardown
            if "torch.distributed" in sys.modules:
                from dayzero.runtime.dist import exit_rank

                exit_rank(e.code)
            raise

    def _main(self, *args, **kwargs):
        try:
            rv = super().main(*args, standalone_mode=False, **kwargs)
        except click.exceptions.NoArgsIsHelpError as e:  # a bare ``dayzero``: the help it asked for
            click.echo(e.ctx.get_help() if e.ctx is not None else str(e))
            sys.exit(0)
        except click.UsageError as e:
            where = f" (see `{e.ctx.command_path} --help`)" if e.ctx is not None else ""
            click.echo(f"error: {e.format_message()}{where}", err=True)
            sys.exit(2)
        except click.ClickException as e:
            e.show()
            sys.exit(e.exit_code)
        except click.exceptions.Abort:
            click.echo("aborted", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)

    def invoke(self, ctx):
        debug = ctx.params.get("debug", False)
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except UserError as e:
            if debug:
                raise
            click.echo(f"error: {e}", err=True)
            ctx.exit(2)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            ctx.exit(130)
        except Exception as e:  # noqa: BLE001 - the last line of defence: one line, not a traceback
            if debug:
                raise
            kind = "internal error" if isinstance(e, (InternalError, DayzeroError)) else \
                f"internal error ({type(e).__name__})"
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            click.echo(f"{kind}: {msg} (rerun with --debug for the traceback)", err=True)
            ctx.exit(3)


@click.group(cls=DayzeroGroup)
@click.option("--debug", is_flag=True, help="show tracebacks instead of one-line errors")
@click.version_option(package_name="dayzero")
def main(debug: bool) -> None:
    """dayzero: compiler-driven bring-up of sparse LLMs (PyTorch + Apache TVM)."""
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING, format="%(message)s")
    if not debug:
        warnings.filterwarnings("ignore")


def compile_options(fn):
    """The options of ``dayzero compile``, shared by ``dump-ir`` (which runs the same compiler); the command gets
    them as ``options=CompileOptions(...)``, validated there."""
    options = [
        click.option("--target", default="host", show_default=True, help="host (LLVM, detected mcpu) or cuda[:sm_90]"),
        click.option("--max-seq", default="512", show_default=True, metavar="TOKENS",
                     help="largest sequence length the artifact serves (a count such as 4096, 64k or 1M; "
                          "k = 10^3, M = 10^6)"),
        click.option("--max-batch", default=4, show_default=True, help="requests served at once (KV-cache slots)"),
        click.option("--prefill-chunk", default=None, metavar="TOKENS",
                     help="most tokens per prefill call (default min(--max-seq, 512)): longer prompts are prefilled "
                          "in chunks, and the prefill arena is sized by the chunk, not by --max-seq"),
        click.option("--kv-block-size", default=16, show_default=True,
                     help="tokens per KV-cache block: caches are pools of blocks handed to requests through block "
                          "tables (0: one contiguous cache per request slot)"),
        click.option("--kv-blocks", type=int, default=None,
                     help="blocks per KV-cache pool (default: --max-batch requests of --max-seq tokens, + 1 scratch "
                          "block); fewer lets requests share a smaller pool, a request that finds it full gets an "
                          "error"),
        click.option("--image-grid", "image_grids", multiple=True, metavar="TxHxW",
                     help="multimodal checkpoints: an image grid (in patches) to compile a vision program for; "
                          "repeat for several sizes (default 1x4x4)"),
        click.option("--verify", is_flag=True, help="run the IR verifier after every pass"),
        click.option("--tune", type=int, default=None, metavar="TRIALS",
                     help="tune kernels without a hand-scheduled rule or a record, TRIALS MetaSchedule trials each"),
        click.option("--tune-minutes", type=float, default=None, help="wall-clock budget for all tuning"),
        click.option("--tuning-dir", type=click.Path(file_okay=False), default=None,
                     help="tuning database (default $DAYZERO_TUNING_DIR or ~/.cache/dayzero/tuning)"),
        click.option("--trace-cache", default=None, metavar="DIR|off",
                     help="the compile cache: traces, weight recipes and compiled kernels, so compiling the same "
                          "config again skips torch.export and every kernel compiled before (default "
                          "$DAYZERO_TRACE_CACHE or ~/.cache/dayzero/traces; off: trace and compile every time)"),
        click.option("--compute-dtype", default=None, metavar="fp32|bf16|fp8_e4m3|SPEC",
                     help="dtype MXFP4 experts are converted to and computed in (or a target spec, e.g. h200, "
                          "whose compute_dtype is taken); default: the target's (host: fp32)"),
        click.option("--expert-route", type=click.Choice(["auto", "fused", "workspace"]), default="auto",
                     show_default=True, help="MXFP4 experts: decode in registers (fused), or convert the routed "
                                             "experts into a reused workspace; auto: fused, unless a cache or a "
                                             "non-fp32 compute dtype is asked for (measured: "
                                             "codegen/kernels/expert_workspace.py)"),
        click.option("--expert-cache", "expert_cache", default="0", metavar="BYTES",
                     help="LRU cache of converted experts, e.g. 64MiB (0: none; the workspace holds one expert)"),
        click.option("--int8-activations", is_flag=True,
                     help="decode programs: MXFP4 experts (fused route) quantise x and the GEMMs' intermediate to "
                          "int8 per 32-block and take integer dot products on the FP4 codes (VNNI / AVX2): "
                          "~2.4x faster decode, ~1% of max error per expert call (prefill stays exact)"),
        click.option("--allow-nonfinite", is_flag=True,
                     help="compile a checkpoint whose float weights hold NaN/Inf (an error otherwise)"),
        click.option("--ep", type=int, default=1, show_default=True,
                     help="expert-parallel ranks: the routed experts of every MoE layer split over them (run the "
                          "artifact with `torchrun --nproc-per-node N -m dayzero run ...`, N = tp x ep)"),
        click.option("--tp", type=int, default=1, show_default=True,
                     help="tensor-parallel ranks: dense MLPs (a dense layer's, the shared experts), attention heads "
                          "(MLA's latent KV and DeepSeek-V4's K=V head, the indexers stay whole), embeddings and the "
                          "LM head split over them"),
    ]

    @functools.wraps(fn)
    def with_options(*args, image_grids, expert_cache, **kwargs):
        from dayzero.tools.compiler import CompileOptions

        names = ("target", "max_seq", "max_batch", "prefill_chunk", "kv_block_size", "kv_blocks", "verify", "tune",
                 "tune_minutes", "tuning_dir", "trace_cache", "compute_dtype", "expert_route", "int8_activations",
                 "allow_nonfinite", "tp", "ep")
        from dayzero.tools.capacity import parse_count

        for k in ("max_seq", "prefill_chunk"):
            if kwargs[k] is not None:
                kwargs[k] = parse_count(kwargs[k], "--" + k.replace("_", "-"))
        opts = CompileOptions(**{k: kwargs.pop(k) for k in names}, image_grids=tuple(image_grids) or None,
                              expert_cache_bytes=_parse_bytes(expert_cache, "--expert-cache"))
        return fn(*args, options=opts, **kwargs)
    for option in reversed(options):
        with_options = option(with_options)
    return with_options


@main.command("compile")
@click.argument("model")
@click.option("-o", "--out", required=True, type=click.Path(), help="artifact directory to write")
@compile_options
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
def compile_cmd(model, out, options, as_json):
    """Compile MODEL (checkpoint dir, module.path:factory or model.onnx) into the artifact directory OUT.

    Without --tune, kernels use a record from the tuning database when one exists, else the default schedule."""
    from dayzero.tools.compiler import compile_artifact

    rep = compile_artifact(model, out, options)
    summary = {"artifact": os.path.abspath(out), "kernels": rep["build"]["kernels"],
               "steps": rep["programs"]["prefill"]["steps"],
               "arena_bytes": rep["programs"]["prefill"]["memory"]["arena_bytes"], "seconds": rep["seconds"],
               "routes": dict(collections.Counter(rep["routes"].values()))}
    _emit(summary, as_json)


def _parse_bytes(text: str, option: str) -> int:
    """'0', '1048576', '64MiB', '2GiB', '500MB' -> bytes."""
    import re

    m = re.fullmatch(r"\s*(\d+)\s*(|B|KB|MB|GB|KiB|MiB|GiB)\s*", text)
    if m is None:
        raise UserError(f"{option} must be a byte count such as 0, 1048576, 64MiB or 1GB, got {text!r}")
    unit = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    return int(m.group(1)) * unit[m.group(2)]


class LoadProgress:
    """A rich progress bar on stderr while an artifact's weights bind (``load(..., progress=)``), shown only for
    loads of at least ``min_bytes`` (a tiny artifact prints nothing); ``close()`` removes it."""

    def __init__(self, min_bytes: int = 256 << 20):
        self.min_bytes, self.bar, self.task = min_bytes, None, None

    def __call__(self, done: int, total: int) -> None:
        if total < self.min_bytes:
            return
        if self.bar is None:
            from rich.console import Console
            from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                       TransferSpeedColumn)

            self.bar = Progress(TextColumn("loading weights"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                                TimeRemainingColumn(), console=Console(stderr=True), transient=True)
            self.bar.start()
            self.task = self.bar.add_task("load", total=total)
        self.bar.update(self.task, completed=done)
        if done >= total:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


IDS_FILE_MAX = 1 << 28  # bytes of an --input-ids @FILE at most (a 1M-token prompt is ~4 MB)


def _read_ids_file(path: str, option: str) -> str:
    """The text of ``--input-ids @FILE`` (a prompt too long for the command line: one argument holds 128 KiB),
    size-checked before it is read."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{option} @{path}: no such file")
    if p.stat().st_size > IDS_FILE_MAX:
        raise UserError(f"{option} @{path}: {p.stat().st_size} bytes, more than the {IDS_FILE_MAX} a token-id "
                        "file may hold")
    try:
        return p.read_text(encoding="ascii")
    except UnicodeDecodeError:
        raise UserError(f"{option} @{path}: not a text file of token ids") from None


def _parse_ids(text: str, option: str) -> list[int]:
    """'1, 2,3' -> [1, 2, 3]; '@FILE': the ids in FILE, separated by commas and/or whitespace; ``option``
    (--input-ids, --stop-ids) names the flag in the error."""
    if option == "--input-ids" and text.startswith("@"):
        text = _read_ids_file(text[1:], option)
    try:
        ids = [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise UserError(f"{option} must be comma-separated integers, got {text[:80]!r}") from None
    if not ids:
        raise UserError(f"{option} is empty: give at least one token id")
    return ids


TEXT_NEW_TOKENS = 32  # tokens `run --prompt` generates unless --max-new-tokens says otherwise


@main.command("run")
@click.argument("artifact", type=click.Path())
@click.option("--input-ids", default=None, help="comma-separated token ids, e.g. 1,2,3; @FILE: the ids in FILE "
                                                "(commas or whitespace between them), for prompts too long for "
                                                "the command line")
@click.option("--prompt", default=None, help="a text prompt, tokenized by the checkpoint's own tokenizer; prints "
                                             "the generated text")
@click.option("--chat", is_flag=True, help="with --prompt: send it as a user message through the model's chat "
                                           "template")
@click.option("--max-new-tokens", type=int, default=None,
              help=f"generate this many tokens (prefill + decode); --prompt: default {TEXT_NEW_TOKENS}")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--stop-ids", default="", help="comma-separated token ids that end generation (--prompt: also the "
                                             "model's end-of-sequence ids)")
@click.option("--image", "images", multiple=True, type=click.Path(dir_okay=False),
              help="an image file joining the prompt at its next image token (repeat for several; with --chat "
                   "the images come first in the user message)")
@click.option("--json", "as_json", is_flag=True)
def run_cmd(artifact, input_ids, prompt, chat, max_new_tokens, temperature, top_p, seed, stop_ids, images,
            as_json):
    """Run the compiled model on INPUT_IDS (the prefill logits' shape and argmax, or generated tokens) or on a
    text PROMPT (the generated text; --json gives {"text", "tokens"})."""
    from dayzero.runtime import load, request_checks

    if (input_ids is None) == (prompt is None):
        raise UserError("give exactly one of --input-ids and --prompt")
    if chat and prompt is None:
        raise UserError("--chat needs --prompt (the text of the user message)")
    ids = _parse_ids(input_ids, "--input-ids") if input_ids is not None else None
    stops = _parse_ids(stop_ids, "--stop-ids") if stop_ids else []
    request_checks.sampling(max_new_tokens or 0, temperature, top_p, seed, cli=True)
    progress = LoadProgress()
    try:
        rt = load(artifact, progress)
    finally:
        progress.close()
    if ids is not None:
        request_checks.token_ids(ids, rt.vocab_size, "--input-ids")
    request_checks.token_ids(stops, rt.vocab_size, "--stop-ids", allow_empty=True)
    if images and getattr(rt, "multimodal", None) is None:
        raise UserError(f"{artifact}: no vision program (compile a multimodal checkpoint to pass --image)")
    t0 = time.perf_counter()
    if prompt is not None:
        from dayzero.runtime.text import encode_chat, encode_prompt

        tok = rt.tokenizer
        if tok is None:
            raise UserError(f"{artifact}: the artifact carries no tokenizer (its checkpoint has none): "
                            "use --input-ids")
        if chat:
            parts = [{"type": "image_url", "image_url": {"url": str(i)}} for i in images]
            ids = encode_chat(tok, [{"role": "user", "content": parts + [{"type": "text", "text": prompt}]
                                     if parts else prompt}])
        else:
            ids = encode_prompt(tok, prompt)
        toks = rt.generate(ids, TEXT_NEW_TOKENS if max_new_tokens is None else max_new_tokens,
                           stop_ids=sorted(set(stops) | set(rt.eos_ids)), temperature=temperature, top_p=top_p,
                           seed=seed, **({"images": list(images)} if images else {}))
        res = {"text": tok.decode(toks, skip_special_tokens=True), "tokens": toks, "prompt_tokens": len(ids)}
    elif max_new_tokens is None and images:
        logits = rt.multimodal.prefill(ids, list(images))
        res = {"logits_shape": list(logits.shape), "argmax": logits[0].argmax(-1).tolist()}
    elif max_new_tokens is None:
        logits = rt.prefill(ids)
        res = {"logits_shape": list(logits.shape), "argmax": logits[0].argmax(-1).tolist()}
    else:
        toks = rt.generate(ids, max_new_tokens, stop_ids=stops, temperature=temperature, top_p=top_p, seed=seed,
                           **({"images": list(images)} if images else {}))
        res = {"tokens": toks}
    res["seconds"] = time.perf_counter() - t0
    if getattr(rt, "rank", 0) == 0:  # a sharded artifact under torchrun: every rank ran the same; rank 0 prints
        _emit(res, as_json, (lambda r: click.echo(r["text"])) if prompt is not None else None)


@main.command("dump-ir")
@click.argument("model")
@click.argument("out", type=click.Path(file_okay=False))
@compile_options
def dump_ir_cmd(model, out, options):
    """Run the compiler on MODEL with compile's options up to lowering, writing every program's IR after every
    step as OUT/<program>/NNN_<step>.ir (prefill, decode, decode_batch, vision_*), verified after each."""
    from dayzero.tools.compiler import dump_ir

    click.echo("\n".join(str(f) for f in dump_ir(model, out, options)))


@main.command("demo")
@click.option("--out", type=click.Path(), default=None, help="artifact directory (default: a temp dir)")
@click.option("--prompt", default=None, help="the user message (default: a question about sparse MoE models)")
@click.option("--image", "images", multiple=True, type=click.Path(dir_okay=False),
              help="run the image + text demo (tiny Qwen3-VL-MoE) on this image file (repeatable)")
@click.option("--json", "as_json", is_flag=True)
@click.option("--serve", "then_serve", is_flag=True,
              help="then serve the demo artifact over OpenAI-compatible HTTP (the probe is checked against upstream)")
@click.option("--host", default="127.0.0.1", show_default=True, help="with --serve")
@click.option("--port", default=8000, show_default=True, type=int, help="with --serve")
def demo_cmd(out, prompt, images, as_json, then_serve, host, port):
    """Build a tiny fixed-seed DeepSeek-V4 (FP8 experts, tokenizer, chat template), compile it, chat with it, and
    compare with upstream transformers run eagerly; ``--serve`` then serves it."""
    from dayzero.tools.demo import DEMO_PROMPT, SERVE_SLOTS, run_demo

    if images and then_serve:
        raise UserError("--serve serves the text demo; run `dayzero serve` on the vision demo's artifact instead")
    if images:
        from dayzero.tools.demo_vision import run_vision_demo

        res = run_vision_demo(out, list(images))
    else:
        res = run_demo(out, prompt or DEMO_PROMPT, max_batch=SERVE_SLOTS if then_serve else 1)

    def human(r):
        click.echo(f"model: {r['model']} (tiny, seed 0{', ' + r['experts'] + ' experts' if 'experts' in r else ''})"
                   f" -> {r['artifact']}")
        for k, v in r["seconds"].items():
            click.echo(f"  {k:<12} {v:7.2f} s")
        if "text" in r:
            click.echo(f"user: {r['prompt']}  ({r['prompt_tokens']} tokens through the chat template)")
            click.echo(f"assistant: {r['text']!r}")
            if not r["tokens_match_upstream"]:
                click.echo(f"upstream:  {r['upstream_text']!r}")
        click.echo(f"max |logits - upstream eager| = {r['max_abs_diff']:.3g}")
        click.echo(f"generated {r['tokens']} ({'same as' if r['tokens_match_upstream'] else 'DIFFERENT from'} "
                   f"upstream generate())")
        width = max((len(p) for p in r.get("patterns", {})), default=0)
        for pattern, p in r.get("patterns", {}).items():
            routes = "; ".join(f"{op}: " + ", ".join(f"{route} x{n}" for route, n in rs.items())
                               for op, rs in p["kernels"].items()) or "-"
            click.echo(f"  pattern {pattern:<{width}} x{p['found']:<3} {routes}")
        click.echo("ok" if r["ok"] else "MISMATCH")
    _emit(res, as_json, human)
    if not res["ok"]:
        sys.exit(1)
    if then_serve:
        from dayzero.runtime.server import serve

        name = os.path.basename(os.path.normpath(res["artifact"]))
        click.echo(f"serving {res['artifact']} as model {name!r} on http://{host}:{port} (ready when /health "
                   f"answers 200); try:\n  curl -s {host}:{port}/v1/chat/completions -H 'Content-Type: "
                   f"application/json' -d '{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", "
                   f"\"content\": \"Hi\"}}], \"max_tokens\": 16}}'", err=as_json)
        sys.stdout.flush()
        serve(res["artifact"], host=host, port=port, validate=res["checkpoint"])


@main.command("serve")
@click.argument("artifact", type=click.Path())
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--max-queue", default=64, show_default=True, type=int,
              help="requests waiting for a slot; beyond it a request gets HTTP 429")
@click.option("--prefill-chunk", default=None, type=int,
              help="prompt tokens prefilled per engine iteration, all requests together (long prompts in chunks, "
                   "decoding goes on) [default: the artifact's compiled --prefill-chunk]")
@click.option("--timeout", type=float, default=None, help="seconds a request may take (HTTP 408 after)")
@click.option("--max-body", default="64M", show_default=True, metavar="BYTES",
              help="largest request body (a count such as 8M; k = 10^3, M = 10^6): larger gets HTTP 413; a "
                   "1M-token prompt is ~7 MB as token ids")
@click.option("--model-name", default=None, help="the model id clients send (default: the artifact's dir name)")
@click.option("--validate", "validate_ckpt", type=click.Path(exists=True, file_okay=False), default=None,
              metavar="CHECKPOINT", help="refuse to start unless the startup probe's logits match the upstream "
                                         "model run eagerly on CHECKPOINT")
def serve_cmd(artifact, host, port, max_queue, prefill_chunk, timeout, max_body, model_name, validate_ckpt):
    """Serve ARTIFACT over OpenAI-compatible HTTP (/v1/completions, /v1/chat/completions, /health, /metrics)."""
    from dayzero.runtime.server import serve

    if max_queue < 1:
        raise UserError("--max-queue must be at least 1")
    if timeout is not None and timeout <= 0:
        raise UserError("--timeout must be positive")
    from dayzero.tools.capacity import parse_count

    max_body = parse_count(max_body, "--max-body")
    if max_body < 1:
        raise UserError("--max-body must be at least 1 byte")
    kwargs = dict(max_queue=max_queue, prefill_chunk=prefill_chunk, timeout=timeout, model=model_name,
                  validate=validate_ckpt, load_progress=LoadProgress(), max_body=max_body)
    if _mesh(artifact):  # a sharded artifact under torchrun: rank 0 serves, every rank steps together
        from dayzero.runtime.lockstep import serve_sharded

        serve_sharded(artifact, host, port, **kwargs)
        return
    serve(artifact, host=host, port=port, **kwargs)


def _mesh(artifact: str):
    """The artifact's device mesh (``--ep`` / ``--tp``), None when it runs on one device or is no artifact (the
    command's own load says so)."""
    from dayzero.runtime import validate

    try:
        return validate.read_json(os.path.join(artifact, "program.json")).get("mesh")
    except (UserError, OSError, AttributeError):
        return None


@main.group("bench")
def bench_group():
    """Benchmarks, side by side in one run; --json writes the DESIGN.md schema."""


@bench_group.command("e2e")
@click.option("--json", "as_json", is_flag=True)
@click.option("--repeat", default=20, show_default=True)
@click.option("--model", "models", multiple=True, help="tiny architecture(s); default: all of E2E_MODELS")
def bench_e2e_cmd(as_json, repeat, models):
    """Tiny Qwen3-MoE, gpt-oss, DeepSeek-V3.2, DeepSeek-V4: prefill latency, one-token forward and a decode step,
    compiled vs torch eager, torch.compile and stock TVM Relax (same export, default pipeline), with the compile
    times."""
    from dayzero.tools.bench import E2E_MODELS, bench_e2e

    unknown = set(models) - set(E2E_MODELS)
    if unknown:
        raise UserError(f"bench e2e: unknown model {sorted(unknown)[0]!r} (one of {', '.join(E2E_MODELS)})")
    _emit(bench_e2e(repeat, models or E2E_MODELS), as_json, _bench_human)


@bench_group.command("decode-batch")
@click.option("--json", "as_json", is_flag=True)
@click.option("--repeat", default=20, show_default=True)
def bench_decode_batch_cmd(as_json, repeat):
    """Tiny Qwen3-MoE: one batched decode step of B = 1, 2, 4, 8 requests vs B sequential decode() calls."""
    from dayzero.tools.bench import bench_decode_batch

    _emit(bench_decode_batch(repeat), as_json, _bench_human)


def _bench_human(r):
    click.echo(f"suite {r['suite']} on {r['machine'].get('cpu', '?')}")
    for row in r["results"]:
        base = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in row["baselines"].items())
        click.echo(f"  {row['case']:<28} dayzero {row['dayzero'] * 1e3:.2f} ms | {base}")
    for model, cs in r.get("compile_s", {}).items():
        click.echo(f"  compile {model}: " + ", ".join(f"{k} {v:.1f} s" for k, v in cs.items()))


def _register_optional():
    """Commands that live in their own modules."""
    from dayzero.tools.bench_attention import attention_command
    from dayzero.tools.bench_cnn import cnn_command
    from dayzero.tools.bench_dequant import dequant_command
    from dayzero.tools.bench_dist import dist_command
    from dayzero.tools.bench_full import full_command
    from dayzero.tools.bench_linear import linear_command
    from dayzero.tools.bench_long import long_command
    from dayzero.tools.bench_ops import ops_command
    from dayzero.tools.bench_moe import moe_command
    from dayzero.tools.bench_profile import profile_command
    from dayzero.tools.bench_serve import serve_command
    from dayzero.tools.bench_tuning import tuning_command
    from dayzero.tools.compare import compare_cmd
    from dayzero.tools.make_full import make_full_cmd
    from dayzero.tools.make_tiny import make_tiny_cmd
    from dayzero.tools.plan_cmd import plan
    from dayzero.tools.report import report_cmd

    for cmd in (make_tiny_cmd, make_full_cmd, plan, report_cmd, compare_cmd):
        main.add_command(cmd)
    for cmd in (dequant_command, linear_command, ops_command, moe_command, tuning_command, attention_command,
                serve_command, long_command, dist_command, full_command, cnn_command, profile_command):
        bench_group.add_command(cmd)


_register_optional()

if __name__ == "__main__":
    main()
