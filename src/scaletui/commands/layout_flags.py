"""The layout flags `scaletui roofline` and `scaletui simulate` share: hosts x devices per host
(and TPU slices) -> a `placement.Placement`, or None for today's one host."""

from __future__ import annotations

import argparse

from scaletui.placement import Layout, Placement, place
from scaletui.specs import HardwareSpec


def add_layout_flags(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--hosts",
        type=int,
        help="hosts (processes) the devices sit on; prices what crosses them at DCN speed "
        "(default: one host holding every device)",
    )
    p.add_argument(
        "--devices-per-host",
        type=int,
        help="devices per host (default: the spec's chips_per_host)",
    )
    p.add_argument(
        "--slices",
        type=int,
        help="ICI domains the hosts form (default: a TPU spec's hosts are one slice; a GPU or "
        "CPU host is its own)",
    )
    p.add_argument(
        "--tp-over-hosts",
        action="store_true",
        help="allow a tp group to leave its host/slice (its all-reduces then run over DCN)",
    )


def placement_from(
    args: argparse.Namespace, hw: HardwareSpec, tp: int, dp: int, prefill_devices: int = 0
) -> Placement | None:
    """The placement the flags ask for, or None without --hosts (ValueError names a bad one)."""
    if args.hosts is None:
        for flag in ("devices_per_host", "slices"):
            if getattr(args, flag) is not None:
                raise ValueError(f"--{flag.replace('_', '-')} needs --hosts N")
        return None
    if args.hosts < 1:
        raise ValueError(f"--hosts should be >= 1, got {args.hosts}")
    slices = args.slices or (1 if hw.kind == "tpu" else args.hosts)
    if slices < 1 or args.hosts % slices:
        raise ValueError(f"--slices should divide --hosts ({args.hosts}), got {slices}")
    layout = Layout(args.hosts, args.devices_per_host or hw.chips_per_host, args.hosts // slices)
    return place(tp, dp, layout, prefill_devices=prefill_devices, tp_over_hosts=args.tp_over_hosts)
