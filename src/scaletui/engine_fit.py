"""`scaletui calibrate --model M`: time the real engine over a small grid and fit the cost model.

The grid (docs/roofline.md, the "expected" level): for a server configuration (model, slots,
max_seq_len, decode_steps, tp, dp, precision, kernels), engines at a few slot counts (the JAX engine
computes every slot row, so a step's batch is its slot count) stay built side by side; in each,
every slot holds a prompt that keeps the generate call inside one KV bucket, and generate calls of 1
and `decode_steps` steps are timed (the two tell the per-call sync from the per-step cost). Prefill
is timed at a few of the engine's prompt buckets. `costmodel.fit` turns the samples into a
CostModel; `fitstore.save_fit` stores it beside `local`, under the precision it ran in.

Timing on a shared host drifts by 10-20 % over tens of seconds, so every point is timed in
`rounds` passes over the whole grid (round robin), `calls` calls a pass after one untimed call,
and the point's time is the median over all its calls: a slow spell lands on every point alike
instead of on whichever point it happened to hit.

This module imports JAX through the engine; `roofline/` stays JAX-free.
"""

from __future__ import annotations

import datetime as dt
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from scaletui.roofline.costfit import fit
from scaletui.roofline.costmodel import CostModel
from scaletui.roofline.samples import DecodeSample, PrefillSample
from scaletui.serve.engine.engine_api import SamplingParams
from scaletui.shape import ServerShape

__all__ = [
    "DecodePoint",
    "Grid",
    "fit_engine",
    "grid_for",
    "measure",
    "prompt_len_for",
    "stderr_log",
]


@dataclass(frozen=True)
class DecodePoint:
    batch: int  # slots of the engine (every row is computed)
    context: int  # the KV bucket the call runs in
    steps: int  # decode steps per generate call


@dataclass(frozen=True)
class Grid:
    """What to time: decode points, prefill prompt lengths, and how often."""

    decode: tuple[DecodePoint, ...]
    prefill: tuple[int, ...] = ()  # prompt lengths (the engine's power-of-two buckets)
    calls: int = 3  # timed calls per point and pass, after one untimed call
    rounds: int = 3  # passes over the grid

    def __post_init__(self) -> None:
        if not self.decode or self.calls < 1 or self.rounds < 1:
            raise ValueError(f"an empty grid: {self}")

    @classmethod
    def product(
        cls,
        batches: Sequence[int],
        contexts: Sequence[int],
        steps: Sequence[int],
        prefill: Sequence[int] = (),
        **how: int,
    ) -> Grid:
        points = tuple(DecodePoint(b, c, s) for b in batches for c in contexts for s in steps)
        return cls(points, tuple(prefill), **how)


def _spread(values: Sequence[int], k: int) -> tuple[int, ...]:
    """k values spread over sorted distinct `values` (first and last included)."""
    v = sorted(set(values))
    if len(v) <= k:
        return tuple(v)
    return tuple(sorted({v[round(i * (len(v) - 1) / (k - 1))] for i in range(k)}))


def grid_for(
    config: ServerShape,
    decode_buckets: Sequence[int],
    prefill_buckets: Sequence[int],
    quick: bool = False,
) -> Grid:
    """The default grid for a server configuration: batches dp, ~slots/4, slots (multiples of
    dp: the slot counts a user turns to around this one), three KV buckets (first, middle, last),
    steps {1, decode_steps}; at `slots` rows, the batch the server always decodes at, also every
    other KV bucket at decode_steps (a step is concave in the context on a CPU, so a chord between
    distant buckets reads low in between, where a loaded server spends most of its calls;
    docs/roofline.md, "Three levels of prediction"). Then the prompt buckets that those contexts'
    prompts fill (so the prefill compiles serve both) and every smaller one. `quick` times 2 calls
    in 3 passes (in 2, one slow spell of a shared host could skew a third of a quick fit's
    points)."""
    s, dp = config.slots, config.dp
    quarter = max(dp, round(s / 4 / dp) * dp)
    batches = sorted({dp, quarter, s})
    steps = sorted({1, config.decode_steps})
    how = {"calls": 2, "rounds": 3} if quick else {"calls": 3, "rounds": 3}
    contexts = _spread(decode_buckets, 3)
    points = [DecodePoint(b, c, n) for b in batches for c in contexts for n in steps]
    points += [
        DecodePoint(s, c, config.decode_steps)
        for c in sorted(set(decode_buckets))
        if c not in contexts
    ]
    prefill = set()
    for c in sorted({p.context for p in points}):
        prev = max((b for b in decode_buckets if b < c), default=0)
        n = min(prompt_len_for(c, prev, max(steps), how["calls"]), config.max_seq_len - 2)
        prefill.add(next((b for b in prefill_buckets if b >= n), prefill_buckets[-1]))
    if len(prefill) < 2:  # one KV bucket (a short max_seq_len): the fit needs two lengths
        prefill.add(prefill_buckets[0])
    # every prompt bucket up to the longest: the server pads a prompt to one of them, and its
    # prefill is then the measured time, not the form's guess between two (-10 % at 128 here)
    prefill |= {b for b in prefill_buckets if b <= max(prefill)}
    return Grid(tuple(points), tuple(sorted(prefill)), **how)


