"""Continuous batching on the generate engine: the policy's decisions (scaletui.policy) applied
to the engine's results, the pages and the request book.

One `Batcher` per worker run: the interleaved worker calls `interleaved_pass` (admit, prefill
pieces, one generate call, the first pieces in it with mixed batches), the disaggregated generate
worker `insert` and `generate`. Each pass reports its `policy.StepPlan` to `on_plan` (tests
replay the simulator against it).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from scaletui import policy
from scaletui.serve.engine.engine_api import Chunk, Engine, Prefix, SamplingParams
from scaletui.serve.scheduling.book import RequestBook
from scaletui.serve.scheduling.events import Request, resume_input
from scaletui.serve.scheduling.metrics import ServerMetrics
from scaletui.serve.scheduling.paging import PageTables
from scaletui.serve.scheduling.speed import SpeedModel
from scaletui.shape import ServerShape

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

    def chunk(self, n: int) -> Chunk:
        """Its next `n` prompt tokens, as a piece that rides in a generate call."""
        return Chunk(self.tokens, self.params, self.slot, self.pages, self.done, self.done + n)


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


class Batcher:
    """The generate engine's decode state, its prefill jobs, and the verbs that change them."""

    def __init__(
        self,
        config: ServerShape,
        engine: Engine,
        book: RequestBook,
        pages: PageTables,
        metrics: ServerMetrics,
        on_plan: Callable[[policy.StepPlan], None] | None = None,
        # the fit pricing each call now (the scheduler's: it may find a fit while serving)
        speed: Callable[[], SpeedModel] = SpeedModel,
    ) -> None:
        self.config, self.engine, self.book, self.pages = config, engine, book, pages
        self.metrics, self.on_plan, self._speed = metrics, on_plan, speed
        self.state = engine.init_decode_state()
        self.jobs: list[PrefillJob] = []  # FCFS, each in its slot, prefilling into its pages
        self.clock = GapClock(metrics)
        self.plan = policy.StepPlan()
        self.pending: tuple[Request, Prefix] | None = None  # disaggregated: waits for pages

    @property
    def speed(self) -> SpeedModel:
        return self._speed()

    def interleaved_pass(self, stop: threading.Event) -> bool:
        """Admit, run prompt pieces within the budget, then one generate call for the
        sequences already decoding (with mixed batches the first pieces ride in it); False
        when there was nothing to do."""
        book, size, self.plan = self.book, self.pages.page_size, policy.StepPlan()
        self.release_cancelled()
        self.jobs = [j for j in self.jobs if book.slots[j.slot] is j.req]  # cancelled: gone
        admit = lambda req: self.slot_for(len(resume_input(req)[0])) is not None  # noqa: E731
        while req := book.next_waiting(False, stop, admit):
            job = self._start_job(req)
            if job is not None:
                self.jobs.append(job)
        budget = policy.token_budget(self.config.max_batched_tokens, size)
        pieces = policy.chunks([j.left for j in self.jobs], budget, size)
        waiting = {j.slot for j in self.jobs}
        decoding = sum(r is not None and b not in waiting for b, r in enumerate(book.slots))
        starts = [j.done for j in self.jobs]
        k = policy.riders(pieces, starts, decoding, self.engine.mix_tokens, size)
        ride = list(zip(self.jobs, pieces[:k], strict=False))  # in the generate call
        try:
            self.engine.check_chunks([job.chunk(n) for job, n in ride], self.state)
        except ValueError:  # a piece's input: each runs alone, so that only the bad one fails
            k, ride = 0, []
        self.plan.chunks += [(job.req.id, n) for job, n in ride]
        for job, n in list(zip(self.jobs, pieces, strict=False))[k:]:
            self._prefill_job(job, n)  # a long prompt runs in pieces between generate calls
        prefilling = {j.slot for j in self.jobs if j.left}
        busy = bool(prefilling)
        if any(r is not None and b not in prefilling for b, r in enumerate(book.slots)):
            self.generate(prefilling, ride)
            busy = True
        self.jobs = [j for j in self.jobs if j.left]
        self._report()
        return busy

    def _report(self) -> None:
        if self.plan and self.on_plan is not None:
            self.on_plan(self.plan)

    def slot_for(self, tokens: int) -> int | None:
        """A free slot whose replica has pages for `tokens` positions and the next decode
        steps, or None."""
        pages = self.pages
        need = policy.admit_pages(tokens, self.config.decode_steps, pages.page_size, pages.cap)
        free = pages.free_pages()
        return policy.admit_slot(need, self.book.free_slots(), free, pages.per_replica)

    def _start_job(self, req: Request) -> PrefillJob | None:
        """Give `req` a slot and pages for its prompt, reusing the longest cached prefix."""
        tokens, params = resume_input(req)
        slot = self.slot_for(len(tokens))  # next_waiting's `admit` checked there is one
        pool, cached, hit = self.pages.pool_of(slot), [], 0
        # prompt logprobs need every prompt position's logits: no cached prefix then
        if self.config.prefix_cache and params.prompt_logprobs is None:
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
        self.plan.admitted.append((req.id, slot, hit))
        return PrefillJob(req, slot, tokens, params, pages, done=hit)

    def _prefill_job(self, job: PrefillJob, n: int, listed: bool = False) -> None:
        """The next `n` prompt tokens of `job` in a prefill call (`listed`: the plan has the
        piece already)."""
        if not listed:
            self.plan.chunks.append((job.req.id, n))
        predicted = self.speed.piece_s(job.done, job.done + n)
        t0 = self.clock.start()
        try:
            self.state, prefix = self.engine.prefill_pages(
                self.state, job.tokens, job.params, job.slot, job.pages, job.done, job.done + n
            )
        except ValueError as e:  # this request's input, not the device: fail it alone
            self.clock.end()
            self._reject(job, e)
            return
        now = self.clock.end()
        self.metrics.record_step("prefill", now - t0, n, predicted=predicted)
        self._piece_done(job, n, prefix, now)

    def _reject(self, job: PrefillJob, e: ValueError) -> None:
        log.warning("request %d rejected by the engine: %s", job.req.id, e)
        self.book.vacate(job.slot, job.req)
        self.pages.free(job.slot)
        self.book.rejected(job.req, e)
        job.done = len(job.tokens)

    def _piece_done(self, job: PrefillJob, n: int, prefix: Prefix | None, now: float) -> None:
        """`n` more prompt tokens of `job` ran; at the prompt's end, its first token out and
        the slot active (or given back, when that token ends it)."""
        req, slot = job.req, job.slot
        job.done += n
        if prefix is None:
            return
        if self.config.prefix_cache:  # its full prompt pages, for the next request to reuse
            self.pages.pool_of(slot).register(job.tokens, job.pages)
        self.metrics.generation_tokens.inc()
        self.metrics.prefill.observe(now - req.t_scheduled)
        if self.book.prefilled(req, prefix, now) is None:  # done at its first token, or gone
            self.plan.finished.append(req.id)
            self.book.vacate(slot, req)
            self.pages.free(slot)
            return
        self.state = self.engine.insert(self.state, prefix, slot, job.pages)

    def disaggregated_pass(self, handover: queue.Queue, wait_s: float = 0.1) -> None:
        """Insert prefilled requests from the `handover` queue into free slots, then one
        generate call while any slot is busy (when idle it waits up to `wait_s` for a
        hand-over; 0: not at all)."""
        book, self.plan = self.book, policy.StepPlan()
        self.release_cancelled()
        busy = any(r is not None for r in book.slots)
        if not busy:  # waits for a hand-over below
            self.clock.idle()
        while None in book.slots:
            if self.pending is None:
                try:
                    self.pending = handover.get(block=not busy and wait_s > 0, timeout=wait_s)
                except queue.Empty:
                    break
            if not self.insert(*self.pending, requeue=not busy):
                break  # no pages yet: it waits for running sequences to end
            self.pending, busy = None, True
        if busy:
            self.generate()
        self._report()

    def insert(self, req: Request, prefix: Prefix, requeue: bool) -> bool:
        """Place a prefilled request in a slot with pages for its prompt -> placed. Without
        room it is requeued (`requeue`) to prefill again later, or left to the caller."""
        slot = self.slot_for(prefix.length)
        if slot is None:
            if requeue:
                self.book.preempt(req, None, self.config.max_seq_len)
            return requeue
        if not self.book.place(req, prefix.length, slot):
            return True  # it ended meanwhile (cancelled)
        pages = self.pages.take(slot, prefix.length)
        self.state = self.engine.insert(self.state, prefix, slot, pages)
        return True

    def release_cancelled(self) -> None:
        """Slots of cancelled requests go back, with their pages (take_cancelled ended them)."""
        for b in self.book.take_cancelled():
            self.state = self.engine.release(self.state, b)
            self.pages.free(b)

    def _make_room(self, steps: int, prefilling: set[int]) -> None:
        """Pages for the positions the next call writes (policy.make_room): grow, or preempt
        (`prefilling` slots are not decoding: they hold their prompt's pages already)."""
        book, pages = self.book, self.pages
        decoding = [
            policy.Seq(b, r.t_scheduled, book.kv_lengths[b], r.params.max_tokens - r.generated)
            for b, r in enumerate(book.slots)
            if r is not None and b not in prefilling
        ]
        held = {b: p for b, p in enumerate(pages.held) if p}
        size, top = pages.page_size, pages.max_seq_len
        free = pages.free_pages()
        for act in policy.make_room(decoding, held, free, steps, size, top, pages.per_replica):
            if isinstance(act, policy.Grow):
                grown = pages.grow(act.slot, act.tokens)
                assert grown, f"slot {act.slot}: the policy counted pages its pool lacks"
            else:
                self._preempt(act.slot)

    def _preempt(self, slot: int) -> None:
        req, length = self.book.slots[slot], self.book.kv_lengths[slot]
        message = "KV pages exhausted: request %d (%d tokens) preempted, to resume by prefill"
        log.info(message, req.id, length)
        if self.config.prefix_cache:  # its full pages stay matchable: resuming may reuse them
            done = (req.prompt + req.outputs)[:length]
            self.pages.pool_of(slot).register(done, self.pages.held[slot])
        self.state = self.engine.release(self.state, slot)
        self.pages.free(slot)
        self.pages.preemptions += 1
        self.metrics.preemptions.inc()
        self.book.preempt(req, slot, self.config.max_seq_len)
        self.plan.preempted.append(req.id)
        if req.finished:
            self.plan.finished.append(req.id)

    def generate(
        self,
        prefilling: set[int] | frozenset = frozenset(),
        ride: Sequence[tuple[PrefillJob, int]] = (),
    ) -> None:
        """One generate call over the decoding slots (`ride`: prompt pieces in its first step),
        its tokens fanned out, finished sequences' pages given back."""
        book = self.book

        def decoding() -> list[Request]:
            return [r for b, r in enumerate(book.slots) if r is not None and b not in prefilling]

        lefts = [r.params.max_tokens - r.generated for r in decoding()]
        steps = policy.decode_steps(lefts, self.config.decode_steps, mixed=bool(ride))
        self._make_room(steps, prefilling)
        running = decoding()
        if not running:  # every sequence was preempted (a pool smaller than their steps)
            for job, n in ride:
                self._prefill_job(job, n, listed=True)
            return
        predicted = None
        if self.speed.costs is not None:  # what the fit says this call takes
            kv = book.kv_lengths
            lengths = [kv[b] for b, r in enumerate(book.slots) if r and b not in prefilling]
            predicted = self.speed.generate_s(steps, lengths)
            if ride:
                predicted += self.speed.mixed_s([(job.done, job.done + n) for job, n in ride])
        t0 = self.clock.start()
        if ride:
            self.state, out, prefixes = self.engine.generate_mixed(
                self.state, steps, self.pages.table, [job.chunk(n) for job, n in ride]
            )
        else:
            self.state, out = self.engine.generate(self.state, steps, self.pages.table)
        now = self.clock.end()
        valid = int(out.valid.sum())
        self.metrics.record_step("generate", now - t0, valid, len(running), steps, predicted)
        book.deliver(out, now)
        self.plan.steps, self.plan.mixed = steps, len(ride)
        self.plan.finished += [r.id for r in running if r.finished]
        for b, req in enumerate(book.slots):  # finished sequences give their pages back
            if req is None and self.pages.held[b] and b not in prefilling:
                self.pages.free(b)
        for (job, n), prefix in zip(ride, prefixes if ride else (), strict=True):
            self.metrics.prompt_tokens.inc(n)  # after the decode rows' ends, as simulated
            self._piece_done(job, n, prefix, now)
