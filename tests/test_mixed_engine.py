"""Mixed batches on the JAX engine (tiny): a prompt chunk riding in a generate call's first step
gives the same greedy tokens as the same schedule run unmixed (at dp 1 and 2), and nothing
compiles after warmup."""

from __future__ import annotations

import numpy as np
import pytest

from scaletui.serve.engine.build import build_engines
from scaletui.serve.engine.engine_api import Chunk, SamplingParams
from scaletui.serve.scheduling.paging import fixed_table
from scaletui.shape import ServerShape
from scaletui.specs import load_model

pytestmark = pytest.mark.slow  # builds JAX engines (see README: the fast subset)

GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)
BUDGET = 16  # the mixed chunk: one page


@pytest.fixture(scope="module")
def engine():
    cfg = ServerShape(
        model=load_model("tiny"),
        slots=4,
        max_seq_len=64,
        page_size=16,
        decode_steps=4,
        max_prefill_bucket=32,
        max_batched_tokens=BUDGET,
    )
    eng, _ = build_engines(cfg)
    eng.warmup()
    assert eng.mix_tokens == BUDGET
    return eng


def run(eng, mixed: bool, slots: tuple[int, int, int, int] = (0, 1, 2, 3)) -> dict[int, list]:
    """Slots a and b (`slots` = a, b, c, d) decode while slot c's 40-token prompt runs in
    pieces of 16, 16 and 8 (the first two leave it unfinished), then slot d's 30-token prompt
    over slot c's first page (a cached prefix: it starts at 16). Each piece runs in a generate
    call's first step (`mixed`) or as a prefill_pages call before it; the greedy tokens per
    slot."""
    a, b_, c, d = slots
    rng = np.random.default_rng(7)
    state, table = eng.init_decode_state(), fixed_table(eng)
    prompts = {b: rng.integers(0, 512, n).tolist() for b, n in ((a, 5), (b_, 20), (c, 40))}
    prompts[d] = prompts[c][:16] + rng.integers(0, 512, 14).tolist()
    table[d, 0] = table[c, 0]  # slot d reads slot c's first page: its cached prefix
    out = {}
    for b in (a, b_):
        state, prefix = eng.prefill_pages(state, prompts[b], GREEDY, b, table[b])
        state = eng.insert(state, prefix, b, table[b])
        out[b] = [prefix.first_token]
    pieces = [(c, 0, 16), (c, 16, 32), (c, 32, 40), (d, 16, 30)]
    for b, start, stop in pieces + [(None, 0, 0)] * 2:
        if b is None:
            state, step = eng.generate(state, 4, table)
            prefix = None
        elif mixed:
            chunk = Chunk(prompts[b], GREEDY, b, table[b], start, stop)
            state, step, prefix = eng.generate_mixed(state, 4, table, chunk)
        else:
            state, prefix = eng.prefill_pages(state, prompts[b], GREEDY, b, table[b], start, stop)
            state, step = eng.generate(state, 4, table)
        for s, row in enumerate(step.tokens):
            for slot in np.flatnonzero(step.valid[s]):
                out[int(slot)].append(int(row[slot]))
        if prefix is not None:  # the prompt ended: its slot decodes from the next call
            state = eng.insert(state, prefix, b, table[b])
            out[b] = [prefix.first_token]
    return out


def test_mixed_and_unmixed_schedules_give_the_same_greedy_tokens(engine):
    before = engine.compile_count()
    mixed, unmixed = run(engine, True), run(engine, False)
    assert engine.compile_count() == before  # warmup compiled the mixed calls
    assert sorted(mixed) == [0, 1, 2, 3]
    assert [len(mixed[b]) for b in range(4)] == [25, 25, 13, 9]
    assert mixed == unmixed


def test_under_dp_a_chunk_mixes_into_either_replicas_slots():
    """dp 2 (two replicas of two slots, each its own pages): the same schedule mixed and
    unmixed gives the same greedy tokens, the chunks in replica 1's slots (2, 3) and then in
    replica 0's (0, 1) while the other replica decodes."""
    cfg = ServerShape(model=load_model("tiny"), slots=4, max_seq_len=64, page_size=16,
                      decode_steps=4, max_prefill_bucket=32, max_batched_tokens=BUDGET, dp=2,
                      kernels="xla")  # fmt: skip
    eng, _ = build_engines(cfg)
    assert eng.replicas == 2 and eng.mix_tokens == BUDGET
    for slots in ((0, 1, 2, 3), (2, 3, 0, 1)):
        mixed = run(eng, True, slots)
        assert [len(mixed[b]) for b in slots] == [25, 25, 13, 9]
        assert mixed == run(eng, False, slots)


def test_a_chunk_past_the_compiled_length_is_refused(engine):
    state, table = engine.init_decode_state(), fixed_table(engine)
    chunk = Chunk(list(range(1, 40)), GREEDY, 0, table[0], 0, 32)
    with pytest.raises(ValueError, match="chunks of 1 to 16 tokens"):
        engine.generate_mixed(state, 4, table, chunk)


def test_the_ragged_kernel_gives_the_greedy_tokens_of_xlas_mixed_step(engine):
    """kernels=pallas (the GPU kernels, interpreted): the mixed calls attend rows and chunk in
    one ragged kernel call over the head-major pool, and the same schedule gives the tokens
    XLA's ops give, mixed or not (nothing warmed up: interpret mode compiles slowly, so only
    what the schedule calls compiles)."""
    cfg = ServerShape(model=load_model("tiny"), slots=4, max_seq_len=64, page_size=16,
                      decode_steps=4, max_prefill_bucket=32, max_batched_tokens=BUDGET,
                      kernels="pallas")  # fmt: skip
    pallas, _ = build_engines(cfg)
    assert pallas.ops.mixed_attention is not None and pallas.mix_tokens == BUDGET
    assert run(pallas, True) == run(engine, False)
