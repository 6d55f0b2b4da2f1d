"""Test helpers for servers started as real processes (``dayzero serve``, ``demo --serve``, torchrun ranks)."""

from __future__ import annotations

import http.client
import json
import re
import socket
import subprocess
import time
import urllib.request


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(procs: list[subprocess.Popen], port: int, timeout_s: float, poll_s: float = 0.2) -> None:
    """Poll ``/health`` on PORT until it answers 200; fails at once (with the last stderr) if a process ended, and
    after TIMEOUT_S seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert all(p.poll() is None for p in procs), [p.communicate()[1][-2000:] for p in procs]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"the server on port {port} did not become ready in {timeout_s:.0f} s"
        time.sleep(poll_s)


class Http:
    """Raw HTTP to a server on 127.0.0.1:port."""

    def __init__(self, port: int):
        self.port = port

    def request(self, method, path, body=None, timeout=120):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        data = body if isinstance(body, (str, bytes)) or body is None else json.dumps(body)
        c.request(method, path, body=data, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        raw = r.read().decode()
        c.close()
        try:
            return r.status, json.loads(raw)
        except json.JSONDecodeError:
            return r.status, raw

    def metric(self, name: str) -> float:
        _, text = self.request("GET", "/metrics")
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0
