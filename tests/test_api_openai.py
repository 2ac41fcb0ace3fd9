"""The real `tiny` JAX engine over a real socket with the official openai client, then live
reconfiguration (tp 1->2, slots 4->8, interleaved->disaggregated) with requests in flight:
none hang, and greedy outputs equal the pre-reconfigure ones.
"""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from openai import OpenAI

from scaletui.serve.engine.build import JaxEngineFactory
from scaletui.serve.http.api import ApiSettings, create_app
from scaletui.serve.http.testing import serve_in_thread
from scaletui.serve.http.tokenizer import load_tokenizer
from scaletui.serve.scheduling.scheduler import Scheduler
from scaletui.shape import ServerShape
from scaletui.specs import load_model

pytestmark = [
    pytest.mark.slow,  # builds JAX engines (see README: the fast subset)
    # one worker (pyproject: --dist loadgroup): the tests share a server and run in order, the
    # stats test after the reconfiguration to disaggregated
    pytest.mark.xdist_group("openai-server"),
]

PROMPTS = ["The quick brown fox", "hello", "Once upon a time there", "JAX", "é日本", "x" * 30]


@pytest.fixture(scope="module")
def server():
    tok = load_tokenizer(None, 512)
    config = ServerShape(
        load_model("tiny"), slots=4, max_seq_len=64, decode_steps=4, min_prefill_bucket=32
    )
    sched = Scheduler(config, JaxEngineFactory(tok.vocab_size, (tok.eos_id,)))
    app = create_app(sched, tok, ApiSettings(log_interval_s=0, drain_timeout_s=120))
    with serve_in_thread(app) as url:
        deadline = time.monotonic() + 240
        while sched.state != "serving" and time.monotonic() < deadline:
            assert sched.state != "failed", sched.error
            time.sleep(0.1)
        yield url, sched


