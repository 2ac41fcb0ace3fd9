"""The timed engine calls a CostModel is fitted to (`costfit.fit`): what `scaletui calibrate
--model` measures, one record per call shape.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeSample:
    """One timed generate call: `steps` decode steps of `batch` rows over `context` KV positions
    (what the step reads: the engine's KV bucket)."""

    batch: int
    context: int
    seconds: float  # the whole call, host sync included (the median of its timed calls)
    steps: int = 1
    spread: tuple = ()  # each timed call over `seconds` (how much one call varies here)


@dataclass(frozen=True)
class PrefillSample:
    """One timed prefill call of `tokens` query positions (the padded bucket) after `start`
    positions already in the cache (a chunk of a long prompt; 0 otherwise)."""

    tokens: int
    seconds: float  # the median of its timed calls
    start: int = 0
    spread: tuple = ()  # each timed call over `seconds`
