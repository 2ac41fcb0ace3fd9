"""`loadgen merge A.jsonl B.jsonl ... [--out R.json]`: the shards of one schedule as one run.

The shards' per-request records (--save-requests of `loadgen --shard I/N --start-at EPOCH`, or
--workers' children's) are pooled and summarized exactly as one process's are: summarize() over
all of them, so every percentile comes from every record, never from averaging shards. The
runs given must be the N shards of one schedule: the same shard.schedule_of, one start_at, each
shard once; else InputError naming the file. Record times are seconds after each shard's
t_start, which is the common EPOCH (+ ramp) on that shard's host clock. The summary adds
`workers` (per shard: its sends, send rate, schedule delay, start lateness, loop lag, CPU) and
`clock_skew` (what loadgen can tell of the shards' clocks).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import numpy as np

from scaletui.loadgen import output
from scaletui.loadgen.client import RequestRecord
from scaletui.loadgen.report import Slo, latencies, summarize
from scaletui.loadgen.results import Block, InputError, flatten, load_blocks
from scaletui.loadgen.search import min_requests, percentiles_ms, verdict

LATE_MS = 1.0  # a shard ready this long after start_at sent its first requests late
ONE_CLOCK = "one host: every shard read the same clock (skew 0)"
HOSTS = (
    "{n} hosts: each shard started at start_at on its own clock; loadgen cannot see how far "
    "those clocks disagree (check the hosts' NTP, e.g. `chronyc tracking`, where ms matter)"
)


def check(blocks: Sequence[Block]) -> list[Block]:
    """The runs, by shard, once they are shown to be every shard of one schedule."""
    if not blocks:
        raise InputError("give the shards' --save-requests files")
    for b in blocks:
        if b.header is None:
            raise InputError(
                f"{b.path}: no run header line (written by an older loadgen): re-run the shard"
            )
    first = blocks[0]
    want = flatten(first.header["schedule"])
    by_shard: dict[int, Block] = {}
    for b in blocks:
        got = flatten(b.header["schedule"])
        diff = [k for k in sorted(want.keys() | got.keys()) if want.get(k) != got.get(k)]
        if diff:
            k = diff[0]
            raise InputError(
                f"{b.path}: shard {b.header['shard']} is of another schedule than "
                f"{first.path}'s shard {first.header['shard']}: {k} {got.get(k)!r} vs "
                f"{want.get(k)!r}"
            )
        if b.header["start_at"] != first.header["start_at"]:
            raise InputError(
                f"{b.path}: shard {b.header['shard']} started at {b.header['start_at']}, "
                f"{first.path}'s at {first.header['start_at']}: give every shard one --start-at"
            )
        index, count = (int(x) for x in b.header["shard"].split("/"))
        if count != int(first.header["shard"].split("/")[1]):
            raise InputError(
                f"{b.path}: shard {b.header['shard']}, but {first.path} has "
                f"{first.header['shard']}: one schedule is cut into one number of shards"
            )
        if index in by_shard:
            raise InputError(
                f"{b.path}: shard {b.header['shard']} again (also in {by_shard[index].path})"
            )
        by_shard[index] = b
    missing = [i for i in range(count) if i not in by_shard]
    if missing:
        raise InputError(f"shard {missing[0]}/{count} is missing (given: "
                         f"{', '.join(sorted({b.path for b in blocks}))})")  # fmt: skip
    return [by_shard[i] for i in range(count)]


def worker_row(b: Block) -> dict:
    """One shard's own figures: what it sent, how far behind its schedule, its start."""
    h = b.header
    recs = [r for r in b.records if not r.get("warmup")]
    sends = sorted(r["t_send"] for r in recs if r["t_send"] is not None)
    delays = np.array([r["t_send"] - r["t_sched"] for r in recs if r["t_send"] is not None])
    span = sends[-1] - sends[0] if len(sends) > 1 else 0.0
    o = h.get("client_overhead") or {}
    delay = {"p50": None, "p99": None, "max": None}
    if delays.size:
        p50, p99 = np.percentile(delays * 1e3, [50, 99])
        delay = {"p50": float(p50), "p99": float(p99), "max": float(delays.max() * 1e3)}
    return {
        "shard": h["shard"],
        "file": b.path,
        "host": h["host"],
        "pid": h["pid"],
        "sent": len(sends),
        "completed": sum(r["outcome"] == "ok" for r in recs),
        "achieved_rate": len(sends) / span if span > 0 else None,
        "schedule_delay_ms": delay,
        "start_late_ms": h["start_late_ms"],
        "t_start_epoch": h["t_start_epoch"],
        "loop_lag_p99_ms": (o.get("loop_lag_ms") or {}).get("p99"),
        "cpu_util": o.get("cpu_util"),
        "saturated": bool(o.get("saturated")),
    }


