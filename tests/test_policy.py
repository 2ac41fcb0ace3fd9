"""The scheduling policy: its pure decisions by hand, then one arrival trace through the live
scheduler (FakeEngine) and through the simulator, which must decide the same, pass for pass."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from scheduler_requests import collect, request

from scaletui import policy
from scaletui.policy import Grow, Preempt, Seq, StepPlan
from scaletui.roofline.costmodel import CostModel
from scaletui.roofline.simrecords import Load
from scaletui.roofline.simulate import simulate
from scaletui.serve.engine.fake_engine import FakeEngineFactory
from scaletui.serve.scheduling.scheduler import Scheduler
from scaletui.shape import ServerShape
from scaletui.specs import load_model


def test_budget_pages_and_the_prefix_cache_rule() -> None:
    assert policy.pages_for(0, 16) == 0 and policy.pages_for(16, 16) == 1
    assert policy.pages_for(17, 16) == 2
    assert policy.token_budget(0, 16) == 0  # no budget
    assert policy.token_budget(40, 16) == 32 and policy.token_budget(10, 16) == 16
    # never the whole prompt: its last token gives the first output token's logits
    assert policy.reusable_pages(33, 16) == 2 and policy.reusable_pages(32, 16) == 1
    assert policy.reusable_pages(1, 16) == 0 and policy.reusable_pages(0, 16) == 0


def test_admission_needs_pages_for_the_prompt_and_the_next_steps() -> None:
    assert policy.admit_pages(20, 4, 16, cap=8) == 2  # 24 positions
    assert policy.admit_pages(29, 4, 16, cap=8) == 3  # 33 positions
    assert policy.admit_pages(120, 4, 16, cap=4) == 4  # at most a sequence's whole pool
    # slots 0-1 are replica 0 (one free page), 2-3 replica 1 (five)
    assert policy.admit_slot(2, [1, 3], [1, 5], per_replica=2) == 3
    assert policy.admit_slot(1, [1, 3], [1, 5], per_replica=2) == 1
    assert policy.admit_slot(6, [1, 3], [1, 5], per_replica=2) is None
    assert policy.admit_slot(1, [], [9], per_replica=4) is None


def test_chunks_run_fcfs_within_the_budget_on_page_boundaries() -> None:
    assert policy.chunks([10, 100], 0, 16) == [10, 100]  # no budget: everything
    assert policy.chunks([100], 32, 16) == [32]
    assert policy.chunks([10, 100], 32, 16) == [10, 16]  # 22 left: one whole page of the next
    assert policy.chunks([20, 100], 32, 16) == [20]  # 12 left: not a whole page
    assert policy.chunks([10, 20, 5], 32, 16) == [10, 20]  # 2 left: the third's 5 wait
    assert policy.chunks([], 32, 16) == []


def test_mixed_batches_pack_the_first_pieces_within_the_budget() -> None:
    assert policy.mix_tokens(True, 40, 16, "interleaved") == 32
    assert policy.mix_tokens(False, 40, 16, "interleaved") == 0  # off
    assert policy.mix_tokens(True, 40, 16, "disaggregated") == 0
    assert policy.mix_tokens(True, 0, 16, "interleaved") == 0  # no budget: no mix
    ride = lambda pieces, starts=None, decoding=3, cap=64: policy.riders(  # noqa: E731
        pieces, starts or [0] * len(pieces), decoding, cap, 16
    )
    assert ride([32, 16]) == 2  # 32 rows, then 16 from row 32
    assert ride([20, 16]) == 2  # 20 rows take two pages: the second piece from row 32
    assert ride([20, 20, 20]) == 2  # the third would start at row 64
    assert ride([20, 44]) == 1  # from row 32, 44 more rows pass 64
    assert ride([5, 5, 5, 5, 5]) == policy.MIX_PIECES == 4  # the program's pieces at most
    assert ride([16, 16], starts=[32, 0]) == 2  # the first may continue its prompt...
    assert ride([16, 16, 16], starts=[0, 0, 16]) == 2  # ... the others start theirs
    assert ride([32], decoding=0) == 0  # nothing decodes: a plain prefill call
    assert ride([32], cap=0) == 0  # mixing off
    assert ride([48], cap=32) == 0  # more than the compiled rows
    assert ride([]) == 0


def test_decode_steps_stop_at_the_most_any_sequence_needs() -> None:
    assert policy.decode_steps([3, 10], 4) == 4
    assert policy.decode_steps([2, 1], 4) == 2
    assert policy.decode_steps([], 4) == 1
    assert policy.decode_steps([3, 10], 4, mixed=True) == 1  # pieces ride: their tokens at once


def test_make_room_grows_the_oldest_and_preempts_the_youngest() -> None:
    old, young = Seq(0, order=0, length=16, left=10), Seq(1, order=1, length=16, left=10)
    held = {0: [1], 1: [2]}
    # 4 steps from 16 positions need a second page each; one is free: the older takes it,
    # then the younger, short of one, is preempted
    assert policy.make_room([young, old], held, [1], 4, 16, 128, 4) == [Grow(0, 20), Preempt(1)]
    # room for both: both grow, oldest first; a sequence with its pages already grows none
    assert policy.make_room([young, old], held, [2], 4, 16, 128, 4) == [Grow(0, 20), Grow(1, 20)]
    assert policy.make_room([Seq(0, 0, 16, 0)], held, [0], 4, 16, 128, 4) == []
    # alone and short: it preempts itself
    assert policy.make_room([old], held, [0], 4, 16, 128, 4) == [Preempt(0)]
    # growth stops at max_seq_len's pages
    assert policy.make_room([Seq(0, 0, 30, 9)], {0: [1, 2]}, [0], 4, 16, 32, 4) == []


def test_make_room_frees_only_pages_nobody_else_holds() -> None:
    # page 1 is a cached prefix shared by slots 0 and 1 and by slot 2, still prefilling
    old, young = Seq(0, order=0, length=32, left=5), Seq(1, order=1, length=32, left=5)
    held = {0: [1, 3], 1: [1, 2], 2: [1, 4]}
    # preempting the younger frees page 2 only: the older grows into it
    assert policy.make_room([old, young], held, [0], 4, 16, 128, 4) == [Preempt(1), Grow(0, 36)]
    # replicas: slot 2 (replica 1) is never a victim for slot 0 (replica 0)
    other = Seq(2, order=2, length=16, left=5)
    acts = policy.make_room([old, other], {0: [1, 3], 2: [1]}, [0, 0], 4, 16, 128, 2)
    assert acts == [Preempt(0), Preempt(2)]  # the page slot 0 frees is replica 0's


def test_finish_reasons() -> None:
    eos = {"eos_ids": (257, 300), "max_tokens": 10}
    assert policy.finish_reason(300, 3, **eos) == "stop"  # any of them
    assert policy.finish_reason(257, 3, **eos) == "stop"
    assert policy.finish_reason(257, 3, ignore_eos=True, **eos) is None
    assert policy.finish_reason(257, 3, min_tokens=5, **eos) is None
    assert policy.finish_reason(5, 10, **eos) == "length"
    assert policy.finish_reason(5, 3, length=128, max_seq_len=128, **eos) == "length"
    assert policy.finish_reason(5, 3, length=127, max_seq_len=128, **eos) is None
    assert policy.resumable(127, 128) and not policy.resumable(128, 128)
    assert not StepPlan() and StepPlan(steps=4)


# -- one trace, two drivers ----------------------------------------------------------------

# 4 slots of 128 positions over 11 usable 16-token pages, a 32-token prefill budget, the prefix
# cache on: request i's first 32 tokens are prefix group i % 4's (two full pages), the rest its
# own; prompts of 40-100 tokens and 3-40 new tokens: long prompts run in pieces, and sequences
# growing past the pool are preempted and resume.
KNOBS = {
    "slots": 4,
    "max_seq_len": 128,
    "page_size": 16,
    "kv_pages": 12,
    "decode_steps": 4,
    "max_batched_tokens": 32,
    "prefix_cache": True,
}
PREFIX, GROUPS = 32, 4
INPUT = [40, 70, 100, 45, 33, 60, 90, 50, 40, 80, 36, 64]
OUTPUT = [30, 8, 20, 40, 3, 25, 12, 1, 35, 10, 30, 20]


def prompt(i: int) -> list[int]:
    """The live request's ids: its group's prefix, then its own (distinct) token."""
    return [200 + i % GROUPS] * PREFIX + [10 + i] * (INPUT[i] - PREFIX)


async def live_plans() -> list[StepPlan]:
    plans: list[StepPlan] = []
    config = ServerShape(load_model("tiny"), **KNOBS)
    factory = FakeEngineFactory(vocab_limit=300, step_s=0.0, prefill_s=0.0)
    sched = Scheduler(config, factory, on_plan=plans.append)
    sched.start()
    assert sched.state == "serving", sched.error
    try:
        reqs = [request(prompt(i), max_tokens=n, ignore_eos=True) for i, n in enumerate(OUTPUT)]
        with sched.book.cv:  # every arrival queued before the worker's first pass
            for r in reqs:
                sched.submit(r)
        results = await asyncio.gather(*(collect(r) for r in reqs))
    finally:
        sched.shutdown()
    for i, (ids, finish) in enumerate(results):  # the fake: each token is the last + 1
        assert ids == [(10 + i + k) % 300 for k in range(1, OUTPUT[i] + 1)] and finish == "length"
    index = {r.id: i for i, r in enumerate(reqs)}
    return [
        StepPlan(
            [(index[r], slot, hit) for r, slot, hit in p.admitted],
            [(index[r], n) for r, n in p.chunks],
            [index[r] for r in p.preempted],
            p.steps,
            [index[r] for r in p.finished],
            p.mixed,
        )
        for p in plans
    ]


def sim_plans() -> list[StepPlan]:
    plans: list[StepPlan] = []
    shape = ServerShape(load_model("tiny"), **KNOBS)
    cost = CostModel(
        model="hand",
        hardware="hand",
        dtype="f32",
        tp=1,
        dp=1,
        weight_bytes=0.0,
        kv_bytes_per_token=0.0,
        flops_per_token=1e6,
        attn_flops_per_pair=0.0,
        step_overhead_s=1e-3,
        sync_s=5e-4,
        read_bw=1.0,
        decode_flops_per_s=1e12,
        prefill_overhead_s=2e-3,
        prefill_flops_per_s=1e10,
        transfer_bw=1e12,
    )
    n = len(INPUT)
    load = Load(
        np.zeros(n), np.array(INPUT), np.array(OUTPUT), prefix_len=PREFIX, prefix_groups=GROUPS
    )
    result = simulate(shape, cost, load, on_plan=plans.append)
    assert (result.outcome == "ok").all()
    return plans


async def test_one_trace_gets_the_same_decisions_live_and_simulated() -> None:
    live, sim = await live_plans(), sim_plans()
    # the trace exercises every decision: prefix hits, pieces, preemption, first-token ends
    assert any(hit for p in live for _, _, hit in p.admitted)
    assert any(n < INPUT[i] for p in live for i, n in p.chunks if i == 2)
    assert sum(len(p.preempted) for p in live) >= 1
    assert sorted(i for p in live for i in p.finished) == list(range(len(INPUT)))
    # mixed batches (on by default): the first `mixed` pieces ride with the decode step
    mixed = [p for p in live if p.mixed]
    assert mixed and all(p.steps == 1 and len(p.chunks) >= p.mixed for p in mixed)
    assert any(not p.mixed and p.chunks and not p.steps for p in live)  # nothing decoding yet
    for step, (a, b) in enumerate(zip(live, sim, strict=False)):
        assert a == b, f"pass {step}: live {a} != simulated {b}"
    assert len(live) == len(sim)


@pytest.mark.parametrize(
    "knob", [{"prefix_cache": False}, {"max_batched_tokens": 0}, {"mixed_batches": False}]
)
async def test_the_trace_agrees_with_other_knobs(knob, monkeypatch) -> None:
    monkeypatch.setitem(KNOBS, next(iter(knob)), next(iter(knob.values())))
    live, sim = await live_plans(), sim_plans()  # live_plans checks every request's tokens
    assert live == sim
    if "prefix_cache" not in knob:  # no budget or mixing off: nothing rides
        assert not any(p.mixed for p in live)


async def test_several_pieces_ride_in_one_call_live_and_simulated(monkeypatch) -> None:
    """A budget of 96 without the prefix cache (every prompt starts at 0): the pass's first
    pieces pack into one generate call, several at once, the same live and simulated."""
    monkeypatch.setitem(KNOBS, "max_batched_tokens", 96)
    monkeypatch.setitem(KNOBS, "prefix_cache", False)
    live, sim = await live_plans(), sim_plans()
    assert live == sim
    assert any(p.mixed > 1 for p in live)
    for p in live:  # what rode packs as riders() packs it
        rows = [n for _, n in p.chunks[: p.mixed]]
        assert sum(-(-n // 16) * 16 for n in rows[:-1]) + sum(rows[-1:]) <= 96
