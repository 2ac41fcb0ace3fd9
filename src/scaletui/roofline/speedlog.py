"""The server's speed against its fit, kept across runs: the band's horizon (roofline/band.py).

A calibration's spread is the host over its window (20-30 s), but a run lands minutes to hours
after the fit it is priced by, and a shared host drifts over that horizon by more than it moves
within a window (docs/roofline.md, "The band's horizon"). So a server priced by a fit appends
its speed factor (measured / predicted seconds of its engine calls) per step kind every BLOCK_S
of calls to a log beside the stored fit of its configuration, and a band reads the recent
blocks back as a spread of its own (`drift_spread`): what the fit was off by when it was used.

One JSON object per line: {"t": unix seconds, "kind": decode | prefill, "factor", "calls",
"seconds", "engine"}; `engine` names what made the fit (`engine_id`) so a block measured
against another engine (a kernels change, another JAX) is not read back. The file is trimmed
to its last KEEP blocks when it reaches twice that.
"""

from __future__ import annotations

import time
from pathlib import Path

import orjson

from scaletui.roofline.band import SpeedSpread, Spread
from scaletui.roofline.costmodel import CostModel
from scaletui.roofline.fitstore import fit_path

__all__ = [
    "BLOCK_S",
    "append",
    "drift_spread",
    "engine_id",
    "log_path",
    "read_blocks",
    "spread_of",
]

BLOCK_S = 30.0  # a block closes at the first call this long after its first call
MIN_BLOCK_CALLS = 8  # fewer calls in a block: not logged (too few to be a speed)
KEEP = 400  # blocks kept in a log
MAX_AGE_S = 7 * 86400.0  # older blocks are not read back
# the most recent blocks of a kind that make its spread: all the file keeps. 60 (half an hour
# of serving) forgot swings the host made between runs 40 minutes apart (0.66x-1.23x of a fresh
# fit), and held-out bands covered 35 of 48 figures where every kept block covered 40
# (docs/roofline.md, "As run in time, over draws")
LAST = KEEP
MIN_BLOCKS = 5  # fewer blocks of a kind: no drift spread for it
KINDS = ("decode", "prefill")


def log_path(cost: CostModel) -> Path:
    """Beside the fit file of `cost`'s configuration on this host, wherever `cost` was read
    from (a --fit FILE prices the same server): `<fit>.speeds.jsonl`."""
    fit = fit_path(cost.model, cost.dtype, cost.kernels, cost.tp, cost.dp,
                   weight_dtype=cost.weight_dtype, kv_dtype=cost.kv_dtype)  # fmt: skip
    return fit.with_name(fit.stem + ".speeds.jsonl")


def engine_id(cost: CostModel) -> str:
    """What made the fit: its fit version, JAX and jaxlib, the native kernels' source."""
    info = cost.info or {}
    versions = info.get("versions") or {}
    parts = [f"v{info.get('fit_version', 0)}"]
    parts += [f"{k} {versions[k]}" for k in sorted(versions)] if isinstance(versions, dict) else []
    if info.get("kernels_source"):
        parts.append(f"kernels {info['kernels_source']}")
    return ", ".join(parts)


def append(path: Path, kind: str, seconds: float, predicted: float, calls: int, engine: str,
           now: float | None = None) -> None:  # fmt: skip
    """One closed block: `calls` calls of `kind` that took `seconds` where the fit said
    `predicted`. OSError (an unwritable config dir) is the caller's to report."""
    if kind not in KINDS or predicted <= 0 or calls < MIN_BLOCK_CALLS:
        return
    record = {"t": time.time() if now is None else now, "kind": kind,
              "factor": seconds / predicted, "calls": calls, "seconds": seconds,
              "engine": engine}  # fmt: skip
    line = orjson.dumps(record) + b"\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("ab") as f:
        f.write(line)
    if path.stat().st_size > 2 * KEEP * len(line):  # about twice KEEP lines: count and trim
        lines = path.read_bytes().splitlines()
        if len(lines) > 2 * KEEP:
            path.write_bytes(b"\n".join(lines[-KEEP:]) + b"\n")


def read_blocks(path: Path) -> list[dict]:
    """The log's blocks, oldest first; a line that is not a block is skipped (a log cut short
    by a crash mid-write stays readable)."""
    try:
        lines = path.read_bytes().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            rec = orjson.loads(line)
            if rec["kind"] in KINDS and float(rec["factor"]) > 0 and float(rec["t"]) >= 0:
                out.append(rec)
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
    return out


def drift_spread(cost: CostModel, now: float | None = None, path: Path | None = None) -> dict:
    """{kind: Spread dict} of the speed factors the server logged against fits of this engine
    in the last MAX_AGE_S, its LAST most recent blocks per kind (a kind with fewer than
    MIN_BLOCKS is left out), with `hours` (the span they cover); {} when there are none."""
    now = time.time() if now is None else now
    engine = engine_id(cost)
    recent = [b for b in read_blocks(path or log_path(cost))
              if b.get("engine") == engine and now - MAX_AGE_S <= float(b["t"]) <= now]  # fmt: skip
    out: dict = {}
    for kind in KINDS:
        mine = [b for b in recent if b["kind"] == kind][-LAST:]
        if len(mine) >= MIN_BLOCKS:
            out[kind] = Spread.of([float(b["factor"]) for b in mine]).to_dict()
            out[kind]["hours"] = (now - float(mine[0]["t"])) / 3600
    return out


def spread_of(host: dict | None, cost: CostModel) -> SpeedSpread:
    """The band's spread for `cost`: the host's measured one (a spec's `measured.spread`; None
    when it has none) with, for a fitted model, its residuals and the server's past runs
    against it (an assumed model has neither). ValueError for a malformed spread."""
    fitted = cost.source == "fit"
    residuals = cost.info.get("residual_spread") if fitted else None
    return SpeedSpread.measured(host, residuals, drift_spread(cost) if fitted else None)
