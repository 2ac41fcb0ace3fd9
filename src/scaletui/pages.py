"""Host-side page allocator of a paged KV cache, with vLLM-style automatic prefix caching.

The device KV cache of one data-parallel replica is a pool of `n_pages` pages of `page_size`
token positions each. Page 0 is the reserved "trash" page: it is never handed out (inactive decode
rows write there). The scheduler keeps one `PagePool` per replica and a page list per running
sequence (serve/scheduling/paging.py); the simulator keeps one to replay the same decisions
(policy.py).
Standard library only.

Every usable page is in exactly one of three places:

- the free list: never used, or released without a registered prefix (refcount 0, no key);
- held: referenced by at least one sequence (refcount >= 1), with or without a key;
- the LRU: released pages that still hold a registered prefix (refcount 0, keyed). They are
  matchable (a new request with the same prefix takes them back) and evictable (`allocate`
  reuses the least recently used one once the free list is empty, dropping its key).

Prefix caching: the key of a FULL page i of a prompt is a hash of (key of page i-1, salt, the
page's token ids as int32), page 0's parent being a fixed root, so a key names the whole prefix
up to and including that page. The salt carries whatever else makes K/V differ (model, precision,
...); different salts never match. `register` maps keys to the pages a sequence wrote its
prompt K/V into; `match` walks a new prompt's chain page by page and takes the longest run of
registered pages, leaving at least one token to prefill (it produces the first token's logits).
A key already registered to another page keeps its first page (the newcomer stays a plain page).

Every call costs O(pages touched), never a scan of the pool (it may have 100k pages). Not
thread-safe by itself: the scheduler calls it under its lock.
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter, OrderedDict
from collections.abc import Iterator, Sequence

from scaletui.policy import reusable_pages

TRASH_PAGE = 0  # reserved, never handed out
_ROOT_KEY = b"\x00" * 16  # parent key of a prompt's first page
_KEY_BYTES = 16


class NoPages(Exception):
    """Not enough free pages (never-used plus evictable) for an allocation."""


def _salt_bytes(salt: bytes | str) -> bytes:
    """The salt as bytes, length-prefixed so that salt and token bytes can't run together."""
    raw = salt.encode() if isinstance(salt, str) else bytes(salt)
    return struct.pack("<I", len(raw)) + raw


