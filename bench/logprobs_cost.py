"""What logprobs cost a decode step, and what they cost a batch that asks for none.

Builds the real engine (default `small`), fills every slot at --context tokens and times
`generate` (--steps decode steps per call, the server's unit) in three batches, interleaved
round by round so that drift hits them alike: `none` (no row asks: the step runs the sampler
as before, plus the `lax.cond` predicate and an untouched zero buffer), `one` (one row asks for
5 candidates: the log-softmax and top-20 run for the whole batch) and `all`. It prints the
median step time of each, tokens/s, and the ratio to `none`; and how many `conditional`s the
compiled generate program holds (the logprobs work sits in one of them).

    python bench/logprobs_cost.py --model small --slots 8 --context 256
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import orjson
from _smoke import shrink

from scaletui.serve.engine.build import build_engines
from scaletui.serve.engine.engine_api import SamplingParams
from scaletui.serve.scheduling.paging import fixed_table
from scaletui.shape import ServerShape
from scaletui.specs import load_model

BATCHES = ("none", "one", "all")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small", help="model spec name or YAML")
    p.add_argument("--slots", type=int, default=8, help="decode batch (every slot running)")
    p.add_argument("--context", type=int, default=256, help="each slot's KV length")
    p.add_argument("--steps", type=int, default=8, help="decode steps per generate call")
    p.add_argument("--calls", type=int, default=10, help="generate calls per batch and round")
    p.add_argument("--rounds", type=int, default=5, help="rounds of none / one / all")
    p.add_argument("--kernels", default="auto", help="as `scaletui serve --kernels`")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    shrink(p, model="tiny", slots=2, context=16, steps=2, calls=2, rounds=1)
    return p.parse_args(argv)


def fill(eng, table, asking: int, context: int):
    """A decode state with every slot at `context` tokens; the first `asking` ask logprobs."""
    state = eng.init_decode_state()
    prompt = [(7 * i + 1) % 200 for i in range(context)]
    for slot in range(eng.slots):
        k = 5 if slot < asking else None
        params = SamplingParams(max_tokens=eng.max_seq_len, ignore_eos=True, logprobs=k)
        state, prefix = eng.prefill_pages(state, prompt, params, slot, table[slot])
        state = eng.insert(state, prefix, slot, table[slot])
    return state


def conditionals(eng) -> int:
    """`conditional` ops in the compiled generate program of the bucket these calls use."""
    exe = eng._generate_exe(eng.last_step_stats["bucket"])
    return exe.as_text().count(" conditional(")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    m = load_model(args.model)
    calls_len = args.steps * args.calls
    cfg = ServerShape(
        model=m,
        slots=args.slots,
        max_seq_len=args.context + calls_len + args.steps,
        decode_steps=args.steps,
        kernels=args.kernels,
    )
    eng, _ = build_engines(cfg)
    eng.warmup()
    table = fixed_table(eng)
    asking = {"none": 0, "one": 1, "all": args.slots}
    times: dict[str, list[float]] = {b: [] for b in BATCHES}
    for _ in range(args.rounds):
        for batch in BATCHES:
            state = fill(eng, table, asking[batch], args.context)
            state, _ = eng.generate(state, args.steps, table)  # its first call: not timed
            for _ in range(args.calls - 1):
                t0 = time.perf_counter()
                state, out = eng.generate(state, args.steps, table)
                times[batch].append((time.perf_counter() - t0) / args.steps)
                assert (out.logprobs is None) == (batch == "none")
    step = {b: statistics.median(v) for b, v in times.items()}
    result = {
        "model": m.name,
        "kernels": eng.kernels,
        "slots": args.slots,
        "context": args.context,
        "steps": args.steps,
        "step_ms": {b: 1e3 * s for b, s in step.items()},
        "tok_s": {b: args.slots / s for b, s in step.items()},
        "vs_none": {b: s / step["none"] for b, s in step.items()},
        "conditionals": conditionals(eng),
    }
    if args.json:
        print(orjson.dumps(result).decode())
        return 0
    print(
        f"{m.name}, {eng.kernels} kernels, {args.slots} slots at {args.context} tokens, "
        f"{args.steps} steps per call; generate holds {result['conditionals']} conditionals"
    )
    print(f"{'batch':<6} {'step ms':>9} {'tok/s':>9} {'vs none':>8}")
    for b in BATCHES:
        print(f"{b:<6} {1e3 * step[b]:9.3f} {result['tok_s'][b]:9.1f} {result['vs_none'][b]:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
