"""The speeds a run met, replayed (roofline/speedtrace.py): a loadgen stage's speed timeline
merged into spells by hand, the simulator pricing each call at its moment's speed, and
`scaletui simulate --as-run-from` reading a result file."""

from __future__ import annotations

import orjson
import pytest
from test_band import ARGS, HOST, _spec
from test_simulate import fixed, flat, server

from scaletui.commands.simulate import main as simulate_main
from scaletui.roofline.band import SpeedFactors
from scaletui.roofline.simband import median_of, simulate_at
from scaletui.roofline.simrecords import SimTiming
from scaletui.roofline.speedtrace import SpeedTrace, of_result, read_result


def row(t: float, **kinds: tuple[float, float]) -> dict:
    """A timeline row: per kind (factor, predicted seconds)."""
    return {
        "t_s": t,
        "factor": {k: f for k, (f, _) in kinds.items()},
        "predicted_s": {k: p for k, (_, p) in kinds.items()},
    }


TIMELINE = [
    row(1.0, decode=(1.0, 0.2), prefill=(2.0, 0.1)),
    row(2.0, decode=(1.2, 0.2)),
    row(3.0, decode=(1.4, 0.2)),
    row(4.0, decode=(1.1, 0.6), prefill=(1.0, 0.3)),
    row(5.0, decode=(2.0, 0.1)),
]


def test_intervals_merge_into_spells_of_half_a_second_of_calls():
    """decode: rows 1-3 make 0.6 s predicted, spent 0.2 + 0.24 + 0.28 = 0.72 (x1.2); row 4
    alone 0.6 s at 1.1; row 5's 0.1 s (x2) is a short tail and joins row 4's spell:
    (0.66 + 0.2) / 0.7. Prefill's 0.4 s never reaches 0.5: no spell, the mean throughout.
    Each spell over the stage's mean 1.1."""
    trace = SpeedTrace.of_timeline(TIMELINE, {"decode": 1.1, "prefill": 1.2})
    assert trace.ends == {"decode": [3.0, 5.0]}
    assert trace.relative["decode"] == pytest.approx([1.2 / 1.1, 0.86 / 0.7 / 1.1])
    assert trace.at("decode", 0.0) == trace.at("decode", 3.0) == pytest.approx(1.2 / 1.1)
    assert trace.at("decode", 3.5) == trace.at("decode", 99.0) == pytest.approx(0.86 / 0.77)
    assert trace.at("prefill", 1.0) == 1.0 and trace.segments == 2
    low = SpeedTrace.of_timeline(TIMELINE, {"decode": 1.0, "prefill": 1.0}, min_predicted_s=0.1)
    assert low.ends["prefill"] == [1.0, 4.0] and low.relative["prefill"] == [2.0, 1.0]


def test_a_timeline_row_that_is_not_one_is_named():
    with pytest.raises(ValueError, match="row 1 should be"):
        SpeedTrace.of_timeline([row(1.0, decode=(1.0, 1.0)), {"t": 2}], {"decode": 1.0})
    with pytest.raises(ValueError, match="row 1: t_s 0.5 before row 0's"):
        SpeedTrace.of_timeline([row(1.0, decode=(1.0, 1.0)), row(0.5)], {"decode": 1.0})
    with pytest.raises(ValueError, match="seconds >= 0"):
        SpeedTrace.of_timeline([row(1.0, decode=(-1.0, 1.0))], {"decode": 1.0})


def test_a_call_torn_across_two_scrapes_is_merged_whole():
    """The server counts a call's seconds, then its prediction: a scrape between the two puts
    0.3 s spent and nothing predicted in one interval and the 0.25 s predicted with nothing
    spent in the next. Merged, the spell is 0.3 + 0.6 spent over 0.25 + 0.5 predicted."""
    rows = [{"t_s": 1.0, "seconds_s": {"decode": 0.3}, "predicted_s": {"decode": 0.0}},
            {"t_s": 2.0, "seconds_s": {"decode": 0.0}, "predicted_s": {"decode": 0.25}},
            {"t_s": 3.0, "seconds_s": {"decode": 0.6}, "predicted_s": {"decode": 0.5}}]  # fmt: skip
    trace = SpeedTrace.of_timeline(rows, {"decode": 1.0})
    assert trace.ends == {"decode": [3.0]} and trace.relative["decode"] == pytest.approx([1.2])


def test_each_call_runs_at_its_moments_speed():
    """One slot, requests at 0 s and 5 s (no queueing), no host time: decode x1 until 2.5 s and
    x3 after, prefill x2 throughout. The first request decodes at the fit's speed, the second at
    3x; both prefills take 2x. A trace that never moves is the mean's simulation exactly."""
    cost, shape = flat(), server(slots=1, decode_steps=4, max_seq_len=1024)
    load = fixed(2, gap=5.0, inp=100, out=8)
    base = simulate_at(shape, cost, load, SpeedFactors(), timing=SimTiming())
    trace = SpeedTrace({"decode": [2.5, 9.0], "prefill": [9.0]},
                       {"decode": [1.0, 3.0], "prefill": [2.0]})  # fmt: skip
    got = simulate_at(shape, cost, load, SpeedFactors(), timing=SimTiming(), trace=trace)
    ttft = lambda r: r.t_first - r.t_send  # noqa: E731
    decode = lambda r: r.t_last - r.t_first  # noqa: E731
    assert ttft(got) == pytest.approx(2 * ttft(base))
    assert decode(got) == pytest.approx(decode(base) * [1.0, 3.0])
    still = SpeedTrace({"decode": [1.0]}, {"decode": [1.0]})
    mean = SpeedFactors(1.3, 0.9)
    a = simulate_at(shape, cost, load, mean, timing=SimTiming(gap_s=1e-3), seed=3)
    b = simulate_at(shape, cost, load, mean, timing=SimTiming(gap_s=1e-3), seed=3, trace=still)
    assert a.summary == b.summary


