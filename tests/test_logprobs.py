"""Logprobs over the FakeEngine, whose values are computable by hand: after token p, token
p + j has logprob -j ln 2 (so every emitted token has -ln 2 and the top k are p+1 .. p+k).
Completions (`logprobs`, `echo`), chat (`logprobs`, `top_logprobs`), streamed chunks, stop
strings, chunked and prefix-cached prompts, and the 400s."""

from __future__ import annotations

import math

import pytest

from scaletui.serve.http.testing import fake_server, sse

LN2 = math.log(2.0)
V = 259  # the byte tokenizer's vocabulary: the fake engine's


def lp(prev: int, token: int) -> float:
    """The fake engine's logprob of `token` after `prev`."""
    return -((token - prev - 1) % V + 1) * LN2


def close(a, b) -> bool:
    """Equal up to f32 rounding, through nested lists and dicts."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float):
        return math.isclose(a, b, rel_tol=1e-6)
    return a == b


async def test_completion_logprobs_are_the_fake_engines() -> None:
    async with fake_server() as (client, _):
        body = {"prompt": "a", "max_tokens": 3, "logprobs": 2, "temperature": 0}
        choice = (await (await client.post("/v1/completions", json=body)).json())["choices"][0]
        assert choice["text"] == "bcd"
        want = {
            "tokens": ["b", "c", "d"],
            "token_logprobs": [-LN2] * 3,
            "top_logprobs": [{"b": -LN2, "c": -2 * LN2}, {"c": -LN2, "d": -2 * LN2},
                             {"d": -LN2, "e": -2 * LN2}],
            "text_offset": [0, 1, 2],
        }  # fmt: skip
        assert close(choice["logprobs"], want), choice["logprobs"]
        body["logprobs"] = 0  # the chosen token only
        choice = (await (await client.post("/v1/completions", json=body)).json())["choices"][0]
        assert close(choice["logprobs"]["top_logprobs"], [{"b": -LN2}, {"c": -LN2}, {"d": -LN2}])


async def test_echo_returns_the_prompt_and_its_logprobs_first_null() -> None:
    async with fake_server() as (client, _):
        body = {"prompt": "ab", "max_tokens": 2, "echo": True, "logprobs": 1}
        choice = (await (await client.post("/v1/completions", json=body)).json())["choices"][0]
        assert choice["text"] == "abcd"
        got = choice["logprobs"]
        # BOS (256, no text) + a b, then c d; 'a' after BOS is 100 steps on: -100 ln 2
        assert got["tokens"] == ["", "a", "b", "c", "d"]
        assert got["text_offset"] == [0, 0, 1, 2, 3]
        assert close(got["token_logprobs"], [None, lp(256, 97), -LN2, -LN2, -LN2])
        assert got["top_logprobs"][0] is None
        assert close(got["top_logprobs"][1], {"": -LN2, "a": lp(256, 97)})  # top1: 257 (EOS)
        assert close(got["top_logprobs"][2], {"b": -LN2})
        plain = {"prompt": "ab", "max_tokens": 2, "echo": True}
        choice = (await (await client.post("/v1/completions", json=plain)).json())["choices"][0]
        assert choice["text"] == "abcd" and choice["logprobs"] is None


async def test_chat_logprobs_content_with_bytes_and_top() -> None:
    async with fake_server() as (client, _):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "logprobs": True, "top_logprobs": 2}  # fmt: skip
        choice = await (await client.post("/v1/chat/completions", json=body)).json()
        choice = choice["choices"][0]
        # the byte chat template ends with "\n" (10): the fake continues 11, 12
        entry = lambda t, v: {"token": chr(t), "logprob": v, "bytes": [t]}  # noqa: E731
        want = [
            entry(11, -LN2) | {"top_logprobs": [entry(11, -LN2), entry(12, -2 * LN2)]},
            entry(12, -LN2) | {"top_logprobs": [entry(12, -LN2), entry(13, -2 * LN2)]},
        ]
        assert close(choice["logprobs"], {"content": want}), choice["logprobs"]
        del body["top_logprobs"]  # logprobs: true alone -> the chosen tokens, no candidates
        choice = await (await client.post("/v1/chat/completions", json=body)).json()
        assert [e["top_logprobs"] for e in choice["choices"][0]["logprobs"]["content"]] == [[], []]


async def test_stream_chunks_carry_their_tokens_logprobs() -> None:
    async with fake_server(decode_steps=3) as (client, _):
        body = {"prompt": "ab", "max_tokens": 6, "echo": True, "logprobs": 2}
        full = (await (await client.post("/v1/completions", json=body)).json())["choices"][0]
        frames = await sse(await client.post("/v1/completions", json=body | {"stream": True}))
        chunks = [f["choices"][0] for f in frames[:-1]]
        assert [c["text"] for c in chunks] == ["ab", "c", "def", "gh"]  # echo, prefill, bursts
        assert [len(c["logprobs"]["tokens"]) for c in chunks] == [3, 1, 3, 2]
        joined = {k: [x for c in chunks for x in c["logprobs"][k]] for k in full["logprobs"]}
        assert close(joined, full["logprobs"])
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "logprobs": True, "top_logprobs": 1, "stream": True}  # fmt: skip
        frames = await sse(await client.post("/v1/chat/completions", json=chat))
        chunks = [f["choices"][0] for f in frames[:-1]]
        assert chunks[0]["logprobs"] is None  # the role chunk
        content = [c["logprobs"]["content"] for c in chunks[1:]]
        assert [len(c) for c in content] == [1, 3]
        assert ["".join(e["token"] for e in c) for c in content] == [
            c["delta"]["content"] for c in chunks[1:]
        ]


async def test_stop_string_keeps_the_logprobs_of_the_tokens_it_counts() -> None:
    async with fake_server() as (client, _):
        body = {"prompt": "a", "max_tokens": 20, "stop": ["fg"], "logprobs": 0}
        full = await (await client.post("/v1/completions", json=body)).json()
        assert full["choices"][0]["text"] == "bcde"
        # b..g: the token that completed "fg" is counted, and so has its logprob
        assert full["choices"][0]["logprobs"]["tokens"] == list("bcdefg")
        assert full["usage"]["completion_tokens"] == 6


async def test_prompt_logprobs_of_chunked_and_cached_prompts() -> None:
    # chunks of one page (16) per generate call; the second request's prompt is cached, yet
    # prompt logprobs need every position: it prefills from 0 again (the fake engine refuses
    # a prompt-logprobs prefill that starts past 0, as the real one does)
    config = {"page_size": 16, "max_batched_tokens": 16, "prefix_cache": True}
    async with fake_server(**config) as (client, sched):
        prompt = [(7 * i) % 200 for i in range(40)]
        body = {"prompt": prompt, "max_tokens": 2, "echo": True, "logprobs": 0}
        for _ in range(2):
            r = await client.post("/v1/completions", json=body)
            got = (await r.json())["choices"][0]["logprobs"]
            assert r.status == 200
            want = [None] + [lp(a, b) for a, b in zip(prompt, prompt[1:], strict=False)]
            assert close(got["token_logprobs"][:40], want)
        assert sched.metrics.prefix_hits._value.get() == 0  # never reused for these
        r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        assert r.status == 200 and sched.metrics.prefix_hits._value.get() == 32  # others do


BAD_CHAT = [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "in [0, 20], got 21"),
    ({"top_logprobs": 3}, "top_logprobs", "needs 'logprobs': true"),
    ({"logprobs": 5}, "logprobs", "must be a boolean"),
    ({"echo": True}, "echo", "not supported"),
]


@pytest.mark.parametrize(("extra", "param", "text"), BAD_CHAT)
async def test_bad_chat_logprobs_get_400_naming_the_field(extra, param, text) -> None:
    async with fake_server() as (client, _):
        body = {"messages": [{"role": "user", "content": "hi"}], **extra}
        r = await client.post("/v1/chat/completions", json=body)
        err = (await r.json())["error"]
        assert r.status == 400 and err["param"] == param and text in err["message"], err


def test_serve_takes_the_logprobs_mode_to_the_engine_and_refuses_another(capsys) -> None:
    from scaletui.commands import serve
    from scaletui.serve.http.tokenizer import load_tokenizer

    tok = load_tokenizer(None, 512)
    base = ["--model", "tiny"]
    default = serve.engine_factory(serve.parser().parse_args(base), tok, ())
    raw = serve.parser().parse_args([*base, "--logprobs-mode", "raw_logprobs"])
    assert default.logprobs_mode == "processed_logprobs"  # the issue's ask; vLLM v1's is raw
    assert serve.engine_factory(raw, tok, ()).logprobs_mode == "raw_logprobs"
    with pytest.raises(SystemExit):
        serve.parser().parse_args([*base, "--logprobs-mode", "raw"])
    err = capsys.readouterr().err
    assert "--logprobs-mode: invalid choice: 'raw'" in err and "raw_logprobs" in err
