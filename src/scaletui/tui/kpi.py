"""A KPI (floor | expected | measured) and its band: each expected figure's p10-p90
(`Expectation.band_for`), taken from the same part of the spread's fast and slow simulated runs
as the figure is of the point's (views.py's docstring: a closed loop's first wave against
itself), else the whole run's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from scaletui.tui.expect import Expectation
from scaletui.tui.simrun import SimRun

# per KPI key with a band: (the whole run's summary key, the simulated part's metric, q)
BANDED = {
    "ttft_p50": ("median_ttft_ms", "ttft", 50),
    "ttft_p99": ("p99_ttft_ms", "ttft", 99),
    "tpot_p50": ("median_tpot_ms", "tpot", 50),
    "tpot_p99": ("p99_tpot_ms", "tpot", 99),
    "decode_step": ("mean_step_ms", None, 0),
    "tok_s": ("output_throughput", "tok_s", 0),
}


@dataclass(frozen=True)
class Kpi:
    key: str  # stable: ttft_p50 ttft_p99 tpot_p50 tpot_p99 decode_step tok_s mem
    label: str  # what the panel shows; may change
    unit: str
    floor: float | None  # the roofline: the best any server could do
    expected: float | None  # our scheduler simulated on the cost model
    measured: float | None
    band: tuple[float, float] | None = None  # the expectation's p10-p90 (None: no width)

    @property
    def ratio(self) -> float | None:
        """measured / expected: 1.07 means 7% above what the cost model and simulation say."""
        if self.expected is None or self.measured is None or self.expected <= 0:
            return None
        return self.measured / self.expected


def with_bands(
    kpis: tuple[Kpi, ...],
    e: Expectation,
    first: int,
    counts: list[int] | None,
    span: tuple[float, float] | None,
) -> tuple[Kpi, ...]:
    """`kpis` with `band` set from `e`: latency over the run's completions from number `first`
    in the pooled windows' `counts` (None: no pool, the whole run), tok/s over `span` (None:
    the whole run)."""

    def part(metric: str | None, q: float) -> Callable[[SimRun], float | None] | None:
        if metric == "tok_s":
            return (lambda r: r.tok_s(*span)) if span is not None else None
        if metric is None or counts is None:
            return None
        return lambda r: r.latency(metric, q, first, counts)

    out = []
    for k in kpis:
        if k.key in BANDED:
            key, metric, q = BANDED[k.key]
            k = replace(k, band=e.band_for(key, k.expected, part(metric, q)))
        out.append(k)
    return tuple(out)


def band_words(note: str, shown: bool) -> str:
    """The KPI panel's line under the table: what the bands come from, or why exp is a point."""
    if shown:
        return f"exp p10-p90: {note}"
    return "exp is a point: no spread measured for this spec and fit (scaletui calibrate)"
