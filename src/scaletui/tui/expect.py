"""The expectation: our own scheduler simulated (`roofline.simulate`) on a cost model of this host.

The cost model is the stored fit for the server's configuration (`fitstore.find_fit`: model,
precision, tp, dp, kernels; written by `scaletui calibrate --model M`), else the hardware spec's
roofs times assumed efficiencies (`CostModel.assumed`, at the same precision), said plainly. The
precision is the knobs' (a pending `w`/`k` edit), else the server's. The load is the TUI's
own, drawn by loadgen's own `schedule` with the run's flags and seed 0, so the same request
list: input/output lengths uniform within the knobs' spread (the server prepends a BOS token to
each prompt), a closed loop at the knobs' concurrency or Poisson offsets at the knobs' rate, a
few hundred requests. Results are memoized on every input, the fits'
`generation` included (the session bumps it whenever a fit is written), as `predict_cached` does.
Each expectation carries its p10-p90 band (roofline/band.py): the same load simulated at the
spread's fast and slow ends, the spread being the spec's measured one (`local`'s
`measured.spread`) and the fit's residuals; a sweep's curve asks for the point alone.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from scaletui import specs
from scaletui.dtypes import Precision
from scaletui.loadgen.workload import Lengths, Workload, schedule
from scaletui.placement import Placement
from scaletui.roofline import speedlog
from scaletui.roofline.band import SpeedFactors, SpeedSpread
from scaletui.roofline.costmodel import CostModel
from scaletui.roofline.dcn import with_dcn
from scaletui.roofline.fitstore import fits_dir, load_fit
from scaletui.roofline.simband import simulate_at, simulate_band
from scaletui.roofline.simrecords import BOS_TOKENS as BOS
from scaletui.roofline.simrecords import (
    HOST_GAP_PER_ROW_S,
    HOST_GAP_S,
    INTAKE_S,
    Load,
    SimTiming,
)
from scaletui.roofline.simulate import simulate
from scaletui.shape import ServerShape
from scaletui.tui.host import FitKey, kernels_of, serve_max_seq_len
from scaletui.tui.knobs import Knobs
from scaletui.tui.predict import host_devices
from scaletui.tui.simrun import SimRun

ASSUMED_EFFICIENCY = 0.5  # no fit: this fraction of the spec's bandwidth and FLOP/s
TOKEN_CHUNKS = 12_000  # simulated requests x generate calls each: about 20 ms of simulation
SWEEP_POINTS = 10  # points of the expected curve across a sweep's range


def server_shape(
    config: dict, knobs: Knobs, model: specs.ModelSpec, backend: str | None = None
) -> ServerShape:
    """The server the knobs describe: /stats "config" (what runs) with the knobs' server keys
    (a staged edit) applied. What /stats lacks (no server yet) is as the embedded server will
    start: max_seq_len for the knobs' lengths, f32 on a CPU backend, else bf16, weights and KV
    as the compute dtype. The kernels are those that run now (`kernels_running`), unless the
    mesh moves. ValueError (ConfigError) for a shape the server would refuse."""
    same_mesh = (knobs.tp, knobs.dp) == (config.get("tp", 1), config.get("dp", 1))
    runs = {
        "max_seq_len": config.get("max_seq_len") or serve_max_seq_len(knobs, model.max_seq_len),
        "dtype": config.get("dtype") or start_dtype(backend),
        "kernels": kernels_of(config) if same_mesh else config.get("kernels") or "auto",
    }
    return knobs.shape(ServerShape.from_json({**config, **runs}, model))


@dataclass(frozen=True)
class FitChoice:
    """The cost model the expectation uses, in words: `label` for the status bar ("vm small f32
    xla tp1 (2026-12-01 02:08, 41 s)" or "none (assumed efficiencies)"), `note` for the KPI
    panel when it is not a fit."""

    source: str  # fit | assumed
    label: str
    note: str | None = None
    path: Path | None = None


@dataclass(frozen=True)
class Expectation:
    """What loadgen should measure, by the simulation: its summary keys, and the decode step
    as the server times it (a generate call / its steps, averaged over the calls, every slot
    row over the KV bucket)."""

    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    decode_step_ms: float
    tok_s: float | None
    mean_batch: float | None  # running requests per generate call
    fit: FitChoice
    run: SimRun | None = field(default=None, compare=False, repr=False)  # request by request
    # the p10-p90 band: {summary key: [low, high]} over the spread's ends, the ends' runs
    # request by request (None: no width, or not asked), and where the spread came from
    band: dict = field(default_factory=dict, compare=False, repr=False)
    ends: tuple[SimRun, SimRun] | None = field(default=None, compare=False, repr=False)
    band_note: str = ""

    def band_for(
        self, key: str, point: float | None, part: Callable[[SimRun], float | None] | None = None
    ) -> tuple[float, float] | None:
        """The band of the figure shown as `point`: over the point and the ends' `part` (the
        same part of each simulated run) where the ends give one, else the whole run's band of
        summary `key`. None without width."""
        if point is None:
            return None
        got = [part(run) for run in self.ends] if part and self.ends else [None]
        if all(x is not None for x in got):
            lo, hi = min(point, *got), max(point, *got)
        elif key in self.band:
            lo, hi = self.band[key]
            lo, hi = min(lo, point), max(hi, point)
        else:
            return None
        return (lo, hi) if hi > lo else None


def start_dtype(backend: str | None) -> str:
    """The compute dtype the embedded server starts with: f32 on a CPU backend, else bf16."""
    return "f32" if backend in (None, "cpu", "?") else "bf16"


def fit_key(shape: ServerShape) -> FitKey:
    """The fit of the server `shape` describes, precision included (its `fit_key()`)."""
    return FitKey(**shape.fit_key())


def fit_label(cost: CostModel) -> str:
    """'vm small f32 xla tp1 (2026-12-01 02:08, 41 s)' from a fitted cost model; a precision
    that is not uniform reads 'f32·w int8'."""
    info = cost.info or {}
    precision = Precision(cost.dtype, cost.weight_dtype, cost.kv_dtype)
    mesh = f"tp{cost.tp}" + (f" dp{cost.dp}" if cost.dp > 1 else "")
    when = str(info.get("date") or "undated")
    with contextlib.suppress(ValueError):  # not ISO: shown as written
        when = dt.datetime.fromisoformat(when).strftime("%Y-%m-%d %H:%M")
    took = info.get("seconds")
    took = f", {float(took):.0f} s" if isinstance(took, (int, float)) else ""
    host = f"{info['host']} " if info.get("host") else ""
    return f"{host}{cost.model} {precision.label()} {cost.kernels} {mesh} ({when}{took})"


def cost_models(
    hardware: specs.HardwareSpec | None, knobs: Knobs, shape: ServerShape, use_fits: str | None
) -> tuple[CostModel, CostModel, FitChoice]:
    """(decode, prefill, choice) for `shape` (the knobs' server). `use_fits` None looks for this
    host's fit; otherwise it is why fits do not apply (a what-if spec, a remote server) and the
    costs are assumed. ValueError when there is neither a fit nor a hardware spec."""
    if use_fits is None:
        path = fit_key(shape).find()
        if path is not None:
            cost = load_fit(path)  # ValueError naming the file when it is not a cost model
            return cost, cost, FitChoice("fit", fit_label(cost), None, path)
        precision = shape.precision
        shown = "" if precision.uniform else f" ({precision.label()})"
        why = f"no fit for this configuration{shown} yet"
    else:
        why = use_fits
    if hardware is None:
        raise ValueError(f"no hardware spec to assume costs on ({why})")
    p, model = shape.precision, shape.model
    devices = host_devices(knobs)
    dispatch = (hardware.extra.get("measured") or {}).get("dispatch_s") or 0.0
    kw = dict(
        dtype=p.compute,
        weight_dtype=p.weights,
        kv_dtype=p.kv,
        efficiency=ASSUMED_EFFICIENCY,
        overhead_s=float(dispatch),
        kernels=shape.kernels,
        host_devices=devices,
    )
    decode = CostModel.assumed(model, hardware, tp=knobs.tp, dp=knobs.dp, **kw)
    prefill = decode
    if knobs.mode == "disaggregated":
        pre = knobs.prefill_devices or knobs.chips
        prefill = CostModel.assumed(model, hardware, tp=knobs.tp, dp=max(pre // knobs.tp, 1), **kw)
    note = f"expected: assumed efficiencies, {why}"
    return decode, prefill, FitChoice("assumed", "none (assumed efficiencies)", note)


def tui_workload(knobs: Knobs) -> Workload:
    """The workload a TUI run sends (`LoadRunner.command`'s loadgen flags, seed 0)."""
    dist = "uniform" if knobs.length_spread else "fixed"
    return Workload(
        input=Lengths(knobs.input_len, dist, knobs.input_spread),
        output=Lengths(knobs.output_len, dist, knobs.output_spread),
        qps=knobs.rate if knobs.load == "qps" else None,
        concurrency=None if knobs.load == "qps" else knobs.concurrency,
    )


def tui_load(knobs: Knobs, shape: ServerShape, budget: int = TOKEN_CHUNKS) -> Load:
    """The TUI's load as loadgen sends it: closed loop at the knobs' concurrency (16 waves of
    it), or Poisson arrivals at the knobs' rate; as many requests as `budget` generate-call
    chunks allow, at least 32."""
    chunks = math.ceil(knobs.output_len / shape.decode_steps)
    most = max(32, budget // chunks)
    closed = knobs.load != "qps"
    n = max(32, min(16 * knobs.concurrency, 512, most)) if closed else min(100, most)
    offsets, inp, out = schedule(tui_workload(knobs), n)
    return Load(
        offsets,
        inp + BOS,
        out,
        concurrency=knobs.concurrency if closed else None,
        closed_loop=closed,
        requested_rate=None if closed else knobs.rate,
    )


def decode_step_s(cost: CostModel, knobs: Knobs, shape: ServerShape) -> float:
    """A generate call of `decode_steps` steps over every slot row, divided by its steps, at
    the KV bucket the longest request reaches: the decode step when the simulation ran no
    generate call (else its `mean_step_ms`, averaged over its calls as /stats
    `per_token_mean` averages the server's)."""
    need = min(knobs.longest + BOS, shape.max_seq_len)
    ctx = next((b for b in shape.decode_buckets if b >= need), shape.decode_buckets[-1])
    return cost.decode_call_s(shape.slots, ctx, shape.decode_steps) / shape.decode_steps


def expect(
    hardware: specs.HardwareSpec | None,
    knobs: Knobs,
    shape: ServerShape,
    use_fits: str | None = None,
    budget: int = TOKEN_CHUNKS,
    band: bool = True,
    speed: SpeedFactors | None = None,
    placement: Placement | None = None,
) -> Expectation:
    """Simulate the knobs' load on the server they describe, `shape` (`server_shape`; ValueError:
    why not); with `band`, at the measured spread's two ends too; at `speed` (the server's
    measured factors: "as run"), the point alone at that speed. With a `placement` over
    processes, each call also pays its DCN term (`roofline.dcn.with_dcn`, as `scaletui
    simulate --hosts` does: a one-host fit cannot hold it)."""
    decode, prefill, choice = cost_models(hardware, knobs, shape, use_fits)
    if placement is not None and hardware is not None:
        decode, prefill = (with_dcn(c, shape.model, hardware, placement) for c in (decode, prefill))
    if knobs.longest + BOS > shape.max_seq_len:
        raise ValueError(
            f"the longest input + output + BOS = {knobs.longest + BOS} ({knobs.lengths_label()}) "
            f"is past the server's max_seq_len {shape.max_seq_len}: requests would fail"
        )
    load = tui_load(knobs, shape, budget)
    host = SimTiming(intake_s=INTAKE_S, gap_s=HOST_GAP_S, gap_per_row_s=HOST_GAP_PER_ROW_S)
    if speed is None:
        result = simulate(shape, decode, load, prefill, timing=host)  # as our server's host pays
    else:  # the same request list, each call's time by its kind's measured factor
        result = simulate_at(shape, decode, load, speed, prefill, timing=host)
    s = result.summary
    spread = spread_of(hardware, decode) if band and speed is None else SpeedSpread()
    banded = simulate_band(shape, decode, load, spread, prefill, timing=host, point=result)
    ms = lambda key: s.get(key)  # noqa: E731 - None when nothing completed
    return Expectation(
        ttft_p50_ms=ms("median_ttft_ms"),
        ttft_p99_ms=ms("p99_ttft_ms"),
        tpot_p50_ms=ms("median_tpot_ms"),
        tpot_p99_ms=ms("p99_tpot_ms"),
        decode_step_ms=s.get("mean_step_ms") or decode_step_s(decode, knobs, shape) * 1e3,
        tok_s=s.get("output_throughput"),
        mean_batch=s.get("mean_running_batch"),
        fit=choice,
        run=SimRun.of(result, load.output_len),
        band=banded.band,
        ends=tuple(SimRun.of(r, load.output_len) for r in banded.ends) or None,  # type: ignore[arg-type]
        band_note=spread.note if band and speed is None else "",
    )


def spread_of(hardware: specs.HardwareSpec | None, cost: CostModel) -> SpeedSpread:
    """The band's spread: the spec's measured one (`local`'s; none for a spec not measured here
    or calibrated before it), a fit's residuals and the server's past runs against it (none for
    assumed costs)."""
    host = (hardware.extra.get("measured") or {}).get("spread") if hardware else None
    try:
        return speedlog.spread_of(host, cost)
    except ValueError as exc:  # a hand-edited spec: the point, and why there is no band
        return SpeedSpread(note=f"no band: {exc}")


MEMO_ENTRIES = 96  # each holds its simulated runs request by request (3 with a band): ~1 MB
_MEMO: dict[tuple, Expectation | str] = {}


def expect_cached(
    hardware: specs.HardwareSpec | None,
    knobs: Knobs,
    shape: ServerShape,
    use_fits: str | None = None,
    generation: int = 0,
    budget: int = TOKEN_CHUNKS,
    band: bool = True,
    speed: SpeedFactors | None = None,
    placement: Placement | None = None,
) -> Expectation | str:
    """`expect`, memoized (the render tick asks for the same few every second; `generation`
    changes when a fit is written), or why there is none, in words."""
    key = (repr(hardware), knobs, shape, use_fits, generation, budget, band, speed, fits_dir())
    key += (placement,)
    if key not in _MEMO:
        if len(_MEMO) >= MEMO_ENTRIES:
            _MEMO.clear()
        try:
            _MEMO[key] = expect(hardware, knobs, shape, use_fits, budget, band, speed, placement)
        except (ValueError, KeyError, specs.SpecError) as exc:
            _MEMO[key] = f"no expectation: {exc}"
    return _MEMO[key]


def sweep_grid(values: list[float], integer: bool, points: int = SWEEP_POINTS) -> list[float]:
    """About `points` values from min to max of `values`, evenly spaced on a log scale (and
    the sweep's own values), as integers when `integer` (every one when that is fewer)."""
    lo, hi = min(values), max(values)
    if integer and hi - lo < points:
        return [float(v) for v in range(max(1, round(lo)), round(hi) + 1)]
    grid = set(values)
    if hi > lo > 0:
        grid |= {lo * (hi / lo) ** (i / (points - 1)) for i in range(points)}
    if integer:
        grid = {float(max(1, round(v))) for v in grid}
    return sorted(grid)
