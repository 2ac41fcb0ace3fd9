"""The scheduler of a multi-process server: every process runs the same passes on the same inputs.

Multi-controller SPMD, as sglang-jax and tpu-inference run it: each process holds its own
`Scheduler` (the same request book, pages and policy) and calls the same compiled engine
programs in the same order, which XLA's collectives (gloo on CPU) join into one computation over
the global mesh. What could make the processes' decisions differ is kept off them:

1. Process 0 takes requests and cancels from its HTTP API into an inbox instead of the book;
   nothing else touches the book between two passes.
2. Before each pass, process 0 packs the inbox (wire.py) with a run or stop word into one
   fixed-size array and sends it to every process (link.py); every process, process 0
   included, unpacks that same array and applies it: arrivals join the waiting queue, cancels
   mark their requests. No process reads its own clock to decide anything.
3. Every process runs `Batcher.interleaved_pass` (disaggregated: `_disaggregated_pass`); the
   engine's sampled tokens are replicated (or broadcast from the process that holds an
   engine's devices: serve/engine/host_copy.py), so every book ends the pass identical. Only
   process 0's requests have a client listening.
4. A watchdog thread turns a lost process (its connection closed) or a pass that does not end
   within --step-timeout into `fatal`: in-flight requests fail with a 503 naming the process,
   /health fails, and the process exits non-zero (process 0 after a short grace, so the 503s
   and /health are seen; its exit closes the others' connections, and they exit too).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable

from scaletui.serve.engine.engine_api import EngineFactory
from scaletui.serve.multihost import wire
from scaletui.serve.multihost.cluster import Cluster
from scaletui.serve.multihost.link import FollowerLink, LeaderLink
from scaletui.serve.scheduling.batcher import Batcher
from scaletui.serve.scheduling.book import RequestBook
from scaletui.serve.scheduling.events import Busy, ErrorKind, Request
from scaletui.serve.scheduling.metrics import ServerMetrics
from scaletui.serve.scheduling.scheduler import Scheduler
from scaletui.shape import ServerShape

log = logging.getLogger("scaletui.serve")

IDLE_S = 0.25  # process 0 sends an empty pass at least this often: the others' heartbeat
GRACE_S = 3.0  # process 0 answers 503 and a failed /health this long before it exits
FOLLOWER_SLACK_S = 5.0  # followers wait this much longer: process 0 names the culprit first


def _exit(code: int) -> None:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # a thread may sit in a collective that will never return: no clean exit


class _Book(RequestBook):
    """The request book, where an engine error is fatal when a process is lost: across
    processes a collective that failed (gloo's read error) can reach the batcher as the
    ValueError of a request the engine refused, and that request must not get a 400 alone."""

    def __init__(self, metrics: ServerMetrics, link: LeaderLink | FollowerLink) -> None:
        super().__init__(metrics)
        self.link = link

    def rejected(self, req: Request, why: Exception) -> None:
        deadline = time.monotonic() + 0.5  # the connection's reader sees a loss at once
        while not self.link.lost and time.monotonic() < deadline:
            time.sleep(0.01)
        if self.link.lost:
            raise RuntimeError(f"an engine call failed: {why}") from why
        super().rejected(req, why)


class LockstepScheduler(Scheduler):
    """A `Scheduler` whose inputs reach every process by one broadcast per pass."""

    def __init__(
        self,
        config: ServerShape,
        factory: EngineFactory,
        cluster: Cluster,
        link: LeaderLink | FollowerLink,
        barrier: Callable[[], None],
        exit_process: Callable[[int], None] = _exit,
        fit: str = "auto",  # Scheduler's: the engine fit its calls are priced by
    ) -> None:
        super().__init__(config, factory, fit=fit)
        self.cluster, self.link, self.barrier = cluster, link, barrier
        self.exit_process = exit_process
        self.wire = wire.WireShape.for_server(config.max_seq_len)
        self.loop: asyncio.AbstractEventLoop | None = None  # followers' requests post here
        self._inbox: list[wire.Event] = []  # process 0: not yet sent (guarded by book.cv)
        self._arrivals: dict[int, Request] = {}  # process 0: its requests in the inbox
        self._known: weakref.WeakValueDictionary[int, Request] = weakref.WeakValueDictionary()
        self.number = 0  # the pass being run
        self._moved = time.monotonic()  # the last pass start or end
        self._armed = False  # passes are running: the step timeout applies
        self._dead = threading.Event()
        self._rebuilt = threading.Event()  # process 0: a reconfiguration's rebuild is done
        self.book = _Book(self.metrics, link)
        link.on_lost = self.fatal
        timeout = cluster.step_timeout_s + (0 if cluster.leader else FOLLOWER_SLACK_S)
        self._timeout_s = timeout
        threading.Thread(target=self._watch, name="scaletui-watchdog", daemon=True).start()

    # -- process 0's API ------------------------------------------------------------------------

    def submit(self, req: Request) -> None:
        """Into the inbox, after the same checks and queue bounds as one process's `submit`."""
        with self.book.cv:
            self.check_admissible(req)
            ahead = self._arrivals.values()
            tokens = sum(len(r.prompt) for r in ahead)
            c = self.config
            self.book.room(req, c.max_waiting, c.max_waiting_tokens, len(ahead), tokens)
            self._arrivals[req.id] = req
            self._inbox.append(wire.Arrival(req.id, tuple(req.prompt), req.params))
            self.book.cv.notify_all()

    def cancel(self, req: Request, reason: str = "abort") -> None:
        """Into the inbox: the cancel takes effect at the next pass, on every process."""
        with self.book.cv:
            if not req.finished:
                self._inbox.append(wire.Cancel(req.id, reason))
                self.book.cv.notify_all()

    def reconfigure(self, changes: dict, drain_timeout_s: float = 60.0) -> dict:
        """As one process's (stop admitting, drain, rebuild, compile, resume), with the rebuild
        at one pass on every process: process 0 checks the changes, drains (a request still
        running after `drain_timeout_s` is cancelled through the inbox, like a client gone),
        then sends a `Reconfig` event; every process rebuilds at that pass (`_rebuild`)."""
        with self.book.cv:
            if self._reconfiguring:
                raise Busy("a reconfiguration is already under way")
            if self.state != "serving":
                raise Busy(f"the server is {self.state}; try again when it is serving")
            new = self.config.updated(**changes)  # ValueError names the value
            event = wire.Reconfig(dict(changes))
            if event.words > self.wire.token_cap:
                raise ValueError(f"the changes {changes} do not fit in a pass's array")
            self.factory.check(new, self.engines)  # placement, sharding, memory: before a drain
            self._reconfiguring, self.state = True, "reconfiguring"
            draining = set(self.book.inflight) | set(self._arrivals.values())
            self._rebuilt = threading.Event()
        try:
            aborted = self._drain(draining, drain_timeout_s)
            with self.book.cv:
                self._inbox.append(event)
                self.book.cv.notify_all()
            while not self._rebuilt.wait(0.25):
                if self._dead.is_set():
                    raise RuntimeError(f"reconfigure failed: {self.error}")
            return {
                "config": self.config.to_json(),
                "compile_s": self.compile["seconds"],
                "drained": len(draining) - aborted,
                "aborted": aborted,
            }
        finally:
            self._reconfiguring = False

    def _drain(self, requests: set[Request], timeout_s: float) -> int:
        """Wait for `requests` to end; cancel those still running after `timeout_s` on every
        process (a cancel event), then wait for the passes to release them."""
        with self.book.cv:
            end = time.monotonic() + timeout_s
            while any(not r.finished for r in requests) and time.monotonic() < end:
                self.book.cv.wait(0.05)
            late = [r for r in requests if not r.finished]
            self._inbox += [wire.Cancel(r.id, "reconfigure") for r in late]
            self.book.cv.notify_all()
            while any(not r.finished for r in late) and not self._dead.is_set():
                self.book.cv.wait(0.05)
        return len(late)

    def _rebuild(self, changes: dict) -> None:
        """Every process, at the pass that carries the `Reconfig`: build and compile the new
        engines (the watchdog waits: a compile is not a hung pass), then meet the others. A
        process that cannot build is lost to the others: every process exits (`fatal`)."""
        self._mark(armed=False)
        self._build(self.config.updated(**changes))
        self.barrier()
        self._mark(armed=True)
        if isinstance(self.link, LeaderLink):
            self.state = "serving"
            self._rebuilt.set()

    def placement(self) -> dict:
        """/stats `placement`: where the mesh's devices are over the processes (devices.py)."""
        from scaletui.serve.multihost import devices  # imports JAX, as the engines have

        return devices.placement(self.config, self.cluster.tp_over_hosts).to_dict()

    # -- the pass loop (every process) -------------------------------------------------------

    def _loops(self) -> list[tuple[str, Callable[[], None]]]:
        """One loop in either mode: the passes run in lock step (disaggregated too)."""
        return [("lockstep", self._pass_loop)]

    def _pass_loop(self) -> None:
        batcher, never = self._batcher(), threading.Event()  # only the stop word stops a pass
        self.barrier()  # every process compiled: from here a slow pass means a stuck one
        self._mark(armed=True)
        try:
            while True:
                got = self._exchange()
                if got is None:  # process 0 lost: the watchdog is ending this process
                    return
                self._mark()
                if got.number != self.number % 2**31:
                    raise RuntimeError(f"pass {got.number} arrived, {self.number} expected")
                self._apply(got)
                if got.word == wire.STOP:
                    return
                if got.events and isinstance(got.events[-1], wire.Reconfig):
                    batcher = None  # the old engines go with it: the new ones take their memory
                    self._rebuild(got.events[-1].changes)
                    batcher = self._batcher()
                if self.config.mode == "interleaved":
                    busy = batcher.interleaved_pass(never)
                else:
                    busy = self._disaggregated_pass(batcher, never)
                self._mark()
                if isinstance(self.link, FollowerLink):
                    self.link.finished(got.number)
                self.number += 1
                if not busy:
                    batcher.clock.idle()
                    self._idle()
        finally:
            self._armed = False

    def _disaggregated_pass(self, batcher: Batcher, never: threading.Event) -> bool:
        """Disaggregated, as one pass: prefill the head of the queue while the generate side
        has a free slot for it (FCFS), hand each prefix over (its K/V and first token reach
        every process: host_copy.py), then one generate call (`Batcher.disaggregated_pass`,
        not waiting for a hand-over). The prefill engine runs on its processes while the
        generate engine's wait at the hand-over: the two sides take turns, not overlap."""
        room = len(self.book.free_slots()) - self._transfer.qsize() - (batcher.pending is not None)
        prefilled = 0
        while room > 0 and (req := self.book.next_waiting(False, never)) is not None:
            prefix = self._prefill_and_hand_over(req)
            if prefix is None:  # rejected, or it ended at its first token
                continue
            self._transfer.put((req, prefix))
            room, prefilled = room - 1, prefilled + 1
        batcher.disaggregated_pass(self._transfer, wait_s=0)
        busy = any(r is not None for r in self.book.slots) or batcher.pending is not None
        return busy or prefilled > 0 or not self._transfer.empty()

    def _exchange(self) -> wire.PassInput | None:
        """The next pass's inputs: packed and sent (process 0) or received (the others)."""
        if isinstance(self.link, LeaderLink):
            with self.book.cv:
                word = wire.STOP if self._stop.is_set() else wire.RUN
                array, taken = wire.pack(self.wire, word, self.number, self._inbox)
                del self._inbox[:taken]
            self.link.send(array)
        else:
            while (array := self.link.recv(IDLE_S)) is None:
                if self._dead.is_set() or self.link.lost:
                    return None
        return wire.unpack(self.wire, array)

    def _apply(self, got: wire.PassInput) -> None:
        """The pass's arrivals join the waiting queue and its cancels mark their requests, in
        the order process 0 received them; process 0 and the others run this same code."""
        for e in got.events:
            if isinstance(e, wire.Arrival):
                with self.book.cv:
                    req = self._arrivals.pop(e.id, None)
                if req is None:  # a follower: the same request, nobody listening
                    req = Request(list(e.prompt), e.params, self.loop, id=e.id)
                req.params = e.params  # as sent (the seed mod 2^31, f32 floats): identical
                self._known[e.id] = req
                self.book.enqueue(req)
            elif isinstance(e, wire.Reconfig):
                continue  # after the pass's other events: the loop rebuilds
            elif (req := self._known.get(e.id)) is not None:  # gone: it had finished
                self.book.cancel(req, e.reason)

    def _idle(self) -> None:
        """Process 0 with nothing to do waits for a request (at most IDLE_S: the others'
        heartbeat); the others wait in `_exchange`."""
        if isinstance(self.link, LeaderLink):
            with self.book.cv:
                if not (self._inbox or self.book.waiting or self._stop.is_set()):
                    self.book.cv.wait(IDLE_S)

    def _mark(self, armed: bool | None = None) -> None:
        self._moved = time.monotonic()
        if armed is not None:
            self._armed = armed

    # -- failure -------------------------------------------------------------------------------

    def _guard(self, loop: Callable[[], None]) -> None:
        try:
            loop()
        except BaseException as e:
            log.exception("scheduler worker died")
            deadline = time.monotonic() + 1.0  # a lost peer is the likelier cause: let it show
            while not self.link.lost and time.monotonic() < deadline:
                time.sleep(0.05)
            self.fatal(self.link.lost or f"process {self.cluster.process_id}'s worker died: {e}")

    def _watch(self) -> None:
        while not self._dead.wait(0.25):
            if self._armed and time.monotonic() - self._moved > self._timeout_s:
                self.fatal(self._stuck())

    def _stuck(self) -> str:
        n, me = self.number, self.cluster.process_id
        waited = f"pass {n} has not finished within {self._timeout_s:g} s (--step-timeout)"
        if isinstance(self.link, LeaderLink):
            behind = sorted(p for p, k in self.link.finished.items() if k < n - 1)
            if behind:
                return f"{waited}: process {', '.join(map(str, behind))} hung before it"
            return f"{waited}: a process hung in it"
        return f"process {me}: {waited}; process 0 or another process hung"

    def fatal(self, why: str) -> None:
        """Fail every request with a 503 naming the lost process, fail /health, exit non-zero
        (process 0 after GRACE_S; it closes the others' connections, so they exit at once)."""
        with self.book.cv:
            if self._dead.is_set():
                return
            self._dead.set()
        log.error("multihost: %s; exiting", why)
        self.state, self.error = "failed", why
        self._stop.set()
        self.book.fail_all(why, ErrorKind.PROCESS_LOST)
        if isinstance(self.link, LeaderLink):
            self.link.close()
            threading.Timer(GRACE_S, self.exit_process, (1,)).start()
        else:
            self.exit_process(1)

    def running(self) -> bool:
        """Whether the pass loop still runs (a follower's main thread waits on it)."""
        return any(t.is_alive() for t in self._threads) and not self._dead.is_set()
