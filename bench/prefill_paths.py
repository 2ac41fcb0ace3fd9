"""Greedy tokens by how a prompt was prefilled: whole, in chunks, or over a cached prefix.

The serving engine (`build_engines`, default kernels) prefills each prompt straight into its
pages three ways: in one piece; in chunks of --chunk tokens; and, after another slot prefilled
it, over that slot's first --cached tokens' pages (a prefix-cache hit) and only the rest
itself. Each then decodes --new-tokens greedy tokens. Printed per prompt: the first position
where each path's tokens leave the f32 engine's (whole prefill), and whether the three paths
gave the same tokens as one another. Dummy weights, random prompts (seeded).

    python bench/prefill_paths.py --model small --dtype bf16 --prompt-len 167
"""

from __future__ import annotations

import argparse
import sys

import jax
import numpy as np
import orjson
from _smoke import shrink

from scaletui.serve.engine.build import build_engines
from scaletui.serve.engine.engine_api import SamplingParams
from scaletui.serve.scheduling.paging import fixed_table
from scaletui.serve.weights.weights import dummy_params
from scaletui.shape import ServerShape
from scaletui.specs import load_model


def greedy(eng, state, slot: int, pages, prompt: list[int], new: int, start: int = 0, step=0):
    """Prefill `prompt` from `start` (its earlier positions already in `pages`) in pieces of
    `step` tokens (0: one), then decode `new` greedy tokens in `slot`; -> (state, tokens)."""
    sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    stops = list(range(start + step, len(prompt), step)) if step else []
    cur = start
    for stop in [*stops, len(prompt)]:
        state, prefix = eng.prefill_pages(state, prompt, sp, slot, pages, cur, stop)
        cur = stop
    state = eng.insert(state, prefix, slot, pages)
    out = [prefix.first_token]
    while state.active[slot]:
        state, res = eng.generate(state, eng.config.decode_steps, fixed_table(eng))
        out += [int(t) for t, ok in zip(res.tokens[:, slot], res.valid[:, slot], strict=True) if ok]
    return eng.release(state, slot), out


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (None: identical)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def run(args, m, dtype: str, prompts: list[list[int]]) -> dict[str, list[list[int]]]:
    """Each path's greedy tokens for every prompt, in `dtype`."""
    seq = -(-(args.prompt_len + args.new_tokens) // args.page_size) * args.page_size
    cfg = ServerShape(model=m, slots=2, max_seq_len=seq, page_size=args.page_size,
                      dtype=dtype, kernels=args.kernels)  # fmt: skip
    eng, _ = build_engines(cfg, host_params=dummy_params(m, args.seed))
    table = fixed_table(eng)
    pages = [[int(p) for p in row[: -(-seq // args.page_size)]] for row in table]
    shared = args.cached // args.page_size
    state, out = eng.init_decode_state(), {"whole": [], "chunked": [], "cached": []}
    for prompt in prompts:
        state, whole = greedy(eng, state, 0, pages[0], prompt, args.new_tokens)
        state, chunked = greedy(eng, state, 1, pages[1], prompt, args.new_tokens, step=args.chunk)
        state, _ = greedy(eng, state, 0, pages[0], prompt, 1)  # the cached prefix: slot 0's
        mine = pages[0][:shared] + pages[1][shared:]
        state, cached = greedy(eng, state, 1, mine, prompt, args.new_tokens, start=args.cached)
        for name, toks in (("whole", whole), ("chunked", chunked), ("cached", cached)):
            out[name].append(toks)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--dtype", default="bf16", choices=["f32", "bf16"])
    p.add_argument("--kernels", default="auto", choices=["auto", "native", "xla", "pallas"])
    p.add_argument("--prompt-len", type=int, default=167)
    p.add_argument("--prompts", type=int, default=4, help="random prompts (seeded)")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--chunk", type=int, default=32, help="chunked: tokens per piece")
    p.add_argument("--cached", type=int, default=128, help="cached: the prefix's tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", help="write the result as JSON here")
    return shrink(p, model="tiny", prompts=1, new_tokens=4, prompt_len=40, cached=32)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cached % args.page_size or args.chunk % args.page_size:
        raise SystemExit("--cached and --chunk must be multiples of --page-size")
    m = load_model(args.model)
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(3, m.vocab_size, args.prompt_len).tolist() for _ in range(args.prompts)]
    ref = run(args, m, "f32", prompts)["whole"]
    got = run(args, m, args.dtype, prompts)
    result = {
        "model": m.name,
        "dtype": args.dtype,
        "device": jax.devices()[0].device_kind,
        "prompt_len": args.prompt_len,
        "first_divergence_from_f32": {
            name: [first_divergence(a, b) for a, b in zip(toks, ref, strict=True)]
            for name, toks in got.items()
        },
        "paths_agree": [
            w == c == k for w, c, k in zip(got["whole"], got["chunked"], got["cached"], strict=True)
        ],
    }
    text = orjson.dumps(result, option=orjson.OPT_INDENT_2).decode()
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