def test_a_results_speeds_are_read_from_one_stage(tmp_path):
    stage = {"server_metrics": {"speed_factor": {"decode": 1.1, "prefill": 1.2},
                                "speed_timeline": TIMELINE}}  # fmt: skip
    mean, trace = of_result(stage)
    assert mean == {"decode": 1.1, "prefill": 1.2} and trace.ends == {"decode": [3.0, 5.0]}
    other = {"server_metrics": {"speed_factor": {"decode": 0.9}}}  # no timeline: no trace
    path = tmp_path / "sweep.json"
    path.write_bytes(orjson.dumps({"stages": [stage, other]}))
    assert read_result(f"{path}:1") == ({"decode": 0.9}, None)
    with pytest.raises(ValueError, match="has 2 stages: name one"):
        read_result(str(path), "--as-run-from")
    with pytest.raises(ValueError, match="stages 0..1, got stage 2"):
        read_result(f"{path}:2")
    with pytest.raises(ValueError, match="no server_metrics.speed_factor"):
        of_result({"server_metrics": None}, name="r.json")
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        read_result(str(path))


def test_simulate_as_run_from_a_loadgen_result(tmp_path, capsys):
    """`--as-run-from r.json`: the stage's mean factors as --as-run gives them, the trace in the
    JSON's config and the printed line; both flags at once, or a result without factors, are
    errors that name the flag."""
    argv = [*ARGS, "--hardware", _spec(tmp_path, HOST), "--concurrency", "1", "--gap-ms", "0",
            "--gap-per-row-ms", "0", "--intake-ms", "0"]  # fmt: skip
    result = tmp_path / "r.json"
    result.write_bytes(orjson.dumps({"server_metrics": {
        "speed_factor": {"decode": 1.1, "prefill": 1.2}, "speed_timeline": TIMELINE}}))  # fmt: skip
    assert simulate_main([*argv, "--as-run-from", str(result), "--json"]) == 0
    s = orjson.loads(capsys.readouterr().out)
    assert s["config"]["as_run"] == {"decode": 1.1, "prefill": 1.2, "host": 1.0}
    assert s["config"]["as_run_trace"]["decode"]["ends_s"] == [3.0, 5.0] and "band" not in s
    assert simulate_main([*argv, "--as-run", "decode=1.1,prefill=1.2", "--json"]) == 0
    flat_run = orjson.loads(capsys.readouterr().out)
    assert flat_run["config"]["as_run_trace"] is None
    assert s["median_tpot_ms"] != flat_run["median_tpot_ms"]  # the trace moved the calls
    assert simulate_main([*argv, "--as-run-from", str(result)]) == 0
    assert "moving in time as the run's: decode x1.09-x1.12 over 2 spells" in (
        capsys.readouterr().out
    )
    assert simulate_main([*argv, "--as-run-from", str(result), "--as-run", "decode=2"]) == 2
    assert "give one" in capsys.readouterr().err
    result.write_bytes(orjson.dumps({"server_metrics": {"queue_time_ms": {}}}))
    assert simulate_main([*argv, "--as-run-from", str(result)]) == 2
    assert f"--as-run-from {result} has no server_metrics.speed_factor" in capsys.readouterr().err


def test_a_figure_over_several_draws_is_their_median():
    """Three draws of a model whose calls vary x0.5..x2: each figure is the median of the three
    draws' own (seeds 4, 5, 6), the per-request times the first draw's; a model without
    call_spread draws nothing, so one draw or five give the same."""
    from dataclasses import replace

    cost, shape = replace(flat(), call_spread=(0.5, 1.0, 2.0)), server(slots=2, max_seq_len=1024)
    load = fixed(12, gap=0.01, inp=100, out=8)
    one = [simulate_at(shape, cost, load, SpeedFactors(), seed=k) for k in (4, 5, 6)]
    got = simulate_at(shape, cost, load, SpeedFactors(), seed=4, draws=3)
    for key in ("median_ttft_ms", "p99_tpot_ms", "output_throughput"):
        assert got.summary[key] == sorted(r.summary[key] for r in one)[1]
    assert len({r.summary["median_ttft_ms"] for r in one}) == 3  # the draws do differ
    assert (got.t_first == one[0].t_first).all()
    plain = simulate_at(shape, flat(), load, SpeedFactors(), seed=4, draws=5)
    assert plain.summary == simulate_at(shape, flat(), load, SpeedFactors(), seed=4).summary
    assert median_of([{"a": 1, "b": None, "c": True}, {"a": 3, "b": 2}, {"a": 2, "b": 4}]) == {
        "a": 2, "b": 3.0}  # fmt: skip


def test_simulate_draws_flag(tmp_path, capsys):
    argv = [*ARGS, "--hardware", _spec(tmp_path, HOST), "--json"]
    assert simulate_main([*argv, "--draws", "3"]) == 0
    assert orjson.loads(capsys.readouterr().out)["config"]["draws"] == 3
    with pytest.raises(SystemExit):
        simulate_main([*argv, "--draws", "0"])
    assert "whole number of draws 1..99, got '0'" in capsys.readouterr().err
