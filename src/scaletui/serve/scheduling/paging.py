"""The scheduler's side of the paged KV cache: which pages each slot holds, and the page table.

One `pages.PagePool` per data-parallel replica (each replica's engine rows read only its own
pages); slot b belongs to replica b // (slots / replicas). A slot takes the pages its prompt
fills when it is inserted and grows a page at a time before each generate call; a finished,
cancelled or preempted slot gives them back. `table` is the [slots, pages_per_seq] array the
engine's generate call takes (0, the scratch page, where a slot holds nothing). Called from the
worker thread that inserts and generates; /stats reads the counts.
"""

from __future__ import annotations

import numpy as np

from scaletui.pages import NoPages, PagePool
from scaletui.serve.engine.engine_api import Engine


class PageTables:
    """Every slot's pages, over one pool per replica."""

    def __init__(self, engine: Engine) -> None:
        self.page_size, self.max_seq_len = engine.page_size, engine.max_seq_len
        self.per_replica = max(engine.slots // engine.replicas, 1)
        self.pools = [PagePool(engine.pages, engine.page_size) for _ in range(engine.replicas)]
        self.held: list[list[int]] = [[] for _ in range(engine.slots)]
        self.table = np.zeros((engine.slots, engine.pages_per_seq), np.int32)
        self.preemptions = 0

    def pool_of(self, slot: int) -> PagePool:
        return self.pools[slot // self.per_replica]

    @property
    def cap(self) -> int:
        """The most pages one sequence holds: its replica's whole pool, or max_seq_len's."""
        return min(self.pools[0].usable, self.pages_for(self.max_seq_len))

    def free_pages(self) -> list[int]:
        """Free pages (never used plus evictable) of each replica."""
        return [p.free for p in self.pools]

    def pages_for(self, tokens: int) -> int:
        """Pages `tokens` positions take (a sequence never holds more than max_seq_len)."""
        return -(-min(tokens, self.max_seq_len) // self.page_size)

    def fits(self, slot: int, tokens: int) -> bool:
        """Whether the free `slot` could take `tokens` positions now."""
        return self.pool_of(slot).free >= self.pages_for(tokens)

    def take(self, slot: int, tokens: int, cached: list[int] | None = None) -> list[int]:
        """Pages for the first `tokens` positions of a free slot, starting with the `cached`
        prefix pages it already holds (PagePool.match); NoPages: none taken."""
        assert not self.held[slot], f"slot {slot} still holds {self.held[slot]}"
        cached = cached or []
        new = self.pool_of(slot).allocate(max(0, self.pages_for(tokens) - len(cached)))
        self.held[slot] = cached + new
        self.table[slot, : len(self.held[slot])] = self.held[slot]
        return list(self.held[slot])

    def grow(self, slot: int, tokens: int) -> bool:
        """Make `slot` hold pages for `tokens` positions; False (nothing taken) when its pool
        has too few free pages."""
        held = self.held[slot]
        more = self.pages_for(tokens) - len(held)
        if more <= 0:
            return True
        try:
            new = self.pool_of(slot).allocate(more)
        except NoPages:
            return False
        self.table[slot, len(held) : len(held) + more] = new
        held += new
        return True

    def free(self, slot: int) -> None:
        """Give back everything `slot` holds (its request ended or was preempted)."""
        if self.held[slot]:
            self.pool_of(slot).release(self.held[slot])
        self.held[slot] = []
        self.table[slot] = 0

    def whole_pool_tokens(self) -> int:
        """Positions one sequence could hold if it had a replica's whole pool."""
        return self.pools[0].usable * self.page_size

    def usage(self) -> float:
        """Pages held by sequences / usable pages (what kv_cache_usage_perc reports)."""
        return sum(p.held for p in self.pools) / sum(p.usable for p in self.pools)

    def stats(self) -> dict:
        """Pages over every replica: size, total, used, free, cached, and preemptions."""
        pools = [p.stats() for p in self.pools]
        total = lambda key: sum(s[key] for s in pools)
        return {
            "page_size": self.page_size,
            "pages_total": total("pages_total"),
            "pages_used": total("pages_used"),
            "pages_free": total("pages_free"),
            "pages_cached": total("pages_cached"),
            "preemptions": self.preemptions,
            "prefix_cache_queries": total("prefix_cache_queries"),
            "prefix_cache_hits": total("prefix_cache_hits"),
            "prefix_cache_hit_rate": total("prefix_cache_hits")
            / max(1, total("prefix_cache_queries")),
        }


def fixed_table(engine: Engine) -> np.ndarray:
    """A page table for driving an engine without a scheduler (benches, tests, the fit): slot
    b holds the pages of its own max_seq_len row, 1 + i * pages_per_seq onwards (i: its index
    in its replica). Needs the default pool (kv_pages 0: every slot at max_seq_len)."""
    per_replica = max(engine.slots // engine.replicas, 1)
    width = engine.pages_per_seq
    if per_replica * width + 1 > engine.pages:
        raise ValueError(
            f"a fixed page table needs {per_replica * width + 1} pages per "
            f"replica, the engine has {engine.pages}"
        )
    rows = np.arange(engine.slots) % per_replica
    return (1 + rows[:, None] * width + np.arange(width)[None]).astype(np.int32)