def prompt_len_for(bucket: int, prev_bucket: int, steps: int, calls: int) -> int:
    """A prompt long enough to need KV `bucket` and short enough that `calls + 1` generate calls
    of `steps` steps stay inside it (the engine picks the bucket of the longest row + steps)."""
    n = bucket - steps * (calls + 1) - 1
    return max(1, n if n > prev_bucket else prev_bucket + 1)


MIN_POINT_S = 0.03  # a pass times a point for at least this long: short calls get more blocks


class _Timer:
    """Timed calls with the median over every pass."""

    def __init__(self, min_s: float = MIN_POINT_S) -> None:
        self.times: dict[object, list[float]] = {}
        self.min_s = min_s

    def run(
        self,
        key: object,
        fn: Callable[[], object],
        calls: int,
        reset: Callable[[], object] | None = None,
    ) -> None:
        """Blocks of one untimed call (compiles on first use, warms caches) and `calls` timed
        ones, `reset` (untimed) before every block after the first, until the timed calls add
        up to `min_s` (at most 8 blocks): a call of a few ms timed 3 times a pass read tens of
        percent apart from one fit to the next. A decode block's calls advance its sequences, so
        `reset` puts them back inside the KV bucket being timed."""
        got = self.times.setdefault(key, [])
        spent = 0.0
        for block in range(8):
            if block and spent >= self.min_s:
                break
            if block and reset is not None:
                reset()
            fn()
            for _ in range(calls):
                t0 = time.perf_counter()
                fn()
                got.append(time.perf_counter() - t0)
                spent += got[-1]

    def median(self, key: object) -> float:
        return statistics.median(self.times[key])

    def spread(self, key: object) -> tuple[float, ...]:
        """Each timed call over the median."""
        mid = self.median(key)
        return tuple(round(t / mid, 4) for t in self.times[key])


def _prompt(engine, n: int) -> list[int]:
    rng = np.random.default_rng(n)
    return [int(t) for t in rng.integers(1, engine.vocab_size, n)]


def _prefill_call(eng, tokens: list[int], params: SamplingParams) -> Callable[[], None]:
    """One prompt's prefill as the server runs it: an interleaved engine writes it straight into
    a slot's pages (`prefill_pages`, what the scheduler calls); a disaggregated server's prefill
    engine runs the contiguous `prefill`."""
    if eng.role != "both":
        return lambda: eng.prefill(tokens, params)
    from scaletui.serve.scheduling.paging import fixed_table

    state, row = [eng.init_decode_state()], fixed_table(eng)[0]

    def call() -> None:
        state[0], _ = eng.prefill_pages(state[0], tokens, params, 0, row)

    return call


