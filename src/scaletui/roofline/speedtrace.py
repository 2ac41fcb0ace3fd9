"""The speeds a run met, in time: a stage's `speed_timeline` (loadgen's `server_metrics`, one
row per /metrics scrape interval: the server's step seconds over its fit's, per kind) as a
piecewise-constant factor the simulator multiplies each call by, relative to the stage's mean.

Why: an "as run" simulation at the stage's one mean factor replays a host whose speed held
still. A shared host's speed moves within a stage (docs/roofline.md, "A run's own noise"), and
queueing is not linear in speed: a burst met at a slow moment queues longer than the mean says.
With a trace, `simulate_at(..., trace=...)` prices each call at the speed of its moment: the
cost models are scaled to the stage's mean (`at_speed`, as before) and each call is multiplied
by `SpeedTrace.at(kind, t)` = that moment's factor / the mean, so a trace that never moves is
the mean's simulation exactly.

Intervals are merged forward into spells of at least `min_predicted_s` of predicted call time
of their kind: a 1-s interval may hold one prefill, whose own variation the simulator draws
from the fit's `call_spread` (it is not the host's speed), and a scrape can fall between a
call's two counter updates (its seconds in one row, its prediction in the next).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import orjson

KINDS = ("decode", "prefill")
MIN_PREDICTED_S = 0.5  # predicted call time a segment of the trace rests on, at least


@dataclass(frozen=True, eq=False)
class SpeedTrace:
    """Per kind, segments (ends ascending, seconds since the schedule's start) and each one's
    factor over the stage's mean; before the first end the first segment's, after the last the
    last's. An empty kind is 1 throughout."""

    ends: dict[str, list[float]] = field(default_factory=dict)
    relative: dict[str, list[float]] = field(default_factory=dict)

    def at(self, kind: str, t: float) -> float:
        """The factor over the mean for a call of `kind` starting at `t`."""
        rel = self.relative.get(kind)
        if not rel:
            return 1.0
        k = bisect.bisect_left(self.ends[kind], t)
        return rel[min(k, len(rel) - 1)]

    @classmethod
    def of_timeline(
        cls,
        rows: Sequence[dict],
        mean: dict[str, float],
        min_predicted_s: float = MIN_PREDICTED_S,
    ) -> SpeedTrace:
        """From `speed_timeline` rows ({t_s, seconds_s: {kind: s}, predicted_s: {kind: s}}) and the
        stage's mean factor per kind (`speed_factor`). ValueError naming a row that is not one."""
        ends: dict[str, list[float]] = {}
        relative: dict[str, list[float]] = {}
        for kind in KINDS:
            if not mean.get(kind, 0) > 0:
                continue
            segments: list[list[float]] = []  # [end, spent, predicted]
            open_ = [0.0, 0.0, 0.0]
            last_t = -math.inf
            for i, row in enumerate(rows):
                t, spent, p = _row(i, row, kind)
                if t < last_t:
                    raise ValueError(f"speed_timeline row {i}: t_s {t} before row {i - 1}'s")
                last_t = t
                if spent == p == 0:
                    continue
                open_ = [t, open_[1] + spent, open_[2] + p]
                if open_[2] >= min_predicted_s and open_[1] > 0:
                    segments.append(open_)
                    open_ = [0.0, 0.0, 0.0]
            if open_[2] > 0 and segments:  # a short tail joins the segment before it
                segments[-1] = [open_[0], segments[-1][1] + open_[1], segments[-1][2] + open_[2]]
            if segments:
                ends[kind] = [end for end, _, _ in segments]
                relative[kind] = [s / p / mean[kind] for _, s, p in segments]
        return cls(ends, relative)

    @property
    def segments(self) -> int:
        return sum(len(v) for v in self.relative.values())

    def to_dict(self) -> dict:
        """Per kind: the segments' ends and factors over the mean (the result JSON's config)."""
        return {
            k: {"ends_s": self.ends[k], "relative": [round(r, 4) for r in self.relative[k]]}
            for k in self.relative
        }


def _row(i: int, row: dict, kind: str) -> tuple[float, float, float]:
    """(end, seconds spent, seconds predicted) of one timeline row for `kind` (0, 0: the
    interval ran no call of that kind). A row without `seconds_s` (an older loadgen's) spends
    factor x predicted."""
    try:
        t = float(row["t_s"])
        p = float((row.get("predicted_s") or {}).get(kind, 0.0))
        spent = (row.get("seconds_s") or {}).get(kind)
        if spent is None:
            f = (row.get("factor") or {}).get(kind)
            spent = 0.0 if f is None else float(f) * p
        spent = float(spent)
    except (KeyError, TypeError, ValueError, AttributeError):
        raise ValueError(
            f"speed_timeline row {i} should be {{t_s, seconds_s: {{kind: s}}, predicted_s: "
            f"{{kind: s}}}}, got {row!r}"
        ) from None
    if not (math.isfinite(t) and 0 <= spent < math.inf and 0 <= p < math.inf):
        raise ValueError(f"speed_timeline row {i}: need a finite t_s and seconds >= 0, got "
                         f"{row!r}")  # fmt: skip
    return t, spent, p


def of_result(
    summary: dict, stage: int | None = None, name: str = "the result"
) -> tuple[dict[str, float], SpeedTrace | None]:
    """(the stage's mean speed factor per kind, its trace or None) from a loadgen result: one
    stage's summary, or a file of `stages` and which one. ValueError saying what is missing."""
    stages = summary.get("stages") if isinstance(summary, dict) else None
    if isinstance(stages, list):
        if stage is None and len(stages) != 1:
            raise ValueError(f"{name} has {len(stages)} stages: name one, FILE:STAGE (from 0)")
        if not 0 <= (stage or 0) < len(stages):
            raise ValueError(f"{name} has stages 0..{len(stages) - 1}, got stage {stage}")
        summary = stages[stage or 0]
    elif stage not in (None, 0):
        raise ValueError(f"{name} is one stage's summary, got stage {stage}")
    metrics = (summary.get("server_metrics") if isinstance(summary, dict) else None) or {}
    mean = metrics.get("speed_factor")
    if not isinstance(mean, dict) or not mean:
        raise ValueError(
            f"{name} has no server_metrics.speed_factor: the server did not price its calls by "
            "a fit (scaletui serve --fit auto, with a stored fit), or loadgen did not read "
            "its /metrics"
        )
    try:
        mean = {k: float(v) for k, v in mean.items() if k in KINDS}
    except (TypeError, ValueError):
        raise ValueError(f"{name}: speed_factor should map kinds to numbers, got {mean}") from None
    rows = metrics.get("speed_timeline")
    if rows is not None and not isinstance(rows, list):
        raise ValueError(f"{name}: speed_timeline should be a list of rows, got {rows!r}")
    trace = SpeedTrace.of_timeline(rows, mean) if rows else None
    return mean, (trace if trace is not None and trace.segments else None)


def read_result(spec: str, flag: str = "the result") -> tuple[dict[str, float], SpeedTrace | None]:
    """`of_result` of the loadgen result file `spec` names, FILE or FILE:STAGE. ValueError
    (OSError for an unreadable file) naming `flag` and the file."""
    path, colon, stage = spec.rpartition(":")
    if not colon or not stage.isdigit():
        path, stage = spec, ""
    try:
        summary = orjson.loads(Path(path).read_bytes())
    except orjson.JSONDecodeError as e:
        raise ValueError(f"{flag} {path}: not JSON ({e})") from None
    return of_result(summary, int(stage) if stage else None, f"{flag} {path}")
