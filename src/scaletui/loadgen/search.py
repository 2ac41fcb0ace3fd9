"""SLO search: the highest request rate whose latency percentile meets every SLO (pure).

The stopping rule (docs/loadgen.md, `loadgen --help`):
1. Bracket: run the start rate; while every stage passes, raise the rate; while every stage
   fails, lower it (down to MIN_RATE); a pass and a fail above it make the bracket [lo, hi].
   From the cold start (1 req/s) each step is x2 or /2. From a given start (a prediction) the
   steps are x1.25 (or /1.25), then x1.25^2, x1.25^3, ... (k-th distinct rate: x1.25^k): a start
   within 25% is bracketed in two stages, a start far off still in a few.
2. Verdicts by majority: a rate may run more than once; its verdict is the majority of its
   stages, and a rate with as many passes as fails runs again before anything else. hi is the
   lowest failing rate, lo the highest passing rate below it (a pass above a fail is ignored).
3. Bisect: run (lo + hi) / 2 until (hi - lo) / lo <= tolerance (5%).
4. Confirm: then lo and hi each need `confirm` (2) stages with a strict majority; lo runs again,
   then hi. A lo that fails twice in three becomes hi and bisection goes on below it; a hi that
   passes twice in three stops bounding and the search goes on above it. `max_rate` = lo.
5. A stage passes when it completed at least `min_requests(percentile, tail)` requests (so that
   `tail` of them lie beyond the percentile), its percentile of each SLO metric is <= the SLO,
   its failure rate is <= --max-failure-rate and it is not saturated (the server kept up).

Why 4: near the SLO edge one stage passes or fails by noise (a busy host, the percentile of a
few hundred requests). A single stray verdict at an end of the bracket used to be the answer;
now it must be repeated, and one stray verdict among three is outvoted.

Nothing here sends a request: `next_rate` reads the verdicts so far and names the next rate, so
the logic is tested against a latency that is a known function of the rate (plus seeded noise).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import orjson

from scaletui.loadgen.report import Latencies, Slo

COLD_START = 1.0  # req/s: where a search starts without --search-start (the "cold" start)
WARM_FACTOR = 1.25  # the first bracketing step from a given start
MIN_RATE = 1e-3  # req/s: a search that fails here has found no passing rate
MAX_RATE = 1e6  # req/s: one that passes here stops bracketing
SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class SearchConfig:
    """How the search moves and when it stops."""

    start: float = COLD_START  # the first stage's rate (req/s)
    factor: float = 2.0  # bracketing: multiply or divide the rate by this
    expand: bool = False  # the k-th bracketing step uses factor**k (a trusted start)
    tolerance: float = 0.05  # bisection stops when (hi - lo) / lo <= this
    confirm: int = 2  # stages each end of the final bracket needs (1: trust single stages)
    max_stages: int = 24  # a search never runs more stages than this

    def __post_init__(self) -> None:
        if not (self.start > 0 and math.isfinite(self.start)):
            raise ValueError(f"search start must be a finite rate > 0 req/s, got {self.start}")
        if not self.factor > 1:
            raise ValueError(f"search factor must be > 1, got {self.factor}")
        if not 0 < self.tolerance < 1:
            raise ValueError(f"search tolerance must be in (0, 1), got {self.tolerance}")
        if self.confirm < 1:
            raise ValueError(f"--search-confirm must be >= 1, got {self.confirm}")
        if self.max_stages < 1:
            raise ValueError(f"max_stages must be >= 1, got {self.max_stages}")


def config_for(start: float | None, confirm: int = 2) -> SearchConfig:
    """The cold search (None), or one from a given start that trusts it (WARM_FACTOR)."""
    if start is None:
        return SearchConfig(confirm=confirm)
    return SearchConfig(start=start, factor=WARM_FACTOR, expand=True, confirm=confirm)


def min_requests(percentile: float, tail: int) -> int:
    """Completed requests a stage needs so that `tail` of them lie beyond the percentile:
    ceil(tail / (1 - percentile / 100)); p99 with tail 5 -> 500, p90 -> 50, p50 -> 10."""
    if not 0 < percentile < 100:
        raise ValueError(f"--slo-percentile must be in (0, 100), got {percentile}")
    if tail < 1:
        raise ValueError(f"--search-tail must be >= 1, got {tail}")
    return math.ceil(round(tail / (1 - percentile / 100), 9))


def tally(history: Sequence[tuple[float, bool]]) -> dict[float, tuple[int, int]]:
    """rate -> (stages passed, stages failed), in the order the rates were first run."""
    votes: dict[float, tuple[int, int]] = {}
    for rate, ok in history:
        p, f = votes.get(rate, (0, 0))
        votes[rate] = (p + ok, f + (not ok))
    return votes


def bracket(history: Sequence[tuple[float, bool]]) -> tuple[float | None, float | None]:
    """(lo, hi) by each rate's majority verdict: hi the lowest failing rate, lo the highest
    passing rate below it (None: none yet). A pass above a fail (noise) does not move lo past
    hi; a tied rate counts for neither."""
    decided = [(r, p > f) for r, (p, f) in tally(history).items() if p != f]
    hi = min((r for r, ok in decided if not ok), default=None)
    lo = max((r for r, ok in decided if ok and (hi is None or r < hi)), default=None)
    return lo, hi


def converged(cfg: SearchConfig, history: Sequence[tuple[float, bool]]) -> bool:
    """The bracket is within the tolerance and both its ends are confirmed."""
    lo, hi = bracket(history)
    if lo is None or hi is None or (hi - lo) / lo > cfg.tolerance:
        return False
    votes = tally(history)
    return all(sum(votes[end]) >= cfg.confirm for end in (lo, hi))


def next_rate(cfg: SearchConfig, history: Sequence[tuple[float, bool]]) -> float | None:
    """The next stage's rate given (rate, passed) of the stages so far, or None: done."""
    if not history:
        return cfg.start
    if len(history) >= cfg.max_stages:
        return None
    votes = tally(history)
    tied = [r for r, (p, f) in votes.items() if p == f]
    if tied:  # a confirmation that disagreed: a third stage decides
        return tied[0]
    lo, hi = bracket(history)
    if hi is None:
        return None if lo >= MAX_RATE else lo * _step(cfg, history, up=True)
    if lo is None:
        rate = hi / _step(cfg, history, up=False)
        return None if rate < MIN_RATE else rate
    if (hi - lo) / lo > cfg.tolerance:
        return (lo + hi) / 2
    for end in (lo, hi):  # the answer first
        if sum(votes[end]) < cfg.confirm:
            return end
    return None


