"""The simulator's records: what the client sends (`Load`), the host's costs around the engine
calls (`SimTiming`, and our server's measured defaults for them), and one run's result
(`SimResult`: per-request times and loadgen's summary).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

BOS_TOKENS = 1  # what our server puts before a text prompt (its tokenizer's BOS), not before ids
INTAKE_S = 1e-3  # our server's intake per request (aiohttp, JSON, tokenizer; ~0.5-2 ms on CPU)
# our scheduler's host time before an engine call (bookkeeping, insert, token fan-out) and its
# growth per running request: a line through the server's measured /stats host_gap
# (docs/roofline.md, "Three levels of prediction")
HOST_GAP_S = 0.55e-3
HOST_GAP_PER_ROW_S = 0.07e-3


@dataclass(frozen=True)
class SimTiming:
    """The host's costs around the engine calls, which a server's shape does not set: what the
    simulator adds to the cost model's times, and how it reads them."""

    intake_s: float = 0.0  # a request's HTTP + tokenizer time before it queues, one at a time
    gap_s: float = 0.0  # the scheduler's host time before each engine call while it has work
    gap_per_row_s: float = 0.0  # and its growth per running request (each one's tokens fan out)
    padded_decode: bool = True  # a step costs slots rows x KV bucket (the JAX engine's shapes)

    def __post_init__(self) -> None:
        for name in ("intake_s", "gap_s", "gap_per_row_s"):
            if not 0 <= vars(self)[name] < 1:
                raise ValueError(f"{name} should be in [0, 1) s, got {vars(self)[name]}")


@dataclass(frozen=True, eq=False)
class Load:
    """The client side: one row per request, as loadgen's workload draws them."""

    offsets: np.ndarray  # intended send times, s after t0 (ignored in a closed loop)
    input_len: np.ndarray  # prompt tokens as the server prefills them (BOS, shared prefix included)
    output_len: np.ndarray  # max_tokens (exact: loadgen ignores EOS)
    concurrency: int | None = None  # cap on requests in flight (closed loop without a rate)
    closed_loop: bool = False  # send at a permit, not at an offset
    duration: float | None = None  # stop sending at this many seconds
    requested_rate: float | None = None  # the offered rate, for the summary
    prefix_len: int = 0  # shared-prefix tokens at the start of every prompt (loadgen's)
    prefix_groups: int = 1  # distinct shared prefixes: request i has prefix i % groups

    def __post_init__(self) -> None:
        n = len(self.offsets)
        if len(self.input_len) != n or len(self.output_len) != n:
            raise ValueError("offsets, input_len and output_len should have one row per request")
        if self.closed_loop and not self.concurrency:
            raise ValueError("a closed loop needs a concurrency")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency should be >= 1, got {self.concurrency}")


@dataclass(frozen=True, eq=False)
class SimResult:
    """Per-request times (s after t0; nan where it never happened) and the loadgen summary."""

    t_sched: np.ndarray
    t_send: np.ndarray
    t_first: np.ndarray
    t_last: np.ndarray
    outcome: np.ndarray  # "ok" | "rejected" (429) | "failed" (400) | "unsent"
    summary: dict = field(repr=False)
    chunk_t: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    chunk_n: np.ndarray = field(default_factory=lambda: np.zeros(0, int), repr=False)
    # ^ each token chunk after a request's first token: when it reached the client, its tokens
    t_admit: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    # ^ per request: when it left the waiting queue for its prefill (queue wait = t_admit - t_send)
    t_second: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    # ^ per request: when its second token (the first decode call's) reached the client
