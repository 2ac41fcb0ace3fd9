"""The scheduler's request book: who waits, who prefills, who holds which slot, how each ends.

One condition variable guards it all; the API's thread (submit, cancel) and the worker threads
(next_waiting, place, deliver) meet here. Every request ends exactly once in `finish`, which
counts it in the Prometheus metrics (the single source of the /stats request counts) and posts
its last event to the request's asyncio queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable

from scaletui import policy
from scaletui.serve.engine.engine_api import Prefix, StepOutput, TokenLogprobs, unpack_logprobs
from scaletui.serve.scheduling.events import ErrorKind, Event, Failed, Overloaded, Request, Tokens
from scaletui.serve.scheduling.metrics import ServerMetrics

ABORTED = ("abort", "reconfigure", "error")  # finish reasons counted as aborted


class RequestBook:
    """Waiting queue (bounded), prefilling and in-flight sets, the slot table."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.cv = threading.Condition()
        self.waiting: deque[Request] = deque()
        self.waiting_tokens = 0
        self.prefilling: set[Request] = set()
        self.inflight: set[Request] = set()
        self.slots: list[Request | None] = []
        self.kv_lengths: list[int] = []
        self.eos_ids: tuple[int, ...] = ()  # the generate engine's: "stop" or "length"
        self._outbox: list[tuple[Request, Event]] | None = None  # `deliver`'s events, unposted

    def reset(self, n_slots: int, eos_ids: tuple[int, ...]) -> None:
        with self.cv:
            self.slots, self.kv_lengths = [None] * n_slots, [0] * n_slots
            self.eos_ids = eos_ids

    # -- admission and cancel (the API's thread) -----------------------------------------------

    def admit(self, req: Request, max_waiting: int, max_waiting_tokens: int) -> None:
        """Queue `req`, or raise Overloaded. Callers hold `cv` (with their state check)."""
        self.room(req, max_waiting, max_waiting_tokens)
        self.enqueue(req)

    def room(
        self,
        req: Request,
        max_waiting: int,
        max_waiting_tokens: int,
        ahead: int = 0,
        ahead_tokens: int = 0,
    ) -> None:
        """Overloaded unless the waiting queue, with `ahead` requests of `ahead_tokens` prompt
        tokens admitted but not yet queued, has room for `req`. Callers hold `cv`."""
        # The token bound applies to a non-empty queue only: a single prompt longer than
        # max_waiting_tokens would otherwise get 429 (retry later) forever.
        n, tokens = len(self.waiting) + ahead, self.waiting_tokens + ahead_tokens
        if n >= max_waiting or (n and tokens + len(req.prompt) > max_waiting_tokens):
            self.metrics.rejected.inc()
            raise Overloaded(
                f"{n} requests / {tokens} prompt tokens waiting "
                f"(limits {max_waiting} / {max_waiting_tokens})"
            )

    def enqueue(self, req: Request) -> None:
        """`req` joins the waiting queue (admitted: `room` said yes)."""
        with self.cv:
            self.waiting.append(req)
            self.waiting_tokens += len(req.prompt)
            self.inflight.add(req)
            self.cv.notify_all()

    def cancel(self, req: Request, reason: str) -> None:
        with self.cv:
            if req.finished or req.cancel_reason:
                return
            req.cancel_reason = reason
            if req in self.waiting:
                self._unqueue(req)
                self.finish(req, reason)
            self.cv.notify_all()

    def _unqueue(self, req: Request) -> None:
        self.waiting.remove(req)
        self.waiting_tokens -= len(req.prompt)

    # -- the workers' side ---------------------------------------------------------------------

    def next_waiting(
        self, block: bool, stop: threading.Event, admit: Callable[[Request], bool] | None = None
    ) -> Request | None:
        """The head of the waiting queue (FCFS), or None; `admit` (called under the lock) may
        hold the head back, e.g. until KV pages free up."""
        with self.cv:
            while not self.waiting and block and not stop.is_set():
                self.cv.wait(0.1)
            if not self.waiting or stop.is_set():
                return None
            if admit is not None and not admit(self.waiting[0]):
                return None
            req = self.waiting.popleft()
            self.waiting_tokens -= len(req.prompt)
            self.prefilling.add(req)
            return req

    def rejected(self, req: Request, why: Exception) -> None:
        """The engine refused this request's input: fail it alone."""
        with self.cv:
            self.prefilling.discard(req)
            self.finish(req, "error", notify=False)
            self.post(req, Failed(ErrorKind.INVALID_REQUEST, f"rejected: {why}"))

    def prefilled(self, req: Request, prefix: Prefix, now: float) -> Prefix | None:
        """Stream the first token; the prefix to insert, or None when the request ended."""
        with self.cv:
            self.prefilling.discard(req)
            if req.cancel_reason or req.finished:
                self.finish(req, req.cancel_reason or "abort")
                return None
            reason = self._reason(req, [prefix.first_token]) if prefix.done else None
            mine = None if prefix.logprobs is None else (prefix.logprobs,)
            self.emit(req, [prefix.first_token], reason, now, mine, prefix.prompt_logprobs)
            return None if prefix.done else prefix

    def place(self, req: Request, length: int, slot: int) -> bool:
        """Put `req` in the free `slot`; False when it ended meanwhile."""
        with self.cv:
            if req.cancel_reason or req.finished:
                self.finish(req, req.cancel_reason or "abort")
                return False
            assert self.slots[slot] is None, f"slot {slot} is taken"
            self.slots[slot], self.kv_lengths[slot] = req, length
            return True

    def vacate(self, slot: int, req: Request) -> None:
        """`req` (done at its first token, or ended while prefilling) leaves `slot`."""
        with self.cv:
            if self.slots[slot] is req:
                self.slots[slot], self.kv_lengths[slot] = None, 0

    def free_slots(self) -> list[int]:
        with self.cv:
            return [b for b, r in enumerate(self.slots) if r is None]

    def preempt(self, req: Request, slot: int | None, max_seq_len: int) -> None:
        """`req` lost its KV pages (from `slot`, or before it got one): back to the head of the
        waiting queue, to resume by prefilling its prompt and what it produced
        (`events.resume_input`). One that could not resume (its prompt and output fill
        max_seq_len) ends with "length", as the next step would have ended it."""
        with self.cv:
            if slot is not None:
                self.slots[slot], self.kv_lengths[slot] = None, 0
            req.preempted += 1
            if req.cancel_reason or req.finished:
                self.finish(req, req.cancel_reason or "abort")
            elif not policy.resumable(len(req.prompt) + len(req.outputs), max_seq_len):
                self.finish(req, "length")
            else:
                self.waiting.appendleft(req)
                self.waiting_tokens += len(req.prompt)
            self.cv.notify_all()

    def take_cancelled(self) -> list[int]:
        """Free the slots of cancelled requests; the engine releases them next."""
        with self.cv:
            gone = [b for b, r in enumerate(self.slots) if r is not None and r.cancel_reason]
            for b in gone:
                req = self.slots[b]
                self.slots[b], self.kv_lengths[b] = None, 0
                self.prefilling.discard(req)  # cancelled while prefilling into its slot
                self.finish(req, req.cancel_reason)
            return gone

    def deliver(self, out: StepOutput, now: float) -> None:
        """Fan one generate call's tokens out to the requests in the slots; free finished ones.
        The call's events reach each event loop in one wake-up (`_post_all`)."""
        tokens, valid = out.tokens.T.tolist(), out.valid.T.tolist()  # [slots][steps]
        ended = out.done.any(axis=0).tolist()
        with self.cv:
            self._outbox = []
            try:
                for b, req in enumerate(self.slots):
                    if req is not None:
                        ids = [t for t, v in zip(tokens[b], valid[b], strict=True) if v]
                        self._deliver_slot(b, req, ids, ended[b], out, now)
            finally:
                outbox, self._outbox = self._outbox, None
                self._post_all(outbox)

    def _deliver_slot(
        self, b: int, req: Request, ids: list[int], done: bool, out: StepOutput, now: float
    ) -> None:
        k, lps = req.params.logprobs, None
        if k is not None and out.logprobs is not None:
            lps = tuple(unpack_logprobs(r, k) for r in out.logprobs[out.valid[:, b], :, b])
        if ids:  # not a slot still prefilling (its engine row is idle)
            self.kv_lengths[b] = int(out.lengths[b])
        if done:
            self.slots[b], self.kv_lengths[b] = None, 0
        if req.cancel_reason:  # cancelled during the call: drop its tokens
            if done:
                self.finish(req, req.cancel_reason)
            return
        reason = (self._reason(req, ids) if ids else "length") if done else None
        if ids or reason:
            self.emit(req, ids, reason, now, lps)

    # -- endings (callers hold cv) ----------------------------------------------------------------

    def _reason(self, req: Request, ids: list[int]) -> str:
        """Why a sequence the engine marked done ended: EOS ("stop") or a limit ("length")."""
        p, n = req.params, req.generated + len(ids)
        limits = {"min_tokens": p.min_tokens, "ignore_eos": p.ignore_eos, "eos_ids": self.eos_ids}
        reason = policy.finish_reason(ids[-1], n, p.max_tokens, **limits)
        return reason or "length"  # the engine ended it: max_seq_len

    def emit(
        self,
        req: Request,
        ids: list[int],
        finish: str | None,
        now: float,
        logprobs: tuple[TokenLogprobs, ...] | None = None,
        prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None,
    ) -> None:
        m = self.metrics
        if ids:
            if not req.t_first:
                req.t_first = now
                m.ttft.observe(now - req.t_arrival)
            else:
                gap = (now - req.t_last) / len(ids)
                for _ in ids:
                    m.itl.observe(gap)
            req.t_last = now
            req.generated += len(ids)
            req.last_token = ids[-1]
            req.outputs += ids
        if finish:  # counted before the client can see the last event
            self.finish(req, finish, notify=False)
        self.post(req, Tokens(tuple(ids), finish, logprobs, prompt_logprobs))

    def finish(self, req: Request, reason: str, notify: bool = True) -> None:
        if req.finished:
            return
        req.finished = True
        self.inflight.discard(req)
        m = self.metrics
        if reason in ABORTED:
            m.aborted.inc()
        else:
            m.success.labels(finished_reason=reason).inc()
            end = req.t_last or time.perf_counter()
            m.e2e.observe(end - req.t_arrival)
            if req.t_first:
                m.decode.observe(end - req.t_first)
        if notify and reason == "reconfigure":
            message = "aborted: the server is reconfiguring (drain timeout)"
            self.post(req, Failed(ErrorKind.ABORTED, message))
        elif notify and reason != "abort":
            self.post(req, Tokens((), reason))
        self.cv.notify_all()

    def post(self, req: Request, event: Event) -> None:
        if self._outbox is not None:  # inside `deliver`: posted with the call's other events
            self._outbox.append((req, event))
            return
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening
            req.loop.call_soon_threadsafe(req.events.put_nowait, event)

    def _post_all(self, outbox: list[tuple[Request, Event]]) -> None:
        """One `call_soon_threadsafe` per event loop for a whole generate call's events: one
        wake-up of the HTTP thread per step, not one per request (each costs the worker a
        pipe write and a GIL hand-over)."""
        loops: dict = {}
        for req, event in outbox:
            loops.setdefault(req.loop, []).append((req.events, event))
        for loop, events in loops.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening
                loop.call_soon_threadsafe(_put_each, events)

    def fail_all(self, message: str, kind: ErrorKind = ErrorKind.FAILED) -> None:
        with self.cv:
            pending = list(self.inflight)
            self.waiting.clear()
            self.waiting_tokens = 0
            self.prefilling.clear()
            self.slots = [None] * len(self.slots)
            self.kv_lengths = [0] * len(self.kv_lengths)
            for req in pending:
                if not req.finished:
                    req.finished = True
                    self.metrics.aborted.inc()
                    self.post(req, Failed(kind, message))
            self.inflight.clear()
            self.cv.notify_all()

    def drain(self, requests: set[Request], timeout_s: float) -> int:
        """Wait for `requests` to end; abort those still running after `timeout_s`."""
        deadline = time.perf_counter() + timeout_s
        with self.cv:
            while any(not r.finished for r in requests) and time.perf_counter() < deadline:
                self.cv.wait(0.05)
            late = [r for r in requests if not r.finished]
            for r in late:
                r.cancel_reason = "reconfigure"
                if r in self.waiting:
                    self._unqueue(r)
                    self.finish(r, "reconfigure")
            self.cv.notify_all()
        end = time.perf_counter() + 30.0  # the workers release them before their next step
        with self.cv:
            while any(not r.finished for r in late) and time.perf_counter() < end:
                self.cv.wait(0.05)
            for r in late:
                self.finish(r, "reconfigure")
        return len(late)

    # -- views -----------------------------------------------------------------------------------

    def counts_now(self, configured_slots: int) -> dict:
        """waiting / running / slots used and total."""
        with self.cv:
            placed = {r for r in self.slots if r is not None}
            used = len(placed)
            return {
                "waiting": len(self.waiting),
                "running": len(placed | self.prefilling),
                "slots_used": used,
                "slots_total": len(self.slots) or configured_slots,
            }


def _put_each(events: list[tuple[asyncio.Queue, Event]]) -> None:
    """On the event loop: each event into its request's queue, in order."""
    for queue, event in events:
        queue.put_nowait(event)
