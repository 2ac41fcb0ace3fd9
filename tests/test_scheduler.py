"""Scheduler over the FakeEngine: hand-computed outputs, both modes, stops, cancel, overload."""

from __future__ import annotations

import asyncio

import pytest
from scheduler_requests import collect, request

from scaletui.serve.engine.engine_api import SamplingParams
from scaletui.serve.engine.fake_engine import FakeEngine, FakeEngineFactory
from scaletui.serve.scheduling.events import Overloaded, Request, Unavailable
from scaletui.serve.scheduling.scheduler import Scheduler
from scaletui.shape import ServerShape
from scaletui.specs import load_model

EOS = 257


def make(mode: str = "interleaved", step_s: float = 0.001, **kw) -> Scheduler:
    config = ServerShape(load_model("tiny"), mode=mode, max_seq_len=128, **kw)
    sched = Scheduler(config, FakeEngineFactory(vocab_limit=259, step_s=step_s, prefill_s=step_s))
    sched.start()
    assert sched.state == "serving"
    return sched


@pytest.mark.parametrize("mode", ["interleaved", "disaggregated"])
async def test_tokens_are_the_hand_computed_sequence(mode: str) -> None:
    sched = make(mode, slots=4, decode_steps=3)
    try:
        reqs = [request([10, 20 + i], max_tokens=7) for i in range(10)]
        for r in reqs:
            sched.submit(r)
        results = await asyncio.gather(*(collect(r) for r in reqs))
        for i, (ids, finish) in enumerate(results):
            assert ids == list(range(21 + i, 28 + i)) and finish == "length"
        assert sched.counts == {"finished": 10, "aborted": 0, "rejected": 0}
        assert sched.counts_now()["slots_used"] == 0
    finally:
        sched.shutdown()


async def test_eos_min_tokens_and_ignore_eos() -> None:
    sched = make(slots=3)
    try:
        # 250 -> 251 ... 257 (EOS) is the 7th token
        plain, late, ignored = (
            request([250], max_tokens=20),
            request([250], max_tokens=20, min_tokens=9),
            request([250], max_tokens=12, ignore_eos=True),
        )
        for r in (plain, late, ignored):
            sched.submit(r)
        (a, fa), (b, fb), (c, fc) = await asyncio.gather(*map(collect, (plain, late, ignored)))
        assert a == list(range(251, 258)) and fa == "stop"
        # EOS at token 7 is ignored before min_tokens; the vocab wraps 258 -> 0 and runs on
        assert b[:8] == [251, 252, 253, 254, 255, 256, 257, 258] and len(b) == 20
        assert fb == "length"
        assert len(c) == 12 and c[6] == EOS and fc == "length"
    finally:
        sched.shutdown()


async def test_first_token_eos_and_max_tokens_one_finish_at_prefill() -> None:
    sched = make(slots=2)
    try:
        one, eos = request([5], max_tokens=1), request([256], max_tokens=5)
        sched.submit(one)
        sched.submit(eos)
        assert await collect(one) == ([6], "length")
        assert await collect(eos) == ([EOS], "stop")
    finally:
        sched.shutdown()


async def test_new_request_joins_running_batch() -> None:
    sched = make(slots=4, step_s=0.004, decode_steps=2)
    try:
        long = [request([1], max_tokens=120, ignore_eos=True) for _ in range(3)]
        for r in long:
            sched.submit(r)
        while not all(r.t_first for r in long):
            await asyncio.sleep(0.01)
        short = request([100], max_tokens=4)
        sched.submit(short)
        assert await collect(short) == ([101, 102, 103, 104], "length")
        assert not any(r.finished for r in long)  # it did not wait for the batch to drain
        await asyncio.gather(*map(collect, long))
    finally:
        sched.shutdown()


