"""bench/greedy_check.py past `--check`: the engine's greedy tokens and the f32 reference, in
JAX. Apart from the parser so that `--check` (bench/accelerator_run.sh --check) imports no JAX."""

from __future__ import annotations

import time

import jax
import numpy as np
import orjson

from scaletui.serve.engine import model as llama
from scaletui.serve.engine.build import build_engines
from scaletui.serve.engine.engine_api import SamplingParams
from scaletui.serve.http.tokenizer import load_tokenizer
from scaletui.serve.scheduling.paging import fixed_table
from scaletui.serve.weights.weights import dummy_params
from scaletui.shape import ServerShape
from scaletui.specs import ModelSpec

# 33 to 64 bytes each: one prefill bucket, so few compiles
PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Roofline: time = max(bytes / bandwidth, flops / peak).",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)",
    "Once upon a time, in a land far away, there lived a",
    "HBM bandwidth on an H200 is about 4.8 TB/s.",
    "1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233,",
    "Continuous batching keeps every decode slot busy",
    "Q: What is the capital of France?\nA:",
]
FORWARD = jax.jit(llama.forward, static_argnums=2)  # (params, tokens, model spec)


def engine_tokens(m, params: dict, device, dtype: str, prompts: list[list[int]], new: int):
    """Greedy tokens from the serving engine: all prompts in one batch of slots."""
    seq = -(-(max(map(len, prompts)) + new) // 64) * 64  # prompt + new, rounded up to 64
    cfg = ServerShape(model=m, slots=len(prompts), max_seq_len=seq, decode_steps=4, dtype=dtype)
    eng, _ = build_engines(cfg, [device], host_params=params)
    sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    state, out, table = eng.init_decode_state(), [], fixed_table(eng)
    for slot, p in enumerate(prompts):
        prefix = eng.prefill(p, sp)
        out.append([prefix.first_token])
        state = eng.insert(state, prefix, slot, table[slot])
    while state.active[: len(prompts)].any():
        state, step = eng.generate(state, cfg.decode_steps, table)
        for s, b in zip(*np.nonzero(step.valid), strict=True):
            out[b].append(int(step.tokens[s, b]))
    return out, ("native" if eng.native else "xla")


def agreement(ref_logits: np.ndarray, prompts: list[list[int]], gens: list[list[int]]) -> dict:
    """Share of generated tokens that are the reference's argmax at their position."""
    hits, total, misses = 0, 0, []
    for i, (p, g) in enumerate(zip(prompts, gens, strict=True)):
        lg = ref_logits[i, len(p) - 1 : len(p) - 1 + len(g)]  # [new, V]: predicts g[0..]
        top = lg.argmax(-1)
        for j, (tok, want) in enumerate(zip(g, top, strict=True)):
            total += 1
            if tok == want:
                hits += 1
            elif len(misses) < 20:  # how close the reference found it: a near-tie or a bug
                margin = float(lg[j, want] - lg[j, tok])
                misses.append({"prompt": i, "pos": j, "token": tok, "ref_token": int(want),
                               "ref_margin": margin})  # fmt: skip
    return {"agreement": hits / total, "tokens": total, "disagreements": misses}


def reference_logits(m, params: dict, prompts: list[list[int]], gens: list[list[int]]):
    """f32 logits [N, T, V] of prompt + generated tokens (right-padded: causal, so harmless)."""
    seqs = [p + g[:-1] for p, g in zip(prompts, gens, strict=True)]
    t = max(map(len, seqs))
    tokens = np.zeros((len(seqs), t), np.int32)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = s
    cpu = jax.devices("cpu")[0]
    return np.asarray(FORWARD(jax.device_put(params, cpu), jax.device_put(tokens, cpu), m))


def run(args, m: ModelSpec) -> int:
    """The check past `--check`: exit status 1 when the agreement is below --min-agreement."""
    tok = load_tokenizer(None, m.vocab_size)
    prompts = [tok.encode(text) for text in PROMPTS]
    ref_params = dummy_params(m, 0, "f32")
    dev, cpu = jax.devices()[0], jax.devices("cpu")[0]
    t0 = time.perf_counter()
    gens, kernels = engine_tokens(m, dummy_params(m, 0, args.dtype), dev, args.dtype, prompts,
                                  args.new_tokens)  # fmt: skip
    device = agreement(reference_logits(m, ref_params, prompts, gens), prompts, gens)
    control, ctl_kernels = engine_tokens(m, ref_params, cpu, "f32", prompts, args.new_tokens)
    ctl = agreement(reference_logits(m, ref_params, prompts, control), prompts, control)
    same = sum(
        a == b for ga, gb in zip(gens, control, strict=True) for a, b in zip(ga, gb, strict=True)
    )
    result = {
        "model": m.name,
        "device": f"{dev.platform} {dev.device_kind}",
        "dtype": args.dtype,
        "kernels": kernels,
        "jax": jax.__version__,
        "prompts": len(prompts),
        "new_tokens": args.new_tokens,
        "agreement": device["agreement"],
        "min_agreement": args.min_agreement,
        "passed": device["agreement"] >= args.min_agreement,
        "tokens_compared": device["tokens"],
        "disagreements": device["disagreements"],
        "cpu_f32_engine": {
            "agreement": ctl["agreement"],
            "kernels": ctl_kernels,
            "disagreements": ctl["disagreements"],
        },  # fmt: skip
        "same_tokens_as_cpu_f32_engine": same / device["tokens"],
        "seconds": time.perf_counter() - t0,
    }
    text = orjson.dumps(result, option=orjson.OPT_INDENT_2).decode()
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text + "\n")
    print(
        f"greedy check, {m.name} {args.dtype} on {result['device']} vs f32 on the CPU: top-1 "
        f"agreement {device['agreement']:.3f} over {device['tokens']} tokens (need >= "
        f"{args.min_agreement}); CPU f32 engine {ctl['agreement']:.3f}; identical tokens "
        f"{result['same_tokens_as_cpu_f32_engine']:.3f}"
    )
    return 0 if result["passed"] else 1
