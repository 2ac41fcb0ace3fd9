"""Spec loading: every shipped spec loads with sane values; a user's minimal YAML loads; a bad file
fails naming the file, the key and what was expected."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from scaletui.specs import (
    SpecError,
    as_dict,
    hardware_names,
    load_hardware,
    load_model,
    local_hardware_path,
    model_names,
)

SHIPPED_HARDWARE = ["a100", "b200", "h100", "h200", "tpu-v4p", "tpu-v5e", "tpu-v5p", "tpu-v6e"]

MINIMAL_HW = {
    "name": "mychip",
    "kind": "gpu",
    "flops_per_s": {"bf16": 1e15},
    "hbm_bytes": 80e9,
    "hbm_bw": 3e12,
    "ici_bw": 4e11,
    "ici_bidirectional": False,
    "dcn_bw": 5e10,
    "chips_per_host": 8,
}


@pytest.fixture(autouse=True)
def _no_user_local(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))


def test_shipped_hardware_loads_with_book_values() -> None:
    assert hardware_names() == SHIPPED_HARDWARE
    for name in SHIPPED_HARDWARE:
        hw = load_hardware(name)
        assert hw.name == name
        assert hw.kind in ("tpu", "gpu")
        assert hw.flops("bf16") >= 1e14
        assert 1e10 < hw.hbm_bytes < 1e12 and 5e11 < hw.hbm_bw < 1e13
        assert hw.ici_bw > hw.dcn_bw > 0
        assert "source" in hw.extra
    v5e = load_hardware("tpu-v5e")
    assert (v5e.flops("bf16"), v5e.hbm_bw, v5e.hbm_bytes) == (1.97e14, 8.2e11, 16e9)
    assert v5e.ici_bw == 4.5e10 and v5e.ici_bidirectional
    assert load_hardware("h100").ici_bw == 4.5e11  # NVLink 4 egress, one direction
    # Critical batches the book quotes: ~240 (v5e), ~295 (H100), ~206 (H200), ~281 (B200).
    for name, crit in (("tpu-v5e", 240), ("h100", 295), ("h200", 206), ("b200", 281)):
        hw = load_hardware(name)
        assert hw.flops("bf16") / hw.hbm_bw == pytest.approx(crit, rel=0.01)


def test_missing_dtype_names_what_exists() -> None:
    with pytest.raises(SpecError, match=r"no flops_per_s\.f32 \(has: bf16, int8\)"):
        load_hardware("tpu-v5e").flops("f32")


def test_shipped_models_load() -> None:
    assert {"tiny", "small", "llama3-8b", "llama3-70b", "llama3-405b", "llama2-13b"} <= set(
        model_names()
    )
    for name in model_names():
        m = load_model(name)
        assert m.n_heads % m.n_kv_heads == 0
        assert m.n_heads * m.head_dim >= m.d_model // 2


def test_minimal_user_yaml_loads_by_path(tmp_path: Path) -> None:
    path = tmp_path / "mychip.yaml"
    path.write_text(yaml.safe_dump(MINIMAL_HW))
    hw = load_hardware(str(path))
    assert hw.flops("bf16") == 1e15 and hw.ici_latency_s == 1e-6
    assert as_dict(hw)["chips_per_host"] == 8


def _bad(tmp_path: Path, **changes: object) -> Path:
    data = {**MINIMAL_HW, **changes}
    data = {k: v for k, v in data.items() if v != "DROP"}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        ({"hbm_bw": "DROP"}, r"missing required key 'hbm_bw' \(float\)"),
        ({"hbm_bw": "fast"}, r"key 'hbm_bw' should be float, got 'fast'"),
        ({"chips_per_host": 2.5}, r"key 'chips_per_host' should be int"),
        ({"ici_bidirectional": "yes please"}, r"key 'ici_bidirectional' should be bool"),
        ({"kind": "fpga"}, r"key 'kind' should be one of"),
        ({"flops_per_s": {"bf17": 1e15}}, r"key 'flops_per_s.bf17': expected one of"),
        ({"hbm_bytes": -1}, r"key 'hbm_bytes' should be > 0"),
        ({"ici_latency_s": -1e-6}, r"key 'ici_latency_s' should be >= 0"),
    ],
)
def test_bad_hardware_file_names_file_key_expected(
    tmp_path: Path, changes: dict, pattern: str
) -> None:
    path = _bad(tmp_path, **changes)
    with pytest.raises(SpecError, match=pattern) as exc:
        load_hardware(path)
    assert str(path) in str(exc.value)


def test_unknown_name_and_missing_local_say_what_to_do() -> None:
    with pytest.raises(SpecError, match="known: a100, b200"):
        load_hardware("h900")
    with pytest.raises(SpecError, match="scaletui calibrate"):
        load_hardware("local")
    assert "local" not in hardware_names()


def test_local_spec_is_found_by_name() -> None:
    path = local_hardware_path()
    path.parent.mkdir(parents=True)
    path.write_text(yaml.safe_dump({**MINIMAL_HW, "name": "local", "kind": "cpu"}))
    assert load_hardware("local").kind == "cpu"
    assert "local" in hardware_names()
