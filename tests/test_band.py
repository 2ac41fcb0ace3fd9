"""Bands, not points: the spread's percentiles, the speed scenarios a spread makes, a band from a
fixed-step cost model computed by hand, the fit's residual spread, an old calibration without a
spread, and `scaletui simulate`'s `band` keys and table."""

from __future__ import annotations

import numpy as np
import orjson
import pytest
import yaml
from fake_specs import CPU
from test_simulate import fixed, flat, server

from scaletui import roofline as rl
from scaletui.commands.simulate import main as simulate_main
from scaletui.roofline.band import SpeedFactors, SpeedSpread, Spread
from scaletui.roofline.costfit import residual_spread
from scaletui.roofline.simband import simulate_at, simulate_band
from scaletui.roofline.simrecords import SimTiming
from scaletui.specs import load_model

HOST = {  # a host's measured spread: read 8 / 10 / 12.5 GB/s, 50 / 100 / 125 GFLOP/s
    "read_bw": {"p10": 8e9, "p50": 10e9, "p90": 12.5e9, "n": 20},
    "flops_per_s": {"p10": 50e9, "p50": 100e9, "p90": 125e9, "n": 20},
    "dispatch_s": {"p10": 4e-6, "p50": 5e-6, "p90": 10e-6, "n": 20},
    "window_s": 10.0,
}


def test_spread_is_numpys_percentiles_of_the_sample():
    s = Spread.of(range(1, 12))  # 1..11: p10 at 2, p50 at 6, p90 at 10
    assert (s.p10, s.p50, s.p90, s.n) == (2.0, 6.0, 10.0, 11)
    assert s.ratio == 5.0
    assert Spread.from_dict(s.to_dict()) == s
    with pytest.raises(ValueError, match="finite samples"):
        Spread.of([])
    with pytest.raises(ValueError, match="p10, p50, p90"):
        Spread.from_dict({"p10": 1.0})


def test_a_measured_spread_makes_a_fast_and_a_slow_end():
    got = SpeedSpread.measured(HOST, {"decode": {"p10": 0.9, "p50": 1.0, "p90": 1.1}})
    # decode follows the read bandwidth: 10 / 12.5 = 0.8 fast, 10 / 8 = 1.25 slow, times the
    # fit's residual ends; prefill the FLOP/s (no residual given: 1); the host the dispatch floor
    assert (got.fast.decode, got.slow.decode) == pytest.approx((0.8 * 0.9, 1.25 * 1.1))
    assert (got.fast.prefill, got.slow.prefill) == pytest.approx((0.8, 2.0))
    assert (got.fast.host, got.slow.host) == pytest.approx((0.8, 2.0))
    assert got.width and "read_bw -20%..+25%" in got.note and "over 10 s" in got.note
    assert "decode -10%..+10%" in got.note


def test_an_old_calibration_without_a_spread_gives_a_point_and_says_so():
    old = {k: v for k, v in HOST.items() if k == "window_s"}  # no spread keys at all
    for host in (None, {}, old):
        got = SpeedSpread.measured(host, None)
        assert not got.width and got.fast == got.slow == SpeedFactors()
        assert "host spread unknown" in got.note and "fit residuals unknown" in got.note
    with pytest.raises(ValueError, match="p10, p50, p90"):
        SpeedSpread.measured({"read_bw": {"p50": 1.0}})
    with pytest.raises(ValueError, match="speed factor decode should be > 0"):
        SpeedFactors(decode=0.0)


