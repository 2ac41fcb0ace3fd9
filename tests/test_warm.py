"""Warm-up runs every compiled shape once, compiles nothing more, and leaves no trace in what
the engines then serve."""

from __future__ import annotations

import numpy as np
import pytest

from scaletui.serve.engine import warm
from scaletui.serve.engine.build import build_engines
from scaletui.serve.engine.engine_api import SamplingParams
from scaletui.serve.scheduling.paging import fixed_table
from scaletui.shape import ServerShape
from scaletui.specs import load_model

pytestmark = pytest.mark.slow  # builds JAX engines

CONFIGS = {
    "interleaved": {},
    "interleaved chunked": {"max_prefill_bucket": 32, "page_size": 16},
    "disaggregated chunked": {"mode": "disaggregated", "max_prefill_bucket": 32},
}


def engines(**kw):
    cfg = ServerShape(model=load_model("tiny"), slots=2, max_seq_len=128, decode_steps=4, **kw)
    prefill, generate = build_engines(cfg)
    return [prefill] if prefill is generate else [prefill, generate]


@pytest.mark.parametrize("name", CONFIGS)
def test_each_shape_runs_once_and_nothing_compiles(name):
    for eng in engines(**CONFIGS[name]):
        for job in eng._warmup_jobs():  # the compile half of warmup()
            job()
        compiled = eng.compile_count()
        ran = warm.run_each_shape(eng)
        assert eng.compile_count() == compiled, "a warm-up run compiled a new shape"
        pieces = eng.chunked_len and (eng.role == "prefill" or eng.chunk >= eng.page_size)
        chunks = [("chunks", eng.chunk)] if pieces else []
        inserts = eng.prefill_buckets + ((eng.chunked_len,) if eng.chunked_len else ())
        prefills = {
            "both": [("prefill_pages", t) for t in eng.prefill_buckets] + chunks,
            "prefill": [("prefill", t) for t in eng.prefill_buckets] + chunks,
            "generate": [("insert", t) for t in inserts],
        }[eng.role]
        decode = [] if eng.role == "prefill" else [("generate", b) for b in eng.decode_buckets]
        assert ran == prefills + decode


def test_a_prompt_longer_than_a_bucket_below_a_page_is_refused_by_name():
    """Interleaved pieces are whole pages: with the largest bucket under a page, a longer
    prompt is a ValueError (the scheduler fails that request alone), not a crash."""
    (eng,) = engines(max_prefill_bucket=32)  # page_size 64
    state = eng.init_decode_state()
    with pytest.raises(ValueError, match="max_prefill_bucket >= page_size"):
        eng.prefill_pages(state, [1] * 40, SamplingParams(max_tokens=2), 0, fixed_table(eng)[0])
    assert warm.run_each_shape(eng)[:3] == [("prefill_pages", t) for t in (16, 32)] + [
        ("generate", 64)
    ]


@pytest.mark.parametrize("mode", ["interleaved", "disaggregated"])
def test_tokens_after_warmup_equal_a_cold_engine(mode):
    """The runs write the scratch page and page 1; a sequence placed there after warm-up
    (fixed_table puts slot 0 on page 1) draws the tokens a cold engine draws."""
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, seed=3)
    prompt = np.random.default_rng(0).integers(0, 512, 40).tolist()

    def tokens(warmed: bool) -> list[int]:
        engs = engines(mode=mode)
        if warmed:
            for e in engs:
                e.warmup()
        first, gen = engs[0], engs[-1]
        state, table = gen.init_decode_state(), fixed_table(gen)
        if gen.role == "both":  # as the scheduler runs it: straight into the slot's pages
            state, prefix = gen.prefill_pages(state, prompt, params, 0, table[0])
        else:
            prefix = first.transfer(first.prefill(prompt, params), gen)
        state = gen.insert(state, prefix, 0, table[0])
        out = [prefix.first_token]
        while len(out) < params.max_tokens:
            state, step = gen.generate(state, gen.config.decode_steps, table)
            out += [int(t) for t, v in zip(step.tokens[:, 0], step.valid[:, 0], strict=True) if v]
        return out

    assert tokens(warmed=True) == tokens(warmed=False)
