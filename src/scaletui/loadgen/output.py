"""Where results go: the terminal table, JSON, per-request JSONL, CSV, the live JSONL stream,
the sweep table and its terminal plot."""

from __future__ import annotations

import csv
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import orjson

from scaletui.loadgen.client import RequestRecord

_DUMP = orjson.OPT_SERIALIZE_NUMPY


def dumps(obj: dict) -> bytes:
    return orjson.dumps(obj, option=_DUMP)


class JsonlSink:
    """One JSON object per line to a file or stdout ('-'), flushed per line (the TUI tails it)."""

    def __init__(self, target: str | None) -> None:
        self._own = target not in (None, "-")
        self._f: IO[bytes] | None = None
        if self._own:
            self._f = open(target, "wb")  # noqa: SIM115 (closed in close())
        elif target == "-":
            self._f = sys.stdout.buffer

    def write(self, obj: dict) -> None:
        if self._f is not None:
            self._f.write(dumps(obj) + b"\n")
            self._f.flush()

    def close(self) -> None:
        if self._own and self._f is not None:
            self._f.close()


def write_json(path: str, obj: dict) -> None:
    Path(path).write_bytes(orjson.dumps(obj, option=_DUMP | orjson.OPT_INDENT_2))


def write_requests_to(
    f: IO[bytes],
    records: Sequence[RequestRecord],
    t_start: float,
    stage: int = 0,
    header: dict | None = None,
) -> None:
    """One line per request; times in seconds since the stage started; the run's header line
    (shard.header: `"type": "run"`, the wall clock of t_start) first, where given."""
    if header is not None:
        f.write(dumps(header) + b"\n")
    for r in records:
        d = {"stage": stage, **r.to_dict()}
        for key in ("t_sched", "t_send", "t_hdr", "t_first", "t_last", "t_done"):
            if d[key] is not None:
                d[key] = d[key] - t_start
        d["chunk_times"] = [t - t_start for t in d["chunk_times"]]
        f.write(orjson.dumps(d) + b"\n")


def scalar_items(summary: dict) -> dict:
    """The summary's scalar keys (for CSV rows)."""
    return {k: v for k, v in summary.items() if isinstance(v, int | float | str | None)}


