"""A KPI (floor | expected | measured) and its band: each expected figure's p10-p90
(`Expectation.band_for`), taken from the same part of the spread's fast and slow simulated runs
as the figure is of the point's (views.py's docstring: a closed loop's first wave against
itself), else the whole run's. And its "as run" figure: the same expectation simulated again at
the speed factors the server measured against its fit (/stats `speed`, docs/roofline.md "The
speed factor and the as-run figure"), the same part of that run, so "the host was slow"
(as-run meets measured) reads apart from "the model is wrong" (as-run is still off). And, for a
server over several processes, what holds its devices and the floor's DCN term in words."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from scaletui.roofline.band import SpeedFactors
from scaletui.tui.expect import Expectation
from scaletui.tui.simrun import SimRun

# the server's own decode step this far off its fit's gets a note: past the spread of two fits
# made a minute apart on a shared host (docs/tui.md, "Floor, expected, measured")
SPEED_NOTE_AT = 0.15
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
    as_run: float | None = None  # the expectation at the server's measured speed factors

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


# per KPI key with an as-run figure: the Expectation's whole-run attribute
WHOLE = {
    "ttft_p50": "ttft_p50_ms",
    "ttft_p99": "ttft_p99_ms",
    "tpot_p50": "tpot_p50_ms",
    "tpot_p99": "tpot_p99_ms",
    "decode_step": "decode_step_ms",
    "tok_s": "tok_s",
}
FACTOR_GRAIN = 0.01  # factors are rounded to this before simulating: a new run per 1 % moved


def speed_factors(speed: dict) -> SpeedFactors | None:
    """The factors /stats `speed` measured (decode, prefill; a kind not priced yet and the
    host, which the server does not price, at 1.0), rounded to FACTOR_GRAIN; None without a
    fit or before any call was priced."""
    got = {}
    for kind in ("decode", "prefill"):
        f = (speed.get(kind) or {}).get("factor") if speed.get("fit") else None
        if isinstance(f, int | float) and f > 0:
            got[kind] = max(FACTOR_GRAIN, round(f / FACTOR_GRAIN) * FACTOR_GRAIN)
    return SpeedFactors(**got) if got else None


def with_as_run(
    kpis: tuple[Kpi, ...],
    run: Expectation,
    first: int,
    counts: list[int] | None,
    span: tuple[float, float] | None,
) -> tuple[Kpi, ...]:
    """`kpis` with `as_run` set from `run` (the expectation at the measured factors), each the
    same part of it as `with_bands` takes of the ends: latency over the pooled windows'
    completions, tok/s over their seconds, else the whole run's."""
    sim = run.run
    out = []
    for k in kpis:
        value = None
        if k.key == "tok_s" and sim is not None and span is not None:
            value = sim.tok_s(*span)
        elif k.key in BANDED and BANDED[k.key][1] not in (None, "tok_s") and sim and counts:
            _, metric, q = BANDED[k.key]
            value = sim.latency(metric, q, first, counts)
        if value is None and k.key in WHOLE:
            value = getattr(run, WHOLE[k.key])
        out.append(replace(k, as_run=value))
    return tuple(out)


def speed_words(speed: dict, shown: bool, why_not: str | None) -> str | None:
    """The KPI panel's line on the server's speed against its fit: the factor per kind and
    what the run column is, or why there is no factor or no as-run figure. None for a server
    whose /stats says nothing of it (not ours)."""
    if not speed:
        return None
    if not speed.get("fit"):
        return f"speed vs fit: none ({speed.get('reason') or 'the server has no fit'})"
    kinds = [
        f"{k} ×{speed[k]['factor']:.2f}"
        for k in ("decode", "prefill")
        if isinstance((speed.get(k) or {}).get("factor"), int | float)
    ]
    if not kinds:
        return "speed vs fit: no engine call priced yet"
    n = speed.get("window_calls")
    line = f"speed vs fit{f' (last {n} calls)' if n else ''}: {', '.join(kinds)}"
    if shown:
        return f"{line}; run = exp simulated at that speed"
    return f"{line}; no as-run: {why_not}" if why_not else line


def speed_note(decode: Kpi, fitted: bool) -> str | None:
    """When the server's own decode step (/stats, its last 5 s) is more than SPEED_NOTE_AT off
    what the fit says for the applied knobs: the engine itself runs at another speed than when
    it was timed, so every m/e carries that (the host's speed moved, the fit is stale, or the
    slots are a batch the fit interpolates), not the scheduling. None for an assumed
    expectation (its note says so already)."""
    r = decode.ratio
    if not fitted or r is None or abs(r - 1) <= SPEED_NOTE_AT:
        return None
    way = "slower" if r > 1 else "faster"
    return (
        f"the engine's decode step runs ×{r:.2f} its fit's, and latency and tok/s m/e "
        f"carry that: a host {way} than at fit time, or a batch the fit did not time "
        f"(refit: palette)"
    )


def processes_words(processes: tuple[int, ...]) -> str:
    """'2 processes × 2' (devices each) for a server over several processes, else ''."""
    if len(processes) < 2:
        return ""
    if len(set(processes)) == 1:
        return f"{len(processes)} processes × {processes[0]}"
    return f"{len(processes)} processes × {'/'.join(map(str, processes))}"


def dcn_words(dcn_ms: float | None, crosses: tuple[str, ...], processes: int) -> str | None:
    """The floor's DCN term of a decode step over processes (hosts), in words: what crosses
    them and what it costs each step; None on one process."""
    if dcn_ms is None:
        return None
    if not crosses:
        return "DCN: the mesh stays within one process (no term)"
    axes = "+".join({"model": "tp", "data": "dp", "transfer": "KV"}.get(a, a) for a in crosses)
    if dcn_ms == 0:
        return f"DCN 0/step: {axes} across {processes} processes, no traffic"
    took = f"{dcn_ms:.3g} ms" if dcn_ms >= 1 else f"{dcn_ms * 1e3:.3g} µs"
    return f"DCN {took}/step floor: {axes} over {processes} processes"
