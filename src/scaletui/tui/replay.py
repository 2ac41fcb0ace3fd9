"""Record and replay: the JSONL event stream the TUI ingests (live or from a file).

One line per event: {"t": seconds since the session started (UI arrival time, used only to pace a
replay, never as a measurement), "kind": "stats" | "window" | "summary" | "event" | "config",
"data": {...}}. `--record DIR` writes the stream; `--replay FILE` feeds it back, so every panel can
be developed and tested on a machine with no server at all.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import orjson

from scaletui.records import Record, RecordKind

KINDS = tuple(k.value for k in RecordKind)


def to_json(rec: Record) -> bytes:
    return orjson.dumps({"t": round(rec.t, 3), "kind": rec.kind, "data": rec.data})


def parse_line(line: str | bytes, where: str = "replay") -> Record:
    """One JSONL line -> Record; bad lines fail naming the place and what was expected."""
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc})") from exc
    if not isinstance(obj, dict) or obj.get("kind") not in KINDS:
        raise ValueError(f"{where}: expected an object with kind in {KINDS}, got {obj!r:.120}")
    if not isinstance(obj.get("data"), dict):
        raise ValueError(f"{where}: expected 'data' to be an object")
    return Record(float(obj.get("t", 0.0)), RecordKind(obj["kind"]), obj["data"])


def read_replay(path: str | Path) -> list[Record]:
    """All records of a replay file, in file order."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"replay file {path} does not exist")
    records = []
    for n, line in enumerate(path.read_bytes().splitlines(), 1):
        if line.strip():
            records.append(parse_line(line, f"{path}:{n}"))
    return records


class ReplaySource:
    """Feeds recorded events; `speed=0` yields them all at once (tests), 1.0 in recorded time."""

    def __init__(self, records: Iterable[Record], speed: float = 0.0) -> None:
        self.records = list(records)
        self.speed = speed

    async def __aiter__(self) -> AsyncIterator[Record]:
        start = time.monotonic()
        for rec in self.records:
            if self.speed > 0:
                delay = rec.t / self.speed - (time.monotonic() - start)
                if delay > 0:
                    await asyncio.sleep(delay)
            yield rec


class Recorder:
    """Appends every ingested record to DIR/session-<stamp>.jsonl."""

    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.path = folder / f"session-{stamp}.jsonl"
        self._file = self.path.open("ab")

    def write(self, rec: Record) -> None:
        self._file.write(to_json(rec) + b"\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
