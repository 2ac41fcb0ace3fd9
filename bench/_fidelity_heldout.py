"""bench/fidelity.py's held-out workloads (issue 44, part 4): bursty arrivals with lengths,
prefixes and conversations the simulator was not tuned on, each as (1) the a-priori banded
prediction, (2) a loadgen run against the real server, (3) the speed factor the server measured
over that stage (loadgen's `server_metrics.speed_factor`) and (4) the prediction re-run at the
speeds the run met ("as run": `--as-run-from` the loadgen result, each call at its moment's speed
from the stage's speed timeline; beside it "as run, mean": at the stage's one mean factor);
and for the first bursty run a per-request timeline, simulated against measured: queue wait,
prefill, first decode, so a TTFT miss can be put on the queue or on the calls.

Pure parts (the workloads' flags, a run's row, the timeline) are tested; `measure` needs a
server and loadgen.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson

JUDGED = {"p50_ttft_ms": "median_ttft_ms", "p50_tpot_ms": "median_tpot_ms"}  # ours: loadgen's
NAMES = ("uniform", "sharegpt", "prefix", "turns")
SHAREGPT_SIGMA = (0.7, 0.5)  # lognormal sigma of the log, prompt and output: ShareGPT-like tails


@dataclass(frozen=True)
class HeldOut:
    """One held-out workload: loadgen's request and arrival flags (the rate and count added per
    run), and whether `scaletui simulate` can model it."""

    name: str
    flags: tuple[str, ...]
    simulated: bool = True


def workloads(
    names: Sequence[str],
    input_len: int,
    output_len: int,
    burstiness: float,
    prefix_len: int,
    prefix_groups: int,
    turns: int,
) -> list[HeldOut]:
    """The held-out workloads asked for, in `names` order: gamma arrivals at `burstiness`;
    uniform lengths (prompt +-50 %, output fixed), lognormal ones (`sharegpt`), uniform behind
    `prefix_groups` shared prefixes of `prefix_len` tokens (`prefix`), and conversations of
    `turns` user turns (`turns`: text prompts; the simulator has no conversations)."""
    arrival = ("--arrival", "gamma", "--burstiness", f"{burstiness:g}")
    uniform = ("--input-len", str(input_len), "--input-dist", "uniform",
               "--input-spread", str(input_len // 2), "--output-len", str(output_len))  # fmt: skip
    si, so = SHAREGPT_SIGMA
    made = {
        "uniform": HeldOut("uniform", (*arrival, *uniform, "--prompt-format", "ids")),
        "sharegpt": HeldOut(
            "sharegpt",
            (
                *arrival,
                "--input-len",
                str(input_len),
                "--input-dist",
                "lognormal",
                "--input-spread",
                f"{si:g}",
                "--output-len",
                str(output_len),
                "--output-dist",
                "lognormal",
                "--output-spread",
                f"{so:g}",
                "--prompt-format",
                "ids",
            ),
        ),  # fmt: skip
        "prefix": HeldOut(
            "prefix",
            (
                *arrival,
                *uniform,
                "--prefix-len",
                str(prefix_len),
                "--prefix-groups",
                str(prefix_groups),
                "--prompt-format",
                "ids",
            ),
        ),
        "turns": HeldOut(
            "turns",
            (*arrival, *uniform, "--turns", str(turns), "--prompt-format", "text"),
            simulated=False,
        ),  # fmt: skip
    }
    unknown = [n for n in names if n not in made]
    if unknown:
        raise ValueError(f"held-out workloads are {', '.join(NAMES)}; got {', '.join(unknown)}")
    return [made[n] for n in names]


def run_row(name: str, rate: float, measured: dict, predicted: dict | None,
            as_run: dict | None, as_run_mean: dict | None = None) -> dict:  # fmt: skip
    """One held-out run: per judged figure the measurement, the prediction's point and band,
    whether the measurement is inside the band, and the as-run figures' errors (as run: at the
    speeds in time; mean: at the stage's mean factor)."""
    factor = (measured.get("server_metrics") or {}).get("speed_factor") or {}
    row: dict = {"kind": "held_out_run", "workload": name, "qps": round(rate, 4),
                 "completed": measured.get("completed"), "speed_factor": factor}  # fmt: skip
    for ours, key in JUDGED.items():
        m = measured.get(key)
        point = predicted.get(key) if predicted else None
        band = (predicted or {}).get("band", {}).get(key)
        ar = as_run.get(key) if as_run else None
        mean = as_run_mean.get(key) if as_run_mean else None
        row[ours] = {
            "measured": m,
            "predicted": point,
            "band": band,
            "inside": None if m is None or band is None else band[0] <= m <= band[1],
            "as_run": ar,
            "as_run_error": None if m is None or not ar else m / ar - 1,
            "as_run_mean": mean,
            "as_run_mean_error": None if m is None or not mean else m / mean - 1,
        }
    return row


def _ms(x: float) -> float | None:
    return None if x != x else round(float(x) * 1e3, 2)  # nan: it never happened


