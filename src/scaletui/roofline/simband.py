"""The simulator at another speed and over a spread: `simulate_at` runs one speed scenario (a
band's end, or the speed a run measured: "as run"), `simulate_band` the point and its p10-p90
band per figure (band.py says why two scenarios give it).

Cost: a band is three simulations of the same request list, the ends only when the spread has
width (an unknown spread costs nothing more). The ends run with the point's seed, so each
call draws the same variation (`call_spread`) in all three and the band is the speed alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from scaletui.roofline.band import SpeedFactors, SpeedSpread
from scaletui.roofline.costmodel import CostModel
from scaletui.roofline.simrecords import Load, SimResult, SimTiming
from scaletui.roofline.simulate import simulate
from scaletui.roofline.speedtrace import SpeedTrace
from scaletui.shape import ServerShape

__all__ = [
    "Banded",
    "at_speed",
    "band_of",
    "median_of",
    "simulate_at",
    "simulate_band",
]

# summary keys that are what was asked for, not what the server did: no band
NOT_BANDED = frozenset({"num_prompts", "requested_rate", "scheduled_rate", "cancelled"})


def at_speed(
    decode: CostModel, prefill: CostModel, timing: SimTiming, speed: SpeedFactors
) -> tuple[CostModel, CostModel, SimTiming]:
    """The cost models and host timing `speed` times slower (`CostModel.scaled`: decode calls
    by `speed.decode`, prefill calls by `speed.prefill`; the host's gap and intake by
    `speed.host`)."""
    if speed.unit:
        return decode, prefill, timing
    d = decode.scaled(speed.decode, speed.prefill)
    p = d if prefill is decode else prefill.scaled(speed.decode, speed.prefill)
    host = {k: getattr(timing, k) * speed.host for k in ("intake_s", "gap_s", "gap_per_row_s")}
    return d, p, replace(timing, **host)


def simulate_at(
    shape: ServerShape,
    decode: CostModel,
    load: Load,
    speed: SpeedFactors,
    prefill: CostModel | None = None,
    seed: int = 0,
    timing: SimTiming | None = None,
    trace: SpeedTrace | None = None,
    draws: int = 1,
) -> SimResult:
    """`simulate` on a host `speed` times slower than the cost models and `timing` say; with
    a `trace` (the speeds a run met, relative to `speed`), each call at its moment's speed.

    Over `draws` draw seeds (seed, seed + 1, ...: each call's variation drawn anew, the request
    list the same): the first draw's per-request times and a summary whose every number is the
    median over the draws. One draw's median TTFT under bursts moves by ±5-13 % with the draw
    alone (bench/sim_noise.py); the median of several is the figure a run is expected at. A
    model without `call_spread` draws nothing: one simulation."""
    d, p, t = at_speed(decode, prefill or decode, timing or SimTiming(), speed)
    run = lambda k: simulate(shape, d, load, p, seed=seed + k, timing=t, trace=trace)  # noqa: E731
    first = run(0)
    if draws <= 1 or not (d.call_spread or p.call_spread):
        return first
    summaries = [first.summary] + [run(k).summary for k in range(1, draws)]
    return replace(first, summary={**first.summary, **median_of(summaries)})


def median_of(summaries: list[dict]) -> dict:
    """{key: the median over `summaries`} for every number (or None) of the first; a draw
    with None for it (nothing completed) is left out; booleans are not numbers here."""
    out = {}
    for key, value in summaries[0].items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            continue
        got = [s.get(key) for s in summaries]
        got = sorted(x for x in got if isinstance(x, int | float) and math.isfinite(x))
        if got:
            mid = len(got) // 2
            out[key] = got[mid] if len(got) % 2 else (got[mid - 1] + got[mid]) / 2
    return out


@dataclass(frozen=True, eq=False)
class Banded:
    """The point simulation, and per figure of its summary [low, high] over the scenarios."""

    point: SimResult
    band: dict[str, list[float]]
    spread: SpeedSpread = field(default_factory=SpeedSpread)
    ends: tuple[SimResult, ...] = ()  # the fast and the slow end's runs (none: no width)


def band_of(summaries: list[dict]) -> dict[str, list[float]]:
    """{key: [min, max]} over `summaries` (the point's first) for every number the point has,
    but NOT_BANDED: the point always lies in its band. A scenario's None (nothing completed) is
    left out of the ends."""
    point, band = summaries[0], {}
    for key, value in point.items():
        if key in NOT_BANDED or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        got = [s.get(key) for s in summaries]
        got = [x for x in got if isinstance(x, int | float) and math.isfinite(x)]
        if got:
            band[key] = [min(got), max(got)]
    return band


def simulate_band(
    shape: ServerShape,
    decode: CostModel,
    load: Load,
    spread: SpeedSpread,
    prefill: CostModel | None = None,
    seed: int = 0,
    timing: SimTiming | None = None,
    draws: int = 1,
    point: SimResult | None = None,
) -> Banded:
    """The point (`simulate_at` at the fit's own speed over `draws`, or `point`, simulated
    already) and each figure's band over `spread`'s fast and slow ends, run on the same request
    list and seeds (not run when the spread has no width: the band is the point)."""
    if point is None:
        point = simulate_at(shape, decode, load, SpeedFactors(), prefill, seed, timing, None, draws)
    speeds = (spread.fast, spread.slow) if spread.width else ()
    ends = tuple(
        simulate_at(shape, decode, load, s, prefill, seed, timing, None, draws) for s in speeds
    )
    return Banded(point, band_of([point.summary, *(e.summary for e in ends)]), spread, ends)
