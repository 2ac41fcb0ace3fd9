"""The loadgen command line: its flags, their checks, and the Workload they describe."""

from __future__ import annotations

import argparse
import math

from scaletui.loadgen.replay import load_trace
from scaletui.loadgen.report import Slo
from scaletui.loadgen.search import min_requests, start_from_simulation
from scaletui.loadgen.shard import add_scale_flags, check_split
from scaletui.loadgen.tokens import SERVER
from scaletui.loadgen.workload import (
    ARRIVALS,
    DISTS,
    PROMPT_FORMATS,
    Lengths,
    Workload,
    iter_requests,
)

DESCRIPTION = "`loadgen`: offer a workload to an OpenAI-compatible server and report what it got."


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"a rate must be > 0 (or 'inf'), got {text!r}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"a fraction must be in [0, 1], got {text!r}")
    return value


def _turns(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--turns wants a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"--turns must be >= 1 (user turns per conversation), got {text!r}"
        )
    return value


def _rates(text: str) -> list[float]:
    try:
        return [_rate(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--sweep wants rates like 1,2,4,8, got {text!r}"
        ) from None


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"want a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"want a whole number >= 1, got {text!r}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"want seconds >= 0, got {text!r}")
    return value


def _start(text: str) -> float | str:
    """--search-start: a rate, or the path of a `scaletui simulate --out` JSON."""
    try:
        float(text)
    except ValueError:
        return text
    return _rate(text)


SEARCH_HELP = (
    "find the highest rate whose --slo-percentile of every --slo is met: from 1 req/s double "
    "(or halve), from --search-start step x1.25, x1.25^2, ... until a stage passes and one "
    "fails, then bisect until (fail - pass) / pass <= 5%%; then run both ends again "
    "(--search-confirm) and go on while one is outvoted. A rate's verdict is the majority of "
    "its stages (a tie runs once more); max_rate = the highest passing rate below the lowest "
    "failing one. A stage passes when it completed at "
    "least ceil(TAIL / (1 - P/100)) requests (p99, tail 5: 500), each percentile <= its SLO, "
    "its failure rate <= --max-failure-rate and it is not saturated. Stages send "
    "max(--num-requests, that minimum)"
)


def add_search_flags(p: argparse.ArgumentParser) -> None:
    """--search and its rule; --repeat, --ramp-up; the server's /metrics and --strict."""
    g = p.add_argument_group("SLO search, repeats, ramp and the server's side")
    g.add_argument("--search", action="store_true", help=SEARCH_HELP)
    g.add_argument("--slo-percentile", type=float, default=99.0, help="P of the SLOs (99)")
    g.add_argument(
        "--search-start",
        type=_start,
        help="first rate (default 1 req/s), or a `scaletui simulate --out` JSON: its highest "
        "rate predicted to pass; the result says how many stages that saved",
    )
    g.add_argument("--search-tail", type=_count, default=5, help="TAIL of the stage rule (5)")
    g.add_argument(
        "--search-confirm",
        type=_count,
        default=2,
        help="stages each end of the final bracket needs, with a strict majority (2: best of "
        "three when they disagree; 1: trust single stages)",
    )
    g.add_argument(
        "--repeat",
        type=_count,
        default=1,
        help="run each stage N times (own seeds): per-metric mean and 95%% Student-t CI; "
        "percentiles from all repeats' records pooled",
    )
    g.add_argument(
        "--ramp-up",
        type=_seconds,
        default=0.0,
        help="S: grow the rate linearly from 0 over S s before the measured window (open "
        "loop; ramp requests excluded, like --warmup)",
    )
    g.add_argument(
        "--metrics-interval",
        type=_seconds,
        default=1.0,
        help="scrape the server's /metrics every S s during a stage for peaks (0: before and "
        "after only)",
    )
    g.add_argument(
        "--strict",
        action="store_true",
        help="exit 5 when loadgen itself was saturated (event-loop lag p99 > 10 ms or > 90%% "
        "of a core)",
    )


