"""Frozen views of the TUI model, one per panel; panels get these and never the model itself.

Every KPI has three levels: the floor (the roofline on the chosen spec), the expectation (our
scheduler simulated on this host's fitted cost model, else assumed efficiencies) and the
measurement, with measured / expected beside them. Each KPI has a stable `key` (`View.kpi`).

Measured numbers cover the current run's last POOL_WINDOWS loadgen windows (1 s each): latency
percentiles pooled over them (a window's percentile counts once per request it completed, as
window lines carry percentiles, not each request's times), else the newest window of the run
that has them, else the last summary; tokens/s as the mean of those windows; decode step from
/stats `step_times_ms.generate.per_token_mean` (the server's own 5 s window); memory per chip
from /stats `memory.*_per_device`, and the KV capacity (max slots) from those bytes.

Expected latencies and tokens/s are the same part of the simulated run (`tui/simrun.py`): its
completions from the run's completion number on, in the pooled windows' counts, and its output
tokens over the pooled windows' seconds, so a closed loop's first wave is compared with itself.
Pending knobs show the whole simulated run of those knobs; so does a part that is empty.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from scaletui.latency import pooled
from scaletui.records import LoadSummary, LoadWindow, StatsSnapshot, number
from scaletui.tui.expect import Expectation
from scaletui.tui.knobs import Knobs, Precision
from scaletui.tui.kpi import (
    Kpi,
    band_words,
    dcn_words,
    processes_words,
    speed_factors,
    speed_note,
    speed_words,
    with_as_run,
    with_bands,
)
from scaletui.tui.predict import Prediction
from scaletui.tui.rows import RunRow, SweepPoint
from scaletui.tui.state import SessionState

POOL_WINDOWS = 5  # measured KPIs pool the run's last 5 loadgen windows (5 s)


@dataclass(frozen=True)
class View:
    version: int
    phase: str
    server: str
    url: str
    backend: str
    n_devices: int
    processes: str  # '2 processes × 2' (devices each) over several, else ''
    dcn_note: str | None  # the floor's DCN term of the step, over several processes
    model: str
    applied: Knobs
    knobs: Knobs  # pending if any, else applied
    pending: dict  # changed keys -> new values
    precision_applied: Precision  # what the server runs: compute, weight and KV dtypes
    precision: Precision  # of `knobs` (a pending w/k edit shows here first)
    hardware: str
    prediction_note: str | None
    fit: str  # the cost model in use, for the status bar: "vm small f32 xla tp1 (...)"
    expected_note: str | None  # why the expectation is assumed, or why there is none
    speed_note: str | None  # the engine runs far off its fit's speed (the host's speed moved)
    band_note: str | None  # what the expected column's p10-p90 bands come from, or why none
    speed_line: str | None  # the server's speed factor against its fit, and the run column
    slots_used: int | None
    run: int
    run_elapsed: float | None
    sweep_point: str  # "2/4 qps 4" while a sweep runs, else ""
    kpis: tuple[Kpi, ...]
    xs: tuple[float, ...]  # latency time series (session seconds)
    ttft_p50: tuple[float, ...]
    ttft_p99: tuple[float, ...]
    tpot_p50: tuple[float, ...]
    exp_ttft_ms: float | None  # flat lines on the latency chart
    exp_tpot_ms: float | None
    spark_tok_s: tuple[float, ...]
    spark_queue: tuple[float, ...]
    spark_occupancy: tuple[float, ...]
    spark_kv: tuple[float, ...]
    prediction: Prediction | None
    expectation: Expectation | None
    meas_flops_per_chip: float | None
    mem_weights: float | None  # measured bytes per chip
    mem_kv: float | None
    mem_capacity: float | None
    mem_max_slots: int | None  # measured KV capacity: slots of max_seq_len that fit in capacity
    kv_pages: dict  # /stats kv_pages: pages used / total / cached, prefix hits, preemptions
    runs: tuple[RunRow, ...]
    sweep: tuple[SweepPoint, ...]
    sweep_curve: tuple[tuple[float, float], ...]  # expected (tok/s, TPOT p50 ms) on a finer grid

    def kpi(self, key: str) -> Kpi:
        """The KPI with this stable key (KeyError naming it when there is none)."""
        for k in self.kpis:
            if k.key == key:
                return k
        raise KeyError(f"no KPI {key!r}; keys: {[k.key for k in self.kpis]}")


def build_view(m: SessionState) -> View:
    """What every panel shows, from the state alone (changes nothing)."""
    got = m.prediction_or_error()
    pred = p = got if isinstance(got, Prediction) else None
    applied_pred = m.prediction(m.run_knobs or m.applied)
    run = list(m.windows)[-m.run_windows :] if m.run_windows else []
    run_windows = [w for _, w, _ in run]
    pool = run[-POOL_WINDOWS:]
    summ = m.summary

    def measured(
        pick: Callable[[LoadWindow], float | None],
        q: float,
        pick_summary: Callable[[LoadSummary], float | None],
    ) -> float | None:
        """Pooled over the run's last POOL_WINDOWS windows, else the newest window of this
        run that has the value, else the run's summary."""
        value = pooled([(pick(w), n) for _, w, n in pool if pick(w) is not None], q)
        if value is not None:
            return value
        for w in reversed(run_windows):
            if pick(w) is not None:
                return pick(w)
        return pick_summary(summ) if summ is not None else None

    recent = [w.output_tok_s for _, w, _ in pool if w.output_tok_s is not None]
    tok_s = sum(recent) / len(recent) if recent else (summ and summ.output_throughput)
    # the same requests simulated: the run's completions from number `first`, window by window
    same = m.expectation(m.run_knobs) if m.run_knobs is not None and not m.pending else None
    sim_run = same.run if same is not None else None
    first = sum(n for _, _, n in run[: len(run) - len(pool)])
    counts = [n for _, _, n in pool]
    ends = [w.t for _, w, _ in pool if w.t is not None]
    span = (ends[0] - pool[0][1].window_s, ends[-1]) if len(ends) == len(pool) > 0 else None

    def expected(whole: float | None, metric: str, q: float) -> float | None:
        """The simulated run's part that the pool measures, else the whole run's percentile."""
        part = sim_run.latency(metric, q, first, counts) if sim_run and pool else None
        return whole if part is None else part

    stats = m.stats
    w_dev, kv_dev = stats.weight_bytes_per_device, stats.kv_bytes_per_device
    mem = None if w_dev is None or kv_dev is None else w_dev + kv_dev
    exp_got = m.expectation_or_error()
    e = exp_got if isinstance(exp_got, Expectation) else None
    latency = (  # key, label, floor, expected, from a window, percentile, from the summary
        (
            "ttft_p50",
            "TTFT p50",
            p and p.ttft_ms,
            e and expected(e.ttft_p50_ms, "ttft", 50),
            lambda w: w.ttft_ms.p50,
            50,
            lambda s: s.median_ttft_ms,
        ),
        (
            "ttft_p99",
            "TTFT p99",
            p and p.ttft_ms,
            e and expected(e.ttft_p99_ms, "ttft", 99),
            lambda w: w.ttft_ms.p99,
            99,
            lambda s: s.p99_ttft_ms,
        ),
        (
            "tpot_p50",
            "TPOT p50",
            p and p.tpot_ms,
            e and expected(e.tpot_p50_ms, "tpot", 50),
            lambda w: w.tpot_ms.p50,
            50,
            lambda s: s.median_tpot_ms,
        ),
        (
            "tpot_p99",
            "TPOT p99",
            p and p.tpot_ms,
            e and expected(e.tpot_p99_ms, "tpot", 99),
            lambda w: w.tpot_ms.p99,
            99,
            lambda s: s.p99_tpot_ms,
        ),
    )
    exp_tok_s = e and e.tok_s
    if sim_run is not None and span is not None and recent:
        exp_tok_s = sim_run.tok_s(*span) or exp_tok_s
    decode = Kpi(
        "decode_step",
        "decode step",
        "ms",
        p and p.tpot_ms,
        e and e.decode_step_ms,
        stats.step_per_token_ms,
    )
    kpis = (
        *(
            Kpi(key, label, "ms", fv, ev, measured(fw, q, fs))
            for key, label, fv, ev, fw, q, fs in latency
        ),
        decode,
        Kpi("tok_s", "output tok/s", "tok/s", p and p.tok_s, exp_tok_s, tok_s),
        # memory is counted, not timed: what the server allocates is the expectation too
        Kpi("mem", "mem/chip", "B", p and p.mem_per_chip, p and p.mem_per_chip, mem),
    )
    parts = (first, counts if pool else None, span if recent else None)
    if e is not None:  # each expected figure's band: the same part of the ends' runs
        kpis = with_bands(kpis, e, *parts)
    as_run, why_not = as_run_of(m, e)
    if as_run is not None:  # the same part of the run simulated at the measured speed
        kpis = with_as_run(kpis, as_run, *parts)
    fit, expected_note = fit_words(m, exp_got)
    series = [(t, w) for t, w, _ in m.windows if w.ttft_ms.p50 is not None]
    capacity = stats.device_bytes_limit
    if capacity is None and pred is not None:
        capacity = pred.hbm_bytes
    max_slots = None
    if capacity and w_dev is not None and kv_dev:  # KV per device grows with the slots
        slots = number(stats.config, "slots") or m.applied.slots
        max_slots = max(0, int(slots * (capacity - w_dev) / kv_dev))
    chips = (m.run_knobs or m.applied).chips
    meas_flops = None
    if applied_pred is not None and tok_s is not None:
        meas_flops = applied_pred.flops_per_token * tok_s / chips
    last_t = run_windows[-1].t if run_windows else None
    pending = m.pending.server_changes(m.applied) if m.pending else {}
    if m.pending:
        applied = m.applied.to_dict()
        pending |= {k: v for k, v in m.pending.to_dict().items() if v != applied[k]}
    hist = list(m.stats_hist)[-120:]
    return View(
        version=m.version,
        phase=m.phase,
        server=m.server,
        url=m.url,
        backend=backend_label(stats),
        n_devices=m.n_devices,
        processes=processes_words(stats.processes),
        dcn_note=pred and dcn_words(pred.dcn_ms, pred.crosses_hosts, len(stats.processes)),
        model=m.model_name,
        applied=m.applied,
        knobs=m.knobs,
        pending=pending,
        precision_applied=m.precision(m.applied),
        precision=m.precision(),
        hardware=m.hardware.name,
        prediction_note=got if isinstance(got, str) else m.hardware.note,
        fit=fit,
        expected_note=expected_note,
        speed_note=speed_note(decode, e is not None and e.fit.source == "fit" and not m.pending),
        band_note=e and e.band_note and band_words(e.band_note, any(k.band for k in kpis)),
        speed_line=speed_words(stats.speed, as_run is not None, why_not),
        slots_used=None if stats.slots_used is None else int(stats.slots_used),
        run=m.run_id,
        run_elapsed=last_t,
        sweep_point=m.sweep_point if m.phase == "sweeping" else "",
        kpis=kpis,
        xs=tuple(t for t, _ in series),
        ttft_p50=tuple(w.ttft_ms.p50 or 0.0 for _, w in series),
        ttft_p99=tuple(w.ttft_ms.p99 or 0.0 for _, w in series),
        tpot_p50=tuple(w.tpot_ms.p50 or 0.0 for _, w in series),
        exp_ttft_ms=e and e.ttft_p50_ms,
        exp_tpot_ms=e and e.tpot_p50_ms,
        spark_tok_s=tuple(w.output_tok_s or 0.0 for _, w, _ in m.windows)[-120:],
        spark_queue=tuple(s.waiting or 0.0 for s in hist),
        spark_occupancy=tuple(s.occupancy for s in hist),
        spark_kv=tuple(s.kv_usage or 0.0 for s in hist),
        prediction=pred,
        expectation=e,
        meas_flops_per_chip=meas_flops,
        mem_weights=w_dev,
        mem_kv=kv_dev,
        mem_capacity=capacity,
        mem_max_slots=max_slots,
        kv_pages=stats.kv_pages,
        runs=tuple(m.runs),
        sweep=tuple(m.sweep),
        sweep_curve=m.sweep_curve(),
    )


