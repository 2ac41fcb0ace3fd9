"""Prediction under load (docs/roofline.md, the third level): a discrete-event simulation of our
scheduler (serve/scheduler.py) over a CostModel, returning loadgen's summary keys.

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
   run between two calls, a long prompt in pieces. Before each call the decoding sequences
   take the pages its steps write; where a pool runs out the youngest is preempted and
   resumes from the head of the queue by prefilling its prompt and output.
   Disaggregated: prefill (and the KV transfer) runs concurrently on its own devices into a
   bounded hand-over queue (max(2, slots)); generate inserts between calls.
4. A generate call runs min(decode_steps, most tokens any slot still needs) steps; its tokens
   reach the clients together at the call's end (one chunk per request: this drives TPOT/ITL).
   The engine computes every slot row over the KV bucket of the longest row (`padded_decode`).
   On the native CPU kernels (the cost model's `kernels`), every slot row runs the matmuls but
   attention reads only the active rows, each over its own positions: a call costs the S-row
   call at the smallest bucket plus, per active row, 1 / S of what S rows at that row's
   mid-call length (rounded up to ROW_GRAIN positions) add to it.
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

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from scaletui import policy
from scaletui.roofline import simreport
from scaletui.roofline.costmodel import CostModel
from scaletui.roofline.simslots import SimSlots
from scaletui.shape import ServerShape

__all__ = ["BOS_TOKENS", "HOST_GAP_PER_ROW_S", "HOST_GAP_S", "INTAKE_S", "Load", "ServerShape",
           "SimResult", "SimTiming", "simulate"]  # fmt: skip

BOS_TOKENS = 1  # what our server puts before a text prompt (its tokenizer's BOS), not before ids
INTAKE_S = 1e-3  # our server's intake per request (aiohttp, JSON, tokenizer; ~0.5-2 ms on CPU)
# our scheduler's host time before an engine call (bookkeeping, insert, token fan-out) and its
# growth per running request: a line through the server's measured /stats host_gap
# (docs/roofline.md, "Three levels of prediction")
HOST_GAP_S = 0.55e-3
HOST_GAP_PER_ROW_S = 0.07e-3
ROW_GRAIN = 8  # native kernels: a running row's attention cost at its length rounded up to this


@dataclass(frozen=True)
class SimTiming:
    """The host's costs around the engine calls, which a server's shape does not set: what the
    simulator adds to the cost model's times, and how it reads them."""

    intake_s: float = 0.0  # a request's HTTP + tokenizer time before it queues, one at a time
    gap_s: float = 0.0  # the scheduler's host time before each engine call while it has work
    gap_per_row_s: float = 0.0  # and its growth per running request (each one's tokens fan out)
    padded_decode: bool = True  # a step costs slots rows x KV bucket (the JAX engine's shapes)

    def __post_init__(self) -> None:
        for name in ("intake_s", "gap_s", "gap_per_row_s"):
            if not 0 <= vars(self)[name] < 1:
                raise ValueError(f"{name} should be in [0, 1) s, got {vars(self)[name]}")


@dataclass(frozen=True, eq=False)
class Load:
    """The client side: one row per request, as loadgen's workload draws them."""

    offsets: np.ndarray  # intended send times, s after t0 (ignored in a closed loop)
    input_len: np.ndarray  # prompt tokens as the server prefills them (BOS, shared prefix included)
    output_len: np.ndarray  # max_tokens (exact: loadgen ignores EOS)
    concurrency: int | None = None  # cap on requests in flight (closed loop without a rate)
    closed_loop: bool = False  # send at a permit, not at an offset
    duration: float | None = None  # stop sending at this many seconds
    requested_rate: float | None = None  # the offered rate, for the summary
    prefix_len: int = 0  # shared-prefix tokens at the start of every prompt (loadgen's)
    prefix_groups: int = 1  # distinct shared prefixes: request i has prefix i % groups

    def __post_init__(self) -> None:
        n = len(self.offsets)
        if len(self.input_len) != n or len(self.output_len) != n:
            raise ValueError("offsets, input_len and output_len should have one row per request")
        if self.closed_loop and not self.concurrency:
            raise ValueError("a closed loop needs a concurrency")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency should be >= 1, got {self.concurrency}")