async def test_cancel_frees_slot_and_counts_abort() -> None:
    sched = make(slots=2, step_s=0.004)
    try:
        r = request([1], max_tokens=120, ignore_eos=True)
        waiting = [request([1], max_tokens=120, ignore_eos=True) for _ in range(3)]
        for x in (r, *waiting):
            sched.submit(x)
        while not r.t_first:
            await asyncio.sleep(0.01)
        for x in (r, *waiting):
            sched.cancel(x)
        for _ in range(500):
            if sched.counts_now()["slots_used"] == 0 and sched.counts["aborted"] == 4:
                break
            await asyncio.sleep(0.01)
        assert sched.counts_now()["slots_used"] == 0 and sched.counts["aborted"] == 4
        again = request([7], max_tokens=3)
        sched.submit(again)
        assert await collect(again) == ([8, 9, 10], "length")
    finally:
        sched.shutdown()


async def test_waiting_bounds_by_requests_and_tokens() -> None:
    config = ServerShape(load_model("tiny"), max_seq_len=128, max_waiting=2, max_waiting_tokens=10)
    sched = Scheduler(config, FakeEngineFactory())
    sched.state = "serving"  # no workers: everything stays waiting
    loop = asyncio.get_running_loop()
    sched.submit(Request([1] * 6, SamplingParams(), loop))
    with pytest.raises(Overloaded, match="prompt tokens"):
        sched.submit(Request([1] * 5, SamplingParams(), loop))  # 6 + 5 > 10 tokens
    sched.submit(Request([1] * 4, SamplingParams(), loop))
    with pytest.raises(Overloaded, match="limits 2 / 10"):
        sched.submit(Request([1], SamplingParams(), loop))
    assert sched.counts["rejected"] == 2
    sched.state = "reconfiguring"
    with pytest.raises(Unavailable):
        sched.submit(Request([1], SamplingParams(), loop))


async def test_dead_worker_fails_pending_requests() -> None:
    class Broken(FakeEngine):
        def generate(self, state, steps, pages):
            raise RuntimeError("device lost")

    config = ServerShape(load_model("tiny"), max_seq_len=128, slots=2)
    sched = Scheduler(config, FakeEngineFactory(259, (EOS,), 0.0, 0.0, engine=Broken))
    sched.start()
    reqs = [request([1], max_tokens=5) for _ in range(4)]
    for r in reqs:
        sched.submit(r)
    results = await asyncio.gather(*map(collect, reqs))
    assert all(finish.startswith("error: worker died: RuntimeError: device lost")
               for _, finish in results)  # fmt: skip
    assert sched.state == "failed" and "device lost" in sched.error
    with pytest.raises(Unavailable, match="device lost"):
        sched.submit(request([1]))
    assert sched.counts["aborted"] == 4 and sched.counts_now()["running"] == 0


async def test_reconfigure_from_failed_rebuilds_and_serves() -> None:
    broken = {"on": True}

    class Flaky(FakeEngine):
        def generate(self, state, steps, pages):
            if broken["on"]:
                raise RuntimeError("device lost")
            return super().generate(state, steps, pages)

    config = ServerShape(load_model("tiny"), max_seq_len=128, slots=2)
    sched = Scheduler(config, FakeEngineFactory(259, (EOS,), 0.0, 0.0, engine=Flaky))
    sched.start()
    try:
        dead = request([1], max_tokens=5)
        sched.submit(dead)
        assert (await collect(dead))[1].startswith("error: worker died")
        assert sched.state == "failed"
        broken["on"] = False
        result = await asyncio.to_thread(sched.reconfigure, {"slots": 4})
        assert result["config"]["slots"] == 4 and sched.state == "serving"
        assert sched.error is None
        again = request([7], max_tokens=3)
        sched.submit(again)
        assert await collect(again) == ([8, 9, 10], "length")
    finally:
        sched.shutdown()


