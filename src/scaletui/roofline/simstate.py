"""The state of one simulated run (the client, the waiting queue, the running requests, the
clocks and counters) and the server's verbs on it, each engine call priced by `CallCosts` (the
server prices its own calls with it too):
`simulate`'s loops drive it.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable

import numpy as np

from scaletui import policy
from scaletui.roofline.callcost import CallCosts
from scaletui.roofline.costmodel import CostModel
from scaletui.roofline.simrecords import Load, SimTiming
from scaletui.roofline.speedtrace import SpeedTrace
from scaletui.shape import ServerShape


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
        trace: SpeedTrace | None = None,
    ):
        self.shape, self.decode, self.prefill_cost, self.load = shape, decode, prefill, load
        self.timing, self.trace = timing, trace
        self._rng, self._uniform = np.random.default_rng(seed), []
        n = len(load.offsets)
        self.offsets = np.asarray(load.offsets, float).tolist()
        self.inp = np.asarray(load.input_len, int).tolist()
        self.out = np.asarray(load.output_len, int).tolist()
        nan = [math.nan] * n
        self.t_sched, self.t_send = nan.copy(), nan.copy()
        self.first, self.second, self.last = nan.copy(), nan.copy(), nan.copy()
        self.admitted = nan.copy()  # when each request left the waiting queue (first time)
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
        # each engine call's expected time: the same pricing the server compares itself with
        self.costs = CallCosts(shape, decode, prefill, timing.padded_decode)
        self.prefill_s, self.piece_s = self.costs.prefill_s, self.costs.piece_s
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

    def varied(self, seconds: float, kind: str, start: float) -> float:
        """One call of `kind` (decode, prefill) of expected time `seconds` as it runs from
        `start`: times a draw from its cost model's spread, and the trace's speed then."""
        if self.trace is not None:
            seconds *= self.trace.at(kind, start)
        spread = (self.decode if kind == "decode" else self.prefill_cost).call_spread
        if not spread:
            return seconds
        if not self._uniform:  # drawn in blocks: one numpy call per 4096 engine calls
            self._uniform = self._rng.random(4096).tolist()
        return seconds * spread[int(self._uniform.pop() * len(spread))]

    def pop_prefill(self, now: float) -> tuple[int, float] | None:
        """FCFS: the next waiting request and when its prefill (and first token) ends."""
        if not self.waiting:
            return None
        i = self.waiting.popleft()
        self.waiting_tokens -= self.inp[i]
        self.admitted[i] = now
        s = self.prefill_s(self.inp[i])  # the prefix cache serves interleaved servers only
        t = now + self.varied(s, "prefill", now)
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

    def generate(self, now: float, steps: int = 0, extra_s: float = 0.0) -> float:
        """One generate call from `now` (of `steps` steps; 0: as the policy says; `extra_s`: what
        a prompt piece riding in it adds); returns when its tokens reach the clients."""
        active, left, length = self.active, self.left, self.length
        steps = steps or policy.decode_steps([left[i] for i in active], self.shape.decode_steps)
        dt = self.costs.generate_s(steps, [length[i] for i in active]) + extra_s
        dt = self.varied(dt, "decode", now)
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
