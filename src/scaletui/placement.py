"""Where a server's devices go over hosts: `place()`, one pure function that the roofline (which
mesh axes it prices at DCN speed) and the server (which devices each mesh takes) both call.

The book's advice ("How to Scale Your Model", Part 5 and Part 12 on tensor parallelism, Part 7
on disaggregation): a `tp` group all-reduces twice per layer per step, so it stays where the
fast links are (a host's NVLink, a TPU slice's ICI); `dp` replicas share nothing per step, so
they go across hosts; disaggregated prefill and generate sets go on different hosts, since the
KV cache crosses once per request, not every step. `tp` over hosts is allowed only when asked.

Devices are numbered host by host: host h holds h*D .. h*D+D-1 (D devices per host), the order
a multi-process JAX run lists them in (by process). Prefill takes the first devices, generate
the next, as the server's split does (serve/weights/sharding.split_devices). Imports nothing of
ours.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AXES", "Layout", "Placement", "place"]

# mesh axes a placement reports on: the server's mesh ('data', 'model') and the KV hand-over
AXES = ("model", "data", "transfer")


def _check_int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} should be an integer >= {low}, got {value!r}")


@dataclass(frozen=True)
class Layout:
    """The machines: `hosts` processes of `devices_per_host` devices, and which hosts share one
    fast-link domain. A TPU slice's hosts share ICI (hosts_per_slice = all of them); a GPU box's
    NVLink ends at the box (hosts_per_slice = 1). DCN joins the slices."""

    hosts: int = 1
    devices_per_host: int = 1
    hosts_per_slice: int = 1  # hosts joined by ICI/NVLink; slices are joined by DCN

    def __post_init__(self) -> None:
        _check_int("hosts", self.hosts, 1)
        _check_int("devices_per_host", self.devices_per_host, 1)
        _check_int("hosts_per_slice", self.hosts_per_slice, 1)
        if self.hosts % self.hosts_per_slice:
            raise ValueError(
                f"hosts ({self.hosts}) should be a multiple of hosts_per_slice "
                f"({self.hosts_per_slice})"
            )

    @property
    def devices(self) -> int:
        return self.hosts * self.devices_per_host

    @property
    def devices_per_slice(self) -> int:
        return self.hosts_per_slice * self.devices_per_host

    def host_of(self, device: int) -> int:
        return device // self.devices_per_host

    def slice_of(self, device: int) -> int:
        return device // self.devices_per_slice


@dataclass(frozen=True)
class Placement:
    """Which devices each mesh takes, and which mesh axes leave a host (and a slice)."""

    layout: Layout
    tp: int
    dp: int
    prefill: tuple[tuple[int, ...], ...]  # disaggregated: the prefill tp groups; () interleaved
    generate: tuple[tuple[int, ...], ...]  # dp groups of tp device ids
    crosses_hosts: tuple[str, ...]  # axes of AXES whose groups span more than one host
    crosses_slices: tuple[str, ...]  # those that leave the ICI domain: priced at DCN speed

    def _widest(self, of: int) -> tuple[int, int]:
        """(units one tp group spans, its devices per unit) for the worst tp group, where a unit
        is `of` devices (a host or a slice)."""
        spans = [len({d // of for d in g}) for g in (*self.prefill, *self.generate)]
        units = max(spans)
        return units, self.tp // units

    @property
    def tp_hosts(self) -> int:
        """Hosts one tp group spans (1: within a host)."""
        return self._widest(self.layout.devices_per_host)[0]

    @property
    def tp_slices(self) -> int:
        """Slices one tp group spans (1: its collectives stay on ICI/NVLink)."""
        return self._widest(self.layout.devices_per_slice)[0]

    @property
    def tp_per_slice(self) -> int:
        """Devices of one tp group in each slice it spans."""
        return self._widest(self.layout.devices_per_slice)[1]

    def to_dict(self) -> dict:
        """The JSON-able view (`scaletui roofline --json`'s `placement`)."""
        return {
            "hosts": self.layout.hosts,
            "devices_per_host": self.layout.devices_per_host,
            "hosts_per_slice": self.layout.hosts_per_slice,
            "tp": self.tp,
            "dp": self.dp,
            "prefill": [list(g) for g in self.prefill],
            "generate": [list(g) for g in self.generate],
            "crosses_hosts": list(self.crosses_hosts),
            "crosses_slices": list(self.crosses_slices),
            "tp_hosts": self.tp_hosts,
            "tp_slices": self.tp_slices,
        }


def _groups(start: int, n: int, tp: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(range(start + i * tp, start + (i + 1) * tp)) for i in range(n // tp))


def _crossing(layout: Layout, unit: int, pre: tuple, gen: tuple) -> tuple[str, ...]:
    """The axes of AXES whose groups span more than one `unit` (devices per host or slice)."""

    def units(devs: tuple[int, ...]) -> frozenset[int]:
        return frozenset(d // unit for d in devs)

    out = []
    if any(len(units(g)) > 1 for g in (*pre, *gen)):
        out.append("model")
    if len({units(g) for g in gen}) > 1:  # two dp replicas on different hosts
        out.append("data")
    if pre and len(units(tuple(d for g in (*pre, *gen) for d in g))) > 1:
        out.append("transfer")  # any prefill group may hand over to any generate replica
    return tuple(out)


def place(
    tp: int,
    dp: int,
    layout: Layout,
    *,
    prefill_devices: int = 0,
    tp_over_hosts: bool = False,
) -> Placement:
    """Place a (dp, tp) generate mesh, and with `prefill_devices` > 0 a disaggregated prefill
    set (prefill_devices / tp groups of tp), on `layout`. By default every tp group stays within
    a host (tp divides devices_per_host) and prefill and generate start on different hosts
    when both fit that way; a tp group spans hosts only when tp > devices_per_host, and, where
    that leaves the slice, only with `tp_over_hosts` (its all-reduces then run at DCN speed).
    ValueError names the value that cannot be placed."""
    _check_int("tp", tp, 1)
    _check_int("dp", dp, 1)
    _check_int("prefill_devices", prefill_devices, 0)
    per_host = layout.devices_per_host
    if tp <= per_host and per_host % tp:
        raise ValueError(
            f"tp={tp} does not divide devices_per_host={per_host}: a tp group would straddle "
            f"two hosts; use a tp that divides {per_host}"
        )
    if tp > per_host and tp % per_host:
        raise ValueError(
            f"tp={tp} spans hosts of {per_host} devices but is not a multiple of {per_host}"
        )
    if prefill_devices % tp:
        raise ValueError(f"prefill_devices ({prefill_devices}) should be a multiple of tp={tp}")
    n_gen = tp * dp
    if prefill_devices + n_gen > layout.devices:
        raise ValueError(
            f"prefill_devices {prefill_devices} + tp*dp {n_gen} = {prefill_devices + n_gen} "
            f"devices, but {layout.hosts} hosts x {per_host} hold {layout.devices}"
        )
    hosts_of = lambda n: -(-n // per_host)  # noqa: E731
    start = prefill_devices
    if prefill_devices and hosts_of(prefill_devices) + hosts_of(n_gen) <= layout.hosts:
        start = hosts_of(prefill_devices) * per_host  # generate on its own hosts
    pre = _groups(0, prefill_devices, tp)
    gen = _groups(start, n_gen, tp)
    hosts = _crossing(layout, per_host, pre, gen)
    slices = _crossing(layout, layout.devices_per_slice, pre, gen)
    if "model" in slices and not tp_over_hosts:
        raise ValueError(
            f"tp={tp} spans {hosts_of(tp)} hosts of {per_host} devices: its all-reduces would "
            f"run at DCN speed; ask for it (tp_over_hosts, --tp-over-hosts) or keep tp <= "
            f"{layout.devices_per_slice} and put dp across hosts"
        )
    return Placement(layout, tp, dp, pre, gen, hosts, slices)
