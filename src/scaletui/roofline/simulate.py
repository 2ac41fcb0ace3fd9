"""Prediction under load (docs/roofline.md, the third level): a discrete-event simulation of our
scheduler (serve/scheduling/scheduler.py) over a CostModel, returning loadgen's summary keys.
Here the event loops; the records in and out: `simrecords`; one run's state, the server's verbs
and each engine call's cost: `simstate`; its slots and KV pages: `simslots`.

What it replays, as the server does it:
1. A request is sent at its offset (open loop), or when one of `concurrency` permits frees (the
   client's cap; a closed loop sends at the permit). It reaches the waiting queue `intake_s`
   later (HTTP and tokenizer), one request at a time: a burst of sends arrives spread out.
   Prompt + max_tokens past max_seq_len fails at once (HTTP 400); a waiting queue past
   `max_waiting` requests or `max_waiting_tokens` prompt tokens rejects it (429). Both free the
   permit.
2. Prefill is FCFS. A prompt is padded to its power-of-two bucket; past the largest bucket it
   runs in bucket-sized chunks. The first token reaches the client when prefill ends.
3. Interleaved: one thread runs passes, each decision scaletui.policy's (the server's own) over
   the same KV page allocator (simslots.py): the requests waiting at a pass's start take the
   free slots whose replica has pages and are prefilled, less a cached prefix's full pages,
   then one generate call runs (a request that arrives meanwhile waits for the next pass);
   with a token budget (`max_batched_tokens`) at most that many prompt tokens (whole pages)
   run between two calls, a long prompt in pieces; with mixed batches (`ServerShape.mixing`)
   the first pieces ride in the generate call (priced `CallCosts.mixed_s` on top of it) and
   their sequences decode from the next call. Before each call the decoding sequences
   take the pages its steps write; where a pool runs out the youngest is preempted and
   resumes from the head of the queue by prefilling its prompt and output.
   Disaggregated: prefill (and the KV transfer) runs concurrently on its own devices into a
   bounded hand-over queue (max(2, slots)); generate inserts between calls.
4. A generate call runs min(decode_steps, most tokens any slot still needs) steps (one with
   pieces riding in it); its tokens reach the clients together at the call's end (one chunk per
   request: this drives TPOT/ITL).
   The engine computes every slot row over the KV bucket of the longest row (`padded_decode`).
   On the native CPU kernels (the cost model's `kernels`), every slot row runs the matmuls but
   attention reads only the active rows, each over its own positions: a call costs the S-row
   call at the smallest bucket plus, per active row, 1 / S of what S rows at that row's
   mid-call length (rounded up to ROW_GRAIN positions, callcost.py) add to it.
5. A call's time is the cost model's expected (median) time, times a draw from its fitted
   `call_spread` (how much one call varies on the host that made the fit; seeded): a run at
   concurrency 1 has a p99 TTFT above its p50, and a closed loop's waves break up as they do
   on the host. Without a spread (an assumed model) every call takes its expected time.
6. Before each engine call the scheduler's worker spends `gap_s` + `gap_per_row_s` per running
   request on the host (its bookkeeping, inserting a prefilled request, fanning the last call's
   tokens out, the GIL it shares with the HTTP side writing each stream's chunk). A pass looks
   at the waiting queue at its start, right after the last call ended: the worker's own gap
   does not let a request sent on that call's tokens (a client's next one) into that pass; the
   client is slower than that. The server measures the gap (/stats `step_times_ms.host_gap`);
   the engine's call times (the fit) leave it out.
Not modelled: EOS before max_tokens (loadgen ignores EOS), cancels, the client's back-off after
a failure, the time a token takes from the engine to the client, and on CPU the two
disaggregated threads sharing cores.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

import numpy as np

from scaletui import policy
from scaletui.roofline import simreport
from scaletui.roofline.costmodel import CostModel
from scaletui.roofline.simrecords import Load, SimResult, SimTiming
from scaletui.roofline.simslots import SimSlots
from scaletui.roofline.simstate import SimState
from scaletui.roofline.speedtrace import SpeedTrace
from scaletui.shape import ServerShape

__all__ = ["simulate"]


def _interleaved(sim: SimState) -> None:
    """The interleaved loop as the scheduler runs it, each decision scaletui.policy's over the
    same pages (simslots): the requests waiting when a pass starts take free slots whose replica
    has pages (prefill jobs, FCFS; one that arrives during the pass's prefills waits for the
    next pass), reusing cached prefix pages; their prompt tokens run, at most `budget` of them
    with --max-batched-tokens (in pieces that end on a page boundary or with the prompt), then
    the decoding sequences grow (the youngest preempted where pages run out, to prefill prompt
    and output again) and one generate call runs."""
    now, shape, size = 0.0, sim.shape, sim.shape.page_size
    budget = policy.token_budget(shape.max_batched_tokens, size)
    cap = shape.mixing  # mixed batches: the prompt rows a generate call takes along
    kv = SimSlots(shape, sim.load.prefix_len, sim.load.prefix_groups)
    produced: dict[int, int] = {}  # preempted requests: the tokens they had produced
    jobs: list[list[int]] = []  # [request, slot, tokens to prefill, tokens in its pages so far]
    while True:
        plan = policy.StepPlan()
        sim.admit(now)
        while sim.waiting:
            i = sim.waiting[0]
            n = sim.inp[i] + produced.get(i, 0)
            got = kv.admit(i, n)
            if got is None:
                break
            sim.waiting.popleft()
            sim.waiting_tokens -= sim.inp[i]
            if sim.admitted[i] != sim.admitted[i]:  # nan: its first admission, not a preemption's
                sim.admitted[i] = now
            plan.admitted.append((i, *got))
            jobs.append([i, got[0], n, got[1]])
        pieces = policy.chunks([n - done for _, _, n, done in jobs], budget, size)
        n_ride = policy.riders(pieces, [job[3] for job in jobs], len(sim.active), cap, size)
        ride = list(zip(jobs, pieces[:n_ride], strict=False))  # they ride in the generate call
        plan.chunks += [(job[0], k) for job, k in ride]
        for job, k in list(zip(jobs, pieces, strict=False))[n_ride:]:
            plan.chunks.append((job[0], k))
            gap = sim.host_gap(len(sim.active))
            t = now + gap + sim.varied(sim.piece_s(job[3], job[3] + k), "prefill", now + gap)
            sim.prefill_calls += 1
            sim.prefill_call_s += t - now - gap
            sim.occupied_s += len(sim.active) * (t - now)
            now = t
            _piece_done(sim, kv, plan, produced, job, k, now)
        jobs = [job for job in jobs if job[3] < job[2]]  # a riding piece's job has not run
        if sim.active:
            lefts = [sim.left[i] for i in sim.active]
            steps = policy.decode_steps(lefts, shape.decode_steps, mixed=bool(ride))
            slot_of, order = kv.slot_of, kv.order
            seqs = [
                policy.Seq(slot_of[i], order[slot_of[i]], sim.length[i], sim.left[i])
                for i in sim.active
            ]
            for act in kv.room(steps, seqs):
                if isinstance(act, policy.Grow):
                    kv.grow(act.slot, act.tokens)
                    continue
                i = kv.req[act.slot]
                kv.preempt(act.slot, sim.length[i])
                sim.active.remove(i)
                plan.preempted.append(i)
                if policy.resumable(sim.inp[i] + sim.out[i] - sim.left[i], shape.max_seq_len):
                    produced[i] = sim.out[i] - sim.left[i]
                    sim.waiting.appendleft(i)
                    sim.waiting_tokens += sim.inp[i]
                else:  # its prompt and output fill max_seq_len: it ends there
                    plan.finished.append(i)
                    sim._done(i, now, "ok")
            if sim.active:
                gap = sim.host_gap(len(sim.active))
                sim.occupied_s += len(sim.active) * gap
                running = list(sim.active)
                extra = sim.costs.mixed_s([(j[3], j[3] + k) for j, k in ride]) if ride else 0.0
                now = sim.generate(now + gap, steps, extra)
                plan.steps, plan.mixed = steps, len(ride)
                for b in sorted(kv.slot_of[i] for i in running if not sim.left[i]):
                    plan.finished.append(kv.req[b])
                    kv.free(b)
                for job, k in ride:
                    _piece_done(sim, kv, plan, produced, job, k, now)
            else:  # every sequence was preempted: the pieces run alone
                for job, k in ride:
                    gap = sim.host_gap(0)
                    now += gap + sim.varied(sim.piece_s(job[3], job[3] + k), "prefill", now + gap)
                    sim.prefill_calls += 1
                    _piece_done(sim, kv, plan, produced, job, k, now)
            jobs = [job for job in jobs if job[3] < job[2]]
        elif not jobs:
            now = max(now, sim.next_arrival())  # inf: the client sends no more
        if plan and sim.on_plan is not None:
            sim.on_plan(plan)
        if now == math.inf:
            return


def _piece_done(sim: SimState, kv: SimSlots, plan, produced: dict, job: list, k: int, now: float):
    """`k` more prompt tokens of `job` ran by `now`; at its prompt's end its first token is out
    and it decodes from the next call (or ends there)."""
    i, slot, n, done = job
    job[3] = done + k
    if job[3] < n:
        return
    kv.prefilled(slot, n)
    before = produced.pop(i, 0)
    if sim.prefilled(i, now, before):  # its first token ends it
        plan.finished.append(i)
        kv.free(slot)
    else:
        sim.insert(i, now, before)


def _disaggregated(sim: SimState) -> None:
    """Two clocks: the prefill thread's and the generate thread's; the earlier one moves.
    A thread that waits on the other (an empty hand-over queue, a full one, no request yet)
    parks at inf and is woken at the other's clock."""
    t_pf, t_gen = 0.0, 0.0
    slots, cap = sim.shape.slots, max(2, sim.shape.slots)
    handover: deque[int] = deque()
    put: tuple[int, float] | None = None  # a prefilled request waiting to enter the queue
    pf_on_queue = False  # the prefill thread waits for room in the queue
    while t_pf < math.inf or t_gen < math.inf:
        if t_pf <= t_gen:
            if put is not None:
                if len(handover) >= cap:
                    pf_on_queue, t_pf = True, math.inf
                    continue
                handover.append(put[0])
                put = None
                if t_gen == math.inf:  # generate was idle: wake it at the hand-over
                    t_gen = t_pf
                continue
            sim.admit(t_pf)
            got = sim.pop_prefill(t_pf + sim.host_gap(0))  # taken now, run after the host time
            if got is None:
                t_pf = sim.next_arrival()  # inf: wait for the client (woken by generate)
                continue
            i, t_pf = got
            if sim.out[i] > 1:
                t_pf += sim.prefill_cost.transfer_s(sim.inp[i])
                put = (i, t_pf)
        else:
            while len(sim.active) < slots and handover:
                sim.insert(handover.popleft(), t_gen)
                if pf_on_queue:
                    pf_on_queue, t_pf = False, t_gen
            if not sim.active:
                t_gen = math.inf
                continue
            gap = sim.host_gap(len(sim.active))
            sim.occupied_s += len(sim.active) * gap
            t_gen = sim.generate(t_gen + gap)
            if t_pf == math.inf and not pf_on_queue and put is None and sim.arrivals:
                t_pf = sim.next_arrival()  # a permit freed: the client sent again
    assert not sim.active and not handover and put is None, "simulation stopped with work left"


