"""The TUI's flags (`parser`) and the Textual app built from them (`build` makes it without
running it, for a headless caller such as bench/tui_first_screen.py); `scaletui` (no subcommand)
and `scaletui tui` run it (`scaletui.commands.tui`).

Textual reads TEXTUAL_COLOR_SYSTEM once, when it is first imported, so `--color` is applied here
before anything imports textual (the app itself lives in `scaletui.tui.ui`).

Default flow: calibrate this host if it has no `local` hardware spec (unless --no-calibrate or
--hardware), start `scaletui serve --model small` on a free port (with --processes N as N local
processes, dp N by default; or attach with --url), wait for /health, then run a closed-loop
load (concurrency = slots, 128 in / 128 out) in 30 s runs, one after another, until quit;
`r` reruns, `a` applies pending knobs.
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from scaletui.tui.knobs import MODES, Knobs

if TYPE_CHECKING:  # textual must not be imported before --color is applied
    from scaletui.tui.controller import Controller
    from scaletui.tui.state import SessionState
    from scaletui.tui.ui import ScaleTUI

COLORS = ("auto", "standard", "256", "truecolor")
SYMBOLS = ("braille", "block", "ascii")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scaletui", description="the interactive serving lab bench")
    a = p.add_argument
    a("--url", help="attach to a running server instead of starting one")
    a("--model", default="small", help="model spec for the embedded server (default small)")
    a("--slots", type=int, default=8, help="initial decode slots")
    a("--tp", type=int, default=1, help="initial tensor parallelism")
    a(
        "--dp",
        type=int,
        help="initial data parallelism (default 1; with --processes N, N: a replica per process)",
    )
    a("--mode", choices=MODES, default="interleaved")
    a(
        "--host-devices",
        type=int,
        help="JAX CPU: virtual devices for the embedded server (default on a CPU-only host: one "
        "per core, at most 8, so tp/dp can shard; 0 = XLA's default of one)",
    )
    a(
        "--processes",
        type=int,
        default=1,
        help="run the embedded server as N local processes on the CPU (jax.distributed, gloo), "
        "as N hosts would; --host-devices is then per process (default: the cores shared)",
    )
    a("--hardware", default="", help="spec for predictions (default: local, calibrated if missing)")
    a(
        "--no-calibrate",
        action="store_true",
        help="without a `local` spec, predict with a built-in spec instead of running "
        "`scaletui calibrate --quick` first; and fit no cost model of the server (expected "
        "then uses assumed efficiencies)",
    )
    a("--qps", type=float, help="open-loop load at this rate instead of closed-loop")
    a("--concurrency", type=int, default=0, help="closed-loop concurrency (default: = slots)")
    a("--input-len", type=int, default=128)
    a("--output-len", type=int, default=128)
    a(
        "--length-spread",
        type=float,
        default=0.25,
        help="input and output lengths uniform within +- this fraction of each (0: fixed)",
    )
    a("--run-seconds", type=float, default=30.0, help="length of one run")
    a("--once", action="store_true", help="one run, then wait for r (default: runs repeat)")
    a("--no-load", action="store_true", help="start the server but no load until r")
    a("--refresh", type=float, default=1.0, help="display refresh interval, s (0.25-5)")
    a("--color", choices=COLORS, help="colour system (sets TEXTUAL_COLOR_SYSTEM)")
    a("--theme", help="Textual theme, e.g. ansi-dark for 16-colour terminals")
    a("--graph-symbols", choices=SYMBOLS, default="braille")
    a("--no-mouse", action="store_true", help="leave the mouse to the terminal (select text)")
    a("--record", metavar="DIR", help="write every ingested event to DIR/session-*.jsonl")
    a("--replay", metavar="FILE", help="replay a recorded session (no server, no load)")
    a("--replay-speed", type=float, default=1.0, help="0 = all at once")
    a("--export-dir", default=".", help="where e writes runs (JSON + CSV)")
    a(
        "--log-dir",
        help="keep the server, loadgen and calibrate logs here (default: a temporary folder, "
        "removed on exit unless something failed)",
    )
    return p


def build(
    args: argparse.Namespace, *, watch_tty: bool = True
) -> tuple[ScaleTUI, Controller | None, SessionState]:
    """The app `main` runs, from parsed flags, not yet running: (app, controller, state), the
    controller None in a replay. Raises ValueError naming a bad flag value. `watch_tty=False`
    for a headless caller (a bench under `App.run_test()`): the TTY check would end the app."""
    if args.color:  # before anything imports textual
        os.environ["TEXTUAL_COLOR_SYSTEM"] = args.color
    if not 0.25 <= args.refresh <= 5:
        raise ValueError(f"--refresh must be in [0.25, 5] s, got {args.refresh}")
    if args.processes < 1:
        raise ValueError(f"--processes must be 1 or more, got {args.processes}")
    if args.processes > 1 and (args.url or args.replay):
        raise ValueError(
            f"--processes {args.processes} starts the embedded server as processes; --url and "
            "--replay start none (attach to a multi-process server's process 0 with --url alone)"
        )
    knobs = Knobs(
        slots=args.slots,
        tp=args.tp,
        dp=args.dp or args.processes,
        mode=args.mode,
        load="qps" if args.qps else "concurrency",
        rate=args.qps or float(args.concurrency),
        input_len=args.input_len,
        output_len=args.output_len,
        length_spread=args.length_spread,
        hardware=args.hardware,
    )

    from scaletui.tui.controller import Controller
    from scaletui.tui.host import process_host_devices
    from scaletui.tui.replay import Recorder, ReplaySource, read_replay
    from scaletui.tui.session import Session
    from scaletui.tui.state import SessionState
    from scaletui.tui.ui import ScaleTUI

    state = SessionState(knobs, args.model, phase="replay" if args.replay else "starting")
    controller = session = None
    if args.replay:
        source = ReplaySource(read_replay(args.replay), speed=args.replay_speed)
    else:
        controller = Controller(
            url=args.url,
            model=args.model,
            knobs=knobs,
            host_devices=args.host_devices
            if args.host_devices is not None or args.processes == 1
            else process_host_devices(args.processes),
            processes=args.processes,
            calibrate=not args.no_calibrate,
            log_dir=args.log_dir,
        )
        session = Session(
            controller,
            autoload=not args.no_load,
            run_seconds=args.run_seconds,
            loop_runs=not args.once,
        )
        source = controller
    app = ScaleTUI(
        source=source,
        session=session,
        state=state,
        refresh_interval=args.refresh,
        recorder=Recorder(args.record) if args.record else None,
        export_dir=args.export_dir,
        watch_tty=watch_tty,
        symbols=args.graph_symbols,
    )
    if args.theme:
        app.theme = args.theme
    return app, controller, state
