"""Fuzz (issue 20): seeded random corruptions of a compiled artifact never give exit 0 with a different output,
never crash the process with a signal, and never write outside the artifact's own directory.

Two kinds of damage, each on a tiny dense artifact (prefill only) and a tiny stateful one with paged KV pools:

* raw: bytes of program.json, weights.json, kernels.so, weights.safetensors or artifact.json flipped, truncated,
  zeroed or extended, or JSON edited, without touching the manifest: the hashes must catch every one (exit 2);
* hostile: program.json / weights.json edited and artifact.json re-hashed to match (a consistent but wrong
  artifact). The edits hit the fields that decide where kernels read and write (offsets, sizes, shapes, dtypes,
  arena, request slots, symbols' bounds, aliases, KV pools, weight entries, format) with numbers changed, huge or
  negative values, keys removed and types swapped; fields that only change *what* is computed (a step's
  arguments, a program's input/output ids, copy-run offsets) are edited only in type or presence, since a
  well-formed program that computes something else is not damage a validator can see.

Every damaged copy runs through the CLI (``dayzero run ... --json``) in one subprocess per artifact, one case after
another (a signal kills it: the test names the case); a case must exit 0 with the clean run's output, or exit
2 (or 1/3) with one line on stderr.
"""

from __future__ import annotations

import copy
import json
import random
import subprocess
import sys
import textwrap

import pytest

from dayzero.codegen.artifact import MANIFEST

from _artifact_edit import copy_artifact, rehash

CASES_RAW, CASES_HOSTILE = 12, 20

_DRIVER = textwrap.dedent("""
    import json, sys
    from click.testing import CliRunner
    from dayzero.tools.cli import main

    cases, results = json.load(open(sys.argv[1])), open(sys.argv[2], "w")
    for case in cases:
        print("case", case["name"], file=sys.stderr, flush=True)
        r = CliRunner().invoke(main, case["args"])
        results.write(json.dumps({"name": case["name"], "exit": r.exit_code, "stdout": r.stdout,
                                  "stderr": r.stderr}) + "\\n")
        results.flush()
""")

_JUNK = ["x", 1.5, None, True, [], {}, -7, "../../etc/passwd"]


def _paths(obj, path=()):
    """Every (path, value) of a JSON object, containers included."""
    yield path, obj
    if isinstance(obj, dict):
        for k in sorted(obj):
            yield from _paths(obj[k], path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, path + (i,))


def _semantic(path) -> bool:
    """Fields that say what is computed rather than where: a step's args/outputs, a program's input and output
    ids, a weight's copy runs (see the module docstring)."""
    p = [x for x in path if isinstance(x, str)]
    return "steps" in p or "runs" in p or (len(path) >= 3 and path[0] == "programs" and path[2] in ("inputs",
                                                                                                      "outputs"))


