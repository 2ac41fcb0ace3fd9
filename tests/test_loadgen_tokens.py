"""loadgen's exact prompt lengths (tokens.fit over a real BPE tokenizer.json), the length check
of the report, and bad input refused before any request: a tokenizer that does not load, a
trace with a bad row, --turns 0."""

from __future__ import annotations

import json
from itertools import islice

import numpy as np
import pytest
from mock_openai import MockConfig, MockServer
from test_loadgen_exact import make_tokenizer

from scaletui.loadgen.breakdown import prompt_lengths
from scaletui.loadgen.cli import main
from scaletui.loadgen.client import RequestRecord
from scaletui.loadgen.tokens import fit, load_counter
from scaletui.loadgen.workload import Lengths, Workload, iter_requests

pytestmark = pytest.mark.timeout(60)


def test_fit_is_exact_and_keeps_the_head(tmp_path):
    counter = load_counter(make_tokenizer(tmp_path))
    rng = np.random.default_rng(0)
    head = "A shared system prompt, with punctuation; and ünïcode."
    for total in (1, 2, 7, 33, 128, 300):
        text = fit(counter, rng, "", total)
        assert counter.count(text) == total
        if total > 40:
            text = fit(counter, rng, head, total, keep=len(head))
            assert text.startswith(head) and counter.count(text) == total
    long = " ".join(["question"] * 200)
    cut = fit(counter, rng, long, 50)
    assert counter.count(cut) == 50 and long.startswith(cut.rstrip())


def test_synthetic_prompts_are_exact_with_a_tokenizer(tmp_path):
    tok = make_tokenizer(tmp_path)
    counter = load_counter(tok)
    w = Workload(qps=1.0, tokenizer=tok, input=Lengths(64, "normal", 20), prefix_len=16)
    specs = list(islice(iter_requests(w), 20))
    assert all(counter.count(s.prompt) == s.input_len for s in specs)
    assert len({s.input_len for s in specs}) > 5
    assert specs == list(islice(iter_requests(w), 20))  # deterministic


def rec(want: int, got: int) -> RequestRecord:
    r = RequestRecord(0, 0.0, want, 4)
    r.outcome, r.prompt_tokens = "ok", got
    return r


def test_length_check_names_the_likely_cause():
    exact = prompt_lengths([rec(100, 100), rec(50, 50)], "tok.json", "completions")
    assert exact["mismatched"] == 0 and exact["warning"] is None and exact["exact"]
    bos = prompt_lengths([rec(10, 11), rec(200, 201)], "tok.json", "completions")
    assert bos["mismatched"] == 1 and "constant" in bos["warning"] and "BOS" in bos["warning"]
    chat = prompt_lengths([rec(10, 19), rec(50, 70)], "tok.json", "chat")
    assert "chat template" in chat["warning"]
    other = prompt_lengths([rec(100, 90), rec(50, 60)], "tok.json", "completions")
    assert "another one" in other["warning"]
    guess = prompt_lengths([rec(100, 90)], None, "completions")
    assert guess["warning"] is None and "estimates" in guess["note"]


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--tokenizer", "{tmp}/missing.json"], "missing.json does not exist"),
        (["--tokenizer", "{tmp}/broken.json"], "broken.json does not load"),
        (["--trace", "{tmp}/gap.jsonl"], "gap.jsonl:2: field 'input_length': missing"),
        (["--trace", "{tmp}/late.jsonl"], "late.jsonl:3: field 'timestamp': 5 ms is before"),
        (["--trace", "{tmp}/late.jsonl", "--qps", "3"], "drop qps"),
    ],
)
def test_bad_input_is_one_line_before_any_request(tmp_path, capsys, extra, needle):
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "gap.jsonl").write_text(
        json.dumps({"input_length": 3, "timestamp": 0}) + "\n" + json.dumps({"timestamp": 1})
    )
    late = [{"input_length": 3, "timestamp": t} for t in (0, 10, 5)]
    (tmp_path / "late.jsonl").write_text("\n".join(json.dumps(r) for r in late))
    args = [a.format(tmp=tmp_path) for a in extra]
    if "--qps" not in args and "--trace" not in args:
        args += ["--qps", "5"]
    with MockServer(MockConfig()) as srv:
        assert main(["--url", srv.url, "--num-requests", "2", *args]) == 2
        assert srv.requests == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("loadgen: error:") and needle in err[0], err


def test_turns_zero_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--url", "http://127.0.0.1:9", "--qps", "5", "--turns", "0"])
    assert exit_.value.code == 2
    assert "--turns must be >= 1" in capsys.readouterr().err
