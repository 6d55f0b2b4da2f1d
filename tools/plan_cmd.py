"""``dayzero plan CONFIG --target SPEC``: the capacity plan of a full-size model, from its config.json alone.

Prints a table (rich), or one JSON object with ``--json``.  Bad input raises UserError; the ``dayzero`` CLI wrapper
turns that into one stderr line and exit code 2.
"""

from __future__ import annotations

import json

import click

from dayzero import UserError
from dayzero.targets.host import HOST_TARGET
from dayzero.targets.spec import load_target_spec
from dayzero.tools.capacity import FORMATS, KV_DTYPE_BYTES, load_config, parse_count, plan_capacity


def _gb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB"


def _b(n: float) -> str:
    return f"{n / 1e9:,.2f} B"


def render(result: dict, console=None) -> None:
    """The plan as rich tables: parameters, weights, KV cache, per-device memory and the verdict."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    r = result
    head = (
        f"{r['model_type']} on {r['devices']} x {r['target']}, context {r['context']:,} tokens, "
        f"weights {r['weight_format']}, KV {r['kv_dtype']}, attention {r['parallelism']['attention']}"
    ) + (f", one rank of tp {r['mesh']['tp']} x ep {r['mesh']['ep']}" if r.get("mesh") else "")
    params = Table(title="parameters", title_justify="left")
    params.add_column("category")
    params.add_column("params", justify="right")
    params.add_column(f"bytes ({r['weight_format']})", justify="right")
    for cat, n in r["params_by_category"].items():
        if n:
            params.add_row(cat, _b(n), _gb(r["resident_bytes_by_category"][cat]))
    params.add_row("total", _b(r["params_total"]), _gb(r["resident_bytes"][r["weight_format"]]), style="bold")
    params.add_row("active / token", _b(r["params_active"]), "", style="bold")
    if r["params_mtp"]:
        params.add_row("MTP modules (not in total)", _b(r["params_mtp"]), "")

    formats = Table(title="resident weights by format", title_justify="left")
    for f in r["resident_bytes"]:
        formats.add_column(f, justify="right")
    formats.add_row(*(_gb(v) for v in r["resident_bytes"].values()))

    kv = Table(title="KV cache (one layer)", title_justify="left")
    for col in ("layer type", "layers", "bytes / token", "window", "formula"):
        kv.add_column(col, justify="left" if col in ("layer type", "formula") else "right")
    for t, e in r["kv_layer_types"].items():
        kv.add_row(t, str(e["layers"]), f"{e['bytes_per_token']:,.2f}", str(e["window"] or "-"), e["formula"])
    kv.add_row("all layers", "", f"{r['kv_bytes_per_token']['total']:,.0f}", "", f"{_gb(r['kv_bytes_per_sequence'])} / sequence", style="bold")

    dev = Table(title="per device", title_justify="left")
    dev.add_column("")
    dev.add_column("bytes", justify="right")
    for k, v in r["per_device"].items():
        dev.add_row(k, _gb(v), style="bold" if k in ("total", "usable") else None)

    console.print(head)
    for t in (params, formats, kv, dev):
        console.print(t)
    batch = r["batch"] or 1
    verdict = "fits" if r["fits"] else "does NOT fit"
    console.print(f"batch {batch}: {verdict}; largest batch at this context: {r['max_batch']}")
    for note in r["notes"]:
        console.print(f"note: {note}")


@click.command("plan")
@click.argument("config", type=click.Path(dir_okay=True))
@click.option("--target", "target", required=True, help="Target spec: a name (h200, b200, ...) or a JSON file.")
@click.option("--devices", default=1, show_default=True, type=int, help="Number of devices (expert + tensor parallel).")
@click.option("--context", default="1M", show_default=True, help="Tokens per sequence: 4096, 128k, 1M, ...")
@click.option("--batch", default=None, type=int, help="Sequences decoded together (default: report the largest).")
@click.option("--format", "weight_format", default="auto", show_default=True,
              type=click.Choice(("auto",) + FORMATS), help="Weight storage format (auto: the config's quantization).")
@click.option("--kv-dtype", default=None, type=click.Choice(tuple(KV_DTYPE_BYTES)),
              help="KV cache element type (default: bf16; fp32 on --target host, as dayzero's CPU runtime keeps it)")
@click.option("--attention", default="auto", show_default=True, type=click.Choice(("auto", "tp", "dp")),
              help="Attention parallelism: tensor (split KV heads) or data (split sequences).")
@click.option("--tp", type=int, default=None,
              help="plan one rank of a `dayzero compile --tp T --ep E` artifact: its tensor-parallel ranks")
@click.option("--ep", type=int, default=None, help="with --tp: the artifact's expert-parallel ranks")
@click.option("--prefill-chunk", type=int, default=None,
              help="with --target host: plan an artifact compiled with --prefill-chunk N (a prefill step of N tokens)")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
def plan(config, target, devices, context, batch, weight_format, kv_dtype, attention, tp, ep, prefill_chunk, as_json):
    """Plan memory for the model described by CONFIG (a config.json or a checkpoint directory) on a target."""
    if devices < 1:
        raise UserError(f"--devices must be >= 1, got {devices}")
    if batch is not None and batch < 1:
        raise UserError(f"--batch must be >= 1, got {batch}")
    mesh = None
    if tp is not None or ep is not None:  # one rank of a sharded artifact; --devices defaults to tp x ep
        mesh = {"tp": 1 if tp is None else tp, "ep": 1 if ep is None else ep}
        if devices == 1:
            devices = max(1, mesh["tp"]) * max(1, mesh["ep"])
    spec = load_target_spec(target)
    if kv_dtype is None:
        kv_dtype = "fp32" if spec.name == HOST_TARGET else "bf16"
    result = plan_capacity(
        load_config(config),
        spec,
        devices=devices,
        context=parse_count(context, "--context"),
        batch=batch,
        weight_format=weight_format,
        kv_dtype=kv_dtype,
        attention=attention,
        mesh=mesh,
        prefill_chunk=prefill_chunk,
    )
    if as_json:
        click.echo(json.dumps(result, sort_keys=True))
    else:
        render(result)