def timeline(sim, records: Sequence[dict], as_run=None) -> list[dict]:
    """Per request, paired in send-schedule order: the simulation's queue wait (sent to taken
    from the waiting queue), prefill (taken to first token), TTFT and first decode (first to
    second token), the as-run simulation's TTFT, and the measured TTFT and first decode (from
    loadgen's --save-requests records: t_send, chunk_times). ms; None where a side has none."""
    done = sorted((r for r in records if not r.get("warmup") and r.get("t_send") is not None),
                  key=lambda r: r["t_sched"])  # fmt: skip
    order = sorted(range(len(sim.t_sched)), key=lambda i: (math.isnan(sim.t_sched[i]),
                                                           sim.t_sched[i]))  # fmt: skip
    rows = []
    for i, r in zip(order, done, strict=False):
        chunks = r.get("chunk_times") or []
        t_first = chunks[0] if chunks else None
        rows.append({
            "sched_s": round(r["t_sched"], 3),
            "sim_sched_s": round(float(sim.t_sched[i]), 3),
            "sim_queue_ms": _ms(sim.t_admit[i] - sim.t_send[i]),
            "sim_prefill_ms": _ms(sim.t_first[i] - sim.t_admit[i]),
            "sim_ttft_ms": _ms(sim.t_first[i] - sim.t_send[i]),
            "as_run_ttft_ms": _ms(as_run.t_first[i] - as_run.t_send[i]) if as_run else None,
            "ttft_ms": None if t_first is None else round((t_first - r["t_send"]) * 1e3, 2),
            "sim_first_decode_ms": _ms(sim.t_second[i] - sim.t_first[i]),
            "first_decode_ms": round((chunks[1] - chunks[0]) * 1e3, 2) if len(chunks) > 1
            else None,
        })  # fmt: skip
    return rows


def _median(rows: list[dict], key: str) -> float | None:
    got = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(got) if got else None


def timeline_summary(rows: list[dict], server_queue_ms: dict | None = None) -> dict:
    """Medians of each timeline column, over all requests and split by whether the simulation
    queued them (queue wait over 1 ms): a TTFT miss that sits in the queued half is the queue
    amplifying a speed error; one in both halves is the calls (or the client). With the
    server's own queue-time histogram over the stage beside the simulated queue wait."""
    cols = ("sim_queue_ms", "sim_prefill_ms", "sim_ttft_ms", "as_run_ttft_ms", "ttft_ms",
            "sim_first_decode_ms", "first_decode_ms")  # fmt: skip
    queued = [r for r in rows if (r["sim_queue_ms"] or 0) > 1.0]
    free = [r for r in rows if (r["sim_queue_ms"] or 0) <= 1.0]
    out: dict = {"kind": "timeline_summary", "requests": len(rows)}
    for label, part in (("all", rows), ("queued", queued), ("not_queued", free)):
        out[label] = {"n": len(part), **{c: _median(part, c) for c in cols}}
    out["server_queue_ms"] = server_queue_ms  # count, mean, p50, p90, p99 (ms) of the stage
    return out


def _f(v: float | None, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt)


def rows_text(rows: Sequence[dict]) -> str:
    """The held-out runs as a table: per figure measured, [band], in?, as-run and its error."""
    lines = [f"\n{'held-out':<9} {'qps':>6} {'speed d/p':>10}  {'metric':<11} {'measured':>8} "
             f"{'predicted [p10-p90]':>24} {'in':>3} {'as-run':>7} {'m/ar-1':>7} "
             f"{'mean ar':>7} {'m/mr-1':>7}"]  # fmt: skip
    for r in rows:
        f = r["speed_factor"]
        speed = f"{_f(f.get('decode'), '.2f')}/{_f(f.get('prefill'), '.2f')}"
        for ours in JUDGED:
            x = r[ours]
            band = "" if x["band"] is None else f" [{x['band'][0]:.1f}-{x['band'][1]:.1f}]"
            inside = {True: "yes", False: "NO", None: "-"}[x["inside"]]
            err, mean_err = (_pct(x.get(k)) for k in ("as_run_error", "as_run_mean_error"))
            lines.append(f"{r['workload']:<9} {r['qps']:>6.2f} {speed:>10}  {ours:<11} "
                         f"{_f(x['measured']):>8} {_f(x['predicted']) + band:>24} {inside:>3} "
                         f"{_f(x['as_run']):>7} {err:>7} {_f(x.get('as_run_mean')):>7} "
                         f"{mean_err:>7}")  # fmt: skip
    judged = [r[o]["inside"] for r in rows for o in JUDGED if r[o]["inside"] is not None]
    lines.append(f"inside the band: {sum(judged)} of {len(judged)} figures")
    for key, what in (("as_run_error", "as run"), ("as_run_mean_error", "as run at the mean")):
        errs = [r[o][key] for r in rows for o in JUDGED if r[o].get(key) is not None]
        if errs:
            near = sum(abs(e) <= 0.10 for e in errs)
            lines.append(f"{what} within 10 %: {near} of {len(errs)} figures")
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def timeline_text(rows: Sequence[dict], summary: dict, limit: int = 24) -> str:
    """The first `limit` requests of the timeline, then the medians per half."""
    cols = ("sched_s", "sim_queue_ms", "sim_prefill_ms", "sim_ttft_ms", "as_run_ttft_ms",
            "ttft_ms", "sim_first_decode_ms", "first_decode_ms")  # fmt: skip
    heads = ("sched s", "sim q", "sim pf", "sim ttft", "asrun ttft", "ttft", "sim dec1", "dec1")
    lines = ["\nper-request timeline (ms; sim = a priori, asrun = at the run's speed factor):",
             " ".join(f"{h:>10}" for h in heads)]  # fmt: skip
    for r in rows[:limit]:
        lines.append(" ".join(f"{_f(r[c], '.3f' if c == 'sched_s' else '.1f'):>10}" for c in cols))
    if len(rows) > limit:
        lines.append(f"... {len(rows) - limit} more in the JSON")
    for part in ("all", "queued", "not_queued"):
        s = summary[part]
        lines.append(f"median {part:<10} n={s['n']:<3} " + " ".join(
            f"{_f(s[c]):>10}" for c in cols[1:]))  # fmt: skip
    q = summary.get("server_queue_ms") or {}
    lines.append(f"server's queue time over the stage: p50 {_f(q.get('p50'))} ms, "
                 f"p90 {_f(q.get('p90'))} ms, mean {_f(q.get('mean'))} ms")  # fmt: skip
    return "\n".join(lines)


