"""Streaming answers: token ids -> text (stop strings held back), OpenAI chunk/response objects,
and the SSE writer, over a request's typed events (`events.Tokens` / `events.Failed`).

A `Failed` event becomes the ApiError its kind maps to (errors.http_error); a client that
went away raises ConnectionResetError, which the caller turns into a cancel. Logprobs ride in
the chunk of the tokens they belong to (logprobs.py writes them); an echoed prompt (its text,
and its logprobs when asked) comes first, with the first token's event.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable

import orjson
from aiohttp import web

from scaletui.serve.http.errors import ApiError, http_error
from scaletui.serve.http.logprobs import LogprobWriter
from scaletui.serve.http.tokenizer import Tokenizer
from scaletui.serve.http.validate import Generation
from scaletui.serve.scheduling.events import Failed, Request, Tokens


class TextStream:
    """Token ids -> text pieces; holds back partial UTF-8 and text that may begin a stop string.

    Only the unsent tail is kept and searched (at most the hold-back plus one token's text), so
    a long generation costs O(tokens), not O(tokens * text length).
    """

    def __init__(self, tok: Tokenizer, stop: tuple[str, ...]) -> None:
        self.decoder, self.stop = tok.decoder(), stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.tail, self.pieces, self.tokens, self.stopped = "", [], 0, False

    @property
    def text(self) -> str:
        """All text so far: what was sent plus what is held back."""
        return "".join(self.pieces) + self.tail

    def push(self, token_id: int) -> str:
        self.tokens += 1
        self.tail += self.decoder.push(token_id)
        if self.stop:  # a stop string can only start in the unsent tail
            hits = [i for s in self.stop if (i := self.tail.find(s)) >= 0]
            if hits:
                self.tail, self.stopped = self.tail[: min(hits)], True
                return self._take(len(self.tail))
        return self._take(len(self.tail) - self.hold)

    def flush(self) -> str:
        if not self.stopped:
            self.tail += self.decoder.flush()
        return self._take(len(self.tail))

    def _take(self, end: int) -> str:
        piece = self.tail[: max(0, end)]
        if piece:
            self.tail = self.tail[len(piece) :]
            self.pieces.append(piece)
        return piece


async def token_events(request: web.Request, req: Request) -> AsyncIterator[Tokens]:
    """The request's token bursts up to its last; raises the ApiError of a `Failed` event, or
    ConnectionResetError when the client went away."""
    while True:
        if req.events.empty():
            try:
                async with asyncio.timeout(0.5):
                    event = await req.events.get()
            except TimeoutError:
                if request.transport is None or request.transport.is_closing():
                    raise ConnectionResetError("client disconnected") from None
                continue
        else:
            event = req.events.get_nowait()
        if isinstance(event, Failed):
            raise http_error(event.kind, event.message)
        yield event
        if event.finish:
            return


def usage_of(req: Request, completion: int) -> dict:
    prompt = len(req.prompt)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


class Shape:
    """OpenAI object names and per-choice fields for completions vs chat."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat, self.model = chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def chunk(
        self,
        piece: str | None,
        finish: str | None,
        usage: dict | None,
        first: bool = False,
        logprobs: dict | None = None,
    ) -> bytes:
        lp = logprobs
        if piece is None:
            choices = []
        elif self.chat:
            delta = {"content": piece} if piece or not finish else {}
            if first:
                delta = {"role": "assistant", "content": piece}
            choices = [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}]
        else:
            choices = [{"index": 0, "text": piece, "logprobs": lp, "finish_reason": finish}]
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            body["usage"] = usage
        return b"data: " + orjson.dumps(body) + b"\n\n"

    def full(self, text: str, finish: str, usage: dict, logprobs: dict | None = None) -> dict:
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": finish,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        obj = "chat.completion" if self.chat else "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage,
        }


