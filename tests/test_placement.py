"""`placement.place` by hand: 2 hosts x 4 devices (and a few more), which devices each mesh
takes and which axes cross hosts."""

from __future__ import annotations

import pytest

from scaletui.placement import Layout, place

TWO_BY_FOUR = Layout(hosts=2, devices_per_host=4)


def test_tp_within_a_host_dp_across():
    p = place(4, 2, TWO_BY_FOUR)
    assert p.generate == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert p.crosses_hosts == ("data",)  # no tp group leaves its host
    assert p.tp_hosts == 1


def test_small_tp_packs_replicas_into_one_host_first():
    p = place(2, 2, TWO_BY_FOUR)
    assert p.generate == ((0, 1), (2, 3))
    assert p.crosses_hosts == ()


def test_tp_over_hosts_only_when_asked():
    with pytest.raises(ValueError, match=r"tp=8 spans 2 hosts of 4 devices.*--tp-over-hosts"):
        place(8, 1, TWO_BY_FOUR)
    p = place(8, 1, TWO_BY_FOUR, tp_over_hosts=True)
    assert p.crosses_hosts == p.crosses_slices == ("model",)
    assert (p.tp_slices, p.tp_per_slice) == (2, 4)


def test_disaggregated_sets_go_on_different_hosts():
    p = place(4, 1, TWO_BY_FOUR, prefill_devices=4)
    assert p.prefill == ((0, 1, 2, 3),) and p.generate == ((4, 5, 6, 7),)
    assert p.crosses_hosts == ("transfer",)
    one_host = place(4, 1, Layout(1, 8), prefill_devices=4)  # nowhere else to go
    assert one_host.generate == ((4, 5, 6, 7),) and one_host.crosses_hosts == ()


def test_disaggregated_packs_when_hosts_run_out():
    p = place(2, 3, TWO_BY_FOUR, prefill_devices=2)  # 1 + 2 hosts needed, 2 there
    assert p.prefill == ((0, 1),) and p.generate == ((2, 3), (4, 5), (6, 7))
    assert p.crosses_hosts == ("data", "transfer")


def test_a_tpu_slice_keeps_tp_on_ici_across_its_hosts():
    slice_ = Layout(hosts=2, devices_per_host=4, hosts_per_slice=2)  # one v5e 4x2... x2 slice
    p = place(8, 1, slice_)  # no flag needed: the hosts share ICI
    assert p.crosses_hosts == ("model",) and p.crosses_slices == ()
    assert p.tp_slices == 1


@pytest.mark.parametrize(
    ("tp", "dp", "kw", "match"),
    [
        (3, 1, {}, r"tp=3 does not divide devices_per_host=4"),
        (4, 3, {}, r"12 devices, but 2 hosts x 4 hold 8"),
        (2, 1, {"prefill_devices": 3}, r"prefill_devices \(3\) should be a multiple of tp=2"),
        (0, 1, {}, r"tp should be an integer >= 1, got 0"),
    ],
)
def test_bad_input_names_the_value(tp, dp, kw, match):
    with pytest.raises(ValueError, match=match):
        place(tp, dp, TWO_BY_FOUR, **kw)


def test_layout_checks_its_slices():
    with pytest.raises(ValueError, match=r"hosts \(3\) should be a multiple of hosts_per_slice"):
        Layout(hosts=3, devices_per_host=4, hosts_per_slice=2)
