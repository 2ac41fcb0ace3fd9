"""bench/tui_first_screen.py's pure parts: the app's command line and the length check that
refuses a load the model cannot hold, before any app starts."""

from __future__ import annotations

from pathlib import Path

from bench_modules import bench_module


def test_app_argv_passes_only_the_flags_given():
    with bench_module("tui_first_screen") as bench:
        args = bench.parse(["--length-spread", "0", "--input-len", "64"])
        argv = bench.app_argv(args, 2, 4, Path("/logs"))
    assert argv[:6] == ["--model", "small", "--tp", "2", "--log-dir", "/logs"]
    assert argv[6:] == ["--host-devices", "4", "--input-len", "64", "--length-spread", "0"]


def test_check_lengths_counts_the_longest_request():
    """tiny holds 256 positions: 100 / 100 fixed (+ BOS) fits, within +-30 % it does not, and
    the app's defaults (128 / 128, +-25 %) do not either."""
    with bench_module("tui_first_screen") as bench:
        fixed = bench.parse(["--model", "tiny", "--input-len", "100", "--output-len", "100",
                             "--length-spread", "0"])  # fmt: skip
        spread = bench.parse(["--model", "tiny", "--input-len", "100", "--output-len", "100",
                              "--length-spread", "0.3"])  # fmt: skip
        assert bench.check_lengths(fixed) is None
        why = bench.check_lengths(spread)
        assert "261 (in 100±30 out 100±30)" in why and "max_seq_len 256" in why
        assert "321" in bench.check_lengths(bench.parse(["--model", "tiny"]))
        assert bench.check_lengths(bench.parse(["--model", "small"])) is None
        bad = bench.check_lengths(bench.parse(["--length-spread", "1.5"]))
        assert "length_spread must be in [0, 1), got 1.5" in bad
