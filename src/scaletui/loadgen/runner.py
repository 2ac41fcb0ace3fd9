"""The load runner: the one place with mutable state in loadgen.

1. Warm-up requests (own seed) run to completion first and are excluded.
2. t0 is fixed; each request's t_sched = t0 + its precomputed offset (open loop) and the
   dispatcher sleeps until then; with a concurrency cap it then waits for a permit, keeping
   t_sched (so TTFT_sched shows client-side queueing). Closed loop: t_sched = permit time.
3. Dispatch stops at num_requests, at duration, or on stop(); in-flight requests finish (each
   has a total timeout, so a silent server cannot hang the run) or are cancelled by stop().
4. Every window_s a window aggregate (docs/interfaces.md) goes to on_window.
5. A server that is gone (health.Liveness: max_connection_failures in a row) stops the run at
   once, as stop() does, with stop_reason "server_gone". A closed-loop worker whose request
   failed holds its permit for a backoff that doubles per failure in a row (BACKOFF_S..
   BACKOFF_MAX_S), so failing fast never turns into thousands of requests a second.
6. --ramp-up (open loop): the ramp's requests (ramp.py) go first and count as warm-up; the
   measured window and its schedule start cfg.ramp_up s after t0 (RunResult.t_start).
7. A conversation (RequestSpec.later) is one task holding one permit: each later turn is sent
   think_s after the previous reply's last token (its t_sched), with the whole history; a turn
   that fails ends its conversation. The open loop's offsets and the cap count conversations.
8. A shard (shard.py) sends only its share of the warm-up, the ramp and the schedule, drawn
   before t0; `start` (a coroutine function) gives t0 instead of "now": a common wall-clock
   start of every shard.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Awaitable, Callable
from dataclasses import replace
from itertools import islice
from time import perf_counter

import aiohttp

from scaletui.loadgen import client
from scaletui.loadgen.client import FAILED, RequestRecord
from scaletui.loadgen.health import Liveness
from scaletui.loadgen.ramp import ramp_specs
from scaletui.loadgen.report import Latencies, latencies
from scaletui.loadgen.request_spec import RequestSpec
from scaletui.loadgen.run_config import RunConfig, RunResult
from scaletui.loadgen.shard import Shard
from scaletui.loadgen.tokens import load_counter
from scaletui.loadgen.windows import window_line
from scaletui.loadgen.workload import Workload, iter_requests

YIELD_EVERY = 128  # window work yields to the loop every this many requests
SPIN_S = 0.001  # the last ms before a send time is spent yielding, not in a timer
BACKOFF_S = 0.05  # closed loop: permit held this long after the first failure in a row ...
BACKOFF_MAX_S = 1.0  # ... doubling per further failure, up to this
PROBE_INTERVAL_S = 0.2  # TCP probes of a server that may be gone (health.Liveness)


class Runner:
    def __init__(
        self,
        cfg: RunConfig,
        workload: Workload,
        *,
        on_window: Callable[[dict], None] | None = None,
        shard: Shard | None = None,
        start: Callable[[], Awaitable[float]] | None = None,
    ) -> None:
        self.cfg, self.workload, self.on_window = cfg, workload, on_window
        self.shard, self._start = shard, start
        self.records: list[RequestRecord] = []
        self.windows: list[dict] = []
        self._stopped = False
        self.stop_reason: str | None = None
        self.stop_message: str | None = None
        self._t_stop: float | None = None
        self._dispatcher: asyncio.Task | None = None
        self._fail_streak = 0  # failed requests in a row (closed-loop backoff)
        self._liveness = (
            Liveness(
                cfg.url,
                self._server_gone,
                limit=cfg.max_connection_failures,
                interval=PROBE_INTERVAL_S,
            )
            if cfg.max_connection_failures
            else None
        )
        self._in_flight: set[RequestRecord] = set()
        self._tasks: set[asyncio.Task] = set()
        self._end = math.inf  # no sends at or after this (duration)
        self._ramp_n = 0  # the first this many dispatched requests are the ramp's
        self._finished: list[RequestRecord] = []  # since the last window
        self._tokens: list[tuple[float, int]] = []  # token arrivals not yet windowed
        self._totals = {"sent": 0, "completed": 0, "failed": 0, "rejected": 0}
        self._window_sent = 0
        self._window_delays: list[float] = []  # schedule delays of requests sent this window
        self._timeout = aiohttp.ClientTimeout(
            total=cfg.timeout, sock_read=cfg.read_timeout, sock_connect=min(cfg.timeout, 10.0)
        )

    def stop(self, reason: str = "interrupted", message: str = "stopped by a signal") -> None:
        """Stop dispatching and abort what is in flight (Ctrl-C, SIGTERM, a dead server)."""
        if not self._stopped:
            self.stop_reason, self.stop_message = reason, message
            self._t_stop = perf_counter()
        self._stopped = True
        if self._dispatcher is not None:
            self._dispatcher.cancel()
        for task in list(self._tasks):
            task.cancel()

    def _server_gone(self, message: str) -> None:
        self.stop("server_gone", message)

    def _result(self, records: list[RequestRecord], t0: float) -> RunResult:
        if self._liveness is not None:
            self._liveness.close()
        stop = (self.stop_reason, self.stop_message, self._t_stop)
        return RunResult(records, t0, self._stopped, self.windows, *stop)

    async def run(self, session: aiohttp.ClientSession) -> RunResult:
        cfg, w = self.cfg, self.workload
        if cfg.warmup:
            await self._warmup(session)
        if self._stopped:
            return self._result([], perf_counter())
        specs = iter_requests(w)
        if self.shard is not None:  # its share of the whole stream, drawn before t0
            specs = iter(self.shard.take(w, cfg.num_requests, cfg.duration))
        elif cfg.num_requests is not None:
            specs = islice(specs, cfg.num_requests)
            if w.tokenizer:  # exact prompts cost encodes (or HTTP calls): made before t0
                specs = iter(list(specs))
        sem = asyncio.Semaphore(w.concurrency) if w.concurrency else None
        ramp = ramp_specs(w, cfg.ramp_up) if cfg.ramp_up and not w.closed_loop else []
        ramped = bool(ramp)  # every shard's window starts after the ramp, its share or none
        if self.shard is not None:
            ramp = [s for s in ramp if self.shard.keeps(s.index)]
        t0 = await self._start() if self._start is not None else perf_counter() + 0.005
        t_measure = t0 + (cfg.ramp_up if ramped else 0.0)  # the measured window starts here
        self._end = t_measure + cfg.duration if cfg.duration is not None else math.inf
        ticker = asyncio.create_task(self._windows(t0)) if self.on_window else None
        if ramped:  # the measured schedule starts after the ramp
            shifted = (replace(s, offset=s.offset + cfg.ramp_up) for s in specs)
            specs, self._ramp_n = itertools.chain(ramp, shifted), len(ramp)
        self._dispatcher = asyncio.create_task(self._dispatch(session, specs, sem, t0))
        try:
            await asyncio.wait({self._dispatcher})
            if not self._dispatcher.cancelled():
                self._dispatcher.result()  # its exception, if any
            while self._tasks and not self._stopped:
                await asyncio.wait(set(self._tasks), timeout=0.1)
            if self._tasks:
                await asyncio.wait(set(self._tasks), timeout=cfg.timeout + 5)
        finally:
            self._dispatcher.cancel()
            if ticker is not None:
                ticker.cancel()
            for task in list(self._tasks):
                task.cancel()
            if self._tasks:
                await asyncio.wait(set(self._tasks))
            for rec in self.records:  # tasks cancelled before they started
                if rec.outcome == "pending":
                    rec.outcome, rec.error, rec.t_done = "cancelled", "run stopped", perf_counter()
        return self._result(self.records, t_measure)

    async def _dispatch(self, session, specs, sem, t0: float) -> None:
        closed, end = self.workload.closed_loop, self._end
        for n, spec in enumerate(specs):
            body = self._body(spec.prompt, spec.max_tokens)
            t_sched = t0 + spec.offset
            if not closed and (t_sched >= end or not await self._sleep_until(t_sched)):
                return
            if sem is not None:
                await sem.acquire()
                if self._stopped:
                    return
            if closed:
                t_sched = perf_counter()
                if t_sched >= end:
                    sem.release()
                    return
            rec = self._record(spec.index, t_sched, spec.input_len, spec.max_tokens)
            rec.warmup = n < self._ramp_n  # a ramp request: sent, never counted
            if spec.conversation:
                rec.session, rec.turn = spec.index, 0
                task = asyncio.create_task(self._conversation(session, body, rec, spec, sem))
            else:
                task = asyncio.create_task(self._one(session, body, rec, spec, sem))
            self._tasks.add(task)

    def _body(self, prompt: str | list[int] | list[dict], max_tokens: int) -> bytes:
        cfg = self.cfg
        return client.request_body(
            prompt, max_tokens, model=cfg.model, api=cfg.api, ignore_eos=cfg.ignore_eos
        )

    def _record(self, index: int, t_sched: float, input_len: int, max_tokens: int):
        """The record of a request about to be sent, counted as sent and in flight."""
        rec = RequestRecord(index, t_sched, input_len, max_tokens)
        self.records.append(rec)
        self._in_flight.add(rec)
        self._totals["sent"] += 1
        self._window_sent += 1
        return rec

    async def _sleep_until(self, t: float) -> bool:
        """Sleep to the absolute time t; False if stopped meanwhile."""
        while not self._stopped:
            delay = t - perf_counter()
            if delay <= 0:
                return True
            await asyncio.sleep(min(delay - SPIN_S, 0.1) if delay > 2 * SPIN_S else 0)
        return False

    async def _one(self, session, body: bytes, rec: RequestRecord, spec: RequestSpec, sem):
        try:
            await self._request(session, body, rec, spec.cancel_after)
        finally:
            if sem is not None:
                self._release(sem, rec)
            self._tasks.discard(asyncio.current_task())

    async def _conversation(self, session, body: bytes, rec: RequestRecord, spec, sem):
        cfg, w = self.cfg, self.workload
        counter = load_counter(w.tokenizer) if w.tokenizer else None
        said: list[str] = [spec.prompt]  # user, assistant, user, ... texts so far
        ramp = rec.warmup  # a ramp conversation's later turns are not counted either
        try:
            rec.reply = []
            await self._request(session, body, rec, spec.cancel_after)
            for k, turn in enumerate(spec.later, start=1):
                if rec.outcome != "ok" or self._stopped:
                    return
                said += ["".join(rec.reply or ()), turn.text]
                rec.reply = None
                prompt = client.history(said, cfg.api)
                if counter is not None:  # a server's /tokenize blocks: off the loop
                    n = await asyncio.to_thread(counter.count, "".join(said))
                else:  # an estimate: the turns asked for plus the tokens received
                    n = rec.input_len + rec.output_tokens + turn.input_len
                body = self._body(prompt, turn.max_tokens)
                last = rec.t_last if rec.chunk_times else rec.t_done
                t_sched = last + turn.think_s
                if t_sched >= self._end or not await self._sleep_until(t_sched):
                    return
                rec = self._record(spec.index, t_sched, n, turn.max_tokens)
                rec.session, rec.turn, rec.reply, rec.warmup = spec.index, k, [], ramp
                await self._request(session, body, rec, None)
        finally:
            rec.reply = None
            if sem is not None:
                self._release(sem, rec)
            self._tasks.discard(asyncio.current_task())

    async def _request(self, session, body: bytes, rec: RequestRecord, cancel_after) -> None:
        """Send one request, then count it (windows, totals, liveness); never raises."""
        if self.on_window is not None:  # ~ t_send: send() stamps it without awaiting first
            self._window_delays.append(perf_counter() - rec.t_sched)
        try:
            await client.send(
                session,
                self.cfg.endpoint,
                body,
                rec,
                timeout=self._timeout,
                cancel_after=cancel_after,
            )
        except asyncio.CancelledError:
            rec.outcome, rec.error = "cancelled", "run stopped"
            rec.t_done = perf_counter()
        finally:
            new_tokens = client.finish(rec)
            self._in_flight.discard(rec)
            if self.on_window is not None:
                self._tokens.extend(new_tokens)
                self._finished.append(rec)
            key = "completed" if rec.outcome == "ok" else rec.outcome
            if key in FAILED:
                key = "failed"
            if key in self._totals:
                self._totals[key] += 1
            if self._liveness is not None:
                self._liveness.note(rec)

    def _release(self, sem: asyncio.Semaphore, rec: RequestRecord) -> None:
        """Free the permit; a closed-loop worker whose request failed waits a backoff first."""
        failed = rec.outcome in FAILED or rec.outcome == "rejected"
        if failed:
            self._fail_streak += 1
        elif rec.outcome == "ok":
            self._fail_streak = 0
        if not (failed and self.workload.closed_loop) or self._stopped:
            sem.release()
            return
        backoff = min(BACKOFF_MAX_S, BACKOFF_S * 2 ** min(self._fail_streak - 1, 20))
        asyncio.get_running_loop().call_later(backoff, sem.release)

    async def _warmup(self, session) -> None:
        cfg = self.cfg
        w = self.workload
        seed_w = replace(w, seed=w.seed + 1_000_003, cancel_rate=0.0)
        tasks = []
        for spec in islice(iter_requests(seed_w), cfg.warmup):
            if self.shard is not None and not self.shard.keeps(spec.index):
                continue
            rec = RequestRecord(spec.index, perf_counter(), spec.input_len, spec.max_tokens)
            rec.warmup = True
            body = self._body(spec.prompt, spec.max_tokens)
            send = client.send(session, cfg.endpoint, body, rec, timeout=self._timeout)
            tasks.append(asyncio.create_task(send))
        self._tasks.update(tasks)  # so stop() aborts a warm-up too
        await asyncio.wait(tasks)
        self._tasks.difference_update(tasks)

    async def _windows(self, t0: float) -> None:
        step, k = self.cfg.window_s, 1
        while True:
            await asyncio.sleep(max(0.0, t0 + k * step - perf_counter()))
            window = await self.window(t0 + k * step, t0, step)
            self.windows.append(window)
            self.on_window(window)
            k += 1

    async def window(self, t_end: float, t0: float, step: float) -> dict:
        """The aggregate of the window ending at t_end (interfaces.md `window` line).

        The work is done in slices that yield to the loop, so sends stay on schedule.
        """
        for i, rec in enumerate(list(self._in_flight)):
            self._tokens.extend(client.parse_pending(rec))
            if i % YIELD_EVERY == YIELD_EVERY - 1:
                await asyncio.sleep(0)
        done, self._finished = self._finished, []
        parts = []
        for i in range(0, len(done), YIELD_EVERY):
            parts.append(latencies(done[i : i + YIELD_EVERY]))
            await asyncio.sleep(0)
        lat = Latencies.concat(parts)
        now_tokens = [tn for tn in self._tokens if tn[0] <= t_end]
        self._tokens = [tn for tn in self._tokens if tn[0] > t_end]
        out_tokens = sum(n for _, n in now_tokens)
        sent, self._window_sent = self._window_sent, 0
        delays, self._window_delays = self._window_delays, []
        return window_line(
            t_end - t0, step, done, lat, out_tokens, sent, delays, len(self._in_flight)
        ) | {"totals": dict(self._totals)}
