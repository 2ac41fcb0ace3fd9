"""The engine's verbs, as the scheduler sees them (after JetStream's engine_api).

An engine owns one compiled model on one device set. The scheduler drives it with a handful of
verbs that take state and return state; `FakeEngine` in the tests implements the same protocol
with outputs computable by hand. Nothing here imports JAX.

An `EngineFactory` builds the (prefill, generate) pair for a config and checks a config before
anything is built; an engine says what it is with `describe()` (mesh, kernels, bytes), so
nobody probes it for attributes.

Decode state holds the paged KV cache (each data-parallel replica's pool of `pages` pages of
`page_size` positions, page 0 scratch) and, per slot: the live length, the last token, the
sampling parameters and the stop counters. Which pages a sequence holds is the scheduler's
(pages.py): `insert` takes the pages a prefix goes into, `generate` every slot's page table.
`generate` runs `steps` decode steps and returns one packed host array; the scheduler reads
tokens and done flags from it and never touches device arrays.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from scaletui import policy

if TYPE_CHECKING:
    from scaletui.shape import ServerShape


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
    # top candidates to return beside each generated token's logprob (0..MAX_LOGPROBS);
    # None: no logprobs at all (the step then skips their work)
    logprobs: int | None = None
    # the same for every prompt token but the first (completions' echo); None: off
    prompt_logprobs: int | None = None


# Logprobs: the device computes the top MAX_LOGPROBS candidates of a position whatever a request
# asked for (one compiled shape), and packs a position into LOGPROB_ROW f32 values: the chosen
# token's logprob, the top values (best first), then the top ids as int32 bits.
MAX_LOGPROBS = 20  # OpenAI's limit for top_logprobs
LOGPROB_ROW = 1 + 2 * MAX_LOGPROBS
# what logprobs score: the logits a sampled row draws from (after its temperature, top-k, top-p)
# or the model's own; vLLM's names (its --logprobs-mode), vLLM v1's default being RAW
PROCESSED, RAW = "processed_logprobs", "raw_logprobs"
LOGPROBS_MODES = (PROCESSED, RAW)


def logprobs_code(params: SamplingParams, processed: bool) -> int:
    """How a request's logprobs ride into the compiled steps (an int32 per row): 0 not asked,
    1 from the raw logits, 2 from the logits its sampler saw (the engine's logprobs mode)."""
    if params.logprobs is None:
        return 0
    return 2 if processed else 1


@dataclass(frozen=True)
class TokenLogprobs:
    """One position's log-probabilities: the chosen token's and the best candidates'."""

    logprob: float  # of the token at this position (sampled, or the prompt's)
    top: tuple[tuple[int, float], ...]  # (token id, logprob), best first, as many as asked


def pack_logprobs(logprob: float, ids: Sequence[int], values: Sequence[float]) -> np.ndarray:
    """The host side of the device's packing (the fake engine's): MAX_LOGPROBS candidates."""
    assert len(ids) == len(values) == MAX_LOGPROBS, (len(ids), len(values))
    bits = np.asarray(ids, np.int32).view(np.float32)
    return np.concatenate([[logprob], np.asarray(values, np.float32), bits]).astype(np.float32)


def unpack_logprobs(row: np.ndarray, k: int) -> TokenLogprobs:
    """A packed f32 [LOGPROB_ROW] position (see LOGPROB_ROW) -> its logprob and top `k`."""
    n = MAX_LOGPROBS
    values = row[1 : 1 + k].tolist()
    ids = np.ascontiguousarray(row[1 + n : 1 + n + k]).view(np.int32).tolist()
    return TokenLogprobs(float(row[0]), tuple(zip(ids, values, strict=True)))


def prompt_logprobs_of(rows: np.ndarray, k: int) -> tuple[TokenLogprobs | None, ...]:
    """Packed rows [n - 1, LOGPROB_ROW] of prompt positions 0..n-2 (position i scores token
    i + 1) -> one entry per prompt token, None for the first, as OpenAI's echo gives them."""
    return (None, *(unpack_logprobs(row, k) for row in rows))


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
    logprobs: TokenLogprobs | None = None  # the first token's, when params.logprobs is set
    # params.prompt_logprobs: one per prompt token, None for the first (nothing predicts it)
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None

    @classmethod
    def of_prompt(
        cls,
        kv: object,
        tokens: list[int],
        first: int,
        params: SamplingParams,
        eos_ids: tuple[int, ...],
        lp: np.ndarray,
        rows: list[np.ndarray],
    ) -> Prefix:
        """The Prefix of a prompt whose last chunk sampled `first`, with its logprobs (the last
        of `lp`'s packed rows) and the prompt's (`rows`: each chunk's packed rows, in order,
        the last row of each the next token's), read from them only when `params` asks."""
        n = len(tokens)
        eos = first in eos_ids and params.min_tokens == 0 and not params.ignore_eos
        mine = prompt = None
        if params.logprobs is not None:
            mine = unpack_logprobs(np.asarray(lp)[-1], params.logprobs)
        if params.prompt_logprobs is not None:  # each chunk's rows but its last (the first token)
            packed = np.concatenate([np.asarray(r)[:-1] for r in rows])[: n - 1]
            assert len(packed) == n - 1, (len(packed), n)
            prompt = prompt_logprobs_of(packed, params.prompt_logprobs)
        done = eos or params.max_tokens <= 1
        return cls(kv, n, first, params, done=done, logprobs=mine, prompt_logprobs=prompt)


@dataclass(frozen=True)
class Chunk:
    """A prompt piece that rides in a generate call (`Engine.generate_mixed`): tokens[start:stop]
    of a prompt into `slot`'s `pages`, as `prefill_pages` takes them."""

    tokens: list[int]
    params: SamplingParams
    slot: int
    pages: Sequence[int]
    start: int
    stop: int


@dataclass(frozen=True)
class StepOutput:
    """What one `generate` call returns, already on the host.

    tokens[s, b]: the token slot b produced at step s (garbage where not valid[s, b]).
    valid[s, b]: slot b was active at step s, so tokens[s, b] belongs to its request.
    done[s, b]: tokens[s, b] is that request's last token (EOS honoured after min_tokens,
        max_tokens reached, or the slot's KV is full). After done, the slot stays inactive
        until the next insert.
    lengths[b]: each slot's KV length after the call.
    logprobs[s, :, b]: tokens[s, b]'s packed logprobs (LOGPROB_ROW), for the slots whose
        request asked; None when no active slot asked (nothing was copied to the host).
    """

    tokens: np.ndarray  # int32 [steps, slots]
    valid: np.ndarray  # bool [steps, slots]
    done: np.ndarray  # bool [steps, slots]
    lengths: np.ndarray  # int32 [slots]
    logprobs: np.ndarray | None = None  # f32 [steps, LOGPROB_ROW, slots]


@dataclass(frozen=True)
class EngineInfo:
    """What an engine is, for /stats and the memory check (`Engine.describe()`)."""

    data: int  # the 'data' mesh axis (dp)
    model: int  # the 'model' mesh axis (tp)
    devices: tuple[int, ...]  # device ids of its mesh
    # "native" (serve/engine/native C++ kernels) | "pallas" (decode attention on JAX's Pallas
    # paged-attention kernels) | "xla" | "none" (FakeEngine)
    kernels: str
    weight_bytes: int  # summed over its devices (replicas counted on each)
    kv_cache_bytes: int  # summed over its devices
    weight_bytes_per_device: int
    kv_cache_bytes_per_device: int
    warmup_total: int  # compile units `warmup` reports progress in
    dtype: str = "f32"  # compute (activations)
    weight_dtype: str = "f32"  # weight storage: f32 | bf16 | int8 (+ f32 per-channel scales)
    kv_dtype: str = "f32"  # KV-cache storage: f32 | bf16 | int8 (+ f32 scales)
    kernels_note: str | None = None  # why XLA's ops run where native could, or a native fallback
    kernels_dense: str | None = None  # native: how the dense kernel runs (native.dense_path)
    page_size: int = 0  # KV positions per page (0: no paged cache, the fake engine)
    kv_pages: int = 0  # KV pages per data-parallel replica, the scratch page included

    def mesh(self) -> dict:
        """The /stats `mesh.prefill` / `mesh.generate` object."""
        return {
            "data": self.data,
            "model": self.model,
            "devices": list(self.devices),
            "kernels": self.kernels,
        }

    @property
    def held_bytes(self) -> int:
        """Device memory this engine holds (weights and KV cache), freed when it is dropped."""
        return self.weight_bytes + self.kv_cache_bytes


def check_request(
    tokens: list[int], params: SamplingParams, max_seq_len: int, vocab_size: int
) -> None:
    """ValueError naming the value when a prompt or its parameters cannot be prefilled."""
    n = len(tokens)
    if not 1 <= n < max_seq_len:
        raise ValueError(f"prompt length must be in [1, {max_seq_len - 1}], got {n}")
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token ids must be in [0, {vocab_size}), got {bad[:5]}")
    if params.temperature < 0 or params.top_k < 0 or not 0 < params.top_p <= 1:
        raise ValueError(
            f"need temperature >= 0, top_k >= 0, 0 < top_p <= 1; got temperature="
            f"{params.temperature} top_k={params.top_k} top_p={params.top_p}"
        )
    if params.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {params.max_tokens}")
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}] or None, got {k}")


