"""Request lifecycle and continuous batching over the engine verbs (DESIGN.md §5).

1. The API validates and tokenizes a request and calls `submit`: the waiting queue is bounded in
   requests and prompt tokens; beyond either, `Overloaded` (HTTP 429 + Retry-After).
2. A prefill worker takes requests FCFS, runs `engine.prefill` and emits the first token at once
   (TTFT does not wait for a slot), then hands the prefix on: straight into a free slot when
   interleaved, or through `transfer` into a bounded transfer queue when disaggregated.
3. The generate worker, between decode calls, inserts ready prefixes into free slots (a new
   request never waits for the batch to drain), runs `decode_steps` steps per host sync, fans
   tokens out to each request's asyncio queue (`loop.call_soon_threadsafe`) and frees slots on
   EOS, max_tokens, a full KV row, a stop string or a cancel.
4. Interleaved: one thread alternates (prefill while a slot is free and requests wait, then
   generate). Disaggregated: a prefill thread and a generate thread on separate device sets;
   transfer time is measured.
5. `cancel` (client disconnect, stop string) marks the request; its slot is released before the
   next decode call.
6. `reconfigure` stops admitting (`Unavailable`, HTTP 503), drains in-flight requests (aborting
   them past a timeout), rebuilds the engines, compiles every bucket and resumes.
A worker that dies logs, sets state "failed" and fails every pending request; nothing hangs.
A reconfigure from "failed" rebuilds the engines and resumes serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from scaletui.serve.config import ServeConfig
from scaletui.serve.engine_api import Engine, Prefix, SamplingParams
from scaletui.serve.metrics import ServerMetrics

log = logging.getLogger("scaletui.serve")
EngineFactory = Callable[[ServeConfig], tuple[Engine, Engine]]
_ids = itertools.count()


class Overloaded(Exception):
    """The waiting queue is full (429)."""


class Unavailable(Exception):
    """Not serving right now: compiling, reconfiguring or failed (503)."""


class Busy(Exception):
    """A reconfiguration is already running (409)."""


@dataclass(eq=False)
class Request:
    """One generation. Events: ("tokens", [ids], finish | None) or ("error", message)."""

    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    id: int = field(default_factory=lambda: next(_ids))
    t_arrival: float = field(default_factory=time.perf_counter)
    t_scheduled: float = 0.0
    t_first: float = 0.0
    t_last: float = 0.0
    generated: int = 0
    last_token: int = -1
    cancel_reason: str | None = None  # "abort" (disconnect) | "stop" (stop string)
    finished: bool = False


class Scheduler:
    """Owns the queues, the slot table and the worker threads; the only mutable serving state."""

    def __init__(
        self, config: ServeConfig, factory: EngineFactory, metrics: ServerMetrics | None = None
    ) -> None:
        self.config = config
        self.factory = factory
        self.metrics = metrics or ServerMetrics()
        self.state = "starting"  # starting | compiling | serving | reconfiguring | failed
        self.error: str | None = None
        self.compile = {"state": "pending", "seconds": 0.0, "count": 0}
        self.engines: tuple[Engine, Engine] | None = None
        self.counts = {"finished": 0, "aborted": 0, "rejected": 0}
        self._cv = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._waiting_tokens = 0
        self._prefilling: set[Request] = set()
        self._transfer: queue.Queue[tuple[Request, Prefix]] = queue.Queue()
        self._slots: list[Request | None] = []
        self._kv_lengths: list[int] = []
        self._inflight: set[Request] = set()
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._reconfiguring = False
        self._closed = False  # shut down: never start workers again
        self._life = threading.Lock()  # worker start/stop vs shutdown from another thread
        self.started = time.perf_counter()

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Build and compile the engines, then start the workers (blocking; run on a thread)."""
        try:
            self._build(self.config)
        except Exception as e:
            if isinstance(e, ValueError):  # a config the engines refuse: the message says why
                log.error("engine start-up failed: %s", e)
            else:
                log.exception("engine start-up failed")
            self.state, self.error = "failed", f"{type(e).__name__}: {e}"
            self.compile["state"] = "failed"
            return
        self._start_workers()

    def _build(self, config: ServeConfig) -> None:
        if self.state == "starting":
            self.state = "compiling"
        self.engines = None
        t0 = time.perf_counter()
        self.compile = {"state": "running", "seconds": 0.0, "count": 0, "done": 0, "total": 0}
        prefill, generate = self.factory(config)
        unique = (prefill,) if generate is prefill else (prefill, generate)
        self.compile["total"] = sum(getattr(e, "warmup_total", 0) for e in unique)
        seconds, before = 0.0, 0
        for e in unique:
            seconds += e.warmup(progress=self._progress(before, t0))
            before += getattr(e, "warmup_total", 0)
        self.metrics.compile.observe(seconds)
        count = sum(e.compile_count() for e in unique)
        total = self.compile["total"]
        self.compile = {"state": "done", "seconds": seconds, "count": count, "done": total,
                        "total": total}  # fmt: skip
        log.info("compiled %d shapes in %.1f s", total, seconds)
        self.engines, self.config = (prefill, generate), config
        self._slots = [None] * generate.slots
        self._kv_lengths = [0] * generate.slots
        self.metrics.slots_total.set(generate.slots)

    def _progress(self, before: int, t0: float) -> Callable[[int, int], None]:
        """An engine's warmup callback: shapes done so far in /stats, a log line every ~2 s."""
        last = [t0]

        def report(done: int, _engine_total: int) -> None:
            total = self.compile["total"]
            self.compile["done"] = min(before + done, total)
            now = time.perf_counter()
            if now - last[0] >= 2.0 and self.compile["done"] < total:
                last[0] = now
                log.info("compiling: %d/%d shapes done, %.1f s", self.compile["done"], total,
                         now - t0)  # fmt: skip

        return report

    def _start_workers(self) -> None:
        with self._life:
            if self._closed:
                return
            self._stop.clear()
            self._transfer = queue.Queue(maxsize=max(2, self.config.slots))
            if self.config.mode == "interleaved":
                targets = [("interleaved", self._interleaved_loop)]
            else:
                targets = [("prefill", self._prefill_loop), ("generate", self._generate_loop)]
            self._threads = [
                threading.Thread(target=self._guard, args=(fn,), name=f"scaletui-{n}", daemon=True)
                for n, fn in targets
            ]
            self.state, self.error = "serving", None
            for t in self._threads:
                t.start()

    def _stop_workers(self) -> None:
        with self._life:
            self._stop.set()
            with self._cv:
                self._cv.notify_all()
            for t in self._threads:
                t.join()
            self._threads = []

    def shutdown(self) -> None:
        with self._life:
            self._closed = True
        self._stop_workers()
        self._fail_all("the server is shutting down")

    def _guard(self, loop: Callable[[], None]) -> None:
        try:
            loop()
        except BaseException as e:  # a dead worker fails loudly and frees every client
            log.exception("scheduler worker died")
            self.state, self.error = "failed", f"worker died: {type(e).__name__}: {e}"
            self._stop.set()
            self._fail_all(self.error)

    # -- the API's verbs ----------------------------------------------------------------------

    def submit(self, req: Request) -> None:
        with self._cv:
            if self.state != "serving":
                raise Unavailable(self.error if self.state == "failed" else self.state)
            c = self.config
            # The token bound applies to a non-empty queue only: a single prompt longer than
            # max_waiting_tokens would otherwise get 429 (retry later) forever.
            if len(self._waiting) >= c.max_waiting or (
                self._waiting and self._waiting_tokens + len(req.prompt) > c.max_waiting_tokens
            ):
                self.counts["rejected"] += 1
                self.metrics.rejected.inc()
                raise Overloaded(
                    f"{len(self._waiting)} requests / {self._waiting_tokens} prompt tokens waiting "
                    f"(limits {c.max_waiting} / {c.max_waiting_tokens})"
                )
            self._waiting.append(req)
            self._waiting_tokens += len(req.prompt)
            self._inflight.add(req)
            self._cv.notify_all()

    def cancel(self, req: Request, reason: str = "abort") -> None:
        """Client gone ("abort") or stop string seen ("stop"); the slot frees by the next step."""
        with self._cv:
            if req.finished or req.cancel_reason:
                return
            req.cancel_reason = reason
            if req in self._waiting:
                self._waiting.remove(req)
                self._waiting_tokens -= len(req.prompt)
                self._finish(req, reason)
            self._cv.notify_all()

    # -- workers ------------------------------------------------------------------------------

    def _next_waiting(self, block: bool) -> Request | None:
        with self._cv:
            while not self._waiting and block and not self._stop.is_set():
                self._cv.wait(0.1)
            if not self._waiting or self._stop.is_set():
                return None
            req = self._waiting.popleft()
            self._waiting_tokens -= len(req.prompt)
            self._prefilling.add(req)
            return req

    def _prefill(self, engine: Engine, req: Request) -> Prefix | None:
        """Prefill and stream the first token; None when the request already ended."""
        req.t_scheduled = time.perf_counter()
        self.metrics.queue.observe(req.t_scheduled - req.t_arrival)
        try:
            prefix = engine.prefill(req.prompt, req.params)
        except ValueError as e:  # this request's input, not the device: fail it alone
            log.warning("request %d rejected by the engine: %s", req.id, e)
            with self._cv:
                self._prefilling.discard(req)
                self._finish(req, "error", notify=False)
                self._post(req, ("error", f"rejected: {e}"))
            return None
        now = time.perf_counter()
        self.metrics.record_step("prefill", now - req.t_scheduled, len(req.prompt))
        self.metrics.generation_tokens.inc()
        self.metrics.prefill.observe(now - req.t_scheduled)
        with self._cv:
            self._prefilling.discard(req)
            if req.cancel_reason or req.finished:
                self._finish(req, req.cancel_reason or "abort")
                return None
            reason = self._reason(req, [prefix.first_token]) if prefix.done else None
            self._emit_tokens(req, [prefix.first_token], reason, now)
            return None if prefix.done else prefix

    def _interleaved_loop(self) -> None:
        engine = self.engines[1]
        state = engine.init_decode_state()
        while not self._stop.is_set():
            state = self._release_cancelled(engine, state)
            while None in self._slots and (req := self._next_waiting(block=False)):
                prefix = self._prefill(engine, req)
                if prefix is not None:
                    state = self._insert(engine, state, req, prefix)
            if any(r is not None for r in self._slots):
                state = self._generate(engine, state)
            else:
                with self._cv:
                    if not self._waiting and not self._stop.is_set():
                        self._cv.wait(0.1)

    def _prefill_loop(self) -> None:
        prefill_engine, generate_engine = self.engines
        while not self._stop.is_set():
            req = self._next_waiting(block=True)
            if req is None:
                continue
            prefix = self._prefill(prefill_engine, req)
            if prefix is None:
                continue
            t0 = time.perf_counter()
            prefix = prefill_engine.transfer(prefix, generate_engine)
            self.metrics.record_step("transfer", time.perf_counter() - t0, prefix.length)
            while not self._stop.is_set():  # bounded: back-pressure on prefill
                try:
                    self._transfer.put((req, prefix), timeout=0.1)
                    break
                except queue.Full:
                    continue

    def _generate_loop(self) -> None:
        engine = self.engines[1]
        state = engine.init_decode_state()
        while not self._stop.is_set():
            state = self._release_cancelled(engine, state)
            busy = any(r is not None for r in self._slots)
            while None in self._slots:
                try:
                    req, prefix = self._transfer.get(block=not busy, timeout=0.1)
                except queue.Empty:
                    break
                state = self._insert(engine, state, req, prefix)
                busy = True
            if busy:
                state = self._generate(engine, state)

    def _insert(self, engine: Engine, state: object, req: Request, prefix: Prefix) -> object:
        with self._cv:
            if req.cancel_reason or req.finished:
                self._finish(req, req.cancel_reason or "abort")
                return state
            slot = self._slots.index(None)
            self._slots[slot] = req
            self._kv_lengths[slot] = prefix.length
        return engine.insert(state, prefix, slot)

    def _release_cancelled(self, engine: Engine, state: object) -> object:
        with self._cv:
            gone = [(b, r) for b, r in enumerate(self._slots) if r is not None and r.cancel_reason]
            for b, r in gone:
                self._slots[b] = None
                self._kv_lengths[b] = 0
                self._finish(r, r.cancel_reason)
        for b, _ in gone:
            state = engine.release(state, b)
        return state

    def _generate(self, engine: Engine, state: object) -> object:
        # no more steps than any running request still needs: a request 3 tokens from its
        # max_tokens does not wait for the other decode_steps - 3 steps of an idle batch
        left = [r.params.max_tokens - r.generated for r in self._slots if r is not None]
        steps = max(1, min(self.config.decode_steps, max(left, default=1)))
        active = sum(r is not None for r in self._slots)
        t0 = time.perf_counter()
        state, out = engine.generate(state, steps)
        now = time.perf_counter()
        self.metrics.record_step("generate", now - t0, int(out.valid.sum()), active, steps)
        with self._cv:
            for b, req in enumerate(self._slots):
                if req is None:
                    continue
                ids = [int(t) for t in out.tokens[out.valid[:, b], b]]
                done = bool(out.done[:, b].any())
                self._kv_lengths[b] = int(out.lengths[b])
                if done:
                    self._slots[b], self._kv_lengths[b] = None, 0
                if req.cancel_reason:  # cancelled during the call: drop its tokens
                    if done:
                        self._finish(req, req.cancel_reason)
                    continue
                reason = (self._reason(req, ids) if ids else "length") if done else None
                if ids or reason:
                    self._emit_tokens(req, ids, reason, now)
        return state

    # -- bookkeeping (callers hold self._cv) ---------------------------------------------------

    def _reason(self, req: Request, ids: list[int]) -> str:
        """Why a sequence the engine marked done ended: EOS ("stop") or a limit ("length")."""
        p, total = req.params, req.generated + len(ids)
        eos = self.engines[1].eos_id
        stopped = ids[-1] == eos and not p.ignore_eos and total >= p.min_tokens
        return "stop" if stopped else "length"

    def _emit_tokens(self, req: Request, ids: list[int], finish: str | None, now: float) -> None:
        if ids:
            if not req.t_first:
                req.t_first = now
                self.metrics.ttft.observe(now - req.t_arrival)
            else:
                gap = (now - req.t_last) / len(ids)
                for _ in ids:
                    self.metrics.itl.observe(gap)
            req.t_last = now
            req.generated += len(ids)
            req.last_token = ids[-1]
        if finish:  # counted before the client can see the last event
            self._finish(req, finish, notify=False)
        self._post(req, ("tokens", ids, finish))

    def _finish(self, req: Request, reason: str, notify: bool = True) -> None:
        if req.finished:
            return
        req.finished = True
        self._inflight.discard(req)
        if reason in ("abort", "reconfigure", "error"):
            self.counts["aborted"] += 1
            self.metrics.aborted.inc()
        else:
            self.counts["finished"] += 1
            self.metrics.success.labels(finished_reason=reason).inc()
            end = req.t_last or time.perf_counter()
            self.metrics.e2e.observe(end - req.t_arrival)
            if req.t_first:
                self.metrics.decode.observe(end - req.t_first)
        if notify and reason == "reconfigure":
            self._post(req, ("error", "aborted: the server is reconfiguring (drain timeout)"))
        elif notify and reason != "abort":
            self._post(req, ("tokens", [], reason))
        self._cv.notify_all()

    def _post(self, req: Request, event: tuple) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening
            req.loop.call_soon_threadsafe(req.events.put_nowait, event)

    def _fail_all(self, message: str) -> None:
        with self._cv:
            pending = list(self._inflight)
            self._waiting.clear()
            self._waiting_tokens = 0
            self._prefilling.clear()
            self._slots = [None] * len(self._slots)
            self._kv_lengths = [0] * len(self._kv_lengths)
            for req in pending:
                if not req.finished:
                    req.finished = True
                    self.counts["aborted"] += 1
                    self.metrics.aborted.inc()
                    self._post(req, ("error", message))
            self._inflight.clear()
            self._cv.notify_all()

    # -- views ----------------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Requests admitted and not yet finished: waiting, prefilling, in transfer or in slots."""
        return len(self._inflight)

    def counts_now(self) -> dict:
        """waiting / running / transfer_backlog / slots used, and the KV fill fraction."""
        with self._cv:
            used = sum(r is not None for r in self._slots)
            total = max(1, len(self._slots))
            kv = sum(self._kv_lengths) / (total * self.config.max_seq_len)
            return {
                "waiting": len(self._waiting),
                "running": used + len(self._prefilling),
                "transfer_backlog": self._transfer.qsize(),
                "slots_used": used,
                "slots_total": len(self._slots) or self.config.slots,
                "kv_cache_usage_perc": kv,
            }

    def update_gauges(self) -> dict:
        now = self.counts_now()
        m = self.metrics
        m.waiting.set(now["waiting"])
        m.running.set(now["running"])
        m.transfer_backlog.set(now["transfer_backlog"])
        m.slots_used.set(now["slots_used"])
        m.kv_usage.set(now["kv_cache_usage_perc"])
        return now

    # -- reconfiguration ----------------------------------------------------------------------

    def reconfigure(self, changes: dict, drain_timeout_s: float = 60.0) -> dict:
        """Drain, rebuild with `changes`, compile, resume. ValueError for a bad combination."""
        with self._cv:
            if self._reconfiguring:
                raise Busy("a reconfiguration is already under way")
            if self.state not in ("serving", "failed"):  # from "failed": rebuild and recover
                raise Busy(f"the server is {self.state}; try again when it is serving")
            new = self.config.updated(**changes)  # ValueError names the value
            check = getattr(self.factory, "validate", None)
            if check is not None:  # sharding rules and memory, before anything is drained
                check(new, self.engines)
            self._reconfiguring, self.state = True, "reconfiguring"
            draining = set(self._inflight)
        try:
            aborted = self._drain(draining, drain_timeout_s)
            self._stop_workers()
            old = self.config
            try:
                self._build(new)
            except Exception:
                log.exception("reconfigure to %s failed; restoring %s", new.public(), old.public())
                self._build(old)
                self._start_workers()
                raise
            self._start_workers()
            return {
                "config": new.public(),
                "compile_s": self.compile["seconds"],
                "drained": len(draining) - aborted,
                "aborted": aborted,
            }
        except BaseException as e:
            if self.state != "serving":
                self.state, self.error = "failed", f"reconfigure failed: {e}"
            raise
        finally:
            self._reconfiguring = False

    def _drain(self, requests: set[Request], timeout_s: float) -> int:
        deadline = time.perf_counter() + timeout_s
        with self._cv:
            while any(not r.finished for r in requests) and time.perf_counter() < deadline:
                self._cv.wait(0.05)
            late = [r for r in requests if not r.finished]
            for r in late:
                r.cancel_reason = "reconfigure"
                if r in self._waiting:
                    self._waiting.remove(r)
                    self._waiting_tokens -= len(r.prompt)
                    self._finish(r, "reconfigure")
            self._cv.notify_all()
        end = time.perf_counter() + 30.0  # the workers release them before their next step
        with self._cv:
            while any(not r.finished for r in late) and time.perf_counter() < end:
                self._cv.wait(0.05)
            for r in late:
                self._finish(r, "reconfigure")
        return len(late)
