"""The engine's verbs, as the scheduler sees them (after JetStream's engine_api).

An engine owns one compiled model on one device set. The scheduler drives it with a handful of
verbs that take state and return state; `FakeEngine` in the tests implements the same protocol
with outputs computable by hand. Nothing here imports JAX.

Decode state holds, per slot: the KV cache row, the live length, the last token, the sampling
parameters and the stop counters. `generate` runs `steps` decode steps and returns one packed
host array; the scheduler reads tokens and done flags from it and never touches device arrays.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters; they ride along into the request's slot."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int = 0  # per-request PRNG seed: same seed, same tokens
    max_tokens: int = 16  # generated tokens, the first (from prefill) included
    min_tokens: int = 0  # EOS is ignored until this many tokens were generated
    ignore_eos: bool = False  # generate exactly max_tokens


@dataclass
class Prefix:
    """A prefilled sequence waiting to be inserted into a decode slot.

    `kv` is engine-private (device arrays for [L, T_bucket, K, H] keys and values, or whatever
    the engine needs); the scheduler only moves it between `prefill`, `transfer` and `insert`.
    """

    kv: object
    length: int  # true prompt length (tokens in the cache)
    first_token: int  # sampled from the prefill logits, already streamed to the client
    params: SamplingParams
    done: bool = False  # the first token already ends the request (EOS or max_tokens == 1)


@dataclass(frozen=True)
class StepOutput:
    """What one `generate` call returns, already on the host.

    tokens[s, b]: the token slot b produced at step s (garbage where not valid[s, b]).
    valid[s, b]: slot b was active at step s, so tokens[s, b] belongs to its request.
    done[s, b]: tokens[s, b] is that request's last token (EOS honoured after min_tokens,
        max_tokens reached, or the slot's KV is full). After done, the slot stays inactive
        until the next insert.
    lengths[b]: each slot's KV length after the call.
    """

    tokens: np.ndarray  # int32 [steps, slots]
    valid: np.ndarray  # bool [steps, slots]
    done: np.ndarray  # bool [steps, slots]
    lengths: np.ndarray  # int32 [slots]


class DecodeState(Protocol):
    """Engine-private; the scheduler keeps it and passes it back."""


class Engine(Protocol):
    """The verbs the scheduler drives. One instance per device set."""

    slots: int  # decode batch size (KV cache slots)
    max_seq_len: int  # KV length per slot
    eos_id: int
    vocab_size: int  # ids the tokenizer can decode; sampling never goes beyond

    warmup_total: int  # steps warmup reports progress in (compile units)

    def warmup(self, progress: Callable[[int, int], None] | None = None) -> float:
        """Compile every bucket and phase; returns seconds spent. Called before serving;
        `progress(done, warmup_total)` after each compile unit."""
        ...

    def init_decode_state(self) -> DecodeState:
        """Empty cache, every slot inactive."""
        ...

    def prefill(self, tokens: list[int], params: SamplingParams) -> Prefix:
        """Run the prompt (padded to a bucket, chunked past the largest) and sample token 1."""
        ...

    def transfer(self, prefix: Prefix, to: Engine) -> Prefix:
        """Move a prefix to another engine's devices and sharding (disaggregation)."""
        ...

    def insert(self, state: DecodeState, prefix: Prefix, slot: int) -> DecodeState:
        """Place a prefix in a free slot; the slot becomes active with its params."""
        ...

    def release(self, state: DecodeState, slot: int) -> DecodeState:
        """Deactivate a slot (cancel, stop string); its row is free for the next insert."""
        ...

    def generate(self, state: DecodeState, steps: int) -> tuple[DecodeState, StepOutput]:
        """Run `steps` decode steps over all slots with one host sync at the end."""
        ...

    def compile_count(self) -> int:
        """Compilations so far (to prove none happen on the request path)."""
        ...
