"""`loadgen --workers N`: one schedule sent by N local processes, reported as one run.

1. The parsed flags go to a private temporary folder; N children (`python -m
   scaletui.loadgen.cli worker ARGS I N FILE`) each run shard I/N (shard.py) against the one
   URL and write their records to FILE, as `loadgen --shard I/N` would.
2. Each child draws its share of the requests and does its share of the warm-up, then prints
   "ready"; once every child is ready the parent sends them all one wall-clock start,
   START_LEAD_S ahead (as --start-at would).
3. When all have exited their files are merged (merge.py): one summary, printed and written as
   one process's; --save-requests gets the shards' files one after another.
A child that exits before it is ready stops the run with the end of its stderr. SIGINT or
SIGTERM goes on to the children as SIGTERM: they stop and write what they have (partial).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import pickle
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scaletui.loadgen import merge
from scaletui.loadgen.results import load_blocks

START_LEAD_S = 0.2  # the start is this far after the last child said it is ready
READY_TIMEOUT_S = 600.0  # a child that is not ready by then (warm-up included) fails the run
TAIL_LINES = 10


def run(args: argparse.Namespace, url: str) -> tuple[dict, bool]:
    """Run the N shards; (the merged summary, whether a signal stopped them)."""
    n = args.workers
    with tempfile.TemporaryDirectory(prefix="loadgen-workers-") as tmp:
        child = copy.copy(args)
        child.url = url
        flags = Path(tmp, "args.pickle")
        flags.write_bytes(pickle.dumps(child))
        files = [str(Path(tmp, f"shard-{i}.jsonl")) for i in range(n)]
        errs = [Path(tmp, f"shard-{i}.err") for i in range(n)]
        procs: list[subprocess.Popen] = []
        stopped = False

        def on_signal(signum, frame) -> None:
            nonlocal stopped
            stopped = True
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            for i in range(n):
                cmd = [sys.executable, "-m", "scaletui.loadgen.cli", "worker", str(flags)]
                with open(errs[i], "wb") as err:
                    procs.append(
                        subprocess.Popen(
                            [*cmd, str(i), str(n), files[i]],
                            stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE,
                            stderr=err,
                        )
                    )
            _wait_ready(procs, errs, lambda: stopped)
            epoch = f"{time.time() + START_LEAD_S!r}\n".encode()
            for p in procs:
                p.stdin.write(epoch)
                p.stdin.close()
            codes = [p.wait() for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for s, handler in old.items():
                signal.signal(s, handler)
        for i, code in enumerate(codes):
            if not Path(files[i]).exists() or code == 2:
                raise RuntimeError(f"worker {i}/{n} exited {code}: {_tail(errs[i])}")
        blocks = [b for f in files for b in load_blocks(f)]
        summary = merge.merged(blocks)
        if args.save_requests:
            with open(args.save_requests, "wb") as out:
                for f in files:
                    out.write(Path(f).read_bytes())
    return summary, stopped


def _wait_ready(procs: list[subprocess.Popen], errs: list[Path], stopped) -> None:
    """Block until every child printed "ready"; RuntimeError if one exits or hangs first,
    KeyboardInterrupt on a signal (the children, waiting for their start, are then killed)."""
    sel = selectors.DefaultSelector()
    for i, p in enumerate(procs):
        sel.register(p.stdout, selectors.EVENT_READ, i)
    deadline = time.monotonic() + READY_TIMEOUT_S
    waiting = set(range(len(procs)))
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"worker {min(waiting)} not ready after {READY_TIMEOUT_S:g} s")
        if stopped():
            raise KeyboardInterrupt
        for key, _ in sel.select(timeout=min(left, 0.2)):
            i = key.data
            line = procs[i].stdout.readline()
            if line.strip() != b"ready":
                code = procs[i].wait()
                if stopped():
                    raise KeyboardInterrupt
                raise RuntimeError(
                    f"worker {i}/{len(procs)} exited {code} before the start: {_tail(errs[i])}"
                )
            sel.unregister(procs[i].stdout)
            waiting.discard(i)
    sel.close()


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no output)"
    return " | ".join(lines[-TAIL_LINES:]) or "(no output)"
