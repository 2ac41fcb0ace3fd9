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
"""

from __future__ import annotations

import contextlib
import datetime as dt
import math
from dataclasses import dataclass, field
from pathlib import Path

from scaletui import specs
from scaletui.loadgen.workload import Lengths, Workload, schedule
from scaletui.roofline.costmodel import DTYPE_BYTES, CostModel
from scaletui.roofline.fitstore import fits_dir, load_fit
from scaletui.roofline.simulate import BOS_TOKENS as BOS
from scaletui.roofline.simulate import (
    HOST_GAP_PER_ROW_S,
    HOST_GAP_S,
    INTAKE_S,
    Load,
    ServerShape,
    simulate,
)
from scaletui.tui.host import FitKey, kernels_of, serve_max_seq_len
from scaletui.tui.knobs import Knobs, Precision
from scaletui.tui.predict import host_devices
from scaletui.tui.simrun import SimRun

ASSUMED_EFFICIENCY = 0.5  # no fit: this fraction of the spec's bandwidth and FLOP/s
TOKEN_CHUNKS = 12_000  # simulated requests x generate calls each: about 20 ms of simulation
SWEEP_POINTS = 10  # points of the expected curve across a sweep's range


@dataclass(frozen=True)
class ServerConfig:
    """The server settings an expectation needs beyond the knobs (from /stats "config")."""

    max_seq_len: int = 1024
    decode_steps: int = 4
    dtype: str = "f32"  # compute
    weight_dtype: str = "f32"  # weight storage: f32 | bf16 | int8
    kv_dtype: str = "f32"  # KV-cache storage: f32 | bf16 | int8
    kernels: str = "auto"
    min_prefill_bucket: int = 16
    max_prefill_bucket: int = 0  # 0 = max_seq_len
    max_waiting: int = 256
    max_waiting_tokens: int = 262144
    page_size: int = 64  # KV positions per page
    prefix_cache: bool = True

    @classmethod
    def from_stats(
        cls, config: dict, knobs: Knobs, model_max: int | None, backend: str | None = None
    ) -> ServerConfig:
        """From /stats "config" and the knobs' precision; what it lacks (no server yet) as
        the embedded server will start: max_seq_len for the knobs' lengths, f32 on a CPU
        backend, else bf16, weights and KV as the compute dtype."""
        buckets = [int(b) for b in config.get("prefill_buckets") or () if int(b) > 0]
        precision = Precision.of(knobs, config, str(config.get("dtype") or start_dtype(backend)))
        # what runs now says which kernels the staged configuration gets, unless the mesh moves
        same_mesh = (knobs.tp, knobs.dp) == (config.get("tp", 1), config.get("dp", 1))
        return cls(
            max_seq_len=int(config.get("max_seq_len") or serve_max_seq_len(knobs, model_max)),
            decode_steps=int(config.get("decode_steps") or 4),
            page_size=int(config.get("page_size") or 64),
            prefix_cache=bool(config.get("prefix_cache", True)),
            dtype=precision.compute,
            weight_dtype=precision.weights,
            kv_dtype=precision.kv,
            kernels=kernels_of(config) if same_mesh else str(config.get("kernels") or "auto"),
            min_prefill_bucket=min(buckets) if buckets else 16,
            max_prefill_bucket=max(buckets) if buckets else 0,
            max_waiting=int(config.get("max_waiting") or 256),
            max_waiting_tokens=int(config.get("max_waiting_tokens") or 262144),
        )


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


def start_dtype(backend: str | None) -> str:
    """The compute dtype the embedded server starts with: f32 on a CPU backend, else bf16."""
    return "f32" if backend in (None, "cpu", "?") else "bf16"


def fit_key(model: str, cfg: ServerConfig, knobs: Knobs) -> FitKey:
    """The fit of the server the knobs describe, precision included."""
    return FitKey(model, cfg.dtype, knobs.tp, knobs.dp, cfg.kernels, cfg.weight_dtype, cfg.kv_dtype)


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
    model: specs.ModelSpec,
    hardware: specs.HardwareSpec | None,
    knobs: Knobs,
    cfg: ServerConfig,
    use_fits: str | None,
) -> tuple[CostModel, CostModel, FitChoice]:
    """(decode, prefill, choice). `use_fits` None looks for this host's fit; otherwise it is why
    fits do not apply (a what-if spec, a remote server) and the costs are assumed. ValueError
    when there is neither a fit nor a hardware spec."""
    if use_fits is None:
        path = fit_key(model.name, cfg, knobs).find()
        if path is not None:
            cost = load_fit(path)  # ValueError naming the file when it is not a cost model
            return cost, cost, FitChoice("fit", fit_label(cost), None, path)
        precision = Precision(cfg.dtype, cfg.weight_dtype, cfg.kv_dtype)
        shown = "" if precision.uniform else f" ({precision.label()})"
        why = f"no fit for this configuration{shown} yet"
    else:
        why = use_fits
    if hardware is None:
        raise ValueError(f"no hardware spec to assume costs on ({why})")
    for dtype in (cfg.dtype, cfg.weight_dtype, cfg.kv_dtype):
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"no cost model for dtype {dtype!r}")
    devices = host_devices(knobs)
    dispatch = (hardware.extra.get("measured") or {}).get("dispatch_s") or 0.0
    kw = dict(
        dtype=cfg.dtype,
        weight_dtype=cfg.weight_dtype,
        kv_dtype=cfg.kv_dtype,
        efficiency=ASSUMED_EFFICIENCY,
        overhead_s=float(dispatch),
        kernels=cfg.kernels,
        host_devices=devices,
    )
    decode = CostModel.assumed(model, hardware, tp=knobs.tp, dp=knobs.dp, **kw)
    prefill = decode
    if knobs.mode == "disaggregated":
        pre = knobs.prefill_devices or knobs.chips
        prefill = CostModel.assumed(model, hardware, tp=knobs.tp, dp=max(pre // knobs.tp, 1), **kw)
    note = f"expected: assumed efficiencies, {why}"
    return decode, prefill, FitChoice("assumed", "none (assumed efficiencies)", note)


def server_shape(knobs: Knobs, cfg: ServerConfig) -> ServerShape:
    return ServerShape(
        slots=knobs.slots,
        max_seq_len=cfg.max_seq_len,
        decode_steps=cfg.decode_steps,
        mode=knobs.mode,
        min_prefill_bucket=cfg.min_prefill_bucket,
        max_prefill_bucket=cfg.max_prefill_bucket,
        max_waiting=cfg.max_waiting,
        max_waiting_tokens=cfg.max_waiting_tokens,
        page_size=cfg.page_size,
        prefix_cache=cfg.prefix_cache,
        max_batched_tokens=knobs.max_batched_tokens,  # the knob the TUI applies
        intake_s=INTAKE_S,
        gap_s=HOST_GAP_S,
        gap_per_row_s=HOST_GAP_PER_ROW_S,
    )


def tui_workload(knobs: Knobs) -> Workload:
    """The workload a TUI run sends (`LoadRunner.command`'s loadgen flags, seed 0)."""
    dist = "uniform" if knobs.length_spread else "fixed"
    return Workload(
        input=Lengths(knobs.input_len, dist, knobs.input_spread),
        output=Lengths(knobs.output_len, dist, knobs.output_spread),
        qps=knobs.rate if knobs.load == "qps" else None,
        concurrency=None if knobs.load == "qps" else knobs.concurrency,
    )


def tui_load(knobs: Knobs, cfg: ServerConfig, budget: int = TOKEN_CHUNKS) -> Load:
    """The TUI's load as loadgen sends it: closed loop at the knobs' concurrency (16 waves of
    it), or Poisson arrivals at the knobs' rate; as many requests as `budget` generate-call
    chunks allow, at least 32."""
    chunks = math.ceil(knobs.output_len / cfg.decode_steps)
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


def decode_step_s(cost: CostModel, knobs: Knobs, cfg: ServerConfig) -> float:
    """A generate call of `decode_steps` steps over every slot row, divided by its steps, at
    the KV bucket the longest request reaches: the decode step when the simulation ran no
    generate call (else its `mean_step_ms`, averaged over its calls as /stats
    `per_token_mean` averages the server's)."""
    shape = server_shape(knobs, cfg)
    need = min(knobs.longest + BOS, cfg.max_seq_len)
    ctx = next((b for b in shape.decode_buckets if b >= need), shape.decode_buckets[-1])
    return cost.decode_call_s(knobs.slots, ctx, cfg.decode_steps) / cfg.decode_steps


def expect(
    model: specs.ModelSpec,
    hardware: specs.HardwareSpec | None,
    knobs: Knobs,
    cfg: ServerConfig,
    use_fits: str | None = None,
    budget: int = TOKEN_CHUNKS,
) -> Expectation:
    """Simulate the knobs' load on the server they describe (ValueError: why not)."""
    decode, prefill, choice = cost_models(model, hardware, knobs, cfg, use_fits)
    if knobs.longest + BOS > cfg.max_seq_len:
        raise ValueError(
            f"the longest input + output + BOS = {knobs.longest + BOS} ({knobs.lengths_label()}) "
            f"is past the server's max_seq_len {cfg.max_seq_len}: requests would fail"
        )
    load = tui_load(knobs, cfg, budget)
    result = simulate(server_shape(knobs, cfg), decode, load, prefill)
    s = result.summary
    ms = lambda key: s.get(key)  # noqa: E731 - None when nothing completed
    return Expectation(
        ttft_p50_ms=ms("median_ttft_ms"),
        ttft_p99_ms=ms("p99_ttft_ms"),
        tpot_p50_ms=ms("median_tpot_ms"),
        tpot_p99_ms=ms("p99_tpot_ms"),
        decode_step_ms=s.get("mean_step_ms") or decode_step_s(decode, knobs, cfg) * 1e3,
        tok_s=s.get("output_throughput"),
        mean_batch=s.get("mean_running_batch"),
        fit=choice,
        run=SimRun.of(result, load.output_len),
    )


MEMO_ENTRIES = 256  # each holds its simulated run request by request: up to ~0.3 MB
_MEMO: dict[tuple, Expectation | str] = {}


def expect_cached(
    model: specs.ModelSpec,
    hardware: specs.HardwareSpec | None,
    knobs: Knobs,
    cfg: ServerConfig,
    use_fits: str | None = None,
    generation: int = 0,
    budget: int = TOKEN_CHUNKS,
) -> Expectation | str:
    """`expect`, memoized (the render tick asks for the same few every second; `generation`
    changes when a fit is written), or why there is none, in words."""
    key = (model, repr(hardware), knobs, cfg, use_fits, generation, budget, fits_dir())
    if key not in _MEMO:
        if len(_MEMO) >= MEMO_ENTRIES:
            _MEMO.clear()
        try:
            _MEMO[key] = expect(model, hardware, knobs, cfg, use_fits, budget)
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
