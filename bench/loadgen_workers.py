"""How fast do `loadgen --workers N` processes offer load together? Against the mock OpenAI
server (tests/mock_openai.py, its own process, an instant one-chunk reply), each worker count
runs rates doubling from --start until the sends fall behind the schedule (below 95% of it)
or requests fail; each row records the merged send rate and every worker's own send rate and
schedule delay p99 (the merged summary's `workers`), and the load average around it (a shared
box's other work steals the cores).

    python bench/loadgen_workers.py [--workers 1 2] [--start 250] [--seconds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import orjson
from _smoke import shrink

MOCK = Path(__file__).resolve().parents[1] / "tests" / "mock_openai.py"
SERVER = "{python} " + str(MOCK) + " --port {port} --ttft 0 --gap 0 --tokens-per-chunk 2"


def start_server(cmd: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = shlex.split(cmd.format(python=sys.executable, port=port))
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"the server did not answer /health: {cmd}")


def stage(url: str, workers: int, rate: float, seconds: float) -> dict:
    """One `loadgen --workers` run at `rate`: the merged and the per-worker figures."""
    n = max(100, int(rate * seconds))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "r.json")
        cmd = [sys.executable, "-m", "scaletui.loadgen.cli", "--url", url, "--qps", str(rate),
               "--num-requests", str(n), "--input-len", "16", "--output-len", "2",
               "--workers", str(workers), "--quiet", "--max-failure-rate", "1",
               "--metrics-interval", "0", "--out", str(out)]  # fmt: skip
        load = os.getloadavg()[0]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds * 10 + 120)
        if not out.exists():
            raise RuntimeError(f"loadgen exited {proc.returncode}: {proc.stderr[-2000:]}")
        s = orjson.loads(out.read_bytes())
    return {
        "workers": workers,
        "rate": rate,
        "sent": s["sent"],
        "completed": s["completed"],
        "achieved_rate": s["achieved_rate"],
        "scheduled_rate": s["scheduled_rate"],
        "schedule_delay_p99_ms": s["p99_schedule_delay_ms"],
        "per_worker": [
            {
                "shard": w["shard"],
                "achieved_rate": w["achieved_rate"],
                "schedule_delay_p99_ms": w["schedule_delay_ms"]["p99"],
                "cpu_util": w["cpu_util"],
                "start_late_ms": w["start_late_ms"],
            }
            for w in s["workers"]
        ],
        "load_before": load,
        "load_after": os.getloadavg()[0],
    }


def keeps_up(row: dict) -> bool:
    """Every request answered and the sends within 95% of the schedule's rate."""
    return row["completed"] == row["sent"] and (row["achieved_rate"] or 0) >= 0.95 * (
        row["scheduled_rate"] or 0
    )


def ok(row: dict) -> bool:
    """Kept up, with each worker's schedule delay p99 under 1 ms (the issue's target)."""
    return keeps_up(row) and all((w["schedule_delay_p99_ms"] or 0) < 1.0 for w in row["per_worker"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--start", type=float, default=250.0)
    p.add_argument("--max", type=float, default=16000.0)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--server-cmd", default=SERVER, help="template with {python} {port}")
    p.add_argument("--json")
    a = shrink(p, start=100.0, max=100.0, seconds=0.5).parse_args(argv)
    server, url = start_server(a.server_cmd)
    rows = []
    try:
        print(f"{'workers':>7} {'rate':>7} {'sent/s':>8} {'per worker sent/s':>22} "
              f"{'per worker sched p99 ms':>26} {'load':>5}")  # fmt: skip
        for w in a.workers:
            rate = a.start
            while rate <= a.max:
                row = stage(url, w, rate, a.seconds)
                rows.append(row)
                _print(row)
                if not keeps_up(row):
                    break
                rate *= 2
    finally:
        server.terminate()
        server.wait(10)
    best, kept = {}, {}
    for w in a.workers:
        mine = [r for r in rows if r["workers"] == w]
        best[str(w)] = max((r["rate"] for r in mine if ok(r)), default=None)
        kept[str(w)] = max((r["rate"] for r in mine if keeps_up(r)), default=None)
    result = {
        "max_rate_all_workers_sched_p99_under_1ms": best,
        "max_rate_kept_up": kept,
        "cores": len(os.sched_getaffinity(0)),
        "server_cmd": a.server_cmd,
        "date": time.strftime("%Y-%m-%d"),
        "stages": rows,
    }
    for w, r in best.items():
        print(f"--workers {w}: highest rate kept up {kept[w]}, with every worker's schedule "
              f"delay p99 < 1 ms: {r}")  # fmt: skip
    if a.json:
        Path(a.json).write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    return 0


def _print(r: dict) -> None:
    rates = " ".join(f"{w['achieved_rate'] or 0:.0f}" for w in r["per_worker"])
    p99s = " ".join(f"{w['schedule_delay_p99_ms'] or 0:.3f}" for w in r["per_worker"])
    print(f"{r['workers']:>7} {r['rate']:>7.0f} {r['achieved_rate'] or 0:>8.0f} {rates:>22} "
          f"{p99s:>26} {r['load_before']:>5.2f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
