"""An Engine with outputs computable by hand, for scheduler/API tests and `scaletui serve --fake`.

Prefill's first token is (last prompt token + 1) % vocab_size; each decode step emits
(previous token + 1) % vocab_size. With the byte tokenizer the prompt "a" continues "bcd...",
and a sequence reaches EOS (257) after byte 255 and BOS 256. Its logprobs are as simple: after
token p, token (p + j) % vocab_size has logprob -j ln 2 (j = 1 .. vocab_size, so p itself is
last), so the emitted token always has -ln 2 and the top k are p+1 .. p+k. `step_s` /
`prefill_s` sleep to mimic compute, so timing behaviour (continuous batching, disconnects) is
observable.
`FakeEngineFactory` builds them the way `build.JaxEngineFactory` builds the real ones.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from scaletui.serve.engine.engine_api import (
    LOGPROB_ROW,
    MAX_LOGPROBS,
    Chunk,
    Engine,
    EngineInfo,
    Prefix,
    SamplingParams,
    StepOutput,
    TokenLogprobs,
    check_packing,
    check_request,
    pack_logprobs,
    unpack_logprobs,
)
from scaletui.shape import ServerShape

WARMUP_UNITS = 2  # "shapes": prefill and generate


@dataclass
class FakeState:
    """Per-slot host arrays: the decode state the scheduler passes back."""

    active: np.ndarray  # bool [B]
    last: np.ndarray  # int32 [B]
    lengths: np.ndarray  # int32 [B]
    generated: np.ndarray  # int32 [B] tokens produced so far (the prefill one included)
    params: list[SamplingParams | None] = field(default_factory=list)
    prefilled: dict[int, int] = field(default_factory=dict)  # slot -> prompt tokens so far


class FakeEngine:
    """Implements `engine_api.Engine` on the host; `slots` and `max_seq_len` as configured."""

    def __init__(
        self,
        slots: int,
        max_seq_len: int,
        vocab_size: int,
        eos_ids: tuple[int, ...],
        step_s: float = 0.0,
        prefill_s: float = 0.0,
        warmup_s: float = 0.0,
        name: str = "fake",
        *,
        devices: tuple[int, ...] = (0,),  # ids it pretends to run on (for /stats)
        dp: int = 1,
        tp: int = 1,
        page_size: int = 16,
        pages: int = 0,  # per replica, scratch included; 0: every slot at max_seq_len
        mix_tokens: int = 0,  # the prompt rows generate_mixed takes (0: it mixes none)
    ) -> None:
        self.slots, self.max_seq_len = slots, max_seq_len
        self.replicas, self.page_size = dp, page_size
        self.pages_per_seq = -(-max_seq_len // page_size)
        self.pages = pages or slots // dp * self.pages_per_seq + 1
        self.vocab_size, self.eos_ids = vocab_size, tuple(eos_ids)
        self.step_s, self.prefill_s, self.warmup_s = step_s, prefill_s, warmup_s
        self.name, self.devices, self.dp, self.tp = name, devices, dp, tp
        self.mix_tokens = mix_tokens
        self._compiles = 0

    def describe(self) -> EngineInfo:
        """No kernels, no device memory; the mesh the config asked for."""
        return EngineInfo(
            self.dp,
            self.tp,
            self.devices,
            "none",
            0,
            0,
            0,
            0,
            WARMUP_UNITS,
            page_size=self.page_size,
            kv_pages=self.pages,
        )

    def warmup(self, progress: Callable[[int, int], None] | None = None) -> float:
        t0 = time.perf_counter()
        for i in range(1, WARMUP_UNITS + 1):
            time.sleep(self.warmup_s / WARMUP_UNITS)
            self._compiles += 1
            if progress is not None:
                progress(i, WARMUP_UNITS)
        return time.perf_counter() - t0

    def compile_count(self) -> int:
        return self._compiles

    def init_decode_state(self) -> FakeState:
        b = self.slots
        return FakeState(
            np.zeros(b, bool),
            np.zeros(b, np.int32),
            np.zeros(b, np.int32),
            np.zeros(b, np.int32),
            [None] * b,
        )

    def prefill(self, tokens: list[int], params: SamplingParams) -> Prefix:
        assert 0 < len(tokens) < self.max_seq_len, len(tokens)
        time.sleep(self.prefill_s)
        return self._prefix(list(tokens), tokens, params)

    def _prefix(self, kv: list[int] | None, tokens: list[int], params: SamplingParams) -> Prefix:
        first = (tokens[-1] + 1) % self.vocab_size
        done = params.max_tokens <= 1 or self._is_eos(first, 1, params)
        mine = prompt = None
        if params.logprobs is not None:
            mine = unpack_logprobs(self.logprob_row(tokens[-1], first), params.logprobs)
        if params.prompt_logprobs is not None:
            k, pairs = params.prompt_logprobs, zip(tokens, tokens[1:], strict=False)
            prompt = (None, *(unpack_logprobs(self.logprob_row(a, b), k) for a, b in pairs))
        return Prefix(kv, len(tokens), first, params, done, mine, prompt)

    def logprob_row(self, prev: int, token: int) -> np.ndarray:
        """The packed logprobs of `token` after `prev` (see the module docstring)."""
        v = self.vocab_size
        ln2 = float(np.log(2.0))
        top = [(prev + j) % v for j in range(1, MAX_LOGPROBS + 1)]
        values = [-j * ln2 for j in range(1, MAX_LOGPROBS + 1)]
        return pack_logprobs(-((token - prev - 1) % v + 1) * ln2, top, values)

    def token_logprobs(self, prev: int, token: int, k: int) -> TokenLogprobs:
        """What a request asking for `k` candidates gets for `token` after `prev` (tests)."""
        return unpack_logprobs(self.logprob_row(prev, token), k)

    def prefill_pages(
        self,
        state: FakeState,
        tokens: list[int],
        params: SamplingParams,
        slot: int,
        pages: Sequence[int],
        start: int = 0,
        stop: int | None = None,
    ) -> tuple[FakeState, Prefix | None]:
        """prefill's outputs; sleeps prefill_s for the share of the prompt it runs."""
        n, stop = len(tokens), len(tokens) if stop is None else stop
        if not 0 <= start < stop <= n or start % self.page_size:
            raise ValueError(
                f"prefill_pages: need 0 <= start < stop <= {n}, start a multiple "
                f"of {self.page_size}, got start={start} stop={stop}"
            )
        if len(pages) < -(-stop // self.page_size) or not all(0 < p < self.pages for p in pages):
            raise ValueError(
                f"positions up to {stop} need {-(-stop // self.page_size)} pages "
                f"in [1, {self.pages}), got {list(pages)}"
            )
        time.sleep(self.prefill_s * (stop - start) / n)
        # as the real engine, which keeps each chunk's prompt logprobs until the prompt's end
        if params.prompt_logprobs is not None and start and start != state.prefilled.get(slot):
            raise ValueError(f"prompt logprobs need the prompt prefilled from 0, got {start}")
        state.prefilled[slot] = stop
        if stop < n:
            return state, None
        del state.prefilled[slot]
        return state, self._prefix(None, tokens, params)

    def transfer(self, prefix: Prefix, to: object) -> Prefix:
        p = prefix
        return Prefix(
            list(p.kv), p.length, p.first_token, p.params, p.done, p.logprobs, p.prompt_logprobs
        )

    def insert(
        self, state: FakeState, prefix: Prefix, slot: int, pages: Sequence[int]
    ) -> FakeState:
        assert not state.active[slot], f"slot {slot} is busy"
        need = -(-prefix.length // self.page_size)
        if len(pages) < need or not all(0 < p < self.pages for p in pages):
            raise ValueError(
                f"a {prefix.length}-token prefix needs {need} pages in [1, "
                f"{self.pages}), got {list(pages)}"
            )
        state.active[slot] = True
        state.last[slot] = prefix.first_token
        state.lengths[slot] = prefix.length
        state.generated[slot] = 1
        state.params[slot] = prefix.params
        return state

    def release(self, state: FakeState, slot: int) -> FakeState:
        state.active[slot] = False
        state.params[slot] = None
        state.prefilled.pop(slot, None)
        return state

    def generate(
        self, state: FakeState, steps: int, pages: np.ndarray
    ) -> tuple[FakeState, StepOutput]:
        self._check_pages(state, steps, pages)
        time.sleep(self.step_s * steps)
        b = self.slots
        tokens = np.zeros((steps, b), np.int32)
        valid = np.zeros((steps, b), bool)
        done = np.zeros((steps, b), bool)
        asked = [s for s in np.flatnonzero(state.active) if state.params[s].logprobs is not None]
        lps = np.zeros((steps, LOGPROB_ROW, b), np.float32) if asked else None
        for s in range(steps):
            for slot in np.flatnonzero(state.active):
                params = state.params[slot]
                token = (int(state.last[slot]) + 1) % self.vocab_size
                if lps is not None and params.logprobs is not None:
                    lps[s, :, slot] = self.logprob_row(int(state.last[slot]), token)
                state.lengths[slot] += 1  # the previous token's KV is now in the cache
                state.generated[slot] += 1
                state.last[slot] = token
                n = int(state.generated[slot])
                finished = (
                    n >= params.max_tokens
                    or self._is_eos(token, n, params)
                    or state.lengths[slot] >= self.max_seq_len
                )
                tokens[s, slot], valid[s, slot], done[s, slot] = token, True, finished
                if finished:
                    state.active[slot] = False
        return state, StepOutput(tokens, valid, done, state.lengths.copy(), lps)

    def check_chunks(self, chunks: Sequence[Chunk], state: FakeState | None = None) -> None:
        """engine_api.check_packing, then each piece's input as prefill_pages checks it."""
        check_packing(chunks, self.mix_tokens, self.page_size)
        for c in chunks:
            check_request(c.tokens, c.params, self.max_seq_len, self.vocab_size)

    def generate_mixed(
        self, state: FakeState, steps: int, pages: np.ndarray, chunks: Sequence[Chunk]
    ) -> tuple[FakeState, StepOutput, list[Prefix | None]]:
        """prefill_pages' outcome for each chunk, then generate's (it sleeps for all)."""
        self.check_chunks(chunks)
        busy = [c.slot for c in chunks if state.active[c.slot]]
        if busy:
            raise ValueError(f"generate_mixed: chunks into active slots {busy}")
        prefixes = []
        for c in chunks:
            args = (c.tokens, c.params, c.slot, c.pages, c.start, c.stop)
            state, prefix = self.prefill_pages(state, *args)
            prefixes.append(prefix)
        return (*self.generate(state, steps, pages), prefixes)

    def _check_pages(self, state: FakeState, steps: int, pages: np.ndarray) -> None:
        """What the real engine needs and cannot check on the device: every active slot holds
        pages for each position the call writes, and no two slots write into the same page."""
        written: dict[int, int] = {}
        for slot in np.flatnonzero(state.active):
            length, left = int(state.lengths[slot]), self._left(state, slot)
            last = min(length + min(steps, left), self.max_seq_len) - 1  # the last one written
            held = pages[slot, : last // self.page_size + 1]
            if not (held > 0).all():
                raise ValueError(
                    f"slot {slot} at length {length} writes up to position {last} "
                    f"but holds pages {pages[slot].tolist()}"
                )
            for page in held[length // self.page_size :]:
                other = written.setdefault(int(page), int(slot))
                if other != slot:
                    raise ValueError(f"slots {other} and {slot} both write page {page}")

    def _left(self, state: FakeState, slot: int) -> int:
        """Tokens slot `slot` may still produce (its max_tokens less what it has)."""
        return state.params[slot].max_tokens - int(state.generated[slot])

    def _is_eos(self, token: int, generated: int, params: SamplingParams) -> bool:
        return token in self.eos_ids and not params.ignore_eos and generated >= params.min_tokens


@dataclass(frozen=True)
class FakeEngineFactory:
    """`engine_api.EngineFactory` for FakeEngines: one engine twice when interleaved, else two
    on consecutive (pretend) device ids. Every config the ServerShape accepts is buildable."""

    vocab_limit: int | None = None  # the tokenizer's vocabulary (default: the model's)
    eos_ids: tuple[int, ...] = (257,)  # the byte tokenizer's EOS
    step_s: float = 0.002
    prefill_s: float = 0.002
    warmup_s: float = 0.0
    engine: type[FakeEngine] = FakeEngine  # tests pass a subclass that fails on purpose

    def build(self, config: ServerShape) -> tuple[Engine, Engine]:
        vocab = self.vocab_limit or config.model.vocab_size
        n = config.tp * config.dp

        def make(name: str, first: int) -> FakeEngine:
            return self.engine(
                config.slots,
                config.max_seq_len,
                vocab,
                self.eos_ids,
                self.step_s,
                self.prefill_s,
                self.warmup_s,
                name,
                devices=tuple(range(first, first + n)),
                dp=config.dp,
                tp=config.tp,
                page_size=config.page_size,
                pages=config.pages,
                mix_tokens=config.mixing if config.mode == "interleaved" else 0,
            )

        if config.mode == "interleaved":
            engine = make("fake", 0)
            return engine, engine
        return make("fake-prefill", 0), make("fake-generate", n)

    def check(self, config: ServerShape, current: tuple[Engine, Engine] | None = None) -> None:
        """Nothing to check: fakes hold no device memory and run on any 'mesh'."""
