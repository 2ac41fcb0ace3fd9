"""Reading what `loadgen report` is given: loadgen's result JSON (--out), `scaletui simulate`'s
summary JSON (the same keys, `config.simulated` true) and per-request JSONL (--save-requests:
each run's `"type": "run"` header line, shard.header, then its records; files written before
the header have records only). A file that is none of these raises InputError naming the file
and what was expected.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson

from scaletui.latency import tpot_s

RESULT = "a loadgen result (--out's JSON: a summary with 'completed' and latency keys, or "
RESULT += "{'stages': [summary, ...]} for a sweep)"
RECORD_KEYS = ("outcome", "t_send", "t_first", "t_last", "output_tokens")
RECORDS = (
    f"per-request JSONL from --save-requests (each line an object with {', '.join(RECORD_KEYS)})"
)


class InputError(ValueError):
    """A report input that cannot be read as what it was given as."""


@dataclass(frozen=True)
class Result:
    """One result file: its stages (one for a single run) and what the report shows of it."""

    path: str
    name: str  # legend name, from the file name
    stages: list[dict]  # loadgen summaries, in stage order
    simulated: bool  # written by `scaletui simulate`
    command: list[str] | None  # argv of the run; None where the file predates it
    max_rate: float | None  # an SLO search's answer, where the file has one


@dataclass(frozen=True)
class Samples:
    """Per-request latencies (ms) of one stage's ok requests: one CDF line."""

    name: str
    ttft_ms: np.ndarray
    tpot_ms: np.ndarray  # requests with more than one output token


def _is_summary(obj: object) -> bool:
    return isinstance(obj, dict) and "completed" in obj and "median_ttft_ms" in obj


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read it ({exc.strerror})") from None


def load_result(path: str, name: str | None = None) -> Result:
    data = _read(path)
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        first = data.split(b"\n", 1)[0]
        hint = ""
        try:
            line = orjson.loads(first)
        except orjson.JSONDecodeError:
            line = None
        if isinstance(line, dict) and ("outcome" in line or line.get("type") == "run"):
            hint = "; it looks like --save-requests' JSONL: give it with --requests"
        elif isinstance(line, dict) and "type" in line:
            hint = "; it looks like --jsonl's live stream: give the --out file"
        raise InputError(f"{path}: not one JSON document, expected {RESULT}{hint}") from None
    if isinstance(obj, dict) and "stages" in obj:
        stages = obj["stages"]
        bad = (
            [i for i, s in enumerate(stages) if not _is_summary(s)]
            if isinstance(stages, list)
            else [0]
        )
        if bad or not stages:
            raise InputError(
                f"{path}: 'stages' entry {bad[0] if bad else 0} is not a summary, expected {RESULT}"
            )
    elif _is_summary(obj):
        stages = [obj]
    else:
        raise InputError(f"{path}: not {RESULT}")
    command = obj.get("command") or stages[0].get("command")
    search = obj.get("search") if isinstance(obj.get("search"), dict) else {}
    max_rate = obj.get("max_rate", search.get("max_rate"))
    if max_rate is not None and not isinstance(max_rate, int | float):
        raise InputError(f"{path}: max_rate must be a number of req/s, got {max_rate!r}")
    return Result(
        path=path,
        name=name or Path(path).stem,
        stages=stages,
        simulated=bool((stages[0].get("config") or {}).get("simulated")),
        command=command if isinstance(command, list) else None,
        max_rate=max_rate,
    )


def merge_predicted(results: Sequence[Result]) -> Result:
    """simulate's files (one rate each) as one predicted curve, its stages by offered rate;
    each stage keeps its own command."""
    stages = [s for r in results for s in r.stages]
    stages.sort(key=lambda s: s.get("requested_rate") or 0.0)
    path = ", ".join(r.path for r in results)
    return Result(path, "predicted", stages, simulated=True, command=None, max_rate=None)


@dataclass(frozen=True)
class Block:
    """One run's part of a --save-requests file: its header (None in a file that predates
    headers) and its records."""

    path: str
    header: dict | None
    records: list[dict]


def load_blocks(path: str) -> list[Block]:
    """The runs of a --save-requests file, in file order, checked line by line."""
    blocks: list[Block] = []
    for n, line in enumerate(_read(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = orjson.loads(line)
        except orjson.JSONDecodeError:
            raise InputError(f"{path}:{n}: not JSON, expected {RECORDS}") from None
        if isinstance(rec, dict) and rec.get("type") == "run":
            blocks.append(Block(path, rec, []))
            continue
        missing = [k for k in RECORD_KEYS if not isinstance(rec, dict) or k not in rec]
        if missing:
            raise InputError(f"{path}:{n}: no {missing[0]!r}, expected {RECORDS}")
        if not blocks:
            blocks.append(Block(path, None, []))
        blocks[-1].records.append(rec)
    if not blocks:
        raise InputError(f"{path}: empty, expected {RECORDS}")
    return blocks


def load_requests(path: str) -> list[dict]:
    """The records of a --save-requests file (every stage and run)."""
    records = [r for b in load_blocks(path) for r in b.records]
    if not records:
        raise InputError(f"{path}: no request in it, expected {RECORDS}")
    return records


def samples(
    records: Sequence[dict], name: str, rates: Sequence[float | None] = ()
) -> list[Samples]:
    """One Samples per stage of a per-request file: TTFT = t_first - t_send and TPOT as the
    summary computes them (latency.tpot_s), ok requests only. `rates`: the stages' offered
    rates, for the names, where the matching result file is known."""
    by_stage: dict[int, list[dict]] = {}
    for r in records:
        if r["outcome"] == "ok" and not r.get("warmup"):
            by_stage.setdefault(int(r.get("stage") or 0), []).append(r)
    out = []
    for stage, recs in sorted(by_stage.items()):
        send = np.array([r["t_send"] for r in recs], dtype=float)
        ttft = np.array([r["t_first"] for r in recs], dtype=float) - send
        e2el = np.array([r["t_last"] for r in recs], dtype=float) - send
        n_out = np.array([r["output_tokens"] for r in recs], dtype=float)
        tpot = tpot_s(ttft, e2el, n_out)[n_out > 1]
        label = name
        if len(by_stage) > 1 or stage:
            rate = rates[stage] if stage < len(rates) else None
            label += f" stage {stage}" + (f" ({rate:g} req/s)" if rate else "")
        out.append(Samples(label, ttft * 1e3, tpot * 1e3))
    return out


def legend_names(paths: Sequence[str]) -> list[str]:
    """File stems; where two are equal, with their parent folder in front."""
    stems = [Path(p).stem for p in paths]
    return [
        f"{Path(p).parent.name}/{s}" if stems.count(s) > 1 else s
        for p, s in zip(paths, stems, strict=True)
    ]


def flatten(obj: dict, prefix: str = "") -> dict[str, object]:
    """Nested dicts as dotted names: {"a": {"b": 1}} -> {"a.b": 1}."""
    out: dict[str, object] = {}
    for key, value in obj.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out