def write_csv(path: str, summaries: Sequence[dict]) -> None:
    rows = [scalar_items(s) for s in summaries]
    fields = list(dict.fromkeys(k for row in rows for k in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def _fmt(v, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def table(s: dict) -> str:
    """vLLM-style result block, then failures by kind and the warnings. A summary with a `band`
    ({key: [p10, p90]}, a simulated prediction's) shows each figure's band beside it, where the
    band has width."""
    lines = ["{:=^60}".format(" Serving Benchmark Result ")]
    if s.get("partial"):
        lines.append(f"PARTIAL: {s.get('partial_message') or 'stopped early'}")
    band = s.get("band") or {}

    def row(label: str, key: str, digits: int = 2) -> None:
        ends = band.get(key)
        wide = ends and ends[0] != ends[1]
        beside = f"  [{_fmt(ends[0], digits)}-{_fmt(ends[1], digits)}]" if wide else ""
        lines.append(f"{label:<44}{_fmt(s.get(key), digits):>16}{beside}")

    for label, key in (
        ("Successful requests:", "completed"),
        ("Failed requests:", "failed"),
        ("Rejected requests (429):", "rejected"),
        ("Cancelled requests:", "cancelled"),
        ("Benchmark duration (s):", "duration"),
        ("Total input tokens:", "total_input_tokens"),
        ("Total generated tokens:", "total_output_tokens"),
        ("Requested rate (req/s):", "requested_rate"),
        ("Achieved send rate (req/s):", "achieved_rate"),
        ("Sustained rate (req/s):", "sustained_rate"),
        ("Request throughput (req/s):", "request_throughput"),
        ("Request goodput (req/s):", "request_goodput"),
        ("Output token throughput (tok/s):", "output_throughput"),
        ("Peak output token throughput (tok/s):", "peak_output_tok_s"),
        ("Total token throughput (tok/s):", "total_token_throughput"),
        ("Mean concurrency:", "mean_concurrency"),
    ):
        row(label, key)
        if key == "cancelled":
            rate = s.get("failure_rate")
            pct = "-" if rate is None else f"{rate:.1%}"
            lines.append(f"{'Failure rate (failed + rejected):':<44}{pct:>16}")
    for title, stem in (
        ("Time to First Token", "ttft"),
        ("TTFT from schedule (CO-corrected)", "ttft_sched"),
        ("Time per Output Token (excl. 1st token)", "tpot"),
        ("Inter-token Latency", "itl"),
        ("End-to-end Latency", "e2el"),
        ("Schedule delay (t_send - t_sched)", "schedule_delay"),
    ):
        lines.append(f"{title:-^60}")
        for stat in ("mean", "median", "p99"):
            row(
                f"{stat.capitalize() if stat != 'p99' else 'P99'} {stem.upper()} (ms):",
                f"{stat}_{stem}_ms",
            )
    lines += _per_turn(s.get("per_turn"))
    lengths = s.get("prompt_lengths") or {}
    if lengths.get("exact"):
        lines.append(f"{'Prompt lengths:':<44}{'exact':>16}")
        lines.append(
            f"  tokenizer {lengths['tokenizer']}; server count off by >1%: "
            f"{lengths['mismatched']} of {lengths['checked']}"
        )
    elif lengths.get("note"):
        lines.append(f"{'Prompt lengths:':<44}{'estimated':>16}")
    lines += _server_side(s)
    lines += _workers(s)
    if s.get("repeat"):
        lines += repeat_table(s["repeat"])
    check = s.get("slo_check")
    if check:
        said = "pass" if check["passed"] else "FAIL: " + "; ".join(check["reasons"])
        lines.append(f"SLO p{check['percentile']:g}: {said}"[:200])
    kinds = s.get("failures_by_kind") or {}
    if kinds:
        lines.append(f"{'Failures by kind':-^60}")
        for kind, entry in kinds.items():
            lines.append(f"{kind:<44}{entry['count']:>16}")
            lines.append(f"  e.g. {entry['example'][:150]}")
    lines.append("=" * 60)
    lines += [f"warning: {w}" for w in s.get("warnings", [])]
    return "\n".join(lines)


def _server_side(s: dict) -> list[str]:
    """The server's /metrics deltas beside the client's figures, and loadgen's own cost."""
    out = []
    m = s.get("server_metrics")
    if m:
        out.append(f"{' Server /metrics (' + str(m['flavour']) + ', stage deltas) ':-^60}")
        rate = m.get("prefix_cache_hit_rate")
        hits = m.get("prefix_cache_hits")
        if rate is not None:
            of = "" if hits is None else f" ({hits:.0f}/{m['prefix_cache_queries']:.0f} tok)"
            out.append(f"{'Prefix cache hit rate:':<36}{f'{rate:.1%}{of}':>24}")
        for label, key, digits in (
            ("KV cache usage peak:", "kv_cache_usage_peak", 3),
            ("Running requests peak:", "running_peak", 0),
            ("Waiting requests peak:", "waiting_peak", 0),
            ("Preemptions:", "preemptions", 0),
        ):
            if m.get(key) is not None:
                out.append(f"{label:<44}{_fmt(float(m[key]), digits):>16}")
        for kind, factor in (m.get("speed_factor") or {}).items():
            label = f"Step time over its fit ({kind}):"
            out.append(f"{label:<44}{_fmt(factor, 2):>16}")
            seen = sorted(r["factor"][kind] for r in m.get("speed_timeline") or ()
                          if kind in r["factor"])  # fmt: skip
            if len(seen) >= 2:
                lo, hi = seen[len(seen) // 10], seen[-1 - len(seen) // 10]
                label = f"  p10-p90 of its {len(seen)} scrape intervals:"
                out.append(f"{label:<44}{f'{lo:.2f}-{hi:.2f}':>16}")
        out.append(f"{'(ms)':<12}{'server p50':>12}{'client p50':>12}{'server p99':>12}"
                   f"{'client p99':>12}")  # fmt: skip
        rows = (("TTFT", "ttft"), ("ITL", "itl"), ("E2EL", "e2el"), ("Queue", "queue_time"))
        for label, stem in rows:
            key, stem = f"{stem}_ms", (stem if stem != "queue_time" else None)
            h = m.get(key)
            if h is None:
                continue
            c50 = s.get(f"median_{stem}_ms") if stem else None
            c99 = s.get(f"p99_{stem}_ms") if stem else None
            cells = (h["p50"], c50, h["p99"], c99)
            out.append(f"{label:<12}" + "".join(f"{_fmt(c, 1):>12}" for c in cells))
    o = s.get("client_overhead")
    if o:
        lag = o["loop_lag_ms"] or {}
        out.append(
            f"loadgen: loop lag p50/p99/max {_fmt(lag.get('p50'))}/{_fmt(lag.get('p99'))}/"
            f"{_fmt(lag.get('max'))} ms, CPU {_fmt(o['cpu_util'])} core"
            + (" (SATURATED)" if o["saturated"] else "")
        )
    return out


def _workers(s: dict) -> list[str]:
    """A merged run's shards (merge.py): each one's sends, schedule delay and start."""
    rows = s.get("workers")
    if not rows:
        return []
    out = [f"{' Workers: ' + str(len(rows)) + ' shards of one schedule ':-^60}"]
    out.append(f"{'shard':<7}{'sent':>7}{'sent/s':>9}{'sched p50':>10}{'sched p99':>10}"
               f"{'late ms':>9}{'lag p99':>8}")  # fmt: skip
    for r in rows:
        d = r["schedule_delay_ms"]
        out.append(
            f"{r['shard']:<7}{r['sent']:>7}{_fmt(r['achieved_rate'], 0):>9}"
            f"{_fmt(d['p50'], 3):>10}{_fmt(d['p99'], 3):>10}{_fmt(r['start_late_ms'], 1):>9}"
            f"{_fmt(r['loop_lag_p99_ms'], 1):>8}"
        )
    clock = s.get("clock_skew") or {}
    if clock.get("note"):
        out.append(f"clock: {clock['note']}"[:200])
    return out


def repeat_table(rep: dict) -> list[str]:
    """Each headline metric's mean and confidence interval over the repeats."""
    lines = [f"{' ' + str(rep['n']) + ' repeats: mean, ' + rep['interval'] + ' CI ':-^60}"]
    for key, m in rep["metrics"].items():
        ci = "" if m["half_width"] is None else f"+- {m['half_width']:.2f}"
        lines.append(f"{key:<32}{m['mean']:>12.2f}{ci:>16}")
    return lines


def _per_turn(rows: list[dict] | None) -> list[str]:
    """TTFT, TPOT and prompt tokens by conversation turn (ms)."""
    if not rows:
        return []
    out = [f"{'Conversations: by turn':-^60}"]
    out.append(
        f"{'turn':>4} {'sent':>6} {'ok':>6} {'prompt tok':>11} {'ttft p50':>9} "
        f"{'ttft p99':>9} {'tpot p50':>9}"
    )
    for r in rows:
        out.append(
            f"{r['turn']:>4} {r['sent']:>6} {r['completed']:>6} "
            f"{_fmt(r['mean_prompt_tokens'], 0):>11} {_fmt(r['median_ttft_ms'], 1):>9} "
            f"{_fmt(r['p99_ttft_ms'], 1):>9} {_fmt(r['median_tpot_ms'], 2):>9}"
        )
    return out


SWEEP_COLS = (
    ("rate", "requested_rate", 1),
    ("sent/s", "achieved_rate", 1),
    ("kept up/s", "sustained_rate", 1),
    ("req/s", "request_throughput", 2),
    ("out tok/s", "output_throughput", 1),
    ("ttft p50", "median_ttft_ms", 1),
    ("ttft p99", "p99_ttft_ms", 1),
    ("sched p99", "p99_ttft_sched_ms", 1),
    ("tpot p50", "median_tpot_ms", 2),
    ("tpot p99", "p99_tpot_ms", 2),
    ("e2el p99", "p99_e2el_ms", 1),
    ("fail", "failed", 0),
    ("rej", "rejected", 0),
)


def sweep_table(summaries: Sequence[dict]) -> str:
    """Latency vs throughput, one row per stage (latencies in ms)."""
    widths = [max(len(h), 9) for h, _, _ in SWEEP_COLS]
    head = " ".join(f"{h:>{w}}" for (h, _, _), w in zip(SWEEP_COLS, widths, strict=True))
    out = [head, "-" * len(head)]
    checks = any(s.get("slo_check") for s in summaries)
    if checks:
        out[0] += "       slo"
        out[1] = "-" * len(out[0])
    for s in summaries:
        cells = [_fmt(s.get(k), d) for _, k, d in SWEEP_COLS]
        row = " ".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True))
        if checks:
            check = s.get("slo_check")
            row += f"{'-' if not check else 'pass' if check['passed'] else 'FAIL':>10}"
        out.append(row)
    return "\n".join(out)


def sweep_plot(summaries: Sequence[dict], width: int = 72, height: int = 18) -> str | None:
    """p50/p99 TTFT against output throughput as a terminal plot (None without plotext)."""
    try:
        import plotext as plt
    except ImportError:
        return None
    pts = [
        (s["output_throughput"], s["median_ttft_ms"], s["p99_ttft_ms"])
        for s in summaries
        if s.get("output_throughput") is not None and s.get("median_ttft_ms") is not None
    ]
    if not pts:
        return None
    xs = [p[0] for p in pts]
    plt.clear_figure()
    plt.plotsize(width, height)
    plt.theme("clear")
    plt.plot(xs, [p[1] for p in pts], marker="dot", label="TTFT p50")
    plt.plot(xs, [p[2] for p in pts], marker="x", label="TTFT p99")
    plt.xlabel("output tok/s")
    plt.ylabel("ms")
    return plt.uncolorize(plt.build())
