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
            state, step, (prefix,) = eng.generate_mixed(state, 4, table, [chunk])
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


def test_a_chunk_past_the_compiled_rows_is_refused(engine):
    state, table = engine.init_decode_state(), fixed_table(engine)
    chunk = Chunk(list(range(1, 40)), GREEDY, 0, table[0], 0, 32)
    with pytest.raises(
        ValueError, match=r"into 16 rows .* got \(slot, start, stop\) \[\(0, 0, 32\)\]"
    ):
        engine.generate_mixed(state, 4, table, [chunk])
    two = [Chunk(list(range(1, 9)), GREEDY, b, table[b], 0, 8) for b in (0, 1)]
    with pytest.raises(ValueError, match="packed from page boundaries"):  # 16 + 8 rows
        engine.check_chunks(two)


LOGGED = SamplingParams(max_tokens=40, ignore_eos=True, prompt_logprobs=2, logprobs=2)


@pytest.mark.parametrize("kernels", ["native", "xla"])
def test_several_pieces_in_one_call_give_the_unmixed_tokens_and_logprobs(kernels):
    """A 48-row mixed call takes three pieces (16 tokens of a 40-token prompt, then whole
    prompts of 10 and 7 tokens from rows 16 and 32), then two (the 40-token prompt's other 24
    tokens over its first page, a 12-token prompt from row 32) while two slots decode: every
    slot's greedy tokens, first tokens' logprobs and prompt logprobs are those of the same
    pieces run as prefill calls."""
    cfg = ServerShape(model=load_model("tiny"), slots=6, max_seq_len=64, page_size=16,
                      decode_steps=4, max_prefill_bucket=32, max_batched_tokens=48,
                      kernels=kernels)  # fmt: skip
    eng, _ = build_engines(cfg)
    assert eng.mix_tokens == 48
    rng = np.random.default_rng(3)
    lengths = {0: 5, 1: 20, 2: 40, 3: 10, 4: 7, 5: 12}
    prompts = {b: rng.integers(0, 512, n).tolist() for b, n in lengths.items()}
    calls = [[(2, 0, 16), (3, 0, 10), (4, 0, 7)], [(2, 16, 40), (5, 0, 12)], [], []]

    def run_schedule(mixed: bool) -> tuple[dict, dict]:
        state, table = eng.init_decode_state(), fixed_table(eng)
        out, logged = {}, {}

        def started(b, prefix, state):
            logged[b] = (prefix.logprobs, prefix.prompt_logprobs)
            out[b] = [prefix.first_token]
            return eng.insert(state, prefix, b, table[b])

        for b in (0, 1):
            state, prefix = eng.prefill_pages(state, prompts[b], GREEDY, b, table[b])
            state = started(b, prefix, state)
        for pieces in calls:
            chunks = [Chunk(prompts[b], LOGGED, b, table[b], i, j) for b, i, j in pieces]
            if mixed and chunks:
                state, step, prefixes = eng.generate_mixed(state, 4, table, chunks)
            else:
                prefixes = []
                for c in chunks:
                    args = (c.tokens, c.params, c.slot, c.pages, c.start, c.stop)
                    state, prefix = eng.prefill_pages(state, *args)
                    prefixes.append(prefix)
                state, step = eng.generate(state, 4, table)
            for s, row in enumerate(step.tokens):
                for slot in np.flatnonzero(step.valid[s]):
                    out[int(slot)].append(int(row[slot]))
            for c, prefix in zip(chunks, prefixes, strict=True):
                if prefix is not None:
                    state = started(c.slot, prefix, state)
        return out, logged

    (mixed, mixed_lp), (unmixed, unmixed_lp) = run_schedule(True), run_schedule(False)
    assert sorted(mixed) == list(range(6))
    assert [len(mixed[b]) for b in range(6)] == [17, 17, 9, 13, 13, 9]
    assert mixed == unmixed
    for b in (2, 3, 4, 5):
        (first, prompt), (first_ref, prompt_ref) = mixed_lp[b], unmixed_lp[b]
        assert len(prompt) == len(prompt_ref) == lengths[b] and prompt[0] is None
        for got, want in [(first, first_ref), *zip(prompt[1:], prompt_ref[1:], strict=True)]:
            assert [i for i, _ in got.top] == [i for i, _ in want.top]
            close = lambda x: np.asarray([x.logprob, *(v for _, v in x.top)])  # noqa: E731
            np.testing.assert_allclose(close(got), close(want), rtol=1e-5, atol=1e-6)


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