def as_run_flag(factor: dict) -> list[str]:
    """`--as-run` for a stage's speed factors ([] when the server measured none)."""
    parts = [f"{k}={factor[k]:.4f}" for k in ("decode", "prefill") if factor.get(k)]
    return ["--as-run", ",".join(parts)] if parts else []


def measure(
    held: Sequence[HeldOut],
    simulate: Callable[[list[str]], object],  # workload flags -> SimResult
    loadgen: Callable[[list[str], Path], dict],  # workload flags, out -> summary
    work: Path,
    fraction: float,
    slots: int,
    requests: int,
    seed: int,
    log: Callable[[str], None],
) -> tuple[list[dict], list[dict], dict | None]:
    """(run rows, the first bursty run's timeline, its summary) over `held`, each at `fraction`
    of its own simulated capacity (a closed loop at `slots`)."""
    rows: list[dict] = []
    line: list[dict] = []
    line_summary = None
    for k, h in enumerate(held):
        if h.simulated:
            capacity = simulate(
                [
                    *h.flags,
                    "--concurrency",
                    str(slots),
                    "--num-requests",
                    str(requests),
                    "--no-band",
                ]
            ).summary["request_throughput"]
        else:  # no conversations in the simulator: the uniform workload's capacity, per turn
            capacity = simulate([*_without_turns(h.flags), "--concurrency", str(slots),
                                 "--num-requests", str(requests), "--no-band"]
                                ).summary["request_throughput"]  # fmt: skip
        rate = fraction * capacity
        flags = [
            *h.flags,
            "--qps",
            f"{rate:.4f}",
            "--num-requests",
            str(requests),
            "--duration",
            f"{max(3 * requests / rate, 10):.1f}",
            "--seed",
            str(seed + k),
        ]
        # the a-priori prediction before the run: its band reads the server's speed log
        # (roofline/speedlog.py), which the run itself adds to
        pred = simulate(flags) if h.simulated else None
        log(f"held-out {h.name}: loadgen {' '.join(flags)}")
        out = work / f"held-out-{h.name}.json"
        got = loadgen(flags, out)
        ran = ran_mean = None
        metrics = got.get("server_metrics") or {}
        if h.simulated and metrics.get("speed_factor"):
            ran_mean = simulate([*flags, *as_run_flag(metrics["speed_factor"])])
            traced = metrics.get("speed_timeline")
            ran = simulate([*flags, "--as-run-from", str(out)]) if traced else ran_mean
        row = run_row(h.name, rate, got, pred and pred.summary, ran and ran.summary,
                      ran_mean and ran_mean.summary)  # fmt: skip
        rows.append(row)
        log(f"held-out {h.name}: {got.get('completed')} completed, speed {row['speed_factor']}")
        if pred is not None and not line:
            recs = out.with_suffix(".requests.jsonl").read_bytes().splitlines()
            records = [orjson.loads(x) for x in recs if x.strip()]
            records = [r for r in records if r.get("type") != "run"]
            line = timeline(pred, records, ran)
            queue = (got.get("server_metrics") or {}).get("queue_time_ms")
            line_summary = timeline_summary(line, queue)
            line_summary["workload"] = h.name
    return rows, line, line_summary


def _without_turns(flags: Sequence[str]) -> list[str]:
    out, skip = [], 0
    for f in flags:
        if skip:
            skip -= 1
        elif f in ("--turns", "--prompt-format"):
            skip = 1
        else:
            out.append(f)
    return [*out, "--prompt-format", "ids"]
