"""`scaletui calibrate --model M`: the grid it times, and (slow) a real fit of `tiny` that lands
where the TUI and `scaletui simulate` look for it."""

from __future__ import annotations

import time

import pytest

from scaletui import engine_fit
from scaletui.commands import calibrate_engine
from scaletui.engine_fit import DecodePoint, Grid, grid_for, prompt_len_for
from scaletui.roofline import fitstore
from scaletui.shape import ServerShape
from scaletui.specs import load_model


def test_the_default_grid_brackets_the_servers_slots_contexts_and_steps():
    cfg = ServerShape(model=load_model("small"), slots=16, max_seq_len=1024, decode_steps=4)
    grid = grid_for(cfg, (128, 256, 512, 1024), (16, 32, 64, 128, 256, 512, 1024))
    assert sorted({p.batch for p in grid.decode}) == [1, 4, 16]
    assert sorted({p.steps for p in grid.decode}) == [1, 4]
    # three KV buckets at every batch, both step counts ...
    for b in (1, 4):
        assert {(p.context, p.steps) for p in grid.decode if p.batch == b} == {
            (c, s) for c in (128, 512, 1024) for s in (1, 4)}  # fmt: skip
    # ... and at the slots the server decodes at, every bucket it can run, at its decode_steps
    at_slots = {(p.context, p.steps) for p in grid.decode if p.batch == 16}
    assert at_slots == {(c, s) for c in (128, 512, 1024) for s in (1, 4)} | {(256, 4)}
    assert len(grid.decode) == 3 * 3 * 2 + 1
    # the prompts that fill those KV buckets fill 128, 512 and 1024 (one compile serves both),
    # and every prompt bucket below the longest is timed: the server pads prompts to them
    assert grid.prefill == (16, 32, 64, 128, 256, 512, 1024)
    assert (grid.calls, grid.rounds) == (3, 3)
    quick = grid_for(cfg, (128, 256, 512, 1024), (16, 1024), quick=True)
    assert (quick.calls, quick.rounds) == (2, 3)
    # with dp the batches are multiples of dp (every replica holds a share of the slots)
    dp = ServerShape(model=load_model("small"), slots=16, dp=2, decode_steps=1)
    assert sorted({p.batch for p in grid_for(dp, (128,), (16,)).decode}) == [2, 4, 16]
    assert {p.steps for p in grid_for(dp, (128,), (16,)).decode} == {1}


def test_a_prompt_keeps_every_timed_call_inside_its_kv_bucket():
    n = prompt_len_for(512, 256, steps=4, calls=3)
    assert n > 256 and n + 4 * (3 + 1) < 512
    # a bucket too tight for the calls still starts inside it
    assert prompt_len_for(16, 8, steps=4, calls=3) == 9
    with pytest.raises(ValueError, match="empty grid"):
        Grid(())
    assert Grid.product([1, 2], [64], [1, 4]).decode[-1] == DecodePoint(2, 64, 4)


@pytest.mark.slow
def test_calibrate_model_fits_tiny_and_stores_it_where_find_fit_looks(capsys):
    argv = ["--model", "tiny", "--slots", "4", "--max-seq-len", "64", "--decode-steps", "2",
            "--quick"]  # fmt: skip
    from scaletui.serve.engine.build import default_compute_dtype

    assert calibrate_engine.main(argv) == 0
    # without --dtype, the precision `scaletui serve` would start with on this host
    path = fitstore.find_fit("tiny", default_compute_dtype(), 1, 1, "auto")
    assert path is not None
    cost = fitstore.load_fit(path)
    assert cost.source == "fit" and cost.model == "tiny" and cost.kernels in ("xla", "native")
    assert sorted({k[0] for k in cost.decode_knots}) == [1, 4]
    assert cost.info["prefill_samples"] >= 2
    assert cost.info["server"]["slots"] == 4 and cost.info["samples"]["decode"]
    # stored under the fit key of the shape it timed, with the kernels that ran
    shape = ServerShape.from_json(cost.info["server"])
    assert fitstore.fit_path_for({**shape.fit_key(), "kernels": cost.kernels}) == path
    assert cost.decode_call_s(4, 64, 2) > 0
    assert "wrote" in capsys.readouterr().err


def test_calibrate_model_refuses_a_configuration_it_cannot_build(capsys):
    assert calibrate_engine.main(["--model", "tiny", "--max-seq-len", "100000"]) == 2
    assert "max_seq_len" in capsys.readouterr().err
    assert calibrate_engine.main(["--model", "nope"]) == 2


