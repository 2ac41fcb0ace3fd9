"""The TUI's one piece of mutable state (plain Python, no Textual), changed only by its own
methods: `add(record)` for everything that arrives (server snapshots, loadgen windows and
summaries, controller events, which also carry the applied knobs, the phase and the fit's
progress), and `edit` / `discard` for the user's pending knobs. `version` grows on every change,
so the render tick redraws only when something moved; `views.build_view(state)` reads it and
changes nothing. Predictions come in two levels beside what loadgen measures: the floor
(`predict`, the roofline) and the expectation (`expect`, our scheduler simulated on a fitted or
assumed cost model). The records it keeps (events, run rows, sweep points) are `rows`'.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace

from scaletui import specs
from scaletui.dtypes import Precision
from scaletui.records import (
    LoadSummary,
    LoadWindow,
    Record,
    RecordKind,
    StatsSnapshot,
    number,
)
from scaletui.roofline.band import SpeedFactors
from scaletui.shape import ServerShape
from scaletui.tui.expect import (
    TOKEN_CHUNKS,
    Expectation,
    expect_cached,
    server_shape,
    start_dtype,
    sweep_grid,
)
from scaletui.tui.knobs import Knobs
from scaletui.tui.predict import (
    Prediction,
    model_spec_from,
    pick_hardware,
    placement_of,
    predict_cached,
)
from scaletui.tui.rows import Event, HardwareChoice, RunRow, SweepPoint

HISTORY = 300  # samples kept per series (5 min at 1 Hz)
BUSY_PHASES = ("calibrating", "starting", "reconfiguring", "sweeping", "fitting")


class SessionState:
    def __init__(
        self, knobs: Knobs | None = None, model_name: str = "small", phase: str = "starting"
    ) -> None:
        self.applied = knobs or Knobs()
        self.pending: Knobs | None = None  # None: no unapplied edits
        self.model_name = model_name
        # calibrating|starting|idle|reconfiguring|running|sweeping|done|error|replay
        self.phase = phase
        self.server = "starting"  # server status text for the status bar
        self.url = ""
        self.calibration = ""  # the controller's calibrate state: running|done|off|remote|failed
        # the controller's fit of this server: running | done (fitted, or a stored fit found) |
        # failed: why; "" before the server is up, and for servers it does not fit
        self.fit = ""
        self.fit_generation = 0  # grows whenever a fit may have been written: expectations redo
        self.stats = StatsSnapshot()
        self.stats_hist: deque[StatsSnapshot] = deque(maxlen=HISTORY)
        # (arrival t, window, requests it completed: its percentiles' weight when pooled)
        self.windows: deque[tuple[float, LoadWindow, int]] = deque(maxlen=HISTORY)
        self.summary: LoadSummary | None = None
        self.run_id = 0
        self.run_knobs: Knobs | None = None
        self.run_kind = "run"
        self.run_windows = 0
        self.sweep_point = ""  # "2/4 qps 4" while a sweep runs
        self.runs: list[RunRow] = []
        self.sweep: list[SweepPoint] = []
        self.events: list[Event] = []
        self.version = 0
        self.spec: specs.ModelSpec | None = None
        self.spec_error: str | None = None
        self.hardware = self._choose_hardware()
        self._load_spec(model_name)

    # -- ingest ---------------------------------------------------------------------------------
    def add(self, rec: Record) -> None:
        """Ingest one record (a malformed one raises ValueError/TypeError/KeyError and changes
        nothing that the next record relies on)."""
        handlers = {
            RecordKind.STATS: self._add_stats,
            RecordKind.WINDOW: self._add_window,
            RecordKind.SUMMARY: self._add_summary,
            RecordKind.EVENT: self._add_event,
            RecordKind.CONFIG: self._add_config,
        }
        handlers[RecordKind(rec.kind)](rec)
        self.version += 1

    def _add_stats(self, rec: Record) -> None:
        snap = StatsSnapshot.from_json(rec.data)
        backend_changed = snap.backend != self.stats.backend
        self.stats = snap
        self.stats_hist.append(snap)
        if snap.model and (self.spec is None or self.spec.name != snap.model.get("name")):
            self.spec = model_spec_from(snap.model)
            self.model_name = self.spec.name
        if snap.config:
            self.applied = self.applied.with_server(snap.config)
            if self.pending is not None and self.pending == self.applied:
                self.pending = None
        self.server = snap.state if not snap.error else f"{snap.state}: {snap.error}"
        if backend_changed:  # the automatic choice follows the server's backend
            self.hardware = self._choose_hardware()

    def _add_window(self, rec: Record) -> None:
        completed = number(rec.data, "completed")
        window = LoadWindow.from_json(rec.data)
        self.windows.append((rec.t, window, 1 if completed is None else int(completed)))
        self.run_windows += 1

    def _add_summary(self, rec: Record) -> None:
        summary = LoadSummary.from_json(rec.data)
        self.summary = summary
        knobs = self.run_knobs or self.applied
        pred = self.prediction(knobs)
        exp = self.expectation(knobs)
        row = RunRow(
            run=self.run_id,
            kind=self.run_kind,
            knobs=knobs,
            pred_ttft_ms=pred.ttft_ms if pred else None,
            pred_tpot_ms=pred.tpot_ms if pred else None,
            pred_tok_s=pred.tok_s if pred else None,
            ttft_ms=summary.median_ttft_ms,
            tpot_ms=summary.median_tpot_ms,
            tok_s=summary.output_throughput,
            completed=summary.completed,
            partial=summary.partial,
            exp_ttft_ms=exp.ttft_p50_ms if exp else None,
            exp_tpot_ms=exp.tpot_p50_ms if exp else None,
            exp_tok_s=exp.tok_s if exp else None,
        )
        self.runs.append(row)
        if self.run_kind == "sweep":
            self.sweep.append(SweepPoint.from_row(row))
        self.run_knobs = None
        if self.phase == "running":
            self.phase = "done"

    def _add_event(self, rec: Record) -> None:
        """Text for the log, and the controller's and session's state changes: `phase`,
        `server`, `url`, `calibration`, `fit` (the cost-model fit: running | done | failed),
        `sweep_point`, `applied` (knobs now on the server) and `pending` (an edit the session
        leaves for the user to apply)."""
        data = rec.data
        if data.get("text"):
            self._log(data["text"], data.get("level", "info"), rec.t)
        for key in ("phase", "server", "url", "sweep_point"):
            if key in data:
                setattr(self, key, str(data[key]))
        if "applied" in data:
            self.applied = Knobs.from_dict(data["applied"])
            if self.pending == self.applied:
                self.pending = None
        if "pending" in data:
            self._stage(replace(self.knobs, **data["pending"]))
        if "calibration" in data:  # `local` may exist now: choose the hardware spec again
            self.calibration = str(data["calibration"])
            self.hardware = self._choose_hardware()
        if "fit" in data:  # a fit may have been written: look for fits again
            self.fit = str(data["fit"])
            self.fit_generation += 1

    def _add_config(self, rec: Record) -> None:
        data = rec.data
        self.run_id = int(data.get("run", self.run_id + 1))
        self.run_kind = data.get("kind", "run")
        self.run_knobs = Knobs.from_dict(data["knobs"]) if "knobs" in data else self.applied
        self.run_windows = 0
        if self.run_kind != "sweep":
            self.sweep_point = ""
        if self.run_kind == "sweep" and data.get("first"):
            self.sweep = []
        self.phase = "sweeping" if self.run_kind == "sweep" else "running"

    def log(self, text: str, level: str = "info") -> None:
        """An event of the UI's own; stamped with the newest event's time (the UI keeps no
        clock of its own)."""
        self._log(text, level, self.events[-1].t if self.events else 0.0)
        self.version += 1

    def _log(self, text: str, level: str, t: float) -> None:
        self.events.append(Event(len(self.events), t, level, text))
        del self.events[:-500]

    # -- knobs ----------------------------------------------------------------------------------
    @property
    def knobs(self) -> Knobs:
        """What the prediction shows: pending edits if any, else the applied config."""
        return self.pending or self.applied

    def edit(self, **changes: object) -> Knobs:
        """Stage an edit (raises ValueError naming a bad value); the prediction follows at once."""
        new = replace(self.knobs, **changes)
        self._stage(new)
        self.version += 1
        return new

    def _stage(self, new: Knobs) -> None:
        new = self._spelled_as_applied(new)
        hardware_changed = new.hardware != self.knobs.hardware
        self.pending = None if new == self.applied else new
        if hardware_changed:
            self.hardware = self._choose_hardware()

    def _spelled_as_applied(self, new: Knobs) -> Knobs:
        """`new` with a storage dtype that is what the server runs spelled as the applied knobs
        spell it ("" = the server's own), so cycling back to it leaves no edit pending."""
        ran, wanted = self.precision(self.applied), self.precision(new)
        same = {}
        if wanted.weights == ran.weights:
            same["weight_dtype"] = self.applied.weight_dtype
        if wanted.kv == ran.kv:
            same["kv_dtype"] = self.applied.kv_dtype
        return replace(new, **same)

    def discard(self) -> None:
        self._stage(self.applied)
        self.version += 1

    @property
    def n_devices(self) -> int:
        return self.stats.n_devices

    # -- predictions ----------------------------------------------------------------------------
    def _load_spec(self, name: str) -> None:
        try:
            self.spec = specs.load_model(name)
        except specs.SpecError as exc:
            self.spec_error = str(exc)

    def _choose_hardware(self) -> HardwareChoice:
        requested = self.knobs.hardware
        name, note = pick_hardware(requested, self.stats.raw.get("backend"), self.calibration)
        try:
            return HardwareChoice(requested, specs.load_hardware(name), note)
        except specs.SpecError as exc:
            return HardwareChoice(requested, None, str(exc))

    def prediction_or_error(self, knobs: Knobs | None = None) -> Prediction | str:
        """The roofline for `knobs` (default: what is shown) on the one spec every panel uses
        (`hardware`, what the knobs panel shows), or why there is none. Pure: the result is
        memoized by `predict_cached`, nothing here changes."""
        knobs = replace(knobs or self.knobs, hardware=self.knobs.hardware)
        if self.spec is None:
            return f"no prediction: {self.spec_error or 'no model spec yet'}"
        if self.hardware.spec is None:
            return f"no prediction: {self.hardware.note}"
        p = self.precision(knobs)
        max_seq_len = self.stats.config.get("max_seq_len")
        where = placement_of(knobs, self.stats.placement)  # over a server's processes
        return predict_cached(
            self.spec, self.hardware.spec, knobs, p.compute, max_seq_len, p.weights, p.kv, where
        )

    def prediction(self, knobs: Knobs | None = None) -> Prediction | None:
        got = self.prediction_or_error(knobs)
        return got if isinstance(got, Prediction) else None

    def precision(self, knobs: Knobs | None = None) -> Precision:
        """The compute, weight and KV-cache dtypes of the server `knobs` describe (default: what
        is shown): the knobs' own storage dtypes (a pending `w`/`k`), else the server's /stats
        config, else its compute dtype (before /stats: what the embedded server starts with)."""
        config = self.stats.config
        compute = str(config.get("dtype") or start_dtype(self.stats.raw.get("backend")))
        return Precision.of(knobs or self.knobs, config, compute)

    def server_shape(self, knobs: Knobs | None = None) -> ServerShape:
        """The server `knobs` describe (default: what is shown): /stats "config" with the knobs'
        server keys (defaults before /stats says); ValueError naming what it cannot be."""
        if self.spec is None:
            raise ValueError("no model spec yet")
        backend = self.stats.raw.get("backend")
        return server_shape(self.stats.config, knobs or self.knobs, self.spec, backend)

    def _fit_scope(self) -> str | None:
        """None when this host's fits apply to the server, else why not (then costs are
        assumed on the shown spec)."""
        if self.knobs.hardware not in ("", "local"):
            return f"what-if spec {self.knobs.hardware}"
        if self.calibration == "remote":
            return "remote server (no fit of its host here)"
        return None

    def expectation_or_error(
        self,
        knobs: Knobs | None = None,
        budget: int = TOKEN_CHUNKS,
        band: bool = True,
        speed: SpeedFactors | None = None,
    ) -> Expectation | str:
        """Our scheduler simulated on the cost model for `knobs` (default: what is shown): the
        fit for that server configuration, else assumed efficiencies on the shown spec; at
        `speed` (as run), the point at those factors; or why there is none. Pure: memoized by
        `expect_cached`, nothing here changes."""
        knobs = replace(knobs or self.knobs, hardware=self.knobs.hardware)
        if self.spec is None:
            return f"no expectation: {self.spec_error or 'no model spec yet'}"
        try:
            shape = self.server_shape(knobs)
        except (TypeError, ValueError) as exc:  # another server's /stats config, or a bad edit
            return f"no expectation: cannot read the server's config: {exc}"
        where = placement_of(knobs, self.stats.placement)  # over a server's processes
        return expect_cached(
            self.hardware.spec,
            knobs,
            shape,
            self._fit_scope(),
            self.fit_generation,
            budget,
            band,
            speed,
            where,
        )

    def expectation(self, knobs: Knobs | None = None) -> Expectation | None:
        got = self.expectation_or_error(knobs)
        return got if isinstance(got, Expectation) else None

    def sweep_curve(self) -> tuple[tuple[float, float], ...]:
        """The expected (output tok/s, TPOT p50 ms) across the sweep's range on a finer grid
        than its points: over rates for an open-loop sweep, else over slot counts."""
        knobs = [p.knobs for p in self.sweep if p.knobs is not None]
        if not knobs:
            return ()
        base = knobs[-1]
        if all(k.load == "qps" for k in knobs):
            grid = [replace(base, rate=v) for v in sweep_grid([k.rate for k in knobs], False)]
        else:
            dp = base.dp  # slots stay a multiple of dp
            values = sweep_grid([k.slots for k in knobs], True)
            slots = sorted({max(dp, round(v / dp) * dp) for v in values})
            grid = [replace(base, slots=s) for s in slots]
        curve = []
        for k in grid:
            got = self.expectation_or_error(k, TOKEN_CHUNKS // 4, band=False)  # the point alone
            if isinstance(got, Expectation) and got.tok_s and got.tpot_p50_ms:
                curve.append((got.tok_s, got.tpot_p50_ms))
        return tuple(curve)
