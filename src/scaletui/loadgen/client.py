"""One streamed request over aiohttp, timed with perf_counter; the per-request record.

The hot loop only timestamps and keeps each SSE `data:` line; JSON is parsed afterwards (or by
the 1 s window ticker for requests still in flight), so parsing never delays a timestamp.
Token counts come from the server's `usage` (stream_options.continuous_usage_stats), falling
back to one token per non-empty chunk (flagged `tokens_from_usage = False`). A request that did
not end `ok` also gets a `kind` (KINDS): why, in words a user can act on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from time import perf_counter

import aiohttp
import orjson

# Outcome classes: only "ok" enters the latency statistics.
OUTCOMES = ("ok", "rejected", "http_error", "timeout", "disconnect", "cancelled", "empty")
FAILED = ("http_error", "timeout", "disconnect", "empty")
# Failure kinds, finer than outcomes: what went wrong, for the report's "failures by kind".
KINDS = {
    "connection_refused": "nothing listens on the port (server down?)",
    "connection_reset": "the connection closed or reset before a response",
    "connection_error": "could not connect (DNS, route, TLS, ...)",
    "connect_timeout": "TCP connect took longer than the connect limit",
    "read_timeout": "the server went silent for --read-timeout",
    "timeout": "the request took longer than --timeout",
    "stream_broken": "the connection dropped in the middle of the stream",
    "stream_error": "an error object inside a 200 stream",
    "empty_stream": "200 without a token-carrying chunk",
    "protocol_error": "a response loadgen could not read (bad header, line too long)",
    "http_429": "rejected: the server sheds load (429)",
    "http_4xx": "a client error status (bad request, unknown model, ...)",
    "http_5xx": "a server error status",
    "http_other": "another non-200 status",
}
# Kinds that say the server did not answer at all: they count towards "the server is gone".
CONNECTION_KINDS = frozenset({"connection_refused", "connection_reset", "connection_error"})
_NAN = math.nan


@dataclass(slots=True, eq=False)
class RequestRecord:
    """Timestamps (perf_counter seconds) and counts of one request; serving.md §5.1 symbols."""

    index: int
    t_sched: float  # intended send time
    input_len: int  # prompt tokens asked for
    max_tokens: int
    t_send: float = _NAN  # just before the POST
    t_hdr: float = _NAN  # response headers received
    t_done: float = _NAN  # [DONE], EOF, error or abort
    outcome: str = "pending"
    status: int | None = None
    error: str | None = None
    kind: str | None = None  # a KINDS key when the outcome is not ok (or cancelled)
    chunk_times: list[float] = field(default_factory=list)  # token-carrying chunks only
    chunk_tokens: list[int] = field(default_factory=list)  # n_k: tokens in chunk k
    prompt_tokens: int | None = None  # usage.prompt_tokens
    output_tokens: int = 0  # final usage.completion_tokens, else sum of n_k
    tokens_from_usage: bool = False
    warmup: bool = False
    session: int | None = None  # a conversation's index (its first turn's request index)
    turn: int | None = None  # the turn within it, 0 first
    reply: list[str] | None = field(default=None, repr=False)  # streamed text, when kept
    # raw stream, parsed incrementally; emptied once the request ends
    raw_times: list[float] = field(default_factory=list, repr=False)
    raw_lines: list[bytes] = field(default_factory=list, repr=False)
    cursor: int = field(default=0, repr=False)
    usage_completion: int = field(default=0, repr=False)
    usage_total: int | None = field(default=None, repr=False)

    @property
    def t_first(self) -> float:
        return self.chunk_times[0] if self.chunk_times else _NAN

    @property
    def t_last(self) -> float:
        return self.chunk_times[-1] if self.chunk_times else _NAN

    def to_dict(self) -> dict:
        """JSON-ready record for --save-requests (times relative to nothing: raw seconds)."""
        return {
            "index": self.index,
            "outcome": self.outcome,
            "status": self.status,
            "error": self.error,
            "kind": self.kind,
            "t_sched": self.t_sched,
            "t_send": _num(self.t_send),
            "t_hdr": _num(self.t_hdr),
            "t_first": _num(self.t_first),
            "t_last": _num(self.t_last),
            "t_done": _num(self.t_done),
            "input_len": self.input_len,
            "max_tokens": self.max_tokens,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "tokens_from_usage": self.tokens_from_usage,
            "warmup": self.warmup,  # a --warmup or --ramp-up request: in no statistic
            "session": self.session,
            "turn": self.turn,
            "chunk_times": self.chunk_times,
            "chunk_tokens": self.chunk_tokens,
        }

    @classmethod
    def from_dict(cls, d: dict) -> RequestRecord:
        """A record as to_dict (or --save-requests, with its times shifted) wrote it."""
        rec = cls(d["index"], d["t_sched"], d["input_len"], d["max_tokens"])
        for key in ("t_send", "t_hdr", "t_done"):
            setattr(rec, key, _NAN if d.get(key) is None else d[key])
        for key in _KEPT:
            if key in d:
                setattr(rec, key, d[key])
        rec.chunk_times, rec.chunk_tokens = list(d["chunk_times"]), list(d["chunk_tokens"])
        return rec


_KEPT = ("outcome", "status", "error", "kind", "prompt_tokens", "output_tokens",
         "tokens_from_usage", "warmup", "session", "turn")  # fmt: skip


def _num(x: float) -> float | None:
    return None if math.isnan(x) else x


def parse_pending(rec: RequestRecord) -> list[tuple[float, int]]:
    """Parse the raw lines not parsed yet; return the new (arrival time, tokens) chunks."""
    new: list[tuple[float, int]] = []
    for i in range(rec.cursor, len(rec.raw_lines)):
        payload = rec.raw_lines[i][5:].strip()
        if not payload or payload == b"[DONE]":
            continue
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            continue
        if not isinstance(obj, dict):
            continue
        if "error" in obj and not obj.get("choices"):
            err = obj["error"]
            rec.error = str(err.get("message", err) if isinstance(err, dict) else err)[:300]
            continue
        usage = obj.get("usage")
        choices = obj.get("choices") or []
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            rec.prompt_tokens = usage.get("prompt_tokens", rec.prompt_tokens)
            rec.usage_total = int(usage["completion_tokens"])
        if not choices:  # usage-only chunk: totals, no tokens
            continue
        c = choices[0]
        text = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
        if rec.reply is not None and text:
            rec.reply.append(text)
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            n = rec.usage_total - rec.usage_completion
            rec.usage_completion = rec.usage_total
        else:
            n = 1 if text else 0
        if n > 0:
            t = rec.raw_times[i]
            rec.chunk_times.append(t)
            rec.chunk_tokens.append(n)
            new.append((t, n))
    rec.cursor = len(rec.raw_lines)
    return new


def finish(rec: RequestRecord) -> list[tuple[float, int]]:
    """Parse what is left, settle the token counts and the outcome; drop the raw stream."""
    new = parse_pending(rec)
    counted = sum(rec.chunk_tokens)
    rec.tokens_from_usage = rec.usage_total is not None
    rec.output_tokens = rec.usage_total if rec.usage_total is not None else counted
    if rec.outcome == "pending":
        if rec.error:  # an error object inside a 200 stream
            rec.outcome, rec.kind = "http_error", "stream_error"
        elif rec.chunk_times:
            rec.outcome = "ok"
        else:
            rec.outcome, rec.kind = "empty", "empty_stream"
            rec.error = rec.error or "stream ended without a token-carrying chunk"
    rec.raw_times, rec.raw_lines, rec.cursor = [], [], 0
    return new


def request_body(
    spec_prompt: str | list[int] | list[dict],
    max_tokens: int,
    *,
    model: str,
    api: str,
    ignore_eos: bool,
) -> bytes:
    """A streaming request; on chat a list of {role, content} dicts is the whole history."""
    body: dict = {
        "model": model,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "temperature": 0.0,
    }
    if ignore_eos:
        body["ignore_eos"] = True
        body["min_tokens"] = max_tokens
    if (
        api == "chat"
        and isinstance(spec_prompt, list)
        and spec_prompt
        and isinstance(spec_prompt[0], dict)
    ):
        body["messages"] = spec_prompt
    elif api == "chat":
        body["messages"] = [{"role": "user", "content": spec_prompt}]
    else:
        body["prompt"] = spec_prompt
    return orjson.dumps(body)


def history(said: list[str], api: str) -> str | list[dict]:
    """A conversation so far (user, assistant, user, ... texts) as the prompt of its next turn:
    the message list on chat, the texts joined on completions."""
    if api != "chat":
        return "".join(said)
    return [{"role": ("user", "assistant")[j % 2], "content": t} for j, t in enumerate(said)]


_HEADERS = {"Content-Type": "application/json", "Accept": "text/event-stream"}


async def send(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    rec: RequestRecord,
    *,
    timeout: aiohttp.ClientTimeout,
    cancel_after: int | None = None,
) -> None:
    """POST one streaming request and fill `rec`; never raises except CancelledError."""
    times, lines = rec.raw_times, rec.raw_lines
    try:
        rec.t_send = perf_counter()
        async with session.post(url, data=body, headers=_HEADERS, timeout=timeout) as resp:
            rec.t_hdr = perf_counter()
            rec.status = resp.status
            if resp.status != 200:
                rec.outcome = "rejected" if resp.status == 429 else "http_error"
                rec.kind = status_kind(resp.status)
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            else:
                async for line in resp.content:
                    if line[:5] == b"data:":
                        times.append(perf_counter())
                        lines.append(line)
                        if cancel_after is not None and len(lines) >= cancel_after:
                            rec.outcome = "cancelled"
                            rec.error = f"cancelled after {cancel_after} chunks (--cancel-rate)"
                            resp.close()
                            break
    except TimeoutError as exc:  # aiohttp's connect and read timeouts are TimeoutErrors too
        rec.outcome = "timeout"
        rec.kind, rec.error = _timeout_kind(exc, timeout)
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
        rec.outcome = "disconnect"
        rec.kind = _connection_kind(exc, headers=not math.isnan(rec.t_hdr))
        rec.error = f"{rec.kind.replace('_', ' ')}: {type(exc).__name__}: {exc}"[:300]
    except (aiohttp.ClientError, ValueError) as exc:  # ValueError: an SSE line over the buffer
        rec.outcome, rec.kind = "http_error", "protocol_error"
        rec.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        rec.t_done = perf_counter()


def status_kind(status: int) -> str:
    if status == 429:
        return "http_429"
    if 400 <= status < 500:
        return "http_4xx"
    return "http_5xx" if 500 <= status < 600 else "http_other"


def _timeout_kind(exc: TimeoutError, timeout: aiohttp.ClientTimeout) -> tuple[str, str]:
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return "connect_timeout", f"no TCP connection within {timeout.sock_connect:g} s"
    if isinstance(exc, aiohttp.SocketTimeoutError):
        return "read_timeout", f"the server sent nothing for {timeout.sock_read:g} s"
    return "timeout", f"no complete answer within the {timeout.total:g} s request timeout"


def _connection_kind(exc: Exception, *, headers: bool) -> str:
    if headers or isinstance(exc, aiohttp.ClientPayloadError):
        return "stream_broken"
    if isinstance(exc, aiohttp.ClientConnectorError):
        err = exc.os_error  # "Multiple exceptions: ..." when every address of a name refused
        refused = isinstance(err, ConnectionRefusedError) or "refused" in str(err).lower()
        return "connection_refused" if refused else "connection_error"
    return "connection_reset"  # ServerDisconnectedError, ECONNRESET, EPIPE before the headers


async def get_json(session: aiohttp.ClientSession, url: str, timeout: float = 5.0) -> dict | None:
    """GET a JSON document; None on 404 or anything not JSON (connection errors propagate)."""
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
        if resp.status != 200:
            return None
        try:
            return orjson.loads(await resp.read())
        except orjson.JSONDecodeError:
            return None
