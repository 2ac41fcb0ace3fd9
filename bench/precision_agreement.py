"""Precision against f32 on a real checkpoint: top-1 agreement and the largest logprob gap of
bf16, int8 weights and int8 KV.

The serving engine (`build_engines`, default kernels, one device) reads the checkpoint in each
precision and decodes every prompt greedily with its top-20 logprobs. The f32 reference model
(`serve.model.forward` on the f32 weights, which tests/test_reference.py holds to
`transformers` within 1e-4) then scores the same sequences: prompt plus the variant's own
tokens (teacher forcing, so one early flip does not count against every later token). Printed
per variant: top-1 agreement (the share of generated tokens that are the reference's argmax in
their context), the largest |logprob - reference| of the chosen tokens and of all top-20
candidates, and, for each disagreement, how close the reference found it (its margin). The f32
engine is the control.

    python bench/precision_agreement.py                      # the conformance fixture
    python bench/precision_agreement.py --model /tmp/peers/tiny-llama-f32 --new-tokens 64
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import numpy as np
import orjson
from _smoke import shrink

from scaletui.serve.engine import model as llama
from scaletui.serve.engine.build import build_engines
from scaletui.serve.engine.engine_api import SamplingParams, TokenLogprobs, unpack_logprobs
from scaletui.serve.http.tokenizer import load_tokenizer
from scaletui.serve.http.validate import completion_prompt
from scaletui.serve.scheduling.paging import fixed_table
from scaletui.serve.weights.checkpoint import load_safetensors
from scaletui.shape import ServerShape
from scaletui.specs import load_model

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "reference" / "llama-untied"
VARIANTS = {  # name -> (compute dtype, weight storage, KV-cache storage)
    "f32": ("f32", "f32", "f32"),
    "bf16": ("bf16", "bf16", "bf16"),
    "int8-weights": ("f32", "int8", "f32"),
    "int8-kv": ("f32", "f32", "int8"),
}
PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Question: What is the capital of Spain? Answer:",
    "def attention(query, key, value, mask):\n    scores = query @ key",
    "When a request arrives, the scheduler looks for a free slot. If the prompt begins with "
    "text that another request already sent, the pages that hold its keys and values are "
    "shared, and only the rest of the prompt is computed.",
    "Numbers such as 1024, 4096, 3.14159 and 2.71828 appear in configuration files.",
    "Caf\u00e9 na\u00efve \u65e5\u672c\u8a9e: r\u00e9sum\u00e9s at 42 \u00b0C",
]
TOP = 20
FORWARD = jax.jit(llama.forward, static_argnums=2)  # (params, tokens, model spec)


def decode(m, folder: str, variant: str, prompts: list[list[int]], new: int) -> tuple:
    """(tokens, logprobs, kernels): `new` greedy tokens per prompt from the serving engine in
    `variant`'s precision, each with its TokenLogprobs (top TOP)."""
    dtype, weight_dtype, kv_dtype = VARIANTS[variant]
    seq = -(-(max(map(len, prompts)) + new) // 64) * 64  # prompt + new, rounded up to 64
    cfg = ServerShape(
        model=m, slots=len(prompts), max_seq_len=min(seq, m.max_seq_len), decode_steps=4,
        dtype=dtype, weight_dtype=weight_dtype, kv_dtype=kv_dtype, weights=folder,
    )  # fmt: skip
    eng, _ = build_engines(cfg, jax.devices()[:1])
    sp = SamplingParams(max_tokens=new, ignore_eos=True, logprobs=TOP)
    state, table = eng.init_decode_state(), fixed_table(eng)
    toks: list[list[int]] = [[] for _ in prompts]
    lps: list[list[TokenLogprobs]] = [[] for _ in prompts]
    for slot, p in enumerate(prompts):
        prefix = eng.prefill(p, sp)
        toks[slot].append(prefix.first_token)
        lps[slot].append(prefix.logprobs)
        state = eng.insert(state, prefix, slot, table[slot])
    while state.active[: len(prompts)].any():
        state, step = eng.generate(state, cfg.decode_steps, table)
        for s, b in zip(*np.nonzero(step.valid), strict=True):
            toks[b].append(int(step.tokens[s, b]))
            lps[b].append(unpack_logprobs(step.logprobs[s, :, b], TOP))
    return toks, lps, eng.describe().kernels


def reference_logprobs(m, params: dict, prompts: list[list[int]], toks: list[list[int]]):
    """f64 log-softmax [N, T, V] of the f32 reference's logits over prompt + generated tokens
    (right-padded: causal, so harmless)."""
    seqs = [p + g[:-1] for p, g in zip(prompts, toks, strict=True)]
    tokens = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = s
    cpu = jax.devices("cpu")[0]
    logits = np.asarray(FORWARD(jax.device_put(params, cpu), jax.device_put(tokens, cpu), m))
    logits = logits.astype(np.float64)
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


def compare(ref: np.ndarray, prompts: list[list[int]], toks: list, lps: list) -> dict:
    """Top-1 agreement and the largest logprob gaps of one variant against the reference."""
    hits, total, chosen, candidates, misses = 0, 0, 0.0, 0.0, []
    for i, (p, ts, ls) in enumerate(zip(prompts, toks, lps, strict=True)):
        for j, (t, lp) in enumerate(zip(ts, ls, strict=True)):
            row = ref[i, len(p) - 1 + j]  # [V]: the reference's view of position j
            want = int(row.argmax())
            total += 1
            hits += t == want
            chosen = max(chosen, float(abs(lp.logprob - row[t])))
            candidates = max(candidates, *(float(abs(v - row[c])) for c, v in lp.top))
            if t != want:
                misses.append({"prompt": i, "pos": j, "ref_margin": float(row[want] - row[t])})
    return {
        "agreement": hits / total,
        "tokens": total,
        "max_logprob_diff_chosen": chosen,
        "max_logprob_diff_top20": candidates,
        "disagreements": misses,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(FIXTURE), help="an HF checkpoint directory")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many of PROMPTS")
    p.add_argument("--json-out", help="write the result as JSON here")
    return shrink(p, new_tokens=4, prompts=2, variants="f32,bf16")  # bench/_smoke.py


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    m = load_model(args.model)
    folder = m.extra.get("checkpoint_dir")
    if not folder:
        raise SystemExit(f"--model {args.model}: not a checkpoint directory (no config.json)")
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; expected some of {sorted(VARIANTS)}")
    tok = load_tokenizer(folder, m.vocab_size)
    prompts = [completion_prompt({"prompt": t}, tok, m.vocab_size) for t in PROMPTS]
    prompts = prompts[: args.prompts]
    params = load_safetensors(folder, m, "f32")
    dev = jax.devices()[0]
    result = {"model": args.model, "device": f"{dev.platform} {dev.device_kind}",
              "jax": jax.__version__, "prompts": len(prompts), "new_tokens": args.new_tokens,
              "variants": {}}  # fmt: skip
    print(f"{m.name} on {result['device']}, {len(prompts)} prompts x {args.new_tokens} tokens")
    print(f"{'variant':>13} {'kernels':>7} {'top-1':>7} {'max|dlp| chosen':>16} {'top-20':>9}")
    for v in variants:
        t0 = time.perf_counter()
        toks, lps, kernels = decode(m, folder, v, prompts, args.new_tokens)
        row = compare(reference_logprobs(m, params, prompts, toks), prompts, toks, lps)
        row.update(kernels=kernels, seconds=time.perf_counter() - t0)
        result["variants"][v] = row
        print(f"{v:>13} {kernels:>7} {row['agreement']:7.3f} "
              f"{row['max_logprob_diff_chosen']:16.2e} {row['max_logprob_diff_top20']:9.2e}"
              + "".join(f"  miss p{d['prompt']}@{d['pos']} (ref margin {d['ref_margin']:.3f})"
                        for d in row["disagreements"][:3]))  # fmt: skip
    if args.json_out:
        Path(args.json_out).write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
