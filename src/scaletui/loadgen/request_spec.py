"""What a workload yields: one request to send (`RequestSpec`), a conversation's later turns
(`Turn`), and the random filler text of synthetic prompts; shared by workload and replay."""

from __future__ import annotations

import string
from dataclasses import dataclass

import numpy as np

_LETTERS = np.frombuffer(string.ascii_lowercase.encode(), dtype=np.uint8)


@dataclass(frozen=True)
class Turn:
    """A later user turn of a conversation: sent `think_s` after the previous reply ended,
    with the whole history before it."""

    text: str  # the new user message
    input_len: int  # its tokens (intended)
    max_tokens: int
    think_s: float


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: `offset` is its intended send time in seconds after t0. A
    conversation's first turn also carries the turns that follow it."""

    index: int
    offset: float
    prompt: str | list[int]
    input_len: int  # intended prompt tokens (exact for ids prompts and with a tokenizer)
    max_tokens: int
    cancel_after: int | None = None  # abort after this many streamed chunks
    conversation: bool = False  # the first turn of a conversation (per-turn figures)
    later: tuple[Turn, ...] = ()  # the conversation's further turns


def random_text(rng: np.random.Generator, n: int) -> str:
    """n characters: random letters at even positions, spaces between.

    A byte-level tokenizer gives exactly n tokens; BPE tokenizers give ~n/2 (" x" pairs),
    never unpredictable merges of long letter runs.
    """
    chars = np.full(n, ord(" "), dtype=np.uint8)
    chars[0::2] = rng.choice(_LETTERS, size=(n + 1) // 2)
    return chars.tobytes().decode()