def test_a_fixed_step_model_at_0_8_and_1_25_gives_a_band_by_hand():
    """One slot, a request a second (no queueing): 7 tokens after the first in a call of 4 steps
    and one of 3, so TPOT = (call4 + call3) / 7, and every decode time scales with the factor;
    TTFT is one prefill, scaled by the prefill factor."""
    cost, shape = flat(), server(slots=1, decode_steps=4, max_seq_len=1024)
    load = fixed(5, gap=1.0, inp=100, out=8, requested_rate=1.0)
    spread = SpeedSpread(SpeedFactors(0.8, 0.9), SpeedFactors(1.25, 1.5))
    got = simulate_band(shape, cost, load, spread)
    tpot = (cost.decode_call_s(1, 128, 4) + cost.decode_call_s(1, 128, 3)) / 7 * 1e3
    ttft = cost.prefill_s(128) * 1e3
    assert got.point.summary["median_tpot_ms"] == pytest.approx(tpot)
    assert got.band["median_tpot_ms"] == pytest.approx([0.8 * tpot, 1.25 * tpot])
    assert got.band["p99_ttft_ms"] == pytest.approx([0.9 * ttft, 1.5 * ttft])
    e2el = [ttft * p + 7 * tpot * d for d, p in ((0.8, 0.9), (1.25, 1.5))]
    assert got.band["output_throughput"] == pytest.approx(
        [40 / (4.0 + e2el[1] / 1e3), 40 / (4.0 + e2el[0] / 1e3)]
    )
    assert "requested_rate" not in got.band and got.band["completed"] == [5, 5]
    # no width: no scenario runs, the band is the point
    point = simulate_band(shape, cost, load, SpeedSpread())
    assert point.band["median_tpot_ms"] == pytest.approx([tpot, tpot])


def test_as_run_is_one_call_at_a_measured_speed():
    """`simulate_at` (part 3's "as run"): the host factor doubles the scheduler's gap too."""
    cost, shape, gap = flat(), server(slots=1, decode_steps=4, max_seq_len=1024), 0.9e-3
    load = fixed(1, gap=1.0, inp=100, out=8)
    r = simulate_at(shape, cost, load, SpeedFactors(2.0, 3.0, 2.0), timing=SimTiming(gap_s=gap))
    assert r.t_first[0] == pytest.approx(2 * gap + 3 * cost.prefill_s(128))


def test_a_fit_stores_its_residual_spread_per_step_kind():
    # model / measured - 1 = -0.5, 0, 1: measured / model 2, 1, 0.5 -> p10 0.6, p50 1, p90 1.8
    got = residual_spread({"decode": np.array([-0.5, 0.0, 1.0])})
    assert got == {"decode": pytest.approx({"p10": 0.6, "p50": 1.0, "p90": 1.8, "n": 3})}
    base = rl.CostModel.assumed(load_model("small"), CPU, dtype="f32")
    decode = [rl.DecodeSample(b, c, base.decode_call_s(b, c, 4), steps=4)
              for b in (1, 4, 16) for c in (128, 512)]  # fmt: skip
    prefill = [rl.PrefillSample(t, base.prefill_s(t)) for t in (16, 64, 256)]
    fitted = rl.fit(base, decode, prefill).info["residual_spread"]
    assert set(fitted) == {"decode", "prefill"} and fitted["decode"]["n"] == 6
    for kind in fitted.values():  # exact samples: the model meets every one
        assert kind["p10"] == pytest.approx(1.0) and kind["p90"] == pytest.approx(1.0)


def _spec(tmp_path, spread: dict | None):
    spec = {"name": "box", "kind": "cpu", "flops_per_s": {"bf16": 1e11, "f32": 1e11},
            "hbm_bytes": 16e9, "hbm_bw": 1e10, "ici_bw": 1e10, "ici_bidirectional": False,
            "dcn_bw": 1e10, "chips_per_host": 1}  # fmt: skip
    if spread is not None:
        spec["measured"] = {"spread": spread}
    path = tmp_path / f"box-{spread is not None}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


ARGS = ["--model", "tiny", "--slots", "2", "--concurrency", "2", "--num-requests", "40",
        "--input-len", "16", "--output-len", "16", "--no-fit"]  # fmt: skip


