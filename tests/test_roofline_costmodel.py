"""The expectation: a fit of timed calls recovers the overhead and rates that produced them, the
assumed model is the floor's bytes and FLOPs over the spec's roofs, fits round-trip through the
user config dir, and virtual CPU devices share one host's roofs."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import yaml
from fake_specs import CPU

from scaletui import roofline as rl
from scaletui.roofline import fitstore
from scaletui.specs import load_hardware, load_model

TRUE = {  # a machine: 1.5 ms per step, 2 ms per host sync, 20 GB/s, 100 / 60 GFLOP/s
    "step_overhead_s": 1.5e-3,
    "sync_s": 2e-3,
    "read_bw": 2e10,
    "decode_flops_per_s": 1e11,
    "prefill_overhead_s": 3e-3,
    "prefill_flops_per_s": 6e10,
}


def _base(tp: int = 1, dp: int = 1) -> rl.CostModel:
    return rl.CostModel.assumed(load_model("small"), CPU, dtype="f32", tp=tp, dp=dp)


def _samples(noise: float, steps=(1, 4, 8), seed: int = 0):
    truth = dataclasses.replace(_base(), **TRUE)
    rng = np.random.default_rng(seed)
    jitter = lambda: 1 + noise * rng.standard_normal()  # noqa: E731
    decode = [
        rl.DecodeSample(b, c, truth.decode_call_s(b, c, k) * jitter(), steps=k)
        for b in (1, 2, 4, 8, 16, 32)
        for c in (128, 512, 1536)
        for k in steps
    ]
    prompts = (16, 32, 64, 128, 256, 512, 1024) * 2
    prefill = [rl.PrefillSample(t, truth.prefill_s(t) * jitter()) for t in prompts]
    return truth, decode, prefill


def test_fit_recovers_known_coefficients_from_noisy_steps():
    truth, decode, prefill = _samples(noise=0.02)
    got = rl.fit(_base(), decode, prefill, host="test")
    assert got.source == "fit" and got.info["host"] == "test"
    for key in ("read_bw", "decode_flops_per_s", "sync_s", "prefill_flops_per_s"):
        assert getattr(got, key) == pytest.approx(TRUE[key], rel=0.15), key
    assert got.step_overhead_s == pytest.approx(TRUE["step_overhead_s"], abs=4e-4)
    assert got.prefill_overhead_s == pytest.approx(TRUE["prefill_overhead_s"], abs=1.5e-3)
    assert got.info["decode_rms_rel_error"] < 0.04
    # and it predicts a point it never saw
    assert got.decode_call_s(12, 1024, 4) == pytest.approx(
        truth.decode_call_s(12, 1024, 4), rel=0.05
    )
    assert got.prefill_s(512) == pytest.approx(truth.prefill_s(512), rel=0.05)


def test_fit_is_exact_without_noise_and_folds_the_sync_into_steps_when_steps_never_vary():
    truth, decode, prefill = _samples(noise=0.0, steps=(4,))
    got = rl.fit(_base(), decode, prefill, knots=False)  # the physical form alone
    assert got.sync_s == 0  # not separable from the per-step overhead with one `steps`
    assert got.step_overhead_s == pytest.approx(TRUE["step_overhead_s"] + TRUE["sync_s"] / 4)
    assert got.read_bw == pytest.approx(TRUE["read_bw"], rel=1e-6)
    for b, c in ((3, 200), (32, 1536)):
        assert got.decode_call_s(b, c, 4) == pytest.approx(truth.decode_call_s(b, c, 4), rel=1e-6)


def test_fit_keeps_coefficients_non_negative_and_refuses_bad_input():
    truth = _base()
    # a machine with no per-step overhead at all: the term is dropped, not fitted negative
    decode = [rl.DecodeSample(b, c, truth.decode_step_s(b, c)) for b in (1, 8) for c in (64, 1024)]
    got = rl.fit(truth, decode)
    assert got.step_overhead_s >= 0 and got.sync_s >= 0
    assert got.read_bw == pytest.approx(CPU.hbm_bw, rel=1e-6)
    assert "prefill not fitted" in got.info["notes"][0]
    with pytest.raises(ValueError, match=">= 3"):
        rl.fit(truth, decode[:2])
    with pytest.raises(ValueError, match="> 0"):
        rl.fit(truth, [*decode, rl.DecodeSample(1, 64, 0.0)])


def test_assumed_is_the_floors_bytes_and_flops_over_the_roofs():
    model, hw = load_model("llama3-8b"), load_hardware("h200")
    e = rl.estimate(model, hw, batch=16, context=2048, chips=2, tp=2)
    cost = rl.CostModel.assumed(model, hw, dtype="bf16", tp=2)
    assert cost.decode_bytes(16, 2048) / hw.hbm_bw == pytest.approx(
        e.decode_weight_s + e.decode_kv_s
    )
    assert cost.prefill_flops(1024) == pytest.approx(e.prefill_flops / 2, rel=1e-9)  # per device
    half = rl.CostModel.assumed(model, hw, efficiency=0.5)
    assert half.decode_step_s(1, 128) == pytest.approx(2 * rl.CostModel.assumed(
        model, hw).decode_step_s(1, 128))  # fmt: skip
    with pytest.raises(ValueError, match="efficienc"):
        rl.CostModel.assumed(model, hw, efficiency=1.5)


def test_virtual_cpu_devices_share_the_hosts_roofs():
    shared = rl.share_host(CPU, 4)
    assert shared.hbm_bw == CPU.hbm_bw / 4 and shared.flops("f32") == CPU.flops("f32") / 4
    assert shared.hbm_bytes == CPU.hbm_bytes / 4
    h200 = load_hardware("h200")
    assert rl.share_host(h200, 8) is h200  # real chips each have their own
    # tp 2 on one CPU host is no faster than tp 1; on two GPUs the weight read halves
    one, two = _base(tp=1), _base(tp=2)
    assert two.decode_step_s(8, 512) == pytest.approx(one.decode_step_s(8, 512))
    model = load_model("small")
    g1 = rl.CostModel.assumed(model, h200, tp=1)
    g2 = rl.CostModel.assumed(model, h200, tp=2)
    assert g2.decode_step_s(8, 512) == pytest.approx(g1.decode_step_s(8, 512) / 2)
    # disaggregated prefill devices on the same host take their share too
    assert rl.CostModel.assumed(model, CPU, dtype="f32", host_devices=2).read_bw == CPU.hbm_bw / 2


def test_fits_are_stored_per_host_model_dtype_kernels_and_mesh(private_config):
    _, decode, prefill = _samples(noise=0.0)
    got = dataclasses.replace(rl.fit(_base(tp=2), decode, prefill), kernels="native")
    path = fitstore.save_fit(got, host="box")
    assert path == fitstore.fit_path("small", "f32", "native", 2, 1, host="box")
    assert path.parent == private_config / "scaletui" / "hardware" / "fits"
    assert "box" in path.name and "tp2-dp1" in path.name
    back = fitstore.load_fit(path)
    stamped = {"fit_version": fitstore.FIT_VERSION, "versions": fitstore.engine_versions(),
               "kernels_source": fitstore.kernels_source(), **got.info}  # fmt: skip
    # (what save_fit adds)
    assert back == dataclasses.replace(got, info=stamped) and back.info == stamped
    assert fitstore.find_fit("small", "f32", 2, 1, "auto", host="box") == path
    assert fitstore.find_fit("small", "f32", 2, 1, "xla", host="box") is None
    assert fitstore.find_fit("small", "f32", 1, 1, host="box") is None
    path.write_text("just: words\n")
    with pytest.raises(ValueError, match="missing"):
        fitstore.load_fit(path)


def test_a_fit_older_than_fit_version_is_not_found(private_config):
    """A fit of an older engine (or from before versions) is made again, not trusted; an older
    file of other kernels does not hide a current one under kernels auto."""
    _, decode, prefill = _samples(noise=0.0)
    got = dataclasses.replace(rl.fit(_base(), decode, prefill), kernels="native")
    path = fitstore.save_fit(got, host="box")
    find = lambda kernels: fitstore.find_fit("small", "f32", 1, 1, kernels, host="box")  # noqa: E731
    assert fitstore.fit_version(path) == fitstore.FIT_VERSION and find("native") == path
    old = fitstore.save_fit(dataclasses.replace(got, kernels="xla", info={**got.info,
                            "fit_version": fitstore.FIT_VERSION - 1}), host="box")  # fmt: skip
    assert old.stat().st_mtime >= path.stat().st_mtime  # the newest file, yet stale
    assert find("xla") is None and find("auto") == path
    data = yaml.safe_load(path.read_text())
    del data["info"]["fit_version"]  # as fits were written before versions
    path.write_text(yaml.safe_dump(data))
    assert fitstore.fit_version(path) == 0 and find("native") is None and find("auto") is None
    assert fitstore.stale(path).startswith("fit version 0, now ")


def test_a_fit_made_under_another_jax_is_not_found(private_config):
    """save_fit records jax and jaxlib as installed; find_fit passes over a fit whose recorded
    versions differ from those installed, and takes one that records none (it cannot tell)."""
    _, decode, prefill = _samples(noise=0.0)
    got = dataclasses.replace(rl.fit(_base(), decode, prefill), kernels="xla")
    path = fitstore.save_fit(got, host="box")
    versions = fitstore.engine_versions()
    assert versions["jax"] and fitstore.load_fit(path).info["versions"] == versions
    find = lambda: fitstore.find_fit("small", "f32", 1, 1, "xla", host="box")  # noqa: E731
    assert find() == path and fitstore.stale(path) is None
    data = yaml.safe_load(path.read_text())
    data["info"]["versions"]["jax"] = "0.0.1"
    path.write_text(yaml.safe_dump(data))
    assert fitstore.stale(path) == f"made under jax 0.0.1, now {versions['jax']}" and find() is None
    assert fitstore.stored_fits("small", "f32", 1, 1, "xla", host="box") == [
        (path, f"made under jax 0.0.1, now {versions['jax']}")
    ]
    del data["info"]["versions"]
    path.write_text(yaml.safe_dump(data))
    assert fitstore.stale(path) is None and find() == path
    # a loaded fit saved again keeps the versions it was made under
    data["info"]["versions"] = {"jax": "0.0.1"}
    path.write_text(yaml.safe_dump(data))
    again = fitstore.save_fit(fitstore.load_fit(path), private_config / "again.yaml")
    assert fitstore.load_fit(again).info["versions"] == {"jax": "0.0.1"}


def test_a_native_fit_is_stale_once_the_kernels_source_changes(private_config):
    """save_fit records a hash of kernels.cc on a fit of the native kernels (not on an XLA fit);
    find_fit passes over the native fit once the recorded hash is not the installed source's."""
    _, decode, prefill = _samples(noise=0.0)
    got = rl.fit(_base(), decode, prefill)
    native = fitstore.save_fit(dataclasses.replace(got, kernels="native"), host="box")
    xla = fitstore.save_fit(dataclasses.replace(got, kernels="xla"), host="box")
    now = fitstore.kernels_source()
    assert now and len(now) == 16
    assert fitstore.load_fit(native).info["kernels_source"] == now
    assert "kernels_source" not in fitstore.load_fit(xla).info
    find = lambda: fitstore.find_fit("small", "f32", 1, 1, "native", host="box")  # noqa: E731
    assert find() == native and fitstore.stale(native) is None
    data = yaml.safe_load(native.read_text())
    data["info"]["kernels_source"] = "0" * 16
    native.write_text(yaml.safe_dump(data))
    assert fitstore.stale(native) == (
        f"made with native kernels source {'0' * 16}, now {now} (kernels.cc changed since)"
    )
    assert find() is None
    assert fitstore.find_fit("small", "f32", 1, 1, "auto", host="box") == xla


