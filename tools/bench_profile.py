"""``dayzero bench profile ART [--batch B] [--context C]``: where one decode step of a compiled artifact spends its
time, kernel by kernel.

B requests (slots 0..B-1) are prefilled with C - 1 fixed-seed token ids each, then the decode program (``decode``
for one request, ``decode_batch`` for several) runs one warm-up step and ``--steps`` timed ones. Each program step
is timed from the previous step's end (the first from the program's entry, so it also carries the copy of the
inputs into the arena); ``step_s`` is the wall time of the whole runtime call, and what it spends outside the
program (``outside_program_s``: gathering and scattering per-request state, sampling bookkeeping) is the
difference. ``by_op`` sums the steps by op; ``top`` lists the slowest steps with their source span and argument
shapes. One run, one process: a profile, not a benchmark against a bound (``bench full`` gives those).
"""

from __future__ import annotations

import json
import time

import click
import torch

from dayzero import UserError


def profile_decode(artifact: str, batch: int = 1, context: int = 64, steps: int = 3, top: int = 20) -> dict:
    """See the module docstring."""
    from dayzero.runtime import load

    if steps < 1 or top < 0:
        raise UserError(f"--steps must be >= 1 and --top >= 0, got {steps} and {top}")
    rt = load(artifact)
    if not 1 <= batch <= rt.max_batch:
        raise UserError(f"--batch {batch}: the artifact serves 1..{rt.max_batch} requests at once (--max-batch)")
    if not 2 <= context < rt.max_length:
        raise UserError(f"--context {context}: a decode step needs 2..{rt.max_length - 1} tokens of context here")
    name = "decode_batch" if batch > 1 else "decode"
    if name not in rt.programs:
        raise UserError(f"{artifact}: no {name} program to profile")
    prog = rt.programs[name]
    lo, hi = prog.input_ranges.get("input_ids", (0, 2 ** 31))
    vocab = (max(int(lo), 0), min(int(hi), max(int(lo), 0) + 1000))
    for s in range(batch):
        g = torch.Generator().manual_seed(64 + 7919 * s)
        # the cache is what counts; the prompt's logits are not read (last=True: one row, not context x vocab)
        rt.prefill(torch.randint(*vocab, (1, context - 1), generator=g), slot=s, last=True)
    spent: dict[int, float] = {}
    inside: list[float] = []
    run = prog.run

    def timed(inputs, observe=None, **kw):  # the runtime's own call, each step's end marked
        marks = []
        t0 = time.perf_counter()
        out = run(inputs, observe=lambda i, node, outs: marks.append((i, time.perf_counter())), **kw)
        prev = t0
        for i, t in marks:
            spent[i] = spent.get(i, 0.0) + t - prev
            prev = t
        inside.append(prev - t0)
        return out

    tokens = [vocab[0] + (7 + 11 * s) % (vocab[1] - vocab[0]) for s in range(batch)]
    walls = []
    prog.run = timed
    try:
        for k in range(steps + 1):
            if k == 1:  # the warm-up step is not counted
                spent.clear()
                inside.clear()
            t0 = time.perf_counter()
            rt.decode_batch(tokens, list(range(batch))) if batch > 1 else rt.decode(tokens[0], slot=0)
            if k:
                walls.append(time.perf_counter() - t0)
    finally:
        del prog.run
    meta = rt.program_json["programs"][name]
    steps_meta, bufs = meta["steps"], meta["buffers"]
    per = {i: s / steps for i, s in spent.items()}
    by_op: dict[str, float] = {}
    for i, s in per.items():
        op = steps_meta[i]["node"].split(" at ", 1)[0]
        by_op[op] = by_op.get(op, 0.0) + s
    rows = []
    for i, s in sorted(per.items(), key=lambda x: -x[1])[:top]:
        st = steps_meta[i]
        op, _, span = st["node"].partition(" at ")
        rows.append({"step": i, "op": op, "span": span, "s": s,
                     "args": [[bufs[a]["shape"], bufs[a]["dtype"]] for a in st["args"]]})
    in_program = sum(inside) / steps
    step = sum(walls) / steps
    return {"suite": "profile", "artifact": str(artifact), "program": name, "batch": batch, "context": context,
            "steps": steps, "step_s": walls, "in_program_s": in_program, "outside_program_s": step - in_program,
            "by_op": dict(sorted(by_op.items(), key=lambda x: -x[1])), "top": rows}


@click.command("profile")
@click.argument("artifact", type=click.Path())
@click.option("--batch", default=1, show_default=True, type=int, help="requests decoded together")
@click.option("--context", default=64, show_default=True, type=int, help="tokens in each request's cache")
@click.option("--steps", default=3, show_default=True, type=int, help="timed decode steps (after one warm-up)")
@click.option("--top", default=20, show_default=True, type=int, help="slowest steps listed")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def profile_command(artifact, batch, context, steps, top, as_json):
    """Time one decode step of ARTIFACT kernel by kernel: by op, and its slowest steps with their shapes."""
    r = profile_decode(artifact, batch, context, steps, top)
    if as_json:
        click.echo(json.dumps(r))
        return
    step = sum(r["step_s"]) / len(r["step_s"])
    click.echo(f"{r['program']}: {r['batch']} request(s) at context {r['context']}: {step * 1e3:.1f} ms a step, "
               f"{r['in_program_s'] * 1e3:.1f} ms in the program, {r['outside_program_s'] * 1e3:.1f} ms outside")
    for op, s in r["by_op"].items():
        click.echo(f"  {op:32s} {s * 1e3:9.2f} ms")
    click.echo("slowest steps:")
    for row in r["top"]:
        shapes = ", ".join(f"{d}{s}" for s, d in row["args"][:4])
        click.echo(f"  {row['s'] * 1e3:9.2f} ms  #{row['step']:<4d} {row['op']} at {row['span'][:60]}  {shapes}")
