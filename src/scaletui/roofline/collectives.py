"""Collective times on ICI / NVLink / DCN, after the book's Part 3 (TPU) and Part 12 (GPU).

`bytes_` is always V, the size of the full (gathered / reduced) array that each chip ends with
(the book's Part 3, "Sharded Matrices"). A ring of n chips moves V*(n-1)/n bytes through each
chip; with wraparound both directions carry half. The book's TPU chapter drops the (n-1)/n factor
(`exact=False` reproduces it); its GPU chapter keeps it. Every collective also pays a latency per
hop: n-1 hops one way round a ring (or through a switch), about n/2 on a bidirectional ring.
"""

from __future__ import annotations

from dataclasses import dataclass

from scaletui.specs import HardwareSpec

__all__ = [
    "Link",
    "all_gather_s",
    "all_gather_split_s",
    "all_reduce_s",
    "all_reduce_split_s",
    "all_to_all_s",
    "collective_intensity",
    "generate_tp_limit",
    "hierarchical_bw",
    "latency_bound_bytes",
    "point_to_point_s",
    "reduce_scatter_s",
    "tp_comms_limit",
]


@dataclass(frozen=True)
class Link:
    """What one chip sees of the network for a collective along one axis."""

    bw: float  # bytes/s per chip, one direction
    bidirectional: bool = False  # a ring with wraparound: both directions usable
    latency_s: float = 0.0  # per hop
    switched: bool = False  # NVSwitch / fat tree rather than a torus ring

    def __post_init__(self) -> None:
        if not self.bw > 0:
            raise ValueError(f"link bandwidth should be > 0 bytes/s, got {self.bw!r}")
        if self.latency_s < 0:
            raise ValueError(f"link latency should be >= 0 s, got {self.latency_s!r}")

    @property
    def ring_bw(self) -> float:
        """Bandwidth a ring collective gets: both directions on a wraparound ring."""
        return self.bw * (2 if self.bidirectional and not self.switched else 1)

    @classmethod
    def ici(cls, hw: HardwareSpec) -> Link:
        """The chip's fast interconnect (ICI on TPUs, NVLink on GPUs)."""
        return cls(
            bw=hw.ici_bw,
            bidirectional=hw.ici_bidirectional,
            latency_s=hw.ici_latency_s,
            switched=hw.kind == "gpu",
        )

    @classmethod
    def dcn(cls, hw: HardwareSpec) -> Link:
        """One chip's share of the network off the host / slice (DCN, InfiniBand: its own NIC on
        a GPU box); latency from an optional `dcn_latency_s`. Fails on a spec whose dcn_bw is
        unknown (null)."""
        if hw.dcn_bw is None:
            note = hw.extra.get("dcn_note") or "no note"
            raise ValueError(
                f"hardware {hw.name!r} has dcn_bw null (unknown: {note}); a layout that "
                "crosses hosts needs it: give dcn_bw in a spec YAML (--hardware FILE)"
            )
        return cls(
            bw=hw.dcn_bw, latency_s=float(hw.extra.get("dcn_latency_s") or 0.0), switched=True
        )


def _hops(n: int, link: Link) -> int:
    return n // 2 if link.bidirectional and not link.switched else n - 1


def _check(bytes_: float, n: int) -> None:
    if bytes_ < 0:
        raise ValueError(f"collective size should be >= 0 bytes, got {bytes_!r}")
    if n < 1:
        raise ValueError(f"collective group should have >= 1 chip, got {n!r}")


def all_gather_s(bytes_: float, n: int, link: Link, *, exact: bool = True) -> float:
    """AllGather of a V-byte array sharded n ways: V*(n-1)/n / W_ring + hops * latency."""
    _check(bytes_, n)
    if n == 1:
        return 0.0
    moved = bytes_ * (n - 1) / n if exact else bytes_
    return moved / link.ring_bw + _hops(n, link) * link.latency_s


def reduce_scatter_s(bytes_: float, n: int, link: Link, *, exact: bool = True) -> float:
    """ReduceScatter to n shards of a V-byte array: the AllGather's mirror image, same cost."""
    return all_gather_s(bytes_, n, link, exact=exact)


def all_reduce_s(bytes_: float, n: int, link: Link, *, exact: bool = True) -> float:
    """AllReduce = ReduceScatter + AllGather: twice an AllGather."""
    return 2 * all_gather_s(bytes_, n, link, exact=exact)


