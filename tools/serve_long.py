"""A long prompt through ``dayzero serve``, measured from outside (issue 18's "serve takes a 1M-token prompt").

    python -m dayzero.tools.serve_long ART --tokens 999992 --max-tokens 8 --out result.json [--prefill-chunk 128]

Starts ``dayzero serve ART`` on a free port (a child process), waits for /health, then:
1. a short request alone (its latency: the reference for 3.);
2. the long prompt as token ids, ``stream: true``; the SSE comment lines (``: prefill N/M``) are its progress;
3. the same short request while the long one prefills (fewest-tokens-left first: it is not queued behind it;
   needs a second request slot, ``--no-short-during`` without one);
4. every ``--every`` seconds: the server's prefilled-token counter (/metrics) and its RSS (/proc), one JSON line on
   stderr and in the result, so a run that cannot finish still gives its rate and a projection.
Results: prefill tokens/s (overall and per sample), time to first token, decode step times (the gaps between the
streamed tokens), the server's RSS now and at its peak (VmHWM). The server is stopped at the end (or on Ctrl-C).
"""

from __future__ import annotations

import http.client
import json
import os
import random
import re
import subprocess
import sys
import threading
import time

import click


def _rss(pid: int) -> dict:
    out = {}
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith(("VmRSS:", "VmHWM:")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def _get(port: int, path: str, timeout: float = 30) -> tuple[int, str]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read().decode()
    finally:
        c.close()


def _metric(port: int, name: str) -> float:
    _, text = _get(port, "/metrics")
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _post(port: int, body: dict, timeout: float = 3600) -> tuple[int, dict, float]:
    t0 = time.monotonic()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    data = json.loads(r.read())
    c.close()
    return r.status, data, time.monotonic() - t0


@click.command()
@click.argument("artifact", type=click.Path(exists=True, file_okay=False))
@click.option("--tokens", default=999_992, show_default=True, help="prompt tokens")
@click.option("--max-tokens", default=8, show_default=True)
@click.option("--prefill-chunk", default=128, show_default=True, help="serve's --prefill-chunk")
@click.option("--every", default=30.0, show_default=True, help="seconds between progress samples")
@click.option("--out", type=click.Path(dir_okay=False), required=True, help="result JSON (rewritten per sample)")
@click.option("--port", default=0, help="0: a free one")
@click.option("--short-during/--no-short-during", default=True, show_default=True,
              help="the short request again while the long one prefills (needs --max-batch 2 or more)")
def main(artifact, tokens, max_tokens, prefill_chunk, every, out, port, short_during):
    import socket

    if not port:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    res = {"artifact": str(artifact), "prompt_tokens": tokens, "max_tokens": max_tokens,
           "prefill_chunk": prefill_chunk, "samples": []}

    def save():
        with open(out + ".tmp", "w") as f:
            json.dump(res, f, indent=1)
        os.replace(out + ".tmp", out)

    proc = subprocess.Popen([sys.executable, "-m", "dayzero", "serve", str(artifact), "--port", str(port),
                             "--prefill-chunk", str(prefill_chunk), "--max-queue", "4"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.monotonic()
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the server ended: {proc.stderr.read()[-2000:]}")
            try:
                if _get(port, "/health", 5)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        res["ready_s"] = time.monotonic() - t0
        res["rss_ready"] = _rss(proc.pid)
        vocab = 256
        short = {"prompt": [(7 * k + 3) % vocab for k in range(24)], "max_tokens": 8, "temperature": 0,
                 "ignore_eos": True}
        status, _, res["short_alone_s"] = _post(port, short)
        assert status == 200, status
        rng = random.Random(0)
        ids = [rng.randrange(vocab) for _ in range(tokens)]
        body = json.dumps({"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                           "stream": True})
        res["body_bytes"] = len(body)
        base = _metric(port, "dayzero_prefilled_tokens_total")
        itl = [_metric(port, f"dayzero_inter_token_latency_seconds_{k}") for k in ("sum", "count")]
        stream = {"comments": 0, "token_times": [], "tokens": []}

        def run_long():
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
            t = time.monotonic()
            stream["t0"] = t
            c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            r = c.getresponse()
            stream["status"], stream["headers_s"] = r.status, time.monotonic() - t
            for line in r:
                line = line.decode().strip()
                if line.startswith(":"):
                    stream["comments"] += 1
                    stream["last_comment"] = line
                elif line.startswith("data: {"):
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        stream["error"] = ev["error"]
                    for ch in ev.get("choices", []):
                        if ch.get("token_ids"):
                            stream["token_times"].append(time.monotonic() - t)
                            stream["tokens"] += ch["token_ids"]
                elif line == "data: [DONE]":
                    break
            stream["end_s"] = time.monotonic() - t

        th = threading.Thread(target=run_long, daemon=True)
        th.start()
        def run_short():
            status, _, res["short_during_long_prefill_s"] = _post(port, short)
            res["short_during_status"] = status
        short_th = None
        if short_during:  # as soon as the long prompt's prefill began
            while th.is_alive() and _metric(port, "dayzero_prefilled_tokens_total") == base:
                time.sleep(0.02)
            short_th = threading.Thread(target=run_short, daemon=True)
            short_th.start()
        while True:  # a last sample after the long request ended
            alive = th.is_alive()
            th.join(every)
            now = time.monotonic() - stream.get("t0", time.monotonic())
            done = _metric(port, "dayzero_prefilled_tokens_total") - base
            sample = {"t_s": round(now, 1), "prefilled": int(done), **_rss(proc.pid)}
            res["samples"].append(sample)
            print(json.dumps(sample), file=sys.stderr, flush=True)
            save()
            if not alive:
                break
        if short_th is not None:
            short_th.join()
        tt = stream["token_times"]
        res.update({
            "status": stream.get("status"), "headers_s": stream.get("headers_s"), "keepalive_comments":
            stream["comments"], "error": stream.get("error"), "generated": stream["tokens"],
            "ttft_s": tt[0] if tt else None,
            "prefill_tokens_per_s": tokens / tt[0] if tt else None,
            "decode_step_s": [b - a for a, b in zip(tt, tt[1:])],
            # the server's own inter-token latency since the long request was sent (its tokens, and the short
            # request's when it ran beside it): the client's gaps above merge tokens that arrived in one write
            "server_itl_mean_s": ((_metric(port, "dayzero_inter_token_latency_seconds_sum") - itl[0])
                                  / max(1.0, _metric(port, "dayzero_inter_token_latency_seconds_count") - itl[1])),
            "rss_end": _rss(proc.pid)})
        save()
        print(json.dumps({k: v for k, v in res.items() if k != "samples"}), file=sys.stderr)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    main()
