"""Trace replay: read a trace file, check every row, and turn it into the request stream.

Three formats, told apart by the file:
- Mooncake JSONL (rows with `hash_ids`): `timestamp` ms, `input_length`, `output_length`,
  `hash_ids` (one per block of `trace_block` tokens; equal ids get equal text, so prefixes
  that a trace shares are shared on the wire too);
- BurstGPT CSV (`.csv`): `Timestamp` s, `Request tokens`, `Response tokens`;
- plain JSONL: `prompt` (text) or `input_length`; optional `output_length`, `timestamp` ms,
  `session_id` (rows with the same id are the turns of one conversation, in file order) and
  `delay` ms (a later turn: after the previous reply; a first row without `timestamp`: after
  the previous row's start).
Times are relative to the first row and divided by `trace_speedup`. A bad row is a ValueError
naming the file, line and field, raised before any request is sent (cli preflight).
"""

from __future__ import annotations

import csv
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson

from scaletui.loadgen.request_spec import RequestSpec, Turn, random_text
from scaletui.loadgen.tokens import TokenCounter, filler, fit, load_counter

BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")
MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


@dataclass(frozen=True)
class TraceRow:
    """One row, checked; None where the format leaves a field out."""

    line: int
    t_ms: float | None  # absolute send time
    input_len: int | None  # tokens asked for (None: `prompt` sets it)
    prompt: str | None
    output_len: int | None
    hash_ids: tuple[int, ...] = ()
    session_id: str | None = None
    delay_ms: float = 0.0


def _bad(path: Path, line: int, field: str, why: str) -> ValueError:
    return ValueError(f"{path}:{line}: field '{field}': {why}")


def _number(path: Path, line: int, row: dict, field: str, *, integer: bool, need: bool):
    value = row.get(field)
    if value is None or value == "":
        if need:
            raise _bad(path, line, field, "missing")
        return None
    try:
        number = float(value) if isinstance(value, str) else value
        if isinstance(number, bool) or not isinstance(number, int | float):
            raise TypeError
    except (TypeError, ValueError):
        raise _bad(path, line, field, f"must be a number, got {value!r}") from None
    if not math.isfinite(number) or number < 0 or (integer and number != int(number)):
        kind = "a whole number >= 0" if integer else "a finite number >= 0"
        raise _bad(path, line, field, f"must be {kind}, got {value!r}")
    return int(number) if integer else float(number)


def _jsonl_rows(path: Path) -> list[TraceRow]:
    rows: list[TraceRow] = []
    mooncake = None
    for line, raw in enumerate(path.read_bytes().splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"{path}:{line}: not a JSON object: {exc}") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{line}: not a JSON object: {raw[:80]!r}")
        if mooncake is None:
            mooncake = "hash_ids" in obj
        num = functools.partial(_number, path, line, obj)
        if mooncake:
            for field in MOONCAKE_FIELDS:
                if field not in obj:
                    raise _bad(
                        path,
                        line,
                        field,
                        f"missing (a Mooncake row needs all of {', '.join(MOONCAKE_FIELDS)})",
                    )
        hash_ids = obj.get("hash_ids", [])
        if not isinstance(hash_ids, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) for h in hash_ids
        ):
            raise _bad(path, line, "hash_ids", f"must be a list of integers, got {hash_ids!r}")
        prompt = obj.get("prompt")
        if prompt is not None and (not isinstance(prompt, str) or not prompt):
            raise _bad(path, line, "prompt", f"must be a non-empty string, got {prompt!r}")
        input_len = num("input_length", integer=True, need=prompt is None)
        if input_len == 0:
            raise _bad(path, line, "input_length", "must be >= 1, got 0")
        session = obj.get("session_id")
        rows.append(
            TraceRow(
                line,
                num("timestamp", integer=False, need=False),
                input_len if prompt is None else None,
                prompt,
                num("output_length", integer=True, need=False),
                tuple(hash_ids),
                None if session is None else str(session),
                num("delay", integer=False, need=False) or 0.0,
            )
        )
    return rows


def _burstgpt_rows(path: Path) -> list[TraceRow]:
    rows = []
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in BURSTGPT_COLUMNS if c not in (reader.fieldnames or ())]
        if missing:
            raise _bad(path, 1, missing[0], f"no such column (BurstGPT needs {BURSTGPT_COLUMNS})")
        for row in reader:
            line = reader.line_num
            num = functools.partial(_number, path, line, row, integer=True, need=True)
            t = _number(path, line, row, "Timestamp", integer=False, need=True)
            # BurstGPT logs failed requests with 0 response tokens: ask for one
            rows.append(
                TraceRow(
                    line,
                    t * 1e3,
                    max(1, num("Request tokens")),
                    None,
                    max(1, num("Response tokens")),
                )
            )
    return rows