def fit_words(m: SessionState, got: Expectation | str) -> tuple[str, str | None]:
    """(the status bar's fit label, the KPI panel's note on the expectation or None)."""
    if isinstance(got, str):
        label, note = "none", got
    else:
        label, note = got.fit.label, got.fit.note
    if m.fit == "running":
        label = "fitting this server now (assumed until it ends)"
        note = note and f"{note} (fitting now)"
    elif m.fit.startswith("failed") and (isinstance(got, str) or got.fit.source == "assumed"):
        label = "failed (assumed efficiencies)"
    return label, note


def as_run_of(m: SessionState, e: Expectation | None) -> tuple[Expectation | None, str | None]:
    """(the run's expectation at the server's measured speed factors, or why there is none)."""
    factors = speed_factors(m.stats.speed)
    if factors is None or e is None:
        return None, None
    if m.pending:
        return None, "pending knobs"
    if e.fit.source != "fit" or e.fit.path is None:
        return None, "the expectation is not on this host's fit"
    if Path(m.stats.speed["fit"]) != e.fit.path:
        return None, f"the server's fit is another one ({Path(m.stats.speed['fit']).name})"
    got = m.expectation_or_error(m.run_knobs, speed=factors)
    return (got, None) if isinstance(got, Expectation) else (None, got)


