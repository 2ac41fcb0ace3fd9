"""One stage of a run at one rate, as the CLI runs it for --qps, each --sweep rate and each
--search step:

1. the server's /metrics is scraped (server_metrics.Scraper) and loadgen's own overhead metered
   (overhead.Overhead) around the whole stage;
2. the workload runs --repeat times, each a fresh Runner with its own seed (stage s, repeat k:
   --seed + s * repeat + k), so no stage resends another's prompts to a prefix cache;
3. the summary is summarize() of the records (repeats pooled: repeat.pool), plus
   `server_metrics`, `client_overhead` and, with --slo, `slo_check` (search.verdict);
4. it goes to the live JSONL, the per-request file (each run's records after a header line,
   shard.header, once the stage is done) and the terminal.

A shard of a schedule (--shard, --workers' children) runs its Runners with its Shard and start.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, replace
from typing import IO

import aiohttp

from scaletui.loadgen import output, repeat
from scaletui.loadgen.client import get_json
from scaletui.loadgen.overhead import Overhead
from scaletui.loadgen.report import latencies, summarize, warnings_for
from scaletui.loadgen.run_config import RunConfig
from scaletui.loadgen.runner import Runner
from scaletui.loadgen.search import min_requests, percentiles_ms, verdict
from scaletui.loadgen.server_metrics import Scraper
from scaletui.loadgen.shard import Shard, StartAt, header, schedule_of
from scaletui.loadgen.workload import Workload


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


async def server_stats(session: aiohttp.ClientSession, url: str) -> dict | None:
    try:
        return await get_json(session, url.rstrip("/") + "/stats", timeout=5)
    except (aiohttp.ClientError, TimeoutError):
        return None


class Stages:
    """Runs stages one after another on one session; remembers whether to go on."""

    def __init__(
        self,
        args: argparse.Namespace,
        session: aiohttp.ClientSession,
        cfg: RunConfig,
        workload: Workload,
        sink: output.JsonlSink,
        human: IO[str],
        requests_file: IO[bytes] | None,
        shard: Shard | None = None,
        start: StartAt | None = None,
    ) -> None:
        self.args, self.session, self.cfg, self.workload = args, session, cfg, workload
        self.shard, self.start = shard, start
        self.sink, self.human, self.requests_file = sink, human, requests_file
        self.summaries: list[dict] = []
        self.stopped = False  # a signal
        self.gone: str | None = None  # why the server is considered gone
        self.runner: Runner | None = None

    @property
    def halted(self) -> bool:
        return self.stopped or self.gone is not None

    def stop(self) -> None:
        self.stopped = True
        if self.runner is not None:
            self.runner.stop()

    async def run(self, rate: float | None, label: str = "") -> dict:
        """One stage at `rate` (None: the workload's own); its summary."""
        args, cfg, stage = self.args, self.cfg, len(self.summaries)
        wl = replace(self.workload, qps=rate)
        config = {"run": asdict(cfg), "workload": asdict(wl), "stage": stage}
        self.sink.write(
            {"type": "start", "t": 0.0, "stage": stage, "config": config, "url": cfg.url}
            | {"model": cfg.model}
        )
        scraper = Scraper(self.session, cfg.url, args.metrics_interval)
        await scraper.start()
        meter = Overhead()
        meter.start()
        repeats, records, first, stats = [], [], None, [None, None]
        runs = []  # (repeat, its workload, its result): the per-request file's blocks
        for k in range(args.repeat):
            if k and self.halted:  # the first always runs, so that a summary exists
                break
            tag = f"{label}repeat {k + 1}/{args.repeat} " if args.repeat > 1 else label
            progress = Progress(cfg.num_requests if not cfg.duration else None, not args.quiet, tag)

            def on_window(win: dict, progress: Progress = progress) -> None:
                self.sink.write({**win, "stage": stage})
                progress(win)

            # each stage and repeat its own prompts and arrivals: a later stage sending the same
            # prompts would find them in the server's prefix cache
            seed = wl.seed + stage * args.repeat + k
            run_wl = replace(wl, seed=seed)
            # a --workers child shows no window and streams none: it spends no time on them
            quiet = self.shard is not None and args.quiet and not args.jsonl
            self.runner = Runner(
                cfg,
                run_wl,
                on_window=None if quiet else on_window,
                shard=self.shard,
                start=self.start,
            )
            if self.stopped:  # a signal while /metrics was read: a partial, empty stage
                self.runner.stop()
            before = await server_stats(self.session, cfg.url)
            result = await self.runner.run(self.session)
            progress.done()
            if result.stop_reason is not None:
                self._aborted(stage, result)
            stats = [stats[0] or before, await server_stats(self.session, cfg.url)]
            first = first or result
            same = {"slo": args.slo, "requested_rate": rate, "config": config,
                    "server_stats_before": stats[0], "server_stats_after": stats[1],
                    "tokenizer": wl.tokenizer}  # fmt: skip
            summary = summarize(
                result.records,
                t_start=result.t_start,
                partial=result.partial,
                partial_reason=result.stop_reason,
                partial_message=result.stop_message,
                **same,
            )
            repeats.append(summary)
            records += [r for r in result.records if not r.warmup]
            runs.append((k, run_wl, result))
        summary = repeats[0]
        if len(repeats) > 1:
            pooled = summarize(records, t_start=first.t_start, **same)
            summary = repeat.pool(pooled, repeats)
            summary["warnings"] = warnings_for(summary)
        summary["command"] = args.command  # argv, as given
        summary["client_overhead"] = await meter.finish()
        # the speed timeline counts from the first repeat's schedule start (the measured one)
        summary["server_metrics"] = await scraper.finish(first.t_start)
        if summary["client_overhead"]["saturated"]:
            summary["warnings"].append(summary["client_overhead"]["saturation"])
        if args.slo is not None:
            summary["slo_check"] = verdict(
                percentiles_ms(latencies(records), args.slo_percentile),
                args.slo,
                percentile=args.slo_percentile,
                completed=summary["completed"],
                needed=min_requests(args.slo_percentile, args.search_tail),
                failure_rate=summary["failure_rate"],
                max_failure_rate=args.max_failure_rate,
                saturation=summary["saturation"],
            )
        for k, run_wl, result in runs if self.requests_file else ():
            head = header(
                shard=self.shard,
                start=self.start,
                result=result,
                schedule=schedule_of(cfg, run_wl),
                stage=stage,
                repeat=k,
                rate=rate,
                summary=summary,
                slo_rule=self._slo_rule(),
            )
            f = self.requests_file
            output.write_requests_to(f, result.records, result.t_start, stage, head)
        self.summaries.append(summary)
        self.sink.write({"type": "summary", "stage": stage, **summary})
        if not args.quiet:
            print(output.table(summary), file=self.human, flush=True)
        return summary

    def _slo_rule(self) -> dict | None:
        """How `slo_check` was judged, for a merge to judge the merged records alike."""
        a = self.args
        if a.slo is None:
            return None
        return {"percentile": a.slo_percentile, "tail": a.search_tail,
                "max_failure_rate": a.max_failure_rate}  # fmt: skip

    def _aborted(self, stage: int, result) -> None:
        t_stop = (result.t_stop or result.t_start) - result.t_start
        reason, message = result.stop_reason, result.stop_message
        self.sink.write(
            {
                "type": "aborted",
                "stage": stage,
                "t": round(t_stop, 6),
                "reason": reason,
                "message": message,
            }
        )
        if reason == "server_gone":
            self.gone = f"{message}; stopped {t_stop:.1f} s into stage {stage}"