def add_arrival_flags(g: argparse._ArgumentGroup) -> None:
    """When requests are sent (after --qps): loadgen's and `scaletui simulate`'s alike."""
    g.add_argument("--arrival", choices=ARRIVALS, default="poisson")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape k (CV=1/sqrt k)")
    g.add_argument("--concurrency", type=int, help="max requests in flight (alone: closed loop)")
    g.add_argument("--num-requests", type=int, help="requests to send (default 200)")
    g.add_argument("--duration", type=float, help="seconds to send for")
    g.add_argument("--seed", type=int, default=0)


def add_request_flags(g: argparse._ArgumentGroup) -> None:
    """What each request asks: prompt and output lengths, dataset, shared prefixes."""
    g.add_argument("--input-len", type=int, default=128)
    g.add_argument("--input-dist", choices=DISTS, default="fixed")
    g.add_argument("--input-spread", type=float, default=0.0)
    g.add_argument("--output-len", type=int, help="max_tokens (default 128; overrides dataset)")
    g.add_argument("--output-dist", choices=DISTS, default="fixed")
    g.add_argument("--output-spread", type=float, default=0.0)
    g.add_argument("--dataset", help="ShareGPT-format JSON file (first turn of each)")
    g.add_argument("--chars-per-token", type=float, default=4.0, help="dataset length estimate")
    g.add_argument("--prefix-len", type=int, default=0, help="shared-prefix tokens")
    g.add_argument("--prefix-groups", type=int, default=1, help="distinct shared prefixes")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loadgen",
        description=DESCRIPTION,
        epilog="loadgen report RESULT.json... --html OUT.html [--png OUT.png]: the results as "
        "one self-contained HTML report (see loadgen report --help). loadgen merge A.jsonl "
        "B.jsonl ... [--out R.json]: the --shard runs' records as one run's summary",
    )
    a = p.add_argument
    a("--url", help="server base URL (default: start an embedded scaletui server)")
    a("--api", choices=("completions", "chat"), default="completions")
    a("--model", help="model name (default: the first id of GET /v1/models)")
    g = p.add_argument_group("arrivals")
    g.add_argument("--qps", type=_rate, help="offered request rate (req/s; 'inf' = all at once)")
    add_arrival_flags(g)
    g.add_argument("--warmup", type=int, default=0, help="warm-up requests, excluded")
    g.add_argument("--cancel-rate", type=float, default=0.0, help="fraction aborted mid-stream")
    g.add_argument("--sweep", type=_rates, help="rates 1,2,4,8: one stage each, then a table")
    w = p.add_argument_group("requests")
    add_request_flags(w)
    w.add_argument("--prompt-format", choices=PROMPT_FORMATS, default="text")
    w.add_argument(
        "--tokenizer",
        help="tokenizer.json or an HF model dir: prompts of exactly their length; 'server': "
        "count with the server's /tokenize",
    )
    w.add_argument(
        "--dataset-fit",
        action="store_true",
        help="with --dataset and --tokenizer: cut or pad prompts to --input-len/--input-dist",
    )
    c = p.add_argument_group("conversations and traces")
    c.add_argument("--turns", type=_turns, help="user turns per conversation (mean)")
    c.add_argument("--turns-dist", choices=DISTS, default="fixed")
    c.add_argument("--turns-spread", type=float, default=0.0)
    c.add_argument(
        "--think-time", type=float, default=0.0, help="s from a reply's end to the next turn"
    )
    c.add_argument("--trace", help="replay a Mooncake JSONL, BurstGPT CSV or plain JSONL trace")
    c.add_argument("--trace-speedup", type=_rate, default=1.0, help="trace time / this")
    c.add_argument("--trace-block-size", type=int, default=512, help="tokens per hash_id")
    w.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    w.add_argument("--timeout", type=float, default=300.0, help="per-request limit (s)")
    w.add_argument("--read-timeout", type=float, default=60.0, help="max stream silence (s)")
    f = p.add_argument_group("failures")
    f.add_argument(
        "--max-failure-rate",
        type=_fraction,
        default=0.01,
        help="exit 3 when (failed + rejected) / (sent - cancelled) is above this in a stage",
    )
    f.add_argument(
        "--max-connection-failures",
        type=int,
        default=5,
        metavar="N",
        help="N connection failures in a row (refused/reset, probes included): the "
        "server is gone, stop with a partial result and exit 4 (0 = never)",
    )
    add_search_flags(p)
    add_scale_flags(p)
    o = p.add_argument_group("outputs")
    o.add_argument(
        "--slo", type=Slo.parse, help="SLOs in ms (goodput; --search): ttft=500,tpot=50,e2el=5000"
    )
    o.add_argument("--out", help="summary JSON file")
    o.add_argument("--save-requests", help="per-request JSONL file")
    o.add_argument("--csv", help="summary CSV (one row per stage)")
    o.add_argument("--jsonl", help="live JSONL (start, 1 s windows, summary) to PATH or -")
    o.add_argument("--quiet", action="store_true", help="no table, no progress")
    s = p.add_argument_group("embedded server")
    s.add_argument(
        "--server-cmd",
        help="command template with {python} {port} "
        "(default $LOADGEN_SERVER_CMD or scaletui serve --model small)",
    )
    s.add_argument("--server-timeout", type=float, default=600.0, help="wait for /health (s)")
    s.add_argument(
        "--server-log",
        help="the server's output to this file (default: a temporary "
        "file, removed after a clean run)",
    )
    return p