def simulate(
    shape: ServerShape,
    decode: CostModel,
    load: Load,
    prefill: CostModel | None = None,
    seed: int = 0,
    timing: SimTiming | None = None,
    on_plan: Callable[[policy.StepPlan], None] | None = None,
    trace: SpeedTrace | None = None,
) -> SimResult:
    """Run `load` through a server of `shape` whose steps cost what `decode` says (and prefill
    what `prefill` says: the prefill devices' model when disaggregated; default `decode`), plus
    the host's `timing` (default: none); `seed` draws the calls' variation (a fitted model's
    `call_spread`); `on_plan` sees each interleaved pass's decisions; `trace` moves each call's
    speed with its start time (a run's measured speeds: roofline/speedtrace.py)."""
    sim = SimState(shape, timing or SimTiming(), decode, prefill or decode, load, seed, trace)
    sim.on_plan = on_plan
    (_interleaved if shape.mode == "interleaved" else _disaggregated)(sim)
    return _result(sim)


def _result(sim: SimState) -> SimResult:
    arr = lambda xs, dtype=float: np.asarray(xs, dtype)  # noqa: E731
    outcome = np.asarray(sim.outcome)
    t_sched, t_send, t_first, t_last = map(arr, (sim.t_sched, sim.t_send, sim.first, sim.last))
    ok = outcome == "ok"
    t_start = float(np.nanmin(t_sched)) if (~np.isnan(t_send)).any() else 0.0
    t_end = float(np.nanmax(np.where(ok, t_last, t_send))) if (~np.isnan(t_send)).any() else 0.0
    span = t_end - t_start
    extra = {
        "generate_calls": sim.calls,
        # a generate call's time over its steps, averaged over the calls (/stats per_token_mean)
        "mean_step_ms": 1e3 * sim.per_step_s / sim.calls if sim.calls else None,
        # a prefill call's time (a budget's piece is one), averaged over the calls
        "mean_prefill_ms": (
            1e3 * sim.prefill_call_s / sim.prefill_calls if sim.prefill_calls else None
        ),
        # running requests per generate call, weighted by the call's time (what a step sees)
        "mean_running_batch": sim.call_batch_s / sim.call_s if sim.call_s else None,
        # slots in use averaged over the whole run (the server's num_requests_running)
        "mean_running": sim.occupied_s / span if span > 0 else None,
        "generate_busy_frac": sim.call_s / span if span > 0 else None,
        # the host time it charged before an engine call, averaged over the calls (/stats's)
        "host_gap_ms": 1e3 * sim.gap_s / sim.gaps if sim.gaps else None,
    }
    chunk_t, chunk_n = arr(sim.chunk_t), arr(sim.chunk_n, int)
    summary = simreport.summary(
        t_sched=t_sched,
        t_send=t_send,
        t_first=t_first,
        t_second=arr(sim.second),
        t_last=t_last,
        outcome=outcome,
        input_len=arr(sim.inp, int),
        output_len=arr(sim.out, int),
        chunk_t=chunk_t,
        chunk_gap=arr(sim.chunk_gap),
        chunk_n=chunk_n,
        requested_rate=sim.load.requested_rate,
        extra=extra,
    )
    return SimResult(
        t_sched, t_send, t_first, t_last, outcome, summary, chunk_t, chunk_n,
        t_admit=arr(sim.admitted), t_second=arr(sim.second),
    )  # fmt: skip
