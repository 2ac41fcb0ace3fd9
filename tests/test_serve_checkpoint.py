"""`scaletui serve --model DIR` (an HF checkpoint directory): it starts with no other flag,
serves under --served-model-name or the argument as given, stops at any of the checkpoint's EOS
ids, and a checkpoint that disagrees with its config exits 2 before the port is bound."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from hf_dirs import write_checkpoint
from safetensors.numpy import load_file, save_file

from scaletui import xla_env
from scaletui.commands.serve import main
from scaletui.serve.engine.engine_api import SamplingParams
from scaletui.serve.engine.fake_engine import FakeEngineFactory
from scaletui.serve.http.api import ApiSettings
from scaletui.serve.http.testing import fake_server
from scaletui.serve.scheduling.events import Request
from scaletui.serve.scheduling.scheduler import Scheduler
from scaletui.shape import ServerShape
from scaletui.specs import load_model

# tiny with the test tokenizer's 300 ids, so greedy decoding never needs a masked id
SPEC = dataclasses.replace(load_model("tiny"), vocab_size=300)


async def test_any_of_several_eos_ids_stops_generation() -> None:
    config = ServerShape(load_model("tiny"), max_seq_len=128, slots=2)
    sched = Scheduler(config, FakeEngineFactory(259, (257, 253), 0.0, 0.0))
    sched.start()
    try:
        loop = asyncio.get_running_loop()
        ids: list[int] = []
        req = Request([250], SamplingParams(max_tokens=20, temperature=0.0), loop)
        sched.submit(req)
        while True:  # the fake engine counts up from the prompt: 251, 252, 253 (an EOS)
            event = await asyncio.wait_for(req.events.get(), 30)
            ids += event.ids
            if event.finish:
                break
        assert ids == [251, 252, 253] and event.finish == "stop"
    finally:
        sched.shutdown()


async def test_served_model_name_is_listed_and_asked_for() -> None:
    settings = ApiSettings(log_interval_s=0, served_model_name="org/llama-mini")
    async with fake_server(settings=settings) as (client, _):
        card = (await (await client.get("/v1/models")).json())["data"][0]
        assert card["id"] == "org/llama-mini" and card["root"] == "tiny"
        body = {"prompt": "hi", "max_tokens": 2}
        ok = await client.post("/v1/completions", json={**body, "model": "org/llama-mini"})
        assert ok.status == 200 and (await ok.json())["model"] == "org/llama-mini"
        other = await client.post("/v1/completions", json={**body, "model": "tiny"})
        assert other.status == 404
        assert "this server serves 'org/llama-mini'" in (await other.json())["error"]["message"]


def test_a_shape_mismatch_exits_2_before_binding(tmp_path, capsys) -> None:
    folder = tmp_path / "llama-mini"
    write_checkpoint(folder, SPEC)
    t = load_file(str(folder / "model.safetensors"))
    key = "model.layers.1.self_attn.k_proj.weight"
    save_file({**t, key: t[key][:16]}, str(folder / "model.safetensors"))
    flags = ["--model", str(folder), "--dtype", "f32", "--kernels", "xla", "--port", "0"]
    assert main(flags) == 2
    err = capsys.readouterr().err
    assert (
        f"tensor {key} has shape (16, 64), but the config of model llama-mini wants (32, 64)" in err
    )
    (folder / "tokenizer.json").unlink()
    assert main(flags) == 2
    assert "has no tokenizer.json: pass --tokenizer FILE" in capsys.readouterr().err


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


@pytest.mark.slow
def test_serve_a_checkpoint_dir_with_no_other_flag(tmp_path, greedy_reference) -> None:
    prompt = [5, 6, 7, 8]
    ref = greedy_reference(SPEC, 0, prompt, 8)
    # an EOS the greedy sequence meets first at token `stop` (1, `</s>`, is the tokenizer's)
    stop = next(i for i in range(1, 8) if ref[i] not in ref[:i] and 1 not in ref[: i + 1])
    folder = tmp_path / "llama-mini"
    write_checkpoint(folder, SPEC, shards=2, eos=[1, ref[stop]])
    argv = ["scaletui", "serve", "--model", str(folder), "--dtype", "f32", "--port", "0"]
    argv += ["--kernels", "xla", "--slots", "2", "--max-seq-len", "64"]  # test speed only
    code = f"import sys; sys.argv = {argv!r}; from scaletui.cli import main; sys.exit(main())"
    env = xla_env.child_env(1)  # one CPU device, the session's other XLA settings kept
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert line.startswith("scaletui serve: http://127.0.0.1:"), (line, proc.stderr.read())
        base = line.split()[2].removesuffix("/v1")
        deadline = time.monotonic() + 240
        while _get(base + "/stats")["compile"]["state"] != "done":
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.2)
        card = _get(base + "/v1/models")["data"][0]
        assert card["id"] == str(folder) and card["root"] == str(folder.resolve())
        stats = _get(base + "/stats")["config"]
        assert stats["weights"] == stats["tokenizer"] == str(folder.resolve())
        body = {"model": str(folder), "prompt": prompt, "max_tokens": 8, "temperature": 0}
        out = _post(base + "/v1/completions", body)
        assert out["choices"][0]["finish_reason"] == "stop"
        assert out["usage"]["completion_tokens"] == stop + 1  # the EOS included
        full = _post(base + "/v1/completions", {**body, "ignore_eos": True})
        assert full["usage"]["completion_tokens"] == 8
        assert full["choices"][0]["text"].startswith(out["choices"][0]["text"])
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