def check_usage(args: argparse.Namespace) -> None:
    """Flags that do not go together: a ValueError naming them, before anything starts."""
    if (
        args.qps is None
        and args.concurrency is None
        and not (args.sweep or args.trace or args.search)
    ):
        raise ValueError("give --qps RATE and/or --concurrency N (or --sweep RATES, --trace)")
    if args.trace and args.sweep:
        raise ValueError("--trace sends at its own times: scale them with --trace-speedup")
    if args.prompt_format == "ids" and args.api == "chat":
        raise ValueError("--prompt-format ids needs --api completions (chat takes text)")
    if args.search:
        if args.slo is None or all(v is None for v in args.slo.as_dict().values()):
            raise ValueError("--search needs --slo, e.g. --slo ttft=500,tpot=50")
        for flag in ("qps", "sweep", "trace", "duration"):
            if getattr(args, flag):
                raise ValueError(
                    f"--search chooses each stage's rate and size itself: drop --{flag}"
                )
    if args.slo is not None:
        min_requests(args.slo_percentile, args.search_tail)  # a percentile in (0, 100)
    if isinstance(args.search_start, str):  # a simulate result: read now, before any request
        start_from_simulation(args.search_start, args.slo, args.slo_percentile)
    check_split(args)
    rates = args.sweep or [args.qps]
    if args.ramp_up and (args.trace or not (args.search or args.sweep or args.qps)):
        raise ValueError("--ramp-up needs an offered rate (--qps, --sweep or --search)")
    if args.ramp_up and any(r is not None and math.isinf(r) for r in rates):
        raise ValueError("--ramp-up needs a finite rate, not --qps inf")


def workload_from(args: argparse.Namespace) -> Workload:
    out_len = args.output_len if args.output_len is not None else 128
    return Workload(
        input=Lengths(args.input_len, args.input_dist, args.input_spread),
        output=Lengths(out_len, args.output_dist, args.output_spread),
        dataset=args.dataset,
        dataset_output=args.output_len is None,
        chars_per_token=args.chars_per_token,
        prefix_len=args.prefix_len,
        prefix_groups=args.prefix_groups,
        prompt_format=args.prompt_format,
        qps=args.sweep[0] if args.sweep else 1.0 if getattr(args, "search", False) else args.qps,
        arrival=args.arrival,
        burstiness=args.burstiness,
        concurrency=args.concurrency,
        cancel_rate=args.cancel_rate,
        seed=args.seed,
        tokenizer=getattr(args, "tokenizer", None),
        dataset_fit=getattr(args, "dataset_fit", False),
        turns=Lengths(args.turns, args.turns_dist, args.turns_spread)
        if getattr(args, "turns", None)
        else None,
        think_time=getattr(args, "think_time", 0.0),
        trace=getattr(args, "trace", None),
        trace_speedup=getattr(args, "trace_speedup", 1.0),
        trace_block=getattr(args, "trace_block_size", 512),
    )


def preflight(workload: Workload) -> None:
    """Load what the workload names (a tokenizer, a trace) so that a bad one is an error before
    any request; a server tokenizer ('server') is loaded once its URL is known."""
    if workload.trace:
        load_trace(workload.trace)
    if workload.tokenizer != SERVER:
        next(iter_requests(workload))  # the first prompt: a tokenizer that cannot make one
