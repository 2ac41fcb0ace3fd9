"""The server's own speed against its engine fit (docs/serve.md, "Metrics"): each prefill and
generate call priced by the stored fit for this shape on this host, with the simulator's own
pricing (`roofline.callcost.CallCosts`), so measured / predicted is the speed factor
`simulate_at` takes to replay a run "as run".

1. `find_speed_model` picks the fit (`--fit auto`: the stored one for the shape and the
   kernels that run, `fitstore.find_fit_for`; a path; `none`) and says why there is none.
2. The workers ask it for each call's predicted seconds (`generate_s`, `prefill_s`, `piece_s`):
   the fit's expected time times the mean of its fitted `call_spread`, what the simulator
   charges a call on average (each call's time is the expected one times a draw from it).
3. `SpeedWindow` keeps the last WINDOW_CALLS calls' sums per kind: the factor /stats shows;
   and every `speedlog.BLOCK_S` of calls it appends the block's factor to the fit's speed log
   (roofline/speedlog.py), the past runs a band's horizon is read from.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from scaletui.roofline import speedlog
from scaletui.roofline.callcost import CallCosts
from scaletui.roofline.fitstore import find_fit_for, load_fit, stored_fits_for
from scaletui.shape import KERNELS, ServerShape

log = logging.getLogger(__name__)

KINDS = ("decode", "prefill")  # decode: generate calls; prefill: prefill calls (pieces)
WINDOW_CALLS = 256  # the factor /stats and the speed_factor gauge show: the last N calls


@dataclass(frozen=True, eq=False)
class SpeedModel:
    """Each engine call's predicted seconds by a fit, or why there is none (`costs` None)."""

    costs: CallCosts | None = None
    fit: str | None = None  # the fit file
    reason: str | None = None  # why no fit prices the calls
    draw: float = 1.0  # the mean of the fit's call_spread (1: none fitted)
    log: Path | None = None  # where the factor's blocks go (speedlog.log_path of the fit)
    engine: str = ""  # what made the fit (speedlog.engine_id), with each block

    def generate_s(self, steps: int, lengths: list[int]) -> float | None:
        if self.costs is None or not lengths:
            return None
        return self.costs.generate_s(steps, lengths) * self.draw

    def prefill_s(self, n: int, cached: int = 0) -> float | None:
        return None if self.costs is None else self.costs.prefill_s(n, cached) * self.draw

    def piece_s(self, start: int, stop: int) -> float | None:
        return None if self.costs is None else self.costs.piece_s(start, stop) * self.draw

    def mixed_s(self, pieces: Sequence[tuple[int, int]]) -> float | None:
        """What prompt pieces add to the generate call they ride in (`CallCosts.mixed_s`)."""
        return None if self.costs is None else self.costs.mixed_s(pieces) * self.draw


def find_speed_model(
    shape: ServerShape, fit: str = "auto", kernels: str | None = None
) -> SpeedModel:
    """The fit `fit` names for `shape` (auto | none | a YAML path), the kernels the generate
    engine runs (`kernels`, when it is one of the shape's choices) standing in for auto.
    ValueError for a path that is not a cost model."""
    if fit == "none":
        return SpeedModel(reason="--fit none")
    if fit != "auto":
        cost = load_fit(fit)  # ValueError naming the file
        mine = shape.fit_key()
        theirs = {"model": cost.model, "tp": cost.tp, "dp": cost.dp, "dtype": cost.dtype}
        if any(mine[k] != v for k, v in theirs.items()):
            raise ValueError(
                f"--fit {fit} is for {cost.model} {cost.describe_precision()} tp {cost.tp} dp "
                f"{cost.dp}, not this server's {mine['model']} {mine['dtype']} tp {mine['tp']} "
                f"dp {mine['dp']}"
            )
        return _model(shape, fit)
    key = shape.fit_key()
    if kernels in KERNELS and kernels != "auto":
        key["kernels"] = kernels
    path = find_fit_for(key)
    if path is not None:
        return _model(shape, str(path))
    found = stored_fits_for(key)
    if found:
        return SpeedModel(reason=f"the stored fit {found[0][0]} is stale ({found[0][1]})")
    return SpeedModel(
        reason=f"no stored fit for {key['model']} {key['dtype']} {key['kernels']} tp "
        f"{key['tp']} dp {key['dp']} on this host (scaletui calibrate --model fits one)"
    )


