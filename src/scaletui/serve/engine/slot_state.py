"""The slot vectors that ride with the KV cache: their fields and dtypes, the `DecodeState`
pytree the engine donates into every call, its host mirror `SlotState`, and the packing and
setting of one slot's fields (`pack_insert_args` on the host, `activate` / `release` on device)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from scaletui.serve.engine.engine_api import SamplingParams, logprobs_code

# slot vectors: name -> dtype
SLOT_FIELDS = {
    "lengths": jnp.int32,
    "tokens": jnp.int32,
    "active": jnp.bool_,
    "generated": jnp.int32,
    "temperature": jnp.float32,
    "top_k": jnp.int32,
    "top_p": jnp.float32,
    "seed": jnp.int32,
    "max_tokens": jnp.int32,
    "min_tokens": jnp.int32,
    "ignore_eos": jnp.bool_,
    "logprobs": jnp.int32,  # engine_api.logprobs_code: 0 not asked, 1 raw, 2 processed
}


class DecodeState(NamedTuple):
    """The engine's device-side decode state (a pytree; donated into every call).

    `cache`: per layer a pool of pages in one of the LAYOUTS, page-major {"k": [dp * P, K, H,
    S], "v": [dp * P, K, S, H]} (int8: also "k_scale", "v_scale": [dp * P, K, S]) or
    head-major; every other field is a [B] vector (B = slot rows) with the
    dtype SLOT_FIELDS gives.
    """

    cache: list
    lengths: jax.Array  # tokens in the slot's cache
    tokens: jax.Array  # the next input token
    active: jax.Array
    generated: jax.Array  # tokens produced, the prefill one included
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array
    max_tokens: jax.Array
    min_tokens: jax.Array
    ignore_eos: jax.Array
    logprobs: jax.Array


assert DecodeState._fields[1:] == tuple(SLOT_FIELDS)


@dataclass
class SlotState:
    """What an engine hands the scheduler: the device state (donated into each call) and a
    host mirror of two vectors, so picking a decode bucket needs no device sync."""

    arrays: DecodeState
    lengths: np.ndarray  # int32 [rows], tokens in each slot's cache
    active: np.ndarray  # bool [rows]
    # bool [rows]: the slot's request asked for logprobs (generate then copies them to the host)
    logprobs: np.ndarray | None = None
    # slot -> packed prompt logprob rows of the chunks prefilled so far (prompt_logprobs)
    prompt_rows: dict[int, list[np.ndarray]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.logprobs is None:
            self.logprobs = np.zeros(self.active.shape, bool)

    def replaced(self, arrays: DecodeState, **mirror: np.ndarray) -> SlotState:
        """The same host mirror (copied where `mirror` gives new vectors) over new arrays."""
        fields = {"lengths": self.lengths, "active": self.active, "logprobs": self.logprobs}
        return SlotState(arrays, **{**fields, **mirror}, prompt_rows=self.prompt_rows)


# insert() packs a request's integer and float fields into two small arrays, in this order
INT_FIELDS = ("slot", "lengths", "tokens", "active", "top_k", "seed", "max_tokens", "min_tokens")
INT_FIELDS += ("ignore_eos", "logprobs")
FLOAT_FIELDS = ("temperature", "top_p")


def activate(state: DecodeState, ints: jax.Array, floats: jax.Array) -> DecodeState:
    """Set row `ints[0]`'s fields (its K/V are in its pages already: prefill wrote them)."""
    fields = dict(zip(INT_FIELDS, ints, strict=True))
    fields.update(zip(FLOAT_FIELDS, floats, strict=True))
    slot = fields.pop("slot")
    now = state._asdict()
    new = {
        name: now[name].at[slot].set(value.astype(now[name].dtype))
        for name, value in fields.items()
    }
    new["generated"] = state.generated.at[slot].set(1)
    return state._replace(**new)


def release(state: DecodeState, slot: jax.Array) -> DecodeState:
    return state._replace(active=state.active.at[slot].set(False))


def pack_insert_args(
    slot: int,
    length: int,
    first: int,
    active: bool,
    params: SamplingParams,
    processed: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Host-side packing of one insert's scalars; `processed`: the engine's logprobs mode."""
    ints = np.array(
        [
            slot,
            length,
            first,
            active,
            params.top_k,
            params.seed % 2**31,
            params.max_tokens,
            params.min_tokens,
            params.ignore_eos,
            logprobs_code(params, processed),
        ],
        np.int32,
    )
    return ints, np.array([params.temperature, params.top_p], np.float32)
