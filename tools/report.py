"""``dayzero report OUT [--json] [--plot FILE.png]``: what a compiled artifact is made of, from its files alone.

    report.json + program.json ──► kernels    kernel -> op, route (hand-scheduled / tuned / default / generic)
                               ──► op counts  steps per op (what the program executes), kernels per route
                               ──► patterns   pattern -> times found; unsupported ops (a list, empty when compiled)
                               ──► memory     per program: arena vs peak-live lower bound, zones, buffers
    --plot                     ──► the arena over program time: one rectangle per buffer
                                   (x = [first step, last step + 1), y = [offset, offset + bytes)), zone colours

Nothing is recompiled: the buffer lifetimes come from report.json (``programs.<name>.memory.buffers`` =
``[offset, bytes, first_step, last_step, zone]``, written by ``tools/driver.plan_memory``).
"""

from __future__ import annotations

import json
import os
from collections import Counter

import click

from dayzero import UserError

ROUTES = ("hand-scheduled", "tuned", "default", "generic")
MIB = 1 << 20
# one fixed colour per zone, so plots of different models read the same way
ZONE_COLOURS = {"weights": "#4c72b0", "lowprec_weights": "#8172b2", "dequant_workspace": "#ccb974",
                "kv_cache": "#c44e52", "cross_layer": "#937860", "activations": "#55a868", "io": "#dd8452"}
_FALLBACK_COLOURS = ("#64b5cd", "#da8bc3", "#8c8c8c", "#ff9f9b")


