"""`loadgen`: offer a workload to an OpenAI-compatible server and report what it got.

Without --url it starts an embedded `scaletui serve --model small` (a subprocess) and stops it
afterwards. --sweep runs one stage per rate and prints latency against throughput; --search
picks the stages' rates itself (search.py) and reports max_rate. Each stage is stages.py's.
`loadgen report RESULT.json... --html OUT` writes results as an HTML report (html_report.py).
--workers N sends one schedule from N local processes (workers.py; each runs this module as
`worker`); --shard I/N --start-at EPOCH sends one shard of it; `loadgen merge` joins shards.
Errors a user can cause (bad flags, a dead port, a wrong URL) are one line on stderr and a
non-zero exit. Exit: 0 ok, 1 no request completed, 2 usage or connection error, 3 failure rate
over --max-failure-rate, 4 the server went away mid-run (partial result), 5 loadgen itself was
saturated in some stage and --strict was given (overhead.py), 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import pickle
import signal
import sys
from dataclasses import replace

import aiohttp

from scaletui.loadgen import output, search, workers
from scaletui.loadgen.client import get_json
from scaletui.loadgen.embedded import EmbeddedServer
from scaletui.loadgen.flags import build_parser, check_usage, preflight, workload_from
from scaletui.loadgen.replay import trace_size
from scaletui.loadgen.results import InputError
from scaletui.loadgen.run_config import RunConfig, make_session
from scaletui.loadgen.search import min_requests
from scaletui.loadgen.shard import STDIN, Shard, StartAt
from scaletui.loadgen.stages import Stages
from scaletui.loadgen.tokens import SERVER, load_counter

EXIT_OK, EXIT_NONE_COMPLETED, EXIT_USAGE, EXIT_FAILURES, EXIT_SERVER_GONE = 0, 1, 2, 3, 4
EXIT_CLIENT_SATURATED, EXIT_INTERRUPTED = 5, 130


class UserError(Exception):
    """A problem the user can fix; printed as one line."""


async def _model(session: aiohttp.ClientSession, url: str) -> str:
    models = await get_json(session, url.rstrip("/") + "/v1/models", timeout=15)
    data = models.get("data") if isinstance(models, dict) else None
    first = data[0] if isinstance(data, list) and data else None
    if not isinstance(first, dict) or not isinstance(first.get("id"), str):
        raise UserError(
            f"{url} has no model list at /v1/models; is it an OpenAI server? (give --model)"
        )
    return first["id"]


async def run(args: argparse.Namespace, url: str) -> int:
    workload = workload_from(args)
    rates: list[float | None] = list(args.sweep) if args.sweep else [workload.qps]
    sink = output.JsonlSink(args.jsonl)
    human = sys.stderr if args.jsonl == "-" else sys.stdout  # keep a JSONL stdout pure
    stages: Stages | None = None
    stopped = False
    found: dict | None = None  # the --search result

    def on_signal() -> None:
        nonlocal stopped
        stopped = True
        if stages is not None:
            stages.stop()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    requests_file = open(args.save_requests, "wb") if args.save_requests else None  # noqa: SIM115
    try:
        async with make_session() as session:
            try:
                model = args.model or await _model(session, url)
            except aiohttp.ClientError as exc:
                raise UserError(f"cannot reach {url}: {exc}") from None
            except TimeoutError:  # an OSError: it would print as a bare "loadgen: error:"
                raise UserError(f"cannot reach {url}: no answer from /v1/models") from None
            if workload.tokenizer == SERVER:  # the URL is known now; loaded before any request
                workload = replace(workload, tokenizer=url)
                load_counter(url)
            num = args.num_requests if args.num_requests or args.duration else 200
            if args.trace and not (args.num_requests or args.duration):
                num = trace_size(args.trace)  # the whole trace
            if args.search:  # enough requests for the percentile to mean something
                num = max(
                    args.num_requests or 0, min_requests(args.slo_percentile, args.search_tail)
                )
            cfg = RunConfig(
                url=url,
                model=model,
                api=args.api,
                num_requests=num,
                duration=args.duration,
                warmup=args.warmup,
                ramp_up=args.ramp_up,
                timeout=args.timeout,
                read_timeout=args.read_timeout,
                ignore_eos=args.ignore_eos,
                max_connection_failures=args.max_connection_failures,
            )
            start = StartAt(args.start_at) if args.shard else None
            stages = Stages(
                args, session, cfg, workload, sink, human, requests_file, args.shard, start
            )
            stages.stopped = stopped
            if args.search:
                found = await _search(stages, args)
            for k, rate in enumerate([] if args.search else rates):
                if stages.halted:
                    break
                label = f"stage {k + 1}/{len(rates)} rate {rate:g}/s " if args.sweep else ""
                await stages.run(rate, label)
    finally:
        sink.close()
        if requests_file:
            requests_file.close()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    summaries = stages.summaries if stages else []
    if args.out:
        one = len(summaries) == 1 and not found
        whole = {**(found or {}), "stages": summaries, "command": args.command}
        output.write_json(args.out, summaries[0] if one else whole)
    if args.csv:
        output.write_csv(args.csv, summaries)
    if (args.sweep or args.search) and not args.quiet and summaries:
        print(output.sweep_table(summaries), file=human)
        plot = output.sweep_plot(summaries)
        if plot:
            print(plot, file=human)
    if found is not None and not args.quiet:
        print(search.describe(found["search"]), file=human)
    gone = stages.gone if stages else None
    return _exit_status(summaries, stopped, gone, args.max_failure_rate, args.strict)


async def _search(stages: Stages, args: argparse.Namespace) -> dict:
    """Stages chosen by search.next_rate until it stops; {"max_rate", "search"}."""
    start = args.search_start
    if isinstance(start, str):
        start = search.start_from_simulation(start, args.slo, args.slo_percentile)
    rule = search.config_for(start, args.search_confirm)
    history: list[dict] = []
    while not stages.halted:
        rate = search.next_rate(rule, [(h["rate"], h["passed"]) for h in history])
        if rate is None:
            break
        again = "again " if any(h["rate"] == rate for h in history) else ""
        label = f"search stage {len(history) + 1} rate {rate:.4g}/s {again}"
        summary = await stages.run(rate, label)
        check = summary["slo_check"]
        history.append({"rate": rate, "passed": check["passed"], "reasons": check["reasons"]})
    result = search.summary_of(rule, history)
    result["start_from"] = args.search_start if isinstance(args.search_start, str) else None
    return {"max_rate": result["max_rate"], "search": result}


def run_workers(args: argparse.Namespace, url: str) -> int:
    """--workers N: the shards' merged summary, printed and written as one process's."""
    summary, stopped = workers.run(args, url)
    human = sys.stderr if args.jsonl == "-" else sys.stdout
    sink = output.JsonlSink(args.jsonl)
    sink.write({"type": "summary", "stage": 0, **summary})
    sink.close()
    if args.out:
        output.write_json(args.out, summary)
    if args.csv:
        output.write_csv(args.csv, [summary])
    if not args.quiet:
        print(output.table(summary), file=human, flush=True)
    return _exit_status([summary], stopped, _gone(summary), args.max_failure_rate, args.strict)


def _gone(summary: dict) -> str | None:
    if summary["partial_reason"] != "server_gone":
        return None
    return summary["partial_message"]


def _merge(argv: list[str]) -> int:
    from scaletui.loadgen import merge

    try:
        summary, args = merge.run(argv)
    except (InputError, OSError) as exc:
        print(f"loadgen merge: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return _exit_status([summary], False, _gone(summary), args.max_failure_rate, False)


def _worker(argv: list[str]) -> int:
    """One of --workers' children: `worker ARGS.pickle I N FILE` (workers.py writes ARGS)."""
    flags, index, count, path = argv
    with open(flags, "rb") as f:
        args = pickle.load(f)  # written by our parent into its private folder
    args.shard, args.start_at, args.save_requests = Shard(int(index), int(count)), STDIN, path
    args.workers, args.quiet, args.out, args.csv, args.jsonl = None, True, None, None, None
    try:
        return _asyncio_run(run(args, args.url))
    except (UserError, ValueError, RuntimeError, OSError) as exc:
        print(f"loadgen: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _exit_status(
    summaries: list[dict], stopped: bool, gone: str | None, max_rate: float, strict: bool
) -> int:
    """The exit code, with its reason as one line on stderr (the first that applies)."""
    if stopped:
        return EXIT_INTERRUPTED
    if gone:
        print(f"loadgen: {gone}; partial result written", file=sys.stderr)
        return EXIT_SERVER_GONE
    for s in summaries:
        if not s["completed"] and s["sent"]:
            first = next(iter(s["errors"]["examples"].items()), ("?", "no message"))
            print(f"loadgen: no request completed ({first[0]}: {first[1]})", file=sys.stderr)
            return EXIT_NONE_COMPLETED
    if not summaries:
        return EXIT_NONE_COMPLETED
    for stage, s in enumerate(summaries):
        rate = s["failure_rate"]
        if rate is not None and rate > max_rate:
            kinds = ", ".join(
                f"{kind} {e['count']} (e.g. {e['example'][:120]})"
                for kind, e in list(s["failures_by_kind"].items())[:3]
            )
            at = "" if len(summaries) == 1 else f" in stage {stage}"
            print(
                f"loadgen: failure rate {rate:.1%}{at} is over --max-failure-rate "
                f"{max_rate:.1%}: {kinds}",
                file=sys.stderr,
            )
            return EXIT_FAILURES
    busy = [(k, s["client_overhead"]) for k, s in enumerate(summaries)]
    busy = [(k, o) for k, o in busy if o and o["saturated"]]
    if strict and busy:
        print(f"loadgen: stage {busy[0][0]}: {busy[0][1]['saturation']}", file=sys.stderr)
        return EXIT_CLIENT_SATURATED
    return EXIT_OK