def test_roofline_cli_prints_the_expectation_beside_the_floor(tmp_path, capsys):
    from scaletui.commands.roofline import main

    cost = rl.CostModel.assumed(load_model("small"), load_hardware("h200"), efficiency=0.5)
    path = fitstore.save_fit(cost, tmp_path / "fit.yaml")
    argv = ["--model", "small", "--hardware", "h200", "--batch", "4", "--fit", str(path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "expected" in out and "x the floor" in out
    assert main([*argv, "--json"]) == 0
    import orjson

    exp = orjson.loads(capsys.readouterr().out)["expected"]
    assert exp["decode_step_s"] == pytest.approx(cost.decode_step_s(4, 1024))
    assert exp["decode_step_over_floor"] > 1


# -- the knots: a CPU whose step is concave in the batch --------------------------------------


def _concave(batch: float) -> float:
    """A 2-core CPU's step without KV: 9 ms at one row, x2 at 4, x5 at 32 (power 0.46)."""
    return 9e-3 * batch**0.46


def _concave_samples(batches, noise: float, seed: int = 0):
    rng = np.random.default_rng(seed)
    kv_s, sync = 1e-6, 2e-3  # 16 KiB of KV per position at ~16 GB/s
    jitter = lambda: 1 + noise * rng.standard_normal()  # noqa: E731
    return [
        rl.DecodeSample(b, c, (sync + k * (_concave(b) + b * c * kv_s)) * jitter(), steps=k)
        for b in batches
        for c in (128, 512, 1536)
        for k in (1, 4)
    ]


def _concave_step(b: float, c: float) -> float:
    return _concave(b) + b * c * 1e-6


def test_the_table_recovers_a_concave_step_that_one_plane_cannot():
    decode = _concave_samples((1, 4, 16, 32), noise=0.01)
    got = rl.fit(_base(), decode)
    assert {(k[0], k[1]) for k in got.decode_knots} == {
        (b, c) for b in (1, 4, 16, 32) for c in (128, 512, 1536)
    }
    for b, c, step_s in got.decode_knots:
        assert step_s == pytest.approx(_concave_step(b, c), rel=0.05)
    assert got.sync_s == pytest.approx(2e-3, rel=0.3)
    assert got.info["decode_rms_rel_error"] < 0.02
    assert got.info["linear_decode_rms_rel_error"] > 3 * got.info["decode_rms_rel_error"]
    # between batches the chord: a held-out batch 8 within a few % of the concave truth
    truth8 = 2e-3 + 4 * _concave_step(8, 512)
    assert got.decode_call_s(8, 512, 4) == pytest.approx(truth8, rel=0.06)
    # without the table the same samples give the plane's larger error
    plane = rl.fit(_base(), decode, knots=False)
    assert plane.decode_knots == () and abs(plane.decode_call_s(8, 512, 4) / truth8 - 1) > 0.06


def test_a_cell_timed_faster_for_more_steps_keeps_a_positive_step():
    """Dispatch-bound tiny steps on a busy host: at (1, 64) four steps timed faster than one.
    Under a shared sync term that cell's step would be negative (dropped: a 0 ms step); the
    table then drops the sync term, and each step is its calls' weighted seconds per step."""
    from scaletui.roofline.samples import DecodeSample

    decode = [DecodeSample(1, 64, 10e-3, 1), DecodeSample(1, 64, 9.9e-3, 4),
              DecodeSample(2, 64, 11e-3, 1), DecodeSample(2, 64, 14e-3, 4)]  # fmt: skip
    got = rl.fit(_base(), decode)
    steps = {(b, c): step_s for b, c, step_s in got.decode_knots}
    assert got.sync_s == 0 and all(s > 0 for s in steps.values())
    # relative least squares of y = steps * x over one cell: x = sum(s/y) / sum((s/y)^2)
    want = (1 / 10e-3 + 4 / 9.9e-3) / ((1 / 10e-3) ** 2 + (4 / 9.9e-3) ** 2)
    assert steps[1, 64] == pytest.approx(want)
    assert got.decode_call_s(1, 64, 4) > 0


@pytest.mark.parametrize(
    "measured",
    [
        {1: 5.0, 4: 5.0, 8: 5.4, 16: 8.0, 32: 15.8},  # small bf16, native, Zen 4 (1 row: flat)
        {1: 16.1, 4: 18.2, 8: 22.9, 16: 36.4, 32: 72.5},  # small f32, native, Zen 2, context 512
    ],
    ids=["zen4-bf16", "zen2-f32"],
)
def test_between_batches_past_the_first_the_step_is_flat_then_compute_bound(measured):
    """The native kernels read the weights once for every row: flat until the multiplies take
    over, then in proportion to the rows, and slower than either near the knee. Timed at 1, 4
    and 32 rows (ms, two CPUs), the table reads 8 and 16 rows within 10 %, where a power law
    from 4 to 32 overshoots by a quarter to a third and the larger regime alone undershoots
    Zen 2's 8 rows by 15 %."""
    knots = tuple((b, c, measured[b] * 1e-3) for b in (1, 4, 32) for c in (128, 1024))
    cost = dataclasses.replace(_base(), decode_knots=knots, sync_s=0.0)
    for b in (1, 4, 32):
        assert cost.decode_step_s(b, 512) == pytest.approx(measured[b] * 1e-3)
    for b in (8, 16):
        assert cost.decode_step_s(b, 512) == pytest.approx(measured[b] * 1e-3, rel=0.10)
    power_law_8 = measured[4] * (measured[32] / measured[4]) ** (1 / 3)
    assert power_law_8 > 1.25 * measured[8]
    # between the first two batches a power law; the curve is continuous at every knot
    assert cost.decode_step_s(2, 512) == pytest.approx((measured[1] * measured[4]) ** 0.5 * 1e-3)
    for b in (4, 32):
        step = measured[b] * 1e-3
        assert cost.decode_step_s(b - 1e-6, 512) == pytest.approx(step, rel=1e-4)
        assert cost.decode_step_s(b + 1e-6, 512) == pytest.approx(step, rel=1e-4)
    steps = [cost.decode_step_s(b, 512) for b in range(1, 33)]
    assert steps == sorted(steps)  # more rows never cost less


def test_the_table_is_linear_in_context_then_a_power_law_in_batch():
    """Between measured cells a step costs between their steps, at any context."""
    knots = ((1, 100, 0.010), (1, 300, 0.012), (4, 100, 0.016), (4, 300, 0.030))
    cost = dataclasses.replace(_base(), decode_knots=knots, sync_s=0.0)
    assert cost.decode_step_s(1, 100) == pytest.approx(0.010)
    assert cost.decode_step_s(1, 200) == pytest.approx(0.011)  # halfway along the context
    assert cost.decode_step_s(4, 50) == pytest.approx(0.016)  # below the first context: flat
    assert cost.decode_step_s(4, 500) == pytest.approx(0.030 + 0.014)  # past: last slope
    # along the batch a power law: half way from 1 to 4 in log(batch) at 2
    assert cost.decode_step_s(2, 100) == pytest.approx(0.010 * (0.016 / 0.010) ** 0.5)
    assert cost.decode_step_s(2, 200) == pytest.approx(0.011 * (0.023 / 0.011) ** 0.5)
    assert cost.decode_step_s(8, 100) == pytest.approx(0.016 + 4 * 0.002)  # past: slope per row
    assert cost.decode_call_s(4, 100, 3) == pytest.approx(3 * 0.016)
    for ctx in (0, 150, 300, 900):
        ends = sorted((cost.decode_step_s(1, ctx), cost.decode_step_s(4, ctx)))
        assert all(ends[0] <= cost.decode_step_s(b, ctx) <= ends[1] for b in (1.5, 2, 3, 3.9))
    # the assumed physical form is untouched by a table it does not have
    assert _base().decode_step_s(4, 100) == _base().linear_decode_step_s(4, 100)
    with pytest.raises(ValueError, match="decode_knots"):
        dataclasses.replace(_base(), decode_knots=((0, 128, 0.01),))


def test_prefill_fits_overhead_dense_flops_and_attention_pairs_at_their_own_rates():
    """XLA materialises [T, T] scores: attention costs more per FLOP than the GEMMs, and a
    prompt's time is overhead + a T term + a T^2 term; fitted on four buckets, the three
    between them and a chunk after cached positions follow."""
    truth = dataclasses.replace(_base(), prefill_overhead_s=0.02, prefill_flops_per_s=1e11,
                                prefill_attn_flops_per_s=5e9, read_bw=math.inf)  # fmt: skip
    decode = _concave_samples((1, 8), noise=0.0)
    prefill = [rl.PrefillSample(t, truth.prefill_s(t)) for t in (32, 128, 512, 2048)]
    got = rl.fit(_base(), decode, prefill)
    assert got.prefill_attn_flops_per_s < got.prefill_flops_per_s
    for t in (64, 256, 1024):
        assert got.prefill_s(t) == pytest.approx(truth.prefill_s(t), rel=0.02)
    assert got.prefill_s(512, start=1024) == pytest.approx(truth.prefill_s(512, 1024), rel=0.02)
    assert got.info["prefill_max_rel_error"] < 0.02


def test_a_fit_with_knots_round_trips_through_the_fit_store(private_config):
    decode = _concave_samples((1, 4, 16), noise=0.0)
    got = rl.fit(_base(), decode, [rl.PrefillSample(64, 0.02), rl.PrefillSample(128, 0.05)])
    assert got.prefill_attn_flops_per_s > 0
    back = fitstore.load_fit(fitstore.save_fit(got, host="box"))
    assert back == got and back.decode_knots == got.decode_knots
    assert back.decode_call_s(8, 300, 4) == got.decode_call_s(8, 300, 4)


def test_fixed_costs_alone_fit_without_a_read_bandwidth():
    """A dispatch-bound model (tiny): time does not grow with bytes; the fit says so, not fails."""
    decode = [rl.DecodeSample(b, c, 1e-3 + 1e-4 * k, steps=k)
              for b in (1, 4) for c in (64, 256) for k in (1, 4)]  # fmt: skip
    got = rl.fit(_base(), decode)
    assert got.read_bw == float("inf") and "no read bandwidth" in got.info["notes"][0]
    assert got.decode_call_s(2, 128, 4) == pytest.approx(1.4e-3, rel=1e-6)


# -- precision: weights and KV stored narrower than they are computed ------------------------


def test_weight_and_kv_storage_set_the_bytes_read_and_compute_sets_the_flop_roof():
    model = load_model("small")  # 8 layers, 4 KV heads of 64, 40.9M parameters
    by = {w: rl.CostModel.assumed(model, CPU, dtype="f32", weight_dtype=w) for w in
          ("f32", "bf16", "int8")}  # fmt: skip
    read_s = {w: c.decode_bytes(1, 0) / c.read_bw for w, c in by.items()}  # the weight read
    assert read_s["f32"] == pytest.approx(rl.param_count(model) * 4 / CPU.hbm_bw)
    assert read_s["bf16"] == pytest.approx(read_s["f32"] / 2)
    assert read_s["int8"] == pytest.approx(read_s["f32"] / 4)
    assert by["int8"].weight_dtype == "int8" and by["int8"].kv_dtype == "f32"
    assert by["int8"].kv_bytes_per_token == by["f32"].kv_bytes_per_token == 2 * 8 * 4 * 64 * 4
    assert by["int8"].flops_per_token == by["f32"].flops_per_token  # FLOPs do not change
    # int8 KV: one byte a value plus an f32 scale per (layer, KV head) for K and for V
    kv8 = rl.CostModel.assumed(model, CPU, dtype="bf16", kv_dtype="int8")
    assert kv8.kv_bytes_per_token == 2 * 8 * 4 * 64 * 1 + 2 * 8 * 4 * 4  # 4096 + 256
    assert kv8.weight_dtype == "bf16" and kv8.weight_bytes == rl.param_count(model) * 2
    h200 = load_hardware("h200")  # the FLOP term runs at the compute dtype's roof
    bf16 = rl.CostModel.assumed(model, h200, dtype="bf16", weight_dtype="int8")
    assert bf16.decode_flops_per_s == h200.flops("bf16")
    assert bf16.describe_precision() == "bf16 compute, int8 weights, bf16 KV"
    assert by["f32"].describe_precision() == "f32"


def test_a_fit_keeps_its_bases_precision_and_reads_the_narrower_weights_faster():
    model = load_model("small")
    f32 = rl.CostModel.assumed(model, CPU, dtype="f32")
    int8 = rl.CostModel.assumed(model, CPU, dtype="f32", weight_dtype="int8", kv_dtype="bf16")
    truth = dataclasses.replace(int8, **TRUE)
    decode = [rl.DecodeSample(b, c, truth.decode_call_s(b, c, k), steps=k)
              for b in (1, 4, 16) for c in (128, 1024) for k in (1, 4)]  # fmt: skip
    got = rl.fit(int8, decode, knots=False)
    assert (got.dtype, got.weight_dtype, got.kv_dtype) == ("f32", "int8", "bf16")
    assert got.weight_bytes == int8.weight_bytes == f32.weight_bytes / 4
    assert got.read_bw == pytest.approx(TRUE["read_bw"], rel=1e-6)
    # at the same bandwidth a quarter of the f32 weights' read time
    f32_read = f32.weight_bytes / TRUE["read_bw"]
    assert got.decode_bytes(1, 0) / got.read_bw == pytest.approx(f32_read / 4)


def test_precision_is_checked_and_round_trips_through_yaml_old_files_meaning_all_dtype(
    private_config,
):
    model = load_model("small")
    with pytest.raises(ValueError, match="weight_dtype should be one of"):
        rl.CostModel.assumed(model, CPU, dtype="f32", weight_dtype="int4")
    with pytest.raises(ValueError, match="kv_dtype should be one of"):
        dataclasses.replace(_base(), kv_dtype="fp8")
    with pytest.raises(ValueError, match="dtype should be one of"):
        rl.CostModel.assumed(model, CPU, dtype="int8")
    cost = rl.CostModel.assumed(model, CPU, dtype="bf16", weight_dtype="int8", kv_dtype="int8")
    d = cost.to_dict()
    assert (d["dtype"], d["weight_dtype"], d["kv_dtype"]) == ("bf16", "int8", "int8")
    back = fitstore.load_fit(fitstore.save_fit(cost, host="box"))
    assert back == cost and back.kv_bytes_per_token == cost.kv_bytes_per_token
    old = {k: v for k, v in _base().to_dict().items() if k not in ("weight_dtype", "kv_dtype")}
    got = rl.CostModel.from_dict(old)  # a fit written before the precision knobs
    assert (got.dtype, got.weight_dtype, got.kv_dtype) == ("f32", "f32", "f32")
    assert got == _base()


def test_fit_files_carry_the_precision_unless_it_is_all_one_dtype(private_config):
    fits = private_config / "scaletui" / "hardware" / "fits"
    plain = fitstore.fit_path("small", "f32", "xla", 1, 1, host="box")
    assert plain == fits / "box--small--f32--xla--tp1-dp1.yaml"  # the name fits always had
    assert fitstore.fit_path("small", "f32", "xla", 1, 1, host="box", weight_dtype="f32",
                             kv_dtype="f32") == plain  # fmt: skip
    mixed = fitstore.fit_path("small", "f32", "xla", 1, 1, host="box", weight_dtype="int8",
                              kv_dtype="bf16")  # fmt: skip
    assert mixed.name == "box--small--f32-wint8-kvbf16--xla--tp1-dp1.yaml"
    kv_only = fitstore.fit_path("small", "bf16", "xla", 1, 1, host="box", kv_dtype="int8")
    assert kv_only.name == "box--small--bf16-wbf16-kvint8--xla--tp1-dp1.yaml"
    model = load_model("small")
    int8 = dataclasses.replace(
        rl.CostModel.assumed(model, CPU, dtype="f32", weight_dtype="int8", kv_dtype="bf16"),
        kernels="xla",
    )
    assert fitstore.save_fit(int8, host="box") == mixed
    # kernels "auto" finds whichever kernels were fitted, for this precision only
    find = lambda **kw: fitstore.find_fit("small", "f32", 1, 1, "auto", host="box", **kw)  # noqa: E731
    assert find(weight_dtype="int8", kv_dtype="bf16") == mixed
    assert find() is None and find(weight_dtype="int8") is None
    fitstore.save_fit(dataclasses.replace(_base(), kernels="native"), host="box")
    assert find() == fits / "box--small--f32--native--tp1-dp1.yaml"
    assert find(weight_dtype="f32", kv_dtype="f32") == find()
    assert find(weight_dtype="int8", kv_dtype="bf16") == mixed
    assert fitstore.find_fit("small", "f32", 1, 1, "native", host="box",
                             weight_dtype="int8", kv_dtype="bf16") is None  # fmt: skip


def test_prefill_knots_are_exact_where_timed_and_scale_the_form_between():
    """A prefill table: the measured time at each timed length; between two, the physical form
    scaled by the ratio measured / form interpolated in log tokens; past the ends, the nearest
    ratio; a later chunk (start > 0) keeps the form's extra attention, scaled alike."""
    base = _base()
    form = base.linear_prefill_s
    knots = ((64, 1.2 * form(64)), (256, 0.9 * form(256)))
    cost = dataclasses.replace(base, prefill_knots=knots)
    assert cost.prefill_s(64) == pytest.approx(knots[0][1])
    assert cost.prefill_s(256) == pytest.approx(knots[1][1])
    assert cost.prefill_s(128) == pytest.approx(form(128) * 1.05)  # halfway in log: (1.2+0.9)/2
    assert cost.prefill_s(16) == pytest.approx(form(16) * 1.2)
    assert cost.prefill_s(1024, 256) == pytest.approx(form(1024, 256) * 0.9)
    back = rl.CostModel.from_dict(cost.to_dict())
    assert back.prefill_knots == cost.prefill_knots
    with pytest.raises(ValueError, match="prefill_knots"):
        dataclasses.replace(base, prefill_knots=((0, 0.01),))
    # the fit keeps the median per length timed from position 0
    _, decode, prefill = _samples(noise=0.0)
    got = rl.fit(base, decode, prefill)
    lengths = sorted({s.tokens for s in prefill if s.start == 0})
    assert [k[0] for k in got.prefill_knots] == lengths
    for s in prefill:
        if s.start == 0:
            assert got.prefill_s(s.tokens) == pytest.approx(s.seconds, rel=1e-9)


def test_the_fit_keeps_how_much_one_call_varies_and_stores_it():
    """Each sample carries its timed calls over their median; the fit pools them into
    call_spread (evenly spaced quantiles), which round-trips through the fit store."""
    truth, decode, prefill = _samples(noise=0.0)
    rng = np.random.default_rng(1)
    ratios = lambda: tuple(np.exp(0.1 * rng.standard_normal(9)))  # noqa: E731
    decode = [dataclasses.replace(s, spread=ratios()) for s in decode]
    prefill = [dataclasses.replace(s, spread=ratios()) for s in prefill]
    got = rl.fit(_base(), decode, prefill)
    spread = np.array(got.call_spread)
    assert len(spread) == rl.costfit.SPREAD_QUANTILES and np.all(np.diff(spread) >= 0)
    assert np.median(spread) == pytest.approx(1.0, abs=0.02)
    # quantiles of a lognormal with sigma 0.1: the 1/64 and 63/64 points at about -/+2.16 sigma
    assert spread[0] == pytest.approx(math.exp(-0.216), rel=0.04)
    assert spread[-1] == pytest.approx(math.exp(0.216), rel=0.04)
    assert rl.fit(_base(), *_samples(noise=0.0)[1:]).call_spread == ()  # no calls: no spread
    assert rl.CostModel.from_dict(yaml.safe_load(yaml.safe_dump(got.to_dict()))) == got
    with pytest.raises(ValueError, match="call_spread"):
        dataclasses.replace(got, call_spread=(1.0, -0.5))


def test_scaled_is_the_same_model_on_a_slower_host():
    """scaled(decode=a, prefill=p): every generate call takes a times as long (table or form),
    a prefill p times as long where it was timed; the spread (relative) is kept."""
    _, decode, prefill = _samples(noise=0.0)
    fitted = rl.fit(_base(), decode, prefill)
    slower = fitted.scaled(decode=1.25, prefill=0.8)
    for b, c, k in ((1, 128, 1), (3, 700, 4), (8, 1536, 8), (64, 4096, 2)):
        assert slower.decode_call_s(b, c, k) == pytest.approx(1.25 * fitted.decode_call_s(b, c, k))
        form = dataclasses.replace(fitted, decode_knots=())
        assert form.scaled(1.25, 0.8).decode_call_s(b, c, k) == pytest.approx(
            1.25 * form.decode_call_s(b, c, k)
        )
    for n, _ in fitted.prefill_knots:
        assert slower.prefill_s(n) == pytest.approx(0.8 * fitted.prefill_s(n))
    assert slower.call_spread == fitted.call_spread
    assert slower.info["scaled"] == {"decode": 1.25, "prefill": 0.8}
    with pytest.raises(ValueError, match="scale factors"):
        fitted.scaled(decode=0.0, prefill=1.0)
