"""`scaletui calibrate --coordinator HOST:PORT --num-processes N --process-id I` (every host, as
`scaletui serve` is launched) or `scaletui calibrate --processes N` (N local CPU processes,
started here): the cross-process all-reduce (`scaletui.calibrate.dcn`), written by process 0
into the `local` spec (or `--out`) as the measured `dcn_bw` and `dcn_latency_s`. The host roofs
stay the spec's: a one-process `scaletui calibrate` measures them, and has to have run first.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import yaml

from scaletui import xla_env
from scaletui.calibrate.host import rounded
from scaletui.procs import free_port, stop_groups
from scaletui.specs import SpecError, load_hardware, local_hardware_path

FLAGS = ("--coordinator", "--num-processes", "--process-id", "--processes")


def wanted(argv: list[str]) -> bool:
    """Whether `scaletui calibrate`'s arguments ask for the distributed measurement."""
    return any(a == f or a.startswith(f + "=") for a in argv for f in FLAGS)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="scaletui calibrate",
        description="Measure the all-reduce across JAX processes and store it as the `local` "
        "spec's dcn_bw and dcn_latency_s (run a one-process `scaletui calibrate` first).",
    )
    p.add_argument("--processes", type=int, help="start N local CPU processes (gloo) here")
    p.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's JAX coordinator")
    p.add_argument("--num-processes", type=int, help="processes taking part (one per host)")
    p.add_argument("--process-id", type=int, help="this process (0 writes the spec)")
    p.add_argument("--quick", action="store_true", help="fewer timed calls per size")
    p.add_argument(
        "--out", type=Path, help=f"the spec to update instead of {local_hardware_path()}"
    )
    p.add_argument("--no-write", action="store_true", help="print the updated spec only")
    return p


def main(argv: list[str]) -> int:
    p = parser()
    args = p.parse_args(argv)
    path = args.out or local_hardware_path()
    spec = None
    if args.process_id in (0, None):  # process 0 writes: its spec must be there before it starts
        try:
            load_hardware(path)
            spec = yaml.safe_load(path.read_text())
        except (OSError, SpecError) as exc:
            p.error(
                f"no hardware spec to add the DCN figures to at {path} ({exc}); run "
                "`scaletui calibrate` (one process) first"
            )
    if args.processes is not None:
        if any(v is not None for v in (args.coordinator, args.num_processes, args.process_id)):
            p.error("--processes starts the processes itself: no --coordinator/--num-processes")
        if args.processes < 2:
            p.error(f"--processes should be 2 or more, got {args.processes}")
        return spawn(args.processes, argv)
    from scaletui.serve.multihost import launch
    from scaletui.shape import ConfigError

    try:
        cluster = launch.Cluster(args.coordinator or "", args.num_processes or 0, args.process_id)
    except (ConfigError, TypeError) as exc:
        p.error(f"{exc}: distributed calibrate needs --coordinator, --num-processes, --process-id")
    from scaletui.calibrate import dcn

    n = cluster.num_processes
    print(
        f"calibrate: all-reduce across {n} processes (process {cluster.process_id})",
        file=sys.stderr,
    )
    stdout = os.dup(1)
    os.dup2(2, 1)  # gloo prints its connections on fd 1: stdout is for the spec alone
    try:
        launch.initialize(cluster)
        got = dcn.measure(quick=args.quick)
    finally:
        sys.stdout.flush()
        os.dup2(stdout, 1)
        os.close(stdout)
    if not cluster.leader:
        return 0
    s = got["spread"]
    print(
        f"calibrate: {got['bw'] / 1e9:.2f} GB/s (p10-p90 of the largest size "
        f"{s['p10'] / 1e9:.2f}-{s['p90'] / 1e9:.2f}), {got['latency_s'] * 1e6:.0f} us per hop",
        file=sys.stderr,
    )
    where = f"coordinator {cluster.coordinator}, {platform.node()} ({got['backend']})"
    date = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    text = yaml.safe_dump(rounded(dcn.merge(spec, got, where, date)), sort_keys=False)
    if not args.no_write:
        path.write_text(text)
        load_hardware(path)  # what we wrote must load
        print(f"calibrate: wrote dcn_bw and dcn_latency_s to {path}", file=sys.stderr)
    sys.stdout.write(text)
    return 0


def spawn(n: int, argv: list[str], timeout_s: float = 600.0) -> int:
    """Run this command as `n` local CPU processes (one device each, gloo) and wait; the first
    to fail stops the others and its exit status is returned."""
    rest, skip = [], False
    for a in argv:  # the same flags, less --processes
        if skip:
            skip = False
        elif a == "--processes":
            skip = True
        elif not a.startswith("--processes="):
            rest.append(a)
    coordinator = f"127.0.0.1:{free_port()}"
    env = {**xla_env.child_env(1, preallocate=False), "JAX_PLATFORMS": "cpu"}
    procs = []
    for i in range(n):
        cmd = [sys.executable, "-m", "scaletui", "calibrate", *rest]
        cmd += ["--coordinator", coordinator, "--num-processes", str(n), "--process-id", str(i)]
        out = None if i == 0 else subprocess.DEVNULL  # process 0 prints the spec
        procs.append(subprocess.Popen(cmd, env=env, stdout=out, start_new_session=True))
    end = time.monotonic() + timeout_s
    try:
        while time.monotonic() < end:
            codes = [proc.poll() for proc in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                return failed[0]
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.1)
        print(f"calibrate: no result after {timeout_s:.0f} s", file=sys.stderr)
        return 1
    finally:
        stop_groups([proc.pid for proc in procs if proc.poll() is None])
        for proc in procs:
            proc.wait()
