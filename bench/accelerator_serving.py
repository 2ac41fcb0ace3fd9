"""The accelerator kit's serving stage: `scaletui serve`, then loadgen at a few loads, one JSON.

Starts `scaletui serve` (a subprocess, this interpreter, seeded dummy weights) on a free
loopback port (or, with `--url`, uses one already started: `--serve-only` execs the same
`scaletui serve`, so the kit starts it early and its weights and compiles overlap the stages
before), waits for /health, then runs `loadgen` once per load: closed loops at each
`--concurrency` and one Poisson run at `--qps`. Each run's summary JSON (loadgen's `--out`),
its exit status and seconds go into `--out` together with the server's final /stats; the file
is rewritten after every run, so a stage stopped at its time limit keeps what it finished. A
loadgen that exits non-zero is recorded and the next load still runs. `--check` parses every
command line with its tool's own parser and exits.

    python bench/accelerator_serving.py --model tiny --slots 8 --concurrency 1 8 --qps 4
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from _smoke import NO_WARMUP, shrink


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--max-seq-len", type=int, help="serve's --max-seq-len (default: serve's)")
    p.add_argument("--concurrency", type=int, nargs="*", default=[1, 8, 64])
    p.add_argument("--requests-per-stream", type=int, default=4, help="closed loops: requests")
    p.add_argument("--qps", type=float, default=20.0, help="the Poisson run's rate (0 = none)")
    p.add_argument("--poisson-requests", type=int, default=200)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--server-timeout", type=float, default=300.0, help="wait for /health (s)")
    p.add_argument("--out", default="serving.json")
    p.add_argument("--url", help="a server already started (by --serve-only): start none")
    p.add_argument("--serve-only", action="store_true", help="exec `scaletui serve` and no more")
    p.add_argument("--port", type=int, default=0, help="--serve-only: its port (0 = a free one)")
    p.add_argument("--check", action="store_true", help="parse every command line and exit")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help=NO_WARMUP)
    # a smoke run (bench/_smoke.py): one closed loop and a short Poisson run on tiny, each shape
    # compiled when first run
    smoke = dict(slots=2, concurrency=[1], requests_per_stream=1, qps=8.0, poisson_requests=2)
    smoke["warmup"] = False
    return shrink(p, model="tiny", dtype="f32", max_seq_len=64, input_len=16, output_len=4, **smoke)


def serve_argv(args: argparse.Namespace, port: int) -> list[str]:
    argv = ["--model", args.model, "--dtype", args.dtype, "--slots", str(args.slots),
            "--port", str(port), "--log-interval", "10"]  # fmt: skip
    argv += ["--max-seq-len", str(args.max_seq_len)] if args.max_seq_len else []
    return argv + ([] if args.warmup else ["--no-warmup"])


def loads(args: argparse.Namespace, url: str) -> list[tuple[str, list[str]]]:
    """(name, loadgen argv without --out) per run."""
    common = ["--url", url, "--input-len", str(args.input_len), "--output-len",
              str(args.output_len), "--timeout", "120"]  # fmt: skip
    runs = [
        (
            f"concurrency-{c}",
            [*common, "--concurrency", str(c), "--num-requests", str(c * args.requests_per_stream)],
        )  # fmt: skip
        for c in args.concurrency
    ]
    if args.qps > 0:
        poisson = ["--qps", str(args.qps), "--arrival", "poisson"]
        runs.append((f"poisson-{args.qps:g}", [*common, *poisson, "--num-requests",
                                                str(args.poisson_requests)]))  # fmt: skip
    return runs


def check(args: argparse.Namespace) -> int:
    from scaletui.commands.serve import parser as serve_parser
    from scaletui.loadgen.flags import build_parser as loadgen_parser
    from scaletui.specs import load_model

    load_model(args.model)
    serve_parser().parse_args(serve_argv(args, 8000))
    for _, argv in loads(args, "http://127.0.0.1:8000"):
        loadgen_parser().parse_args([*argv, "--out", "x.json"])
    print(f"accelerator_serving: arguments ok ({len(loads(args, 'x'))} loadgen runs)")
    return 0


def _get(url: str, timeout: float = 5.0) -> tuple[int, dict | None]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, None
    except (OSError, ValueError):
        return 0, None


def wait_healthy(url: str, server: subprocess.Popen | None, limit: float) -> str | None:
    """None once /health says ok; else why not."""
    t_end = time.monotonic() + limit
    while time.monotonic() < t_end:
        if server is not None and server.poll() is not None:
            return f"server exited with {server.returncode} before it was healthy"
        status, body = _get(url + "/health")
        if status == 200:
            return None
        if status == 500:
            return f"server failed: {body}"
        time.sleep(1.0)
    return f"server not healthy after {limit:.0f} s"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_loads(args: argparse.Namespace, url: str, result: dict, save) -> int:
    """Each load in turn; the number that exited non-zero."""
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, lg in loads(args, url):
            summary = Path(tmp) / f"{name}.json"
            cmd = [sys.executable, "-m", "scaletui.loadgen.cli", *lg, "--out", str(summary)]
            print(f"\nserving: {name}: " + " ".join(cmd[3:]), flush=True)
            t0 = time.monotonic()
            rc = subprocess.run(cmd).returncode
            failed += rc != 0
            body = json.loads(summary.read_text()) if summary.exists() else None
            run = {"name": name, "argv": lg, "exit": rc, "seconds": time.monotonic() - t0}
            result["runs"].append({**run, "summary": body})
            result["stats"] = _get(url + "/stats")[1]
            save()
    return failed


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.check:
        return check(args)
    serve = [sys.executable, "-m", "scaletui.cli", "serve"]
    if args.serve_only:
        os.execv(sys.executable, [*serve, *serve_argv(args, args.port or free_port())])
    # `timeout` sends SIGTERM: unwind through `finally`, which saves the JSON and stops the server
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    server, url = None, args.url
    if url is None:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = subprocess.Popen([*serve, *serve_argv(args, port)])
        print("serving: started " + " ".join(server.args[3:]), flush=True)
    result: dict = {"url": url, "server": {"argv": serve_argv(args, 0)}, "runs": [], "stats": None}
    out = Path(args.out)
    save = lambda: out.write_text(json.dumps(result, indent=2) + "\n")
    t0 = time.monotonic()
    try:
        why = wait_healthy(url, server, args.server_timeout)
        result["server"].update(waited_s=time.monotonic() - t0, error=why)
        save()
        if why:
            print(f"serving: {why}", file=sys.stderr)
            return 1
        return 1 if run_loads(args, url, result, save) else 0
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
            result["server"]["exit"] = server.returncode
        save()


if __name__ == "__main__":
    sys.exit(main())
