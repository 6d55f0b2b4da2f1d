"""One rank of a sharded artifact, started by tests/test_dist.py as torchrun would (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT in the environment): ``python _dist_worker.py ART OUT MODE``.

MODE ``run``: load ART, prefill a prompt, generate greedily (alone, and two prompts batched), and write to OUT (a safetensors file) the logits, the
tokens, the checkpoint reads this rank made ("key start length" lines) and the bound expert weights of layer 0.
MODE ``die``: rank 1 exits right after loading (before any collective); rank 0 runs and writes the error it got.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from safetensors.torch import save_file

PROMPT = [1, 5, 9, 33, 7, 2, 100, 17]
NEW_TOKENS = 6
BATCH = [[3, 4, 5], [200, 17, 1, 1, 9]]


def main(art: str, out: str, mode: str) -> None:
    from dayzero import UserError
    from dayzero.frontend import checkpoint
    from dayzero.runtime import load
    from dayzero.runtime.executor import generate_batch

    reads = []
    original = checkpoint.TensorReader.read_into

    def recorded(self, dst, info, start):
        reads.append(f"{info.key} {start} {dst.numel()}")
        return original(self, dst, info, start)
    checkpoint.TensorReader.read_into = recorded
    rt = load(art, dist_timeout_s=20)
    rank = int(os.environ["RANK"])
    if mode == "die" and rank == 1:
        os._exit(0)
    try:
        logits = rt.prefill([PROMPT])
        tokens = rt.generate(PROMPT, max_new_tokens=NEW_TOKENS)
        batch = generate_batch(rt, BATCH, max_new_tokens=NEW_TOKENS)  # the batched decode program
    except UserError as e:
        with open(out + ".err", "w") as f:
            f.write(str(e))
        raise SystemExit(2)
    prog = rt.programs["prefill"]
    experts = {b["weight"]: prog.view(b["id"], ()).clone() for b in prog.buffers
               if b.get("weight") and b["alias_of"] is None and ".layers.0." in b["weight"] and "experts" in b["weight"]}
    save_file({"logits": logits.contiguous(), "tokens": torch.tensor(tokens),
               "batch_tokens": torch.tensor([r["tokens"] for r in batch]), **experts}, out,
              metadata={"reads": json.dumps(reads)})


if __name__ == "__main__":
    from dayzero.runtime.dist import exit_rank

    try:
        main(*sys.argv[1:4])
    except SystemExit as e:  # a rank ends as `dayzero run` ends one: past the C++ teardown (runtime/dist.py)
        exit_rank(e.code)
        raise
    exit_rank(0)
