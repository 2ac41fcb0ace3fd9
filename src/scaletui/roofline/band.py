"""Bands, not points: how far the host's speed and the fit's own error move a prediction.

A prediction's band is the simulator run over the measured spread (docs/roofline.md, "How to
read a band"), not a fixed percentage. The spread has two sources:
1. the host: `scaletui calibrate` samples its read bandwidth, prefill GEMM FLOP/s and dispatch
   floor over a window (`measured.spread` of the `local` spec: p10, p50, p90 of each);
2. the fit: a fitted cost model's calls measured over what it answers, p10/p50/p90 per step kind
   (`info.residual_spread` of the fit, `costfit.residual_spread`).
3. the horizon: the speed factors the server measured against its fit in past runs on this
   host (`roofline/speedlog.py`'s blocks, p10/p50/p90 per step kind), which carry the drift
   between a fit and a run minutes or hours later that a calibration window does not see.
They make two speed scenarios, `SpeedFactors` (time multipliers per decode call, prefill call
and host time): fast = the faster of the host's p90 read bandwidth and FLOP/s over their p50
and the past runs' p10 factor, times the fit's p10 residual; slow = the other ends. Decode calls
follow the read bandwidth (a decode step streams the weights), prefill the GEMM FLOP/s, the
scheduler's host time the dispatch floor. The host and the horizon are two readings of one
thing, the host's speed at run time against the fit, so the band takes the wider of the two at
each end rather than their product.

Why two simulations give the p10-p90 band (simband.py runs them): a shared host's speed moves in
spells of seconds to minutes, so one run meets roughly one speed; every figure the simulator
returns is monotone in that speed (slower calls never make TTFT or TPOT shorter, nor tok/s at
a closed loop higher); and quantiles commute with a monotone map, so the figure at the p10
(p90) speed IS the figure's p10 (p90). Exact under those assumptions, with the sources taken
as moving together (one host state slows reads, GEMMs and the host alike); where they move
independently the product of their ends is wider than the true p10-p90: a bound, not an
understatement. Without a spread (an old calibration, a spec not measured here, an assumed
model's residuals) a factor is 1 and the band is as wide as what was measured, said in `note`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["NOISY_AT", "SpeedFactors", "SpeedSpread", "Spread"]

NOISY_AT = 1.2  # the host is noisy when a speed's p90 / p10 exceeds this (read bw or FLOP/s)


@dataclass(frozen=True)
class Spread:
    """p10, p50, p90 of a sample (numpy's linear-interpolated percentiles) and its size."""

    p10: float
    p50: float
    p90: float
    n: int = 0  # samples it came from (0: unknown)

    def __post_init__(self) -> None:
        if not self.p10 <= self.p50 <= self.p90:
            raise ValueError(f"a spread needs p10 <= p50 <= p90, got {self}")

    @classmethod
    def of(cls, samples: Sequence[float]) -> Spread:
        """The spread of `samples` (ValueError for none, or any not finite)."""
        xs = np.asarray(samples, float)
        if xs.size == 0 or not np.isfinite(xs).all():
            raise ValueError(f"a spread needs finite samples, got {list(samples)[:8]}")
        p10, p50, p90 = (float(x) for x in np.percentile(xs, (10, 50, 90)))
        return cls(p10, p50, p90, int(xs.size))

    @classmethod
    def from_dict(cls, d: dict) -> Spread:
        """From `to_dict`'s keys; ValueError naming what is missing."""
        try:
            return cls(float(d["p10"]), float(d["p50"]), float(d["p90"]), int(d.get("n", 0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"a spread should have numbers p10, p50, p90, got {d!r}") from exc

    def to_dict(self) -> dict:
        return {"p10": self.p10, "p50": self.p50, "p90": self.p90, "n": self.n}

    @property
    def ratio(self) -> float:
        """p90 / p10 (how far apart the ends are; 1.0: no spread)."""
        return self.p90 / self.p10 if self.p10 > 0 else math.inf


def noisy(read_bw: Spread | None, flops: Spread | None) -> bool:
    """The rule calibrate states: read bandwidth or FLOP/s with p90 / p10 over NOISY_AT."""
    return any(s is not None and s.ratio > NOISY_AT for s in (read_bw, flops))


@dataclass(frozen=True)
class SpeedFactors:
    """One speed scenario: each kind of time multiplied by its factor (1: as the cost model and
    the host timing say; 1.2: 20 % slower). Part of a band, or what a run measured ("as run")."""

    decode: float = 1.0  # generate calls
    prefill: float = 1.0  # prefill calls
    host: float = 1.0  # the scheduler's host time and a request's intake (SimTiming)

    def __post_init__(self) -> None:
        for name in ("decode", "prefill", "host"):
            if not 0 < vars(self)[name] < math.inf:
                raise ValueError(f"speed factor {name} should be > 0, got {vars(self)[name]}")

    @property
    def unit(self) -> bool:
        return self.decode == self.prefill == self.host == 1.0

    @classmethod
    def parse(cls, text: str) -> SpeedFactors:
        """'decode=1.12,prefill=0.95,host=1.0' (any of them; one left out is 1.0), as
        `scaletui simulate --as-run` takes a run's measured factors. ValueError naming the
        bad part."""
        got: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, eq, value = part.partition("=")
            name = name.strip()
            if not eq or name not in ("decode", "prefill", "host") or name in got:
                raise ValueError(
                    f"speed factors are decode=F,prefill=F,host=F (each at most once), got {part!r}"
                )
            try:
                got[name] = float(value)
            except ValueError:
                raise ValueError(f"speed factor {name} should be a number, got {value!r}") from None
        return cls(**got)


def _slow_over_p50(s: Spread | None, time_like: bool) -> tuple[float, float]:
    """(fast, slow) time factors of one host figure against its p50: a rate's p90 is fast (time
    x p50 / p90), a time's p10 is."""
    if s is None or s.p50 <= 0 or s.p10 <= 0:
        return 1.0, 1.0
    if time_like:
        return s.p10 / s.p50, s.p90 / s.p50
    return s.p50 / s.p90, s.p50 / s.p10


@dataclass(frozen=True)
class SpeedSpread:
    """The two ends of a band: `fast` (the p10 of every time) and `slow` (the p90)."""

    fast: SpeedFactors = SpeedFactors()
    slow: SpeedFactors = SpeedFactors()
    note: str = ""  # where the spread came from, or why a part of it is unknown

    @property
    def width(self) -> bool:
        """False when both ends are the point: no scenario needs simulating."""
        return not (self.fast.unit and self.slow.unit)

    @classmethod
    def measured(
        cls, host: dict | None, residuals: dict | None = None, drift: dict | None = None
    ) -> SpeedSpread:
        """From a hardware spec's `measured.spread` (`host`; None or {} for a spec without one),
        a fit's `info.residual_spread` (`residuals`; None for an assumed model or a fit made
        before it) and the past runs' speed factors (`drift`: `speedlog.drift_spread`; None or
        {} when none were logged). ValueError for a spread that is there but malformed."""
        host, residuals, drift = host or {}, residuals or {}, drift or {}
        got = {k: Spread.from_dict(host[k]) for k in ("read_bw", "flops_per_s", "dispatch_s")
               if host.get(k)}  # fmt: skip
        res = {k: Spread.from_dict(residuals[k]) for k in ("decode", "prefill") if k in residuals}
        past = {k: Spread.from_dict(drift[k]) for k in ("decode", "prefill") if k in drift}
        read = _widest(_slow_over_p50(got.get("read_bw"), False), past.get("decode"))
        flops = _widest(_slow_over_p50(got.get("flops_per_s"), False), past.get("prefill"))
        disp = _slow_over_p50(got.get("dispatch_s"), True)
        rd = res.get("decode") or Spread(1.0, 1.0, 1.0)
        rp = res.get("prefill") or Spread(1.0, 1.0, 1.0)
        fast = SpeedFactors(read[0] * rd.p10, flops[0] * rp.p10, disp[0])
        slow = SpeedFactors(read[1] * rd.p90, flops[1] * rp.p90, disp[1])
        parts = []
        if got:
            window = host.get("window_s")
            parts.append(
                "host spread p10-p90: "
                + ", ".join(f"{k} {_pct(v)}" for k, v in got.items())
                + (f" over {window:g} s" if isinstance(window, int | float) else "")
            )
        else:
            parts.append("host spread unknown (the spec has none: scaletui calibrate measures it)")
        if res:
            each = ", ".join(f"{k} {_pct(v, 1.0)}" for k, v in res.items())
            parts.append(f"fit residuals (measured / model) p10-p90: {each}")
        else:
            parts.append("fit residuals unknown")
        if past:
            hours = max(float(drift[k].get("hours") or 0) for k in past)
            each = ", ".join(f"{k} {_pct(v, 1.0)} ({v.n} blocks)" for k, v in past.items())
            parts.append(f"past runs against the fit p10-p90: {each} over {hours:.1f} h")
        else:
            parts.append("no past runs logged yet")
        return cls(fast, slow, "; ".join(parts))

    def to_dict(self) -> dict:
        return {"fast": vars(self.fast), "slow": vars(self.slow), "note": self.note}


def _widest(host: tuple[float, float], past: Spread | None) -> tuple[float, float]:
    """(fast, slow) time factors: the host's window and the past runs' p10 / p90 factors are
    two readings of the host's speed at run time against the fit; the band takes the wider."""
    if past is None:
        return host
    return min(host[0], past.p10), max(host[1], past.p90)


def _pct(s: Spread, center: float | None = None) -> str:
    """'-8%..+11%': the ends of a spread against `center` (default its p50)."""
    c = s.p50 if center is None else center
    if c <= 0:
        return "?"
    return f"{s.p10 / c - 1:+.0%}..{s.p90 / c - 1:+.0%}"
