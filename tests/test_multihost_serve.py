"""`scaletui serve` on 2 processes x 2 CPU devices (jax.distributed, gloo) at tp 2 dp 2: tp
within each process, dp across them; process 0 answers with the tokens of a one-process server
of the same shape on 4 devices and /stats lists both processes with their devices; /admin/config
turns it into tp 4 over both processes (--tp-over-hosts) and 2 slots with streams in flight,
none cut, and it answers with the one-process server's tokens at that shape; a lost process
fails the requests in flight with a 503 naming it, fails /health, and process 0 exits
non-zero. Before that loss, /admin/config turns both servers disaggregated (prefill on process
0's devices, generate on process 1's) and the two processes answer as the one does, logprobs
included. One set of processes serves every assertion (each start compiles).
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from scaletui import xla_env

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("multihost")]

SHAPE = ["--model", "tiny", "--dtype", "f32", "--max-seq-len", "32", "--slots", "4"]
SHAPE += ["--tp", "2", "--dp", "2"]
CHANGES = {"tp": 4, "dp": 1, "slots": 2}  # tp over both processes, fewer slots
BODIES = [  # greedy and seeded sampling, sent together
    {"prompt": "the quick brown fox", "max_tokens": 10, "temperature": 0},
    {"prompt": [5, 9, 200, 17, 3], "max_tokens": 12, "temperature": 0, "ignore_eos": True},
    {"prompt": "jumps over", "max_tokens": 10, "temperature": 0.9, "top_p": 0.8, "seed": 5},
    {"prompt": "the lazy dog", "max_tokens": 8, "temperature": 1.2, "top_k": 20, "seed": 11},
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(devices: int, *flags: str) -> subprocess.Popen:
    argv = ["scaletui", "serve", "--log-interval", "0", "--host-devices", str(devices), *flags]
    code = f"import sys; sys.argv = {argv!r}; from scaletui.cli import main; sys.exit(main())"
    env = {**xla_env.child_env(devices), "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip


def _line(proc: subprocess.Popen, pattern: str) -> str:
    """The first stdout line matching `pattern` (gloo prints its own lines there too)."""
    seen = []
    for line in proc.stdout:
        if found := re.search(pattern, line):
            return found.group(0)
        seen.append(line)
    raise AssertionError((seen, proc.wait(), proc.stderr.read()))


def _url(proc: subprocess.Popen) -> str:
    return _line(proc, r"http://[\d.]+:\d+")


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _healthy(url: str, procs: list[subprocess.Popen], timeout: float = 240) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert all(p.poll() is None for p in procs), [p.stderr.read() for p in procs]
        try:
            if _get(url + "/health")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} not healthy after {timeout} s")


def _post(url: str, body: dict) -> tuple[int, dict]:
    data = json.dumps({"model": "tiny", **body}).encode()
    req = urllib.request.Request(url + "/v1/completions", data)
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _admin(url: str, changes: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/admin/config", json.dumps(changes).encode())
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=240) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _stream(url: str, body: dict, first: threading.Event) -> tuple[int, str | None]:
    """(completion tokens, finish_reason) as the stream ends; `first` set at its first chunk."""
    usage = {"stream_options": {"include_usage": True}}
    data = json.dumps({"model": "tiny", "stream": True, **usage, **body}).encode()
    req = urllib.request.Request(url + "/v1/completions", data)
    req.add_header("Content-Type", "application/json")
    n, reason = 0, None
    with urllib.request.urlopen(req, timeout=240) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for choice in chunk["choices"]:
                reason = choice["finish_reason"] or reason
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
            first.set()
    return n, reason


def _reconfigure_with_streams_in_flight(url: str, follower: subprocess.Popen) -> dict:
    """3 streams in flight, held there by a stopped process 1 while /admin/config starts."""
    body = {"prompt": "ab", "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    firsts = [threading.Event() for _ in range(3)]
    got: list = [None] * 3

    def one(i: int) -> None:
        got[i] = _stream(url, body, firsts[i])

    streams = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in streams:
        t.start()
    assert all(f.wait(60) for f in firsts)
    follower.send_signal(signal.SIGSTOP)  # the passes wait on process 1: the streams stay open
    answer: list = []
    admin = threading.Thread(target=lambda: answer.append(_admin(url, CHANGES)))
    admin.start()
    end = time.monotonic() + 10
    while _get(url + "/stats")[1]["state"] != "reconfiguring":
        assert time.monotonic() < end
        time.sleep(0.05)
    assert _post(url, BODIES[0])[0] == 503  # not admitted while it drains
    follower.send_signal(signal.SIGCONT)
    admin.join(timeout=240)
    for t in streams:
        t.join(timeout=60)
    assert got == [(20, "length")] * 3  # none cut: every stream ran to its max_tokens
    status, result = answer[0]
    assert status == 200 and (result["drained"], result["aborted"]) == (3, 0), result
    return result


def _together(url: str, bodies: list[dict]) -> list[tuple[int, dict]]:
    out: list = [None] * len(bodies)

    def one(i: int) -> None:
        out[i] = _post(url, bodies[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _answers(results: list[tuple[int, dict]]) -> list[tuple]:
    assert all(status == 200 for status, _ in results), results
    return [
        (b["choices"][0]["text"], b["choices"][0]["finish_reason"], b["usage"]) for _, b in results
    ]


def test_two_processes_serve_the_one_process_tokens_and_fail_loudly() -> None:
    coordinator = f"127.0.0.1:{_free_port()}"
    cluster = ["--coordinator", coordinator, "--num-processes", "2", "--tp-over-hosts"]
    leader = _serve(2, *SHAPE, *cluster, "--process-id", "0", "--port", "0")
    follower = _serve(2, *SHAPE, *cluster, "--process-id", "1")
    single = _serve(4, *SHAPE, "--port", "0", "--no-warmup")  # the tokens' reference only
    procs = [leader, follower, single]
    try:
        url, ref = _url(leader), _url(single)
        _line(follower, "process 1 of 2 follows process 0")
        _healthy(url, procs)
        _healthy(ref, procs)
        stats = _get(url + "/stats")[1]
        assert stats["config"]["kernels_running"] == "xla"  # native kernels: one device only
        procs_seen = stats["processes"]
        assert [(p["id"], len(p["devices"])) for p in procs_seen] == [(0, 2), (1, 2)]
        place = stats["placement"]
        assert (place["hosts"], place["devices_per_host"]) == (2, 2)
        assert place["crosses_hosts"] == ["data"] and place["tp_hosts"] == 1  # tp in a process
        mesh = stats["mesh"]["generate"]  # dp rows of tp devices: each row one process's
        assert (mesh["data"], mesh["model"]) == (2, 2), mesh
        assert mesh["devices"] == procs_seen[0]["devices"] + procs_seen[1]["devices"], mesh
        got = _answers(_together(url, BODIES))
        assert got == _answers(_together(ref, BODIES))
        assert got[1][2]["completion_tokens"] == 12

        # live reconfiguration on both processes, then the one-process tokens at that shape
        single_done: list = []
        again = threading.Thread(target=lambda: single_done.append(_admin(ref, CHANGES)))
        again.start()
        result = _reconfigure_with_streams_in_flight(url, follower)
        assert (result["config"]["tp"], result["config"]["slots"]) == (4, 2)
        again.join(timeout=240)
        assert single_done[0][0] == 200, single_done
        place = _get(url + "/stats")[1]["placement"]
        assert place["tp_hosts"] == 2 and place["crosses_hosts"] == ["model"], place
        assert _answers(_together(url, BODIES)) == _answers(_together(ref, BODIES))

        # disaggregated: prefill on process 0's two devices, generate on process 1's, the
        # hand-over across processes (serve/engine/host_copy.py)
        split = {"mode": "disaggregated", "tp": 2, "dp": 1}
        assert _admin(ref, split)[0] == 200
        status, result = _admin(url, split)
        assert status == 200, result
        stats = _get(url + "/stats")[1]
        place, mesh = stats["placement"], stats["mesh"]
        assert (place["prefill"], place["generate"]) == ([[0, 1]], [[2, 3]]), place
        assert place["crosses_hosts"] == ["transfer"], place
        mine = [p["devices"] for p in procs_seen]
        assert [mesh["prefill"]["devices"], mesh["generate"]["devices"]] == mine, mesh
        bodies = [*BODIES, {**BODIES[1], "logprobs": 2}]  # logprobs cross processes too
        got = _answers(_together(url, bodies))
        assert got == _answers(_together(ref, bodies)) and got[4][0] == got[1][0]

        # a hung follower (the generate side) holds the leader's next pass; then it dies
        follower.send_signal(signal.SIGSTOP)
        pending: list = []
        hung = threading.Thread(target=lambda: pending.append(_post(url, BODIES[1])))
        hung.start()
        time.sleep(1.0)
        assert not pending  # in flight: the pass waits on process 1
        follower.kill()
        killed = time.monotonic()
        hung.join(timeout=20)
        status, body = pending[0]
        assert status == 503 and "process 1" in body["error"]["message"], body
        health, why = _get(url + "/health")
        assert health != 200 and "process 1" in why["error"], why
        status, body = _post(url, BODIES[0])  # a new request: refused, naming process 1 too
        assert status == 503 and "process 1" in body["error"]["message"], body
        leader.wait(timeout=30)
        assert leader.returncode not in (0, None)
        assert time.monotonic() - killed < 30
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
