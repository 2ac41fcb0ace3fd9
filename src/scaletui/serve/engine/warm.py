"""Run every compiled shape of an engine once, before it serves.

An XLA CPU executable pays a one-time cost on its first run (its temporary buffers are
allocated and their pages faulted in), well above its later runs (docs/serve.md, "Start-up").
Without this run a request pays it, once per shape, and a closed loop at concurrency 1 shows it
as its p99 TTFT. vLLM makes the same dummy runs before it serves.

The runs write only where no sequence lives: interleaved prefill (alone or mixed into a
generate call) into the replica's scratch page, decode K/V into the scratch page (the page
table passed is all zeros); a generate engine's insert writes zeros into page 1, which holds
nothing before serving and is written again before any sequence reads it. The decode state is
thrown away.
"""

from __future__ import annotations

import numpy as np

from scaletui.serve.engine.engine_api import Chunk, Prefix, SamplingParams

ONE_TOKEN = SamplingParams(max_tokens=1, ignore_eos=True)


def _prompt_for(bucket: int, max_seq_len: int) -> list[int]:
    """A prompt that runs in `bucket` (any length above the bucket below does)."""
    return [1] * min(bucket, max_seq_len - 1)


def run_each_shape(engine) -> list[tuple[str, int]]:
    """Run each prefill (or insert) shape and each decode bucket of `engine` once; returns
    (verb, shape) per run, a decode bucket as the engine picked it."""
    ran: list[tuple[str, int]] = []
    long_prompt = [1] * min(engine.chunk + 1, engine.max_seq_len - 1)  # two chunks
    if engine.role == "prefill":
        for t in engine.prefill_buckets:
            engine.prefill(_prompt_for(t, engine.max_seq_len), ONE_TOKEN)
            ran.append(("prefill", t))
        if engine.chunked_len:
            engine.prefill(long_prompt, ONE_TOKEN)
            ran.append(("chunks", engine.chunk))
        return ran
    state = engine.init_decode_state()
    inserts = engine.prefill_buckets + ((engine.chunked_len,) if engine.chunked_len else ())
    if engine.role == "both":  # prefill into the scratch page (no pages given)
        for t in engine.prefill_buckets:
            prompt = _prompt_for(t, engine.max_seq_len)
            state, _ = engine.prefill_pages(state, prompt, ONE_TOKEN, 0, ())
            ran.append(("prefill_pages", t))
        if engine.chunked_len and engine.chunk >= engine.page_size:  # the second gathers
            state, _ = engine.prefill_pages(state, long_prompt, ONE_TOKEN, 0, ())
            ran.append(("chunks", engine.chunk))
    else:
        for t in inserts:
            state = _activate(engine, state, min(t, engine.max_seq_len - 1), t)
            ran.append(("insert", t))
    steps = engine.config.decode_steps
    for b in engine.decode_buckets:  # a row `steps` short of the bucket's end picks it
        length = max(1, min(b, engine.max_seq_len - 1) - steps)
        kv_rows = next((t for t in inserts if t >= length), None)
        if engine.role == "both":
            kv_rows = None  # its K/V would be in its pages already
        elif kv_rows is None:
            continue  # no insert shape holds a prefix this long: no request makes one
        state = _activate(engine, state, length, kv_rows)
        table = np.zeros((engine.slots, b // engine.page_size), np.int32)  # the scratch page
        state, _ = engine.generate(state, min(steps, engine.max_seq_len - length), table)
        ran.append(("generate", engine.last_step_stats["bucket"]))
        if engine.role == "both" and engine.mix_tokens:  # a chunk into the scratch page too
            state = _activate(engine, state, length, kv_rows)
            prompt = [1] * min(engine.mix_tokens, engine.max_seq_len - 1)
            chunk = Chunk(prompt, ONE_TOKEN, 0, (), 0, len(prompt))
            n = min(steps, engine.max_seq_len - length)
            state, _, _ = engine.generate_mixed(state, n, table, [chunk])
            ran.append(("mixed", engine.last_step_stats["bucket"]))
    return ran


def _activate(engine, state, length: int, kv_rows: int | None):
    """Slot 0 running at `length`: its K/V taken as in place (interleaved), or inserted from
    a zero prefix of `kv_rows` rows into page 1 (a generate engine)."""
    kv = None if kv_rows is None else engine.zero_kv(kv_rows)
    params = SamplingParams(max_tokens=engine.max_seq_len, ignore_eos=True)
    prefix = Prefix(kv, length, 1, params)
    return engine.insert(state, prefix, 0, [1] * -(-length // engine.page_size))
