"""`loadgen report RESULT.json... --html OUT`: one self-contained HTML file (inline SVG, inline
CSS, no script, nothing loaded from anywhere) and, with --png, the same charts as one image.

It shows latency against load (one point per stage, each file a line set, the predicted curve
of `scaletui simulate` in grey, an SLO search's max_rate marked), TTFT/TPOT CDFs from
--save-requests files, TTFT by conversation turn, the server's side of each stage and the exact
command of each run. What an input lacks is said in words, never drawn from guesses.
"""

from __future__ import annotations

import argparse
import html
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from scaletui.loadgen import charts
from scaletui.loadgen.output import SWEEP_COLS, _fmt
from scaletui.loadgen.results import (
    InputError,
    Result,
    Samples,
    flatten,
    legend_names,
    load_requests,
    load_result,
    merge_predicted,
    samples,
)

EXIT_USAGE = 2
PERCENTILES = (50, 90, 95, 99, 99.9)  # those a summary has (latency.PERCENTILES)
STATS_KEYS = ("kv_cache_usage_perc", "kv_pages.", "requests.", "tokens.", "batch.")  # /stats
CSS = """body{font:14px/1.45 system-ui,sans-serif;max-width:1100px;margin:1.5em auto;color:#222}
h2{border-bottom:1px solid #ccc;margin-top:2em}table{border-collapse:collapse;margin:.6em 0}
td,th{border:1px solid #ddd;padding:2px 8px;text-align:right}th{background:#f4f4f4}
td:first-child,th:first-child{text-align:left}pre{background:#f6f6f6;padding:.6em;
white-space:pre-wrap;word-break:break-all}.note{color:#666;font-style:italic}
svg{max-width:100%;height:auto}"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loadgen report",
        description="Write loadgen results as one self-contained HTML report (and a PNG).",
    )
    p.add_argument("results", nargs="+", metavar="RESULT.json", help="loadgen --out files")
    p.add_argument("--html", required=True, metavar="OUT.html", help="the report to write")
    p.add_argument("--png", metavar="OUT.png", help="also the charts as one PNG image")
    p.add_argument(
        "--predicted",
        nargs="+",
        default=[],
        metavar="SIM.json",
        help="`scaletui simulate --out` files (one per rate): the predicted curve (simulate's "
        "files among the RESULTs are recognised too)",
    )
    p.add_argument(
        "--requests",
        nargs="+",
        default=[],
        metavar="REQ.jsonl",
        help="--save-requests files: TTFT/TPOT CDFs (a result of the same name names its stages)",
    )
    p.add_argument("--x", choices=tuple(charts.X_KEYS), default="throughput", help="x axis")
    p.add_argument(
        "--percentiles",
        default="50,99",
        help=f"latency percentiles on the curves, of {','.join(f'{q:g}' for q in PERCENTILES)}",
    )
    return p


def parse_percentiles(text: str) -> list[float]:
    try:
        got = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        got = []
    if not got or any(p not in PERCENTILES for p in got):
        raise InputError(
            f"--percentiles wants some of {','.join(f'{q:g}' for q in PERCENTILES)}, got {text!r}"
        )
    return got


def table(head: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cell = lambda tag, v: f"<{tag}>{html.escape(v if isinstance(v, str) else _fmt(v))}</{tag}>"
    out = ["<table><tr>" + "".join(cell("th", h) for h in head) + "</tr>"]
    out += ["<tr>" + "".join(cell("td", v) for v in row) + "</tr>" for row in rows]
    return "\n".join(out) + "</table>"


def note(text: str) -> str:
    return f'<p class="note">{html.escape(text)}</p>'


def stage_name(r: Result, i: int) -> str:
    rate = r.stages[i].get("requested_rate")
    return f"stage {i}" + (f" ({rate:g} req/s)" if rate else "")


def stage_table(r: Result) -> str:
    head = ["stage", *(h for h, _, _ in SWEEP_COLS), "saturated"]
    rows = [
        [
            str(i),
            *(_fmt(s.get(k), d) for _, k, d in SWEEP_COLS),
            "yes" if s.get("saturated") else "no",
        ]
        for i, s in enumerate(r.stages)
    ]
    return table(head, rows)


def latency_section(results: Sequence[Result], x: str, pct: Sequence[float]) -> tuple[str, list]:
    curves = [
        charts.Curve(r.name, r.stages, predicted=r.simulated, max_rate=r.max_rate) for r in results
    ]
    parts = ["<h2>Latency against load</h2>"]
    draws = [charts.draw_latency(curves, x, pct)]
    parts.append(charts.svg(draws[0]))
    for r in results:
        key = charts.percentile_key("ttft", pct[0])
        if not charts.curve_points(r.stages, x, key)[0]:
            parts.append(note(f"{r.name}: no stage has {charts.X_KEYS[x]} and {key}: not drawn"))
        kind = "predicted by scaletui simulate" if r.simulated else "measured"
        parts.append(f"<h3>{html.escape(r.name)} ({kind}; latencies in ms)</h3>")
        if r.max_rate is not None:
            parts.append(f"<p>max_rate (SLO search): {r.max_rate:.4g} req/s</p>")
        parts.append(stage_table(r))
    return "\n".join(parts), draws


def cdf_section(sets: Sequence[Samples], paths: Sequence[str]) -> tuple[str, list]:
    parts = ["<h2>Latency distributions</h2>"]
    if not sets:
        parts.append(
            note(
                "No per-request file was given, so there is no CDF: a summary holds percentiles "
                "only. Run loadgen with --save-requests FILE and pass it with --requests FILE."
            )
        )
        return "\n".join(parts), []
    draws = [charts.draw_cdfs(sets)]
    parts.append(charts.svg(draws[0]))
    q = lambda a, p: float(np.percentile(a, p)) if a.size else None  # noqa: E731
    rows = [
        [s.name, s.ttft_ms.size, q(s.ttft_ms, 50), q(s.ttft_ms, 99), q(s.tpot_ms, 50)]
        + [q(s.tpot_ms, 99)]
        for s in sets
    ]
    parts.append(table(["requests", "ok", "ttft p50", "ttft p99", "tpot p50", "tpot p99"], rows))
    parts.append(note("from " + ", ".join(paths) + " (ms, ok requests)"))
    return "\n".join(parts), draws


def turn_section(results: Sequence[Result]) -> tuple[str, list]:
    parts = ["<h2>Conversations: TTFT by turn</h2>"]
    found = [
        (r.name + (f" {stage_name(r, i)}" if len(r.stages) > 1 else ""), s["per_turn"])
        for r in results
        for i, s in enumerate(r.stages)
        if s.get("per_turn")
    ]
    if not found:
        parts.append(note("No stage ran conversations (--turns): no per-turn figures."))
        return "\n".join(parts), []
    draws = [charts.draw_per_turn(found)]
    parts.append(charts.svg(draws[0]))
    head = ["turn", "sent", "ok", "prompt tok", "ttft p50", "ttft p99", "tpot p50"]
    for name, rows in found:
        parts.append(f"<h3>{html.escape(name)}</h3>")
        keys = ("turn", "sent", "completed", "mean_prompt_tokens", "median_ttft_ms")
        keys += ("p99_ttft_ms", "median_tpot_ms")
        parts.append(table(head, [[row.get(k) for k in keys] for row in rows]))
    return "\n".join(parts), draws


def server_section(results: Sequence[Result]) -> str:
    parts = ["<h2>Server and client side</h2>"]
    shown = False
    for r in results:
        for i, s in enumerate(r.stages):
            where = f"{r.name} {stage_name(r, i)}"
            for key, title in (("server_metrics", "server metrics"), ("client_overhead", "client")):
                if isinstance(s.get(key), dict) and s[key]:
                    parts.append(f"<h3>{html.escape(where)}: {title} ({key})</h3>")
                    parts.append(table(["name", "value"], list(flatten(s[key]).items())))
                    shown = True
            before, after = s.get("server_stats_before"), s.get("server_stats_after")
            if isinstance(before, dict) and isinstance(after, dict):
                b, a = flatten(before), flatten(after)
                names = [k for k in a if k.startswith(STATS_KEYS) and _num(a[k])]
                rows = [[k, b.get(k), a[k], _delta(b.get(k), a[k])] for k in names]
                parts.append(f"<h3>{html.escape(where)}: the server's /stats</h3>")
                parts.append(table(["name", "before", "after", "after - before"], rows))
                shown = True
    if not shown:
        parts.append(note("No stage has server_metrics, client_overhead or /stats snapshots."))
    return "\n".join(parts)


def _num(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _delta(b: object, a: object) -> float | None:
    return a - b if _num(a) and _num(b) else None  # type: ignore[operator]


def run_section(results: Sequence[Result]) -> str:
    parts = ["<h2>Runs</h2>"]
    for r in results:
        parts.append(f"<h3>{html.escape(r.name)} <small>({html.escape(r.path)})</small></h3>")
        commands = [r.command] if r.command else []
        for s in r.stages:  # a merged predicted curve: each file's own
            if isinstance(s.get("command"), list) and s["command"] not in commands:
                commands.append(s["command"])
        if commands:
            parts += [f"<pre>{html.escape(shlex.join(c))}</pre>" for c in commands]
        else:
            parts.append(
                note(
                    "The command was not recorded (a result from before loadgen "
                    "recorded it, or one that no command wrote)."
                )
            )
        lengths = r.stages[0].get("prompt_lengths") or {}
        lines = [lengths.get("note")] if lengths.get("note") else []
        lines += [
            f"{stage_name(r, i)}: {w}"
            for i, s in enumerate(r.stages)
            for w in s.get("warnings") or []
        ]
        if lines:
            parts.append("<ul>" + "".join(f"<li>{html.escape(t)}</li>" for t in lines) + "</ul>")
    return "\n".join(parts)


def build(
    results: Sequence[Result],
    request_sets: Sequence[Samples],
    request_paths: Sequence[str],
    x: str = "throughput",
    percentiles: Sequence[float] = (50, 99),
) -> tuple[str, list[charts.Draw]]:
    """(the HTML text, the chart drawers for a PNG)."""
    lat, draws = latency_section(results, x, percentiles)
    cdfs, more = cdf_section(request_sets, request_paths)
    turns, most = turn_section(results)
    draws += more + most
    stamp = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    body = "\n".join([lat, cdfs, turns, server_section(results), run_section(results)])
    page = (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>loadgen report</title><style>{CSS}</style></head><body>\n"
        f"<h1>loadgen report</h1><p>written {html.escape(stamp)} from "
        f"{html.escape(', '.join(r.path for r in results))}</p>\n{body}\n</body></html>\n"
    )
    return page, draws


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        pct = parse_percentiles(args.percentiles)
        paths = [*args.results, *args.predicted]
        results = [load_result(p, n) for p, n in zip(paths, legend_names(paths), strict=True)]
        for r in results[len(args.results) :]:
            if not r.simulated:
                raise InputError(
                    f"{r.path}: --predicted wants `scaletui simulate --out` JSON "
                    "(config.simulated true), got a measured loadgen result"
                )
        sims = [r for r in results if r.simulated]
        results = [r for r in results if not r.simulated]
        if sims:  # one predicted curve, after the measured ones
            results.append(merge_predicted(sims))
        rates = {r.name: [s.get("requested_rate") for s in r.stages] for r in results}
        sets = []
        for p, name in zip(args.requests, legend_names(args.requests), strict=True):
            sets += samples(load_requests(p), name, rates.get(name, []))
        page, draws = build(results, sets, args.requests, args.x, pct)
        Path(args.html).write_text(page, encoding="utf-8")
        if args.png:
            Path(args.png).write_bytes(charts.png(draws))
    except (InputError, OSError) as exc:
        print(f"loadgen report: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"wrote {args.html}" + (f" and {args.png}" if args.png else ""))
    return 0
