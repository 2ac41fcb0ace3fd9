"""loadgen workloads: arrival statistics, determinism, lengths, datasets, shared prefixes."""

from __future__ import annotations

from itertools import islice

import numpy as np
import orjson
import pytest

from scaletui.loadgen.workload import Lengths, Workload, arrival_offsets, iter_requests


def _cv(offsets: np.ndarray) -> float:
    gaps = np.diff(offsets)
    return float(gaps.std() / gaps.mean())


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("qps", [5.0, 50.0, 1000.0])
def test_poisson_has_the_requested_rate_and_cv_one(qps, seed):
    off = arrival_offsets(2000, qps, "poisson", seed=seed)
    assert off[0] == 0.0 and np.all(np.diff(off) >= 0)
    rate = (len(off) - 1) / off[-1]
    assert rate == pytest.approx(qps, rel=0.05)
    assert _cv(off) == pytest.approx(1.0, abs=0.08)


def test_gamma_burstiness_moves_cv_as_vllm_does():
    # vLLM: gamma(shape=k, scale=1/(rate*k)) -> mean gap 1/rate, CV = 1/sqrt(k)
    for k in (0.25, 1.0, 4.0):
        off = arrival_offsets(4000, 20.0, "gamma", burstiness=k, seed=3)
        assert (len(off) - 1) / off[-1] == pytest.approx(20.0, rel=0.08)
        assert _cv(off) == pytest.approx(1 / np.sqrt(k), rel=0.1)
    constant = arrival_offsets(100, 20.0, "constant")
    assert np.allclose(np.diff(constant), 0.05)


def test_request_stream_is_deterministic_and_offsets_match_schedule():
    w = Workload(qps=30.0, input=Lengths(40, "normal", 10), output=Lengths(20, "uniform", 5))
    a = list(islice(iter_requests(w), 50))
    b = list(islice(iter_requests(w), 50))
    assert a == b
    assert [r.offset for r in a] == pytest.approx(list(arrival_offsets(50, 30.0)))
    other = list(islice(iter_requests(Workload(qps=30.0, seed=1)), 50))
    assert [r.offset for r in other] != [r.offset for r in a]
    outs = [r.max_tokens for r in a]
    assert min(outs) >= 15 and max(outs) <= 25 and len(set(outs)) > 3
    for r in a:
        assert len(r.prompt) == r.input_len  # byte-level: one char per token


def test_closed_loop_and_ids_prompts():
    w = Workload(concurrency=4, prompt_format="ids", input=Lengths(12))
    reqs = list(islice(iter_requests(w), 5))
    assert all(r.offset == 0.0 for r in reqs)
    assert all(isinstance(r.prompt, list) and len(r.prompt) == 12 for r in reqs)
    assert all(isinstance(t, int) for t in reqs[0].prompt)


def test_shared_prefix_groups():
    w = Workload(qps=10.0, prefix_len=16, prefix_groups=3, input=Lengths(8))
    reqs = list(islice(iter_requests(w), 9))
    prefixes = [r.prompt[:16] for r in reqs]
    assert len(set(prefixes)) == 3
    assert prefixes[0] == prefixes[3] == prefixes[6] != prefixes[1]
    assert all(r.input_len == 24 and len(r.prompt) == 24 for r in reqs)
    assert len({r.prompt[16:] for r in reqs}) == 9


def test_sharegpt_first_turn(tmp_path):
    data = [
        {"conversations": [{"from": "human", "value": "hello there"},
                           {"from": "gpt", "value": "x" * 40},
                           {"from": "human", "value": "second turn is ignored"}]},
        {"conversations": [{"from": "human", "value": "only one turn"}]},
        {"conversations": [{"from": "human", "value": "why?"}, {"from": "gpt", "value": "y" * 8}]},
    ]  # fmt: skip
    path = tmp_path / "sg.json"
    path.write_bytes(orjson.dumps(data))
    reqs = list(islice(iter_requests(Workload(qps=5.0, dataset=str(path))), 4))
    assert {r.prompt for r in reqs} == {"hello there", "why?"}
    by_prompt = {r.prompt: r for r in reqs}
    assert by_prompt["hello there"].max_tokens == 10  # 40 chars / 4 chars per token
    assert by_prompt["why?"].max_tokens == 2
    fixed = Workload(qps=5.0, dataset=str(path), dataset_output=False, output=Lengths(7))
    assert all(r.max_tokens == 7 for r in islice(iter_requests(fixed), 4))


def test_cancel_rate_marks_that_fraction():
    reqs = list(islice(iter_requests(Workload(qps=10.0, cancel_rate=0.3, seed=5)), 1000))
    marked = [r for r in reqs if r.cancel_after is not None]
    assert 0.25 < len(marked) / 1000 < 0.35
    assert all(1 <= r.cancel_after < r.max_tokens for r in marked)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "qps"),
        ({"qps": 0}, "qps must be > 0"),
        ({"qps": 1, "arrival": "weibull"}, "arrival must be one of"),
        ({"qps": 1, "burstiness": 0}, "burstiness must be > 0"),
        ({"qps": 1, "cancel_rate": 2}, "cancel_rate"),
        ({"concurrency": 0}, "concurrency must be >= 1"),
        ({"qps": 1, "dataset": "x.json", "prompt_format": "ids"}, "text prompts"),
    ],
)
def test_bad_workloads_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Workload(**kwargs)
    with pytest.raises(ValueError, match="normal"):
        Lengths(10, "normal-ish")


def test_missing_dataset_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="cannot read ShareGPT dataset"):
        next(iter_requests(Workload(qps=1.0, dataset=str(tmp_path / "none.json"))))


@pytest.mark.parametrize("qps", [None, 20.0], ids=["closed", "poisson"])
def test_schedule_draws_the_requests_iter_requests_sends(qps):
    """schedule skips the prompt text, not a request's offset or lengths (each has its own
    random stream), with a spread, a normal output and a shared prefix."""
    from scaletui.loadgen.workload import schedule

    w = Workload(input=Lengths(64, "uniform", 16), output=Lengths(32, "normal", 8), qps=qps,
                 concurrency=None if qps else 4, prefix_len=5, prefix_groups=3, seed=7)  # fmt: skip
    offsets, inp, out = schedule(w, 200)
    sent = list(islice(iter_requests(w), 200))
    assert offsets.tolist() == [r.offset for r in sent]
    assert inp.tolist() == [r.input_len for r in sent]
    assert out.tolist() == [r.max_tokens for r in sent]
    assert len(set(inp.tolist())) > 10  # the spread is drawn
