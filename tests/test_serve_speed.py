"""The server's speed against its engine fit: the FakeEngine sleeps fixed times per call, so a
fit of known coefficients gives a known factor in /metrics and /stats; without a fit, /stats
says why and no predicted counter is exported."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from scaletui.roofline import speedlog
from scaletui.roofline.costmodel import CostModel
from scaletui.roofline.fitstore import load_fit, save_fit
from scaletui.serve.http.testing import fake_server
from scaletui.serve.scheduling.speed import find_speed_model
from scaletui.shape import ServerShape
from scaletui.specs import load_model

# the FakeEngine's sleep per decode step and per whole prompt: long enough that a loaded
# host's oversleep (a few ms a call) stays a few percent of the factors below
STEP_S = 0.03


def fake_fit(model: str = "tiny", spread: tuple = ()) -> CostModel:
    """A fit with no byte or FLOP term: a decode step of STEP_S / 2 (the FakeEngine runs 2x
    slower than it), a prefill call of 2 x STEP_S (the FakeEngine runs 2x faster)."""
    return CostModel(
        model=model, hardware="local", dtype="f32", tp=1, dp=1,
        weight_bytes=0.0, kv_bytes_per_token=0.0, flops_per_token=0.0, attn_flops_per_pair=0.0,
        step_overhead_s=STEP_S / 2, sync_s=0.0, read_bw=1e9, decode_flops_per_s=1e9,
        prefill_overhead_s=2 * STEP_S, prefill_flops_per_s=1e9, transfer_bw=1e9,
        kernels="xla", source="fit", call_spread=spread,
    )  # fmt: skip


def samples(text: str, name: str) -> dict[str, float]:
    """{kind: value} of the Prometheus samples `name{kind="..."}`."""
    pattern = re.escape(name) + r'\{kind="(\w+)"\} (\S+)'
    return {k: float(v) for k, v in re.findall(pattern, text)}


async def run_two(client) -> None:
    """Two requests one after the other: each a prefill and two 4-step generate calls."""
    for prompt in ([97, 98, 99], [100, 101]):
        r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 9})
        assert r.status == 200, await r.text()


@pytest.mark.parametrize("mode", ["interleaved", "disaggregated"])
async def test_a_stored_fit_prices_every_call_and_the_factor_is_measured_over_predicted(mode):
    path = save_fit(fake_fit())  # where `auto` finds it: this host, tiny f32 tp1 dp1
    async with fake_server(step_s=STEP_S, decode_steps=4, mode=mode) as (client, _):
        await run_two(client)
        stats = (await (await client.get("/stats")).json())["speed"]
        metrics = await (await client.get("/metrics")).text()
    assert stats["fit"] == str(path) and stats["reason"] is None
    predicted = samples(metrics, "scaletui:step_predicted_seconds_total")
    measured = samples(metrics, "scaletui:step_seconds_total")
    # by hand: 2 requests x 2 calls x 4 steps x STEP_S / 2, and 2 prompts x 2 STEP_S
    assert predicted == pytest.approx({"decode": 8 * STEP_S, "prefill": 4 * STEP_S})
    decode, prefill = stats["decode"], stats["prefill"]
    assert (decode["calls"], prefill["calls"]) == (4, 2)
    assert 1.9 < decode["factor"] < 2.4  # the engine sleeps 2x what the fit says
    assert 0.45 < prefill["factor"] < 0.65  # and half
    for kind in ("decode", "prefill"):  # the counters' ratio is the factor (< 256 calls)
        assert measured[kind] / predicted[kind] == pytest.approx(stats[kind]["factor"])
    gauge = samples(metrics, "scaletui:speed_factor")
    assert gauge == pytest.approx({k: stats[k]["factor"] for k in ("decode", "prefill")})


async def test_the_prediction_is_what_the_simulator_charges_on_average():
    # a fitted call spread of mean 1.25: the simulator charges each call 1.25x its median
    save_fit(fake_fit(spread=(0.5, 1.0, 1.5, 2.0)))
    async with fake_server(step_s=STEP_S, decode_steps=4) as (client, _):
        await run_two(client)
        metrics = await (await client.get("/metrics")).text()
    predicted = samples(metrics, "scaletui:step_predicted_seconds_total")
    assert predicted == pytest.approx({"decode": 1.25 * 8 * STEP_S, "prefill": 1.25 * 4 * STEP_S})


async def test_without_a_fit_stats_says_why_and_no_predicted_counter_is_exported():
    async with fake_server(step_s=0.001) as (client, _):
        await run_two(client)
        stats = (await (await client.get("/stats")).json())["speed"]
        metrics = await (await client.get("/metrics")).text()
    assert stats["fit"] is None and "no stored fit for tiny f32" in stats["reason"]
    assert "decode" not in stats and "prefill" not in stats
    assert set(samples(metrics, "scaletui:step_seconds_total")) == {"decode", "prefill"}
    assert samples(metrics, "scaletui:step_predicted_seconds_total") == {}
    assert samples(metrics, "scaletui:speed_factor") == {}
    async with fake_server(step_s=0.001, fit="none") as (client, _):
        stats = (await (await client.get("/stats")).json())["speed"]
    assert stats["reason"] == "--fit none"


async def test_a_fit_stored_while_serving_is_found_by_the_next_stats_poll():
    """The TUI fits the server it started, after the server started: /stats (which it polls)
    looks again for a fit, at most every 5 s, and the calls after it are priced."""
    async with fake_server(step_s=0.001) as (client, sched):
        assert (await (await client.get("/stats")).json())["speed"]["fit"] is None
        path = save_fit(fake_fit())
        sched.relook_fit(every_s=0.0)  # the 5 s since the last look, passed
        stats = (await (await client.get("/stats")).json())["speed"]
        assert stats["fit"] == str(path) and stats["reason"] is None
        await run_two(client)
        metrics = await (await client.get("/metrics")).text()
    predicted = samples(metrics, "scaletui:step_predicted_seconds_total")
    assert predicted == pytest.approx({"decode": 8 * STEP_S, "prefill": 4 * STEP_S})  # as above


def test_a_fit_file_of_another_shape_is_refused_naming_both(tmp_path):
    path = save_fit(fake_fit("small"), tmp_path / "small.yaml")
    with pytest.raises(ValueError, match="is for small .* not this server's tiny"):
        find_speed_model(ServerShape(load_model("tiny"), max_seq_len=128), str(path))


async def test_the_server_logs_its_factor_in_blocks_and_a_band_reads_them_back(monkeypatch):
    """Every BLOCK_S of calls the server appends the block's factor to the fit's speed log;
    `drift_spread` reads the blocks of the fit's engine back (here each block holds a call or
    two: the FakeEngine's 2x decode and 0.5x prefill factors, as /stats shows them)."""
    monkeypatch.setattr(speedlog, "BLOCK_S", 1e-3)
    monkeypatch.setattr(speedlog, "MIN_BLOCK_CALLS", 1)
    monkeypatch.setattr(speedlog, "MIN_BLOCKS", 2)
    fit = load_fit(save_fit(fake_fit()))  # as stored: with the engine that made it
    async with fake_server(step_s=STEP_S, decode_steps=4) as (client, _):
        await run_two(client)
    blocks = speedlog.read_blocks(speedlog.log_path(fit))
    assert {b["kind"] for b in blocks} == {"decode", "prefill"}
    assert sum(b["calls"] for b in blocks if b["kind"] == "decode") == 4  # a call a block
    got = speedlog.drift_spread(fit)
    # a block of one call carries its oversleep whole, where /stats sums it over the window
    assert 1.9 < got["decode"]["p50"] < 2.8 and 0.45 < got["prefill"]["p50"] < 0.75
    other = replace(fit, info={"fit_version": 1})  # a fit of another engine: not read
    assert speedlog.drift_spread(other) == {}
