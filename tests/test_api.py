"""OpenAI API over the FakeEngine: texts computable by hand, SSE, usage, stops, every bad input."""

from __future__ import annotations

import pytest

from scaletui.serve.http.api import ApiSettings
from scaletui.serve.http.testing import fake_server, sse


async def test_completion_text_and_usage() -> None:
    async with fake_server() as (client, _):
        r = await client.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": "abc", "max_tokens": 5, "temperature": 0},
        )
        body = await r.json()
        assert r.status == 200, body
        # BOS + a b c: the fake engine continues with the next bytes
        assert body["choices"][0]["text"] == "defgh"
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9}
        r = await client.post("/v1/completions", json={"prompt": [97, 98], "max_tokens": 2})
        assert (await r.json())["choices"][0]["text"] == "cd"  # token-id prompts, no BOS


async def test_stream_chunks_carry_each_burst_with_running_usage() -> None:
    # decode_steps 3: token 1 from prefill, then bursts of 3 and 2 (one host sync each)
    async with fake_server(decode_steps=3) as (client, _):
        options = {"include_usage": True, "continuous_usage_stats": True}
        body = {"prompt": "k", "max_tokens": 6, "stream": True, "stream_options": options}
        frames = await sse(await client.post("/v1/completions", json=body))
        assert frames[-1] == "[DONE]"
        final = frames[-2]
        assert final["choices"] == [] and final["usage"]["completion_tokens"] == 6
        chunks = frames[:-2]
        assert [c["choices"][0]["text"] for c in chunks] == ["l", "mno", "pq"]
        assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 4, 6]
        assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]


async def test_stop_strings_truncate_stream_and_non_stream_alike() -> None:
    async with fake_server() as (client, _):
        body = {"prompt": "a", "max_tokens": 20, "stop": ["fg", "zz"]}
        full = await (await client.post("/v1/completions", json=body)).json()
        assert full["choices"][0] == {"index": 0, "text": "bcde", "logprobs": None,
                                      "finish_reason": "stop"}  # fmt: skip
        assert full["usage"]["completion_tokens"] == 6  # b..g: the token that completed "fg"
        frames = await sse(await client.post("/v1/completions", json=body | {"stream": True}))
        chunks = [f for f in frames if f != "[DONE]"]
        assert "".join(c["choices"][0]["text"] for c in chunks) == "bcde"
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_chat_stream_matches_non_stream() -> None:
    async with fake_server() as (client, _):
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 5, "temperature": 0}  # fmt: skip
        full = await (await client.post("/v1/chat/completions", json=body)).json()
        message = full["choices"][0]["message"]
        assert message["role"] == "assistant" and len(message["content"]) == 5
        assert full["object"] == "chat.completion" and full["usage"]["completion_tokens"] == 5
        frames = await sse(await client.post("/v1/chat/completions", json=body | {"stream": True}))
        assert frames[0]["choices"][0]["delta"]["role"] == "assistant"
        text = "".join(f["choices"][0]["delta"].get("content", "") for f in frames[:-1])
        assert text == message["content"] and frames[-1] == "[DONE]"