async def test_prompt_over_the_token_bound_is_admitted_into_an_empty_queue() -> None:
    config = ServerShape(load_model("tiny"), max_seq_len=128, max_waiting_tokens=10)
    sched = Scheduler(config, FakeEngineFactory())
    sched.state = "serving"  # no workers: everything stays waiting
    loop = asyncio.get_running_loop()
    sched.submit(Request([1] * 12, SamplingParams(), loop))  # alone: it can never fit otherwise
    with pytest.raises(Overloaded, match="prompt tokens"):
        sched.submit(Request([1], SamplingParams(), loop))


async def test_reconfigure_drains_then_serves_new_shape() -> None:
    sched = make(slots=2, step_s=0.002)
    try:
        inflight = [request([30 + i], max_tokens=30, ignore_eos=True) for i in range(4)]
        for r in inflight:
            sched.submit(r)
        result = await asyncio.to_thread(sched.reconfigure, {"slots": 4, "decode_steps": 2})
        assert result["config"]["slots"] == 4 and result["drained"] == 4
        for i, r in enumerate(inflight):
            assert await collect(r) == (list(range(31 + i, 61 + i)), "length")
        assert sched.config.slots == 4 and sched.engines[1].slots == 4
        with pytest.raises(ValueError, match=r"slots \(3\) must be a multiple of dp \(2\)"):
            sched.reconfigure({"slots": 3, "dp": 2})
        with pytest.raises(ValueError, match=r"unknown config key\(s\) \['vocab'\]"):
            sched.reconfigure({"vocab": 3})
        assert sched.state == "serving"
    finally:
        sched.shutdown()


async def test_reconfigure_aborts_past_drain_timeout() -> None:
    sched = make(slots=1, step_s=0.005, decode_steps=1)
    try:
        slow = [request([1], max_tokens=500, ignore_eos=True) for _ in range(3)]
        for r in slow:
            sched.submit(r)
        result = await asyncio.to_thread(sched.reconfigure, {"slots": 2}, 0.2)
        assert result["aborted"] == 3 and result["drained"] == 0
        for r in slow:
            _, finish = await collect(r)
            assert finish.startswith("error: aborted: the server is reconfiguring")
        after = request([1], max_tokens=2)
        sched.submit(after)
        assert await collect(after) == ([2, 3], "length")
    finally:
        sched.shutdown()


@pytest.mark.parametrize("mode", ["interleaved", "disaggregated"])
async def test_the_host_gap_between_engine_calls_is_measured_while_busy(
    mode: str, monkeypatch
) -> None:
    """Each busy worker records its host time from one engine call's end to the next one's
    start (/stats host_gap, Prometheus scheduler_gap_seconds); a wait for work is not one. How
    many busy spells a burst makes depends on the host (a generate worker may wait for the
    prefill worker's prefix), so the calls that start a spell are counted as they happen."""
    from scaletui.serve.scheduling.batcher import GapClock

    spells = []  # per call: whether it started a busy spell (no earlier call to measure from)
    start = GapClock.start
    monkeypatch.setattr(GapClock, "start", lambda c: spells.append(c.last_end is None) or start(c))
    sched = make(mode, step_s=0.002, slots=2, decode_steps=2)
    try:
        for _ in range(2):  # two bursts with an idle spell between them
            reqs = [request([10, 20 + i], max_tokens=9) for i in range(3)]
            for r in reqs:
                sched.submit(r)
            await asyncio.gather(*(collect(r) for r in reqs))
            await asyncio.sleep(0.3)
        stats = sched.metrics.window(60.0)["step_times_ms"]
        gap, gen = stats["host_gap"], stats["generate"]
        assert gap["count"] == len(spells) - sum(spells)  # every call after a spell's first
        assert sum(spells) >= 2 and gap["count"] >= gen["count"] // 2  # two bursts, both busy
        assert gap["mean"] > 0 and gap["p99"] < 250  # the 300 ms idle spell is never counted
        text = sched.metrics.exposition().decode()
        assert f"scaletui:scheduler_gap_seconds_count {float(gap['count'])}" in text
        assert stats["prefill"]["count"] == 6  # tokens and calls are counted as before
    finally:
        sched.shutdown()
