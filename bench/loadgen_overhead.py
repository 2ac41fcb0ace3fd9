"""How fast can loadgen offer load? Against a null server that streams instantly, find the
highest request rate loadgen sustains on one core with schedule delay p99 under 1 ms, and its
own CPU time per request.

The null server (a raw asyncio HTTP/1.1 responder, keep-alive, one SSE body of `--tokens`
chunks with usage, no delay) runs in a child process on another core when there is one;
loadgen runs in this process, pinned to one core, with uvloop when installed. Rates double from
--start until sends fall behind the schedule; the p99 < 1 ms bracket is then bisected.

    python bench/loadgen_overhead.py [--start 250] [--seconds 3] [--tokens 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time

import orjson
from _smoke import shrink

from scaletui.loadgen import runner as runner_mod
from scaletui.loadgen.report import summarize
from scaletui.loadgen.run_config import RunConfig, make_session
from scaletui.loadgen.runner import Runner
from scaletui.loadgen.workload import Lengths, Workload


def _sse_body(tokens: int) -> bytes:
    out = []
    for k in range(1, tokens + 1):
        chunk = {"choices": [{"index": 0, "text": "x"}],
                 "usage": {"prompt_tokens": 16, "completion_tokens": k}}  # fmt: skip
        out.append(b"data: " + orjson.dumps(chunk) + b"\n\n")
    out.append(b"data: [DONE]\n\n")
    return b"".join(out)


class NullHTTP(asyncio.Protocol):
    """Answers every request at once: /v1/models with a model list, anything else with SSE."""

    def __init__(self, sse: bytes, models: bytes) -> None:
        self.sse, self.models, self.buf = sse, models, b""

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while (end := self.buf.find(b"\r\n\r\n")) >= 0:
            head = self.buf[:end].lower()
            length = 0
            for line in head.split(b"\r\n"):
                if line.startswith(b"content-length:"):
                    length = int(line[15:])
            if len(self.buf) < end + 4 + length:
                return
            self.buf = self.buf[end + 4 + length :]
            body, ctype = (
                (self.models, b"application/json")
                if head.startswith(b"get /v1/models")
                else (self.sse, b"text/event-stream")
            )
            self.transport.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: " + ctype
                + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
            )  # fmt: skip


def serve(port: int, tokens: int) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    models = orjson.dumps({"data": [{"id": "null"}]})
    sse = _sse_body(tokens)

    async def main():
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: NullHTTP(sse, models), "127.0.0.1", port)
        await server.serve_forever()

    asyncio.run(main())


async def stage(url: str, rate: float, seconds: float, tokens: int) -> dict:
    n = max(200, int(rate * seconds))
    wl = Workload(qps=rate, input=Lengths(16), output=Lengths(tokens), seed=1)
    cfg = RunConfig(url=url, model="null", num_requests=n, timeout=30, warmup=50)
    runner = Runner(cfg, wl)
    async with make_session() as session:
        cpu0 = time.process_time()
        result = await runner.run(session)
        cpu = time.process_time() - cpu0
    s = summarize(result.records, t_start=result.t_start, requested_rate=rate)
    return {
        "rate": rate,
        "sent": s["sent"],
        "completed": s["completed"],
        "achieved_rate": s["achieved_rate"],
        "scheduled_rate": s["scheduled_rate"],
        "schedule_delay_p50_ms": s["median_schedule_delay_ms"],
        "schedule_delay_p99_ms": s["p99_schedule_delay_ms"],
        "cpu_ms_per_request": cpu / max(s["sent"], 1) * 1e3,
        "cpu_util": cpu / s["duration"] if s["duration"] else None,
    }


def keeps_up(row: dict) -> bool:
    return row["completed"] == row["sent"] and (row["achieved_rate"] or 0) >= 0.95 * (
        row["scheduled_rate"] or 0
    )


def ok(row: dict) -> bool:
    return (
        row["completed"] == row["sent"]
        and row["schedule_delay_p99_ms"] is not None
        and row["schedule_delay_p99_ms"] < 1.0
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--start", type=float, default=250.0)
    p.add_argument("--max", type=float, default=64000.0)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--bisect", type=int, default=3, help="bisection steps after the ramp")
    p.add_argument("--spin-ms", type=float, default=runner_mod.SPIN_S * 1e3,
                   help="yield-spin before each send (ms); 0 = timer only")  # fmt: skip
    p.add_argument("--json")
    p.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    # a smoke run (bench/_smoke.py): two short stages and one bisection step
    a = shrink(p, max=500.0, seconds=0.3, bisect=1).parse_args(argv)
    if a.serve:
        serve(a.serve, a.tokens)
        return 0
    runner_mod.SPIN_S = a.spin_ms / 1e3
    cores = sorted(os.sched_getaffinity(0))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(port), "--tokens", str(a.tokens)],
        preexec_fn=(lambda: os.sched_setaffinity(0, {cores[-1]})) if len(cores) > 1 else None,
    )
    os.sched_setaffinity(0, {cores[0]})
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    url = f"http://127.0.0.1:{port}"
    rows = []
    try:
        time.sleep(1.0)
        print(f"{'rate':>8} {'sent/s':>8} {'sched p50':>10} {'sched p99':>10} {'cpu ms/req':>11}")
        rate = a.start
        while rate <= a.max:  # double until sends fall behind the schedule
            row = run(stage(url, rate, a.seconds, a.tokens))
            rows.append(row)
            _print(row)
            if not keeps_up(row):
                break
            rate *= 2
        good = [r for r in rows if ok(r)]
        if good and good[-1] is not rows[-1]:  # bisect between the last good and the next
            lo, hi = good[-1]["rate"], rows[rows.index(good[-1]) + 1]["rate"]
            for _ in range(a.bisect):
                mid = (lo * hi) ** 0.5
                row = run(stage(url, mid, a.seconds, a.tokens))
                rows.append(row)
                _print(row)
                lo, hi = (mid, hi) if ok(row) else (lo, mid)
    finally:
        server.terminate()
        server.wait(10)
    good = [r for r in rows if ok(r)]
    best = max(good, key=lambda r: r["rate"]) if good else None
    result = {
        "max_rate_sched_p99_under_1ms": best["rate"] if best else None,
        "cpu_ms_per_request": best["cpu_ms_per_request"] if best else None,
        "max_achieved_rate": max(r["achieved_rate"] or 0 for r in rows),
        "spin_ms": a.spin_ms,
        "tokens_per_request": a.tokens,
        "stages": rows,
    }
    print(f"\nmax rate with p99 schedule delay < 1 ms on one core: "
          f"{best['rate'] if best else 'none tried'} req/s")  # fmt: skip
    if best:
        print(f"loadgen CPU per request at that rate: {best['cpu_ms_per_request']:.3f} ms")
    print(f"highest achieved send rate: {result['max_achieved_rate']:.0f} req/s")
    if a.json:
        with open(a.json, "wb") as f:
            f.write(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    return 0


def _print(r: dict) -> None:
    print(
        f"{r['rate']:8.0f} {r['achieved_rate'] or 0:8.0f} {r['schedule_delay_p50_ms']:10.3f} "
        f"{r['schedule_delay_p99_ms']:10.3f} {r['cpu_ms_per_request']:11.3f}",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
