"""`scaletui calibrate` across processes: the link fit on hand-computed times, the spec it
writes (and a later host calibration keeps), and 2 local CPU processes (gloo) measuring a
positive bandwidth into a spec that the roofline's DCN link then reads."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from scaletui.calibrate import dcn
from scaletui.roofline.collectives import Link, all_reduce_s
from scaletui.specs import load_hardware

SPEC = {
    "name": "local",
    "kind": "cpu",
    "flops_per_s": {"bf16": 1.2e11, "f32": 1.0e11},
    "hbm_bytes": 8.0e9,
    "hbm_bw": 2.0e10,
    "ici_bw": 2.0e10,
    "ici_bidirectional": False,
    "dcn_bw": 2.0e10,
    "chips_per_host": 2,
    "notes": ["dcn_bw: no off-host link measured; set equal to ici_bw", "cpu: shared"],
    "measured": {"spread": {"read_bw": {"p10": 1.0, "p50": 2.0, "p90": 3.0, "n": 3}}},
}


def test_fit_recovers_a_link_the_roofline_prices_the_same() -> None:
    link = Link(bw=1e9, latency_s=1e-4, switched=True)  # as Link.dcn builds it
    for n in (2, 4):
        points = [(v, all_reduce_s(v, n, link)) for v in (4, 1 << 16, 1 << 22)]
        bw, latency = dcn.fit_link(points, n)
        assert bw == pytest.approx(1e9) and latency == pytest.approx(1e-4)
    # by hand, 2 processes: t = 2 * (V/2) / W + 2 * latency = V / 1e9 + 2e-4
    assert dcn.fit_link([(0.0 + 1, 1e-9 + 2e-4), (1e6 + 1, 1e-3 + 1e-9 + 2e-4)], 2) == (
        pytest.approx(1e9),
        pytest.approx(1e-4),
    )


@pytest.mark.parametrize(
    ("points", "n", "says"),
    [
        ([(4, 1e-3), (4, 2e-3)], 2, "2 or more sizes"),
        ([(4, 2e-3), (1 << 20, 1e-3)], 2, "do not grow"),
        ([(4, 1e-3), (1 << 20, 0.0)], 2, "> 0 s"),
        ([(4, 1e-3), (1 << 20, 2e-3)], 1, "n >= 2"),
    ],
)
def test_fit_refuses_points_without_a_bandwidth(points, n, says) -> None:
    with pytest.raises(ValueError, match=says):
        dcn.fit_link(points, n)


MEASURED = {
    "bw": 7.5e8,
    "latency_s": 2e-4,
    "processes": 2,
    "backend": "cpu",
    "sizes": [],
    "spread": {"p10": 5e8, "p50": 7e8, "p90": 9e8, "n": 12},
    "method": "psum",
}


def test_merge_stores_the_measurement_and_a_host_calibration_keeps_it(tmp_path) -> None:
    got = dcn.merge(SPEC, MEASURED, "127.0.0.1 (vm)", "2026-12-06")
    assert (got["dcn_bw"], got["dcn_latency_s"]) == (7.5e8, 2e-4)
    assert got["measured"]["spread"]["dcn_bw"]["p50"] == 7e8
    assert got["measured"]["spread"]["read_bw"] == SPEC["measured"]["spread"]["read_bw"]
    assert got["notes"][0] == "cpu: shared" and "0.50-0.90 GB/s" in got["notes"][1]
    path = tmp_path / "local.yaml"
    path.write_text(yaml.safe_dump(got))
    link = Link.dcn(load_hardware(path))
    assert (link.bw, link.latency_s) == (7.5e8, 2e-4)
    fresh = {**SPEC, "dcn_bw": 3e10}  # a later one-process calibration: DCN not measured
    kept = dcn.carry_over(got, fresh)
    assert (kept["dcn_bw"], kept["dcn_latency_s"]) == (7.5e8, 2e-4)
    assert kept["measured"]["dcn"]["date"] == "2026-12-06"
    assert dcn.carry_over(SPEC, fresh) is fresh  # nothing measured before: nothing to keep


def _calibrate(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "scaletui", "calibrate", *flags],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_without_a_spec_it_says_to_calibrate_the_host_first(tmp_path) -> None:
    done = _calibrate("--processes", "2", "--out", str(tmp_path / "none.yaml"))
    assert done.returncode == 2
    assert "none.yaml" in done.stderr and "`scaletui calibrate` (one process) first" in done.stderr


@pytest.mark.slow
@pytest.mark.xdist_group("multihost")
def test_two_processes_store_a_measured_dcn_bandwidth(tmp_path) -> None:
    path = tmp_path / "local.yaml"
    path.write_text(yaml.safe_dump(SPEC))
    done = _calibrate("--processes", "2", "--quick", "--out", str(path))
    assert done.returncode == 0, done.stderr[-3000:]
    hw = load_hardware(path)
    assert 0 < hw.dcn_bw != SPEC["dcn_bw"]
    assert hw.extra["dcn_latency_s"] >= 0
    link = Link.dcn(hw)  # what the roofline and the simulator price a host-crossing axis at
    assert (link.bw, link.latency_s) == (hw.dcn_bw, hw.extra["dcn_latency_s"])
    measured = hw.extra["measured"]
    spread = measured["spread"]["dcn_bw"]
    assert 0 < spread["p10"] <= spread["p50"] <= spread["p90"]
    assert measured["dcn"]["processes"] == 2 and len(measured["dcn"]["sizes"]) == 4
    assert yaml.safe_load(done.stdout)["dcn_bw"] == hw.dcn_bw  # the spec on stdout too
    assert hw.hbm_bw == SPEC["hbm_bw"]  # the host roofs are left as they were
