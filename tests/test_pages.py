"""PagePool: allocation accounting, release errors, prefix caching (register / match), LRU
eviction, hit counters, and a randomized invariant check. Pure Python, no jax."""

from __future__ import annotations

import random

import pytest

from scaletui.pages import NoPages, PagePool

S = 4  # page size used throughout


def check_invariants(pool: PagePool) -> None:
    """Every usable page in exactly one place; refcounts, keys and counters consistent."""
    free, lru = pool._free, list(pool._lru)
    held = [p for p in range(1, pool.usable + 1) if pool._ref[p] > 0]
    assert all(r >= 0 for r in pool._ref)
    assert pool._ref[0] == 0
    assert len(set(free)) == len(free) and 0 not in free and 0 not in lru
    assert not set(free) & set(lru) and not set(free) & set(held) and not set(lru) & set(held)
    assert len(held) + len(free) + len(lru) == pool.usable
    assert pool.held == len(held) and pool.free == len(free) + len(lru)
    assert pool.evictable == len(lru)
    assert all(pool._ref[p] == 0 for p in free + lru)
    # keys: a bijection; LRU pages are keyed, free-list pages are not
    assert {p: k for k, p in pool._page_of.items()} == pool._key_of
    assert all(p in pool._key_of for p in lru)
    assert not any(p in pool._key_of for p in free)
    assert pool.hits <= pool.queries


