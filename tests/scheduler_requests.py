"""Requests for the scheduler tests: a greedy request and the reading of its events."""

from __future__ import annotations

import asyncio

from scaletui.serve.engine.engine_api import SamplingParams
from scaletui.serve.scheduling.events import Failed, Request


async def collect(req: Request) -> tuple[list[int], str]:
    ids: list[int] = []
    while True:
        event = await asyncio.wait_for(req.events.get(), 30)
        if isinstance(event, Failed):
            return ids, "error: " + event.message
        ids += event.ids
        if event.finish:
            return ids, event.finish


def request(prompt: list[int], **params) -> Request:
    return Request(prompt, SamplingParams(temperature=0.0, **params), asyncio.get_running_loop())
