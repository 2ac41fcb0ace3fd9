"""Pure metrics: summarize(records) with serving.md §5 formulas and vLLM key names; windows.

Latencies come from ok requests only; failed, rejected and cancelled ones are counted by
class and by kind (client.KINDS), with one example message each. Percentiles are numpy's linear
interpolation (as vLLM and SGLang). A metric with no samples is null, never 0. A run that did
not keep up with its offered rate is flagged (`saturation`, see _saturation).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from scaletui.latency import (
    SATURATION,
    SATURATION_MIN_REQUESTS,
    stats_ms,
    sustained_rate,
    tpot_s,
)
from scaletui.loadgen.breakdown import per_turn, prompt_lengths
from scaletui.loadgen.client import FAILED, OUTCOMES, RequestRecord

# metric -> JSON stem; every one gets mean_/median_/std_/min_/max_/pNN_<stem>_ms keys
LATENCIES = (
    "ttft",
    "tpot",
    "itl",
    "e2el",
    "ttft_sched",
    "e2el_sched",
    "schedule_delay",
    "ntpot",
    "ttst",
    "icl",
)

METRIC_DEFINITIONS = {
    "ttft_ms": "t_first_token - t_send (first SSE chunk carrying >= 1 output token)",
    "ttft_sched_ms": "t_first_token - t_sched: TTFT including client-side waiting "
    "(coordinated-omission corrected)",
    "schedule_delay_ms": "t_send - t_sched: how late the request left versus the schedule",
    "e2el_ms": "t_last_token - t_send",
    "e2el_sched_ms": "t_last_token - t_sched",
    "tpot_ms": "(E2EL - TTFT) / (N - 1) per request with N > 1 output tokens",
    "itl_ms": "per token: a gap g_k between token chunks k-1 and k counts n_k times as g_k / n_k;"
    " pooled over all requests",
    "icl_ms": "raw gap between consecutive token-carrying chunks (chunk batching visible)",
    "ntpot_ms": "E2EL / N",
    "ttst_ms": "t_second_token - t_send (a chunk with >= 2 tokens gives it at t_first)",
    "request_throughput": "completed / D, D = last request end - run start (req/s)",
    "output_throughput": "sum of output tokens of completed requests / D (tok/s)",
    "input_throughput": "sum of prompt tokens of completed requests / D (tok/s)",
    "total_token_throughput": "(prompt + output tokens of completed) / D (tok/s)",
    "request_goodput": "completed requests meeting every given SLO (<=) / D (req/s)",
    "token_goodput": "(prompt + output tokens) of good requests / D (tok/s)",
    "goodput_pct": "good / completed",
    "mean_concurrency": "sum of E2EL / D (Little's law)",
    "peak_output_tok_s": "max over 1 s buckets (from run start) of tokens arrived",
    "peak_concurrency": "max requests in flight at any instant",
    "achieved_rate": "sent / (last t_send - first t_send) (req/s)",
    "scheduled_rate": "sent / (last t_sched - first t_sched): the rate this schedule asked for",
    "sustained_rate": "scheduled_rate / (1 + b), b = least-squares slope of (t_done - t_sched) "
    "over t_sched of completed requests: the completion rate the server kept up with (open loop)",
    "failure_rate": "(failed + rejected) / (sent - cancelled)",
}


@dataclass(frozen=True)
class Slo:
    """Goodput SLOs in ms; None = not checked."""

    ttft: float | None = None
    tpot: float | None = None
    e2el: float | None = None

    @classmethod
    def parse(cls, text: str) -> Slo:
        """'ttft=500,tpot=50,e2el=3000' -> Slo (ms)."""
        values: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, _, value = part.partition("=")
            if key not in ("ttft", "tpot", "e2el"):
                raise ValueError(f"SLO key must be ttft, tpot or e2el, got {key!r} in {text!r}")
            try:
                values[key] = float(value)
            except ValueError:
                raise ValueError(f"SLO {key} needs a number of ms, got {value!r}") from None
            if values[key] <= 0:
                raise ValueError(f"SLO {key} must be > 0 ms, got {value}")
        return cls(**values)

    def as_dict(self) -> dict:
        return {"ttft": self.ttft, "tpot": self.tpot, "e2el": self.e2el}


@dataclass(frozen=True)
class Latencies:
    """Per-request latencies (seconds) of ok requests, plus the pooled ITL/ICL samples."""

    ttft: np.ndarray
    tpot: np.ndarray  # N > 1 only
    tpot_goodput: np.ndarray  # every ok request, 0 for N <= 1 (vLLM)
    e2el: np.ndarray
    ttft_sched: np.ndarray
    e2el_sched: np.ndarray
    ntpot: np.ndarray
    ttst: np.ndarray
    itl: np.ndarray
    icl: np.ndarray
    schedule_delay: np.ndarray  # every sent request

    @classmethod
    def concat(cls, parts: Sequence[Latencies]) -> Latencies:
        if not parts:
            return latencies([])
        names = cls.__dataclass_fields__
        return cls(**{n: np.concatenate([vars(p)[n] for p in parts]) for n in names})


def latencies(records: Sequence[RequestRecord]) -> Latencies:
    ok = [r for r in records if r.outcome == "ok"]
    ttft = np.array([r.t_first - r.t_send for r in ok])
    e2el = np.array([r.t_last - r.t_send for r in ok])
    n = np.array([r.output_tokens for r in ok], dtype=float)
    # one output token has no TPOT: 0 for the goodput check (it cannot miss a TPOT SLO)
    tpot_all = np.nan_to_num(tpot_s(ttft, e2el, n), nan=0.0) if ok else np.array([])
    itl: list[float] = []
    icl: list[float] = []
    ttst = []
    for r in ok:
        times, toks = r.chunk_times, r.chunk_tokens
        for k in range(1, len(times)):
            gap = times[k] - times[k - 1]
            icl.append(gap)
            itl.extend([gap / toks[k]] * toks[k])
        if toks[0] >= 2:
            ttst.append(times[0] - r.t_send)
        elif len(times) >= 2:
            ttst.append(times[1] - r.t_send)
    sent = [r for r in records if not math.isnan(r.t_send)]
    return Latencies(
        ttft=ttft,
        tpot=tpot_all[n > 1] if ok else tpot_all,
        tpot_goodput=tpot_all,
        e2el=e2el,
        ttft_sched=np.array([r.t_first - r.t_sched for r in ok]),
        e2el_sched=np.array([r.t_last - r.t_sched for r in ok]),
        ntpot=np.array([(r.t_last - r.t_send) / r.output_tokens for r in ok if r.output_tokens]),
        ttst=np.array(ttst),
        itl=np.array(itl),
        icl=np.array(icl),
        schedule_delay=np.array([r.t_send - r.t_sched for r in sent]),
    )


def quantiles_ms(seconds: np.ndarray | list[float]) -> dict[str, float | None]:
    """{"p50", "p99"} in ms for a live window (null when empty)."""
    a = np.asarray(seconds, dtype=float)
    if a.size == 0:
        return {"p50": None, "p99": None}
    p50, p99 = np.percentile(a * 1e3, [50, 99])
    return {"p50": float(p50), "p99": float(p99)}


def _peaks(ok: Sequence[RequestRecord], sent: Sequence[RequestRecord], t_start: float):
    buckets: dict[int, int] = {}
    for r in ok:
        for t, n in zip(r.chunk_times, r.chunk_tokens, strict=True):
            b = int((t - t_start) // 1.0)
            buckets[b] = buckets.get(b, 0) + n
    events = sorted([(r.t_send, 1) for r in sent] + [(r.t_done, -1) for r in sent])
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return (max(buckets.values()) if buckets else None), peak


def summarize(
    records: Sequence[RequestRecord],
    *,
    t_start: float | None = None,
    slo: Slo | None = None,
    requested_rate: float | None = None,
    config: dict | None = None,
    server_stats_before: dict | None = None,
    server_stats_after: dict | None = None,
    partial: bool = False,
    partial_reason: str | None = None,
    partial_message: str | None = None,
    tokenizer: str | None = None,
) -> dict:
    """The run summary (a JSON-ready dict). Warm-up records are ignored.

    D = t_end - t_start: t_start when dispatch began (default: the first t_sched), t_end when
    the last request ended (any outcome). partial_reason says why a partial run stopped
    ("interrupted", "server_gone"), partial_message in words. `tokenizer` (the one that made
    the prompts, None: estimated lengths) goes into the prompt-length check.
    """
    records = [r for r in records if not r.warmup]
    sent = [r for r in records if not math.isnan(r.t_send)]
    ok = [r for r in records if r.outcome == "ok"]
    if t_start is None:
        t_start = min((r.t_sched for r in records), default=0.0)
    t_end = max((r.t_done for r in sent), default=t_start)
    duration = t_end - t_start
    lat = latencies(records)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: None)
    n_out = [r.output_tokens for r in ok]
    n_in = [r.prompt_tokens if r.prompt_tokens is not None else r.input_len for r in ok]
    good = np.ones(len(ok), dtype=bool)
    slo = slo or Slo()
    for limit, values in ((slo.ttft, lat.ttft), (slo.tpot, lat.tpot_goodput), (slo.e2el, lat.e2el)):
        if limit is not None and len(ok):
            good &= values * 1e3 <= limit
    good_tokens = sum(i + o for i, o, g in zip(n_in, n_out, good, strict=True) if g)
    counts = {k: 0 for k in OUTCOMES}
    http_status: dict[str, int] = {}
    examples: dict[str, str] = {}
    by_kind: dict[str, dict] = {}
    for r in records:
        counts[r.outcome] = counts.get(r.outcome, 0) + 1
        if r.outcome != "ok" and r.error:
            examples.setdefault(r.outcome, r.error)
        if r.kind is not None and r.outcome not in ("ok", "cancelled"):
            entry = by_kind.setdefault(r.kind, {"count": 0, "example": r.error or r.kind})
            entry["count"] += 1
        if r.outcome in ("http_error", "rejected") and r.status is not None:
            http_status[str(r.status)] = http_status.get(str(r.status), 0) + 1
    sends = sorted(r.t_send for r in sent)
    span = sends[-1] - sends[0] if len(sends) > 1 else 0.0
    scheds = sorted(r.t_sched for r in sent)
    sched_span = scheds[-1] - scheds[0] if len(scheds) > 1 else 0.0
    peak_tok, peak_conc = _peaks(ok, sent, t_start)
    failed = sum(counts[k] for k in FAILED)
    answerable = len(sent) - sum(r.outcome == "cancelled" for r in sent)
    scheduled_rate = len(sent) / sched_span if sched_span > 0 else None
    summary: dict = {
        "partial": partial,
        "partial_reason": partial_reason if partial else None,
        "partial_message": partial_message if partial else None,
        "num_prompts": len(records),
        "sent": len(sent),
        "completed": len(ok),
        "failed": failed,
        "rejected": counts["rejected"],
        "cancelled": counts["cancelled"],
        "errors": {
            **{k: v for k, v in counts.items() if k != "ok"},
            "http_status": http_status,
            "examples": examples,  # the first error message of each class
        },
        # kind -> {"count", "example"}: failed and rejected requests by cause, most first
        "failures_by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1]["count"])),
        "failure_rate": (failed + counts["rejected"]) / answerable if answerable else None,
        "duration": duration,
        "total_input_tokens": sum(n_in),
        "total_output_tokens": sum(n_out),
        "tokens_from_usage": sum(r.tokens_from_usage for r in ok),
        "tokens_from_chunks": sum(not r.tokens_from_usage for r in ok),
        "request_throughput": per_s(len(ok)),
        "request_goodput": per_s(int(good.sum())),
        "output_throughput": per_s(sum(n_out)),
        "input_throughput": per_s(sum(n_in)),
        "total_token_throughput": per_s(sum(n_in) + sum(n_out)),
        "token_goodput": per_s(good_tokens),
        "goodput_pct": float(good.mean()) if len(ok) else None,
        "mean_concurrency": per_s(float(lat.e2el.sum())) if len(ok) else None,
        "peak_output_tok_s": peak_tok,
        "peak_concurrency": peak_conc,
        "requested_rate": requested_rate,
        "scheduled_rate": scheduled_rate,
        "achieved_rate": len(sent) / span if span > 0 else None,
        "sustained_rate": _sustained_rate(ok, scheduled_rate) if requested_rate else None,
        "slo": slo.as_dict(),
    }
    summary["saturation"] = _saturation(summary, answerable) if requested_rate else None
    summary["saturated"] = summary["saturation"] is not None
    for name in LATENCIES:
        summary.update(stats_ms(name, vars(lat)[name]))
    api = (config or {}).get("run", {}).get("api", "completions")
    summary["prompt_lengths"] = prompt_lengths(records, tokenizer, api)
    summary["per_turn"] = per_turn(records)
    summary["warnings"] = warnings_for(summary)
    summary["metric_definitions"] = METRIC_DEFINITIONS
    summary["config"] = config or {}
    summary["server_stats_before"] = server_stats_before
    summary["server_stats_after"] = server_stats_after
    return summary


def _sustained_rate(ok: Sequence[RequestRecord], offered: float | None) -> float | None:
    t_sched = np.array([r.t_sched for r in ok])
    return sustained_rate(t_sched, np.array([r.t_done for r in ok]), offered)


def _saturation(s: dict, answerable: int) -> str | None:
    """Why the server did not keep up with an open loop's offered load, or None."""
    if s["sent"] < SATURATION_MIN_REQUESTS:
        return None
    reasons = []
    offered, sustained = s["scheduled_rate"], s["sustained_rate"]
    if offered and sustained is not None and sustained < SATURATION * offered:
        reasons.append(
            f"it kept up with about {sustained:.2f} req/s of the {offered:.2f} req/s offered "
            f"({sustained / offered:.0%}; latency grew over the run)"
        )
    if answerable and s["completed"] < SATURATION * answerable:
        lost = answerable - s["completed"]
        reasons.append(
            f"only {s['completed']} of {answerable} requests completed ({lost} failed or rejected)"
        )
    if not reasons:
        return None
    return (
        "saturated: the server did not sustain the offered load: "
        + "; and ".join(reasons)
        + ". Lower --qps (find the rate with --sweep) or add capacity"
    )


def warnings_for(s: dict) -> list[str]:
    out = []
    if s["saturation"]:
        out.append(s["saturation"])
    rate, achieved = s["scheduled_rate"], s["achieved_rate"]
    if rate and achieved and achieved < 0.95 * rate:
        out.append(
            f"achieved send rate {achieved:.2f} req/s is below 95% of the schedule's "
            f"{rate:.2f} req/s: latencies from t_send hide client-side waiting; read ttft_sched"
        )
    if s["tokens_from_chunks"]:
        out.append(
            f"{s['tokens_from_chunks']} request(s) had no usage in the stream: tokens counted "
            "as one per chunk (server lacks stream_options.include_usage)"
        )
    if s["prompt_lengths"]["warning"]:
        out.append(s["prompt_lengths"]["warning"])
    if s["partial"]:
        why = f" ({s['partial_message']})" if s["partial_message"] else ""
        out.append(f"partial run: stopped before the workload was done{why}")
    return out
