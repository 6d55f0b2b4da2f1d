"""``dayzero demo --image PATH``: image + text end to end on the tiny Qwen3-VL-MoE.

A fixed-seed tiny Qwen3-VL-MoE (transformers' own modeling code: vision encoder with 2D rotary, deepstack mergers,
MoE text model with 3D M-RoPE) is written as a checkpoint directory and compiled with two image grids (1x4x4 and
1x4x6 patches); each image goes through the upstream image processor and is resized to the compiled grid of
nearest aspect ratio (``fit``); the prompt ``[5, <vision_start> <image> <vision_end>]*n + [17, 99]`` is run and
compared with the upstream model run eagerly on the same processor outputs: prefill logits, and 16 greedy tokens
against upstream ``generate()``.
"""

from __future__ import annotations

import time

import torch

DEMO_MODEL = "qwen3_vl_moe"
GRIDS = ["1x4x4", "1x4x6"]
TOLERANCE = 1e-4
GENERATE = 16


def run_vision_demo(out: str | None, images: list) -> dict:
    from transformers import AutoModelForImageTextToText

    from dayzero.frontend.hf import _quiet
    from dayzero.runtime import load
    from dayzero.runtime.multimodal import Multimodal
    from dayzero.tools.demo import build_tiny

    for im in images:  # an unreadable image fails before the compile, not after
        Multimodal.load_image(im)
    ckpt, art, seconds = build_tiny(DEMO_MODEL, out, max_seq=64, max_batch=1, image_grids=GRIDS)
    rt = load(art)
    mm = rt.multimodal
    info = mm.info
    t0 = time.perf_counter()
    prompt = []
    for _ in images:
        prompt += [5, info["vision_start_token_id"], info["image_token_id"], info["vision_end_token_id"]]
    prompt += [17, 99]
    logits = mm.prefill(prompt, images, fit=True)  # errors (unreadable file...) are UserErrors
    tokens = mm.generate(prompt, GENERATE, images=images, fit=True)
    # the reference sees the same processor outputs (each image fitted to its compiled grid)
    pre = [mm.preprocess(im, fit=True) for im in images]
    grids = [list(g) for _, g in pre]
    ids = mm._expand(torch.tensor([prompt]), grids)
    mask = (ids == mm.image_token_id)
    seconds["run"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    with _quiet():
        ref = AutoModelForImageTextToText.from_pretrained(str(ckpt)).eval()
    kw = dict(pixel_values=torch.cat([p for p, _ in pre]), image_grid_thw=torch.tensor(grids),
              mm_token_type_ids=mask.to(torch.int32), attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        expected = ref(input_ids=ids, **kw).logits
        upstream = ref.generate(input_ids=ids, max_new_tokens=GENERATE, do_sample=False, **kw)[0, ids.shape[1]:]
    seconds["eager"] = time.perf_counter() - t0
    diff = float((logits - expected).abs().max())
    same = tokens == upstream.tolist()
    return {"model": DEMO_MODEL, "checkpoint": str(ckpt), "artifact": str(art), "images": [str(i) for i in images],
            "image_grids": ["x".join(map(str, g)) for g in grids], "prompt_tokens": int(ids.shape[1]),
            "max_abs_diff": diff, "ok": diff <= TOLERANCE and same, "seconds": seconds, "tokens": tokens,
            "tokens_match_upstream": same}