def prompt(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


# ---- construction and helpers


@pytest.mark.parametrize(("n_pages", "page_size", "word"), [(1, 4, "n_pages"), (8, 0, "page_size")])
def test_validation(n_pages: int, page_size: int, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        PagePool(n_pages, page_size)


def test_pages_for() -> None:
    pool = PagePool(8, S)
    assert [pool.pages_for(t) for t in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


# ---- allocation


def test_allocate_release_accounting() -> None:
    pool = PagePool(11, S)  # 10 usable
    assert (pool.usable, pool.free, pool.held) == (10, 10, 0)
    a = pool.allocate(3)
    b = pool.allocate(4)
    assert len(set(a + b)) == 7 and 0 not in a + b
    assert (pool.free, pool.held) == (3, 7)
    assert pool.usage() == pytest.approx(0.7)
    pool.release(a)
    assert (pool.free, pool.held) == (6, 4)
    pool.release(b)
    assert (pool.free, pool.held, pool.cached) == (10, 0, 0)
    assert pool.allocate(0) == []
    check_invariants(pool)


def test_no_pages_changes_nothing() -> None:
    pool = PagePool(5, S)
    held = pool.allocate(3)
    before = pool.stats()
    with pytest.raises(NoPages, match="need 2.*free 1.*usable 4"):
        pool.allocate(2)
    assert pool.stats() == before
    pool.release(held)
    assert pool.allocate(4)  # all usable pages still there
    check_invariants(pool)


def test_trash_page_never_handed_out() -> None:
    pool = PagePool(6, S)
    rng = random.Random(0)
    live: list[list[int]] = []
    for _ in range(500):
        if live and (rng.random() < 0.5 or pool.free == 0):
            pool.release(live.pop(rng.randrange(len(live))))
        else:
            pages = pool.allocate(rng.randint(1, pool.free))
            assert 0 not in pages
            live.append(pages)
    check_invariants(pool)


def test_release_errors_change_nothing() -> None:
    pool = PagePool(6, S)
    pages = pool.allocate(2)
    with pytest.raises(ValueError, match="trash"):
        pool.release([0])
    with pytest.raises(ValueError, match="out of range"):
        pool.release([99])
    with pytest.raises(ValueError, match="released"):
        pool.release([pages[0], pages[0]])  # refcount 1, released twice
    free_page = pool._free[-1]
    with pytest.raises(ValueError, match="released"):
        pool.release([pages[1], free_page])  # refcount 0
    assert (pool.held, pool.free) == (2, 3)  # nothing changed, pages[1] included
    pool.release(pages)
    with pytest.raises(ValueError):
        pool.release(pages)
    check_invariants(pool)


# ---- prefix caching


def run_request(pool: PagePool, tokens: list[int], salt: bytes | str = b"") -> list[int]:
    """What the scheduler does: match, allocate the rest, write K/V, register."""
    matched, _ = pool.match(tokens, salt)
    pages = matched + pool.allocate(pool.pages_for(len(tokens)) - len(matched))
    pool.register(tokens, pages, salt)
    return pages


def test_register_then_match_same_pages() -> None:
    pool = PagePool(16, S)
    tokens = prompt(3 * S + 2)  # 3 full pages + tail
    pages = pool.allocate(4)
    assert pool.register(tokens, pages) == 3  # partial last page not registered
    assert pool.cached == 3 and pages[3] not in pool._key_of
    pool.release(pages)
    assert (pool.evictable, pool.held, pool.free) == (3, 0, 15)
    got, n = pool.match(tokens)
    assert got == pages[:3] and n == 3 * S
    assert (pool.held, pool.evictable) == (3, 0)
    check_invariants(pool)


def test_register_is_idempotent() -> None:
    pool = PagePool(8, S)
    tokens = prompt(2 * S)
    pages = pool.allocate(2)
    assert pool.register(tokens, pages) == 2
    assert pool.register(tokens, pages) == 2
    assert pool.cached == 2
    check_invariants(pool)


def test_match_never_covers_whole_prompt() -> None:
    pool = PagePool(8, S)
    tokens = prompt(2 * S)  # exactly 2 pages
    pool.release(run_request(pool, tokens))
    assert pool.cached == 2
    got, n = pool.match(tokens)
    assert len(got) == 1 and n == S
    pool.release(got)
    assert pool.match(tokens[:1]) == ([], 0)
    assert pool.match([]) == ([], 0)
    check_invariants(pool)


def test_different_salts_do_not_match() -> None:
    pool = PagePool(8, S)
    tokens = prompt(2 * S + 1)
    pool.release(run_request(pool, tokens, salt="model-a/bf16"))
    assert pool.match(tokens, salt="model-a/int8") == ([], 0)
    assert pool.match(tokens) == ([], 0)
    got, n = pool.match(tokens, salt=b"model-a/bf16")  # str and bytes salts agree
    assert n == 2 * S
    pool.release(got)
    check_invariants(pool)


def test_divergent_token_in_page_two_matches_page_one() -> None:
    pool = PagePool(16, S)
    tokens = prompt(3 * S + 1)
    first = run_request(pool, tokens)
    other = list(tokens)
    other[S + 1] = 7  # inside page 2 (index 1)
    got, n = pool.match(other)
    assert got == first[:1] and n == S
    check_invariants(pool)


def test_matched_page_not_evictable_until_released() -> None:
    pool = PagePool(4, S)  # 3 usable
    tokens = prompt(2 * S + 1)
    pool.release(run_request(pool, tokens))  # 2 cached + 1 plain, all free
    got, _ = pool.match(tokens)
    assert (pool.held, pool.evictable, pool.free) == (2, 0, 1)
    with pytest.raises(NoPages):
        pool.allocate(2)
    fresh = pool.allocate(1)
    assert not set(fresh) & set(got)
    assert pool.match(tokens)[0] == got  # still matchable while held: refcount 2
    assert pool._ref[got[0]] == 2
    pool.release(got)
    pool.release(got)
    assert pool.evictable == 2
    check_invariants(pool)


def test_lru_eviction_order() -> None:
    pool = PagePool(4, S)  # 3 usable
    prompts = {name: prompt(S, start) for name, start in (("a", 100), ("b", 200), ("c", 300))}
    page = {}
    for name, tokens in prompts.items():  # one cached page each, released in order a, b, c
        (page[name],) = pool.allocate(1)
        assert pool.register(tokens, [page[name]]) == 1
        pool.release([page[name]])
    assert (pool.cached, pool.evictable, len(pool._free)) == (3, 3, 0)
    pool.release(pool.match(prompts["a"] + [1])[0])  # touch a: b is now the oldest
    evicted = pool.allocate(1)
    assert evicted == [page["b"]]
    assert pool.match(prompts["b"] + [1]) == ([], 0)  # an evicted key no longer matches
    assert pool.cached == 2
    pool.release(evicted)  # plain now: back to the free list, which goes before the LRU
    assert pool.allocate(2) == [page["b"], page["c"]]
    got, n = pool.match(prompts["a"] + [1])
    assert got == [page["a"]] and n == S
    check_invariants(pool)


def test_release_evicts_tail_pages_first() -> None:
    pool = PagePool(4, S)  # 3 usable
    tokens = prompt(3 * S + 1)
    pages = pool.allocate(3)
    pool.register(tokens, pages)
    pool.release(pages)
    assert pool.allocate(1) == [pages[2]]  # the tail goes first, the head survives
    got, n = pool.match(tokens)
    assert got == pages[:2] and n == 2 * S
    check_invariants(pool)


def test_register_keeps_first_page_for_a_key() -> None:
    pool = PagePool(8, S)
    tokens = prompt(2 * S)
    first = pool.allocate(2)
    second = pool.allocate(2)  # same prompt computed twice, concurrently
    assert pool.register(tokens, first) == 2
    assert pool.register(tokens, second) == 2
    assert pool.cached == 2 and not set(second) & set(pool._key_of)
    pool.release(second)
    assert pool.evictable == 0 and pool.free == 5  # plain pages back on the free list
    pool.release(first)
    got, _ = pool.match(tokens + [1])
    assert got == first
    check_invariants(pool)


def test_register_rejects_unheld_pages() -> None:
    pool = PagePool(8, S)
    with pytest.raises(ValueError, match="not held"):
        pool.register(prompt(S), [3])
    with pytest.raises(ValueError, match="not held"):
        pool.register(prompt(S), [0])
    assert pool.cached == 0


def test_hit_counters() -> None:
    pool = PagePool(16, S)
    tokens = prompt(3 * S + 2)  # 3 full pages + tail
    assert pool.hit_rate() == 0.0
    pool.release(run_request(pool, tokens))
    assert (pool.queries, pool.hits) == (len(tokens), 0)
    pool.release(run_request(pool, tokens))
    assert (pool.queries, pool.hits) == (2 * len(tokens), 3 * S)
    assert pool.hit_rate() == pytest.approx(3 * S / (2 * len(tokens)))


def test_stats() -> None:
    pool = PagePool(16, S)
    tokens = prompt(3 * S + 2)
    pool.release(run_request(pool, tokens))
    run_request(pool, tokens)
    assert pool.stats() == {
        "page_size": S,
        "pages_total": 15,
        "pages_used": 4,
        "pages_free": 11,
        "pages_cached": 3,
        "prefix_cache_queries": 2 * len(tokens),
        "prefix_cache_hits": 3 * S,
        "prefix_cache_hit_rate": pytest.approx(3 * S / (2 * len(tokens))),
    }


# ---- randomized


@pytest.mark.parametrize("seed", range(5))
def test_randomized_invariants(seed: int) -> None:
    rng = random.Random(seed)
    pool = PagePool(12, 2)
    # a small vocabulary and shared stems so prefixes collide often
    stems = [[rng.randrange(3) for _ in range(8)] for _ in range(3)]
    live: list[tuple[list[int], list[int]]] = []  # (tokens, pages) per running sequence
    for _ in range(400):
        op = rng.random()
        if op < 0.4:
            tokens = rng.choice(stems)[: rng.randint(1, 8)] + [
                rng.randrange(3) for _ in range(rng.randint(0, 3))
            ]
            matched, n = pool.match(tokens, salt=rng.choice(["", "x"]))
            assert n == 2 * len(matched) and n < len(tokens)
            need = pool.pages_for(len(tokens)) - len(matched)
            try:
                pages = matched + pool.allocate(need)
            except NoPages:
                pool.release(matched)
            else:
                live.append((tokens, pages))
        elif op < 0.6 and live:
            tokens, pages = rng.choice(live)
            registered = pool.register(tokens, pages, salt=rng.choice(["", "x"]))
            assert 0 <= registered <= len(tokens) // 2
        elif op < 0.95 and live:
            _, pages = live.pop(rng.randrange(len(live)))
            pool.release(pages)
        check_invariants(pool)
    for _, pages in live:
        pool.release(pages)
    check_invariants(pool)
    assert (pool.held, pool.free) == (0, pool.usable)
