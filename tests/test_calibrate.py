"""`scaletui calibrate --quick` on the 8 virtual CPU devices: it writes a `local` spec that loads,
prints the same YAML on stdout with progress on stderr, and feeds an f32 roofline estimate.
Speeds are not asserted (bench/calibrate_check.py measures them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from scaletui import roofline
from scaletui.calibrate import main
from scaletui.specs import load_hardware, load_model, local_hardware_path


@pytest.fixture(autouse=True)
def _config_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))


@pytest.mark.timeout(120)
def test_calibrate_writes_a_loadable_local_spec(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import jax

    assert main(["--quick"]) == 0
    out = capsys.readouterr()
    path = local_hardware_path()
    assert path == tmp_path / "config" / "scaletui" / "hardware" / "local.yaml"
    assert yaml.safe_load(out.out) == yaml.safe_load(path.read_text())
    assert "[1/4] memory bandwidth" in out.err and f"wrote {path}" in out.err

    hw = load_hardware("local")
    n = len(jax.devices())
    assert (hw.name, hw.kind, hw.chips_per_host) == ("local", "cpu", n)
    assert hw.hbm_bw > 0 and hw.flops("f32") > 0 and hw.flops("bf16") > 0
    assert hw.hbm_bytes > 1e9  # host RAM on a CPU
    measured = hw.extra["measured"]
    assert measured["memory"]["bytes_moved"] == 2 * (32 << 20)  # read + write of the array
    assert measured["matmul"]["f32"]["n"] == 512
    if n > 1:  # conftest gives 8 virtual devices: the all-reduce path runs
        assert measured["all_reduce"]["devices"] == n
        assert hw.ici_bw == pytest.approx(measured["all_reduce"]["bw"])
        assert hw.ici_latency_s > 0
    assert hw.dcn_bw == hw.ici_bw
    assert "date" in hw.extra

    # The server's CPU config predicts from it: f32 weights and KV, batch = slots.
    est = roofline.estimate(
        load_model("small"), hw, batch=4, chips=1, weight_bytes=4, kv_bytes=4, compute_dtype="f32"
    )
    assert est.decode_step_s > 0 and est.fits


@pytest.mark.timeout(120)
def test_calibrate_out_and_no_write(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--quick", "--no-write"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["name"] == "local"
    assert not local_hardware_path().exists()
    out = tmp_path / "elsewhere" / "mine.yaml"
    copy = tmp_path / "printed.yaml"
    copy.write_text(yaml.safe_dump(printed))
    assert load_hardware(copy).kind == "cpu"  # what --no-write prints is a valid spec too
    assert main(["--quick", "--out", str(out)]) == 0
    assert load_hardware(out).name == "local"
    assert not local_hardware_path().exists()


@pytest.mark.timeout(120)
def test_calibrate_one_device_uses_memory_bandwidth_for_ici() -> None:
    import jax

    from scaletui.calibrate import calibrate

    spec = calibrate(quick=True, devices=jax.devices()[:1], log=lambda msg: None)
    assert spec["measured"]["all_reduce"] is None
    assert spec["ici_bw"] == spec["hbm_bw"] == spec["dcn_bw"]
    assert "ici_latency_s" not in spec
    assert spec["chips_per_host"] == 1
    assert any("one device" in note for note in spec["notes"])
