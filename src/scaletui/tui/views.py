"""Frozen views of the TUI model, one per panel; panels get these and never the model itself.

Measured numbers: latency percentiles from the newest loadgen window of the current run that has
them (window percentiles cover the requests finished in that second), else the last summary;
tokens/s as the mean of the last 5 windows; decode step from /stats
`step_times_ms.generate.per_token_mean`; memory per chip from /stats `memory.*_per_device`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from scaletui.tui.knobs import Knobs

if TYPE_CHECKING:
    from scaletui.tui.model import MetricsModel
    from scaletui.tui.predict import Prediction


@dataclass(frozen=True)
class Kpi:
    label: str
    unit: str
    predicted: float | None
    measured: float | None

    @property
    def delta(self) -> float | None:
        """(measured - predicted) / predicted; +50% means 1.5x the roofline."""
        if self.predicted is None or self.measured is None or self.predicted <= 0:
            return None
        return (self.measured - self.predicted) / self.predicted


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

    @property
    def efficiency(self) -> float | None:
        """Measured tokens/s as a fraction of the roofline's."""
        if not self.pred_tok_s or self.tok_s is None:
            return None
        return self.tok_s / self.pred_tok_s


@dataclass(frozen=True)
class SweepPoint:
    label: str
    tok_s: float | None
    tpot_ms: float | None
    ttft_ms: float | None
    pred_tok_s: float | None
    pred_tpot_ms: float | None

    @classmethod
    def from_row(cls, row: RunRow) -> SweepPoint:
        k = row.knobs
        label = f"{k.rate:g}qps" if k.load == "qps" else f"s{k.slots}"
        return cls(label, row.tok_s, row.tpot_ms, row.ttft_ms, row.pred_tok_s, row.pred_tpot_ms)


@dataclass(frozen=True)
class View:
    version: int
    phase: str
    server: str
    url: str
    backend: str
    n_devices: int
    model: str
    applied: Knobs
    knobs: Knobs  # pending if any, else applied
    pending: dict  # changed keys -> new values
    hardware: str
    prediction_note: str | None
    slots_used: int | None
    run: int
    run_elapsed: float | None
    sweep_point: str  # "2/4 qps 4" while a sweep runs, else ""
    kpis: tuple[Kpi, ...]
    xs: tuple[float, ...]  # latency time series (session seconds)
    ttft_p50: tuple[float, ...]
    ttft_p99: tuple[float, ...]
    tpot_p50: tuple[float, ...]
    pred_ttft_ms: float | None
    pred_tpot_ms: float | None
    spark_tok_s: tuple[float, ...]
    spark_queue: tuple[float, ...]
    spark_occupancy: tuple[float, ...]
    spark_kv: tuple[float, ...]
    prediction: Prediction | None
    meas_flops_per_chip: float | None
    mem_weights: float | None  # measured bytes per chip
    mem_kv: float | None
    mem_capacity: float | None
    runs: tuple[RunRow, ...]
    sweep: tuple[SweepPoint, ...]


def _get(d: dict, *path: str) -> float | None:
    for key in path:
        if not isinstance(d, dict):
            return None
        d = d.get(key)
    return float(d) if isinstance(d, (int, float)) and not isinstance(d, bool) else None


def _latest(windows: list[dict], *path: str) -> float | None:
    for w in reversed(windows):
        value = _get(w, *path)
        if value is not None:
            return value
    return None


