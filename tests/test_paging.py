"""The paged KV cache under the scheduler: pages per slot, growth, preemption and resume.

The FakeEngine checks on every generate call that each active slot holds a page for every
position the call writes and that no two slots write the same page (fake_engine._check_pages),
so a scheduler that under-allocates or double-books pages fails these tests loudly.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from scheduler_requests import collect, request

from scaletui.serve.engine.engine_api import SamplingParams
from scaletui.serve.engine.fake_engine import FakeEngine, FakeEngineFactory
from scaletui.serve.scheduling.events import Request, TooLong
from scaletui.serve.scheduling.paging import PageTables, fixed_table
from scaletui.serve.scheduling.scheduler import Scheduler
from scaletui.shape import ConfigError, ServerShape
from scaletui.specs import load_model

# one worker runs this module (pyproject: --dist loadgroup): each uninterrupted run serves once
pytestmark = pytest.mark.xdist_group("paging")


def make(mode: str = "interleaved", **kw) -> Scheduler:
    kw = {"slots": 4, "max_seq_len": 128, "page_size": 16, "decode_steps": 4, **kw}
    config = ServerShape(load_model("tiny"), mode=mode, **kw)
    sched = Scheduler(config, FakeEngineFactory(vocab_limit=300, step_s=0.001, prefill_s=0.001))
    sched.start()
    assert sched.state == "serving", sched.error
    return sched


def test_config_sizes_the_pool_from_slots_unless_told() -> None:
    tiny = load_model("tiny")
    c = ServerShape(tiny, slots=4, max_seq_len=100, page_size=16)
    assert c.pages_per_seq == 7 and c.pages == 4 * 7 + 1
    assert ServerShape(tiny, slots=4, dp=2, max_seq_len=100, page_size=16).pages == 2 * 7 + 1
    assert ServerShape(tiny, slots=4, max_seq_len=100, kv_pages=9).pages == 9
    with pytest.raises(ConfigError, match="page_size must be one of"):
        ServerShape(tiny, max_seq_len=100, page_size=24)
    with pytest.raises(ConfigError, match="kv_pages must be 0"):
        ServerShape(tiny, max_seq_len=100, kv_pages=1)


def test_page_tables_take_grow_and_free() -> None:
    eng = FakeEngine(slots=4, max_seq_len=64, vocab_size=300, eos_ids=(257,), page_size=16, pages=6)
    t = PageTables(eng)
    assert t.pools[0].usable == 5 and t.whole_pool_tokens() == 80
    assert t.take(0, 17) == [1, 2] and t.table[0].tolist() == [1, 2, 0, 0]
    assert t.grow(0, 32) and t.held[0] == [1, 2]  # 32 positions still fit two pages
    assert t.grow(0, 33) and t.table[0].tolist() == [1, 2, 3, 0]
    assert t.fits(1, 32) and not t.fits(1, 33)
    assert not t.grow(0, 200 + 64) or len(t.held[0]) == 4  # capped at max_seq_len: 4 pages
    assert t.usage() == pytest.approx(4 / 5)
    t.free(0)
    assert t.held[0] == [] and not t.table[0].any() and t.usage() == 0
    assert t.stats()["pages_free"] == 5


def test_fixed_table_gives_each_slot_its_own_row_of_pages() -> None:
    eng = FakeEngine(slots=3, max_seq_len=40, vocab_size=300, eos_ids=(257,), page_size=16)
    table = fixed_table(eng)
    assert table.tolist() == [[1, 2, 3], [4, 5, 6], [7, 8, 9]] and eng.pages == 10
    small = FakeEngine(
        slots=3, max_seq_len=40, vocab_size=300, eos_ids=(257,), page_size=16, pages=4
    )
    with pytest.raises(ValueError, match="needs 10 pages"):
        fixed_table(small)


@pytest.mark.parametrize("mode", ["interleaved", "disaggregated"])
async def test_a_small_pool_preempts_and_every_request_completes_exactly(mode: str) -> None:
    # 4 slots, but 9 usable pages of 16: four 40-token sequences need 3 pages each, so the
    # youngest are preempted as they grow, resume by prefilling prompt + output, and finish
    sched = make(mode, kv_pages=10)
    try:
        reqs = [request([5 + i] * 20, max_tokens=30, ignore_eos=True) for i in range(8)]
        for r in reqs:
            sched.submit(r)
        results = await asyncio.gather(*(collect(r) for r in reqs))
        for i, (ids, finish) in enumerate(results):  # the fake: each token is the last + 1
            assert ids == list(range(6 + i, 36 + i)) and finish == "length", (i, ids)
        stats = await settled(sched)
        assert stats["preemptions"] > 0 and sum(r.preempted for r in reqs) == stats["preemptions"]
        assert stats["pages_used"] == 0 and sched.counts_now()["kv_cache_usage_perc"] == 0
        assert sched.metrics.counter_value(sched.metrics.preemptions) == stats["preemptions"]
        assert sched.counts == {"finished": 8, "aborted": 0, "rejected": 0}
    finally:
        sched.shutdown()


async def test_usage_counts_the_pages_held() -> None:
    sched = make(slots=4, kv_pages=33)
    sched.factory = FakeEngineFactory(vocab_limit=300, step_s=0.05, prefill_s=0.0)
    sched.reconfigure({})  # rebuild with slow steps
    try:
        reqs = [request([7] * 20, max_tokens=40, ignore_eos=True) for _ in range(3)]
        for r in reqs:
            sched.submit(r)
        for _ in range(200):  # all three running
            if sched.counts_now()["slots_used"] == 3:
                break
            await asyncio.sleep(0.01)
        held = sum(len(h) for h in sched.pages.held)
        assert held >= 3 * 2  # at least their prompts' pages (20 tokens: 2 pages of 16)
        assert sched.counts_now()["kv_cache_usage_perc"] == pytest.approx(held / 32, abs=3 / 32)
        await asyncio.gather(*(collect(r) for r in reqs))
        assert sched.counts_now()["kv_cache_usage_perc"] == 0
    finally:
        sched.shutdown()


async def test_a_request_longer_than_the_pool_is_refused_naming_both() -> None:
    sched = make(kv_pages=4)  # 3 usable pages: 48 tokens
    try:
        with pytest.raises(TooLong, match="needs 60 tokens .* holds 48 tokens"):
            sched.submit(request([1] * 20, max_tokens=40))
        ids, finish = await _one(sched, request([1] * 20, max_tokens=20, ignore_eos=True))
        assert len(ids) == 20 and finish == "length"  # the pool still serves what fits
    finally:
        sched.shutdown()


async def settled(sched: Scheduler) -> dict:
    """The page counts once the worker has taken back the pages of the requests that ended
    (their last token reaches the client just before)."""
    for _ in range(100):
        if sched.kv_pages()["pages_used"] == 0:
            break
        await asyncio.sleep(0.01)
    return sched.kv_pages()


async def _one(sched: Scheduler, req) -> tuple[list[int], str]:
    sched.submit(req)
    return await collect(req)


def test_resume_input_carries_the_output_and_lowers_the_limits() -> None:
    from scaletui.serve.scheduling.events import resume_input

    req = Request([1, 2], SamplingParams(max_tokens=10, min_tokens=4, seed=3), None)
    assert resume_input(req) == ([1, 2], req.params)
    req.outputs = [7, 8, 9]
    tokens, params = resume_input(req)
    assert tokens == [1, 2, 7, 8, 9] and (params.max_tokens, params.min_tokens) == (7, 1)
    assert params.seed == 3


def test_fake_engine_refuses_a_table_that_misses_a_written_position() -> None:
    eng = FakeEngine(slots=2, max_seq_len=64, vocab_size=300, eos_ids=(257,), page_size=16)
    state = eng.init_decode_state()
    prefix = eng.prefill([1] * 15, SamplingParams(max_tokens=10))
    state = eng.insert(state, prefix, 0, [1])
    table = np.zeros((2, 4), np.int32)
    table[0, 0] = 1
    with pytest.raises(ValueError, match="writes up to position 18"):
        eng.generate(state, 4, table)  # positions 15..18 cross into a second page
    state = eng.insert(state, prefix, 1, [3])
    table[0], table[1] = [1, 2, 0, 0], [3, 2, 0, 0]
    with pytest.raises(ValueError, match="slots 0 and 1 both write page 2"):
        eng.generate(state, 4, table)
    table[1, 1] = 4
    _, out = eng.generate(state, 4, table)
    assert out.valid.all()


async def serve_real(
    waves: list, slots: int, max_seq_len: int = 64, **config
) -> tuple[list[list[int]], dict]:
    """The real tiny engine (pages of 16, 4 decode steps, prompt buckets from 32, no warm-up:
    only the programs a wave runs compile) serving `waves` of requests one wave after the
    other; every request's tokens (each must end at its length) and the settled page counts."""
    from scaletui.serve.engine.build import JaxEngineFactory

    cfg = ServerShape(load_model("tiny"), slots=slots, max_seq_len=max_seq_len, page_size=16,
                      decode_steps=4, min_prefill_bucket=32, **config)  # fmt: skip
    sched = Scheduler(cfg, JaxEngineFactory(300, (257,)), warmup=False)
    sched.start()
    assert sched.state == "serving", sched.error
    try:
        outs = []
        for wave in waves:
            reqs = wave()
            for r in reqs:
                sched.submit(r)
            results = await asyncio.gather(*(collect(r) for r in reqs))
            assert all(finish == "length" for _, finish in results)
            outs += [ids for ids, _ in results]
        return outs, await settled(sched)
    finally:
        sched.shutdown()