def _mutate(obj, rng: random.Random) -> str:
    """One random edit of OBJ in place; returns what it did."""
    paths = [(p, v) for p, v in _paths(obj) if p]
    while True:
        path, v = rng.choice(paths)
        parent = obj
        for k in path[:-1]:
            parent = parent[k]
        key = path[-1]
        semantic = _semantic(path)
        ops = ["type"]
        if isinstance(parent, dict):
            ops.append("remove")
        if not semantic and isinstance(v, int) and not isinstance(v, bool):
            ops += ["number", "number", "negative", "huge"]
        if not semantic and isinstance(v, str):
            ops.append("string")
        op = rng.choice(ops)
        where = "/".join(map(str, path))
        if op == "remove":
            del parent[key]
        elif op == "type":
            new = rng.choice([j for j in _JUNK if type(j) is not type(v)])
            parent[key] = new
        elif op == "number":
            parent[key] = rng.choice([v + 1, v - 1, v * 2, v + 64, v - 64, 0, 1, v // 2])
        elif op == "negative":
            parent[key] = -64 * rng.randint(1, 1000)
        elif op == "huge":
            parent[key] = rng.choice([1 << 62, 10 ** 30, 1 << 31])
        else:
            parent[key] = v + rng.choice(["x", "_0", " ", "'"])
        return f"{op} {where}"


def _raw(d, rng: random.Random) -> str:
    name = rng.choice(["program.json", "weights.json", "kernels.so", "kernels.so", "weights.safetensors", MANIFEST])
    f = d / name
    data = bytearray(f.read_bytes())
    how = rng.choice(["flip", "flip", "truncate", "zero", "append", "json"])
    if how == "json" and name.endswith(".json") and name != MANIFEST:
        obj = json.loads(data)
        what = _mutate(obj, rng)
        f.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")
        return f"{name}: {what} (not re-hashed)"
    if how == "truncate":
        data = data[: rng.randrange(len(data))]
    elif how == "zero":
        at = rng.randrange(len(data))
        data[at:at + 4096] = bytes(len(data[at:at + 4096]))
    elif how == "append":
        data += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    else:
        how = "flip"
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    f.write_bytes(bytes(data))
    return f"{name}: {how}"


def _hostile(d, rng: random.Random) -> str:
    name = rng.choice(["program.json", "program.json", "weights.json"])
    obj = json.loads((d / name).read_text())
    what = _mutate(obj, rng)
    (d / name).write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")
    rehash(d)
    return f"{name}: {what}"


def _snapshot(root):
    return sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*"))


def _fuzz(art, args, tmp_path, seed):
    cases_dir = tmp_path / "cases"
    cases_dir.mkdir()
    scratch = tmp_path / "cwd"
    scratch.mkdir()
    cases = [{"name": "clean", "args": ["run", str(copy_artifact(art, cases_dir / "clean")), *args, "--json"]}]
    what = {"clean": "nothing"}
    rng = random.Random(seed)
    for k in range(CASES_RAW + CASES_HOSTILE):
        name = f"{'raw' if k < CASES_RAW else 'hostile'}{k:02d}"
        d = copy_artifact(art, cases_dir / name)
        what[name] = (_raw if k < CASES_RAW else _hostile)(d, rng)
        cases.append({"name": name, "args": ["run", str(d), *args, "--json"]})
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    before, before_art = _snapshot(cases_dir), _snapshot(art)
    outside = sorted(p.name for p in tmp_path.iterdir())
    p = subprocess.run([sys.executable, "-c", _DRIVER, str(tmp_path / "cases.json"), str(tmp_path / "results")],
                       cwd=scratch, capture_output=True, text=True, timeout=600)
    started = [ln.split(" ", 1)[1] for ln in p.stderr.splitlines() if ln.startswith("case ")]
    assert p.returncode == 0, (f"case {started[-1] if started else '?'} ({what.get(started[-1]) if started else ''}) "
                               f"ended the process with {p.returncode}: {p.stderr[-2000:]}")
    results = [json.loads(ln) for ln in (tmp_path / "results").read_text().splitlines()]
    assert len(results) == len(cases)
    # nothing written anywhere but the results file: not in the cases, not beside them, not in the cwd
    assert _snapshot(cases_dir) == before and _snapshot(art) == before_art
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(outside + ["results"])
    assert not list(scratch.iterdir())

    def output(r):
        out = json.loads(r["stdout"])
        out.pop("seconds")
        return out
    clean = results[0]
    assert clean["exit"] == 0, clean
    expected = output(clean)
    codes = {}
    for r in results[1:]:
        desc = f"{r['name']} ({what[r['name']]}): exit {r['exit']}, {r['stderr'].strip()[:300]}"
        codes[r["name"]] = r["exit"]
        assert r["exit"] in (0, 1, 2, 3), desc
        if r["exit"] == 0:
            assert output(r) == expected, desc
            continue
        lines = r["stderr"].strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(("error: ", "internal error")), desc
        if r["name"].startswith("raw"):
            assert r["exit"] == 2 and "artifact" in lines[0], desc  # the hashes catch raw damage
    return codes, what


@pytest.mark.slow
def test_fuzz_dense_artifact(compiled_factory, tmp_path):
    art, _, _ = compiled_factory("tiny_dense")
    codes, what = _fuzz(art, ["--input-ids", "1,2,3"], tmp_path, seed=20)
    assert sum(c == 2 for c in codes.values()) >= len(codes) * 3 // 4, {k: (c, what[k]) for k, c in codes.items()}


@pytest.mark.slow
def test_fuzz_paged_kv_artifact(tiny_compiled, tmp_path):
    _, art, _ = tiny_compiled("qwen3_moe")
    codes, what = _fuzz(art, ["--input-ids", "1,2,3", "--max-new-tokens", "3"], tmp_path, seed=7)
    assert sum(c == 2 for c in codes.values()) >= len(codes) * 3 // 4, {k: (c, what[k]) for k, c in codes.items()}


def test_mutations_are_seeded():
    """The same seed edits the same fields (a failing case reproduces)."""
    obj = {"programs": {"prefill": {"memory": {"offsets": {"0": 0, "1": 64}}, "inputs": [0]}}, "format": "f"}
    a, b = copy.deepcopy(obj), copy.deepcopy(obj)
    assert _mutate(a, random.Random(3)) == _mutate(b, random.Random(3)) and a == b and a != obj