def _step(cfg: SearchConfig, history: Sequence[tuple[float, bool]], *, up: bool) -> float:
    """The bracketing step: factor, or with `expand` factor**k, k the stages at the end of the
    history that each went past every rate before them in this direction (at least 1), so
    that a bracket lost to a confirmation starts again with small steps."""
    if not cfg.expand:
        return cfg.factor
    k = 0
    for i in range(len(history) - 1, -1, -1):
        rate, ok = history[i]
        earlier = [r for r, _ in history[:i]]
        if ok != up or not all(rate > r if up else rate < r for r in earlier):
            break
        k += 1
    return cfg.factor ** max(k, 1)


def replay(cfg: SearchConfig, passes: Callable[[float], bool]) -> list[tuple[float, bool]]:
    """The whole search against an oracle: its (rate, passed) stages in order."""
    history: list[tuple[float, bool]] = []
    while (rate := next_rate(cfg, history)) is not None:
        history.append((rate, passes(rate)))
    return history


def stages_cold(cfg: SearchConfig, max_rate: float | None) -> int:
    """How many stages the cold search (same `confirm`) would have run, replayed against what
    this one found (a rate passes iff it is <= max_rate: every confirmation agrees)."""
    limit = -1.0 if max_rate is None else max_rate
    cold = replace(config_for(None, cfg.confirm), max_stages=cfg.max_stages)
    return len(replay(cold, lambda r: r <= limit))


def percentiles_ms(lat: Latencies, percentile: float) -> dict[str, float | None]:
    """The stage's percentile of TTFT, TPOT (N > 1) and E2EL in ms (None: no sample)."""
    out: dict[str, float | None] = {}
    for name in SLO_METRICS:
        values = vars(lat)[name]
        out[name] = float(np.percentile(values * 1e3, percentile)) if values.size else None
    return out