def tight_wave() -> list:
    """Three greedy requests and one seeded sampled one, 61 positions each (4 pages of 16):
    the pools below hold fewer pages than they need at once, so some are preempted."""
    reqs = [request([3 + i, 40, 41 + i] * 7, max_tokens=40, ignore_eos=True) for i in range(3)]
    sampled = SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.0, seed=5)
    return [*reqs, Request([9] * 21, sampled, asyncio.get_running_loop())]


_UNINTERRUPTED: dict[str, list[list[int]]] = {}


async def uninterrupted(name: str, waves: list, slots: int, **config) -> list[list[int]]:
    """The tokens of `waves` on one unsharded engine of XLA's ops with room for every sequence:
    what every other configuration below must reproduce. Served once per test process."""
    if name not in _UNINTERRUPTED:
        outs, pages = await serve_real(waves, slots, kernels="xla", **config)
        assert pages["preemptions"] == 0
        _UNINTERRUPTED[name] = outs
    return _UNINTERRUPTED[name]


@pytest.mark.slow  # builds JAX engines
@pytest.mark.parametrize("kernels", ["xla", "auto"])
async def test_preempted_sequences_resume_with_the_tokens_of_an_uninterrupted_run(kernels) -> None:
    """Greedy and seeded sampling on the real tiny engine (f32): a pool too small for every
    sequence preempts and resumes them, and each produces the tokens of an uninterrupted run
    (of XLA's ops: in f32 the native kernels give the same tokens). Pallas' kernel preempts
    and resumes in test_replicas_prefill_and_decode_in_their_own_pools (dp2-tp2-pallas and
    disagg-pallas, the same tight wave)."""
    want = await uninterrupted("tight", [tight_wave], 4)
    got, pages = await serve_real([tight_wave], 4, kv_pages=9, kernels=kernels)
    assert pages["preemptions"] > 0  # 8 usable pages: two 61-token sequences at once
    assert got == want


