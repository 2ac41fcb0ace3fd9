"""Server metrics: a Prometheus registry (`scaletui:` prefix, vLLM semantics) plus a ring of
recent step and token events that `/stats` summarizes over a short window for the TUI.

Every interval is a difference of `time.perf_counter()` stamps taken in this process. Metric
objects are thread-safe; the ring is guarded by a lock because workers append while the
event loop reads.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from pathlib import Path

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from scaletui.serve.scheduling.speed import WINDOW_CALLS, SpeedWindow

P = "scaletui:"
_LATENCY = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
# TTFT and ITL: bounds 4.5% apart from 0.1 ms to 2 min, so a quantile read off the histogram (by
# interpolation within its bucket, as histogram_quantile does) is within 5% of the exact one: a
# load generator's percentiles are checked against these (bench/loadgen_agreement.py). _LATENCY's
# vLLM-like bounds are up to 2.5x apart, too coarse for that.
_FINE = tuple(float(f"{1e-4 * 1.045**i:.4g}") for i in range(318))
_STEP = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_COMPILE = (0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
PHASES = ("prefill", "generate", "transfer")  # engine calls
STEP_KINDS = {"generate": "decode", "prefill": "prefill"}  # phase -> speed.KINDS
GAP = "host_gap"  # the scheduler worker's host time between two engine calls while it has work


class ServerMetrics:
    """The server's counters, gauges and histograms, and the ring behind `/stats`."""

    def __init__(self, ring: int = 4096) -> None:
        r = self.registry = CollectorRegistry()
        self.running = Gauge(P + "num_requests_running", "Requests in decode slots.", registry=r)
        self.waiting = Gauge(P + "num_requests_waiting", "Requests not yet prefilled.", registry=r)
        self.transfer_backlog = Gauge(
            P + "transfer_backlog_size", "Prefilled requests waiting for a slot.", registry=r
        )
        self.kv_usage = Gauge(
            P + "kv_cache_usage_perc", "KV pages held by sequences / usable pages, 0-1.", registry=r
        )
        self.prefix_queries = Counter(
            P + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", registry=r
        )
        self.prefix_hits = Counter(
            P + "prefix_cache_hits",
            "Prompt tokens found in the prefix cache (their prefill skipped).",
            registry=r,
        )
        self.preemptions = Counter(
            P + "num_preemptions",
            "Sequences preempted for KV pages (they resume by prefilling again).",
            registry=r,
        )
        self.slots_used = Gauge(P + "slots_used", "Decode slots in use.", registry=r)
        self.slots_total = Gauge(P + "slots_total", "Decode slots configured.", registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prefilled prompt tokens.", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Generated tokens.", registry=r)
        self.success = Counter(
            P + "request_success", "Finished requests.", ["finished_reason"], registry=r
        )
        self.aborted = Counter(
            P + "request_aborted", "Requests aborted (disconnect, reconfigure).", registry=r
        )
        self.rejected = Counter(P + "request_rejected", "Requests refused with 429.", registry=r)
        self.ttft = self._hist("time_to_first_token_seconds", "HTTP arrival to first token.", _FINE)
        self.itl = self._hist(
            "inter_token_latency_seconds", "Time between tokens of a request.", _FINE
        )
        self.e2e = self._hist("e2e_request_latency_seconds", "HTTP arrival to last token.")
        self.queue = self._hist("request_queue_time_seconds", "Arrival to prefill start.")
        self.prefill = self._hist("request_prefill_time_seconds", "Prefill start to first token.")
        self.decode = self._hist("request_decode_time_seconds", "First token to last token.")
        self.transfer = Histogram(
            P + "kv_transfer_seconds", "Prefix move between device sets.", buckets=_STEP, registry=r
        )
        self.step = Histogram(
            P + "step_duration_seconds",
            "Engine call duration by phase.",
            ["phase"],
            buckets=_STEP,
            registry=r,
        )
        self.iteration_tokens = Histogram(
            P + "iteration_tokens",
            "Tokens produced per engine call.",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
            registry=r,
        )
        self.gap = Histogram(
            P + "scheduler_gap_seconds",
            "Host time between two engine calls of a busy scheduler worker.",
            buckets=_STEP,
            registry=r,
        )
        self.compile = Histogram(
            P + "jit_compile_seconds",
            "Warm-up compile time per config.",
            buckets=_COMPILE,
            registry=r,
        )
        # the server's speed against its fit (speed.py), per step kind: decode = generate
        # calls, prefill = prefill calls; a scraper's delta ratio is the factor over its window
        self.step_seconds = Counter(
            P + "step_seconds",
            "Engine call seconds by kind (decode: generate calls; prefill: prefill calls).",
            ["kind"],
            registry=r,
        )
        self.step_predicted = Counter(
            P + "step_predicted_seconds",
            "The engine fit's predicted seconds for the same calls (only with a fit).",
            ["kind"],
            registry=r,
        )
        self.speed_factor = Gauge(
            P + "speed_factor",
            f"step_seconds / step_predicted_seconds over the last {WINDOW_CALLS} calls of a kind.",
            ["kind"],
            registry=r,
        )
        self.speed = SpeedWindow()
        self._children: dict[tuple, Counter | Gauge] = {}  # (metric, kind) -> its child
        self._lock = threading.Lock()
        # (t, phase, seconds, tokens, active_slots, steps)
        self._steps: deque[tuple[float, str, float, int, int, int]] = deque(maxlen=ring)

    def _hist(self, name: str, doc: str, buckets: tuple[float, ...] = _LATENCY) -> Histogram:
        return Histogram(P + name, doc, buckets=buckets, registry=self.registry)

    def record_step(
        self,
        phase: str,
        seconds: float,
        tokens: int,
        active: int = 0,
        steps: int = 1,
        predicted: float | None = None,
    ) -> None:
        """One engine call: prefill (tokens = prompt tokens), generate or transfer; with
        `predicted`, the fit's seconds for the same call (speed.SpeedModel)."""
        self.step.labels(phase=phase).observe(seconds)
        kind = STEP_KINDS.get(phase)
        if kind is not None:
            self._child(self.step_seconds, kind).inc(seconds)
            if predicted is not None:
                self._child(self.step_predicted, kind).inc(predicted)
                factor = self.speed.add(kind, seconds, predicted)
                if factor == factor:  # not nan (a prediction of 0 s)
                    self._child(self.speed_factor, kind).set(factor)
        if phase == "prefill":
            self.prompt_tokens.inc(tokens)
        elif phase == "transfer":
            self.transfer.observe(seconds)
        elif phase == "generate":
            self.iteration_tokens.observe(tokens)
            self.generation_tokens.inc(tokens)
        with self._lock:
            self._steps.append((time.perf_counter(), phase, seconds, tokens, active, steps))

    def _child(self, metric: Counter | Gauge, kind: str) -> Counter | Gauge:
        """`metric.labels(kind=kind)`, kept: the look-up costs more than the increment. A
        child is made on first use, so with no fit no predicted sample is exported."""
        key = (metric, kind)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(kind=kind)
        return child

    def reset_speed(self, log_file: Path | None = None, engine: str = "") -> None:
        """Another fit prices the calls from now on: the factor's window starts afresh (the
        counters, monotonic, go on: a scraper's window spanning the change mixes both fits),
        its blocks logged to `log_file` (speedlog; None: not logged)."""
        self.speed.reset(log_file, engine)
        self.speed_factor.clear()
        self._children = {k: c for k, c in self._children.items() if k[0] is not self.speed_factor}

    def record_gap(self, seconds: float) -> None:
        """The scheduler worker's host time from one engine call's end to the next one's start
        (its bookkeeping, inserts, token fan-out), while it had work: what the simulator adds
        before each call (`ServerShape.gap_s`, `gap_per_row_s`)."""
        self.gap.observe(seconds)
        with self._lock:
            self._steps.append((time.perf_counter(), GAP, seconds, 0, 0, 1))

    def window(self, window_s: float) -> dict:
        """Rates and step-time summaries over the last `window_s` seconds (the /stats part)."""
        since = time.perf_counter() - window_s
        with self._lock:
            events = [e for e in self._steps if e[0] >= since]
        step_times: dict[str, dict] = {}
        for phase in (*PHASES, GAP):
            rows = [e for e in events if e[1] == phase]
            if not rows:
                continue
            ms = np.array([e[2] for e in rows]) * 1e3
            summary = {
                "count": len(rows),
                "mean": float(ms.mean()),
                "p50": float(np.percentile(ms, 50)),
                "p99": float(np.percentile(ms, 99)),
            }
            if phase == "generate":
                summary["per_token_mean"] = float(np.mean([e[2] * 1e3 / e[5] for e in rows]))
            step_times[phase] = summary
        prompt = sum(e[3] for e in events if e[1] == "prefill")
        # every prefill also samples one token (the first)
        generated = sum(
            e[3] if e[1] == "generate" else 1 for e in events if e[1] in ("prefill", "generate")
        )
        gen = [e[4] for e in events if e[1] == "generate"]
        return {
            "window_s": window_s,
            "throughput": {
                "prompt_tokens_per_s": prompt / window_s,
                "generation_tokens_per_s": generated / window_s,
            },
            "step_times_ms": step_times,
            "batch": {"mean_active_slots": float(np.mean(gen)) if gen else 0.0},
        }

    def request_counts(self) -> dict[str, int]:
        """/stats `requests.finished|aborted|rejected`, read from the Prometheus counters."""
        return {
            "finished": int(self.counter_value(self.success)),  # summed over finish reasons
            "aborted": int(self.counter_value(self.aborted)),
            "rejected": int(self.counter_value(self.rejected)),
        }

    def counter_value(self, counter: Counter) -> float:
        samples = (s for m in counter.collect() for s in m.samples)
        return sum(s.value for s in samples if s.name.endswith("_total"))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