def clock_skew(blocks: Sequence[Block]) -> dict:
    hosts = sorted({b.header["host"] for b in blocks})
    late = [b.header["start_late_ms"] for b in blocks if b.header["start_late_ms"] is not None]
    return {
        "hosts": hosts,
        "skew_ms": 0.0 if len(hosts) == 1 else None,  # None: not measurable from here
        "start_at": blocks[0].header["start_at"],
        "max_start_late_ms": max(late) if late else None,
        "note": ONE_CLOCK if len(hosts) == 1 else HOSTS.format(n=len(hosts)),
    }


def merged(blocks: Sequence[Block]) -> dict:
    """The summary one process would have written for the whole schedule, plus `workers` and
    `clock_skew`. Server-side figures (`server_metrics`, /stats) are shard 0's reads."""
    blocks = check(blocks)
    h0 = blocks[0].header
    records = [RequestRecord.from_dict(r) for b in blocks for r in b.records]
    stopped = next((b.header for b in blocks if b.header["partial"]), None)
    slo = h0.get("slo")
    summary = summarize(
        records,
        t_start=0.0,
        slo=Slo(**slo) if slo else None,
        requested_rate=h0["requested_rate"],
        config=h0["config"],
        server_stats_before=h0["server_stats_before"],
        server_stats_after=h0["server_stats_after"],
        partial=stopped is not None,
        partial_reason=stopped and stopped["partial_reason"],
        partial_message=stopped and stopped["partial_message"],
        tokenizer=h0["schedule"]["workload"]["tokenizer"],
    )
    rule = h0.get("slo_rule")
    if slo and rule:  # judged as the one process judges its stage (stages.py)
        summary["slo_check"] = verdict(
            percentiles_ms(latencies([r for r in records if not r.warmup]), rule["percentile"]),
            Slo(**slo),
            percentile=rule["percentile"],
            completed=summary["completed"],
            needed=min_requests(rule["percentile"], rule["tail"]),
            failure_rate=summary["failure_rate"],
            max_failure_rate=rule["max_failure_rate"],
            saturation=summary["saturation"],
        )
    rows = [worker_row(b) for b in blocks]
    summary["command"] = h0["command"]  # the load's, as one process's summary has it
    summary["workers"] = rows
    summary["clock_skew"] = clock_skew(blocks)
    summary["server_metrics"] = h0["server_metrics"]
    loads = [(b.header["client_overhead"], r["shard"]) for b, r in zip(blocks, rows, strict=True)]
    loads = [(o, s) for o, s in loads if o]
    if loads:  # the busiest shard's: the one whose timestamps carry the most of its own queueing
        worst, shard = max(loads, key=lambda x: (x[0]["loop_lag_ms"] or {}).get("p99") or 0.0)
        summary["client_overhead"] = {**worst, "shard": shard}
        for o, s in loads:
            if o["saturated"]:
                summary["warnings"].append(f"shard {s}: {o['saturation']}")
    for r in rows:
        if r["start_late_ms"] is not None and r["start_late_ms"] > LATE_MS:
            summary["warnings"].append(
                f"shard {r['shard']} was ready {r['start_late_ms']:.0f} ms after --start-at: "
                "its first requests left late (see its schedule delay); start later"
            )
    return summary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loadgen merge",
        description="the --save-requests files of every shard of one schedule (loadgen --shard "
        "I/N --start-at EPOCH) as one run's summary, percentiles from all records",
    )
    p.add_argument("files", nargs="+", help="per-request JSONL files, one or more shards each")
    p.add_argument("--out", help="the merged summary JSON")
    p.add_argument("--csv", help="the merged summary as one CSV row")
    p.add_argument("--quiet", action="store_true", help="no table")
    p.add_argument(
        "--max-failure-rate", type=float, default=0.01, help="exit 3 above this (as loadgen)"
    )
    return p


def run(argv: list[str]) -> tuple[dict, argparse.Namespace]:
    """`loadgen merge ...`: the merged summary (written and printed as asked)."""
    args = build_parser().parse_args(argv)
    blocks = [b for path in args.files for b in load_blocks(path)]
    summary = merged(blocks)
    if args.out:
        output.write_json(args.out, summary)
    if args.csv:
        output.write_csv(args.csv, [summary])
    if not args.quiet:
        print(output.table(summary), flush=True)
    return summary, args
