"""loadgen conversations against the mock server: history grows turn by turn, think time is
kept, sessions are the unit of both loops, and the report has per-turn figures."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from itertools import islice

import orjson
import pytest
from mock_openai import STATE, MockConfig, MockServer

from scaletui.loadgen.client import request_body
from scaletui.loadgen.flags import build_parser
from scaletui.loadgen.output import table
from scaletui.loadgen.report import summarize
from scaletui.loadgen.run_config import RunConfig, make_session
from scaletui.loadgen.runner import Runner
from scaletui.loadgen.workload import Lengths, Workload, iter_requests

pytestmark = pytest.mark.timeout(120)


async def run(url, workload, n, api="completions"):
    cfg = RunConfig(url=url, model="mock-model", num_requests=n, api=api)
    async with make_session() as session:
        result = await Runner(cfg, workload).run(session)
    return result.records, summarize(result.records, t_start=result.t_start)


def by_session(records) -> dict[int, list]:
    out = defaultdict(list)
    for r in records:
        out[r.session].append(r)
    return {k: sorted(v, key=lambda r: r.turn) for k, v in out.items()}


def test_history_grows_and_think_time_is_kept():
    w = Workload(qps=40.0, input=Lengths(12), output=Lengths(5), turns=Lengths(3), think_time=0.02)
    specs = list(islice(iter_requests(w), 4))
    with MockServer(MockConfig(ttft=0.005, gap=0.001)) as srv:
        records, s = asyncio.run(run(srv.url, w, 4))
        log = {p: e["arrive"] for p, e in srv.app[STATE]["log"].items()}
    assert s["completed"] == 12 and len(by_session(records)) == 4
    for sid, turns in by_session(records).items():
        spec = specs[sid]
        sent = sorted((t for p, t in log.items() if p.startswith(spec.prompt)))
        assert len(sent) == 3  # every turn's prompt starts with the first turn's
        for prev, rec in zip(turns, turns[1:], strict=False):
            assert rec.t_sched == pytest.approx(prev.t_last + 0.02)  # the think time
            assert rec.t_send >= rec.t_sched and rec.t_send > prev.t_done
            # history + reply ("x" per token on the mock) + new message
            assert rec.prompt_tokens == prev.prompt_tokens + 5 + 12 == rec.input_len
    per_turn = s["per_turn"]
    assert [t["turn"] for t in per_turn] == [0, 1, 2]
    assert [t["mean_prompt_tokens"] for t in per_turn] == [12, 29, 46]
    assert all(t["median_ttft_ms"] is not None for t in per_turn)
    assert "Conversations: by turn" in table(s)


def test_closed_loop_counts_sessions_in_flight():
    w = Workload(concurrency=2, input=Lengths(8), output=Lengths(3), turns=Lengths(3, "uniform", 2))
    with MockServer(MockConfig(ttft=0.005, gap=0.001)) as srv:
        records, s = asyncio.run(run(srv.url, w, 6))
    sessions = by_session(records)
    assert len(sessions) == 6 and len({len(t) for t in sessions.values()}) > 1
    spans = [(t[0].t_send, t[-1].t_done) for t in sessions.values()]
    for t, _ in spans:  # at any session's start, at most 2 sessions are open
        assert sum(a <= t < b for a, b in spans) <= 2


def test_chat_history_is_the_message_list():
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    body = orjson.loads(request_body(history, 4, model="m", api="chat", ignore_eos=True))
    assert body["messages"] == history
    assert orjson.loads(request_body("hi", 4, model="m", api="chat", ignore_eos=False))[
        "messages"
    ] == [{"role": "user", "content": "hi"}]


def test_turns_flags():
    p = build_parser()
    with pytest.raises(SystemExit):
        p.parse_args(["--qps", "1", "--turns", "0"])
    args = p.parse_args(["--qps", "1", "--turns", "4", "--turns-dist", "uniform"])
    assert (args.turns, args.turns_dist) == (4, "uniform")
