"""The KV-cache manager: blocks of the paged pools handed to requests, and each request's block tables.

Every paged cache of an artifact (passes/paged_kv.py) is a pool of blocks of ``block_size`` rows; position p of
the request in slot k lives in row ``table[p // block_size] * block_size + p % block_size`` of its pool. Caches of
one window class share a table and a block count: class 0 (full attention: every position stays) and one class per
sliding window W (blocks whose positions all fell behind the window are handed back). Block 0 of every pool is the
scratch block: table entries not handed out point to it, so a padded prefill's tail writes there and nothing
valid is ever read from it.

    ensure(slot, tokens)   blocks for positions [0, tokens) (a windowed class: those not yet behind the window)
                           before a program writes them; a pool without enough free blocks is a UserError for that
                           request alone, and nothing is taken
    trim(slot, tokens)     after a call: windowed classes free the blocks the next query (at ``tokens``) cannot see
    release(slot)          the request is over (or reset): its blocks go back to the free lists, reused first
    batch_table(name, slots)   a class's tables of several requests stacked [B, table_len] (batched decode)
"""

from __future__ import annotations

import torch

from dayzero import UserError


class _Class:
    def __init__(self, name: str, window: int, blocks: int, table_len: int, slots: int):
        self.name, self.window, self.blocks = name, int(window), int(blocks)
        self.free = list(range(self.blocks - 1, 0, -1))  # a stack: pop() hands out the most recently freed block
        self.rows = torch.zeros(slots, table_len, dtype=torch.int32)  # every slot's table, row k slot k's
        self.tables = {k: self.rows[k] for k in range(slots)}
        self.owned: dict[int, dict[int, int]] = {k: {} for k in range(slots)}  # slot -> {logical: block}
        self.behind: dict[int, int] = {k: 0 for k in range(slots)}  # logical blocks below this are handed back
        self.top: dict[int, int] = {k: 0 for k in range(slots)}  # logical blocks below this were handed out


class KVPages:
    def __init__(self, block_size: int, table_len: int, classes: list[dict], slots: int):
        self.block_size, self.table_len = int(block_size), int(table_len)
        self.classes = [_Class(c["name"], c["window"], c["blocks"], self.table_len, slots) for c in classes]
        self.by_name = {c.name: c for c in self.classes}

    @classmethod
    def of(cls, program_json: dict, slots: int) -> "KVPages | None":
        cfg = program_json.get("kv_pages")
        return cls(cfg["block_size"], cfg["table_len"], cfg["tables"], slots) if cfg else None

    @property
    def tables(self) -> dict[int, torch.Tensor]:
        """Slot -> its full-attention table (class 0), or the first class's."""
        return self.by_name.get("block_table", self.classes[0]).tables

    def table(self, name: str, slot: int) -> torch.Tensor:
        return self.by_name[name].tables[slot]

    def batch_table(self, name: str, slots: list[int]) -> torch.Tensor:
        """The tables of a class for several requests, one row each [len(slots), table_len] (the batched decode
        step reads row i for its token i): one indexed read of the stacked tables, or, for slots 0..B-1 in order
        (a server's usual batch), a view of them (read-only: it changes with the tables)."""
        rows = self.by_name[name].rows
        if slots == list(range(len(slots))):
            return rows[:len(slots)]
        return rows.index_select(0, torch.tensor(slots, dtype=torch.int64))

    def ensure(self, slot: int, tokens: int) -> None:
        need = -(-int(tokens) // self.block_size)
        if need > self.table_len:
            raise UserError(f"{tokens} tokens exceed the block table of {self.table_len} blocks of "
                            f"{self.block_size} tokens")
        # blocks are handed out in logical order and back from the bottom: [behind, top) is held, so a call costs
        # the blocks it adds, not the request's length
        for c in self.classes:  # all or nothing
            missing = need - max(c.top[slot], c.behind[slot])
            if missing > len(c.free):
                raise UserError(f"KV cache full: the request needs {missing} more blocks of {self.block_size} tokens"
                                f" in {c.name} but {len(c.free)} of {c.blocks - 1} are free (compile with a larger "
                                f"--kv-blocks or serve fewer requests at once)")
        for c in self.classes:
            for i in range(max(c.top[slot], c.behind[slot]), need):
                b = c.free.pop()
                c.owned[slot][i] = b
                c.tables[slot][i] = b
            c.top[slot] = max(c.top[slot], need)

    def trim(self, slot: int, tokens: int) -> None:
        for c in self.classes:
            if not c.window:
                continue
            behind = max(0, (int(tokens) - c.window + 1) // self.block_size)  # blocks the next query cannot see
            for i in range(c.behind[slot], behind):
                b = c.owned[slot].pop(i, None)
                if b is not None:
                    c.free.append(b)
                    c.tables[slot][i] = 0
            c.behind[slot] = max(c.behind[slot], behind)

    def release(self, slot: int) -> None:
        for c in self.classes:
            c.free.extend(reversed(list(c.owned[slot].values())))
            c.owned[slot] = {}
            c.behind[slot] = c.top[slot] = 0
            c.tables[slot].zero_()

    def owned(self, slot: int, name: str = "block_table") -> list[int]:
        """Blocks the request in ``slot`` holds in a class's pools, in logical order."""
        c = self.by_name[name]
        return [c.owned[slot][i] for i in sorted(c.owned[slot])]

    def stats(self) -> dict:
        """Per class: blocks in the pool, held ("used": every block off the free list is some slot's, so it is
        counted off the free list, not summed over the slots at every engine iteration) and free."""
        return {c.name: {"block_size": self.block_size, "window": c.window, "blocks": c.blocks - 1,
                         "used": c.blocks - 1 - len(c.free), "free": len(c.free)} for c in self.classes}
