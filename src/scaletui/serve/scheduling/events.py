"""What the scheduler and the API hand each other: requests, token events and error kinds.

A `Request` crosses from the event loop (the API) to the worker threads (the scheduler); its
events come back through its asyncio queue (`loop.call_soon_threadsafe`) as `Tokens` or
`Failed`. Every refusal or failure carries an `ErrorKind`, and the API turns a kind into an
HTTP status by looking it up (http/api.py's table), never by reading the message. Standard library
only: serve-internal (a thread boundary, not a process one), so not in `scaletui.records`.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field, replace
from enum import Enum

from scaletui.serve.engine.engine_api import SamplingParams, TokenLogprobs

_ids = itertools.count()


class ErrorKind(Enum):
    """Why a request was refused or ended without a finish reason."""

    INVALID_REQUEST = "invalid_request"  # the engine refused this request's input (400)
    OVERLOADED = "overloaded"  # the waiting queue is full (429)
    UNAVAILABLE = "unavailable"  # not serving now: compiling, reconfiguring or failed (503)
    BUSY = "busy"  # a reconfiguration is already running (409)
    ABORTED = "aborted"  # aborted by a reconfiguration's drain timeout (503)
    FAILED = "failed"  # a worker died or the server shuts down (500)
    PROCESS_LOST = "process_lost"  # multi-host: another process died or hung (503)


@dataclass(frozen=True)
class Tokens:
    """A burst of tokens for one request (one host sync); `finish` set on its last event."""

    ids: tuple[int, ...]
    finish: str | None = None  # "stop" | "length" | "abort" | "error" | None (more to come)
    logprobs: tuple[TokenLogprobs, ...] | None = None  # one per id, when the request asked
    # the prompt's (first event only, when asked): one per prompt token, the first None
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None


@dataclass(frozen=True)
class Failed:
    """The request ended without a finish reason; the API answers by `kind`."""

    kind: ErrorKind
    message: str


Event = Tokens | Failed


class ServeError(Exception):
    """A refusal the scheduler raises to the API; the subclass fixes the kind."""

    kind: ErrorKind = ErrorKind.FAILED


class Overloaded(ServeError):
    """The waiting queue is full (429)."""

    kind = ErrorKind.OVERLOADED


class Unavailable(ServeError):
    """Not serving right now: compiling, reconfiguring or failed (503)."""

    kind = ErrorKind.UNAVAILABLE


class Busy(ServeError):
    """A reconfiguration is already running (409)."""

    kind = ErrorKind.BUSY


class TooLong(ServeError):
    """The request needs more KV pages than one replica's whole pool (400)."""

    kind = ErrorKind.INVALID_REQUEST


@dataclass(eq=False)
class Request:
    """One generation, from `submit` to its last `Tokens` (or `Failed`) event."""

    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    id: int = field(default_factory=lambda: next(_ids))
    t_arrival: float = field(default_factory=time.perf_counter)
    t_scheduled: float = 0.0
    t_first: float = 0.0
    t_last: float = 0.0
    generated: int = 0
    last_token: int = -1
    outputs: list[int] = field(default_factory=list)  # every token streamed so far
    preempted: int = 0  # times its pages were taken back (it resumes by prefilling again)
    cancel_reason: str | None = None  # "abort" (disconnect) | "stop" (stop string)
    finished: bool = False


def resume_input(req: Request) -> tuple[list[int], SamplingParams]:
    """What prefill runs for `req`: its prompt, or after a preemption the prompt and every token
    it produced, with the token limits less what it already has. The sampling key of a token is
    (seed, position), so a resumed request draws the tokens it would have drawn. Its prompt
    logprobs went out with its first token: a resume does not compute them again."""
    if not req.outputs:
        return req.prompt, req.params
    p, n = req.params, len(req.outputs)
    left = replace(
        p, max_tokens=p.max_tokens - n, min_tokens=max(0, p.min_tokens - n), prompt_logprobs=None
    )
    return req.prompt + req.outputs, left
