"""How much a run's own length moves its figures: the simulator's median TTFT and TPOT over the
per-call draws alone (the same arrivals and lengths, `--draws` seeds of the fit's call spread),
for each run length in `--requests`, at one speed factor.

A measured run is one draw of the host's call-to-call variation; a simulated one is one draw
of the fit's `call_spread`. So a figure whose p10-p90 over draws is +-8 % cannot be matched
within 10 % by one simulated draw against one measured run, however right the model is:
docs/roofline.md ("A run's own noise") reads the as-run misses against this.

    python bench/sim_noise.py --fit FIT.yaml --model small --slots 4 --max-seq-len 1024 \\
        --requests 60 240 -- --arrival gamma --burstiness 0.5 --input-len 200 \\
        --input-dist uniform --input-spread 100 --output-len 96 --qps 3.16 --prompt-format ids

Arguments after `--` are `scaletui simulate`'s workload flags (arrivals, lengths, rate).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from scaletui.commands import simulate as cli
from scaletui.loadgen.workload import schedule
from scaletui.roofline.band import SpeedFactors
from scaletui.roofline.simband import simulate_at
from scaletui.roofline.simrecords import Load, SimTiming
from scaletui.specs import load_model

FIGURES = ("median_ttft_ms", "median_tpot_ms")


def noise(argv: list[str], requests: int, arrivals: int, draws: int, speed: float) -> list[dict]:
    """Per arrival seed: each figure's p10 / p50 / p90 over `draws` draw seeds."""
    args = cli.build_parser().parse_args([*argv, "--num-requests", str(requests)])
    model = load_model(args.model)
    shape = cli.server_shape(args, model)
    decode, prefill, _ = cli.cost_models(args, model, shape)
    out = []
    for k in range(arrivals):
        args.seed = k
        workload = cli.workload_from(args)
        offsets, inp, outs = schedule(workload, requests, None, cli.MAX_REQUESTS)
        load = Load(offsets, inp, outs, concurrency=args.concurrency,
                    closed_loop=workload.closed_loop, requested_rate=args.qps)  # fmt: skip
        runs = [
            simulate_at(shape, decode, load, SpeedFactors(speed, speed), prefill, s, SimTiming())
            for s in range(draws)
        ]
        got = np.array([[r.summary[f] for f in FIGURES] for r in runs], float)
        p10, p50, p90 = np.percentile(got, (10, 50, 90), axis=0)
        out.append({f: (p10[i], p50[i], p90[i]) for i, f in enumerate(FIGURES)})
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, sim = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (
        argv, [])  # fmt: skip
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, nargs="+", default=[60, 240], help="run lengths")
    p.add_argument("--arrivals", type=int, default=4, help="arrival seeds (each its own list)")
    p.add_argument("--draws", type=int, default=12, help="draw seeds per arrival seed")
    p.add_argument("--speed", type=float, default=1.0, help="decode and prefill speed factor")
    args, server = p.parse_known_args(own)  # the rest: simulate's server flags (--fit, ...)
    print(f"{'requests':>8}  per arrival seed: median TTFT ms [p10, p90 over {args.draws} "
          "draws], median TPOT [p10, p90]")  # fmt: skip
    for n in args.requests:
        cells = []
        for row in noise([*server, *sim], n, args.arrivals, args.draws, args.speed):
            t10, t50, t90 = row["median_ttft_ms"]
            o10, o50, o90 = row["median_tpot_ms"]
            cells.append(f"{t50:.0f} [{t10 / t50 - 1:+.0%},{t90 / t50 - 1:+.0%}] "
                         f"{o50:.2f} [{o10 / o50 - 1:+.1%},{o90 / o50 - 1:+.1%}]")  # fmt: skip
        print(f"{n:>8}  " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