async def test_models_health_and_harmless_fields() -> None:
    async with fake_server() as (client, _):
        models = await (await client.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["tiny"]
        assert (await client.get("/health")).status == 200
        body = {"prompt": "x", "max_tokens": 2, "user": "u", "logprobs": None, "stop": None,
                "repetition_penalty": 1.0, "presence_penalty": 0, "n": 1, "best_of": None,
                "stream_options": None, "echo": False, "seed": 3}  # fmt: skip
        r = await client.post("/v1/completions", json=body)
        assert r.status == 200, await r.text()


BAD = [
    ({"prompt": "x", "max_tokens": "10"}, 400, "max_tokens", "must be an integer"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature", "must be a number"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream", "must be a boolean"),
    ({"prompt": 12}, 400, "prompt", "must be a string"),
    ({"max_tokens": 3}, 400, "prompt", "'prompt' is required"),
    ({"prompt": ""}, 400, "prompt", "must not be empty"),
    ({"prompt": []}, 400, "prompt", "must not be empty"),
    ({"prompt": [1, 99999]}, 400, "prompt", "[0, 512)"),
    ({"prompt": ["a", "b"]}, 400, "prompt", "batched prompts (2)"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens", ">= 1, got 0"),
    ({"prompt": "x", "max_tokens": -5}, 400, "max_tokens", ">= 1, got -5"),
    ({"prompt": "x", "max_tokens": 500}, 400, "max_tokens", "only 126 tokens of context"),
    ({"prompt": "y" * 300}, 400, "prompt",
     "301 tokens, but the model's context (max_seq_len) is 128"),
    ({"prompt": "x", "temperature": -0.1}, 400, "temperature", "in [0, 2], got -0.1"),
    ({"prompt": "x", "temperature": 1e28}, 400, "temperature", "in [0, 2], got 1e+28"),
    ({"prompt": "x", "stop": ["a"] * 17}, 400, "stop", "17 strings; at most 16"),
    ({"prompt": "x", "stop": ["a" * 257]}, 400, "stop", "at most 256 characters, got one of 257"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p", "(0, 1]"),
    ({"prompt": "x", "top_p": 1.5}, 400, "top_p", "(0, 1]"),
    ({"prompt": "x", "n": 2}, 400, "n", "not supported"),
    ({"prompt": "x", "logprobs": 21}, 400, "logprobs", "in [0, 20], got 21"),
    ({"prompt": "x", "logprobs": True}, 400, "logprobs", "must be an integer"),
    ({"prompt": "x", "top_logprobs": 2}, 400, "top_logprobs", "ask with 'logprobs': k"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model", "'gpt-4' does not exist"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "status", "param", "text"), BAD)
async def test_bad_completion_inputs_get_4xx_naming_the_field(body, status, param, text) -> None:
    async with fake_server() as (client, sched):
        r = await client.post("/v1/completions", json=body)
        err = (await r.json())["error"]
        assert r.status == status and err["param"] == param and text in err["message"], err
        assert set(err) == {"message", "type", "param", "code"}
        ok = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert ok.status == 200  # still serving


async def test_bad_chat_and_transport_errors() -> None:
    settings = ApiSettings(log_interval_s=0, max_body_bytes=1000)
    async with fake_server(settings=settings) as (client, _):
        cases = [
            ("/v1/chat/completions", {}, 400, "'messages' is required"),
            ("/v1/chat/completions", {"messages": []}, 400, "non-empty array"),
            ("/v1/chat/completions", {"messages": [{"role": "bot", "content": "x"}]}, 400,
             "messages[0].role"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400,
             "messages[0].content"),
        ]  # fmt: skip
        for path, body, status, text in cases:
            r = await client.post(path, json=body)
            assert r.status == status and text in (await r.json())["error"]["message"]
        r = await client.post("/v1/completions", data=b"{not json")
        assert r.status == 400 and "not valid JSON" in (await r.json())["error"]["message"]
        r = await client.post("/v1/completions", data=b"[1, 2]")
        assert r.status == 400 and "JSON object" in (await r.json())["error"]["message"]
        r = await client.post("/v1/completions", json={"prompt": "x" * 5000})
        assert r.status == 413 and "1000 bytes" in (await r.json())["error"]["message"]
        r = await client.get("/v1/nothing")
        assert r.status == 404 and "unknown route" in (await r.json())["error"]["message"]
        r = await client.get("/v1/completions")
        assert r.status == 405 and "POST" in (await r.json())["error"]["message"]
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status == 200


async def test_input_the_engine_refuses_fails_that_request_only() -> None:
    async with fake_server() as (client, sched):
        real = sched.engines[0].prefill_pages  # interleaved: prefill into the slot's pages

        def picky(state, tokens, params, *args):
            if tokens == [99]:
                raise ValueError("token 99 is not allowed here")
            return real(state, tokens, params, *args)

        sched.engines[0].prefill_pages = picky
        r = await client.post("/v1/completions", json={"prompt": [99], "max_tokens": 2})
        err = (await r.json())["error"]
        assert r.status == 400 and "token 99 is not allowed" in err["message"], err
        ok = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert ok.status == 200 and (await ok.json())["choices"][0]["text"] == "bc"
        assert sched.state == "serving" and sched.counts["aborted"] == 1


def test_huge_top_k_means_off_and_packs_into_the_engine_int32() -> None:
    from scaletui.serve.engine.slot_state import pack_insert_args
    from scaletui.serve.http.validate import generation

    params = generation({"top_k": 10**12}, [1, 2], 128, chat=False).params
    assert params.top_k == 2**31 - 1
    ints, _ = pack_insert_args(0, 2, 3, True, params)  # used to raise OverflowError
    assert int(ints[4]) == 2**31 - 1


def test_text_stream_keeps_only_the_unsent_tail_and_cuts_at_a_stop_string() -> None:
    from scaletui.serve.http.streaming import TextStream
    from scaletui.serve.http.tokenizer import load_tokenizer

    tok = load_tokenizer(None, 512)
    text = TextStream(tok, ("STOP", "xyz"))
    body = "é" * 3000 + "abcST"  # 2-byte UTF-8: the decoder holds half characters back
    sent = [text.push(t) for t in tok.encode(body)]
    assert len(text.tail) <= 3 and not text.stopped  # never the whole text
    for t in tok.encode("OP and more"):
        sent.append(text.push(t))
        if text.stopped:  # as the handlers do
            break
    assert text.stopped and "".join(sent) == text.text == "é" * 3000 + "abc"
