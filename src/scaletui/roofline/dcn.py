"""The DCN term: what a placement's host-crossing axes cost per step, at the spec's DCN bandwidth.

Per `placement.place` (the book's advice, Parts 5, 7 and 12):
1. `model` (tp) across slices: each decode step's 2 all-reduces per layer of the rows x D
   activations run up the book's two-level tree (`collectives.all_reduce_split_s`): the part
   inside a slice over ICI/NVLink, the part between slices over each chip's DCN share.
2. `data` (dp) across hosts: nothing per step; replicas share no collective (the server's own
   per-step input broadcast is its cost, not the roofline's).
3. `transfer` across slices: the disaggregated KV hand-over at DCN speed, tp shards in parallel.
A slice is one ICI domain: a GPU box (NVLink ends there) or a TPU slice (its hosts share ICI).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from scaletui.placement import Placement
from scaletui.roofline.collectives import Link, all_reduce_s, all_reduce_split_s
from scaletui.roofline.costmodel import CostModel
from scaletui.specs import HardwareSpec, ModelSpec

__all__ = [
    "TpComms",
    "activation_bytes",
    "dcn_step_terms",
    "tp_comms",
    "transfer_link",
    "with_dcn",
]


def activation_bytes(compute_dtype: str) -> int:
    """Bytes of one activation on the wire: the compute dtype's (f32 4, else 2)."""
    return 4 if compute_dtype == "f32" else 2


@dataclass(frozen=True)
class TpComms:
    """A step's tensor-parallel all-reduces, seconds, by the link they run on."""

    ici_s: float  # inside the slice (ICI / NVLink)
    dcn_s: float  # between slices (DCN): 0 when the tp group stays in one

    @property
    def total_s(self) -> float:
        """The tree's levels pipeline (Part 12's min_i D_i W_i / (D_i - 1)): the larger one."""
        return max(self.ici_s, self.dcn_s)


def tp_comms(
    model: ModelSpec,
    hardware: HardwareSpec,
    rows: float,
    tp: int,
    act_bytes: float,
    placement: Placement | None = None,
) -> TpComms:
    """L x 2 all-reduces of `rows` x D activations (`act_bytes` each) over a tp group: all on
    ICI without a placement or where the group stays in one slice, else split over ICI and DCN
    by the placement's slices per group and devices per slice."""
    V = rows * model.d_model * act_bytes
    n = 2 * model.n_layers
    ici = Link.ici(hardware)
    if placement is None or placement.tp_slices == 1:
        return TpComms(n * all_reduce_s(V, tp, ici), 0.0)
    assert placement.tp == tp, (placement.tp, tp)
    ici_s, dcn_s = all_reduce_split_s(
        V, placement.tp_per_slice, placement.tp_slices, ici, Link.dcn(hardware)
    )
    return TpComms(n * ici_s, n * dcn_s)


def dcn_step_terms(
    model: ModelSpec, hardware: HardwareSpec, placement: Placement | None, act_bytes: float
) -> tuple[float, float]:
    """(fixed seconds, seconds per row) of one step's DCN all-reduces, rows being one tp group's
    (a decode batch / dp, or a prompt's tokens): linear in the rows, latency fixed."""
    if placement is None or placement.tp_slices == 1:
        return 0.0, 0.0
    at = lambda rows: tp_comms(model, hardware, rows, placement.tp, act_bytes, placement).dcn_s  # noqa: E731
    fixed = at(0)
    return fixed, at(1) - fixed


def transfer_link(hardware: HardwareSpec, placement: Placement | None) -> tuple[str, Link]:
    """('dcn' | 'ici', the link) the disaggregated KV hand-over meets under `placement`."""
    if placement is not None and "transfer" in placement.crosses_slices:
        return "dcn", Link.dcn(hardware)
    return "ici", Link.ici(hardware)


def with_dcn(
    cost: CostModel, model: ModelSpec, hardware: HardwareSpec, placement: Placement | None
) -> CostModel:
    """`cost` with the placement's DCN term: each decode step's DCN all-reduces added (a fit
    made on one host cannot hold them; they sit between a layer's matmuls, so they add), and
    the KV hand-over at the DCN bandwidth when prefill and generate are on different slices."""
    if placement is None:
        return cost
    fixed, per_row = dcn_step_terms(model, hardware, placement, activation_bytes(cost.dtype))
    link_name, link = transfer_link(hardware, placement)
    transfer_bw = link.bw if link_name == "dcn" else cost.transfer_bw
    return replace(cost, dcn_step_s=fixed, dcn_row_s=per_row, transfer_bw=transfer_bw)