def speed_model(shape: ServerShape, fit: str = "auto", kernels: str | None = None) -> SpeedModel:
    """`find_speed_model`, a fit that does not fit this shape (a --fit FILE of another shape
    after a reconfigure) being a reason for none."""
    try:
        return find_speed_model(shape, fit, kernels)
    except ValueError as e:
        return SpeedModel(reason=str(e))


def _model(shape: ServerShape, path: str) -> SpeedModel:
    cost = load_fit(path)
    spread = cost.call_spread
    draw = sum(spread) / len(spread) if spread else 1.0
    return SpeedModel(
        CallCosts(shape, cost), str(Path(path)), None, draw,
        speedlog.log_path(cost), speedlog.engine_id(cost),
    )  # fmt: skip


class SpeedWindow:
    """Per kind, the last `calls` priced calls' measured and predicted seconds (running sums:
    O(1) per call, under a lock as two workers add while /stats reads)."""

    def __init__(self, calls: int = WINDOW_CALLS, block_s: float | None = None) -> None:
        self.calls = calls
        self.block_s = speedlog.BLOCK_S if block_s is None else block_s
        self._lock = threading.Lock()
        self._rows = {k: deque[tuple[float, float]]() for k in KINDS}
        self._sums = {k: [0.0, 0.0] for k in KINDS}
        self._log: Path | None = None
        self._engine = ""
        self._blocks: dict[str, list[float]] = {}  # kind -> [first call's time, s, predicted, n]

    def add(self, kind: str, seconds: float, predicted: float, now: float | None = None) -> float:
        """One priced call; returns the kind's factor over the window."""
        closed = None
        with self._lock:
            rows, sums = self._rows[kind], self._sums[kind]
            rows.append((seconds, predicted))
            sums[0] += seconds
            sums[1] += predicted
            if len(rows) > self.calls:
                old_s, old_p = rows.popleft()
                sums[0] -= old_s
                sums[1] -= old_p
            factor = sums[0] / sums[1] if sums[1] > 0 else float("nan")
            if self._log is not None:
                closed = self._block(kind, seconds, predicted, time.time() if now is None else now)
        if closed is not None:
            self._write(kind, *closed)
        return factor

    def _block(self, kind: str, seconds: float, predicted: float, now: float) -> tuple | None:
        """Add a call (ended `now`) to its kind's block; the block's (seconds, predicted, calls,
        time) once it spans block_s from its first call's start, a new block starting with the
        next call."""
        block = self._blocks.setdefault(kind, [now - seconds, 0.0, 0.0, 0])
        block[1] += seconds
        block[2] += predicted
        block[3] += 1
        if now - block[0] < self.block_s:
            return None
        del self._blocks[kind]
        return block[1], block[2], block[3], now

    def _write(self, kind: str, seconds: float, predicted: float, calls: int, now: float) -> None:
        log_file = self._log
        if log_file is None:
            return
        try:
            speedlog.append(log_file, kind, seconds, predicted, calls, self._engine, now)
        except OSError as exc:  # the server serves on; the bands go without this host's past
            log.warning("speed log %s not written, no more blocks logged: %s", log_file, exc)
            self._log = None

    def reset(self, log_file: Path | None = None, engine: str = "") -> None:
        """Start afresh for another fit: blocks go to `log_file` from now on (None: nowhere)."""
        with self._lock:
            for k in KINDS:
                self._rows[k].clear()
                self._sums[k] = [0.0, 0.0]
            self._log, self._engine, self._blocks = log_file, engine, {}

    def summary(self) -> dict:
        """{kind: {factor, calls, seconds, predicted_seconds}} for the kinds priced so far."""
        with self._lock:
            out = {}
            for k in KINDS:
                n = len(self._rows[k])
                if not n:
                    continue
                s, p = self._sums[k]
                out[k] = {
                    "factor": s / p if p > 0 else None,
                    "calls": n,
                    "seconds": s,
                    "predicted_seconds": p,
                }
            return out
