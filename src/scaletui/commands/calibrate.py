"""`scaletui calibrate [--quick] [--window S] [--out PATH] [--no-write]`: the host roofs and
their spread over a window (`scaletui.calibrate`) written as the `local` hardware spec; with
`--model M` the engine fit instead (commands/calibrate_engine.py over engine_fit.py); over
several processes the all-reduce between them (commands/calibrate_dcn.py), which a later host
calibration keeps."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from scaletui.calibrate import dcn
from scaletui.calibrate.host import QUICK_WINDOW_S, WINDOW_S, calibrate, rounded
from scaletui.commands import calibrate_dcn
from scaletui.specs import load_hardware, local_hardware_path


def _old_spec(path: Path) -> dict | None:
    """The spec this run replaces, for what one process cannot measure (the DCN); None if none."""
    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if any(a == "--model" or a.startswith("--model=") for a in argv):
        from scaletui.commands import calibrate_engine  # `scaletui calibrate --model M`

        return calibrate_engine.main(argv)
    if calibrate_dcn.wanted(argv):  # the all-reduce across processes
        return calibrate_dcn.main(argv)
    p = argparse.ArgumentParser(
        prog="scaletui calibrate",
        description="Measure this host's JAX devices; write the 'local' hardware spec. With "
        "--model M (see `scaletui calibrate --model M --help`): time that server "
        "configuration's engine and store its fitted cost model.",
        epilog="Across processes (dcn_bw, dcn_latency_s): `scaletui calibrate --processes N` or "
        "--coordinator/--num-processes/--process-id (see `scaletui calibrate --processes 2 -h`).",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="same working sets, a shorter timing window (~15 s on 2 cores)",
    )
    p.add_argument(
        "--window",
        type=float,
        metavar="S",
        help=f"seconds to sample the host's spread over (default {WINDOW_S:g}, --quick "
        f"{QUICK_WINDOW_S:g}; more catches more of a shared host's spells)",
    )
    p.add_argument("--out", type=Path, help=f"write here instead of {local_hardware_path()}")
    p.add_argument("--no-write", action="store_true", help="print the spec only")
    args = p.parse_args(argv)

    if args.window is not None and not 0 < args.window < float("inf"):
        p.error(f"--window should be > 0 seconds, got {args.window}")
    path = args.out or local_hardware_path()
    spec = rounded(
        dcn.carry_over(_old_spec(path), calibrate(quick=args.quick, window_s=args.window))
    )
    text = yaml.safe_dump(spec, sort_keys=False)
    if not args.no_write:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        load_hardware(path)  # what we wrote must load
        print(f"calibrate: wrote {path}", file=sys.stderr)
    sys.stdout.write(text)
    return 0
