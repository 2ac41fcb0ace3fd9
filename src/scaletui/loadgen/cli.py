"""`loadgen`: offer a workload to an OpenAI-compatible server and report what it got.

Without --url it starts an embedded `scaletui serve --model small` (a subprocess) and stops it
afterwards. --sweep runs one stage per rate and prints latency against throughput. Errors a user
can cause (bad flags, a dead port, a wrong URL) are one line on stderr and a non-zero exit.
`loadgen report RESULT.json... --html OUT` writes the results as an HTML report (html_report.py).
Exit: 0 ok, 1 no request completed, 2 usage or connection error, 3 failure rate over
--max-failure-rate, 4 the server went away mid-run (partial result), 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from dataclasses import asdict, replace

import aiohttp

from scaletui.loadgen import output
from scaletui.loadgen.client import get_json
from scaletui.loadgen.embedded import EmbeddedServer
from scaletui.loadgen.flags import build_parser, preflight, workload_from
from scaletui.loadgen.replay import trace_size
from scaletui.loadgen.report import summarize
from scaletui.loadgen.run_config import RunConfig, make_session
from scaletui.loadgen.runner import Runner
from scaletui.loadgen.tokens import SERVER, load_counter

EXIT_OK, EXIT_NONE_COMPLETED, EXIT_USAGE, EXIT_FAILURES, EXIT_SERVER_GONE = 0, 1, 2, 3, 4
EXIT_INTERRUPTED = 130


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


class Progress:
    """A one-line progress display on stderr, only when stderr is a TTY; each update rewrites
    the line and clears what a longer previous one left (ESC [K)."""

    def __init__(self, total: int | None, enabled: bool, label: str = "") -> None:
        self.total, self.enabled = total, enabled and sys.stderr.isatty()
        self.label = label  # e.g. the sweep stage's rate

    def __call__(self, win: dict) -> None:
        if not self.enabled:
            return
        tot = win["totals"]
        of = f"/{self.total}" if self.total else ""
        ttft = win["ttft_ms"]["p50"]
        print(
            f"\r{self.label}[{win['t']:6.0f}s] sent {tot['sent']}{of} done {tot['completed']} "
            f"fail {tot['failed']} rej {tot['rejected']} in-flight {win['in_flight']} "
            f"{win['output_tok_s']:.0f} tok/s ttft p50 {'-' if ttft is None else f'{ttft:.1f}'} ms"
            "\x1b[K",
            end="",
            file=sys.stderr,
            flush=True,
        )

    def done(self) -> None:
        if self.enabled:
            print(file=sys.stderr)


async def run(args: argparse.Namespace, url: str) -> int:
    workload = workload_from(args)
    rates: list[float | None] = list(args.sweep) if args.sweep else [workload.qps]
    sink = output.JsonlSink(args.jsonl)
    human = sys.stderr if args.jsonl == "-" else sys.stdout  # keep a JSONL stdout pure
    summaries: list[dict] = []
    stopped = False
    gone: str | None = None  # why the server is considered gone
    runner: Runner | None = None

    def on_signal() -> None:
        nonlocal stopped
        stopped = True
        if runner is not None:
            runner.stop()

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
            cfg = RunConfig(
                url=url,
                model=model,
                api=args.api,
                num_requests=num,
                duration=args.duration,
                warmup=args.warmup,
                timeout=args.timeout,
                read_timeout=args.read_timeout,
                ignore_eos=args.ignore_eos,
                max_connection_failures=args.max_connection_failures,
            )
            for stage, rate in enumerate(rates):
                if stopped or gone:
                    break
                wl = replace(workload, qps=rate)
                config = {"run": asdict(cfg), "workload": asdict(wl), "stage": stage}
                sink.write(
                    {
                        "type": "start",
                        "t": 0.0,
                        "stage": stage,
                        "config": config,
                        "url": url,
                        "model": model,
                    }
                )
                label = f"stage {stage + 1}/{len(rates)} rate {rate:g}/s " if args.sweep else ""
                progress = Progress(num if not args.duration else None, not args.quiet, label)

                def on_window(win: dict, stage: int = stage, progress: Progress = progress):
                    sink.write({**win, "stage": stage})
                    progress(win)

                runner = Runner(cfg, wl, on_window=on_window)
                before = await _stats(session, url)
                result = await runner.run(session)
                progress.done()
                if result.stop_reason is not None:
                    t_stop = (result.t_stop or result.t_start) - result.t_start
                    reason, message = result.stop_reason, result.stop_message
                    sink.write(
                        {
                            "type": "aborted",
                            "stage": stage,
                            "t": round(t_stop, 6),
                            "reason": reason,
                            "message": message,
                        }
                    )
                    if reason == "server_gone":
                        gone = f"{message}; stopped {t_stop:.1f} s into stage {stage}"
                after = await _stats(session, url)
                summary = summarize(
                    result.records,
                    t_start=result.t_start,
                    slo=args.slo,
                    requested_rate=rate,
                    config=config,
                    server_stats_before=before,
                    server_stats_after=after,
                    partial=result.partial,
                    partial_reason=result.stop_reason,
                    partial_message=result.stop_message,
                    tokenizer=wl.tokenizer,
                )
                summary["command"] = args.command  # argv, as given
                summaries.append(summary)
                sink.write({"type": "summary", "stage": stage, **summary})
                if requests_file:
                    output.write_requests_to(requests_file, result.records, result.t_start, stage)
                if not args.quiet:
                    print(output.table(summary), file=human, flush=True)
    finally:
        sink.close()
        if requests_file:
            requests_file.close()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    if args.out:
        one = len(summaries) == 1
        output.write_json(
            args.out, summaries[0] if one else {"stages": summaries, "command": args.command}
        )
    if args.csv:
        output.write_csv(args.csv, summaries)
    if args.sweep and not args.quiet and summaries:
        print(output.sweep_table(summaries), file=human)
        plot = output.sweep_plot(summaries)
        if plot:
            print(plot, file=human)
    return _exit_status(summaries, stopped, gone, args.max_failure_rate)


def _exit_status(summaries: list[dict], stopped: bool, gone: str | None, max_rate: float) -> int:
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
    return EXIT_OK


async def _stats(session: aiohttp.ClientSession, url: str) -> dict | None:
    try:
        return await get_json(session, url.rstrip("/") + "/stats", timeout=5)
    except (aiohttp.ClientError, TimeoutError):
        return None


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
    parser = build_parser()
    args = parser.parse_args(argv)
    args.command = ["loadgen", *argv]
    try:
        if args.qps is None and args.concurrency is None and not (args.sweep or args.trace):
            raise UserError("give --qps RATE and/or --concurrency N (or --sweep RATES, --trace)")
        if args.trace and args.sweep:
            raise UserError("--trace sends at its own times: scale them with --trace-speedup")
        if args.prompt_format == "ids" and args.api == "chat":
            raise UserError("--prompt-format ids needs --api completions (chat takes text)")
        preflight(workload_from(args))  # validate (and load files) before starting anything
        RunConfig(
            url="-",
            model="-",
            num_requests=args.num_requests or 1,
            duration=args.duration,
            warmup=args.warmup,
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
            code = _asyncio_run(run(args, url))
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
