"""`scaletui doctor`: the facts it reports and its exit status (never compiles anything)."""

from __future__ import annotations

import shutil
from importlib import resources

import orjson
import pytest

from scaletui import cli
from scaletui.specs import load_hardware, local_hardware_path


@pytest.fixture
def fake_cxx(tmp_path, monkeypatch) -> str:
    """A compiler that exists (doctor only looks for one) and an empty kernel cache."""
    script = tmp_path / "fake-cxx"
    script.write_text("#!/bin/sh\necho 'fake c++ 1.0'\n")
    script.chmod(0o755)
    monkeypatch.setenv("CXX", str(script))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("SCALETUI_NATIVE_KERNELS", raising=False)
    return str(script)


def _doctor_json(capsys, *extra: str) -> tuple[int, dict]:
    rc = cli.main(["doctor", "--json", *extra])
    return rc, orjson.loads(capsys.readouterr().out)


def test_json_has_the_facts_and_exit_0_when_ready(fake_cxx, tmp_path, capsys):
    rc, f = _doctor_json(capsys)
    assert rc == 0 and f["ok"] and f["problems"] == []
    assert {"python", "scaletui", "jax", "kernels", "calibration", "paths", "optional"} <= set(f)
    assert f["jax"]["backend"] == "cpu"
    assert f["jax"]["devices"] == f["jax"]["virtual_cpu_devices"] == 8  # conftest's XLA_FLAGS
    k = f["kernels"]
    assert k["status"] == "buildable" and k["compiler"] == fake_cxx
    assert k["compiler_version"] == "fake c++ 1.0"
    assert k["path"].startswith(str(tmp_path / "cache" / "scaletui" / "kernels"))
    assert f["calibration"] == {"status": "missing", "path": str(local_hardware_path())}
    assert f["paths"]["cache_dir"] == str(tmp_path / "cache" / "scaletui")
    assert f["optional"]["cxx"] == fake_cxx and "uvloop" in f["optional"]


def test_no_compiler_on_cpu_is_a_warning_naming_it(fake_cxx, monkeypatch, capsys):
    """The server still serves (XLA's ops, slower): a warning, not a failure."""
    monkeypatch.setenv("CXX", "/nonexistent")
    rc, f = _doctor_json(capsys)
    assert rc == 0 and f["ok"] and f["problems"] == []
    assert f["kernels"]["status"] == "unavailable" and f["kernels"]["compiler"] is None
    assert "no C++ compiler" in f["warnings"][0]
    assert cli.main(["doctor"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert any(ln.startswith("warning") and "no C++ compiler" in ln for ln in lines)


def test_no_jax_backend_exits_1_naming_it(fake_cxx, monkeypatch, capsys):
    from scaletui.commands import doctor

    monkeypatch.setattr(doctor, "_jax", lambda: {"backend": None, "error": "no devices"})
    f = doctor.facts()
    assert not f["ok"] and "no usable backend: no devices" in f["problems"][0]


def test_kernels_switched_off_is_not_a_problem(fake_cxx, monkeypatch, capsys):
    monkeypatch.setenv("CXX", "/nonexistent")
    monkeypatch.setenv("SCALETUI_NATIVE_KERNELS", "0")
    rc, f = _doctor_json(capsys)
    assert rc == 0 and f["kernels"]["status"] == "disabled"


def test_reports_the_local_calibration(fake_cxx, capsys):
    path = local_hardware_path()
    path.parent.mkdir(parents=True)
    shutil.copy(resources.files("scaletui.specs") / "hardware" / "h200.yaml", path)
    rc, f = _doctor_json(capsys)
    c, hw = f["calibration"], load_hardware("local")
    assert rc == 0 and c["status"] == "present" and c["path"] == str(path)
    assert c["hbm_bw"] == hw.hbm_bw and c["f32_flops_per_s"] == hw.flops_per_s["f32"]
    assert c["written"]
    assert cli.main(["doctor"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("calibration"))
    assert str(path) in line and f"hbm_bw {hw.hbm_bw / 1e9:.1f} GB/s" in line
