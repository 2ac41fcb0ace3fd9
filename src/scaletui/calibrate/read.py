"""calibrate's `hbm_bw`: the read bandwidth a decode step meets, as read-only GEMVs over
weight-shaped matrices past the last-level cache, through XLA and (CPU) the server's native dense
kernel, the faster kernel's plateau; `ReadStream` times it one pass at a time between other work
(bench/calibrate_check.py). The old in-place scale (read + write) stays for reference."""

from __future__ import annotations

from collections.abc import Callable

from scaletui.calibrate.timing import (
    READ_SHAPE,
    Sizes,
    _median_time,
    _Passes,
    _summary,
    pick_read_bw,
)


def _read_stream(jax, jnp, device, sizes: Sizes) -> _Passes:
    """Read-only stream over each working set of `sizes.read_points`, ready to time in passes
    (`calibrate` spreads its `sizes.windows` passes over the whole run: memory bandwidth on a
    shared host drifts over tens of seconds; `_read_figure` then takes the plateau).

    The decode step's own op at batch 1: `h[1, D] @ W[D, F]` for each of a list of f32 weight
    matrices, in one jitted call (contracting the weight's leading axis, as the model's dense
    layers do), nothing written back but F floats per matrix. XLA:CPU's kernel matters: a dot
    per row, a column sum or a batched einsum over the same bytes each read at another speed. On
    CPU the same product also runs through the server's own dense kernel over packed panels
    (keys ("native", bytes)), and hbm_bw is the faster of the two: the native kernel can read
    faster than XLA's GEMVs, and an XLA-only roof would be one the engine's batch-1 step beats
    (docs/roofline.md, "`scaletui calibrate`", has the measured rates). Every core the server uses:
    XLA:CPU runs one op on its intra-op thread pool, one thread per host core, shared by the
    server's jitted steps; this runs on that same default backend unpinned."""
    gemvs = jax.jit(lambda h, ws: [h @ w for w in ws])
    h = jax.device_put(jnp.ones((1, READ_SHAPE[0]), jnp.float32), device)
    mat = READ_SHAPE[0] * READ_SHAPE[1] * 4
    count = sizes.read_points[-1] // mat
    # one list of matrices; the smaller working sets are its first matrices (no more memory)
    ws = [jax.device_put(jnp.ones(READ_SHAPE, jnp.float32), device) for _ in range(count)]
    calls: dict = {
        n: (lambda k=n // mat: jax.block_until_ready(gemvs(h, ws[:k]))) for n in sizes.read_points
    }
    own = _native_read(jax, device, h, count)
    if own is not None:
        calls.update({("native", n): (lambda k=n // mat: own(k)) for n in sizes.read_points})
    return _Passes(calls, sizes.windows, sizes.reps, sizes.min_time_s / 3)


def _native_read(jax, device, h, count: int) -> Callable[[int], object] | None:
    """k -> h @ each of the first k of `count` READ_SHAPE f32 weights packed as the server packs
    them, through its native dense kernel (blocking); None off CPU or without the kernels."""
    if device.platform != "cpu":
        return None
    import numpy as np

    from scaletui.serve.engine import native  # the kernels' build: cached, or compiled once here

    if not native.available():
        return None
    panels = native.pack(np.ones(READ_SHAPE, np.float32))
    ws = [jax.device_put(panels.copy(), device) for _ in range(count)]  # a buffer each
    f = READ_SHAPE[1]
    gemvs = jax.jit(lambda h, ws: [native.dense(h, w, f) for w in ws])
    return lambda k: jax.block_until_ready(gemvs(h, ws[:k]))


def _read_curves(timed: dict) -> dict[str, list[dict]]:
    """{kernel: [{bytes, bw, pass_bws}] by working set} from `_Passes.result()` of
    `_read_stream` (XLA's keys are the bytes, the native kernel's ("native", bytes))."""
    curves: dict[str, list[dict]] = {}
    for key, (t, _, medians) in timed.items():
        kernel, n = key if isinstance(key, tuple) else ("xla", key)
        point = {"bytes": n, "bw": n / t, "pass_bws": [n / x for x in medians]}
        curves.setdefault(kernel, []).append(point)
    return curves


def _read_figure(passes: _Passes, sizes: Sizes) -> dict:
    timed = passes.result()
    curves = _read_curves(timed)
    plateaus = {k: pick_read_bw(c, sizes.llc_bytes) for k, c in curves.items()}
    kernel = max(plateaus, key=plateaus.get)
    largest = sizes.read_points[-1]
    t, runs, _ = timed[largest if kernel == "xla" else (kernel, largest)]
    last = _summary(t, runs)
    llc = f"LLC {sizes.llc_bytes} B" if sizes.llc_bytes else "LLC unknown"
    each = ", ".join(f"{k} {bw / 1e9:.1f} GB/s" for k, bw in plateaus.items())
    method = (
        f"read-only GEMVs h[1, {READ_SHAPE[0]}] @ W[{READ_SHAPE[0]}, {READ_SHAPE[1]}] f32 over a "
        "list of matrices in one call (jit, block_until_ready), through XLA's dot"
        + (" and scaletui's native dense kernel (packed panels)" if len(curves) > 1 else "")
        + f", at working sets {list(sizes.read_points)} B ({llc}), timed round robin in "
        f"{sizes.windows} passes spread over the calibration, each point its fastest pass's "
        f"median (>= {sizes.reps} runs in all after a warm-up); per kernel the median of the "
        f"points >= 8x LLC ({each}); bw = the faster kernel's ({kernel}); bytes read only"
    )
    return {
        "bw": plateaus[kernel],
        "kernel": kernel,
        "method": method,
        "working_set_bytes": largest,
        "llc_bytes": sizes.llc_bytes,
        "curve": curves[kernel],
        "curves": curves,
        "bytes_moved": largest,
        **last,
    }


SPREAD_NOTE_AT = 1.15  # read passes further apart than this get a note


def read_spread_note(curve: list[dict]) -> str | None:
    """A note when the read stream's passes at its largest working set disagree by more than
    SPREAD_NOTE_AT: the host's memory bandwidth moved during the calibration. On a shared VM it
    can flip between two speeds for seconds to minutes at a time, so two calibrations agree only
    when both fall in the same spell (docs/roofline.md, "`scaletui calibrate`")."""
    bws = max(curve, key=lambda p: p["bytes"])["pass_bws"]
    if len(bws) < 2 or max(bws) <= SPREAD_NOTE_AT * min(bws):
        return None
    return (
        f"hbm_bw: the read passes ranged {min(bws) / 1e9:.1f}-{max(bws) / 1e9:.1f} GB/s, so this "
        "host's memory bandwidth moved during the calibration (a shared host or VM); hbm_bw is "
        "the fastest pass, and a calibration run wholly in a slow spell reads lower"
    )


class ReadStream:
    """calibrate's `hbm_bw` method, timed one pass at a time between other work: a check that
    compares another read with hbm_bw interleaves their passes, so both see the same host (a
    shared host's read bandwidth can swing within a minute; bench/calibrate_check.py)."""

    def __init__(self, device=None, sizes: Sizes | None = None) -> None:
        import jax
        import jax.numpy as jnp

        self.sizes = sizes or Sizes.for_backend(jax.default_backend())
        device = device or jax.devices()[0]
        self._passes = _read_stream(jax, jnp, device, self.sizes)

    def run(self) -> None:
        """One pass over every working set."""
        self._passes.run()

    def bw(self) -> float:
        """hbm_bw over the passes run so far, as calibrate judges it (bytes/s)."""
        return _read_figure(self._passes, self.sizes)["bw"]

    def last_pass_bw(self) -> float:
        """hbm_bw of the latest pass alone (bytes/s): the faster kernel's plateau, as calibrate
        judges it, over that pass's medians. A check beside another read compares pass with
        pass: on a shared host the read bandwidth can jump for seconds to minutes at a time
        (docs/roofline.md, "`scaletui calibrate`"), so the fastest pass of each side may come
        from different spells."""
        latest = {k: (m[-1], [], [m[-1]]) for k, m in self._passes.medians.items()}
        return max(pick_read_bw(c, self.sizes.llc_bytes) for c in _read_curves(latest).values())


def _copy_bw(jax, jnp, device, nbytes: int, reps: int, min_s: float) -> dict:
    n = nbytes // 4
    scale = jax.jit(lambda x, s: x * s, donate_argnums=0)
    s = jax.device_put(jnp.float32(1.0), device)
    state = {"x": jax.device_put(jnp.ones((n,), jnp.float32), device)}  # [n] f32

    def run() -> None:
        state["x"] = scale(state["x"], s)
        state["x"].block_until_ready()

    t, runs = _median_time(run, reps, min_s)
    moved = 2 * n * 4  # read + write
    method = (
        f"in-place x * s over {n * 4} B f32, buffer donated; bytes = read + write = {moved}; "
        f"median of >= {reps} runs; reference only (a decode step reads, it does not copy)"
    )
    return {"bw": moved / t, "method": method, "bytes_moved": moved, **_summary(t, runs)}
