"""``dayzero demo --serve`` end to end in a real process: the demo's heaviest test (a tiny DeepSeek-V4 compile, the
upstream model run eagerly, then a server), in a file of its own so that ``--dist loadfile`` can run it beside the
rest of the CLI tests instead of after them on one worker."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from _http import free_port, wait_until_healthy


@pytest.mark.slow
def test_demo_json_then_serve(tmp_path):
    """The demo: tiny DeepSeek-V4 with FP8 experts, a chat prompt through its template, text out, equal to
    upstream transformers (its own FP8 loader) in logits and greedy tokens; every pattern found on a kernel route.
    ``--serve`` then serves the artifact: the openai client's greedy chat answer to the demo's prompt is the demo's
    own (upstream-equal) text. One demo compile serves both checks."""
    import openai

    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "dayzero.tools.cli", "demo", "--json", "--serve", "--port",
                          str(port), "--out", str(tmp_path / "demo")], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        # a V4 compile: about a minute alone, much longer on a busy host
        wait_until_healthy([p], port, timeout_s=1800, poll_s=2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        from dayzero.tools.demo import DEMO_PROMPT, GENERATE

        model = client.models.list().data[0].id
        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": DEMO_PROMPT}],
                                              max_tokens=GENERATE, temperature=0)
    finally:
        p.terminate()
        out, err = p.communicate(timeout=120)
    res = json.loads(out)
    assert res["max_abs_diff"] <= 1e-4 and res["ok"] and res["tokens_match_upstream"]
    assert {"compile", "run", "eager"} <= set(res["seconds"])
    assert res["artifact"] and res["model"] == "deepseek_v4" and res["experts"] == "fp8"
    assert res["prompt_tokens"] > 10 and res["tokens"] and res["text"] == res["upstream_text"]
    pats = res["patterns"]
    assert {"moe.grouped_experts", "dequant.experts"} <= set(pats)
    assert any(p.startswith("compressed_attention.") for p in pats)
    fp8 = pats["dequant.experts"]["kernels"]
    assert fp8 and all(set(routes) == {"hand-scheduled"} for routes in fp8.values())
    assert all(p["kernels"] for p in pats.values())  # every pattern found has its kernels listed
    assert chat.choices[0].message.content == res["text"]
    assert chat.usage.prompt_tokens == res["prompt_tokens"] and chat.usage.completion_tokens == len(res["tokens"])
    assert "curl" in err and f":{port}/v1/chat/completions" in err