class Answer:
    """What one request's token events become for its client: text (`TextStream`, cut at a
    stop string), logprobs (`LogprobWriter`, when asked) and the echoed prompt."""

    def __init__(self, tok: Tokenizer, gen: Generation, chat: bool) -> None:
        self.text = TextStream(tok, gen.stop)
        self.writer = LogprobWriter(tok, chat) if gen.params.logprobs is not None else None
        self.echo = tok.decode(gen.prompt) if gen.echo else None
        self.prompt = gen.prompt

    def echoed(self, event: Tokens) -> tuple[str, dict | None] | None:
        """(prompt text, its logprobs) for the first event of an echoing request, else None."""
        if self.echo is None:
            return None
        text, self.echo = self.echo, None
        lps = event.prompt_logprobs
        if self.writer is None or lps is None:
            return text, None
        return text, self.writer.add(self.prompt, lps)

    def take(self, event: Tokens) -> tuple[str, str | None, dict | None]:
        """(text piece, finish, logprobs) of one event: its tokens up to a stop string (the
        stop wins over the event's finish), the text flushed at the end."""
        pieces, n = [], 0
        for t in event.ids:
            pieces.append(self.text.push(t))
            n += 1
            if self.text.stopped:
                break
        end = "stop" if self.text.stopped else event.finish
        if end:
            pieces.append(self.text.flush())
        lps = None
        if self.writer is not None and event.logprobs is not None and n:
            lps = self.writer.add(event.ids[:n], event.logprobs[:n])
        return "".join(pieces), end, lps


async def collect(
    request: web.Request,
    req: Request,
    answer: Answer,
    shape: Shape,
    cancel: Callable[[Request, str], None],
) -> dict:
    """The non-streamed answer: every event's text and logprobs, joined."""
    pieces, finish = [], "length"
    async for event in token_events(request, req):
        if (echo := answer.echoed(event)) is not None:
            pieces.append(echo[0])
        piece, end, _ = answer.take(event)
        pieces.append(piece)
        finish = end or finish
        if answer.text.stopped:
            cancel(req, "stop")
            break
    lps = None if answer.writer is None else answer.writer.total()
    return shape.full("".join(pieces), finish, usage_of(req, answer.text.tokens), lps)


async def stream(
    request: web.Request,
    req: Request,
    gen: Generation,
    answer: Answer,
    shape: Shape,
    cancel: Callable[[Request, str], None],
) -> web.StreamResponse:
    """Answer with SSE: one event per token burst, usage as asked, then `data: [DONE]`."""
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    usage_each, text = gen.continuous_usage, answer.text
    try:
        if shape.chat:
            await resp.write(shape.chunk("", None, usage_of(req, 0) if usage_each else None, True))
        async for event in token_events(request, req):
            if (echo := answer.echoed(event)) is not None:  # before the first token's chunk
                counts = usage_of(req, 0) if usage_each else None
                await resp.write(shape.chunk(echo[0], None, counts, logprobs=echo[1]))
            # One SSE event per burst (the decode_steps tokens of one host sync): the tokens
            # arrive together, and the usage delta tells a client how many the event carries,
            # so per-token latency is the burst's gap spread over its tokens, not 0, 0, 0, gap.
            piece, end, lps = answer.take(event)
            counts = usage_of(req, text.tokens) if usage_each and event.ids else None
            if event.ids or end:
                await resp.write(shape.chunk(piece, end, counts, logprobs=lps))
            if text.stopped:
                cancel(req, "stop")
                break
        if gen.include_usage:
            await resp.write(shape.chunk(None, None, usage_of(req, text.tokens)))
        await resp.write(b"data: [DONE]\n\n")
    except ApiError as e:  # the server aborted the request mid-stream
        with contextlib.suppress(ConnectionResetError):
            await resp.write(b"data: " + orjson.dumps(e.body()) + b"\n\ndata: [DONE]\n\n")
    except ConnectionResetError:
        cancel(req, "abort")
    return resp
