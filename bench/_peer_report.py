"""bench/peer_vllm.py's rows and table: ours against vLLM, run once before ours and once after.

One row per figure at one point: TPOT p50 and output tok/s of a closed loop at N streams, TTFT
p50 of an N-token prompt sent alone. `ratio` is ours / the mean of vLLM's runs; `ratio_runs` is
ours / each run in order (before ours, after ours), and `vllm_drift` is vLLM's second run / its
first - 1: how far the host moved while ours ran. Where the two `ratio_runs` lie on both sides
of 1.0, the host's drift is as large as the gap. TPOT and TTFT: lower is better for us.
"""

from __future__ import annotations

from dataclasses import dataclass

# row metric: (loadgen summary key, the table's label)
CLOSED = {"tpot_ms": ("median_tpot_ms", "TPOT p50 ms"), "tok_s": ("output_throughput", "tok/s")}
TTFT = {"ttft_ms": ("median_ttft_ms", "TTFT p50 ms")}
FORMATS = {"tpot_ms": ".2f", "tok_s": ".1f", "ttft_ms": ".1f"}
KERNEL_KEYS = ("kernels_running", "kernels_dense", "kernels_note")  # /stats config, ours only


@dataclass(frozen=True)
class Measured:
    """One server run's loadgen summaries: closed loops by streams, TTFT runs by prompt length."""

    server: str  # "vllm" | "ours"
    precision: str  # vLLM: its --dtype; ours: the --weight-dtype
    model: str  # the id the server reports at /v1/models
    closed: dict[int, dict]  # streams -> loadgen summary
    ttft: dict[int, dict]  # prompt tokens -> loadgen summary (concurrency 1)
    kernels: dict | None = None  # ours: /stats config's KERNEL_KEYS after the run


def ratio(ours: float | None, theirs: float | None) -> float | None:
    return ours / theirs if ours is not None and theirs else None


def _point(ours: float | None, runs: list[float | None]) -> dict:
    """ours against vLLM's runs at one point: the mean, the ratios and the drift."""
    have = [v for v in runs if v is not None]
    mean = sum(have) / len(have) if have and len(have) == len(runs) else None
    drift = ratio(runs[1], runs[0]) if len(runs) == 2 else None
    return {
        "ours": ours,
        "vllm": runs,
        "vllm_mean": mean,
        "vllm_drift": None if drift is None else drift - 1,
        "ratio": ratio(ours, mean),
        "ratio_runs": [ratio(ours, v) for v in runs],
    }


def _value(m: Measured | None, part: str, at: int, key: str) -> float | None:
    """A run's figure `key` at streams or prompt length `at` of its `part` (closed | ttft)."""
    return getattr(m, part).get(at, {}).get(key) if m else None


def rows(vllm: list[Measured], ours: list[Measured], shape: str, input_len: int) -> list[dict]:
    """One row per (our precision, metric, point); vLLM's runs in the order they ran (none,
    one, or before and after ours); a vLLM-only run gives rows with ours None."""
    streams = sorted({c for m in [*vllm, *ours] for c in m.closed})
    prompts = sorted({n for m in [*vllm, *ours] for n in m.ttft})
    points = [(name, key, c, "closed", c) for name, (key, _) in CLOSED.items() for c in streams]
    points += [(name, key, None, "ttft", n) for name, (key, _) in TTFT.items() for n in prompts]
    out = []
    for o in ours or [None]:
        kernels = (o.kernels if o else None) or {}
        for name, key, c, part, at in points:
            row = {
                "shape": shape,
                "precision": o.precision if o else None,
                "metric": name,
                "streams": c,
                "prompt_len": input_len if part == "closed" else at,
                **_point(_value(o, part, at, key), [_value(v, part, at, key) for v in vllm]),
                "vllm_runs": len(vllm),
                "vllm_precision": vllm[0].precision if vllm else None,
                "ours_model": o.model if o else None,
                "vllm_model": vllm[0].model if vllm else None,
                **{k: kernels.get(k) for k in KERNEL_KEYS},
            }
            out.append(row)
    return out


def legend(runs: int) -> str:
    """What the ratio columns mean with `runs` vLLM runs."""
    if runs == 2:
        return ("ratio = ours / the mean of vLLM's runs; vs 1st, vs 2nd = ours / each run "
                "(before ours, after ours); drift = vLLM's 2nd / its 1st - 1")  # fmt: skip
    return "ratio = ours / vLLM" if runs else "no vLLM run: no ratios"


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def table(rows_: list[dict]) -> str:
    """The rows as text, then the kernels each precision of ours ran."""
    runs = max((r["vllm_runs"] for r in rows_), default=0)
    heads = {0: [], 1: ["vLLM"], 2: ["vLLM 1st", "vLLM 2nd"]}[runs]
    ratio_heads = ["vs 1st", "vs 2nd", "drift"] if runs == 2 else []
    head = f"{'ours':>5} {'metric':<12} {'at':>11} | {'ours':>8} " + "".join(
        f"{h:>9}" for h in heads
    )
    head += f" | {'ratio':>6}" + "".join(f"{h:>7}" for h in ratio_heads) if runs else ""
    lines = [head.rstrip()]
    labels = {**CLOSED, **TTFT}
    for r in rows_:
        fmt = FORMATS[r["metric"]]
        c = r["streams"]
        at = f"{c} stream{'s' if c > 1 else ''}" if c else f"{r['prompt_len']} tok"
        line = f"{r['precision'] or '-':>5} {labels[r['metric']][1]:<12} {at:>11} | "
        line += f"{_num(r['ours'], fmt):>8} " + "".join(f"{_num(v, fmt):>9}" for v in r["vllm"])
        if runs:
            line += f" | {_num(r['ratio'], '.2f'):>6}"
        if runs == 2:
            line += "".join(f"{_num(x, '.2f'):>7}" for x in r["ratio_runs"])
            drift = r["vllm_drift"]
            line += f"{'-' if drift is None else format(drift, '+.0%'):>7}"
        lines.append(line.rstrip())
    seen = {}
    for r in rows_:
        if r["precision"] and r["kernels_running"]:
            seen[r["precision"]] = r
    for precision, r in seen.items():
        dense = f", dense {r['kernels_dense']}" if r["kernels_dense"] else ""
        note = f" ({r['kernels_note']})" if r["kernels_note"] else ""
        lines.append(f"ours {precision}: {r['kernels_running']} kernels{dense}{note}")
    return "\n".join(lines)