class PagePool:
    """Pages of one replica: allocation, refcounts, and the prefix cache (see module docstring)."""

    def __init__(self, n_pages: int, page_size: int) -> None:
        if n_pages < 2:
            raise ValueError(f"n_pages must be >= 2 (page 0 is reserved), got {n_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.usable = n_pages - 1
        self._tokens = struct.Struct(f"<{page_size}i")  # one page's token ids as int32 bytes
        self._ref = [0] * n_pages  # refcount per page
        self._free = list(range(n_pages - 1, 0, -1))  # stack: pops 1, 2, ... first
        self._lru: OrderedDict[int, None] = OrderedDict()  # evictable keyed pages, oldest first
        self._page_of: dict[bytes, int] = {}  # chain key -> page
        self._key_of: dict[int, bytes] = {}  # page -> chain key
        self._held = 0  # pages with refcount >= 1
        self.queries = 0  # prefix cache counters, in tokens (vLLM semantics)
        self.hits = 0

    # ---- accounting

    def pages_for(self, tokens: int) -> int:
        """Pages needed to hold `tokens` positions."""
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        return -(-tokens // self.page_size)

    @property
    def free(self) -> int:
        """Pages a caller can get now: never used plus evictable."""
        return len(self._free) + len(self._lru)

    @property
    def held(self) -> int:
        """Pages referenced by at least one sequence."""
        return self._held

    @property
    def cached(self) -> int:
        """Pages holding a registered prefix, held or not."""
        return len(self._page_of)

    @property
    def evictable(self) -> int:
        """Cached pages with refcount 0."""
        return len(self._lru)

    def hit_rate(self) -> float:
        """Prefix cache hits / queries (tokens), 0.0 before any query."""
        return self.hits / self.queries if self.queries else 0.0

    def usage(self) -> float:
        """Fraction of usable pages held (what kv_cache_usage_perc reports)."""
        return self._held / self.usable

    def stats(self) -> dict:
        return {
            "page_size": self.page_size,
            "pages_total": self.usable,
            "pages_used": self._held,
            "pages_free": self.free,
            "pages_cached": self.cached,
            "prefix_cache_queries": self.queries,
            "prefix_cache_hits": self.hits,
            "prefix_cache_hit_rate": self.hit_rate(),
        }

    # ---- allocation

    def allocate(self, n: int) -> list[int]:
        """`n` fresh pages at refcount 1: the free list first, then the least recently used
        evictable pages (their keys dropped). Raises NoPages, changing nothing, when short."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n > self.free:
            raise NoPages(f"need {n} pages, free {self.free}, of usable {self.usable}")
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._lru.popitem(last=False)  # evict the oldest
                del self._page_of[self._key_of.pop(page)]
            self._ref[page] = 1
            pages.append(page)
        self._held += n
        return pages

    def release(self, pages: list[int]) -> None:
        """Drop one reference to each page. A page reaching refcount 0 goes to the LRU if it holds
        a registered prefix, else back to the free list. Pages are released last to first, so a
        sequence's tail pages (the least shared) are evicted before its head pages."""
        # validate everything first so that a bad call changes nothing
        for page, count in Counter(pages).items():
            if page == TRASH_PAGE:
                raise ValueError("page 0 is the reserved trash page and is never allocated")
            if not 0 < page < len(self._ref):
                raise ValueError(f"page {page} is out of range 1..{self.usable}")
            if self._ref[page] < count:
                raise ValueError(f"page {page} released more often than it is held")
        for page in reversed(pages):
            self._ref[page] -= 1
            if self._ref[page]:
                continue
            self._held -= 1
            if page in self._key_of:
                self._lru[page] = None  # most recent end
            else:
                self._free.append(page)

    # ---- prefix caching

    def _iter_keys(self, tokens: Sequence[int], n_pages: int, salt: bytes | str) -> Iterator[bytes]:
        """Chain keys of the first `n_pages` full pages of `tokens`, lazily (`match` stops at its
        first miss, so it hashes only the pages it touches)."""
        salt_b = _salt_bytes(salt)
        key = _ROOT_KEY
        size = self.page_size
        for i in range(n_pages):
            chunk = tokens[i * size : (i + 1) * size]
            h = hashlib.blake2b(key, digest_size=_KEY_BYTES)
            h.update(salt_b)
            h.update(self._tokens.pack(*chunk))  # ints, or anything with __index__
            key = h.digest()
            yield key

    def match(self, tokens: Sequence[int], salt: bytes | str = b"") -> tuple[list[int], int]:
        """The longest registered prefix of `tokens` in full pages, never the whole prompt.
        Returns (pages, n_tokens); the caller now holds each page (refcount + 1)."""
        max_pages = reusable_pages(len(tokens), self.page_size)
        pages = []
        for key in self._iter_keys(tokens, max_pages, salt):  # stops at the first miss
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        for page in pages:
            if self._ref[page] == 0:  # evictable -> held
                del self._lru[page]
                self._held += 1
            self._ref[page] += 1
        n_tokens = len(pages) * self.page_size
        self.queries += len(tokens)
        self.hits += n_tokens
        return pages, n_tokens

    def register(self, tokens: Sequence[int], pages: list[int], salt: bytes | str = b"") -> int:
        """Key each FULL page of `tokens` in `pages` (the sequence's page list, in order, its
        prompt K/V written). A key already registered keeps its page. Idempotent. Returns how
        many leading pages of this prefix are registered (to whichever page)."""
        n_full = min(len(tokens) // self.page_size, len(pages))
        for page in pages[:n_full]:
            if not 0 < page < len(self._ref) or self._ref[page] == 0:
                raise ValueError(f"page {page} is not held; only held pages can be registered")
        registered = 0
        for page, key in zip(pages, self._iter_keys(tokens, n_full, salt), strict=False):
            if key not in self._page_of and page not in self._key_of:
                self._page_of[key] = page
                self._key_of[page] = key
            if key not in self._page_of:
                break  # this page already holds another prefix: later ones are unreachable
            registered += 1
        return registered
