"""The DCN term: the shipped specs' DCN figures against the book's (Part 2, Part 12), the
two-level collective against the book's cross-node cases, and `estimate()` pricing only the
axes a placement sends across hosts. Every expected number is worked by hand here."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from scaletui.placement import Layout, place
from scaletui.roofline import Link, estimate
from scaletui.roofline.collectives import all_gather_split_s, collective_intensity
from scaletui.specs import load_hardware, load_model

CASES = {
    c["id"]: c
    for c in json.loads((Path(__file__).parent / "data" / "scaling_book_cases.json").read_text())
}


@pytest.mark.parametrize(
    ("name", "host_egress"),
    [
        ("h100", 400e9),  # Part 12 node table: 8 x 400 Gb/s CX7 NICs
        ("h200", 400e9),  # the same HGX board and NICs
        ("b200", 400e9),  # Part 12 node table
        ("a100", 200e9),  # DGX A100: 8 x 200 Gb/s HDR
        ("tpu-v5e", 25e9),  # Cloud TPU docs: 2 x 100 Gb/s NICs per host; Part 2 3.125e9/chip
        ("tpu-v5p", 25e9),  # Cloud TPU docs: 50 Gb/s DCN per chip, 4 per host
        ("tpu-v4p", 25e9),  # Part 2 (Feb-2025): "about 2.5e10 B/s per host"
        ("tpu-v6e", 100e9),  # Part 2 (newer): 12.5e9 per v6e chip, 8 per host
    ],
)
def test_spec_dcn_is_per_chip_and_sums_to_the_host_egress(name: str, host_egress: float):
    hw = load_hardware(name)
    assert hw.dcn_bw * hw.chips_per_host == pytest.approx(host_egress)


def test_cross_node_collective_intensity_is_the_books():
    """Part 12: across H100 nodes alpha = C / W_node_egress ~ 2475 (B200: 5625)."""
    for name, cid_or_value in (("h100", "h100_dp_crit_batch_crossnode"), ("b200", 5625)):
        hw = load_hardware(name)
        node = Link(bw=hw.dcn_bw * hw.chips_per_host, switched=True)
        want = CASES[cid_or_value]["expected"] if isinstance(cid_or_value, str) else cid_or_value
        assert collective_intensity(hw, link=node) == pytest.approx(want, rel=0.01)


def test_two_level_allgather_matches_the_superpod_leaf():
    """Part 12's SuperPod: 32 nodes of 8 H100 under one leaf, AllGather bandwidth
    min(8*450/7, 32*400/31) = 413 GB/s: the shipped h100 spec through the two-level tree."""
    hw = dataclasses.replace(load_hardware("h100"), ici_latency_s=0.0)
    V = 1e9
    ici_s, dcn_s = all_gather_split_s(V, 8, 32, Link.ici(hw), Link.dcn(hw))
    assert ici_s == pytest.approx(V * 7 / 8 / 450e9)
    assert dcn_s == pytest.approx(V / 8 * 31 / 32 / 50e9)
    case = CASES["h100_crossnode_ag_bw"]
    assert V / max(ici_s, dcn_s) == pytest.approx(case["expected"], rel=case["rel_tol"])


LLAMA70 = load_model("llama3-70b")
H100 = load_hardware("h100")


def test_tp_over_two_h100_hosts_prices_its_dcn_part():
    p = place(16, 1, Layout(hosts=2, devices_per_host=8), tp_over_hosts=True)
    e = estimate(LLAMA70, H100, batch=32, chips=16, placement=p)
    V = 32 * 8192 * 2  # one all-reduce's activations, bf16
    per_all_reduce = 2 * (V / 8) * (1 / 2) / 50e9  # each GPU's eighth over its NIC, 2 hosts
    assert e.decode_comm_dcn_s == pytest.approx(80 * 2 * per_all_reduce)
    within = estimate(LLAMA70, H100, batch=32, chips=8)
    assert e.decode_comm_s == pytest.approx(max(within.decode_comm_s, e.decode_comm_dcn_s))
    assert e.placement["crosses_slices"] == ["model"]


def test_dp_across_hosts_costs_nothing_per_step():
    p = place(8, 2, Layout(hosts=2, devices_per_host=8))
    e = estimate(LLAMA70, H100, batch=64, chips=16, tp=8, dp=2, placement=p)
    alone = estimate(LLAMA70, H100, batch=32, chips=8)
    assert e.decode_comm_dcn_s == 0 and e.decode_comm_s == pytest.approx(alone.decode_comm_s)
    assert e.placement["crosses_hosts"] == ["data"]


def test_the_kv_hand_over_crosses_at_dcn_speed_only_between_hosts():
    apart = place(4, 1, Layout(2, 4), prefill_devices=4)
    e = estimate(LLAMA70, H100, chips=4, prompt_len=1000, placement=apart)
    assert e.kv_transfer_link == "dcn"
    assert e.kv_transfer_dcn_s == pytest.approx(1000 * 2 * 80 * 8 * 128 * 2 / 4 / 50e9)
    together = place(4, 1, Layout(1, 8), prefill_devices=4)
    assert estimate(LLAMA70, H100, chips=4, placement=together).kv_transfer_link == "ici"


def test_unknown_dcn_is_null_and_fails_only_where_needed(tmp_path: Path):
    spec = {k: v for k, v in vars(H100).items() if k != "extra"}
    spec.update(name="nodcn", dcn_bw=None, dcn_note="no NIC figure published")
    path = tmp_path / "nodcn.yaml"
    path.write_text(yaml.safe_dump(spec))
    hw = load_hardware(path)
    assert hw.dcn_bw is None
    assert estimate(LLAMA70, hw, chips=8).kv_transfer_dcn_s is None
    p = place(16, 1, Layout(2, 8), tp_over_hosts=True)
    with pytest.raises(ValueError, match=r"'nodcn' has dcn_bw null \(unknown: no NIC figure"):
        estimate(LLAMA70, hw, chips=16, placement=p)


def test_placement_must_match_the_mesh():
    with pytest.raises(ValueError, match=r"placement is for tp=4 dp=2, not tp=8 dp=1"):
        estimate(LLAMA70, H100, chips=8, placement=place(4, 2, Layout(2, 4)))


def _json_of(main, argv, capsys) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_roofline_cli_shows_the_dcn_term(capsys):
    from scaletui.commands import roofline

    argv = ["--model", "llama3-70b", "--hardware", "h100", "--chips", "16", "--batch", "32"]
    over = _json_of(roofline.main, [*argv, "--hosts", "2", "--tp-over-hosts"], capsys)
    assert over["placement"]["crosses_slices"] == ["model"]
    assert over["decode_comm_dcn_s"] == pytest.approx(80 * 2 * 2 * (32 * 8192 * 2 / 8) / 2 / 50e9)
    assert roofline.main([*argv, "--hosts", "2"]) == 2  # tp over hosts only when asked
    assert "--tp-over-hosts" in capsys.readouterr().err
    assert roofline.main([*argv, "--devices-per-host", "8"]) == 2
    assert "--devices-per-host needs --hosts N" in capsys.readouterr().err


def test_simulate_adds_the_dcn_term_to_each_decode_step(capsys):
    from scaletui.commands import simulate

    argv = ["--model", "llama3-70b", "--hardware", "h100", "--tp", "16", "--slots", "32"]
    argv += ["--concurrency", "32", "--num-requests", "32", "--no-band", "--output-len", "64"]
    one_box = _json_of(simulate.main, argv, capsys)  # 16 GPUs on one NVLink domain (what-if)
    two = _json_of(simulate.main, [*argv, "--hosts", "2", "--tp-over-hosts"], capsys)
    dcn = two["config"]["dcn_step_s_at_slots"]
    assert dcn == pytest.approx(80 * 2 * 2 * (32 * 8192 * 2 / 8) / 2 / 50e9)
    assert two["median_tpot_ms"] == pytest.approx(one_box["median_tpot_ms"] + dcn * 1e3, rel=0.02)
