"""The JAX engine's prompt chunks into a slot's pages: alone (`prefill_pages`) or riding in a
generate call's first step (`generate_mixed`: one forward pass over the decode rows and up to
policy.MIX_PIECES pieces, steps.generate_mixed), with what both share: the chunk's checks, its
page row, its prompt logprobs and its outcome.

A mixed call is compiled per decode bucket for `mix_tokens` prompt rows (the token budget:
`ServerShape.mixing`), so mixing adds as many programs as there are decode buckets, all
compiled by `warmup`. The pieces pack into the rows from page boundaries; each attends its own
rows, and every page of rows is written to its piece's page (model.Pieces, kv_cache.write_pieces):
a piece's padding rows land past its prompt in its last page, where the sequence writes before
it reads, as prefill_pages' padding does.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from scaletui import policy
from scaletui.serve.engine.engine_api import (
    Chunk,
    Prefix,
    SamplingParams,
    StepOutput,
    check_packing,
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
        row, base = self._page_row(slot, pages)
        return self._put(row), self._put(np.int32(base))

    def _page_row(self, slot: int, pages: Sequence[int]) -> tuple[np.ndarray, int]:
        """`_chunk_row`'s values on the host."""
        base = slot // (self.rows // self.replicas) * self.pages  # the replica's scratch page
        row = np.full(self.pages_per_seq, base, np.int32)
        row[: len(pages)] += np.asarray(pages, np.int32)
        return row, base

    def _prompt_rows(self, state: SlotState, slot: int, params: SamplingParams, start: int):
        """The slot's prompt logprob rows so far (a new list at the prompt's start)."""
        self._check_prompt_rows(state, slot, params, start)
        if start == 0:
            state.prompt_rows.pop(slot, None)
        return state.prompt_rows.setdefault(slot, [])

    def _check_prompt_rows(self, state: SlotState, slot: int, params: SamplingParams, start: int):
        """ValueError when prompt logprobs are asked of a piece whose earlier positions did not
        run here (a cached prefix)."""
        rows = [] if start == 0 else state.prompt_rows.get(slot, [])
        if params.prompt_logprobs is not None and start != sum(len(r) - 1 for r in rows):
            raise ValueError(
                f"prompt logprobs need every prompt position prefilled here, but the prompt "
                f"starts at {start} (a cached prefix?); prefill it from 0"
            )

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

    def check_chunks(self, chunks: Sequence[Chunk], state: SlotState | None = None) -> None:
        """engine_api.Engine.check_chunks (and, given the state, the pieces' prompt logprobs)."""
        check_packing(chunks, self.mix_tokens, self.page_size)
        for c in chunks:
            self._check_chunk(c.tokens, c.params, c.start, c.stop, c.pages, c.slot)
            if state is not None:
                self._check_prompt_rows(state, c.slot, c.params, c.start)

    def generate_mixed(
        self, state: SlotState, steps: int, pages: np.ndarray, chunks: Sequence[Chunk]
    ) -> tuple[SlotState, StepOutput, list[Prefix | None]]:
        """`generate` with `chunks` in its first step's forward pass (engine_api.Engine): their
        tokens packed from page boundaries into `mix_tokens` rows, the unused pieces of the
        program's MIX_PIECES empty (offset past the rows)."""
        self.check_chunks(chunks, state)
        t, size, most = self.mix_tokens, self.page_size, policy.MIX_PIECES
        packed, offs, lens = (
            np.zeros(t, np.int32),
            np.full(most, t, np.int32),
            np.zeros(most, np.int32),
        )
        rows, scratch = np.zeros((most, self.pages_per_seq), np.int32), np.zeros(most, np.int32)
        args, at = [], 0
        for k, c in enumerate(chunks):
            n = c.stop - c.start
            packed[at : at + n], offs[k], lens[k] = c.tokens[c.start : c.stop], at, n
            rows[k], scratch[k] = self._page_row(c.slot, c.pages)
            nxt = c.tokens[c.stop] if c.stop < len(c.tokens) else 0
            processed = self.logprobs_processed
            args.append(PrefillArgs.of(c.stop, c.params, self.vocab_size, c.start, nxt, processed))
            at += -(-n // size) * size
        idle = args[0]._replace(logprobs=np.int32(0), prompt_logprobs=np.int32(0))
        args += [idle] * (most - len(chunks))  # unused pieces: nothing asked of them
        stacked = PrefillArgs(*(np.stack(field) for field in zip(*args, strict=True)))
        # the ragged kernel reads the earlier pages from the pool itself: nothing to gather
        first = chunks[0]
        if first.start and self.ops.mixed_attention is None:
            prior = self._gather_exe()(state.arrays.cache, self._put(rows[0]))
        else:
            prior = self._no_prior
        logged = [self._prompt_rows(state, c.slot, c.params, c.start) for c in chunks]
        bucket, table, consts = self._step_inputs(state, steps, pages)
        exe = self._mixed_exe(bucket)
        placed = (
            self._put(packed),
            self._put(stacked),
            *map(self._put, (offs, lens, rows, scratch)),
        )
        arrays, packed_out, lps, toks, lp = exe(
            self.params, state.arrays, consts, table, *placed, prior
        )
        state, out = self._step_output(state, arrays, packed_out, lps, steps, bucket)
        prefixes = []
        for k, c in enumerate(chunks):
            if c.params.prompt_logprobs is not None:  # the piece's positions, and the last row
                logged[k].append(np.asarray(lp[k])[np.r_[: c.stop - c.start, -1]])
            end = self._chunk_end(state, c.tokens, c.params, c.slot, c.stop, toks[k], lp[k])
            prefixes.append(end)
        return state, out, prefixes
