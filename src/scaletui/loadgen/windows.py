"""One live window's line (docs/interfaces.md `window`): what the runner saw in the last
`window_s` seconds, as the TUI and --jsonl read it. Pure: the runner gathers, this shapes."""

from __future__ import annotations

from collections.abc import Sequence

from scaletui.loadgen.client import FAILED, RequestRecord
from scaletui.loadgen.report import Latencies, quantiles_ms


def window_line(
    t: float,
    step: float,
    done: Sequence[RequestRecord],
    lat: Latencies,
    out_tokens: int,
    sent: int,
    delays: list[float],
    in_flight: int,
) -> dict:
    """The window ending `t` s after t0: `done` the requests that ended in it (`lat` their
    latencies), `out_tokens` the tokens that arrived in it, `sent` and `delays` (schedule
    delays, s) of the requests sent in it, `in_flight` at its end."""
    ok = sum(r.outcome == "ok" for r in done)
    return {
        "type": "window",
        "t": round(t, 6),
        "window_s": step,
        "sent": sent,
        "completed": ok,
        "failed": sum(r.outcome in FAILED for r in done),
        "rejected": sum(r.outcome == "rejected" for r in done),
        "cancelled": sum(r.outcome == "cancelled" for r in done),
        "in_flight": in_flight,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / step,
        "request_rate": ok / step,
        "ttft_ms": quantiles_ms(lat.ttft),
        "tpot_ms": quantiles_ms(lat.tpot),
        "itl_ms": quantiles_ms(lat.itl),
        "e2el_ms": quantiles_ms(lat.e2el),
        "schedule_delay_ms": quantiles_ms(delays),  # requests *sent* in the window
        "ttft_sched_ms": quantiles_ms(lat.ttft_sched),
    }
