"""What the scheduler and the API hand each other: requests, token events and error kinds.

A `Request` crosses from the event loop (the API) to the worker threads (the scheduler); its
events come back through its asyncio queue (`loop.call_soon_threadsafe`) as `Tokens` or
`Failed`. Every refusal or failure carries an `ErrorKind`, and the API turns a kind into an
HTTP status by looking it up (api.py's table), never by reading the message. Standard library
only: serve-internal (a thread boundary, not a process one), so not in `scaletui.records`.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from enum import Enum

from scaletui.serve.engine_api import SamplingParams

_ids = itertools.count()


class ErrorKind(Enum):
    """Why a request was refused or ended without a finish reason."""

    INVALID_REQUEST = "invalid_request"  # the engine refused this request's input (400)
    OVERLOADED = "overloaded"  # the waiting queue is full (429)
    UNAVAILABLE = "unavailable"  # not serving now: compiling, reconfiguring or failed (503)
    BUSY = "busy"  # a reconfiguration is already running (409)
    ABORTED = "aborted"  # aborted by a reconfiguration's drain timeout (503)
    FAILED = "failed"  # a worker died or the server shuts down (500)


@dataclass(frozen=True)
class Tokens:
    """A burst of tokens for one request (one host sync); `finish` set on its last event."""

    ids: tuple[int, ...]
    finish: str | None = None  # "stop" | "length" | "abort" | "error" | None (more to come)


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
    cancel_reason: str | None = None  # "abort" (disconnect) | "stop" (stop string)
    finished: bool = False