def test_simulate_json_has_a_band_per_figure(tmp_path, capsys):
    assert simulate_main([*ARGS, "--hardware", _spec(tmp_path, HOST), "--json"]) == 0
    s = orjson.loads(capsys.readouterr().out)
    for key in ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "output_throughput"):
        lo, hi = s["band"][key]
        assert lo < s[key] <= hi or lo <= s[key] < hi, key  # the point inside, with width
    lo, hi = s["band"]["median_tpot_ms"]
    # at least the read spread's 1.25 / 0.8: prefills between calls and the host gap (slower
    # too, by the FLOP/s and dispatch spreads) add to it; an assumed model has no residuals
    assert hi / lo > 0.95 * 1.25 / 0.8
    assert s["config"]["speed_spread"]["slow"]["decode"] == pytest.approx(1.25)
    # an old calibration (no spread): a band of zero width, and why
    assert simulate_main([*ARGS, "--hardware", _spec(tmp_path, None), "--json"]) == 0
    s = orjson.loads(capsys.readouterr().out)
    assert s["band"]["median_tpot_ms"] == [s["median_tpot_ms"]] * 2
    assert "host spread unknown" in s["config"]["speed_spread"]["note"]
    assert simulate_main([*ARGS, "--hardware", _spec(tmp_path, None), "--json", "--no-band"]) == 0
    assert "band" not in orjson.loads(capsys.readouterr().out)


def test_simulate_table_shows_the_band_beside_each_figure(tmp_path, capsys):
    assert simulate_main([*ARGS, "--hardware", _spec(tmp_path, HOST)]) == 0
    out = capsys.readouterr().out
    assert "band: p10-p90 [in brackets]" in out and "decode x0.80-x1.25" in out
    line = next(x for x in out.splitlines() if x.startswith("Median TPOT (ms):"))
    assert line.count("[") == 1 and line.rstrip().endswith("]")
    assert simulate_main([*ARGS, "--hardware", _spec(tmp_path, None)]) == 0
    out = capsys.readouterr().out
    assert "no width: host spread unknown" in out
    line = next(x for x in out.splitlines() if x.startswith("Median TPOT (ms):"))
    assert "[" not in line  # a band without width is the point: nothing beside it


def test_simulate_as_run_is_simulate_at_at_those_factors(tmp_path, capsys, monkeypatch):
    """`--as-run decode=2,prefill=1`: one simulation at those factors, its summary printed as
    is, no band; alone on the server (concurrency 1, no host time) TPOT doubles."""
    import scaletui.commands.simulate as cli

    calls = []

    def spy(*args, **kw):
        calls.append((args, kw, simulate_at(*args, **kw)))
        return calls[-1][2]

    monkeypatch.setattr(cli, "simulate_at", spy)
    argv = [*ARGS, "--hardware", _spec(tmp_path, HOST), "--concurrency", "1", "--gap-ms", "0",
            "--gap-per-row-ms", "0", "--intake-ms", "0", "--json"]  # fmt: skip
    assert simulate_main(argv) == 0
    point = orjson.loads(capsys.readouterr().out)
    calls.clear()
    assert simulate_main([*argv, "--as-run", "decode=2, prefill=1"]) == 0
    s = orjson.loads(capsys.readouterr().out)
    ((args, _, got),) = calls  # one simulation: no band's ends
    assert args[3] == SpeedFactors(decode=2.0, prefill=1.0, host=1.0)
    assert "band" not in s and s["config"]["as_run"] == {"decode": 2.0, "prefill": 1.0, "host": 1.0}
    numbers = {k: v for k, v in got.summary.items() if isinstance(v, int | float)}
    assert len(numbers) > 20 and {k: s[k] for k in numbers} == pytest.approx(numbers)
    assert s["median_tpot_ms"] == pytest.approx(2 * point["median_tpot_ms"])
    # a prefill's weight read follows the decode factor (CostModel.scaled): no faster
    assert s["median_ttft_ms"] >= point["median_ttft_ms"]
    assert simulate_main([*argv, "--as-run", "decode=fast"]) == 2
    assert "speed factor decode should be a number" in capsys.readouterr().err


def test_speed_factors_parse_names_what_is_wrong():
    assert SpeedFactors.parse("decode=1.12,prefill=0.95,host=1.0") == SpeedFactors(1.12, 0.95)
    assert SpeedFactors.parse("prefill=2") == SpeedFactors(prefill=2.0)
    with pytest.raises(ValueError, match="decode=F,prefill=F,host=F"):
        SpeedFactors.parse("gpu=2")
    with pytest.raises(ValueError, match="decode should be > 0"):
        SpeedFactors.parse("decode=0")
