"""Mixed batches on and off under the same Poisson load at ~70% of capacity: TTFT p99 and
TPOT p99 side by side, as ratios (on / off).

Drives the real engine's scheduler in-process (no HTTP, so the figures are the server's own),
default model `small` with dummy weights. Capacity is measured first, with mixing off: a burst
of 2 x slots requests at once, completed requests per second. Then one Poisson schedule at
`--load` of it (seeded: the same arrivals and lengths) runs against a server with
--mixed-batches off and then on. The token budget's prediction for TPOT: a mixed call adds at
most one budget's piece to one step of each call, so TPOT p99 may rise by at most a piece's
time (`piece_ms`: the mean time of an unmixed `prefill_pages` piece, measured in the off run).
`--one-piece` adds a third run, mixing with one piece a call (policy.MIX_PIECES = 1, as before
several pieces rode together) beside the default's packing. `--json` prints one JSON object.

    python bench/mixed_batches.py --model small --requests 200
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import numpy as np  # noqa: E402
import orjson  # noqa: E402
from _smoke import NO_WARMUP, shrink  # noqa: E402

from scaletui import policy  # noqa: E402
from scaletui.serve.engine.build import JaxEngineFactory  # noqa: E402
from scaletui.serve.engine.engine_api import SamplingParams  # noqa: E402
from scaletui.serve.scheduling.events import Failed, Request  # noqa: E402
from scaletui.serve.scheduling.scheduler import Scheduler  # noqa: E402
from scaletui.shape import ServerShape  # noqa: E402
from scaletui.specs import load_model  # noqa: E402


async def one(sched: Scheduler, prompt: list[int], out: int, at: float) -> tuple[float, float]:
    """Send at `at` (perf_counter); -> (TTFT, TPOT) in seconds (TPOT nan for one token)."""
    await asyncio.sleep(max(0.0, at - time.perf_counter()))
    params = SamplingParams(max_tokens=out, ignore_eos=True)
    req = Request(prompt, params, asyncio.get_running_loop())
    t0 = time.perf_counter()
    sched.submit(req)
    first, n = None, 0
    while True:
        event = await req.events.get()
        if isinstance(event, Failed):
            raise RuntimeError(event.message)
        now = time.perf_counter()
        first = now if first is None else first
        n += len(event.ids)
        if event.finish:
            return first - t0, (now - first) / (n - 1) if n > 1 else float("nan")


async def run(sched: Scheduler, prompts, outs, offsets) -> tuple[list, list, float]:
    t0 = time.perf_counter() + 0.05
    tasks = [one(sched, p, o, t0 + s) for p, o, s in zip(prompts, outs, offsets, strict=True)]
    got = await asyncio.gather(*tasks)
    return [g[0] for g in got], [g[1] for g in got], time.perf_counter() - t0


def serve(shape: ServerShape, warmup: bool, pieces: list[float] | None = None) -> Scheduler:
    sched = Scheduler(shape, JaxEngineFactory(), warmup=warmup)
    sched.start()
    assert sched.state == "serving", sched.error
    if pieces is not None:  # time every prefill_pages piece (the off run's)
        engine = sched.engines[0]
        real = engine.prefill_pages

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return real(*a, **kw)
            finally:
                pieces.append(time.perf_counter() - t)

        engine.prefill_pages = timed
    return sched


def p99(xs) -> float:
    return float(np.nanpercentile(np.asarray(xs, float), 99))


def p50(xs) -> float:
    return float(np.nanpercentile(np.asarray(xs, float), 50))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--budget", type=int, default=64, help="--max-batched-tokens")
    p.add_argument("--decode-steps", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=192, help="mean; uniform +- 50%%")
    p.add_argument("--output-len", type=int, default=64, help="mean; uniform +- 50%%")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--load", type=float, default=0.7, help="fraction of the measured capacity")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--one-piece", action="store_true", help="and mixing one piece a call")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help=NO_WARMUP)
    shrink(p, model="tiny", slots=4, max_seq_len=64, budget=16, prompt_len=24, output_len=8,
           requests=12, warmup=False)  # fmt: skip
    a = p.parse_args(argv)
    shape = ServerShape(
        load_model(a.model),
        slots=a.slots,
        max_seq_len=a.max_seq_len,
        page_size=16,
        max_batched_tokens=a.budget,
        decode_steps=a.decode_steps,
        mixed_batches=False,
    )
    rng = np.random.default_rng(a.seed)
    spread = lambda mean, n: rng.integers(max(1, mean // 2), mean + mean // 2 + 1, n)  # noqa: E731
    ins, outs = spread(a.prompt_len, a.requests), spread(a.output_len, a.requests)
    prompts = [rng.integers(1, 250, n).tolist() for n in ins]  # distinct: no prefix hits
    outs = [int(o) for o in outs]
    pieces: list[float] = []
    off = serve(shape, a.warmup, pieces)
    try:
        burst = 2 * a.slots
        _, _, took = asyncio.run(run(off, prompts[:burst], outs[:burst], [0.0] * burst))
        capacity = burst / took
        rate = a.load * capacity
        offsets = np.cumsum(rng.exponential(1 / rate, a.requests)).tolist()
        pieces.clear()
        ttft_off, tpot_off, took_off = asyncio.run(run(off, prompts, outs, offsets))
    finally:
        off.shutdown()
    on = serve(dataclasses.replace(shape, mixed_batches=True), a.warmup)
    try:
        ttft_on, tpot_on, took_on = asyncio.run(run(on, prompts, outs, offsets))
    finally:
        on.shutdown()
    extra = {}
    if a.one_piece:  # the same, one piece riding a call (compiled so, then put back)
        most, policy.MIX_PIECES = policy.MIX_PIECES, 1
        one_piece = serve(dataclasses.replace(shape, mixed_batches=True), a.warmup)
        try:
            ttft_1, tpot_1, took_1 = asyncio.run(run(one_piece, prompts, outs, offsets))
        finally:
            one_piece.shutdown()
            policy.MIX_PIECES = most
        extra = {"ttft_p99_ms": 1e3 * p99(ttft_1), "ttft_p50_ms": 1e3 * p50(ttft_1),
                 "tpot_p99_ms": 1e3 * p99(tpot_1), "tok_s": sum(outs) / took_1}  # fmt: skip
    piece_ms = 1e3 * float(np.mean(pieces)) if pieces else 0.0
    row = {
        "model": a.model,
        "slots": a.slots,
        "budget": a.budget,
        "capacity_rps": round(capacity, 3),
        "rate_rps": round(rate, 3),
        "ttft_p99_ms": {"off": 1e3 * p99(ttft_off), "on": 1e3 * p99(ttft_on)},
        "tpot_p99_ms": {"off": 1e3 * p99(tpot_off), "on": 1e3 * p99(tpot_on)},
        "piece_ms": piece_ms,
        "ttft_p50_ms": {"off": 1e3 * p50(ttft_off), "on": 1e3 * p50(ttft_on)},
        "tok_s": {"off": sum(outs) / took_off, "on": sum(outs) / took_on},
    }
    if extra:
        row["one_piece"] = extra
    row["ttft_p99_ratio"] = row["ttft_p99_ms"]["on"] / row["ttft_p99_ms"]["off"]
    row["tpot_p99_ratio"] = row["tpot_p99_ms"]["on"] / row["tpot_p99_ms"]["off"]
    rise = row["tpot_p99_ms"]["on"] - row["tpot_p99_ms"]["off"]
    row["tpot_within_budget"] = rise <= piece_ms
    if a.json:
        print(orjson.dumps(row).decode())
    else:
        print(f"{a.model}, {a.slots} slots, budget {a.budget}: capacity {capacity:.2f} req/s, "
              f"Poisson at {rate:.2f} req/s ({a.load:.0%})")  # fmt: skip
        for key in ("ttft_p99_ms", "ttft_p50_ms", "tpot_p99_ms", "tok_s"):
            v, one = row[key], row.get("one_piece", {}).get(key)
            print(f"  {key:12s} off {v['off']:8.1f}  on {v['on']:8.1f}  on/off "
                  f"{v['on'] / v['off']:.2f}" + ("" if one is None else f"  one piece a call "
                  f"{one:8.1f}"))  # fmt: skip
        print(
            f"  TPOT p99 rise {rise:.1f} ms, a budget's piece {piece_ms:.1f} ms: "
            f"{'within' if row['tpot_within_budget'] else 'past'} the budget's prediction"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
