"""The simulator's slot table and KV pages: the live scheduler's bookkeeping
(serve/scheduling/paging.py) over the same page allocator (scaletui.pages), so the policy's
decisions see the same state.

The simulator has no token ids, so it makes them up to share what the load's prompts share:
request i's first `prefix_len` tokens are its prefix group's (i % prefix_groups), the rest
(its own prompt and what it generates) its alone. Standard library only, no clocks.
"""

from __future__ import annotations

from scaletui import policy
from scaletui.pages import PagePool
from scaletui.shape import ServerShape


class SimSlots:
    """Which request holds each slot, the pages each slot holds, and when each was admitted."""

    def __init__(self, shape: ServerShape, prefix_len: int = 0, prefix_groups: int = 1) -> None:
        self.shape, self.prefix_len, self.groups = shape, prefix_len, prefix_groups
        self.page_size, self.max_seq_len = shape.page_size, shape.max_seq_len
        self.per_replica = max(shape.slots // shape.dp, 1)
        self.pools = [PagePool(shape.pages, shape.page_size) for _ in range(shape.dp)]
        self.cap = min(self.pools[0].usable, policy.pages_for(shape.max_seq_len, shape.page_size))
        self.req: list[int | None] = [None] * shape.slots  # the request in each slot
        self.slot_of: dict[int, int] = {}  # and the slot of each request in one
        self.held: list[list[int]] = [[] for _ in range(shape.slots)]
        self.order = [0] * shape.slots  # admission count: the oldest grows first
        self.admitted = 0
        self.preemptions = 0

    def tokens(self, i: int, n: int) -> list[int]:
        """Request i's first n token ids: its group's shared prefix, then its own."""
        shared = min(self.prefix_len, n)
        return [-1 - i % self.groups] * shared + [i] * (n - shared)

    def pool_of(self, slot: int) -> PagePool:
        return self.pools[slot // self.per_replica]

    def admit(self, i: int, n: int) -> tuple[int, int] | None:
        """Request i (n tokens to prefill) into the first free slot whose replica has pages
        for them and the next decode steps -> (slot, cached tokens), or None (it waits)."""
        size = self.page_size
        need = policy.admit_pages(n, self.shape.decode_steps, size, self.cap)
        free_slots = [b for b, r in enumerate(self.req) if r is None]
        slot = policy.admit_slot(need, free_slots, [p.free for p in self.pools], self.per_replica)
        if slot is None:
            return None
        pool, cached, hit = self.pool_of(slot), [], 0
        if self.shape.prefix_cache:
            cached, hit = pool.match(self.tokens(i, n))
        pages = policy.pages_for(min(n, self.max_seq_len), size)
        fresh = pool.allocate(max(0, pages - len(cached)))
        self.req[slot], self.held[slot], self.slot_of[i] = i, cached + fresh, slot
        self.order[slot], self.admitted = self.admitted, self.admitted + 1
        return slot, hit

    def prefilled(self, slot: int, n: int) -> None:
        """Its n prompt tokens are in its pages: their full pages become matchable."""
        if self.shape.prefix_cache:
            self.pool_of(slot).register(self.tokens(self.req[slot], n), self.held[slot])

    def free(self, slot: int) -> None:
        """The slot's request ended: its pages go back."""
        if self.held[slot]:
            self.pool_of(slot).release(self.held[slot])
        del self.slot_of[self.req[slot]]
        self.req[slot], self.held[slot] = None, []

    def room(self, steps: int, seqs: list[policy.Seq]) -> list[policy.Grow | policy.Preempt]:
        """What gives the decoding sequences `seqs` pages for `steps` steps (policy.make_room),
        to apply in order: `grow`, or `preempt` and requeue."""
        held = {b: p for b, p in enumerate(self.held) if p}
        free = [p.free for p in self.pools]
        size, top = self.page_size, self.max_seq_len
        return policy.make_room(seqs, held, free, steps, size, top, self.per_replica)

    def grow(self, slot: int, tokens: int) -> None:
        pages = self.held[slot]
        pages += self.pool_of(slot).allocate(policy.pages_for(tokens, self.page_size) - len(pages))

    def preempt(self, slot: int, length: int) -> None:
        """Take the slot's pages back; its first `length` tokens stay matchable."""
        i = self.req[slot]
        if self.shape.prefix_cache:
            self.pool_of(slot).register(self.tokens(i, length), self.held[slot])
        self.preemptions += 1
        self.free(slot)