def client(url: str) -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def greedy(url: str, prompt: str, n: int = 12) -> str:
    out = client(url).completions.create(
        model="tiny", prompt=prompt, max_tokens=n, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == n
    return out.choices[0].text


def test_openai_client_completions_and_chat(server) -> None:
    url, _ = server
    c = client(url)
    full = c.completions.create(model="tiny", prompt="hello", max_tokens=10, temperature=0)
    text, usage = full.choices[0].text, full.usage
    assert usage.prompt_tokens == 6 and 1 <= usage.completion_tokens <= 10
    assert full.choices[0].finish_reason in ("stop", "length")
    chunks = list(
        c.completions.create(
            model="tiny", prompt="hello", max_tokens=10, temperature=0, stream=True,
            stream_options={"include_usage": True},
            extra_body={"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        )
    )  # fmt: skip
    token_chunks = [ch for ch in chunks if ch.choices]
    assert "".join(ch.choices[0].text for ch in token_chunks) == text  # greedy: same text
    assert chunks[-1].usage.completion_tokens == usage.completion_tokens
    running = [ch.usage.completion_tokens for ch in token_chunks]  # one chunk per host sync
    assert running[0] == 1 and running[-1] == usage.completion_tokens
    assert all(b > a for a, b in zip(running, running[1:], strict=False))
    assert len(token_chunks) < usage.completion_tokens or usage.completion_tokens <= 2
    messages = [{"role": "user", "content": "hi"}]
    chat = c.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    stream = list(
        c.chat.completions.create(
            model="tiny", messages=messages, max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    streamed = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert streamed == chat.choices[0].message.content
    assert stream[-1].usage.completion_tokens == chat.usage.completion_tokens
    with pytest.raises(Exception, match="400") as bad:
        c.completions.create(model="tiny", prompt="x", max_tokens=0)
    assert "max_tokens" in str(bad.value)


def test_openai_client_parses_logprobs_streamed_and_not(server) -> None:
    url, _ = server
    c = client(url)
    kw = {"model": "tiny", "prompt": "hello", "max_tokens": 6, "temperature": 0, "logprobs": 5,
          "echo": True, "extra_body": {"ignore_eos": True}}  # fmt: skip
    full = c.completions.create(**kw)
    lp = full.choices[0].logprobs
    assert full.choices[0].text.startswith("hello")
    n = 6 + 6  # BOS + "hello", then 6 generated
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert lp.text_offset == sorted(lp.text_offset) and len(lp.text_offset) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, n):  # the top 5 and the chosen token (bytes >= 128 all read "\ufffd")
        top = lp.top_logprobs[i]
        assert len(top) <= 6 and top[lp.tokens[i]] <= 0 and lp.token_logprobs[i] <= 0
    for i in range(6, n):  # greedy: each generated token is the best candidate
        assert lp.token_logprobs[i] == pytest.approx(max(lp.top_logprobs[i].values()))
    chunks = [ch.choices[0] for ch in c.completions.create(**kw, stream=True) if ch.choices]
    assert "".join(ch.text for ch in chunks) == full.choices[0].text
    streamed = [x for ch in chunks for x in ch.logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:])

    messages = [{"role": "user", "content": "hi"}]
    kw = {"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0,
          "logprobs": True, "top_logprobs": 5, "extra_body": {"ignore_eos": True}}  # fmt: skip
    chat = c.chat.completions.create(**kw)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 6
    for e in content:
        assert len(e.top_logprobs) == 5 and e.logprob == pytest.approx(e.top_logprobs[0].logprob)
    text = b"".join(bytes(e.bytes) for e in content).decode("utf-8", errors="replace")
    assert text == chat.choices[0].message.content
    chunks = [ch.choices[0] for ch in c.chat.completions.create(**kw, stream=True) if ch.choices]
    streamed = [e for ch in chunks if ch.logprobs for e in ch.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content])


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url + "/admin/config", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


@pytest.mark.parametrize(
    "change",
    [{"tp": 2}, {"slots": 8}, {"mode": "disaggregated"}],
    ids=["tp1-2", "slots4-8", "interleaved-disaggregated"],
)
def test_reconfigure_in_flight_keeps_greedy_outputs(server, change) -> None:
    url, sched = server
    reference = getattr(test_reconfigure_in_flight_keeps_greedy_outputs, "reference", None)
    if reference is None:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            reference = list(pool.map(lambda p: greedy(url, p, 24), PROMPTS))
        test_reconfigure_in_flight_keeps_greedy_outputs.reference = reference
    finished = sched.counts["finished"]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        inflight = [pool.submit(greedy, url, p, 24) for p in PROMPTS]
        deadline = time.monotonic() + 60
        while sched.in_flight + sched.counts["finished"] - finished < len(PROMPTS):
            assert time.monotonic() < deadline, "requests were not admitted"
            time.sleep(0.002)
        result = _post(url, change)
        drained = [f.result(timeout=300) for f in inflight]  # none hang
    assert all(result["config"][k] == v for k, v in change.items())
    assert result["aborted"] == 0 and result["compile_s"] > 0
    assert drained == reference
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        assert list(pool.map(lambda p: greedy(url, p, 24), PROMPTS)) == reference


def test_stats_after_disaggregation_reports_meshes_memory_and_transfer(server) -> None:
    url, sched = server
    if sched.config.mode != "disaggregated":
        pytest.skip("runs after the interleaved -> disaggregated reconfiguration")
    greedy(url, "stats", 8)
    with urllib.request.urlopen(url + "/stats", timeout=30) as resp:
        stats = json.loads(resp.read())
    prefill, generate = stats["mesh"]["prefill"]["devices"], stats["mesh"]["generate"]["devices"]
    assert prefill and generate and not set(prefill) & set(generate)
    assert stats["mesh"]["generate"]["model"] == 2 and stats["backend"] == "cpu"
    assert stats["memory"]["weight_bytes"] > 0 and stats["memory"]["kv_cache_bytes"] > 0
    assert stats["step_times_ms"]["transfer"]["count"] >= 1
    assert stats["slots"]["total"] == 8 and stats["compile"]["state"] == "done"
    assert len(stats["devices"]) == 8
