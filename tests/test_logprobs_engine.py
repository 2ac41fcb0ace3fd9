"""Logprobs from the real JAX engine on tiny (f32): every value equals the log-softmax of the
full causal forward's logits, for decode steps and for the prompt (chunked, paged or not), and
the greedy token's logprob is the best candidate's. A batch that asks for none copies none."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jitted_model
import numpy as np
import pytest

from scaletui.serve.engine.build import build_engines
from scaletui.serve.engine.engine_api import SamplingParams, unpack_logprobs
from scaletui.serve.scheduling.paging import fixed_table
from scaletui.serve.weights import weights
from scaletui.shape import ServerShape
from scaletui.specs import load_model

pytestmark = pytest.mark.slow  # builds a JAX engine

TOL = 1e-5
ASK = SamplingParams(max_tokens=9, ignore_eos=True, logprobs=5, prompt_logprobs=5)
PLAIN = SamplingParams(max_tokens=9, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    cfg = ServerShape(
        model=load_model("tiny"),
        slots=2,
        max_seq_len=64,
        decode_steps=4,
        max_prefill_bucket=16,
        page_size=16,
    )
    eng, _ = build_engines(cfg)
    eng.warmup()
    return eng


def reference(eng, seq: list[int]) -> np.ndarray:
    """[len(seq), vocab] log-softmax of the full forward over the ids sampling may produce."""
    params = weights.dummy_params(eng.model, seed=eng.config.seed)
    logits = jitted_model.forward(params, jnp.asarray([seq], jnp.int32), eng.model)[0]
    return np.asarray(jax.nn.log_softmax(logits[:, : eng.vocab_size], axis=-1))


def check(entry, ref_row: np.ndarray, token: int, k: int = 5) -> None:
    """One position's TokenLogprobs against the reference's row."""
    assert abs(entry.logprob - ref_row[token]) < TOL, (entry.logprob, ref_row[token])
    best = np.sort(ref_row)[::-1][:k]
    assert np.allclose([v for _, v in entry.top], best, atol=TOL)
    assert all(abs(ref_row[i] - v) < TOL for i, v in entry.top)  # each id has its value


def test_prompt_and_decode_logprobs_equal_the_forward(engine) -> None:
    eng, before = engine, engine.compile_count()
    prompt = [(11 * i + 3) % 250 for i in range(25)]  # two 16-token chunks
    state, table = eng.init_decode_state(), fixed_table(eng)
    # in two calls, as the scheduler runs a long prompt between decode steps
    state, none = eng.prefill_pages(state, prompt, ASK, 0, table[0], 0, 16)
    assert none is None
    state, pre = eng.prefill_pages(state, prompt, ASK, 0, table[0], 16)
    state, other = eng.prefill_pages(state, prompt[:7], PLAIN, 1, table[1])
    assert other.logprobs is None and other.prompt_logprobs is None
    state = eng.insert(state, pre, 0, table[0])
    state = eng.insert(state, other, 1, table[1])
    tokens, entries = [pre.first_token], [pre.logprobs]
    for _ in range(2):
        state, out = eng.generate(state, 4, table)
        assert out.valid[:, 1].all()  # slot 1 runs beside it, without logprobs
        tokens += out.tokens[:, 0].tolist()
        entries += [unpack_logprobs(out.logprobs[s, :, 0], 5) for s in range(4)]
    seq = prompt + tokens
    ref = reference(eng, seq)
    assert len(pre.prompt_logprobs) == len(prompt) and pre.prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        check(pre.prompt_logprobs[i], ref[i - 1], prompt[i])
    for j, entry in enumerate(entries):  # greedy: the chosen token is the best candidate
        pos = len(prompt) - 1 + j
        check(entry, ref[pos], seq[pos + 1])
        assert entry.top[0] == (seq[pos + 1], entry.logprob)
    assert eng.compile_count() == before  # no new shape for logprobs


def test_a_batch_that_asks_for_none_copies_none(engine) -> None:
    eng = engine
    state, table = eng.init_decode_state(), fixed_table(eng)
    state, pre = eng.prefill_pages(state, [5, 6, 7], PLAIN, 0, table[0])
    state = eng.insert(state, pre, 0, table[0])
    state, out = eng.generate(state, 4, table)
    assert out.valid[:, 0].all() and out.logprobs is None


def test_disaggregated_prefill_gives_the_same_prompt_logprobs(engine) -> None:
    """`prefill` (the prefill engine's verb: a K/V buffer, chunked past the largest bucket)."""
    prompt = [(5 * i + 1) % 250 for i in range(21)]
    pre = engine.prefill(prompt, ASK)
    ref = reference(engine, prompt + [pre.first_token])
    for i in range(1, len(prompt)):
        check(pre.prompt_logprobs[i], ref[i - 1], prompt[i])
    check(pre.logprobs, ref[-2], pre.first_token)


@pytest.mark.parametrize("processed", [True, False])
def test_sampled_logprobs_in_each_mode(engine, processed: bool) -> None:
    """At temperature 0.7, processed logprobs are the log-softmax of logits / 0.7 (what the
    sampler drew from), raw ones the model's; prompt logprobs are the model's in both. The
    mode is data in the compiled steps (engine_api.logprobs_code): switching it compiles
    nothing."""
    eng, before = engine, engine.compile_count()
    hot = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.7, seed=3, logprobs=5)
    prompt = [(7 * i + 2) % 250 for i in range(12)]
    was, eng.logprobs_processed = eng.logprobs_processed, processed
    try:
        state, table = eng.init_decode_state(), fixed_table(eng)
        state, pre = eng.prefill_pages(state, prompt, hot, 0, table[0])
        state = eng.insert(state, pre, 0, table[0])
        state, out = eng.generate(state, 4, table)
    finally:
        eng.logprobs_processed = was
    tokens = [pre.first_token, *out.tokens[:, 0].tolist()]
    entries = [pre.logprobs] + [unpack_logprobs(out.logprobs[s, :, 0], 5) for s in range(4)]
    ref = reference(eng, prompt + tokens)
    if processed:
        ref = np.asarray(jax.nn.log_softmax(jnp.asarray(ref) / 0.7, axis=-1))
    for j, (entry, token) in enumerate(zip(entries, tokens, strict=True)):
        check(entry, ref[len(prompt) - 1 + j], token)
    assert eng.compile_count() == before