def build_view(m: MetricsModel) -> View:
    pred = m.prediction()
    applied_pred = m.prediction(m.run_knobs or m.applied)
    run_windows = [w for _, w in list(m.windows)[-m.run_windows :]] if m.run_windows else []
    summ = m.summary or {}

    def measured(path: tuple[str, str], summary_key: str) -> float | None:
        value = _latest(run_windows, *path)
        return value if value is not None else _get(summ, summary_key)

    recent = [w.get("output_tok_s") for w in run_windows[-5:]]
    recent = [float(x) for x in recent if isinstance(x, (int, float))]
    tok_s = sum(recent) / len(recent) if recent else _get(summ, "output_throughput")
    step = _get(m.stats, "step_times_ms", "generate", "per_token_mean")
    w_dev = _get(m.stats, "memory", "weight_bytes_per_device")
    kv_dev = _get(m.stats, "memory", "kv_cache_bytes_per_device")
    mem = None if w_dev is None or kv_dev is None else w_dev + kv_dev
    p = pred
    kpis = (
        Kpi("TTFT p50", "ms", p and p.ttft_ms, measured(("ttft_ms", "p50"), "median_ttft_ms")),
        Kpi("TTFT p99", "ms", p and p.ttft_ms, measured(("ttft_ms", "p99"), "p99_ttft_ms")),
        Kpi("TPOT p50", "ms", p and p.tpot_ms, measured(("tpot_ms", "p50"), "median_tpot_ms")),
        Kpi("TPOT p99", "ms", p and p.tpot_ms, measured(("tpot_ms", "p99"), "p99_tpot_ms")),
        Kpi("decode step", "ms", p and p.tpot_ms, step),
        Kpi("output tok/s", "tok/s", p and p.tok_s, tok_s),
        Kpi("mem/chip", "B", p and p.mem_per_chip, mem),
    )
    series = [(t, w) for t, w in m.windows if _get(w, "ttft_ms", "p50") is not None]
    devices = m.stats.get("devices") or []
    capacity = _get(devices[0], "memory", "bytes_limit") if devices else None
    if capacity is None and pred is not None:
        capacity = pred.hbm_bytes
    slots = m.stats.get("slots") or {}
    total = float(slots.get("total") or m.applied.slots)
    chips = (m.run_knobs or m.applied).chips
    meas_flops = None
    if applied_pred is not None and tok_s is not None:
        meas_flops = applied_pred.flops_per_token * tok_s / chips
    last_t = run_windows[-1].get("t") if run_windows else None
    pending = m.pending.server_changes(m.applied) if m.pending else {}
    if m.pending:
        pending |= {k: v for k, v in m.pending.to_dict().items() if v != getattr(m.applied, k)}
    return View(
        version=m.version,
        phase=m.phase,
        server=m.server,
        url=m.url,
        backend=_backend_label(m.stats),
        n_devices=m.n_devices,
        model=m.model_name,
        applied=m.applied,
        knobs=m.knobs,
        pending=pending,
        hardware=(pred.hardware if pred else m.hardware(m.knobs.hardware)[0] or "auto"),
        prediction_note=m.prediction_error() or m.hardware(m.knobs.hardware)[2],
        slots_used=slots.get("used"),
        run=m.run_id,
        run_elapsed=float(last_t) if isinstance(last_t, (int, float)) else None,
        sweep_point=m.sweep_point if m.phase == "sweeping" else "",
        kpis=kpis,
        xs=tuple(t for t, _ in series),
        ttft_p50=tuple(_get(w, "ttft_ms", "p50") or 0.0 for _, w in series),
        ttft_p99=tuple(_get(w, "ttft_ms", "p99") or 0.0 for _, w in series),
        tpot_p50=tuple(_get(w, "tpot_ms", "p50") or 0.0 for _, w in series),
        pred_ttft_ms=p and p.ttft_ms,
        pred_tpot_ms=p and p.tpot_ms,
        spark_tok_s=tuple(float(w.get("output_tok_s") or 0.0) for _, w in m.windows)[-120:],
        spark_queue=tuple(_get(s, "requests", "waiting") or 0.0 for s in m.stats_hist)[-120:],
        spark_occupancy=tuple(
            (_get(s, "slots", "used") or 0.0) / max(1.0, _get(s, "slots", "total") or total)
            for s in m.stats_hist
        )[-120:],
        spark_kv=tuple(_get(s, "kv_cache_usage_perc") or 0.0 for s in m.stats_hist)[-120:],
        prediction=pred,
        meas_flops_per_chip=meas_flops,
        mem_weights=w_dev,
        mem_kv=kv_dev,
        mem_capacity=capacity,
        runs=tuple(m.runs),
        sweep=tuple(m.sweep),
    )


def _backend_label(stats: dict) -> str:
    """`cpu`, or `cpu+native` when the generate engine runs the native CPU kernels."""
    backend = str(stats.get("backend") or "?")
    generate = (stats.get("mesh") or {}).get("generate") or {}
    return backend + "+native" if generate.get("kernels") == "native" else backend
