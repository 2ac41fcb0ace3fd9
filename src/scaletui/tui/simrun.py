"""The simulated run request by request, so that a part of a measured run is compared with the
same part simulated, not with the whole run's percentiles.

A closed loop starts with every request at once: the first wave queues behind its own prefills
and reads a TTFT about three times the steady one (docs/tui.md, "Floor, expected, measured",
has the figures). The KPI panel pools the run's last five 1 s
windows, so in a run's first seconds it holds only that wave; the expectation for it is the same
requests simulated: the run's completions number `first` on, in the windows' own counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from scaletui.latency import pooled, tpot_s
from scaletui.roofline.simrecords import SimResult


@dataclass(frozen=True, eq=False)
class SimRun:
    """The successful simulated requests in completion order, and the output tokens' times.

    `steady` counts the completions up to the simulated run's last send: after it a closed loop
    drains (fewer requests running), which a TUI run, restarted before it ends, barely sees. A
    part past them is read as the last part of the same size before it."""

    ttft_ms: np.ndarray
    tpot_ms: np.ndarray  # nan for a one-token output
    steady: int
    token_t: np.ndarray  # s after the run's start, sorted: every output token's arrival
    token_n: np.ndarray  # tokens arriving then (a chunk of decode steps, or a first token)
    last_send: float

    @classmethod
    def of(cls, r: SimResult, output_len: np.ndarray) -> SimRun:
        ok = r.outcome == "ok"
        order = np.flatnonzero(ok)[np.argsort(r.t_last[ok], kind="stable")]
        ttft = (r.t_first - r.t_send)[order]
        n_out = np.asarray(output_len)[order]
        e2el = (r.t_last - r.t_send)[order]
        tpot = tpot_s(ttft, e2el, n_out)
        sent = r.t_send[~np.isnan(r.t_send)]
        last_send = float(sent.max()) if sent.size else 0.0
        t = np.concatenate([r.chunk_t, r.t_first[ok]])
        n = np.concatenate([r.chunk_n, np.ones(int(ok.sum()), int)])
        by_t = np.argsort(t, kind="stable")
        return cls(
            ttft_ms=ttft * 1e3,
            tpot_ms=tpot * 1e3,
            steady=int(np.searchsorted(r.t_last[order], last_send, side="right")),
            token_t=t[by_t],
            token_n=n[by_t],
            last_send=last_send,
        )

    def latency(self, metric: str, q: float, first: int, counts: list[int]) -> float | None:
        """What the KPI panel's pool reads for these requests: the q-th percentile of each
        window's completions (`counts`, the windows' completed requests, from the run's
        completion number `first`), each counted once per request, then the q-th percentile of
        those; `metric` ttft | tpot. None when nothing is in the part."""
        values = {"ttft": self.ttft_ms, "tpot": self.tpot_ms}[metric]
        total = sum(counts)
        if total <= 0 or self.steady <= 0:
            return None
        lo = first if first + total <= self.steady else max(0, self.steady - total)
        windows: list[tuple[float, int]] = []
        for n in counts:
            part = values[lo : lo + n]
            lo += n
            part = part[~np.isnan(part)]
            if part.size:
                windows.append((float(np.percentile(part, q)), int(part.size)))
        return pooled(windows, q)

    def tok_s(self, t0: float, t1: float) -> float | None:
        """Output tokens per second reaching the clients between t0 and t1 s into the run (past
        the last send: the same span ending there). None for an empty span."""
        span = t1 - t0
        if span <= 0 or self.last_send <= 0:
            return None
        if t1 > self.last_send:
            t0, t1 = max(0.0, self.last_send - span), self.last_send
        lo, hi = np.searchsorted(self.token_t, [t0, t1], side="right")
        return float(self.token_n[lo:hi].sum()) / (t1 - t0)
