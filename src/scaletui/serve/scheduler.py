"""Request lifecycle and continuous batching over the engine verbs (DESIGN.md §5).

1. The API validates and tokenizes a request and calls `submit`: the waiting queue is bounded in
   requests and prompt tokens; beyond either, `Overloaded` (HTTP 429 + Retry-After).
2. A prefill worker takes requests FCFS, runs `engine.prefill` and emits the first token at once
   (TTFT does not wait for a slot), then hands the prefix on: straight into a free slot when
   interleaved, or through `transfer` into a bounded transfer queue when disaggregated.
3. The generate worker, between decode calls, inserts ready prefixes into free slots (a new
   request never waits for the batch to drain), runs `decode_steps` steps per host sync, fans
   tokens out to each request's asyncio queue (`loop.call_soon_threadsafe`) and frees slots on
   EOS, max_tokens, max_seq_len, a stop string or a cancel.
   KV pages (paging.py): a request is taken from the queue only when a free slot's replica has
   pages for its prompt and the next decode steps; an inserted sequence holds the pages its
   prompt fills and takes one more as it crosses each page boundary, before the generate call
   that writes there. When a replica runs out, the youngest running sequence there is preempted
   (vLLM's recompute policy): its pages go back, and it returns to the head of the queue to
   prefill its prompt and output again and carry on; nothing is lost.
4. Interleaved: one thread alternates (prefill while a slot is free and requests wait, then
   generate). Disaggregated: a prefill thread and a generate thread on separate device sets;
   transfer time is measured. The interleaved worker and the generate worker measure their host
   time between two engine calls while busy (`GapClock`, /stats `host_gap`): the simulator's
   `gap_s`, which the engine's call times leave out.
5. `cancel` (client disconnect, stop string) marks the request; its slot is released before the
   next decode call.
6. `reconfigure` stops admitting (`Unavailable`, HTTP 503), drains in-flight requests (aborting
   them past a timeout), rebuilds the engines, compiles every bucket and resumes.
A worker that dies logs, sets state "failed" and fails every pending request; nothing hangs.
A reconfigure from "failed" rebuilds the engines and resumes serving. The queues, the slot table
and how a request ends live in the scheduler's `RequestBook` (book.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from scaletui.serve.book import RequestBook
from scaletui.serve.config import ServeConfig
from scaletui.serve.engine_api import Engine, EngineFactory, Prefix, SamplingParams, distinct
from scaletui.serve.events import Busy, Request, TooLong, Unavailable, resume_input
from scaletui.serve.metrics import ServerMetrics
from scaletui.serve.paging import PageTables

log = logging.getLogger("scaletui.serve")


@dataclass
class PrefillJob:
    """A request prefilling into its slot's pages (interleaved mode), a chunk at a time."""

    req: Request
    slot: int
    tokens: list[int]  # what prefill runs: the prompt (and, resumed, what it produced)
    params: SamplingParams
    pages: list[int]  # the slot's pages: a cached prefix's, then its own
    done: int  # tokens whose K/V are in the pages (the cached prefix, earlier chunks)

    @property
    def left(self) -> int:
        return len(self.tokens) - self.done


