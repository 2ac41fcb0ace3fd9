"""The band's horizon: the server's speed factors logged in blocks beside its fit, read back as
a spread (only the fit's engine, only recent blocks, enough of them), the server's block
accounting by hand, and a band that takes the wider of the host's window and the past runs."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
from test_serve_speed import fake_fit

from scaletui.roofline import speedlog
from scaletui.roofline.band import SpeedSpread
from scaletui.serve.scheduling.speed import SpeedWindow

NOW = 1_800_000_000.0
ENGINE = speedlog.engine_id(fake_fit())


def log_factors(path, kind: str, factors: list[float], t0: float = NOW - 3600) -> None:
    for i, f in enumerate(factors):  # one block of 10 calls a minute, each `f` x the fit
        speedlog.append(path, kind, 10 * f, 10.0, 10, ENGINE, now=t0 + 60 * i)


def test_blocks_read_back_as_the_spread_of_their_factors(tmp_path):
    path = tmp_path / "fit.speeds.jsonl"
    log_factors(path, "decode", [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 1.8, 1.9, 2.0])
    log_factors(path, "prefill", [0.9, 1.0, 1.1, 1.2])  # 4 blocks: fewer than MIN_BLOCKS
    got = speedlog.drift_spread(fake_fit(), now=NOW, path=path)
    # numpy's percentiles of 1.0..2.0 in 0.1s: p10 1.1, p50 1.5, p90 1.9; first block 1 h ago
    assert set(got) == {"decode"}
    d = got["decode"]
    assert (d["p10"], d["p50"], d["p90"], d["n"]) == pytest.approx((1.1, 1.5, 1.9, 11))
    assert d["hours"] == pytest.approx(1.0)


def test_other_engines_old_blocks_short_blocks_and_broken_lines_are_not_read(tmp_path):
    path = tmp_path / "fit.speeds.jsonl"
    log_factors(path, "decode", [1.0] * 5, t0=NOW - speedlog.MAX_AGE_S - 3600)  # a week ago
    for i in range(5):  # another engine's blocks
        speedlog.append(path, "decode", 30.0, 10.0, 10, "v1", now=NOW - 60 * i)
    speedlog.append(path, "decode", 30.0, 10.0, speedlog.MIN_BLOCK_CALLS - 1, ENGINE, now=NOW)
    with path.open("ab") as f:
        f.write(b'{"t": 1, "kind": "decode", "fac\n')  # a write cut short
    assert len(speedlog.read_blocks(path)) == 10  # the short block was never written
    assert speedlog.drift_spread(fake_fit(), now=NOW, path=path) == {}
    log_factors(path, "decode", [1.2] * 5)
    assert speedlog.drift_spread(fake_fit(), now=NOW, path=path)["decode"]["p50"] == 1.2


def test_the_horizon_is_every_kept_block_not_the_last_hour(tmp_path):
    """100 blocks over 100 minutes: the older 50 ran 2x the fit, the last 50 at it. The spread
    holds both (a host that swung an hour ago may swing again): p10 1.0, p90 2.0."""
    path = tmp_path / "fit.speeds.jsonl"
    log_factors(path, "decode", [2.0] * 50 + [1.0] * 50, t0=NOW - 6000)
    d = speedlog.drift_spread(fake_fit(), now=NOW, path=path)["decode"]
    assert (d["p10"], d["p90"], d["n"]) == pytest.approx((1.0, 2.0, 100))


def test_the_log_is_trimmed_to_its_last_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(speedlog, "KEEP", 10)
    path = tmp_path / "fit.speeds.jsonl"
    log_factors(path, "decode", [1 + i / 100 for i in range(25)])
    blocks = speedlog.read_blocks(path)
    assert 10 <= len(blocks) <= 20 and blocks[-1]["factor"] == pytest.approx(1.24)


def test_the_log_lives_beside_the_stored_fit_of_the_configuration():
    fit = fake_fit()
    assert speedlog.log_path(fit).name.endswith("--tiny--f32--xla--tp1-dp1.speeds.jsonl")
    assert speedlog.log_path(replace(fit, info={"note": "another fit"})) == speedlog.log_path(fit)


def test_the_window_closes_a_block_once_it_spans_block_s(tmp_path):
    window, path = SpeedWindow(block_s=10.0), tmp_path / "log.jsonl"
    window.add("decode", 1.0, 0.5, now=100.0)  # not logged: no log yet
    window.reset(path, ENGINE)
    for i in range(10):  # calls of 1 s (fit: 0.8 s) ending at 101..110: the block spans 10 s
        window.add("decode", 1.0, 0.8, now=101.0 + i)
    window.add("decode", 2.0, 0.8, now=113.0)  # opens the next block
    (block,) = speedlog.read_blocks(path)
    assert block["calls"] == 10 and block["factor"] == pytest.approx(1.25)
    assert block["t"] == 110.0 and block["engine"] == ENGINE
    window.reset(None)
    for i in range(20):
        window.add("decode", 1.0, 0.8, now=200.0 + i)
    assert len(speedlog.read_blocks(path)) == 1  # no log: nothing more written


def test_an_unwritable_log_is_reported_once_and_the_server_goes_on(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(speedlog, "MIN_BLOCK_CALLS", 1)
    blocked = tmp_path / "file"
    blocked.write_text("")
    window = SpeedWindow(block_s=0.0)  # every call closes its block
    window.reset(blocked / "log.jsonl", ENGINE)  # its parent is a file: mkdir fails
    with caplog.at_level(logging.WARNING):
        for i in range(4):
            assert window.add("decode", 1.0, 0.5, now=1.0 + i) == 2.0
    assert sum("not written" in r.message for r in caplog.records) == 1


def test_a_band_takes_the_wider_of_the_host_window_and_the_past_runs():
    host = {  # read 9.5 / 10 / 10.5 GB/s: a quiet window, time factors 0.952..1.053
        "read_bw": {"p10": 9.5e9, "p50": 10e9, "p90": 10.5e9, "n": 20},
        "flops_per_s": {"p10": 95e9, "p50": 100e9, "p90": 105e9, "n": 20},
    }
    past = {  # the server ran 1.05-1.30x its fit in past runs (decode), prefill not logged
        "decode": {"p10": 1.05, "p50": 1.15, "p90": 1.30, "n": 12, "hours": 2.5},
    }
    got = SpeedSpread.measured(host, None, past)
    assert (got.fast.decode, got.slow.decode) == pytest.approx((10 / 10.5, 1.30))
    assert (got.fast.prefill, got.slow.prefill) == pytest.approx((10 / 10.5, 10 / 9.5))
    assert "past runs against the fit p10-p90: decode +5%..+30% (12 blocks) over 2.5 h" in got.note
    wide = {"decode": {"p10": 0.7, "p50": 1.0, "p90": 1.02, "n": 12}}  # faster than the window
    got = SpeedSpread.measured(host, None, wide)
    assert (got.fast.decode, got.slow.decode) == pytest.approx((0.7, 10 / 9.5))
    assert "no past runs logged" in SpeedSpread.measured(host, None, {}).note


def test_spread_of_reads_the_log_for_a_fit_and_not_for_assumed_costs(monkeypatch):
    fit = fake_fit()
    log_factors(speedlog.log_path(fit), "decode", [1.1, 1.2, 1.3, 1.4, 1.5], t0=NOW - 600)
    monkeypatch.setattr(speedlog.time, "time", lambda: NOW)
    got = speedlog.spread_of(None, fit)
    assert got.slow.decode == pytest.approx(1.46) and "decode +14%..+46% (5 blocks)" in got.note
    assumed = speedlog.spread_of(None, replace(fit, source="assumed"))
    assert not assumed.width and "no past runs logged yet" in assumed.note
