"""The cross-process all-reduce: `scaletui calibrate` run over several JAX processes measures
the link between them (DCN between hosts; on one machine, the loopback that `--processes N`
servers share) and writes it into the `local` spec as the measured `dcn_bw` and `dcn_latency_s`.

1. The mesh takes one device of each process, so every byte of the psum crosses processes.
2. Every process runs the same fixed number of calls per size (a collective waits for all of
   them; a time-based count would differ between processes and hang the last call).
3. The p50 time per size is fitted (least squares of the relative error) as t = a + b * V
   (V bytes per process) to the ring's 2(n-1)/n * V / W + 2(n-1) * latency, the form
   `roofline.collectives.all_reduce_s` prices a DCN all-reduce with (a switched link: n-1
   hops): W = 2(n-1) / (n b), latency = a / (2(n-1)).
4. The spread (p10/p50/p90 of W) comes from the largest size's calls, each one's bus bandwidth.
"""

from __future__ import annotations

import numpy as np

from scaletui.roofline.band import Spread

SIZES = (4, 1 << 16, 1 << 20, 1 << 22)  # bytes per process: latency-bound to bandwidth-bound
REPS, QUICK_REPS = 30, 12  # timed calls per size (after one warm-up call)


def fit_link(points: list[tuple[float, float]], n: int) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s per hop) of the least-squares line through (bytes per
    process, seconds) all-reduce points over `n` processes; ValueError when the points do not
    give a positive bandwidth (too few sizes, or times that fall with the size)."""
    if n < 2:
        raise ValueError(f"an all-reduce across processes needs n >= 2, got {n}")
    if len({v for v, _ in points}) < 2:
        raise ValueError(f"fitting a link needs 2 or more sizes, got {points}")
    v, t = np.asarray(points, float).T
    if not (t > 0).all():
        raise ValueError(f"all-reduce times should be > 0 s, got {points}")
    b, a = np.polyfit(v, t, 1, w=1 / t)  # relative residuals: the small sizes count too
    if not b > 0:
        raise ValueError(f"all-reduce times do not grow with the size ({points}): no bandwidth")
    hops = 2 * (n - 1)
    return hops / (n * b), max(float(a), 0.0) / hops


def measure(quick: bool = False, sizes: tuple[int, ...] = SIZES) -> dict:
    """Time the psum over one device of each process (jax.distributed initialized by the
    caller, every process calling this alike) and return `measured.dcn`: the fit, the spread of
    the largest size's bandwidth, p10/p50/p90 seconds per size and how it was measured."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from scaletui.calibrate.spread import _timed

    first = {}
    for d in sorted(jax.devices(), key=lambda d: (d.process_index, d.id)):
        first.setdefault(d.process_index, d)
    n = len(first)
    if n < 2:
        raise ValueError(f"the cross-process all-reduce needs 2 or more processes, got {n}")
    mesh = Mesh(np.array(list(first.values())), ("p",))
    spec = PartitionSpec("p")
    sharding = NamedSharding(mesh, spec)
    psum = jax.jit(
        jax.shard_map(lambda x: jax.lax.psum(x, "p"), mesh=mesh, in_specs=spec, out_specs=spec)
    )
    reps = QUICK_REPS if quick else REPS
    rows, largest = [], []
    for nbytes in sizes:
        elems = max(nbytes // 4, 1)
        ones = np.ones((n * elems,), np.float32)
        x = jax.make_array_from_callback(ones.shape, sharding, lambda idx, a=ones: a[idx])
        psum(x).block_until_ready()  # compile and warm up
        times = [_timed(lambda x=x: psum(x).block_until_ready()) for _ in range(reps)]
        s = Spread.of(times)
        rows.append({"bytes": elems * 4, "p10_s": s.p10, "p50_s": s.p50, "p90_s": s.p90, "n": s.n})
        largest = times
    bw, latency = fit_link([(r["bytes"], r["p50_s"]) for r in rows], n)
    bus = [2 * (n - 1) / n * rows[-1]["bytes"] / t for t in largest]
    return {
        "bw": bw,
        "latency_s": latency,
        "processes": n,
        "backend": jax.default_backend(),
        "sizes": rows,
        "spread": Spread.of(bus).to_dict(),
        "method": (
            f"psum over one device of each of {n} processes (shard_map), {reps} calls at each of "
            f"{len(rows)} sizes ({rows[0]['bytes']}-{rows[-1]['bytes']} B per process); their "
            "p50 seconds fitted to 2(n-1)/n V / W + 2(n-1) latency"
        ),
    }


def merge(spec: dict, got: dict, where: str, date: str) -> dict:
    """The spec with `got` (`measure`'s) as its measured DCN: `dcn_bw`, `dcn_latency_s`, how
    (`methods.dcn_bw`), `measured.dcn`, `measured.spread.dcn_bw`, and a note in place of the
    one that said the DCN was not measured. `where` names the processes' hosts."""
    out = dict(spec)
    out["dcn_bw"] = got["bw"]
    out["dcn_latency_s"] = got["latency_s"]
    out["methods"] = {**(spec.get("methods") or {}), "dcn_bw": f"{got['method']}; {where}"}
    measured = dict(spec.get("measured") or {})
    measured["dcn"] = {**got, "where": where, "date": date}
    measured["spread"] = {**(measured.get("spread") or {}), "dcn_bw": got["spread"]}
    out["measured"] = measured
    notes = [n for n in spec.get("notes") or [] if not str(n).startswith("dcn_bw:")]
    s = got["spread"]
    notes.append(
        f"dcn_bw: all-reduce across {got['processes']} processes ({where}), "
        f"{s['p10'] / 1e9:.2f}-{s['p90'] / 1e9:.2f} GB/s p10-p90, latency "
        f"{got['latency_s'] * 1e6:.0f} us per hop, {date}"
    )
    out["notes"] = notes
    return out


def carry_over(old: dict | None, new: dict) -> dict:
    """A host calibration (`new`) keeps an earlier spec's measured DCN (`old`): one process
    cannot measure it, and it should not be reset to the stand-in."""
    dcn = ((old or {}).get("measured") or {}).get("dcn")
    if not dcn:
        return new
    return merge(new, dcn, dcn.get("where", "earlier"), dcn.get("date", "earlier"))