def backend_label(stats: StatsSnapshot) -> str:
    """`cpu`, or `cpu+native` when the generate engine runs the native CPU kernels (`gpu+pallas`
    on JAX's Pallas paged attention)."""
    return stats.backend + (f"+{stats.kernels}" if stats.kernels in ("native", "pallas") else "")


def redraw_keys(v: View) -> dict[str, tuple]:
    """Per panel (by CSS id), the view fields it draws from: a panel is redrawn only when its
    key changed (the App adds the sizes of the panels that draw to their size)."""
    notes = (v.prediction_note, v.expected_note, v.speed_note, v.band_note, v.speed_line)
    return {
        "#status": (
            v.phase,
            v.server,
            v.backend,
            v.n_devices,
            v.processes,
            v.model,
            v.applied,
            v.knobs,
            v.slots_used,
            v.run,
            v.run_elapsed,
            v.sweep_point,
            v.fit,
            v.precision_applied,
        ),
        "#knobs": (v.applied, v.knobs, v.hardware, v.precision_applied, v.precision),
        "#kpis": (v.kpis, v.pending, *notes, v.dcn_note),
        "#memory": (v.mem_weights, v.mem_kv, v.mem_capacity, v.mem_max_slots, v.prediction),
        "#latency": (v.xs, v.ttft_p50, v.exp_ttft_ms, v.exp_tpot_ms),
        "#strips": (v.spark_tok_s, v.spark_queue, v.spark_occupancy, v.spark_kv),
        "#roofline": (v.prediction, v.meas_flops_per_chip),
        "#sweep": (v.sweep, v.sweep_curve),
        "#runs": (len(v.runs),),
    }