@functools.lru_cache(maxsize=8)
def load_trace(path: str) -> tuple[TraceRow, ...]:
    """Every row of a trace file, checked (ValueError: file, line, field)."""
    file = Path(path).expanduser()
    try:
        rows = _burstgpt_rows(file) if file.suffix == ".csv" else _jsonl_rows(file)
    except OSError as exc:
        raise ValueError(f"cannot read trace {path}: {exc}") from None
    if not rows:
        raise ValueError(f"trace {path} has no rows")
    last: TraceRow | None = None
    for row in rows:
        if row.t_ms is None:
            continue
        if last is not None and row.t_ms < last.t_ms:
            raise _bad(
                file,
                row.line,
                "timestamp" if file.suffix != ".csv" else "Timestamp",
                f"{row.t_ms:g} ms is before line {last.line}'s {last.t_ms:g} ms "
                "(rows must be in time order)",
            )
        last = row
    return tuple(rows)


def trace_size(path: str) -> int:
    """Requests a trace starts: its single rows plus one per conversation."""
    rows = load_trace(path)
    return sum(r.session_id is None for r in rows) + len({r.session_id for r in rows} - {None})


@dataclass(frozen=True)
class TraceOptions:
    """What a replay takes from its workload: the trace, the seed, the block size of
    `hash_ids`, the time scale, the tokenizer (exact lengths) and the output-length sampler
    for rows without one."""

    trace: str
    seed: int
    trace_block: int
    trace_speedup: float
    tokenizer: str | None
    chars_per_token: float
    sample_output: Callable[[np.random.Generator], int]


class _Prompts:
    """Prompt text of a row: exact with a counter, else one character per token."""

    def __init__(self, w: TraceOptions, make: bool) -> None:
        self.w, self.make = w, make
        self.counter: TokenCounter | None = load_counter(w.tokenizer) if w.tokenizer else None
        self._blocks: dict[int, str] = {}

    def block(self, hash_id: int) -> str:
        """The text of a hash id: `trace_block` tokens (special tokens aside), the same for
        every row that names it."""
        if hash_id not in self._blocks:
            rng = np.random.default_rng([self.w.seed, 7, hash_id & (2**63 - 1)])
            n, c = self.w.trace_block, self.counter
            if c is None:
                text = random_text(rng, n)
            else:
                text = fit(c, rng, filler(c, rng, n), n + c.count(""))
            self._blocks[hash_id] = text
        return self._blocks[hash_id]

    def of(self, row: TraceRow, rng: np.random.Generator) -> tuple[str, int]:
        """(prompt, intended tokens)."""
        if row.prompt is not None:
            n = (
                self.counter.count(row.prompt)
                if self.counter
                else max(1, round(len(row.prompt) / self.w.chars_per_token))
            )
            return row.prompt, n
        n = row.input_len
        if not self.make:
            return "", n
        need = -(-n // self.w.trace_block)
        ids = list(row.hash_ids[:need])
        blocks = [self.block(h) for h in ids]
        while len(blocks) < need:  # blocks the row did not name: its own text
            blocks.append(
                random_text(rng, self.w.trace_block)
                if self.counter is None
                else filler(self.counter, rng, self.w.trace_block)
            )
        shared = "".join(blocks[:-1])
        text = shared + blocks[-1]
        if self.counter is None:
            return text[:n], n
        return fit(self.counter, rng, text, n, keep=len(shared)), n


def trace_requests(w: TraceOptions, prompts: bool = True) -> Iterator[RequestSpec]:
    """The trace's requests in send order; a conversation is its first row with the rest as
    later turns."""
    rows = load_trace(w.trace)
    make = _Prompts(w, prompts)
    rng_len = np.random.default_rng([w.seed, 2])
    rng = np.random.default_rng([w.seed, 3])
    t_first = next((r.t_ms for r in rows if r.t_ms is not None), 0.0)
    sessions: dict[str, list[TraceRow]] = {}
    starts: list[TraceRow] = []
    for r in rows:
        if r.session_id is not None and r.session_id in sessions:
            sessions[r.session_id].append(r)
            continue
        if r.session_id is not None:
            sessions[r.session_id] = [r]
        starts.append(r)
    offset_ms = 0.0
    for i, r in enumerate(starts):
        offset_ms = r.t_ms - t_first if r.t_ms is not None else offset_ms + r.delay_ms
        prompt, n = make.of(r, rng)
        out = r.output_len or w.sample_output(rng_len)
        later = ()
        if r.session_id is not None:
            later = tuple(
                Turn(
                    *make.of(t, rng),
                    t.output_len or w.sample_output(rng_len),
                    t.delay_ms / 1e3 / w.trace_speedup,
                )
                for t in sessions[r.session_id][1:]
            )
        yield RequestSpec(
            i,
            offset_ms / 1e3 / w.trace_speedup,
            prompt,
            n,
            max(1, out),
            conversation=r.session_id is not None,
            later=later,
        )
