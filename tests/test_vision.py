"""Image input (issue 9): tiny Qwen3-VL-MoE, vision encoder + text compiled from one checkpoint, against upstream.

One artifact with two image grids (1x4x4: a 64x64 image, 1x4x6: 64 high x 96 wide): the session's shared one
(conftest.tiny_compiled, SHARED_IMAGE_GRIDS; max_batch 3). The
reference is transformers' ``AutoModelForImageTextToText.from_pretrained(dir)`` run eagerly on the same processor
outputs (pixel_values, image_grid_thw, expanded ids, mm_token_type_ids), logits and ``generate(do_sample=False)``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dayzero import UserError
from dayzero.runtime import load
from conftest import SHARED_IMAGE_GRIDS, SHARED_MAX_BATCH

NEW = 16
IMG = 255  # the tiny config's image_token_id
VS, VE = 253, 252  # vision start / end


def _image(h, w, seed, mode="RGB"):
    from PIL import Image

    rs = np.random.RandomState(seed)
    img = Image.fromarray(rs.randint(0, 255, (h, w, 3), dtype=np.uint8))
    return img.convert(mode) if mode != "RGB" else img


@pytest.fixture(scope="module")
def served(tiny_compiled):
    """(runtime, upstream model, artifact dir) of the shared tiny Qwen3-VL-MoE artifact."""
    from transformers import AutoModelForImageTextToText

    ckpt, art, _ = tiny_compiled("qwen3_vl_moe")
    assert SHARED_IMAGE_GRIDS["qwen3_vl_moe"] == ("1x4x4", "1x4x6") and SHARED_MAX_BATCH == 3  # what these tests read
    ref = AutoModelForImageTextToText.from_pretrained(str(ckpt)).eval()
    return load(art), ref, art


def _upstream(rt, ref, prompt, images, n=NEW):
    """Upstream eager logits and greedy tokens on the same processor outputs the runtime uses."""
    mm = rt.multimodal
    kw = {}
    ids = torch.tensor([prompt])
    if images:
        pre = [mm.preprocess(im) for im in images]
        grids = [list(g) for _, g in pre]
        ids = mm._expand(ids, grids)
        kw = dict(pixel_values=torch.cat([p for p, _ in pre]), image_grid_thw=torch.tensor(grids),
                  mm_token_type_ids=(ids == IMG).int())
    with torch.no_grad():
        logits = ref(input_ids=ids, attention_mask=torch.ones_like(ids), **kw).logits
        out = ref.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                           **kw)
    return logits, out[0, ids.shape[1]:].tolist()


TEXT = [5, 17, 99, 3, 42, 8, 120, 7]
ONE = [5, 17, VS, IMG, VE, 99, 3, 42]
TWO = [5, VS, IMG, VE, 17, 99, VS, IMG, VE, 3, 42]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["text", "one_image", "two_images"])
def test_matches_upstream(served, case):
    rt, ref, _ = served
    prompt, images = {"text": (TEXT, []), "one_image": (ONE, [_image(64, 64, 1)]),
                      "two_images": (TWO, [_image(64, 64, 2), _image(64, 96, 3)])}[case]
    exp_logits, exp_tokens = _upstream(rt, ref, prompt, images)
    logits = rt.multimodal.prefill(prompt, images)
    assert logits.shape == exp_logits.shape
    assert float((logits - exp_logits).abs().max()) < 1e-4
    assert rt.generate(prompt, NEW, images=images) == exp_tokens


@pytest.mark.slow
def test_vision_program_matches_upstream_encoder(served):
    rt, ref, _ = served
    for img, grid in ((_image(64, 64, 4), (1, 4, 4)), (_image(64, 96, 5), (1, 4, 6))):
        pv, g = rt.multimodal.preprocess(img)
        assert g == grid
        feats, _ = rt.multimodal.encode(img)
        with torch.no_grad():
            out = ref.model.visual(pv, grid_thw=torch.tensor([list(g)]), return_dict=True)
        exp = torch.stack([out.pooler_output, *out.deepstack_features])
        assert feats.shape == exp.shape
        assert float((feats - exp).abs().max()) < 1e-4


@pytest.mark.slow
def test_batch_mixing_image_and_text_equals_alone(served):
    """generate_batch: the text decode of the three requests is one batched call per step."""
    rt, ref, _ = served
    reqs = [{"input_ids": ONE, "images": [_image(64, 64, 6)]}, {"input_ids": TEXT},
            {"input_ids": TWO, "images": [_image(64, 96, 7), _image(64, 64, 8)]}]
    steps = []
    batched = rt.decode_batch
    rt.decode_batch = lambda tokens, slots: steps.append(len(slots)) or batched(tokens, slots)
    try:
        res = rt.multimodal.generate_batch(reqs, max_new_tokens=NEW)
    finally:
        del rt.decode_batch
    assert steps == [3] * (NEW - 1)
    for req, r in zip(reqs, res):
        assert r["error"] is None
        assert r["tokens"] == rt.generate(req["input_ids"], NEW, images=req.get("images"))
    assert res[0]["tokens"] == _upstream(rt, ref, ONE, reqs[0]["images"])[1]


@pytest.mark.slow
def test_text_decode_of_image_and_text_requests_is_one_batched_step(served):
    """Three requests (one image, text only, two images: three different rope deltas) prefilled in their
    slots, then stepped together through the batched decode program (each token at its cache position, its M-RoPE
    position shifted by its own delta): each gets upstream's greedy tokens; the first stops early, so later
    steps run slots 1 and 2 only."""
    rt, ref, d = served
    report = json.loads((d / "report.json").read_text())
    assert rt.has_batched_decode and report["decode_batch"] == {"built": True, "reason": None}
    reqs = [(ONE, [_image(64, 64, 11)]), (TEXT, []), (TWO, [_image(64, 96, 12), _image(64, 64, 13)])]
    limits = [4, NEW, NEW]
    out = {k: [int(rt.multimodal.prefill(p, imgs, slot=k)[0, -1].argmax())] for k, (p, imgs) in enumerate(reqs)}
    assert len(set(rt.multimodal.deltas[k] for k in out)) == 3
    calls = []
    run = rt.programs["decode_batch"].run
    rt.programs["decode_batch"].run = lambda *a, **kw: calls.append(1) or run(*a, **kw)
    try:
        for _ in range(NEW - 1):
            live = [k for k in out if len(out[k]) < limits[k]]
            for k, row in zip(live, rt.decode_batch([out[k][-1] for k in live], live)):
                out[k].append(int(row.argmax()))
    finally:
        del rt.programs["decode_batch"].run
    assert len(calls) == NEW - 1
    for k, (p, imgs) in enumerate(reqs):
        assert out[k] == _upstream(rt, ref, p, imgs, limits[k])[1], k


@pytest.mark.slow
def test_bad_images(served, tmp_path):
    rt, ref, _ = served
    mm = rt.multimodal
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image")
    with pytest.raises(UserError, match="cannot read"):
        mm.preprocess(bad)
    with pytest.raises(UserError, match="cannot read"):
        mm.preprocess(tmp_path / "missing.png")
    with pytest.raises(UserError, match="zero-size"):
        mm.preprocess(np.zeros((0, 64, 3), dtype=np.uint8))
    with pytest.raises(UserError, match="aspect ratio"):  # upstream smart_resize refuses ratios over 200
        mm.preprocess(np.zeros((2, 500, 3), dtype=np.uint8))
    with pytest.raises(UserError, match="not compiled"):  # 64x128 -> grid 1x4x8 (not declared)
        mm.preprocess(_image(64, 128, 9))
    assert mm.preprocess(_image(64, 128, 9), fit=True)[1] == (1, 4, 6)  # fit: the nearest compiled grid
    # larger than the declared maximum (the largest compiled grid): the upstream processor downscales it
    big = _image(200, 200, 10)
    assert mm.preprocess(big)[1] == (1, 4, 4)
    # grayscale and RGBA: the upstream processor converts to RGB (do_convert_rgb); results match upstream
    for img in (_image(64, 64, 11, "L"), _image(64, 64, 12, "RGBA"), np.full((64, 64), 77, dtype=np.uint8), big):
        exp_logits, exp_tokens = _upstream(rt, ref, ONE, [img], n=8)
        assert float((mm.prefill(ONE, [img]) - exp_logits).abs().max()) < 1e-4
        assert rt.generate(ONE, 8, images=[img]) == exp_tokens
    # a bad request in a batch reports its error; the others keep going
    good = {"input_ids": ONE, "images": [_image(64, 64, 13)]}
    res = mm.generate_batch([{"input_ids": ONE, "images": [bad]}, good, {"input_ids": ONE}], max_new_tokens=8)
    assert "cannot read" in res[0]["error"] and "image tokens" in res[2]["error"]
    assert res[1]["error"] is None and res[1]["tokens"] == rt.generate(ONE, 8, images=good["images"])


@pytest.mark.slow
def test_vision_activations_planned_in_the_shared_arena(served):
    rt, _, d = served
    pj = json.loads((d / "program.json").read_text())["programs"]
    assert {"prefill", "decode", "vision_1x4x4", "vision_1x4x6"} <= set(pj)
    arena = pj["prefill"]["memory"]["arena_bytes"]

    def region(name):
        p = pj[name]
        offs = p["memory"]["offsets"]
        local = [offs[str(b["id"])] for b in p["buffers"] if b.get("weight") is None and b.get("state") is None
                 and b["alias_of"] is None]
        return min(local), max(local)
    base = region("prefill")[0]
    for name in ("vision_1x4x4", "vision_1x4x6"):
        mem = pj[name]["memory"]
        assert mem["arena_bytes"] == arena and "activations" in mem["zones"] and "io" in mem["zones"]
        lo, hi = region(name)
        assert lo >= base and hi < arena  # its own region above the persistent zones, from the common base
        # the vision weights are the checkpoint's tensors, placed once (shared names with upstream's keys)
        names = {b["weight"] for b in pj[name]["buffers"] if b.get("weight")}
        assert "model.visual.patch_embed.proj.weight" in names


@pytest.mark.slow
def test_cli_run_with_images(served, tmp_path):
    from click.testing import CliRunner

    from dayzero.tools.cli import main

    rt, ref, d = served
    p1, p2 = tmp_path / "a.png", tmp_path / "b.png"
    _image(64, 64, 2).save(p1)
    _image(64, 96, 3).save(p2)
    ids = ",".join(map(str, TWO))
    r = CliRunner().invoke(main, ["run", str(d), "--image", str(p1), "--image", str(p2), "--input-ids", ids,
                                  "--max-new-tokens", "6", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["tokens"] == rt.generate(TWO, 6, images=[str(p1), str(p2)])
    r = CliRunner().invoke(main, ["run", str(d), "--image", str(tmp_path / "nope.png"), "--input-ids", ids])
    assert r.exit_code == 2 and "cannot read" in r.output


def test_parse_grid():
    from dayzero.frontend.vision import parse_grid

    assert parse_grid("1x4x4") == (1, 4, 4)
    assert parse_grid("4x6") == (1, 4, 6)
    with pytest.raises(UserError):
        parse_grid("4")