def check_packing(chunks: Sequence[Chunk], mix_tokens: int, page_size: int) -> None:
    """ValueError naming the pieces unless `policy.riders` packs all of `chunks` into a mixed
    call of `mix_tokens` prompt rows (0: the engine mixes none), each into its own slot."""
    pieces, starts = [c.stop - c.start for c in chunks], [c.start for c in chunks]
    slots = [c.slot for c in chunks]
    fits = policy.riders(pieces, starts, 1, mix_tokens, page_size) == len(chunks)
    if not chunks or min(pieces) < 1 or not fits or len(set(slots)) < len(slots):
        raise ValueError(
            f"generate_mixed takes 1 to {policy.MIX_PIECES} pieces of a token or more, in "
            f"slots of their own, packed from page boundaries ({page_size}) into {mix_tokens} "
            f"rows (0: this engine mixes none), only the first past its prompt's start; got "
            f"(slot, start, stop) {[(c.slot, c.start, c.stop) for c in chunks]}"
        )


class DecodeState(Protocol):
    """Engine-private; the scheduler keeps it and passes it back."""


class Engine(Protocol):
    """The verbs the scheduler drives. One instance per device set."""

    slots: int  # decode batch size: running sequences at most
    max_seq_len: int  # longest sequence (prompt + generated)
    replicas: int  # data-parallel replicas: slot b belongs to replica b // (slots / replicas)
    page_size: int  # KV positions per page
    pages: int  # KV pages per replica, page 0 (scratch) included
    pages_per_seq: int  # pages a max_seq_len sequence holds: a page table row's width
    eos_ids: tuple[int, ...]  # sampling any of them ends a sequence ("stop")
    vocab_size: int  # ids the tokenizer can decode; sampling never goes beyond
    mix_tokens: int  # the prompt rows `generate_mixed` takes (policy.riders; 0: it mixes none)

    def describe(self) -> EngineInfo:
        """Mesh, kernels, bytes held and compile units; cheap (polled by /stats)."""
        ...

    def warmup(self, progress: Callable[[int, int], None] | None = None) -> float:
        """Compile every bucket and phase; returns seconds spent. Called before serving;
        `progress(done, describe().warmup_total)` after each compile unit."""
        ...

    def init_decode_state(self) -> DecodeState:
        """Empty cache, every slot inactive."""
        ...

    def prefill(self, tokens: list[int], params: SamplingParams) -> Prefix:
        """Run the prompt (padded to a bucket, chunked past the largest) and sample token 1."""
        ...

    def prefill_pages(
        self,
        state: DecodeState,
        tokens: list[int],
        params: SamplingParams,
        slot: int,
        pages: Sequence[int],
        start: int = 0,
        stop: int | None = None,
    ) -> tuple[DecodeState, Prefix | None]:
        """Interleaved engines: prefill tokens[start:stop] straight into `slot`'s `pages`
        (positions before `start` are there already: earlier chunks or a cached prefix). At
        the prompt's end, the Prefix to `insert` (kv None), else None."""
        ...

    def transfer(self, prefix: Prefix, to: Engine) -> Prefix:
        """Move a prefix to another engine's devices and sharding (disaggregation)."""
        ...

    def insert(
        self, state: DecodeState, prefix: Prefix, slot: int, pages: Sequence[int]
    ) -> DecodeState:
        """Place a prefix in a free slot, its K/V in `pages` (ids in the slot's replica, at
        least ceil(length / page_size) of them); the slot becomes active with its params."""
        ...

    def release(self, state: DecodeState, slot: int) -> DecodeState:
        """Deactivate a slot (cancel, stop string); its row is free for the next insert."""
        ...

    def generate(
        self, state: DecodeState, steps: int, pages: np.ndarray
    ) -> tuple[DecodeState, StepOutput]:
        """Run `steps` decode steps over all slots with one host sync at the end. `pages`
        [slots, W]: every slot's page table (0 where it holds none), covering the positions
        the call writes: each active slot's length + steps."""
        ...

    def check_chunks(self, chunks: Sequence[Chunk], state: DecodeState | None = None) -> None:
        """ValueError naming the value when `generate_mixed` cannot take `chunks` (a piece's
        input, or pieces that `policy.riders` would not pack into `mix_tokens` rows; with
        `state`, what it holds of their prompts too), before anything runs."""
        ...

    def generate_mixed(
        self, state: DecodeState, steps: int, pages: np.ndarray, chunks: Sequence[Chunk]
    ) -> tuple[DecodeState, StepOutput, list[Prefix | None]]:
        """`generate`, whose first step also runs `chunks` in the same forward pass (as
        `check_chunks` takes them; their slots not active): the decode tokens as `generate`
        gives them and each chunk's outcome as `prefill_pages` gives it (the Prefix to `insert`
        at its prompt's end, else None). Greedy tokens are the same as unmixed calls give."""
        ...

    def compile_count(self) -> int:
        """Compilations so far (to prove none happen on the request path)."""
        ...


class EngineFactory(Protocol):
    """Builds engines for a config; the scheduler calls `check` before it drains anything."""

    def build(self, config: ServerShape) -> tuple[Engine, Engine]:
        """(prefill engine, generate engine); the same object twice when interleaved."""
        ...

    def check(self, config: ServerShape, current: tuple[Engine, Engine] | None = None) -> None:
        """Raise ConfigError when `config` cannot be built here (sharding, kernels, memory);
        `current`: the engines running now, whose memory a rebuild frees."""
        ...


def distinct(engines: tuple[Engine, Engine]) -> tuple[Engine, ...]:
    """The pair's engines once each (interleaved: one engine serves both roles)."""
    prefill, generate = engines
    return (prefill,) if prefill is generate else (prefill, generate)