async def test_prefix_cache_reuses_a_shared_prompts_pages_and_counts_hits() -> None:
    # 48 shared tokens = 3 full pages of 16, then a request's own tail
    async def run(prefix_cache: bool) -> tuple[list[list[int]], Scheduler]:
        sched = make(slots=2, prefix_cache=prefix_cache)
        try:
            outs = []
            for i in range(4):  # one after another: each finds the pages the last one left
                req = request([40] * 48 + [50 + i] * 5, max_tokens=6, ignore_eos=True)
                ids, finish = await _one(sched, req)
                assert finish == "length"
                outs.append(ids)
            await settled(sched)
            return outs, sched
        finally:
            sched.shutdown()

    cached, sched = await run(True)
    plain, off = await run(False)
    assert cached == plain == [list(range(51 + i, 57 + i)) for i in range(4)]
    stats, m = sched.kv_pages(), sched.metrics
    assert stats["prefix_cache_hits"] == 3 * 48 and stats["prefix_cache_queries"] == 4 * 53
    assert m.counter_value(m.prefix_hits) == 3 * 48 and m.counter_value(m.prefix_queries) == 212
    assert stats["pages_cached"] == 3 and stats["pages_used"] == 0
    assert off.kv_pages()["prefix_cache_queries"] == 0 and off.kv_pages()["pages_cached"] == 0


