"""The records the TUI's session keeps, frozen: a log event, the hardware spec predictions use,
and each finished run's row (measured beside predicted and expected) and sweep point.
"""

from __future__ import annotations

from dataclasses import dataclass

from scaletui import specs
from scaletui.tui.knobs import Knobs


@dataclass(frozen=True)
class Event:
    seq: int
    t: float
    level: str  # info | warning | error
    text: str


@dataclass(frozen=True)
class HardwareChoice:
    """The spec predictions use: the knob's value ("" = automatic), the spec, and why, when the
    automatic choice could not be this host's calibrated `local`."""

    requested: str
    spec: specs.HardwareSpec | None
    note: str | None

    @property
    def name(self) -> str:
        return self.spec.name if self.spec else (self.requested or "auto")


@dataclass(frozen=True)
class RunRow:
    run: int
    kind: str
    knobs: Knobs
    pred_ttft_ms: float | None
    pred_tpot_ms: float | None
    pred_tok_s: float | None
    ttft_ms: float | None
    tpot_ms: float | None
    tok_s: float | None
    completed: int
    partial: bool
    exp_ttft_ms: float | None = None  # the expectation (simulated scheduler on the cost model)
    exp_tpot_ms: float | None = None
    exp_tok_s: float | None = None

    @property
    def efficiency(self) -> float | None:
        """Measured tokens/s as a fraction of the roofline's."""
        if not self.pred_tok_s or self.tok_s is None:
            return None
        return self.tok_s / self.pred_tok_s

    @property
    def vs_expected(self) -> float | None:
        """Measured tokens/s / expected tokens/s (1.0: the cost model and simulation hold)."""
        if not self.exp_tok_s or self.tok_s is None:
            return None
        return self.tok_s / self.exp_tok_s


@dataclass(frozen=True)
class SweepPoint:
    label: str
    tok_s: float | None
    tpot_ms: float | None
    ttft_ms: float | None
    pred_tok_s: float | None
    pred_tpot_ms: float | None
    knobs: Knobs | None = None  # what the point ran at
    exp_tok_s: float | None = None
    exp_tpot_ms: float | None = None

    @classmethod
    def from_row(cls, row: RunRow) -> SweepPoint:
        k = row.knobs
        label = f"{k.rate:g}qps" if k.load == "qps" else f"s{k.slots}"
        return cls(
            label,
            row.tok_s,
            row.tpot_ms,
            row.ttft_ms,
            row.pred_tok_s,
            row.pred_tpot_ms,
            k,
            row.exp_tok_s,
            row.exp_tpot_ms,
        )
