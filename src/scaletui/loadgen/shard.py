"""One schedule over several loadgen processes: which requests are shard I's of N, when every
shard starts, and what makes two shards' files parts of one schedule.

1. Shard I of N sends the requests whose index % N == I, and the same share of the ramp and of
   the warm-up. Each shard draws the whole request stream (one seed: the same prompts, lengths
   and send offsets as one process) and keeps its share, all before the start, so the draws
   cost nothing during the run.
2. The start is a wall-clock EPOCH (time.time()): a shard turns it into its own perf_counter
   once, t0 = EPOCH - (time.time() - perf_counter()), so every shard's times relative to t0 are
   on the one clock the hosts share (up to their NTP skew, which loadgen cannot see).
3. A shard's per-request file starts with a header (`"type": "run"`, header()): the schedule
   (schedule_of: everything that decides which requests go when), the shard, the start and
   how late this shard was for it, and what its summary alone cannot be rebuilt from.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import socket
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from itertools import islice, takewhile
from time import perf_counter

from scaletui.loadgen.request_spec import RequestSpec
from scaletui.loadgen.run_config import RunConfig, RunResult
from scaletui.loadgen.workload import Workload, iter_requests

DAY_S = 86_400.0  # an --start-at further than this from now is not meant as a wall-clock time
STDIN = "stdin"  # --workers' children: say "ready" on stdout, then read EPOCH from stdin


@dataclass(frozen=True)
class Shard:
    """Shard `index` (0-based) of `count`: the requests whose index % count == index."""

    index: int  # I
    count: int  # N

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ValueError(
                f"--shard {self.index}/{self.count}: want I/N with 0 <= I < N (shards are "
                f"numbered from 0, as Slurm's SLURM_PROCID and k8s' JOB_COMPLETION_INDEX)"
            )

    @classmethod
    def parse(cls, text: str) -> Shard:
        """'1/4' -> Shard(1, 4)."""
        i, sep, n = text.partition("/")
        try:
            index, count = int(i), int(n)
        except ValueError:
            raise ValueError(f"--shard wants I/N such as 0/4, got {text!r}") from None
        if not sep:
            raise ValueError(f"--shard wants I/N such as 0/4, got {text!r}")
        return cls(index, count)

    @property
    def label(self) -> str:
        return f"{self.index}/{self.count}"

    def keeps(self, index: int) -> bool:
        return index % self.count == self.index

    def take(self, workload: Workload, n: int | None, duration: float | None) -> list[RequestSpec]:
        """This shard's requests of the first n (or of those an open loop schedules before
        `duration`), drawn now."""
        if n is None and (duration is None or workload.closed_loop):
            raise ValueError("a shard needs a finite schedule: --num-requests, or --duration "
                             "with an open loop")  # fmt: skip
        specs: Iterable[RequestSpec] = iter_requests(workload)
        if n is not None:
            specs = islice(specs, n)
        if duration is not None and not workload.closed_loop:
            specs = takewhile(lambda s: s.offset < duration, specs)
        return [s for s in specs if self.keeps(s.index)]


def clock_offset() -> float:
    """time.time() - perf_counter(): the tightest of five reads between two perf_counters."""
    best = (math.inf, 0.0)
    for _ in range(5):
        a = perf_counter()
        wall = time.time()
        b = perf_counter()
        best = min(best, (b - a, wall - (a + b) / 2))
    return best[1]


def check_epoch(epoch: float, now: float | None = None) -> float:
    """A --start-at that is a wall-clock time near now (seconds since 1970, like `date +%s`)."""
    now = time.time() if now is None else now
    if not (math.isfinite(epoch) and abs(epoch - now) < DAY_S):
        raise ValueError(
            f"--start-at {epoch:g} is not a wall-clock time within a day of now ({now:.0f}): "
            "give seconds since 1970, e.g. $(( $(date +%s) + 30 ))"
        )
    return epoch


class StartAt:
    """A shard's start (the Runner's `start`): t0 in this process's perf_counter for the
    wall-clock `epoch`; `late_s`: how far past it the shard was when it was ready to send."""

    def __init__(self, epoch: float | str) -> None:
        self.epoch: float | None = None if epoch == STDIN else float(epoch)
        self.late_s: float | None = None
        self.offset: float | None = None

    async def __call__(self) -> float:
        if self.epoch is None:  # --workers' child: its parent picks the start once all are ready
            print("ready", file=sys.stdout, flush=True)
            line = await asyncio.to_thread(sys.stdin.readline)
            try:
                self.epoch = float(line)
            except ValueError:
                raise RuntimeError(f"no start time from the parent (got {line!r})") from None
        self.offset = clock_offset()
        t0 = self.epoch - self.offset
        self.late_s = max(0.0, perf_counter() - t0)
        return t0


def _workers_arg(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--workers wants a whole number >= 1, got {text!r}")
    return int(text)


def _shard_arg(text: str) -> Shard:
    try:
        return Shard.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _epoch(text: str) -> float:
    try:
        return check_epoch(float(text))
    except ValueError as exc:
        msg = str(exc) if "wall-clock" in str(exc) else f"want seconds since 1970, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None


def add_scale_flags(p: argparse.ArgumentParser) -> None:
    """--workers, --shard and --start-at: one schedule sent by several processes (shard.py)."""
    g = p.add_argument_group("beyond one process (`loadgen merge A.jsonl ...` joins shards)")
    g.add_argument(
        "--workers",
        type=_workers_arg,
        help="N local processes send one schedule (one seed: the same requests at the same "
        "times as one process), shard I the requests with index %% N == I; one merged summary",
    )
    g.add_argument(
        "--shard",
        type=_shard_arg,
        metavar="I/N",
        help="send shard I (from 0) of N of the schedule, from --start-at, to --save-requests; "
        "any launcher (ssh, Slurm, k8s) runs the N; `loadgen merge` joins their files",
    )
    g.add_argument(
        "--start-at",
        type=_epoch,
        metavar="EPOCH",
        help="a --shard's start on the wall clock (time.time(); e.g. $(( $(date +%%s) + 30 ))): "
        "every shard's schedule counts from it",
    )


def check_split(args: argparse.Namespace) -> None:
    """--workers, --shard and --start-at: what goes with them."""
    if args.workers and args.shard:
        raise ValueError("--workers N runs every shard here, --shard I/N one of them: give one")
    if args.shard and args.start_at is None:
        raise ValueError(
            "--shard needs --start-at EPOCH: every shard starts at one wall-clock time, e.g. "
            "--start-at $(( $(date +%s) + 30 ))"
        )
    if args.start_at is not None and not args.shard:
        raise ValueError("--start-at is when a --shard starts: give --shard I/N with it")
    if args.shard and not args.save_requests:
        raise ValueError(
            "--shard writes its records for `loadgen merge`: give --save-requests FILE"
        )
    if not (args.workers or args.shard):
        return
    for flag in ("sweep", "search"):
        if getattr(args, flag):
            raise ValueError(f"--workers and --shard split one stage's schedule: drop --{flag}")
    if args.repeat > 1:
        raise ValueError("--workers and --shard split one stage's schedule: drop --repeat")
    if args.concurrency is not None:
        raise ValueError(
            "--workers and --shard split an open-loop schedule (--qps or --trace); "
            "--concurrency caps one process's requests in flight: drop it"
        )


def schedule_of(cfg: RunConfig, workload: Workload) -> dict:
    """What decides which requests are sent when, and what they ask: equal for every shard of
    one schedule (the URL and the timeouts may differ between machines)."""
    return {
        "workload": asdict(workload),
        "num_requests": cfg.num_requests,
        "duration": cfg.duration,
        "warmup": cfg.warmup,
        "ramp_up": cfg.ramp_up,
        "api": cfg.api,
        "model": cfg.model,
        "ignore_eos": cfg.ignore_eos,
    }


def header(
    *,
    shard: Shard | None,
    start: StartAt | None,
    result: RunResult,
    schedule: dict,
    stage: int,
    repeat: int,
    rate: float | None,
    summary: dict,
    slo_rule: dict | None = None,
) -> dict:
    """The `"type": "run"` line before a run's records in --save-requests. Record times are
    seconds after `t_start_epoch` (the measured window's start on this host's wall clock)."""
    offset = start.offset if start is not None and start.offset is not None else clock_offset()
    late = None if start is None or start.late_s is None else start.late_s * 1e3
    return {
        "type": "run",
        "stage": stage,
        "repeat": repeat,
        "shard": (shard or Shard(0, 1)).label,
        "schedule": schedule,
        "start_at": None if start is None else start.epoch,
        "start_late_ms": late,  # ready this long after start_at (0: in time)
        "t_start_epoch": result.t_start + offset,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "requested_rate": rate,
        "partial": result.partial,
        "partial_reason": result.stop_reason,
        "partial_message": result.stop_message,
        "slo_rule": slo_rule,  # with --slo: percentile, tail, max_failure_rate of slo_check
        **{k: summary.get(k) for k in SHARED},
    }


# summary keys a shard's header carries for a merge: not rebuilt from the records
SHARED = (
    "config",
    "command",
    "slo",
    "client_overhead",
    "server_metrics",
    "server_stats_before",
    "server_stats_after",
)