def _asyncio_run(coro):
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["report"]:
        from scaletui.loadgen import html_report  # matplotlib only for the report

        return html_report.main(argv[1:])
    if argv[:1] == ["merge"]:
        return _merge(argv[1:])
    if argv[:1] == ["worker"]:
        return _worker(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    args.command = ["loadgen", *argv]
    try:
        check_usage(args)
        preflight(workload_from(args))  # validate (and load files) before starting anything
        RunConfig(
            url="-",
            model="-",
            num_requests=args.num_requests or 1,
            duration=args.duration,
            warmup=args.warmup,
            ramp_up=args.ramp_up,
            timeout=args.timeout,
            read_timeout=args.read_timeout,
            max_connection_failures=args.max_connection_failures,
        )
        with contextlib.ExitStack() as stack:
            url = args.url
            srv = None
            if url is None:
                srv = EmbeddedServer(
                    args.server_cmd, timeout=args.server_timeout, log=args.server_log
                )
                url = stack.enter_context(srv).url
            elif not url.startswith(("http://", "https://")):
                raise UserError(f"--url must start with http:// or https://, got {url!r}")
            code = run_workers(args, url) if args.workers else _asyncio_run(run(args, url))
            if srv is not None:
                srv.finish(clean=code == EXIT_OK)
            return code
    except (UserError, ValueError, RuntimeError, OSError) as exc:
        print(f"loadgen: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("loadgen: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
