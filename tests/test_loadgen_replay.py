"""loadgen trace replay: the shipped traces parse, shared hash_ids share text, times scale,
plain JSONL conversations, and every bad row is an error naming its file, line and field."""

from __future__ import annotations

import json
from itertools import islice

import pytest

from scaletui.loadgen.replay import load_trace, trace_size
from scaletui.loadgen.workload import Lengths, Workload, iter_requests

TRACES = "src/scaletui/loadgen/traces/"


def write(tmp_path, name: str, rows: list) -> str:
    path = tmp_path / name
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_shipped_traces_parse_and_are_small():
    mooncake = load_trace(TRACES + "mooncake_style.jsonl")
    burst = load_trace(TRACES + "burstgpt_style.csv")
    assert 100 <= len(mooncake) <= 400 and 100 <= len(burst) <= 400
    assert all(r.hash_ids and r.input_len and r.output_len for r in mooncake)
    assert all(r.input_len >= 1 and r.output_len >= 1 for r in burst)  # 0 responses asked as 1
    specs = list(iter_requests(Workload(trace=TRACES + "burstgpt_style.csv", trace_speedup=2.0)))
    assert [s.offset for s in specs] == pytest.approx([r.t_ms / 2e3 for r in burst])
    assert [len(s.prompt) for s in specs] == [r.input_len for r in burst]  # 1 char per token


def test_equal_hash_ids_give_equal_text(tmp_path):
    rows = [
        {"timestamp": 0, "input_length": 40, "output_length": 3, "hash_ids": [7, 8, 9]},
        {"timestamp": 10, "input_length": 36, "output_length": 3, "hash_ids": [7, 8, 5]},
        {"timestamp": 30, "input_length": 20, "output_length": 3, "hash_ids": [1, 2]},
    ]
    w = Workload(trace=write(tmp_path, "t.jsonl", rows), trace_block=16, trace_speedup=10.0)
    a, b, c = list(iter_requests(w))
    assert a.prompt[:32] == b.prompt[:32] and a.prompt[32:] != b.prompt[32:]
    assert c.prompt[:16] != a.prompt[:16]
    assert [len(s.prompt) for s in (a, b, c)] == [40, 36, 20]
    assert [s.offset for s in (a, b, c)] == pytest.approx([0.0, 0.001, 0.003])


def test_plain_jsonl_sessions_become_conversations(tmp_path):
    rows = [
        {"session_id": "a", "timestamp": 0, "prompt": "hello there", "output_length": 4},
        {"input_length": 8, "delay": 500},
        {"session_id": "a", "prompt": "and then?", "delay": 250},
        {"session_id": "b", "timestamp": 2000, "input_length": 5},
    ]
    path = write(tmp_path, "plain.jsonl", rows)
    w = Workload(trace=path, output=Lengths(6))
    first, single, b = list(iter_requests(w))
    assert trace_size(path) == 3
    assert first.conversation and first.prompt == "hello there" and first.max_tokens == 4
    assert [(t.text, t.think_s, t.max_tokens) for t in first.later] == [("and then?", 0.25, 6)]
    assert single.offset == pytest.approx(0.5) and not single.conversation
    assert b.offset == pytest.approx(2.0) and b.later == ()


@pytest.mark.parametrize(
    "rows, needle",
    [
        (
            [{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}]
            + [{"timestamp": 5, "input_length": 5, "hash_ids": [1]}],
            "t.jsonl:2: field 'output_length': missing",
        ),
        (
            [{"timestamp": 9, "input_length": 5}, {"timestamp": 3, "input_length": 5}],
            "t.jsonl:2: field 'timestamp': 3 ms is before line 1's 9 ms",
        ),
        ([{"input_length": "many"}], "t.jsonl:1: field 'input_length': must be a number"),
        ([{"output_length": 3}], "t.jsonl:1: field 'input_length': missing"),
        ([{"prompt": "x"}, "{nope"], "t.jsonl:2: not a JSON object"),
        (
            [{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": ["a"]}],
            "t.jsonl:1: field 'hash_ids': must be a list of integers",
        ),
    ],
)
def test_bad_jsonl_rows_name_file_line_and_field(tmp_path, rows, needle):
    path = write(tmp_path, "t.jsonl", rows)
    with pytest.raises(ValueError) as err:
        load_trace(path)
    assert needle in str(err.value)


def test_bad_burstgpt_csv(tmp_path):
    bad = tmp_path / "b.csv"
    bad.write_text("Timestamp,Request tokens\n0.5,10\n")
    with pytest.raises(ValueError, match=r"b.csv:1: field 'Response tokens': no such column"):
        load_trace(str(bad))
    bad.write_text("Timestamp,Request tokens,Response tokens\n0.5,10,3\n0.2,4,x\n")
    with pytest.raises(ValueError, match=r"b.csv:3: field 'Response tokens': must be a number"):
        load_trace(str(bad))
    bad.write_text("Timestamp,Request tokens,Response tokens\n0.5,10,3\n0.2,4,4\n")
    with pytest.raises(ValueError, match=r"b.csv:3: field 'Timestamp': 200 ms is before"):
        load_trace(str(bad))


def test_a_trace_and_qps_or_turns_do_not_mix():
    with pytest.raises(ValueError, match="own timestamps"):
        Workload(trace="x.jsonl", qps=5.0)
    with pytest.raises(ValueError, match="session_id"):
        Workload(trace="x.jsonl", turns=Lengths(2))
    assert not Workload(trace="x.jsonl").closed_loop
    assert len(list(islice(iter_requests(Workload(trace=TRACES + "mooncake_style.jsonl")), 3)))
