"""Request lifecycle and continuous batching over the engine verbs (docs/serve.md).

1. The API validates and tokenizes a request and calls `submit`: the waiting queue is bounded in
   requests and prompt tokens; beyond either, `Overloaded` (HTTP 429 + Retry-After).
2. A prefill worker takes requests FCFS, runs `engine.prefill` and emits the first token at once
   (TTFT does not wait for a slot), then hands the prefix on: straight into a free slot when
   interleaved, or through `transfer` into a bounded transfer queue when disaggregated.
3. The generate worker, between decode calls, inserts ready prefixes into free slots, runs
   `decode_steps` steps per host sync, fans tokens out to each request's asyncio queue and frees
   slots on EOS, max_tokens, max_seq_len, a stop string or a cancel. Admission, KV pages
   (paging.py), prompt pieces and preemption (vLLM's recompute policy: nothing lost) are pure
   decisions of scaletui.policy, which the simulator replays too; batcher.py applies them to the
   engine's results and reports each pass's `StepPlan`.
4. Interleaved: one thread alternates (prefill while a slot is free and requests wait, then
   generate). Disaggregated: a prefill thread and a generate thread on separate device sets;
   transfer time is measured. Both measure their host time between engine calls while busy
   (`batcher.GapClock`, /stats `host_gap`): the simulator's `gap_s`.
5. `cancel` (client disconnect, stop string) marks the request; its slot is released before the
   next decode call.
6. `reconfigure` stops admitting (`Unavailable`, HTTP 503), drains in-flight requests (aborting
   them past a timeout), rebuilds the engines, compiles every bucket (unless `warmup` is off:
   then each compiles on its first call) and resumes. A worker that dies logs, sets state
   "failed" and fails every pending request; a reconfigure from "failed" rebuilds and resumes.
The queues, the slot table and how a request ends live in `RequestBook` (book.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from scaletui.policy import StepPlan
from scaletui.serve.engine.engine_api import Engine, EngineFactory, Prefix, distinct
from scaletui.serve.scheduling.batcher import Batcher
from scaletui.serve.scheduling.book import RequestBook
from scaletui.serve.scheduling.events import Busy, Request, TooLong, Unavailable, resume_input
from scaletui.serve.scheduling.metrics import ServerMetrics
from scaletui.serve.scheduling.paging import PageTables
from scaletui.serve.scheduling.speed import SpeedModel, speed_model
from scaletui.shape import ServerShape

log = logging.getLogger("scaletui.serve")


class Scheduler:
    """Owns the engines, the worker threads and the request book: the serving state."""

    def __init__(
        self,
        config: ServerShape,
        factory: EngineFactory,
        metrics: ServerMetrics | None = None,
        on_plan: Callable[[StepPlan], None] | None = None,  # each pass's decisions (tests)
        fit: str = "auto",  # the engine fit its calls are priced by: auto | none | a YAML path
        warmup: bool = True,  # compile and run every shape before serving (else on first use)
    ) -> None:
        self.config, self.on_plan, self.fit, self.warmup = config, on_plan, fit, warmup
        self.speed = SpeedModel(reason="the engines are not built yet")
        self.factory = factory
        self.metrics = metrics or ServerMetrics()
        self.book = RequestBook(self.metrics)
        self.state = "starting"  # starting | compiling | serving | reconfiguring | failed
        self.error: str | None = None
        self.compile = {"state": "pending", "seconds": 0.0, "count": 0}
        self.engines: tuple[Engine, Engine] | None = None
        self.pages: PageTables | None = None  # the generate engine's KV pages
        self._transfer: queue.Queue[tuple[Request, Prefix]] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._reconfiguring = False
        self._closed = False  # shut down: never start workers again
        self._life = threading.Lock()  # worker start/stop vs shutdown from another thread
        self.started = time.perf_counter()
        self._looked = -1e9  # monotonic time of relook_fit's last look

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

    def _build(self, config: ServerShape) -> None:
        if self.state == "starting":
            self.state = "compiling"
        self.engines = None
        t0 = time.perf_counter()
        self.compile = {"state": "running", "seconds": 0.0, "count": 0, "done": 0, "total": 0}
        prefill, generate = self.factory.build(config)
        unique = distinct((prefill, generate))
        warming = unique if self.warmup else ()  # no warm-up: each shape compiles when first run
        units = [e.describe().warmup_total for e in warming]
        total = self.compile["total"] = sum(units)
        seconds = sum(
            e.warmup(progress=self._progress(sum(units[:i]), t0)) for i, e in enumerate(warming)
        )
        self.metrics.compile.observe(seconds)
        count = sum(e.compile_count() for e in unique)
        self.compile = dict(state="done", seconds=seconds, count=count, done=total, total=total)
        if self.warmup:
            log.info("compiled %d shapes and ran each once in %.1f s", total, seconds)
        else:
            log.info("no warm-up: each shape compiles on its first call")
        self.engines, self.config = (prefill, generate), config
        self._price(config, generate.describe().kernels)
        self.pages = PageTables(generate)
        self.book.reset(generate.slots, generate.eos_ids)
        self.metrics.slots_total.set(generate.slots)

    def _price(self, config: ServerShape, kernels: str) -> None:
        """The fit that prices this shape's calls (speed.py), or why none; a new fit starts
        the speed factor's window afresh."""
        speed = speed_model(config, self.fit, kernels)
        if speed.fit != self.speed.fit:
            self.metrics.reset_speed(speed.log, speed.engine)
        self.speed = speed
        log.info("engine calls priced by %s", speed.fit or f"no fit: {speed.reason}")

    def relook_fit(self, every_s: float = 5.0) -> None:
        """`--fit auto` with no fit found: look again (at most every `every_s`; /stats calls
        it), for a fit made while serving (the TUI fits the server it started)."""
        now, engines = time.monotonic(), self.engines
        if self.fit == "auto" and not self.speed.fit and engines and now - self._looked >= every_s:
            self._looked, kernels = now, engines[1].describe().kernels
            if speed_model(self.config, self.fit, kernels).fit:
                self._price(self.config, kernels)

    def _progress(self, before: int, t0: float) -> Callable[[int, int], None]:
        """An engine's warmup callback: shapes done so far in /stats, a log line every ~2 s."""
        last = [t0]

        def report(done: int, _engine_total: int) -> None:
            total = self.compile["total"]
            self.compile["done"] = min(before + done, total)
            now = time.perf_counter()
            if now - last[0] >= 2.0 and self.compile["done"] < total:
                last[0] = now
                log.info(
                    "compiling: %d/%d shapes done, %.1f s", self.compile["done"], total, now - t0
                )

        return report

    def _start_workers(self) -> None:
        with self._life:
            if self._closed:
                return
            self._stop.clear()
            self._transfer = queue.Queue(maxsize=max(2, self.config.slots))
            self._threads = [
                threading.Thread(target=self._guard, args=(fn,), name=f"scaletui-{n}", daemon=True)
                for n, fn in self._loops()
            ]
            self.state, self.error = "serving", None
            for t in self._threads:
                t.start()

    def _loops(self) -> list[tuple[str, Callable[[], None]]]:
        """The worker threads' (name, loop): one interleaved loop, or a prefill and a generate
        loop joined by the hand-over queue."""
        if self.config.mode == "interleaved":
            return [("interleaved", self._interleaved_loop)]
        return [("prefill", self._prefill_loop), ("generate", self._generate_loop)]

    def _stop_workers(self) -> None:
        with self._life:
            self._stop.set()
            with self.book.cv:
                self.book.cv.notify_all()
            for t in self._threads:
                t.join()
            self._threads = []

    def shutdown(self) -> None:
        with self._life:
            self._closed = True
        self._stop_workers()
        self.book.fail_all("the server is shutting down")

    def _guard(self, loop: Callable[[], None]) -> None:
        try:
            loop()
        except BaseException as e:  # a dead worker fails loudly and frees every client
            log.exception("scheduler worker died")
            self.state, self.error = "failed", f"worker died: {type(e).__name__}: {e}"
            self._stop.set()
            self.book.fail_all(self.error)

    # -- the API's verbs ----------------------------------------------------------------------

    def submit(self, req: Request) -> None:
        """Queue a request; Unavailable when not serving, Overloaded past the queue bounds."""
        with self.book.cv:
            self.check_admissible(req)
            self.book.admit(req, self.config.max_waiting, self.config.max_waiting_tokens)

    def check_admissible(self, req: Request) -> None:
        """Unavailable when not serving, TooLong past the KV pool. Callers hold `book.cv`."""
        if self.state != "serving":
            raise Unavailable(self.error if self.state == "failed" else self.state)
        need = min(len(req.prompt) + req.params.max_tokens, self.config.max_seq_len)
        pool = self.pages.whole_pool_tokens() if self.pages else need
        if need > pool:
            raise TooLong(
                f"the request needs {need} tokens of KV (prompt {len(req.prompt)} + "
                f"max_tokens {req.params.max_tokens}), but the whole KV pool holds {pool} "
                "tokens; send fewer tokens or start the server with more --kv-pages"
            )

    def cancel(self, req: Request, reason: str = "abort") -> None:
        """Client gone ("abort") or stop string seen ("stop"); the slot frees by the next step."""
        self.book.cancel(req, reason)

    # -- workers ------------------------------------------------------------------------------

    def _prefill(self, engine: Engine, req: Request) -> Prefix | None:
        """Prefill and stream the first token; None when the request already ended."""
        req.t_scheduled = time.perf_counter()
        if not req.preempted:
            self.metrics.queue.observe(req.t_scheduled - req.t_arrival)
        tokens, params = resume_input(req)
        predicted = self.speed.prefill_s(len(tokens))
        try:
            prefix = engine.prefill(tokens, params)
        except ValueError as e:  # this request's input, not the device: fail it alone
            log.warning("request %d rejected by the engine: %s", req.id, e)
            self.book.rejected(req, e)
            return None
        now = time.perf_counter()
        self.metrics.record_step("prefill", now - req.t_scheduled, len(tokens), predicted=predicted)
        self.metrics.generation_tokens.inc()
        self.metrics.prefill.observe(now - req.t_scheduled)
        return self.book.prefilled(req, prefix, now)

    def _prefill_and_hand_over(self, req: Request) -> Prefix | None:
        """Disaggregated: prefill `req` and move its prefix to the generate engine's devices (the
        move timed as a transfer step); None when the request already ended."""
        prefill_engine, generate_engine = self.engines
        prefix = self._prefill(prefill_engine, req)
        if prefix is None:
            return None
        t0 = time.perf_counter()
        prefix = prefill_engine.transfer(prefix, generate_engine)
        self.metrics.record_step("transfer", time.perf_counter() - t0, prefix.length)
        return prefix

    def _interleaved_loop(self) -> None:
        batcher = self._batcher()
        while not self._stop.is_set():
            if not batcher.interleaved_pass(self._stop):
                with self.book.cv:
                    if not self.book.waiting and not self._stop.is_set():
                        batcher.clock.idle()
                        self.book.cv.wait(0.1)

    def _batcher(self) -> Batcher:
        engine = self.engines[1]
        c, m = self.config, self.metrics
        return Batcher(c, engine, self.book, self.pages, m, self.on_plan, lambda: self.speed)

    def _prefill_loop(self) -> None:
        while not self._stop.is_set():
            req = self.book.next_waiting(True, self._stop)
            if req is None:
                continue
            prefix = self._prefill_and_hand_over(req)
            if prefix is None:
                continue
            while not self._stop.is_set():  # bounded: back-pressure on prefill
                try:
                    self._transfer.put((req, prefix), timeout=0.1)
                    break
                except queue.Full:
                    continue

    def _generate_loop(self) -> None:
        batcher = self._batcher()
        while not self._stop.is_set():
            batcher.disaggregated_pass(self._transfer)

    # -- views ----------------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Requests admitted and not yet finished: waiting, prefilling, in transfer or in slots."""
        return len(self.book.inflight)

    @property
    def counts(self) -> dict[str, int]:
        """finished / aborted / rejected so far (from the Prometheus counters)."""
        return self.metrics.request_counts()

    def counts_now(self) -> dict:
        """waiting / running / transfer_backlog / slots used, and the KV pages held."""
        now = self.book.counts_now(self.config.slots)
        usage = self.pages.usage() if self.pages else 0.0
        return {**now, "transfer_backlog": self._transfer.qsize(), "kv_cache_usage_perc": usage}

    def kv_pages(self) -> dict | None:  # page counts and preemptions; None before the engines
        return self.pages.stats() if self.pages else None

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
        with self.book.cv:
            if self._reconfiguring:
                raise Busy("a reconfiguration is already under way")
            if self.state not in ("serving", "failed"):  # from "failed": rebuild and recover
                raise Busy(f"the server is {self.state}; try again when it is serving")
            new = self.config.updated(**changes)  # ValueError names the value
            self.factory.check(new, self.engines)  # sharding, kernels, memory: before a drain
            self._reconfiguring, self.state = True, "reconfiguring"
            draining = set(self.book.inflight)
        try:
            aborted = self.book.drain(draining, drain_timeout_s)
            self._stop_workers()
            old = self.config
            try:
                self._build(new)
            except Exception:
                log.exception("reconfigure to %s failed, back to %s", new.to_json(), old.to_json())
                self._build(old)
                self._start_workers()
                raise
            self._start_workers()
            return {
                "config": new.to_json(),
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