class Recording(FakeEngine):
    """Logs prefill_pages chunks and generate calls, in order."""

    calls: list = []

    def prefill_pages(self, state, tokens, params, slot, pages, start=0, stop=None):
        stop = len(tokens) if stop is None else stop
        Recording.calls.append(("prefill", len(tokens), start, stop))
        return super().prefill_pages(state, tokens, params, slot, pages, start, stop)

    def generate(self, state, steps, pages):
        Recording.calls.append(("generate", int(state.active.sum())))
        return super().generate(state, steps, pages)


async def test_a_token_budget_splits_a_long_prompt_between_generate_calls() -> None:
    config = ServerShape(load_model("tiny"), slots=2, max_seq_len=256, page_size=16,
                         decode_steps=2, max_batched_tokens=32)  # fmt: skip
    factory = FakeEngineFactory(vocab_limit=300, step_s=0.002, prefill_s=0.0, engine=Recording)
    sched = Scheduler(config, factory)
    sched.start()
    Recording.calls = []
    try:
        short = request([7] * 10, max_tokens=60, ignore_eos=True)
        sched.submit(short)
        while not any(c[0] == "generate" for c in Recording.calls):
            await asyncio.sleep(0.005)
        long = request([9] * 100, max_tokens=3, ignore_eos=True)
        sched.submit(long)
        (a, _), (b, _) = await asyncio.gather(collect(short), collect(long))
        assert a == list(range(8, 68)) and b == [10, 11, 12]
    finally:
        sched.shutdown()
    chunks = [c for c in Recording.calls if c[:2] == ("prefill", 100)]
    assert [(c[2], c[3]) for c in chunks] == [(0, 32), (32, 64), (64, 96), (96, 100)]
    first = Recording.calls.index(chunks[0])
    last = Recording.calls.index(chunks[-1])
    between = [c for c in Recording.calls[first:last] if c[0] == "generate"]
    assert len(between) == 3 and all(c[1] == 1 for c in between)  # the short one kept decoding


@pytest.mark.slow  # builds JAX engines
@pytest.mark.parametrize("kernels", ["auto", "pallas"])
async def test_prefix_cache_and_token_budget_keep_greedy_outputs(kernels) -> None:
    """On the real tiny engine: prompts sharing a 40-token prefix, served with the prefix cache
    and a 24-token budget (long prompts in pieces between decode calls), give the tokens they
    give with neither (on XLA's ops); the cache hits. auto: mixed batches on (the default), so
    a pass's first piece rides in its generate call while others decode. pallas: the pool is
    head-major, chunks gather from it (unmixed: a mixed step's attention is auto's chunk
    attention, and Pallas' interpreter on CPU would compile it again at several times the
    cost)."""

    def wave(n: int):  # the second wave finds the first's pages
        return lambda: [request([11, 12, 13, 14] * 10 + [20 + i + n] * (3 + 9 * i),
                                max_tokens=12, ignore_eos=True) for i in range(3)]  # fmt: skip

    waves = [wave(0), wave(1)]
    plain = await uninterrupted("shared-prefix", waves, 3, max_seq_len=128, prefix_cache=False)
    mixed = kernels != "pallas"
    cached, on = await serve_real(
        waves, 3, 128, kernels=kernels, max_batched_tokens=24, mixed_batches=mixed
    )
    assert cached == plain and on["prefix_cache_hits"] >= 3 * 32


PALLAS_DISAGG = {"kernels": "pallas", "mode": "disaggregated"}


@pytest.mark.slow  # builds JAX engines on 2 and 4 virtual devices
@pytest.mark.parametrize(("dp", "tp", "more"),
                         [(2, 1, {}), (2, 2, {}), (2, 2, {"kernels": "pallas"}),
                          (1, 1, PALLAS_DISAGG)],
                         ids=["dp2", "dp2-tp2", "dp2-tp2-pallas", "disagg-pallas"])  # fmt: skip
async def test_replicas_prefill_and_decode_in_their_own_pools(dp, tp, more) -> None:
    """dp replicas each page their own pool (sharded over 'data'; tp shards KV heads), a tight
    one preempting: greedy and seeded tokens equal one unsharded engine's. With the Pallas
    kernel too (sharded through shard_map), and disaggregated (prefixes written into head-major
    pages)."""
    want = await uninterrupted("tight", [tight_wave], 4)
    got, stats = await serve_real([tight_wave], 4, dp=dp, tp=tp, kv_pages=7, **more)
    assert got == want and stats["preemptions"] > 0  # 6 usable pages per replica