def measure(
    config: ServerShape,
    devices: list,
    grid: Grid,
    *,
    host_params: dict | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> tuple[list[DecodeSample], list[PrefillSample]]:
    """Time `grid` on engines of `config` (one per batch in the grid, slots = batch) on
    `devices`. Returns the decode samples (one per point, whole generate calls) and the prefill
    samples (one per prompt length, on the largest engine)."""
    from scaletui.serve.engine.build import build_engines
    from scaletui.serve.scheduling.paging import fixed_table
    from scaletui.serve.weights import quant, weights

    m, p = config.model, config.precision
    if host_params is None:
        host_params = weights.dummy_params(m, config.seed, config.dtype)
    host_params = quant.convert_params(host_params, p.compute, p.weights)  # once, not per engine
    engines = {}
    for b in sorted({p.batch for p in grid.decode}):
        engines[b] = build_engines(replace(config, slots=b), devices, host_params=host_params)[1]
    big = engines[max(engines)]
    max_steps = max(p.steps for p in grid.decode)
    prefixes = {}  # prefilled once on the largest engine; every engine (same mesh) takes them
    for c in sorted({p.context for p in grid.decode}):
        prev = max((b for b in big.decode_buckets if b < c), default=0)
        n = min(prompt_len_for(c, prev, max_steps, grid.calls), config.max_seq_len - 2)
        params = SamplingParams(max_tokens=config.max_seq_len - n, ignore_eos=True)
        prefixes[c] = big.prefill(_prompt(big, n), params)
    timer = _Timer()
    for r in range(grid.rounds):
        for p in grid.decode:
            eng, prefix = engines[p.batch], prefixes[p.context]
            state, table = [None], fixed_table(eng)  # `fill` makes the state

            def fill(eng=eng, state=state, prefix=prefix, table=table) -> None:
                """Every slot back at the prefix: the block's calls stay in its KV bucket."""
                state[0] = eng.init_decode_state()
                for slot in range(eng.slots):
                    state[0] = eng.insert(state[0], prefix, slot, table[slot])

            def call(eng=eng, state=state, steps=p.steps, table=table) -> None:
                state[0], _ = eng.generate(state[0], steps, table)

            fill()
            timer.run(p, call, grid.calls, reset=fill)
        for n in grid.prefill:  # a prompt fills its bucket, leaving one position to generate
            params = SamplingParams(max_tokens=1, ignore_eos=True)
            tokens = _prompt(big, min(n, config.max_seq_len - 1))
            timer.run(("prefill", n), _prefill_call(big, tokens, params), grid.calls)
        log(f"pass {r + 1}/{grid.rounds} done")
    decode = [
        DecodeSample(
            batch=p.batch,
            context=p.context,
            steps=p.steps,
            seconds=timer.median(p),
            spread=timer.spread(p),
        )
        for p in grid.decode
    ]
    prefill = [
        PrefillSample(tokens=n, seconds=timer.median(k), spread=timer.spread(k))
        for n in grid.prefill
        for k in [("prefill", n)]
    ]
    for s in decode:
        log(
            f"decode batch {s.batch:4d} context {s.context:5d} steps {s.steps:2d}: "
            f"{s.seconds * 1e3:8.2f} ms"
        )
    for s in prefill:
        log(f"prefill {s.tokens:5d} tokens: {s.seconds * 1e3:8.2f} ms")
    return decode, prefill


def fit_engine(
    config: ServerShape,
    devices: list,
    base: CostModel,
    *,
    quick: bool = False,
    grid: Grid | None = None,
    host_params: dict | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> CostModel:
    """Time `config`'s engine over `grid` (default `grid_for`) and fit `base` (an assumed model
    for the same model, precision and mesh) to it; the fit's info says when, where, how long and on
    what grid it was made, with the raw samples. The fit records the kernels the engine ran
    (what `auto` resolved to: the simulator prices a part-filled batch by them)."""
    from scaletui.serve.engine.build import build_engines, plan_engines

    t0 = time.perf_counter()
    base = replace(base, kernels=plan_engines(config, devices)[-1].kernels)
    if grid is None:
        _, eng = build_engines(replace(config, slots=config.dp), devices)
        grid = grid_for(config, eng.decode_buckets, eng.prefill_buckets, quick)
        del eng
    decode, prefill = measure(config, devices, grid, host_params=host_params, log=log)
    took = time.perf_counter() - t0
    return fit(
        base,
        decode,
        prefill,
        host=platform.node() or "host",
        date=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        seconds=round(took, 1),
        grid={"calls": grid.calls, "rounds": grid.rounds},
        server=config.to_json(),  # the shape timed: its fit_key() says where the fit is stored
        samples={
            "decode": [[s.batch, s.context, s.steps, round(s.seconds, 6)] for s in decode],
            "prefill": [[s.tokens, round(s.seconds, 6)] for s in prefill],
        },
    )


def stderr_log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