class GapClock:
    """One worker's host time between its engine calls while it has work (/stats `host_gap`,
    the simulator's `gap_s`): from one call's end to the next one's start; `idle` before the
    worker waits for work, so a wait is never counted."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.last_end: float | None = None

    def start(self) -> float:
        now = time.perf_counter()
        if self.last_end is not None:
            self.metrics.record_gap(now - self.last_end)
        return now

    def end(self) -> float:
        self.last_end = time.perf_counter()
        return self.last_end

    def idle(self) -> None:
        self.last_end = None


class Scheduler:
    """Owns the engines, the worker threads and the request book: the serving state."""

    def __init__(
        self, config: ServeConfig, factory: EngineFactory, metrics: ServerMetrics | None = None
    ) -> None:
        self.config = config
        self.factory = factory
        self.metrics = metrics or ServerMetrics()
        self.book = RequestBook(self.metrics)
        self.state = "starting"  # starting | compiling | serving | reconfiguring | failed
        self.error: str | None = None
        self.compile = {"state": "pending", "seconds": 0.0, "count": 0}
        self.engines: tuple[Engine, Engine] | None = None
        self.pages: PageTables | None = None  # the generate engine's KV pages
        self._pending: tuple[Request, Prefix] | None = None  # disaggregated: waits for pages
        self._transfer: queue.Queue[tuple[Request, Prefix]] = queue.Queue()
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
        prefill, generate = self.factory.build(config)
        unique = distinct((prefill, generate))
        units = [e.describe().warmup_total for e in unique]
        total = self.compile["total"] = sum(units)
        seconds = sum(
            e.warmup(progress=self._progress(sum(units[:i]), t0)) for i, e in enumerate(unique)
        )
        self.metrics.compile.observe(seconds)
        count = sum(e.compile_count() for e in unique)
        self.compile = {"state": "done", "seconds": seconds, "count": count, "done": total,
                        "total": total}  # fmt: skip
        log.info("compiled %d shapes and ran each once in %.1f s", total, seconds)
        self.engines, self.config = (prefill, generate), config
        self.pages, self._pending = PageTables(generate), None
        self.book.reset(generate.slots, generate.eos_id)
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
            self.book.admit(req, self.config.max_waiting, self.config.max_waiting_tokens)

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
        try:
            prefix = engine.prefill(tokens, params)
        except ValueError as e:  # this request's input, not the device: fail it alone
            log.warning("request %d rejected by the engine: %s", req.id, e)
            self.book.rejected(req, e)
            return None
        now = time.perf_counter()
        self.metrics.record_step("prefill", now - req.t_scheduled, len(tokens))
        self.metrics.generation_tokens.inc()
        self.metrics.prefill.observe(now - req.t_scheduled)
        return self.book.prefilled(req, prefix, now)

    def _interleaved_loop(self) -> None:
        engine, book = self.engines[1], self.book
        state = engine.init_decode_state()
        admit = lambda req: self._slot_for(len(resume_input(req)[0])) is not None
        jobs: list[PrefillJob] = []  # FCFS, each in its slot, prefilling into its pages
        clock = GapClock(self.metrics)
        while not self._stop.is_set():
            state = self._release_cancelled(engine, state)
            jobs = [j for j in jobs if book.slots[j.slot] is j.req]  # cancelled ones are gone
            while req := book.next_waiting(False, self._stop, admit):
                job = self._start_job(req)
                if job is not None:
                    jobs.append(job)
            budget = self._budget(jobs)
            while jobs and budget > 0:  # a long prompt runs in pieces between generate calls
                left, size = jobs[0].left, self.pages.page_size
                n = left if left <= budget else budget // size * size  # the next piece starts
                if n == 0:  # on a page boundary: a piece ends on one, or with the prompt
                    break
                state = self._prefill_job(engine, state, jobs[0], n, clock)
                budget -= n
                if jobs[0].left == 0:
                    jobs.pop(0)
            prefilling = {j.slot for j in jobs}
            if any(r is not None and b not in prefilling for b, r in enumerate(book.slots)):
                state = self._generate(engine, state, clock, prefilling)
            elif not jobs:
                with book.cv:
                    if not book.waiting and not self._stop.is_set():
                        clock.idle()
                        book.cv.wait(0.1)

    def _budget(self, jobs: list[PrefillJob]) -> int:
        """Prompt tokens to run before the next generate call: --max-batched-tokens rounded
        down to whole pages (a piece must start on a page boundary), at least one page; all
        of them without a budget."""
        size = self.pages.page_size
        if not self.config.max_batched_tokens:
            return sum(j.left for j in jobs)
        return max(size, self.config.max_batched_tokens // size * size)

    def _start_job(self, req: Request) -> PrefillJob | None:
        """Give `req` a slot and pages for its prompt, reusing the longest cached prefix."""
        tokens, params = resume_input(req)
        slot = self._slot_for(len(tokens))  # next_waiting's `admit` checked there is one
        pool, cached, hit = self.pages.pool_of(slot), [], 0
        if self.config.prefix_cache:
            cached, hit = pool.match(tokens)
            self.metrics.prefix_queries.inc(len(tokens))
            self.metrics.prefix_hits.inc(hit)
        pages = self.pages.take(slot, len(tokens), cached)
        if not self.book.place(req, len(tokens), slot):  # cancelled meanwhile
            self.pages.free(slot)
            return None
        req.t_scheduled = time.perf_counter()
        if not req.preempted:
            self.metrics.queue.observe(req.t_scheduled - req.t_arrival)
        return PrefillJob(req, slot, tokens, params, pages, done=hit)

    def _prefill_job(
        self, engine: Engine, state: object, job: PrefillJob, n: int, clock: GapClock
    ) -> object:
        """The next `n` prompt tokens of `job`; at the prompt's end, its first token out and
        the slot active (or given back, when that token ends it)."""
        req, slot = job.req, job.slot
        t0 = clock.start()
        try:
            state, prefix = engine.prefill_pages(state, job.tokens, job.params, slot, job.pages,
                                                 job.done, job.done + n)  # fmt: skip
        except ValueError as e:  # this request's input, not the device: fail it alone
            clock.end()
            log.warning("request %d rejected by the engine: %s", req.id, e)
            self.book.vacate(slot, req)
            self.pages.free(slot)
            self.book.rejected(req, e)
            job.done = len(job.tokens)
            return state
        now = clock.end()
        job.done += n
        self.metrics.record_step("prefill", now - t0, n)
        if prefix is None:
            return state
        if self.config.prefix_cache:  # its full prompt pages, for the next request to reuse
            self.pages.pool_of(slot).register(job.tokens, job.pages)
        self.metrics.generation_tokens.inc()
        self.metrics.prefill.observe(now - req.t_scheduled)
        if self.book.prefilled(req, prefix, now) is None:  # done at its first token, or gone
            self.book.vacate(slot, req)
            self.pages.free(slot)
            return state
        return engine.insert(state, prefix, slot, job.pages)

    def _prefill_loop(self) -> None:
        prefill_engine, generate_engine = self.engines
        while not self._stop.is_set():
            req = self.book.next_waiting(True, self._stop)
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
        engine, book = self.engines[1], self.book
        state = engine.init_decode_state()
        clock = GapClock(self.metrics)
        while not self._stop.is_set():
            state = self._release_cancelled(engine, state)
            busy = any(r is not None for r in book.slots)
            if not busy:  # waits for a hand-over below
                clock.idle()
            while None in book.slots:
                if self._pending is None:
                    try:
                        self._pending = self._transfer.get(block=not busy, timeout=0.1)
                    except queue.Empty:
                        break
                state, placed = self._insert(engine, state, *self._pending, requeue=not busy)
                if not placed:  # no pages yet: it waits for running sequences to end
                    break
                self._pending, busy = None, True
            if busy:
                state = self._generate(engine, state, clock)

    def _slot_for(self, tokens: int) -> int | None:
        """A free slot whose replica has pages for `tokens` positions and the next decode
        steps, or None."""
        need = min(tokens + self.config.decode_steps, self.pages.whole_pool_tokens())
        return next((b for b in self.book.free_slots() if self.pages.fits(b, need)), None)

    def _insert(
        self, engine: Engine, state: object, req: Request, prefix: Prefix, requeue: bool
    ) -> tuple[object, bool]:
        """Place a prefilled request in a slot with pages for its prompt -> (state, placed).
        Without room it is requeued (`requeue`) to prefill again later, or left to the caller."""
        slot = self._slot_for(prefix.length)
        if slot is None:
            if requeue:
                self.book.preempt(req, None, self.config.max_seq_len)
            return state, requeue
        if not self.book.place(req, prefix.length, slot):
            return state, True  # it ended meanwhile (cancelled)
        return engine.insert(state, prefix, slot, self.pages.take(slot, prefix.length)), True

    def _release_cancelled(self, engine: Engine, state: object) -> object:
        """Slots of cancelled requests go back, with their pages (taken_cancelled ended
        them)."""
        for b in self.book.take_cancelled():
            state = engine.release(state, b)
            self.pages.free(b)
        return state

    def _make_room(self, engine: Engine, state: object, steps: int, prefilling: set[int]) -> object:
        """Give every decoding sequence pages for the positions the next call writes, oldest
        first; where a replica has none left, preempt its youngest sequence until it does
        (`prefilling` slots are not decoding: they hold their prompt's pages already)."""
        book, pages = self.book, self.pages
        running = [b for b, r in enumerate(book.slots) if r is not None and b not in prefilling]
        for b in sorted(running, key=lambda b: book.slots[b].t_scheduled):
            req = book.slots[b]  # writes until done: at most its max_tokens
            if req is None:  # preempted for an older sequence
                continue
            need = book.kv_lengths[b] + min(steps, req.params.max_tokens - req.generated)
            while book.slots[b] is not None and not pages.grow(b, need):
                replica = [c for c in running if book.slots[c] is not None
                           and pages.pool_of(c) is pages.pool_of(b)]  # fmt: skip
                victim = max(replica, key=lambda c: book.slots[c].t_scheduled)
                state = self._preempt(engine, state, victim)
        return state

    def _preempt(self, engine: Engine, state: object, slot: int) -> object:
        req, length = self.book.slots[slot], self.book.kv_lengths[slot]
        log.info("KV pages exhausted: request %d (%d tokens) preempted, to resume by prefill",
                 req.id, length)  # fmt: skip
        if self.config.prefix_cache:  # its full pages stay matchable: resuming may reuse them
            done = (req.prompt + req.outputs)[:length]
            self.pages.pool_of(slot).register(done, self.pages.held[slot])
        state = engine.release(state, slot)
        self.pages.free(slot)
        self.pages.preemptions += 1
        self.metrics.preemptions.inc()
        self.book.preempt(req, slot, self.config.max_seq_len)
        return state

    def _generate(
        self, engine: Engine, state: object, clock: GapClock, prefilling: frozenset = frozenset()
    ) -> object:
        # no more steps than any running request still needs: a request 3 tokens from its
        # max_tokens does not wait for the other decode_steps - 3 steps of an idle batch
        decoding = lambda: [r for b, r in enumerate(self.book.slots)
                            if r is not None and b not in prefilling]  # fmt: skip
        left = [r.params.max_tokens - r.generated for r in decoding()]
        steps = max(1, min(self.config.decode_steps, max(left, default=1)))
        state = self._make_room(engine, state, steps, prefilling)
        running = decoding()
        if not running:  # every sequence was preempted (a pool smaller than their steps)
            return state
        t0 = clock.start()
        state, out = engine.generate(state, steps, self.pages.table)
        now = clock.end()
        self.metrics.record_step("generate", now - t0, int(out.valid.sum()), len(running), steps)
        self.book.deliver(out, now)
        for b, req in enumerate(self.book.slots):  # finished sequences give their pages back
            if req is None and self.pages.held[b] and b not in prefilling:
                self.pages.free(b)
        return state

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

    def kv_pages(self) -> dict | None:
        """The paged KV cache's page counts and preemptions (None before the engines exist)."""
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
