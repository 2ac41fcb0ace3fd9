"""`scaletui serve --fake` as a subprocess: the URL line, interval summaries, clean SIGTERM."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request

from scaletui.commands.serve import main


def test_serve_process_answers_logs_and_stops_on_sigterm() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "scaletui", "serve", "--model", "tiny", "--fake", "--port", "0",
         "--slots", "2", "--log-interval", "0.2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert line.startswith("scaletui serve: http://127.0.0.1:"), line
        base = line.split()[2].removesuffix("/v1")
        for _ in range(200):
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.05)
        body = json.dumps({"prompt": "a", "max_tokens": 3}).encode()
        req = urllib.request.Request(base + "/v1/completions", body)
        with urllib.request.urlopen(req, timeout=30) as r:
            assert json.loads(r.read())["choices"][0]["text"] == "bcd"
        time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "running 0 reqs, waiting 0 reqs, slots 0/2" in err and "generation" in err


def test_bad_flags_exit_2_naming_the_problem(capsys) -> None:
    assert main(["--model", "no-such-model", "--fake"]) == 2
    assert "no-such-model" in capsys.readouterr().err
    assert main(["--model", "tiny", "--fake", "--slots", "3", "--dp", "2"]) == 2
    assert "slots (3) must be a multiple of dp (2)" in capsys.readouterr().err
    assert main(["--model", "tiny", "--fake", "--max-waiting", "0"]) == 2  # it would 429 all
    assert "max_waiting and max_waiting_tokens must be >= 1, got 0" in capsys.readouterr().err


def test_a_taken_port_exits_2_naming_it(capsys) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["--model", "tiny", "--fake", "--port", str(port), "--log-interval", "0"]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
