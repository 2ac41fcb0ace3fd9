"""The simulator's summary: loadgen's report keys and formulas (serving.md §5), from per-request
arrays instead of loadgen's records, vectorised so 10,000 requests take milliseconds.

Same definitions as loadgen.report: TTFT from t_send, TPOT = (E2EL - TTFT) / (N - 1) for N > 1,
ITL pooled over token chunks (a gap g over n tokens counts n times as g / n), D = last request
end - first t_sched, numpy's linear percentiles, null for an empty sample. Extra keys name what
only a simulation knows: `mean_running_batch`, `mean_running`, `generate_calls`.
"""

from __future__ import annotations

import numpy as np

from scaletui.latency import (
    SATURATION,
    SATURATION_MIN_REQUESTS,
    stats_ms,
    sustained_rate,
    tpot_s,
)

__all__ = ["summary"]


def _rate(count: float, span: float) -> float | None:
    return count / span if span > 0 else None


def summary(
    *,
    t_sched: np.ndarray,
    t_send: np.ndarray,
    t_first: np.ndarray,
    t_second: np.ndarray,
    t_last: np.ndarray,
    outcome: np.ndarray,
    input_len: np.ndarray,
    output_len: np.ndarray,
    chunk_t: np.ndarray,
    chunk_gap: np.ndarray,
    chunk_n: np.ndarray,
    requested_rate: float | None = None,
    extra: dict | None = None,
) -> dict:
    """The loadgen summary dict of one simulated run (times in s after t0)."""
    sent = ~np.isnan(t_send)
    ok = outcome == "ok"
    n_ok = int(ok.sum())
    t_start = float(np.nanmin(t_sched)) if sent.any() else 0.0
    t_done = np.where(ok, t_last, t_send)  # a 400/429 ends when it is sent
    t_end = float(t_done[sent].max()) if sent.any() else t_start
    duration = t_end - t_start
    n_out, n_in = output_len[ok], input_len[ok]
    ttft = t_first[ok] - t_send[ok]
    e2el = t_last[ok] - t_send[ok]
    tpot = tpot_s(ttft, e2el, n_out)[n_out > 1]
    itl = np.repeat(chunk_gap / chunk_n, chunk_n)
    sends = np.sort(t_send[sent])
    scheds = np.sort(t_sched[sent])
    send_span = float(sends[-1] - sends[0]) if sends.size > 1 else 0.0
    sched_span = float(scheds[-1] - scheds[0]) if scheds.size > 1 else 0.0
    rejected = int((outcome == "rejected").sum())
    failed = int((outcome == "failed").sum())
    scheduled_rate = _rate(int(sent.sum()), sched_span)
    buckets = np.bincount(((chunk_t - t_start) // 1.0).astype(int), weights=chunk_n)
    first_bucket = np.bincount(((t_first[ok] - t_start) // 1.0).astype(int))
    n = max(buckets.size, first_bucket.size)
    per_s = np.pad(buckets, (0, n - buckets.size)) + np.pad(
        first_bucket, (0, n - first_bucket.size)
    )
    events = np.concatenate(
        [
            np.stack([t_send[sent], np.ones(sends.size)], 1),
            np.stack([t_done[sent], -np.ones(sends.size)], 1),
        ]
    )
    events = events[np.lexsort((events[:, 1], events[:, 0]))]
    out: dict = {
        "partial": False,
        "num_prompts": int(len(outcome)),
        "sent": int(sent.sum()),
        "completed": n_ok,
        "failed": failed,
        "rejected": rejected,
        "cancelled": 0,
        "failure_rate": (failed + rejected) / int(sent.sum()) if sent.any() else None,
        "duration": duration,
        "total_input_tokens": int(n_in.sum()),
        "total_output_tokens": int(n_out.sum()),
        "request_throughput": _rate(n_ok, duration),
        "request_goodput": _rate(n_ok, duration),  # no SLOs given: every completion is good
        "output_throughput": _rate(int(n_out.sum()), duration),
        "input_throughput": _rate(int(n_in.sum()), duration),
        "total_token_throughput": _rate(int(n_in.sum() + n_out.sum()), duration),
        "goodput_pct": 1.0 if n_ok else None,
        "mean_concurrency": _rate(float(e2el.sum()), duration) if n_ok else None,
        "peak_output_tok_s": float(per_s.max()) if per_s.size else None,
        "peak_concurrency": int(np.cumsum(events[:, 1]).max()) if events.size else 0,
        "requested_rate": requested_rate,
        "scheduled_rate": scheduled_rate,
        "achieved_rate": _rate(int(sent.sum()), send_span),
        "sustained_rate": sustained_rate(t_sched[ok], t_last[ok], scheduled_rate)
        if requested_rate
        else None,
    }
    out["saturated"] = bool(
        requested_rate
        and out["sent"] >= SATURATION_MIN_REQUESTS
        and (
            (
                out["sustained_rate"] is not None
                and scheduled_rate
                and out["sustained_rate"] < SATURATION * scheduled_rate
            )
            or n_ok < SATURATION * out["sent"]
        )
    )
    samples = {
        "ttft": ttft,
        "tpot": tpot,
        "itl": itl,
        "e2el": e2el,
        "ttft_sched": t_first[ok] - t_sched[ok],
        "e2el_sched": t_last[ok] - t_sched[ok],
        "schedule_delay": t_send[sent] - t_sched[sent],
        "ntpot": e2el / n_out,
        "ttst": (t_second[ok] - t_send[ok])[~np.isnan(t_second[ok])],
        "icl": chunk_gap,
    }
    for name, values in samples.items():
        out.update(stats_ms(name, values))
    out.update(extra or {})
    return out