def verdict(
    measured: dict[str, float | None],
    slo: Slo,
    *,
    percentile: float,
    completed: int,
    needed: int,
    failure_rate: float | None,
    max_failure_rate: float,
    saturation: str | None,
) -> dict:
    """Whether a stage meets the SLOs (the rule in the module docstring), with its reasons:
    the summary's `slo_check`."""
    reasons = []
    if completed < needed:
        reasons.append(f"only {completed} completed; p{percentile:g} needs {needed}")
    limits = slo.as_dict()
    for name in SLO_METRICS:
        limit, value = limits[name], measured.get(name)
        if limit is None:
            continue
        if value is None:
            reasons.append(f"no {name} sample")
        elif value > limit:
            reasons.append(f"p{percentile:g} {name} {value:.1f} ms > {limit:g} ms")
    if failure_rate is not None and failure_rate > max_failure_rate:
        reasons.append(f"failure rate {failure_rate:.1%} > {max_failure_rate:.1%}")
    if saturation:
        reasons.append("saturated: the server did not keep up")
    return {
        "passed": not reasons,
        "percentile": percentile,
        "measured_ms": {k: measured.get(k) for k in SLO_METRICS if limits[k] is not None},
        "slo_ms": {k: v for k, v in limits.items() if v is not None},
        "min_completed": needed,
        "reasons": reasons,
    }


def start_from_simulation(path: str, slo: Slo, percentile: float) -> float:
    """A starting rate from `scaletui simulate --out FILE` (one summary, or {"stages": [...]}
    of several rates): the highest simulated rate whose predicted percentile meets every SLO
    and is not saturated; if none does, the lowest simulated rate's sustained rate (or its
    rate). The search then brackets from there as from any start."""
    try:
        data = orjson.loads(Path(path).read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        raise ValueError(f"--search-start {path}: not a readable JSON file ({exc})") from None
    rows = data.get("stages", [data]) if isinstance(data, dict) else None
    if not rows or not all(
        isinstance(r, dict) and (r.get("config") or {}).get("simulated") for r in rows
    ):
        raise ValueError(
            f"--search-start {path}: not a `scaletui simulate --out` result "
            "(config.simulated is missing)"
        )
    passing, fallback = [], []
    for i, row in enumerate(rows):
        rate = row.get("requested_rate")
        if not isinstance(rate, int | float) or not rate > 0:
            raise ValueError(f"--search-start {path}: stage {i} has no requested_rate (--qps)")
        ok = not row.get("saturated")
        for name, limit in slo.as_dict().items():
            key = f"p{percentile:g}_{name}_ms"
            if limit is None:
                continue
            if key not in row:
                raise ValueError(f"--search-start {path}: stage {i} has no {key}")
            ok = ok and row[key] is not None and row[key] <= limit
        if ok:
            passing.append(float(rate))
        kept = row.get("sustained_rate")
        fallback.append(min(float(rate), kept) if isinstance(kept, int | float) else float(rate))
    return max(passing) if passing else min(fallback)


def summary_of(cfg: SearchConfig, history: list[dict]) -> dict:
    """The result's `search` block: max_rate, the bracket, and the stages the start saved."""
    pairs = [(h["rate"], h["passed"]) for h in history]
    lo, hi = bracket(pairs)
    cold_n = stages_cold(cfg, lo)
    return {
        "max_rate": lo,
        "bracket": [lo, hi],
        "start": cfg.start,
        "factor": cfg.factor,
        "expand": cfg.expand,
        "tolerance": cfg.tolerance,
        "confirm": cfg.confirm,
        "stages_run": len(history),
        "stages_cold": cold_n,
        "stages_saved": cold_n - len(history),
        "converged": converged(cfg, pairs),
        "history": history,
    }


def describe(s: dict) -> str:
    """The search's result in two lines, for the terminal."""
    lo, hi = s["bracket"]
    if lo is None:
        head = "search: no rate passed (lowest tried failed)"
    else:
        head = (
            f"search: max_rate {lo:.4g} req/s (lowest failing {'-' if hi is None else f'{hi:.4g}'})"
        )
    saved = (
        f"; the start {s['start']:.4g} req/s saved {s['stages_saved']} of the "
        f"{s['stages_cold']} stages a start at {COLD_START:g} req/s takes"
    )
    return f"{head} after {s['stages_run']} stages{saved}"
