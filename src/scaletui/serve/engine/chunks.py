"""The JAX engine's prompt chunks into a slot's pages: alone (`prefill_pages`) or riding in a
generate call's first step (`generate_mixed`: one forward pass over the decode rows and the
chunk, steps.generate_mixed), with what both share: the chunk's checks, its page row, its
prompt logprobs and its outcome.

A mixed call is compiled per decode bucket for one chunk length, `mix_tokens` (the token
budget: `ServerShape.mixing`), so mixing adds as many programs as there are decode buckets,
all compiled by `warmup`. A chunk shorter than `mix_tokens` is padded to it (its padding's K/V
land past the prompt, where the sequence writes before it reads, as prefill_pages' do).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from scaletui.serve.engine.engine_api import (
    Chunk,
    Prefix,
    SamplingParams,
    StepOutput,
    check_request,
)
from scaletui.serve.engine.slot_state import SlotState
from scaletui.serve.engine.steps import PrefillArgs


class ChunkCalls:
    """`prefill_pages`' and `generate_mixed`'s shared parts (a mixin of `JaxEngine`)."""

    def _check_chunk(self, tokens: list[int], params: SamplingParams, start: int, stop: int,
                     pages: Sequence[int], slot: int) -> None:  # fmt: skip
        """ValueError naming the value when tokens[start:stop] cannot run into `pages`."""
        check_request(tokens, params, self.max_seq_len, self.model.vocab_size)
        n, size = len(tokens), self.page_size
        if not 0 <= start < stop <= n or start % size or len(pages) > self.pages_per_seq:
            raise ValueError(
                f"prefill_pages: need 0 <= start < stop <= {n}, start a multiple "
                f"of the page size {size} and at most {self.pages_per_seq} pages, "
                f"got start={start} stop={stop} and {len(pages)} pages"
            )
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot must be in [0, {self.slots}), got {slot}")

    def _chunk_row(self, slot: int, pages: Sequence[int]) -> tuple[object, object]:
        """(the slot's page row [pages_per_seq] as global ids, its replica's scratch page id past
        `pages`), placed on the devices."""
        base = slot // (self.rows // self.replicas) * self.pages  # the replica's scratch page
        row = np.full(self.pages_per_seq, base, np.int32)
        row[: len(pages)] += np.asarray(pages, np.int32)
        return self._put(row), self._put(np.int32(base))

    def _prompt_rows(self, state: SlotState, slot: int, params: SamplingParams, start: int):
        """The slot's prompt logprob rows so far (a new list at the prompt's start)."""
        if start == 0:
            state.prompt_rows.pop(slot, None)
        rows = state.prompt_rows.setdefault(slot, [])
        if params.prompt_logprobs is not None and start != sum(len(r) - 1 for r in rows):
            raise ValueError(
                f"prompt logprobs need every prompt position prefilled here, but the prompt "
                f"starts at {start} (a cached prefix?); prefill it from 0"
            )
        return rows

    def _chunk_args(self, tokens, params, cur: int, c: int, t: int) -> tuple[object, object]:
        """(tokens[cur:cur + c] padded to `t`, its PrefillArgs), placed."""
        padded = np.zeros(t, np.int32)
        padded[:c] = tokens[cur : cur + c]
        nxt = tokens[cur + c] if cur + c < len(tokens) else 0
        args = PrefillArgs.of(cur + c, params, self.vocab_size, cur, nxt, self.logprobs_processed)
        return self._put(padded), self._put(args)

    def _chunk_end(self, state: SlotState, tokens, params, slot: int, stop: int, tok, lp):
        """The Prefix to insert once `stop` ends the prompt (its K/V are in the pages), else
        None."""
        if stop < len(tokens):
            return None
        rows = state.prompt_rows.pop(slot, [])
        return Prefix.of_prompt(None, tokens, int(tok), params, self.eos_ids, lp, rows)

    def generate_mixed(
        self, state: SlotState, steps: int, pages: np.ndarray, chunk: Chunk
    ) -> tuple[SlotState, StepOutput, Prefix | None]:
        """`generate` with `chunk` in its first step's forward pass (engine_api.Engine)."""
        c = chunk
        self._check_chunk(c.tokens, c.params, c.start, c.stop, c.pages, c.slot)
        if not 0 < c.stop - c.start <= self.mix_tokens:
            raise ValueError(
                f"generate_mixed takes chunks of 1 to {self.mix_tokens} tokens (0: this engine "
                f"mixes none), got {c.stop - c.start}"
            )
        row, scratch = self._chunk_row(c.slot, c.pages)
        rows = self._prompt_rows(state, c.slot, c.params, c.start)
        tokens, args = self._chunk_args(
            c.tokens, c.params, c.start, c.stop - c.start, self.mix_tokens
        )
        # the ragged kernel reads the earlier pages from the pool itself: nothing to gather
        gather = c.start and self.ops.mixed_attention is None
        prior = self._gather_exe()(state.arrays.cache, row) if gather else self._no_prior
        bucket, table, consts = self._step_inputs(state, steps, pages)
        exe = self._mixed_exe(bucket)
        inputs = (self.params, state.arrays, consts, table, tokens, args, row, scratch, prior)
        arrays, packed, lps, tok, lp = exe(*inputs)
        if c.params.prompt_logprobs is not None:  # the chunk's positions, and the last row
            rows.append(np.asarray(lp)[np.r_[: c.stop - c.start, -1]])
        state, out = self._step_output(state, arrays, packed, lps, steps, bucket)
        return state, out, self._chunk_end(state, c.tokens, c.params, c.slot, c.stop, tok, lp)
