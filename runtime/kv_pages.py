"""The KV-cache manager: blocks of the paged pools handed to requests, and each request's block table.

Every paged cache of an artifact (passes/paged_kv.py) is a pool of ``blocks`` blocks of ``block_size`` rows;
position p of the request in slot k lives in row ``table_k[p // block_size] * block_size + p % block_size`` of
every pool (one table maps all of a request's caches). Block 0 is the scratch block: table entries not yet
handed out point to it, so a padded prefill's tail writes there and nothing valid is ever read from it.

    ensure(slot, tokens)   blocks for positions [0, tokens) before a program writes them (prefill, decode step);
                           a pool without enough free blocks is a UserError for that request alone
    release(slot)          the request is over (or reset): its blocks go back to the free list, reused first

A request holds ceil(tokens / block_size) blocks, never the compiled maximum: with ``--kv-blocks`` below
``max_batch`` full-length requests, short requests share a small pool.
"""

from __future__ import annotations

import torch

from dayzero import UserError


class KVPages:
    def __init__(self, block_size: int, blocks: int, table_len: int, slots: int):
        self.block_size, self.blocks, self.table_len = int(block_size), int(blocks), int(table_len)
        self.free = list(range(self.blocks - 1, 0, -1))  # a stack: pop() hands out the most recently freed block
        self.tables = {k: torch.zeros(self.table_len, dtype=torch.int32) for k in range(slots)}
        self.owned: dict[int, list[int]] = {k: [] for k in range(slots)}

    @classmethod
    def of(cls, program_json: dict, slots: int) -> "KVPages | None":
        cfg = program_json.get("kv_pages")
        return cls(cfg["block_size"], cfg["blocks"], cfg["table_len"], slots) if cfg else None

    def ensure(self, slot: int, tokens: int) -> None:
        need = -(-int(tokens) // self.block_size)
        owned = self.owned[slot]
        missing = need - len(owned)
        if missing <= 0:
            return
        if need > self.table_len:
            raise UserError(f"{tokens} tokens exceed the block table of {self.table_len} blocks of "
                            f"{self.block_size} tokens")
        if missing > len(self.free):
            raise UserError(f"KV cache full: the request needs {missing} more blocks of {self.block_size} tokens "
                            f"but {len(self.free)} of {self.blocks - 1} are free (compile with a larger --kv-blocks "
                            f"or serve fewer requests at once)")
        table = self.tables[slot]
        for i in range(len(owned), need):
            b = self.free.pop()
            owned.append(b)
            table[i] = b

    def release(self, slot: int) -> None:
        self.free.extend(reversed(self.owned[slot]))
        self.owned[slot] = []
        self.tables[slot].zero_()

    def stats(self) -> dict:
        used = sum(len(v) for v in self.owned.values())
        return {"block_size": self.block_size, "blocks": self.blocks - 1, "used": used, "free": len(self.free)}
