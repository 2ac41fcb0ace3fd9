"""The calibrated prediction: a fit of measured steps recovers the overhead and achieved fractions
that produced them, and predicts unseen configs."""

from __future__ import annotations

import pytest

from scaletui import roofline as rl
from scaletui.specs import HardwareSpec, load_model

CPU = HardwareSpec(
    name="cpu-test",
    kind="cpu",
    flops_per_s={"f32": 4e11},
    hbm_bytes=24e9,
    hbm_bw=3.5e10,
    ici_bw=1e10,
    ici_bidirectional=False,
    dcn_bw=1e10,
    chips_per_host=1,
)


def _est(batch: int, context: int) -> rl.Estimate:
    return rl.estimate(
        load_model("small"),
        CPU,
        batch=batch,
        context=context,
        weight_bytes=4,
        kv_bytes=4,
        compute_dtype="f32",
    )


def _synthetic(e: rl.Estimate) -> float:
    """A 'machine' with 2 ms overhead, 50% of peak bandwidth and 25% of peak FLOP/s."""
    mem = e.decode_weight_s + e.decode_kv_s
    return 2e-3 + mem / 0.5 + e.decode_matmul_s / 0.25


def test_fit_recovers_overhead_and_fractions() -> None:
    points = [(_est(b, s), 0.0) for b in (1, 4, 16, 64) for s in (128, 1024)]
    points = [(e, _synthetic(e)) for e, _ in points]
    cal = rl.fit_calibration(points)
    assert cal.overhead_s == pytest.approx(2e-3, rel=1e-6)
    assert cal.bw_fraction == pytest.approx(0.5, rel=1e-6)
    assert cal.flops_fraction == pytest.approx(0.25, rel=1e-6)
    assert cal.rms_rel_error < 1e-9 and cal.samples == 8
    unseen = _est(32, 512)
    assert rl.calibrated_step_s(cal, unseen) == pytest.approx(_synthetic(unseen), rel=1e-6)
    assert rl.calibrated_step_s(cal, unseen) > unseen.decode_step_s  # above the floor


def test_fit_with_noise_and_batch_only_still_predicts() -> None:
    # Batch-only sweeps make memory and matmul time collinear: a reduced fit must still predict.
    noise = [1.03, 0.98, 1.01, 0.97, 1.02]
    points = [
        (_est(b, 512), _synthetic(_est(b, 512)) * n)
        for b, n in zip((1, 2, 4, 8, 16), noise, strict=True)
    ]
    cal = rl.fit_calibration(points)
    assert cal.rms_rel_error < 0.05
    assert rl.calibrated_step_s(cal, _est(6, 512)) == pytest.approx(
        _synthetic(_est(6, 512)), rel=0.06
    )


def test_fit_rejects_too_few_or_bad_samples() -> None:
    e = _est(1, 128)
    with pytest.raises(ValueError, match=">= 3 measured steps"):
        rl.fit_calibration([(e, 0.01), (e, 0.02)])
    with pytest.raises(ValueError, match="should be > 0 s"):
        rl.fit_calibration([(e, 0.01), (e, 0.02), (e, 0.0)])
