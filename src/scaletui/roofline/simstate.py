"""The state of one simulated run (the client, the waiting queue, the running requests, the
clocks and counters) and the server's verbs on it, each engine call priced by the cost model:
`simulate`'s loops drive it.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable

import numpy as np

from scaletui import policy
from scaletui.roofline.costmodel import CostModel
from scaletui.roofline.simrecords import Load, SimTiming
from scaletui.shape import ServerShape

ROW_GRAIN = 8  # native kernels: a running row's attention cost at its length rounded up to this


class SimState:
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
            s = sum(
                cost.prefill_s(next(b for b in self._pbuckets if b >= min(chunk, stop - c)), c)
                for c in range(start, stop, chunk)
            )
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
        return base, [
            max(self.decode.decode_call_s(batch, k * ROW_GRAIN, steps) - base, 0.0) / batch
            for k in range(top)
        ]

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
