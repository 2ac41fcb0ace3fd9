"""SCALETUI_BENCH_SMOKE=1: every bench on the code path of its default options, shrunk.

Each bench's parser ends with `shrink(parser, model="tiny", ...)`: with the variable set (to
anything but empty or 0), those values become its defaults, so a smoke run takes the same path as a
default run, on the `tiny` model with a short sweep (few batches, few requests, short durations)
and, where a bench starts a server, no warm-up, in seconds. Options given on the command line still
win. Its figures mean nothing; tests/test_bench_smoke.py runs every bench this way and fails on an
exception.
"""

from __future__ import annotations

import argparse
import os

ENV = "SCALETUI_BENCH_SMOKE"
# the help of a bench's --no-warmup, which a smoke run turns on (its figures mean nothing)
NO_WARMUP = "no server warm-up: each shape compiles on its first call, inside the figures"


def on() -> bool:
    """Whether this process runs a smoke run."""
    return os.environ.get(ENV, "") not in ("", "0")


def shrink(parser: argparse.ArgumentParser, **defaults: object) -> argparse.ArgumentParser:
    """`parser`, with `defaults` as its defaults in a smoke run (unknown names are an error)."""
    if on():
        known = {a.dest for a in parser._actions}
        assert set(defaults) <= known, f"{ENV}: no such option: {set(defaults) - known}"
        parser.set_defaults(**defaults)
    return parser