def all_gather_split_s(
    bytes_: float, per_slice: int, slices: int, ici: Link, dcn: Link, *, exact: bool = True
) -> tuple[float, float]:
    """(ICI part, DCN part) of an AllGather of V bytes over `slices` x `per_slice` chips, the
    book's two-level tree (Part 12, "cross-node collectives"): within a slice V(g-1)/g over ICI;
    across slices each chip moves its 1/g of V over its own DCN share, V/g * (h-1)/h / W_dcn, so
    a host's g NICs carry V(h-1)/h together (the book's V / W_node_egress). The levels pipeline:
    the collective takes the larger, V / min_i(D_i W_i / (D_i - 1)) as `hierarchical_bw`."""
    _check(bytes_, per_slice)
    return (
        all_gather_s(bytes_, per_slice, ici, exact=exact),
        all_gather_s(bytes_ / per_slice, slices, dcn, exact=exact),
    )


def all_reduce_split_s(
    bytes_: float, per_slice: int, slices: int, ici: Link, dcn: Link, *, exact: bool = True
) -> tuple[float, float]:
    """(ICI part, DCN part) of an AllReduce over slices x per_slice chips: twice each of
    `all_gather_split_s`'s (ReduceScatter up the tree, AllGather down)."""
    ici_s, dcn_s = all_gather_split_s(bytes_, per_slice, slices, ici, dcn, exact=exact)
    return 2 * ici_s, 2 * dcn_s


def all_to_all_s(bytes_: float, n: int, link: Link, *, exact: bool = True) -> float:
    """AllToAll of a V-byte array over n chips: an AllGather/4 on a bidirectional ring (/2 one
    way), V*(n-1)/(n^2*W) through a switch (Part 12), plus the same hop latency."""
    _check(bytes_, n)
    if n == 1:
        return 0.0
    moved = bytes_ * (n - 1) / n if exact else bytes_
    if link.switched:
        moved /= n
    else:
        moved /= 4 if link.bidirectional else 2
    return moved / link.bw + _hops(n, link) * link.latency_s


def point_to_point_s(bytes_: float, link: Link, *, ports: int = 1, hops: int = 1) -> float:
    """Send `bytes_` from one chip to another over `ports` links in parallel, `hops` away."""
    _check(bytes_, 1)
    return bytes_ / (ports * link.bw) + hops * link.latency_s


def latency_bound_bytes(link: Link) -> float:
    """Bytes per hop below which a collective is latency-bound: W * T_hop (45 kB on v5e)."""
    return link.bw * link.latency_s


def hierarchical_bw(levels: list[tuple[int, float]]) -> float:
    """Effective AllGather bandwidth of a tree of (degree D_i, link bandwidth W_i) levels, e.g. an
    H100 SuperPod: min_i D_i*W_i/(D_i-1) (Part 12)."""
    if not levels:
        raise ValueError("hierarchical_bw needs at least one (degree, bandwidth) level")
    return min(d * w / (d - 1) for d, w in levels if d > 1)


def collective_intensity(
    hw: HardwareSpec, dtype: str = "bf16", *, link: Link | None = None
) -> float:
    """alpha = C / W_collective in FLOPs per byte (v5e: 1.97e14/9e10 = 2189; H100 node: 2200).
    Above this many tokens per chip, data parallelism is compute-bound (Part 5 and 12)."""
    link = link or Link.ici(hw)
    return hw.flops(dtype) / link.ring_bw


def tp_comms_limit(d_ff: int, hw: HardwareSpec, dtype: str = "bf16", *, n_axes: int = 1) -> float:
    """Largest 1D Megatron tensor-parallel degree Y before the MLP turns comms-bound:
    Y < n_axes * F / alpha (Part 5). Independent of precision."""
    return n_axes * d_ff / collective_intensity(hw, dtype)


def generate_tp_limit(d_ff: int, batch: int, beta: float) -> float:
    """Memory-bound generation: model parallelism Y above which the ICI time 2BD/W_ici exceeds the
    weight-load time 2DF/(Y*W_hbm), Y = F/(B*beta) with beta = W_hbm/W_ici (Part 7)."""
    if batch < 1 or beta <= 0:
        raise ValueError(f"generate_tp_limit needs batch >= 1 and beta > 0, got {batch}, {beta}")
    return d_ff / (batch * beta)
