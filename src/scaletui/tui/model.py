"""The TUI's one piece of mutable state (plain Python, no Textual): ring buffers of /stats
snapshots and loadgen windows, knobs (applied vs pending), predictions, runs and events.

`add(record)` ingests; `view()` hands panels a frozen snapshot. `version` grows on every change
so the render tick redraws only when something moved.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace

from scaletui import specs
from scaletui.tui.knobs import Knobs
from scaletui.tui.predict import Prediction, model_spec_from, pick_hardware, predict
from scaletui.tui.replay import Record
from scaletui.tui.views import RunRow, SweepPoint, View

HISTORY = 300  # samples kept per series (5 min at 1 Hz)
BUSY_PHASES = ("calibrating", "starting", "reconfiguring", "sweeping")


@dataclass
class Event:
    seq: int
    t: float
    level: str  # info | warning | error
    text: str


class MetricsModel:
    def __init__(self, knobs: Knobs | None = None, model_name: str = "small") -> None:
        self.applied = knobs or Knobs()
        self.pending: Knobs | None = None  # None: no unapplied edits
        self.model_name = model_name
        # calibrating|starting|idle|reconfiguring|running|sweeping|done|error|replay
        self.phase = "starting"
        self.server = "starting"  # server status text for the status bar
        self.url = ""
        self.calibration = ""  # the controller's calibrate state: running|done|off|remote|failed
        self.stats: dict = {}
        self.stats_hist: deque[dict] = deque(maxlen=HISTORY)
        self.windows: deque[tuple[float, dict]] = deque(maxlen=HISTORY)
        self.summary: dict | None = None
        self.run_id = 0
        self.run_knobs: Knobs | None = None
        self.run_kind = "run"
        self.run_windows = 0
        self.sweep_point = ""  # "2/4 qps 4" while a sweep runs
        self.runs: list[RunRow] = []
        self.sweep: list[SweepPoint] = []
        self.events: list[Event] = []
        self.version = 0
        self._spec: specs.ModelSpec | None = None
        self._hw: tuple[str, specs.HardwareSpec | None, str | None] | None = None
        self._hw_backend: str | None = None
        self._preds: dict[tuple, Prediction | str] = {}

    # -- ingest ---------------------------------------------------------------------------------
    def add(self, rec: Record) -> None:
        getattr(self, f"_add_{rec.kind}")(rec)
        self.version += 1

    def _add_stats(self, rec: Record) -> None:
        data = rec.data
        self.stats = data
        self.stats_hist.append(data)
        if isinstance(data.get("model"), dict) and (
            self._spec is None or self._spec.name != data["model"].get("name")
        ):
            self._spec = model_spec_from(data["model"])
            self.model_name = self._spec.name
            self._preds.clear()
        if isinstance(data.get("config"), dict):
            self.applied = self.applied.with_server(data["config"])
            if self.pending is not None and self.pending == self.applied:
                self.pending = None
        state = data.get("state", "serving")
        self.server = state if not data.get("error") else f"{state}: {data['error']}"

    def _add_window(self, rec: Record) -> None:
        self.windows.append((rec.t, rec.data))
        self.run_windows += 1

    def _add_summary(self, rec: Record) -> None:
        data = rec.data
        self.summary = data
        knobs = self.run_knobs or self.applied
        pred = self.prediction(knobs)
        row = RunRow(
            run=self.run_id,
            kind=self.run_kind,
            knobs=knobs,
            pred_ttft_ms=pred.ttft_ms if pred else None,
            pred_tpot_ms=pred.tpot_ms if pred else None,
            pred_tok_s=pred.tok_s if pred else None,
            ttft_ms=data.get("median_ttft_ms"),
            tpot_ms=data.get("median_tpot_ms"),
            tok_s=data.get("output_throughput"),
            completed=int(data.get("completed") or 0),
            partial=bool(data.get("partial")),
        )
        self.runs.append(row)
        if self.run_kind == "sweep":
            self.sweep.append(SweepPoint.from_row(row))
        self.run_knobs = None
        if self.phase == "running":
            self.phase = "done"

    def _add_event(self, rec: Record) -> None:
        data = rec.data
        if data.get("text"):
            self.log(data["text"], data.get("level", "info"), rec.t)
        if "phase" in data:
            self.phase = data["phase"]
        if "server" in data:
            self.server = data["server"]
        if "url" in data:
            self.url = data["url"]
        if "sweep_point" in data:
            self.sweep_point = str(data["sweep_point"])
        if "calibration" in data:  # `local` may exist now: choose the hardware spec again
            self.calibration = str(data["calibration"])
            self._hw = None
            self._preds.clear()

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

    def log(self, text: str, level: str = "info", t: float | None = None) -> None:
        """An event; `t` defaults to the newest event's (the UI keeps no clock of its own)."""
        if t is None:
            t = self.events[-1].t if self.events else 0.0
        self.events.append(Event(len(self.events), t, level, text))
        del self.events[:-500]
        self.version += 1

    # -- knobs ----------------------------------------------------------------------------------
    @property
    def knobs(self) -> Knobs:
        """What the prediction shows: pending edits if any, else the applied config."""
        return self.pending or self.applied

    def edit(self, **changes: object) -> Knobs:
        """Stage an edit (raises ValueError naming a bad value); the prediction follows at once."""
        new = replace(self.knobs, **changes)
        self.pending = None if new == self.applied else new
        self.version += 1
        return new

    def discard(self) -> None:
        self.pending = None
        self.version += 1

    @property
    def n_devices(self) -> int:
        return len(self.stats.get("devices") or [])

    # -- predictions ----------------------------------------------------------------------------
    def model_spec(self) -> specs.ModelSpec:
        if self._spec is None:
            self._spec = specs.load_model(self.model_name)
        return self._spec

    def hardware(self, name: str) -> tuple[str, specs.HardwareSpec | None, str | None]:
        """(name, spec or None, note) for a knob value ("" = automatic choice)."""
        backend = self.stats.get("backend")
        if self._hw is None or self._hw[0] != name or self._hw_backend != backend:
            if self._hw is not None and self._hw_backend != backend:
                self._preds.clear()  # the automatic choice follows the server's backend
            self._hw_backend = backend
            chosen, note = pick_hardware(name, backend, self.calibration)
            try:
                self._hw = (name, specs.load_hardware(chosen), note)
            except specs.SpecError as exc:
                self._hw = (name, None, str(exc))
        return self._hw

    def _pred_key(self, knobs: Knobs) -> tuple:
        config = self.stats.get("config") or {}
        return (knobs, config.get("dtype", "f32"), config.get("max_seq_len"), self.model_name)

    def prediction(self, knobs: Knobs | None = None) -> Prediction | None:
        """The roofline for `knobs` (default: what is shown), always on the hardware spec the
        knobs panel shows, so the KPIs, charts and Runs rows never compare different specs."""
        knobs = replace(knobs or self.knobs, hardware=self.knobs.hardware)
        key = self._pred_key(knobs)
        if key not in self._preds:
            _, dtype, max_seq_len, _ = key
            _, hw, note = self.hardware(knobs.hardware)
            try:
                if hw is None:
                    raise ValueError(note)
                self._preds[key] = predict(self.model_spec(), hw, knobs, dtype, max_seq_len)
            except (ImportError, ValueError, KeyError, specs.SpecError) as exc:
                self._preds[key] = f"no prediction: {exc}"
        got = self._preds[key]
        return got if isinstance(got, Prediction) else None

    def prediction_error(self) -> str | None:
        self.prediction()
        got = self._preds.get(self._pred_key(self.knobs))
        return got if isinstance(got, str) else None

    # -- view -----------------------------------------------------------------------------------
    def view(self) -> View:
        from scaletui.tui.views import build_view

        return build_view(self)