@dataclass(frozen=True, eq=False)
class SimResult:
    """Per-request times (s after t0; nan where it never happened) and the loadgen summary."""

    t_sched: np.ndarray
    t_send: np.ndarray
    t_first: np.ndarray
    t_last: np.ndarray
    outcome: np.ndarray  # "ok" | "rejected" (429) | "failed" (400) | "unsent"
    summary: dict = field(repr=False)
    chunk_t: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    chunk_n: np.ndarray = field(default_factory=lambda: np.zeros(0, int), repr=False)
    # ^ each token chunk after a request's first token: when it reached the client, its tokens


class _Sim:
    """The mutable state of one run: the client, the waiting queue, the slots, the clocks."""

    def __init__(
        self,
        shape: ServerShape,
        timing: SimTiming,
        decode: CostModel,
        prefill: CostModel,
        load: Load,
        seed: int,
    ):
        self.shape, self.decode, self.prefill_cost, self.load = shape, decode, prefill, load
        self.timing = timing
        self._rng, self._uniform = np.random.default_rng(seed), []
        n = len(load.offsets)
        self.offsets = np.asarray(load.offsets, float).tolist()
        self.inp = np.asarray(load.input_len, int).tolist()
        self.out = np.asarray(load.output_len, int).tolist()
        nan = [math.nan] * n
        self.t_sched, self.t_send = nan.copy(), nan.copy()
        self.first, self.second, self.last = nan.copy(), nan.copy(), nan.copy()
        self.outcome = ["unsent"] * n
        self.arrivals: list[tuple[float, int]] = []  # heap of (reaches the queue, request)
        self.intake_free = -math.inf  # when the server's intake finishes the last request
        self.next_unsent = 0
        self.end = load.duration if load.duration is not None else math.inf
        self.on_plan: Callable[[policy.StepPlan], None] | None = None  # each pass's decisions
        self.waiting: deque[int] = deque()
        self.waiting_tokens = 0
        self.left, self.length, self.prev = [0] * n, [0] * n, [0.0] * n
        self.active: list[int] = []
        self.chunk_t: list[float] = []  # per token chunk after the first: time, gap, tokens
        self.chunk_gap: list[float] = []
        self.chunk_n: list[int] = []
        self.call_s = 0.0  # time in generate calls
        self.call_batch_s = 0.0  # running requests x call time
        self.occupied_s = 0.0  # slots in use x time, all the time
        self.calls = 0
        self.gap_s, self.gaps = 0.0, 0  # host time charged before engine calls, and how often
        self.per_step_s = 0.0  # sum over generate calls of the call's time / its steps
        self.prefill_calls, self.prefill_call_s = 0, 0.0  # prefill calls (pieces) and time
        self._prefill_memo: dict[tuple[int, int], float] = {}
        self._call_memo: dict[tuple[int, int, int], float] = {}  # (batch, bucket, steps)
        self._row_memo: dict[tuple[int, int], tuple] = {}  # native: (batch, steps) -> _row_costs
        buckets = shape.prefill_buckets
        self._pbuckets, self._chunk = buckets, buckets[-1]
        self._dbuckets = shape.decode_buckets
        # the native kernels' attention skips inactive rows (they attend position 0 only)
        self._live_rows = timing.padded_decode and decode.kernels == "native"
        cap = load.concurrency if load.concurrency else n
        for _ in range(min(cap, n)):
            self._send_next(0.0)

    # -- the client -------------------------------------------------------------------------

    def _send_next(self, t_permit: float) -> None:
        """Send the next unsent request once a permit is free at `t_permit`."""
        if self.next_unsent >= len(self.offsets):
            return
        i = self.next_unsent
        sched = t_permit if self.load.closed_loop else self.offsets[i]
        if sched >= self.end:
            self.next_unsent = len(self.offsets)  # dispatch stops at the duration
            return
        self.next_unsent += 1
        self.t_sched[i], self.t_send[i] = sched, max(sched, t_permit)
        # the server takes requests in one at a time: a burst of sends reaches the queue spread
        t_in = max(self.t_send[i], self.intake_free) + self.timing.intake_s
        self.intake_free = t_in
        heapq.heappush(self.arrivals, (t_in, i))

    def _done(self, i: int, t: float, outcome: str) -> None:
        self.outcome[i] = outcome
        if outcome == "ok":
            self.last[i] = t
        if self.load.concurrency:
            self._send_next(t)

    def admit(self, now: float) -> None:
        """Requests sent by `now` reach the waiting queue, or 400 / 429, in send order."""
        shape, arrivals = self.shape, self.arrivals
        while arrivals and arrivals[0][0] <= now:
            t, i = heapq.heappop(arrivals)
            n = self.inp[i]
            if n + self.out[i] > shape.max_seq_len:
                self._done(i, t, "failed")
            elif len(self.waiting) >= shape.max_waiting or (
                self.waiting and self.waiting_tokens + n > shape.max_waiting_tokens
            ):
                self._done(i, t, "rejected")
            else:
                self.waiting.append(i)
                self.waiting_tokens += n

    def next_arrival(self) -> float:
        return self.arrivals[0][0] if self.arrivals else math.inf

    # -- the server's verbs -----------------------------------------------------------------

    def host_gap(self, running: int) -> float:
        """The worker's host time before its next engine call, with `running` requests."""
        s = self.timing.gap_s + self.timing.gap_per_row_s * running
        self.gap_s += s
        self.gaps += 1
        return s

    def varied(self, seconds: float, cost: CostModel) -> float:
        """One call of expected time `seconds` as it runs: times a draw from `cost`'s spread."""
        spread = cost.call_spread
        if not spread:
            return seconds
        if not self._uniform:  # drawn in blocks: one numpy call per 4096 engine calls
            self._uniform = self._rng.random(4096).tolist()
        return seconds * spread[int(self._uniform.pop() * len(spread))]

    def prefill_s(self, n: int, cached: int = 0) -> float:
        """Prefill of an n-token prompt whose first `cached` tokens are in cached pages."""
        s = self._prefill_memo.get((n, cached))
        if s is None:
            cost, chunk, left = self.prefill_cost, self._chunk, n - cached
            if left <= chunk:
                s = cost.prefill_s(next(b for b in self._pbuckets if b >= left), cached)
            else:
                s = sum(cost.prefill_s(chunk, start) for start in range(cached, n, chunk))
            self._prefill_memo[(n, cached)] = s
        return s

    def piece_s(self, start: int, stop: int) -> float:
        """Prefill of prompt tokens start..stop-1 of a sequence whose earlier ones are in its
        pages (a budget's piece): the engine's bucket-sized chunks from `start`."""
        key = (-start - 1, stop)  # apart from prefill_s's (n, cached) keys
        s = self._prefill_memo.get(key)
        if s is None:
            cost, chunk = self.prefill_cost, self._chunk
            s = sum(cost.prefill_s(next(b for b in self._pbuckets if b >= min(chunk, stop - c)), c)
                    for c in range(start, stop, chunk))  # fmt: skip
            self._prefill_memo[key] = s
        return s

    def pop_prefill(self, now: float) -> tuple[int, float] | None:
        """FCFS: the next waiting request and when its prefill (and first token) ends."""
        if not self.waiting:
            return None
        i = self.waiting.popleft()
        self.waiting_tokens -= self.inp[i]
        s = self.prefill_s(self.inp[i])  # the prefix cache serves interleaved servers only
        t = now + self.varied(s, self.prefill_cost)
        self.prefill_calls += 1
        self.prefill_call_s += t - now
        self.first[i] = t
        if self.out[i] == 1:
            self._done(i, t, "ok")
        return i, t

    def insert(self, i: int, now: float, produced: int = 0) -> None:
        """Request i starts decoding: its prompt, the `produced` tokens it had before a
        preemption and the one its prefill gave are its KV."""
        n = self.inp[i] + produced
        self.length[i], self.left[i], self.prev[i] = n, self.out[i] - produced - 1, now
        self.active.append(i)

    def prefilled(self, i: int, t: float, produced: int = 0) -> bool:
        """Request i's prefill gave its next token at `t`: its first, or after a preemption a
        chunk of one; True when that token ends it."""
        if produced:
            self.chunk_t.append(t)
            self.chunk_gap.append(t - self.prev[i])
            self.chunk_n.append(1)
            self.prev[i] = t
            if self.second[i] != self.second[i]:  # nan: this is the second chunk
                self.second[i] = t
        else:
            self.first[i] = t
        if self.out[i] - produced > 1:
            return False
        self._done(i, t, "ok")
        return True

    def _call_s(self, batch: int, ctx: int, steps: int, active: list[int]) -> float:
        """One generate call at `batch` rows over bucket `ctx` for the `active` requests. XLA's
        engine computes every row over the bucket; the native attention reads each running
        row's own positions (0..pos, `kernels.cc`), so there the call is the `batch`-row call at
        the smallest bucket plus, per running row, 1 / batch of what `batch` rows at that row's
        mid-call length add to it (charging each row the bucket over-read the server's calls:
        docs/roofline.md, "Three levels of prediction")."""
        key = (batch, ctx, steps)
        if not self._live_rows:
            full = self._call_memo.get(key)
            if full is None:
                full = self._call_memo[key] = self.decode.decode_call_s(batch, ctx, steps)
            return full
        table = self._row_memo.get((batch, steps))
        if table is None:
            table = self._row_memo[batch, steps] = self._row_costs(batch, steps)
        base, rows = table
        length, up = self.length, steps // 2 + ROW_GRAIN - 1  # mid-call, rounded up
        return base + sum(rows[(length[i] + up) // ROW_GRAIN] for i in active)

    def _row_costs(self, batch: int, steps: int) -> tuple[float, list[float]]:
        """(the call at the smallest bucket, each running row's share by its positions //
        ROW_GRAIN, never below the smallest bucket's): one table for every bucket, as a row's
        cost is its own length's (rounded up, it may pass its bucket by < ROW_GRAIN)."""
        base = self.decode.decode_call_s(batch, self._dbuckets[0], steps)
        top = self.shape.max_seq_len // ROW_GRAIN + steps + 2
        return base, [max(self.decode.decode_call_s(batch, k * ROW_GRAIN, steps) - base, 0.0)
                      / batch for k in range(top)]  # fmt: skip

    def generate(self, now: float, steps: int = 0) -> float:
        """One generate call from `now` (of `steps` steps; 0: as the policy says); returns when
        its tokens reach the clients."""
        active, left, length = self.active, self.left, self.length
        steps = steps or policy.decode_steps([left[i] for i in active], self.shape.decode_steps)
        if self.timing.padded_decode:
            need = max(length[i] for i in active) + steps
            ctx = next((b for b in self._dbuckets if b >= need), self._dbuckets[-1])
            batch = self.shape.slots
        else:
            ctx = sum(length[i] for i in active) // len(active) + steps // 2
            batch = len(active)
        dt = self.varied(self._call_s(batch, ctx, steps, active), self.decode)
        t = now + dt
        self.calls += 1
        self.per_step_s += dt / steps
        self.call_s += dt
        self.call_batch_s += len(active) * dt
        self.occupied_s += len(active) * dt
        still = []
        prev, second = self.prev, self.second
        ct, cg, cn = self.chunk_t.append, self.chunk_gap.append, self.chunk_n.append
        for i in active:
            g = left[i] if left[i] < steps else steps
            left[i] -= g
            length[i] += g
            ct(t)
            cg(t - prev[i])
            cn(g)
            prev[i] = t
            if second[i] != second[i]:  # nan: this is the second chunk
                second[i] = t
            if left[i]:
                still.append(i)
            else:
                self._done(i, t, "ok")
        self.active = still
        return t


def _interleaved(sim: _Sim) -> None:
    """The interleaved loop as the scheduler runs it, each decision scaletui.policy's over the
    same pages (simslots): the requests waiting when a pass starts take free slots whose replica
    has pages (prefill jobs, FCFS; one that arrives during the pass's prefills waits for the
    next pass), reusing cached prefix pages; their prompt tokens run, at most `budget` of them
    with --max-batched-tokens (in pieces that end on a page boundary or with the prompt), then
    the decoding sequences grow (the youngest preempted where pages run out, to prefill prompt
    and output again) and one generate call runs."""
    now, shape, size = 0.0, sim.shape, sim.shape.page_size
    budget = policy.token_budget(shape.max_batched_tokens, size)
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
            plan.admitted.append((i, *got))
            jobs.append([i, got[0], n, got[1]])
        pieces = policy.chunks([n - done for _, _, n, done in jobs], budget, size)
        for job, k in zip(jobs[: len(pieces)], pieces, strict=True):
            i, slot, n, done = job
            plan.chunks.append((i, k))
            gap = sim.host_gap(len(sim.active))
            t = now + gap + sim.varied(sim.piece_s(done, done + k), sim.prefill_cost)
            sim.prefill_calls += 1
            sim.prefill_call_s += t - now - gap
            sim.occupied_s += len(sim.active) * (t - now)
            now, job[3] = t, done + k
            if job[3] < n:
                continue
            kv.prefilled(slot, n)
            before = produced.pop(i, 0)
            if sim.prefilled(i, now, before):  # its first token ends it
                plan.finished.append(i)
                kv.free(slot)
            else:
                sim.insert(i, now, before)
        jobs = [job for job in jobs if job[3] < job[2]]
        if sim.active:
            steps = policy.decode_steps([sim.left[i] for i in sim.active], shape.decode_steps)
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
                now = sim.generate(now + gap, steps)
                plan.steps = steps
                for b in sorted(kv.slot_of[i] for i in running if not sim.left[i]):
                    plan.finished.append(kv.req[b])
                    kv.free(b)
        elif not jobs:
            now = max(now, sim.next_arrival())  # inf: the client sends no more
        if plan and sim.on_plan is not None:
            sim.on_plan(plan)
        if now == math.inf:
            return


def _disaggregated(sim: _Sim) -> None:
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
) -> SimResult:
    """Run `load` through a server of `shape` whose steps cost what `decode` says (and prefill
    what `prefill` says: the prefill devices' model when disaggregated; default `decode`), plus
    the host's `timing` (default: none); `seed` draws the calls' variation (a fitted model's
    `call_spread`); `on_plan` sees each interleaved pass's decisions."""
    sim = _Sim(shape, timing or SimTiming(), decode, prefill or decode, load, seed)
    sim.on_plan = on_plan
    (_interleaved if shape.mode == "interleaved" else _disaggregated)(sim)
    return _result(sim)


def _result(sim: _Sim) -> SimResult:
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
        ),  # fmt: skip
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
        t_sched=t_sched, t_send=t_send, t_first=t_first, t_second=arr(sim.second),
        t_last=t_last, outcome=outcome, input_len=arr(sim.inp, int),
        output_len=arr(sim.out, int), chunk_t=chunk_t, chunk_gap=arr(sim.chunk_gap),
        chunk_n=chunk_n, requested_rate=sim.load.requested_rate, extra=extra,
    )  # fmt: skip
    return SimResult(t_sched, t_send, t_first, t_last, outcome, summary, chunk_t, chunk_n)
