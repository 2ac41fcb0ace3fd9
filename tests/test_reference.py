"""The conformance suite (issue 40): `scaletui serve --model DIR --dtype f32` on micro
checkpoints that `transformers` made (tests/fixtures/make_reference.py) gives the reference's
greedy tokens, its top-20 logprobs and prompt logprobs within 1e-4 and its chat prompt ids:
sent alone, 8 at once, chunked and from the prefix cache.

One server process per checkpoint, all started as the module begins so that they compile side
by side; each test waits only for the one it uses. Token ids come back as text (the API's
shape), so tokens are compared as the reference's ids decoded by the checkpoint's tokenizer.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from scaletui import xla_env
from scaletui.serve.http.tokenizer import load_tokenizer

FIXTURES = Path(__file__).parent / "fixtures"
REFERENCE = FIXTURES / "reference"
REF = json.loads((REFERENCE / "reference.json").read_text())
PROMPTS = [p["ids"] for p in REF["prompts"]]
TOL = 1e-4  # f32 against f32: the issue measured 7e-5 on the top-5
QUICK = ("--no-warmup",)  # only the shapes a test runs compile
SERVERS = {  # checkpoint -> flags beside `--model DIR --dtype f32`
    "llama-untied": (),  # the acceptance: no other flag
    "llama-tied": ("--max-batched-tokens", "32", "--min-prefill-bucket", "32", *QUICK),  # chunked
    "llama31-rope": ("--min-prefill-bucket", "64", *QUICK),
    "qwen2-bias": ("--max-batched-tokens", "32", "--min-prefill-bucket", "32", *QUICK),
}
START_S = 900  # every server compiles at once on a shared CPU
# one worker runs this module (pyproject: --dist loadgroup): its four servers start once
pytestmark = pytest.mark.xdist_group("reference-servers")


@dataclass
class Server:
    url: str
    model: str  # the name /v1/models lists
    tok: Tokenizer  # the checkpoint's own tokenizer.json, to decode the reference's ids
    ref: dict  # REF["models"][checkpoint]


def _launch(name: str, logs: Path) -> tuple[subprocess.Popen, Path]:
    env = xla_env.child_env(1)  # one CPU device, the session's other XLA settings kept
    env["JAX_PLATFORMS"] = "cpu"
    argv = ["--model", str(REFERENCE / name), "--dtype", "f32", *SERVERS[name]]
    argv += ["--port", "0", "--log-interval", "0"]
    err = logs / f"{name}.stderr"
    with open(err, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "scaletui", "serve", *argv],
            stdout=subprocess.PIPE, stderr=stderr, text=True, env=env,
        )  # fmt: skip
    return proc, err


class Servers:
    """The servers this module's selected tests use, all started at once; `ready(name)` waits
    for one to serve (once)."""

    def __init__(self, names: set[str], logs: Path) -> None:
        self.procs = {name: _launch(name, logs) for name in sorted(names)}
        self.ready_: dict[str, Server] = {}

    def ready(self, name: str) -> Server:
        if name in self.ready_:
            return self.ready_[name]
        proc, err = self.procs[name]
        line = proc.stdout.readline()
        assert line.startswith("scaletui serve: http://"), f"{name}: {line!r}\n{err.read_text()}"
        url = line.split()[2].removesuffix("/v1")
        deadline = time.monotonic() + START_S
        while _get(url + "/health")[0] != 200:
            log = err.read_text()[-3000:]
            assert proc.poll() is None, f"{name} exited {proc.returncode}:\n{log}"
            assert time.monotonic() < deadline, f"{name}: not serving after {START_S} s\n{log}"
            time.sleep(0.2)
        model = json.loads(_get(url + "/v1/models")[1])["data"][0]["id"]
        tok = Tokenizer.from_file(str(REFERENCE / name / "tokenizer.json"))
        self.ready_[name] = Server(url, model, tok, REF["models"][name])
        return self.ready_[name]

    def stop(self) -> None:
        for proc, _ in self.procs.values():
            proc.terminate()
        for proc, _ in self.procs.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture(scope="module")
def servers(request, tmp_path_factory):
    """The servers of the selected tests, started together (they build the native kernels
    once: the first takes the cache's build lock, the others wait for its file)."""
    mine = [item for item in request.session.items if item.module is request.module]
    params = [getattr(item, "callspec", None) for item in mine]
    names = {p.params["server"] for p in params if p is not None and "server" in p.params}
    started = Servers(names, tmp_path_factory.mktemp("reference-servers"))
    yield started
    started.stop()


@pytest.fixture(params=sorted(SERVERS))
def server(request, servers: Servers) -> Server:
    """The server of the checkpoint `request.param`, serving."""
    return servers.ready(request.param)


def post(s: Server, path: str, body: dict) -> dict:
    req = urllib.request.Request(
        s.url + path,
        json.dumps({"model": s.model, "temperature": 0, **body}).encode(),
        {"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise AssertionError(f"{path} answered {e.code}: {e.read().decode()}") from None


def complete(s: Server, prompt: list[int] | str, **body) -> dict:
    body = {"prompt": prompt, "max_tokens": 16, "ignore_eos": True, **body}
    return post(s, "/v1/completions", body)


def at_once(fn, args: list) -> list:
    with ThreadPoolExecutor(len(args)) as pool:
        return list(pool.map(fn, args))


def text_of(s: Server, ids: list[int]) -> str:
    return s.tok.decode(ids, skip_special_tokens=True)


def check_greedy(s: Server, outs: list[dict]) -> None:
    """Each answer's text is the reference's 16 greedy tokens, from the whole prompt."""
    for i, out in enumerate(outs):
        want = s.ref["greedy"][i]["tokens"]
        assert out["usage"] == {
            "prompt_tokens": len(PROMPTS[i]),
            "completion_tokens": len(want),
            "total_tokens": len(PROMPTS[i]) + len(want),
        }, f"prompt {i}"
        assert out["choices"][0]["text"] == text_of(s, want), f"prompt {i}: {want}"


def prefix_hits(s: Server) -> float:
    text = _get(s.url + "/metrics")[1].decode()
    found = re.search(r"^scaletui:prefix_cache_hits_total (\S+)$", text, re.M)
    assert found, "no scaletui:prefix_cache_hits_total in /metrics"
    return float(found.group(1))


# -- greedy tokens -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(START_S + 120)  # the first test on a server waits for it
def test_greedy_tokens_sent_alone(server: Server) -> None:
    check_greedy(server, [complete(server, p) for p in PROMPTS])


@pytest.mark.slow
@pytest.mark.timeout(START_S + 120)
def test_greedy_tokens_8_at_once_then_from_the_prefix_cache(server: Server) -> None:
    """All prompts at once, then again: the second round reuses the cached pages of every
    prompt of a page or more (page size 64: the two longest) and gives the same tokens."""
    check_greedy(server, at_once(lambda p: complete(server, p), PROMPTS))
    before = prefix_hits(server)
    check_greedy(server, at_once(lambda p: complete(server, p), PROMPTS))
    assert prefix_hits(server) - before >= 64 + 128, "the second round missed the cache"


@pytest.mark.slow
@pytest.mark.timeout(START_S + 120)
@pytest.mark.parametrize("server", ["llama-untied"], indirect=True)
def test_text_prompts_tokenize_as_transformers(server: Server) -> None:
    """A text prompt is the ids `transformers`' tokenizer gives it, BOS included (vLLM's
    completions encode with add_special_tokens=True), so its tokens are the same too."""
    outs = at_once(lambda p: complete(server, p["text"]), REF["prompts"])
    check_greedy(server, outs)


# -- logprobs ----------------------------------------------------------------------------------


def _close(got: float, want: float, where: str) -> None:
    assert abs(got - want) <= TOL, f"{where}: {got} vs the reference's {want}"


def check_top(s: Server, got: dict, ids: list[int], values: list[float], edge: float, at: str):
    """`got`, a completions top_logprobs {token text: logprob}, against the reference's top-20
    (ids, values). Ids whose texts coincide (byte tokens that are not UTF-8 alone all read
    '\ufffd') share a key: its value must be one of theirs. Where the 20th and 21st are
    within the tolerance (`edge`), either may be in the set: the 20th is left out."""
    n = len(ids) if edge > 2 * TOL else len(ids) - 1
    texts: dict[str, list[float]] = {}
    for i, v in zip(ids[:n], values[:n], strict=True):
        texts.setdefault(s.tok.decode([i], skip_special_tokens=False), []).append(v)
    extra = set(got) - set(texts)
    assert len(extra) <= len(ids) - n, f"{at}: {extra} are not in the reference's top"
    for text, vs in texts.items():
        assert text in got, f"{at}: {text!r} ({vs}) missing from {got}"
        assert min(abs(got[text] - v) for v in vs) <= TOL, f"{at}: {text!r} {got[text]} vs {vs}"


@pytest.mark.slow
@pytest.mark.timeout(START_S + 120)
def test_top_20_logprobs_within_1e4(server: Server) -> None:
    outs = at_once(lambda p: complete(server, p, logprobs=20), PROMPTS)
    check_greedy(server, outs)
    for i, out in enumerate(outs):
        lp, ref = out["choices"][0]["logprobs"], server.ref["greedy"][i]
        assert len(lp["tokens"]) == len(ref["tokens"])
        for j, top in enumerate(lp["top_logprobs"]):
            at = f"prompt {i} token {j}"
            _close(lp["token_logprobs"][j], ref["top_logprobs"][j][0], at)
            edge = ref["top_edge_gaps"][j]
            check_top(server, top, ref["top_ids"][j], ref["top_logprobs"][j], edge, at)


@pytest.mark.slow
@pytest.mark.timeout(START_S + 120)
def test_echo_gives_the_prompt_logprobs(server: Server) -> None:
    outs = at_once(
        lambda p: complete(server, p, max_tokens=1, echo=True, logprobs=1), PROMPTS
    )  # fmt: skip
    for i, out in enumerate(outs):
        lp, want = out["choices"][0]["logprobs"], server.ref["prompt_logprobs"][i]
        got = lp["token_logprobs"][: len(want)]
        assert got[0] is None and want[0] is None, f"prompt {i}: {got[:2]}"
        for j, (g, w) in enumerate(zip(got[1:], want[1:], strict=True)):
            _close(g, w, f"prompt {i} position {j + 1}")
        first = server.ref["greedy"][i]["top_logprobs"][0][0]
        _close(lp["token_logprobs"][len(want)], first, f"prompt {i}: the first token")


# -- chat --------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(START_S + 120)
def test_chat_prompts_are_apply_chat_template_ids(server: Server) -> None:
    """With the checkpoint's own template: the prompt is as many tokens as
    apply_chat_template's, and the greedy answer to those ids is the reference's."""
    template = server.ref["chat_template"]

    def chat(c: dict) -> dict:
        return post(
            server, "/v1/chat/completions",
            {"messages": c["messages"], "max_tokens": 16, "ignore_eos": True},
        )  # fmt: skip

    for i, (c, out) in enumerate(zip(REF["chats"], at_once(chat, REF["chats"]), strict=True)):
        assert out["usage"]["prompt_tokens"] == len(c["ids"][template]), f"chat {i}"
        want = text_of(server, server.ref["chat_greedy"][i])
        assert out["choices"][0]["message"]["content"] == want, f"chat {i}"


TEMPLATE_FILES = {
    "chatml": "qwen2_chatml.jinja",
    "llama3": "llama3.jinja",
    "mistral": "mistral_v0.1.jinja",
}


@pytest.mark.parametrize("template", sorted(TEMPLATE_FILES))
def test_chat_ids_equal_apply_chat_template(template: str) -> None:
    """The server's chat ids (the tokenizer's `chat_ids`, with `--chat-template FILE`) equal
    `apply_chat_template(..., add_generation_prompt=True, tokenize=True)`'s."""
    tok = load_tokenizer(
        str(REFERENCE / "llama-untied" / "tokenizer.json"),
        512,
        str(FIXTURES / "chat_templates" / TEMPLATE_FILES[template]),
    )
    for i, c in enumerate(REF["chats"]):
        assert tok.chat_ids(c["messages"]) == c["ids"][template], f"chat {i}"