def _read_json(path: str, what: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise UserError(f"{os.path.dirname(path) or '.'}: not a dayzero artifact (no {what})") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None


def _step_op(node: str) -> str:
    return node.split(" at ", 1)[0]


def build_report(artifact: str) -> dict:
    """The report object (what ``--json`` prints)."""
    rep = _read_json(os.path.join(artifact, "report.json"), "report.json")
    pfile = os.path.join(artifact, "program.json")
    progs = _read_json(pfile, "program.json").get("programs", {}) if os.path.isfile(pfile) else {}
    routes = rep.get("routes", {})
    kops = rep.get("kernel_ops", {})
    tuned = rep.get("tuned", {})
    kernels = {k: {"op": kops.get(k, "?"), "route": r, **({"tuned": tuned[k]} if k in tuned else {})}
               for k, r in sorted(routes.items())}
    op_counts: Counter = Counter()
    for pj in progs.values():
        op_counts.update(_step_op(s["node"]) for s in pj.get("steps", []))
    if not op_counts:  # an artifact without program.json: count kernels instead of steps
        op_counts.update(kops.values())
    programs = {}
    for name, p in rep.get("programs", {}).items():
        m = p.get("memory", {})
        mem = {k: v for k, v in m.items() if k != "buffers"}
        peak = sum(m.get("peak_live_bytes", {}).values())
        mem["peak_live_total_bytes"] = peak
        mem["arena_over_peak"] = round(m.get("arena_bytes", 0) / peak, 4) if peak else None
        mem["buffers"] = len(m.get("buffers", []))
        programs[name] = {"steps": p.get("steps"), "kernels": p.get("kernels"), "memory": mem}
    return {
        "artifact": os.path.abspath(artifact),
        "model_type": rep.get("model_type", ""),
        "target": rep.get("target"),
        "kernels": kernels,
        "routes": {r: c for r, c in sorted(Counter(routes.values()).items())},
        "op_counts": dict(sorted(op_counts.items(), key=lambda kv: (-kv[1], kv[0]))),
        "patterns": dict(rep.get("patterns", {})),
        "unsupported": list(rep.get("unsupported", [])),
        "programs": programs,
    }


def plot_arena(artifact: str, png: str) -> dict:
    """Draw every program's arena over time into PNG; returns ``{program: buffers drawn}``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.collections import PatchCollection
    from matplotlib.patches import Patch, Rectangle

    rep = _read_json(os.path.join(artifact, "report.json"), "report.json")
    progs = {n: p["memory"] for n, p in rep.get("programs", {}).items() if p.get("memory", {}).get("buffers")}
    if not progs:
        raise UserError(f"{artifact}: report.json has no buffer lifetimes (compiled by an older dayzero: recompile)")
    fig, axes = plt.subplots(1, len(progs), figsize=(11 * len(progs), 6.5), squeeze=False)
    drawn = {}
    extra = iter(_FALLBACK_COLOURS * 4)
    colours = dict(ZONE_COLOURS)
    for ax, (name, m) in zip(axes[0], progs.items()):
        bufs = m["buffers"]
        steps = m.get("steps") or max(b[3] for b in bufs) + 1
        by_zone: dict[str, list] = {}
        for off, size, first, last, zone in bufs:
            if size <= 0:
                continue
            # x: the steps the buffer is live in, [first, last + 1), clipped to the program
            x0, x1 = first, min(last + 1, steps)
            by_zone.setdefault(zone, []).append(Rectangle((x0, off / MIB), max(x1 - x0, 0.6), size / MIB))
        for zone, rects in by_zone.items():
            c = colours.setdefault(zone, next(extra))
            ax.add_collection(PatchCollection(rects, facecolor=c, edgecolor="black", linewidth=0.25, alpha=0.8))
        # zones in layout order (bottom up, from the buffers' offsets): a dashed line at each zone's base
        lo = {z: min(off for off, size, _, _, zz in bufs if zz == z) for z in by_zone}
        order = sorted(by_zone, key=lambda z: lo[z])
        for z in order[1:]:
            ax.axhline(lo[z] / MIB, color="grey", linestyle="--", linewidth=0.6)
        arena = m["arena_bytes"]
        peak = sum(m.get("peak_live_bytes", {}).values())
        ax.set_xlim(0, steps)
        ax.set_ylim(0, max(arena, 1) / MIB * 1.02)
        ax.set_xlabel("program step")
        ax.set_ylabel("arena offset (MiB)")
        ratio = f" ({arena / peak:.2f}x)" if peak else ""
        ax.set_title(f"{rep.get('model_type') or 'model'} {name}: arena {arena / MIB:.2f} MiB vs peak-live "
                     f"{peak / MIB:.2f} MiB{ratio}\n{steps} steps, {len(bufs)} buffers, sized at "
                     + ", ".join(f"{s}={v}" for s, v in m.get("bounds", {}).items()), fontsize=10)
        zones, live = m.get("zones", {}), m.get("peak_live_bytes", {})
        handles = [Patch(facecolor=colours[z], edgecolor="black",
                         label=f"{z}: {zones.get(z, 0) / MIB:.2f} MiB\n(peak-live {live.get(z, 0) / MIB:.2f})")
                   for z in reversed(order)]  # the top zone first, as drawn
        ax.legend(handles=handles, title="zone (size)", loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
                  title_fontsize=8, frameon=False)
        ax.grid(True, linewidth=0.3, alpha=0.5)
        drawn[name] = sum(len(r) for r in by_zone.values())
    fig.tight_layout()
    try:
        fig.savefig(png, dpi=110)
    except OSError as e:
        raise UserError(f"cannot write {png}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
    return drawn


def _human(r: dict) -> None:
    click.echo(f"artifact: {r['artifact']}")
    click.echo(f"model_type: {r['model_type'] or '-'}   target: {r['target']}")
    click.echo("routes: " + ", ".join(f"{k} {v}" for k, v in r["routes"].items()))
    width = max((len(k) for k in r["kernels"]), default=0)
    for k, v in r["kernels"].items():
        t = v.get("tuned")
        extra = f"  default {t['default_s'] * 1e6:.1f} us -> tuned {t['tuned_s'] * 1e6:.1f} us" if t else ""
        click.echo(f"  {k:<{width}}  {v['route']:<14} {v['op']}{extra}")
    click.echo("op counts (steps): " + ", ".join(f"{k} {v}" for k, v in r["op_counts"].items()))
    click.echo("patterns: " + (", ".join(f"{k} x{v}" for k, v in r["patterns"].items()) or "none"))
    click.echo(f"unsupported: {len(r['unsupported'])}" + "".join(f"\n  {u}" for u in r["unsupported"]))
    for name, p in r["programs"].items():
        m = p["memory"]
        click.echo(f"{name}: {p['steps']} steps, {p['kernels']} kernels, arena {m['arena_bytes']} B vs peak-live "
                   f"{m['peak_live_total_bytes']} B (x{m['arena_over_peak']}), zones {m.get('zones')}")


@click.command("report")
@click.argument("artifact", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@click.option("--plot", "plot", type=click.Path(dir_okay=False), default=None,
              help="draw the memory arena over program time into this PNG")
def report_cmd(artifact, as_json, plot):
    """Kernels and their routes (hand-scheduled / tuned / default / generic), op counts, patterns, unsupported ops
    and the memory plan of a compiled ARTIFACT."""
    r = build_report(artifact)
    if plot:
        plot_arena(artifact, plot)
        r["plot"] = os.path.abspath(plot)
    if as_json:
        click.echo(json.dumps(r, indent=1, sort_keys=True, default=str))
    else:
        _human(r)
        if plot:
            click.echo(f"plot: {r['plot']}")
