"""For the TUI tests that run a real server: a renderable's text, and waiting on a condition."""

from __future__ import annotations

import asyncio
import io

from rich.console import Console


def text_of(renderable) -> str:
    console = Console(width=100, record=True, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


async def wait_for(predicate, seconds: float) -> bool:
    for _ in range(int(seconds / 0.25)):
        if predicate():
            return True
        await asyncio.sleep(0.25)
    return predicate()