def test_calibrate_model_precision_flags_reach_the_engines_the_base_and_the_file(monkeypatch):
    """The grid is not timed here (a fake `fit_engine`); what the flags set is checked."""
    from types import SimpleNamespace

    from scaletui.dtypes import Precision
    from scaletui.roofline import costfit
    from scaletui.roofline.samples import DecodeSample
    from scaletui.serve.engine import build
    from scaletui.serve.weights import quant

    seen = {}

    def probe(config, devices, host_params=None):
        seen["probe"] = config
        buckets = (16, 32, 64)
        eng = SimpleNamespace(describe=lambda: SimpleNamespace(kernels="xla"),
                              decode_buckets=buckets, prefill_buckets=buckets)  # fmt: skip
        return eng, eng

    def fake_fit(config, devices, base, *, grid, host_params, log):
        seen.update(config=config, base=base, weights=quant.storage_of(host_params))
        decode = [DecodeSample(b, c, 1e-3 * b + 1e-5 * c, 1) for b in (1, 4) for c in (16, 64)]
        return costfit.fit(base, decode, seconds=0.0)

    monkeypatch.setattr(build, "build_engines", probe)
    monkeypatch.setattr(engine_fit, "fit_engine", fake_fit)
    argv = ["--model", "tiny", "--slots", "4", "--max-seq-len", "64", "--decode-steps", "2",
            "--quick", "--dtype", "f32", "--weight-dtype", "int8",
            "--kv-dtype", "bf16"]  # fmt: skip
    assert calibrate_engine.main(argv) == 0
    assert seen["config"].precision == Precision("f32", "int8", "bf16") == seen["probe"].precision
    assert seen["weights"] == "int8"  # converted once, before the engines are built
    base = seen["base"]
    assert (base.dtype, base.weight_dtype, base.kv_dtype) == ("f32", "int8", "bf16")
    path = fitstore.find_fit("tiny", "f32", 1, 1, "auto", weight_dtype="int8", kv_dtype="bf16")
    assert path is not None and "f32-wint8-kvbf16--xla" in path.name
    assert fitstore.load_fit(path).weight_dtype == "int8"
    assert fitstore.find_fit("tiny", "f32", 1, 1, "auto") is None  # f32 weights: not fitted
    with pytest.raises(SystemExit):
        calibrate_engine.build_parser().parse_args(["--model", "tiny", "--weight-dtype", "int4"])


def test_calibrate_model_refuses_weights_wider_than_compute(capsys):
    argv = ["--model", "tiny", "--dtype", "bf16", "--weight-dtype", "f32"]
    assert calibrate_engine.main(argv) == 2
    assert "weight_dtype=f32 is wider than dtype=bf16" in capsys.readouterr().err


@pytest.mark.slow  # builds a JAX engine
def test_the_fit_times_prefill_the_way_the_interleaved_server_runs_it(monkeypatch):
    """Into a slot's pages (`prefill_pages`, what the scheduler calls), not the contiguous
    prefill that only a disaggregated server runs: the two differ by 10-35 % on CPU."""
    import jax

    from scaletui.serve.engine.build import build_engines
    from scaletui.serve.engine.engine_api import SamplingParams

    config = ServerShape(load_model("tiny"), slots=2, max_seq_len=128)
    eng, _ = build_engines(config, jax.devices()[:1])
    calls, paged = [], eng.prefill_pages
    monkeypatch.setattr(eng, "prefill", lambda *a: calls.append("contiguous"))
    monkeypatch.setattr(eng, "prefill_pages", lambda *a: (calls.append("pages"), paged(*a))[1])
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    run = engine_fit._prefill_call(eng, list(range(1, 70)), params)
    run()
    run()  # the state it donated came back: a second call runs too
    assert calls == ["pages", "pages"]


def test_fit_engine_records_the_kernels_auto_resolved_to():
    """The simulator prices a part-filled batch by the kernels the engine ran, so a fit made
    from an `auto` base says which ones `auto` became (here, as the engine's plan says)."""
    import jax

    from scaletui.roofline.costmodel import CostModel
    from scaletui.serve.engine.build import plan_engines
    from scaletui.specs import load_hardware

    model = load_model("tiny")
    config = ServerShape(model, slots=2, max_seq_len=64, decode_steps=2)
    devices = jax.devices()[:1]
    base = CostModel.assumed(model, load_hardware("h200"), dtype="f32", kernels="auto")
    grid = Grid.product([1, 2], [64], [1, 2], prefill=(16, 32), calls=1, rounds=1)
    cost = engine_fit.fit_engine(config, devices, base, grid=grid)
    assert cost.kernels == plan_engines(config, devices)[-1].kernels != "auto"


def test_the_timer_times_short_calls_in_more_blocks_each_after_a_reset():
    """Short calls: blocks of (one untimed + `calls` timed) until they add up to min_s, at most
    8, each after the first behind a reset (decode: the sequences back inside their bucket);
    long calls: one block."""
    from scaletui.engine_fit import _Timer

    timer, done, resets = _Timer(min_s=1.0), [], []
    timer.run("short", lambda: done.append(1), 3, reset=lambda: resets.append(1))
    assert len(timer.times["short"]) == 8 * 3 and len(done) == 8 * 4 and len(resets) == 7
    slow = _Timer(min_s=0.01)
    slow.run("long", lambda: time.sleep(0.006), 2, reset=lambda: resets.append(2))
    assert len(slow.times["long"]) == 2 and resets.count(2) == 0
