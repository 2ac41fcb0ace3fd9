"""The JAX engine on tiny: greedy tokens equal a full forward, stop rules, seeds, no recompiles."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from scaletui.serve.engine.build import build_engines
from scaletui.serve.engine.engine_api import SamplingParams
from scaletui.serve.scheduling.paging import fixed_table
from scaletui.serve.weights import weights
from scaletui.shape import ServerShape
from scaletui.specs import load_model

pytestmark = pytest.mark.slow  # builds JAX engines (see README: the fast subset)

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    m = load_model("tiny")
    cfg = ServerShape(
        model=m, slots=4, max_seq_len=64, page_size=16, decode_steps=4, max_prefill_bucket=32
    )
    eng, other = build_engines(cfg)
    assert eng is other
    eng.warmup()
    return eng


@pytest.fixture(scope="module")
def reference(greedy_reference):
    """Greedy continuation of the engine's model from the full causal forward."""
    return lambda eng, prompt, n: greedy_reference(eng.model, eng.config.seed, prompt, n)


def serve(eng, requests, calls=8, paged=False):
    """Prefill + insert each (prompt, params) into slots 0.., generate; tokens per slot.
    paged: prefill straight into the slot's pages, as an interleaved server does (prefill_pages,
    then insert activates the slot), instead of prefill's own K/V copied in by insert."""
    state, table = eng.init_decode_state(), fixed_table(eng)
    out, finished = {}, {}
    for slot, (prompt, params) in enumerate(requests):
        if paged:
            state, prefix = eng.prefill_pages(state, prompt, params, slot, table[slot])
        else:
            prefix = eng.prefill(prompt, params)
        out[slot] = [prefix.first_token]
        if prefix.done:
            finished[slot] = 1
            continue
        state = eng.insert(state, prefix, slot, table[slot])
    for _ in range(calls):
        state, step = eng.generate(state, eng.config.decode_steps, table)
        for s in range(step.tokens.shape[0]):
            for b in out:
                if step.valid[s, b]:
                    assert b not in finished, "a done slot produced a token"
                    out[b].append(int(step.tokens[s, b]))
                    if step.done[s, b]:
                        finished[b] = s
    return out, state


def test_greedy_tokens_equal_full_forward(engine, reference):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 512, n).tolist() for n in (3, 17, 40)]  # 40: chunked prefill
    out, _ = serve(engine, [(p, GREEDY) for p in prompts], calls=3)
    for slot, p in enumerate(prompts):
        assert out[slot] == reference(engine, p, 10)


def test_no_compilation_after_warmup(engine):
    compiles = []
    listener = lambda event, secs, **kw: compiles.append(event) if "compile" in event else None
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        before = engine.compile_count()
        rng = np.random.default_rng(1)
        reqs = [
            (
                rng.integers(0, 512, n).tolist(),
                SamplingParams(max_tokens=30, temperature=0.8, top_k=5, seed=n, ignore_eos=True),
            )
            for n in (1, 9, 16, 31, 33, 60)[:4]
        ]
        # the interleaved server's calls (what this engine's role warms up); lengths cross
        # several decode buckets, and a 60-token prompt runs in two chunks
        serve(engine, reqs, calls=8, paged=True)
        serve(engine, [(rng.integers(0, 512, 60).tolist(), GREEDY)], calls=1, paged=True)
        assert engine.compile_count() == before
        assert [e for e in compiles if "backend_compile" in e] == []
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def test_max_tokens_and_eos_end_requests(engine, reference):
    prompt = [5, 6, 7, 8]
    ref = reference(engine, prompt, 8)
    out, state = serve(engine, [(prompt, SamplingParams(max_tokens=6, ignore_eos=True))])
    assert out[0] == ref[:6]
    assert not state.active[0]
    engine.eos_ids = (ref[3],)  # the 4th generated token is EOS
    try:
        out, _ = serve(
            engine,
            [
                (prompt, SamplingParams(max_tokens=8)),
                (prompt, SamplingParams(max_tokens=8, min_tokens=5)),
                (prompt, SamplingParams(max_tokens=8, ignore_eos=True)),
            ],
        )
    finally:
        engine.eos_ids = ()
    assert out[0] == ref[:4]  # stops at EOS, EOS included
    late = next((i for i in range(5, 8) if ref[i] == ref[3]), 7)  # EOS before 5 tokens: ignored
    assert out[1] == ref[: late + 1]
    assert out[2] == ref[:8]
    first = engine.prefill(prompt, SamplingParams(max_tokens=1))
    assert first.done and first.first_token == ref[0]


def test_seeded_sampling_is_reproducible_across_slots_and_limited_to_vocab(engine):
    p = SamplingParams(max_tokens=12, temperature=1.0, seed=42, ignore_eos=True)
    prompt = [1, 2, 3, 4, 5]
    engine.vocab_size = 40
    try:
        out, _ = serve(engine, [([9, 9], GREEDY), (prompt, p), ([7], GREEDY), (prompt, p)])
        alone, _ = serve(engine, [(prompt, p)])
    finally:
        engine.vocab_size = engine.model.vocab_size
    assert out[1] == out[3] == alone[0]
    assert max(out[1]) < 40 and max(out[0]) < 40
    other, _ = serve(
        engine, [(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=43, ignore_eos=True))]
    )
    assert other[0] != out[1]


def test_release_frees_a_slot(engine):
    state = engine.init_decode_state()
    table = fixed_table(engine)
    state = engine.insert(state, engine.prefill([1, 2, 3], GREEDY), 2, table[2])
    state = engine.release(state, 2)
    state, step = engine.generate(state, 2, table)
    assert not step.valid.any()


def test_bad_requests_are_rejected_with_values(engine):
    with pytest.raises(ValueError, match="prompt length must be in \\[1, 63\\], got 0"):
        engine.prefill([], GREEDY)
    with pytest.raises(ValueError, match="got 64"):
        engine.prefill([1] * 64, GREEDY)
    with pytest.raises(ValueError, match="top_p=1.5"):
        engine.prefill([1], SamplingParams(top_p=1.5))
    with pytest.raises(ValueError, match="slot must be in \\[0, 4\\), got 4"):
        engine.insert(engine.init_decode_state(), engine.prefill([1], GREEDY), 4, [1])
    with pytest.raises(ValueError, match="needs 1 pages"):
        engine.insert(engine.init_decode_state(), engine.prefill([1], GREEDY), 0, [0])
    with pytest.raises(ValueError, match="token ids"):
        engine.prefill([512], GREEDY)


def test_stats_fields(engine):
    assert engine.mesh_shape == {"data": 1, "model": 1}
    assert engine.weight_bytes == weights.param_count(engine.model) * 4
    per_token = 2 * engine.model.n_layers * engine.model.n_kv_heads * engine.model.head_dim * 4
    assert engine.kv_cache_bytes >= engine.slots * engine.max_seq_len * per_token
    assert engine.compile_seconds > 0


def test_single_slot_engine_equals_full_forward(reference):
    """slots=1 runs its matmuls at batch 1 over a cache with a spare row (JaxEngine.rows)."""
    cfg = ServerShape(model=load_model("tiny"), slots=1, max_seq_len=32, decode_steps=4)
    eng, _ = build_engines(cfg)
    prompt = [3, 1, 4, 1, 5]
    out, _ = serve(eng, [(prompt, GREEDY)], calls=3)
    assert out[0] == reference(eng, prompt, 10)
