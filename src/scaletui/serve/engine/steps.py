"""The jitted step bodies the engine compiles ahead of time: prefill, chunked prefill, generate
(and generate with a prompt chunk in its first step: a mixed batch).

Pure functions over named pytrees: `PrefillArgs` (one request's sampling scalars) and
`slot_state.DecodeState` (every slot's cache and vectors). The engine binds the static arguments
(model spec, op set, shapes) with `functools.partial` and compiles one executable per shape.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from scaletui.serve.engine import model, sampling
from scaletui.serve.engine.engine_api import LOGPROB_ROW, SamplingParams, logprobs_code
from scaletui.serve.engine.slot_state import DecodeState
from scaletui.specs import ModelSpec


class PrefillArgs(NamedTuple):
    """One prefill call's scalars (int32 unless noted)."""

    true_len: jax.Array  # prompt length
    seed: jax.Array  # the request's PRNG seed
    top_k: jax.Array
    temperature: jax.Array  # f32
    top_p: jax.Array  # f32
    vocab_limit: jax.Array  # sampling never goes beyond (the tokenizer's vocabulary)
    start: jax.Array  # the chunk's first position (0 unless chunked)
    logprobs: jax.Array  # the first token's logprobs: 0 skipped, 1 raw, 2 processed (logprobs_code)
    prompt_logprobs: jax.Array  # 1: each chunk position's logprob of the next prompt token
    next_token: jax.Array  # the prompt token after this chunk (0 at the prompt's end)

    @classmethod
    def of(
        cls,
        n: int,
        params: SamplingParams,
        vocab_limit: int,
        start: int = 0,
        next_token: int = 0,
        processed: bool = False,
    ) -> PrefillArgs:
        """Host values (numpy scalars) for one request; `jax.device_put` the result."""
        i32, f32 = np.int32, np.float32
        return cls(
            i32(n),
            i32(params.seed % 2**31),
            i32(params.top_k),
            f32(params.temperature),
            f32(params.top_p),
            i32(vocab_limit),
            i32(start),
            i32(logprobs_code(params, processed)),
            i32(params.prompt_logprobs is not None),
            i32(next_token),
        )


class StepConsts(NamedTuple):
    """A generate call's constants (int32), placed once per value and reused."""

    n_steps: jax.Array  # decode steps to run (<= the compiled max_steps)
    vocab_limit: jax.Array
    eos_ids: jax.Array  # [E]: sampling any of them ends a sequence (`eos_row`)


def eos_row(eos_ids: tuple[int, ...]) -> np.ndarray:
    """The engine's EOS ids as StepConsts.eos_ids: [E], or [-1] (no id) when it has none."""
    return np.asarray(eos_ids or (-1,), np.int32)


def sample_one(
    params: dict, logits: jax.Array, hidden: jax.Array, tokens: jax.Array, args: PrefillArgs, m, ops
) -> tuple[jax.Array, jax.Array]:
    """The first token from the prompt's last logits (its key position is the new token's),
    and the chunk's packed logprobs f32 [T + 1, LOGPROB_ROW]: row i scores the prompt token
    after chunk position i (`prompt_logprobs`), row T the first token (`logprobs`); zeros
    where not asked, and then neither the [T, V] logits nor a top-k run."""
    one = lambda x: x[None]
    tok = sampling.sample(
        logits[None],
        one(args.seed),
        one(args.true_len),
        one(args.temperature),
        one(args.top_k),
        one(args.top_p),
        args.vocab_limit,
    )
    first = sampling.logprob_rows(
        logits[None],
        tok,
        one(args.logprobs > 0),
        args.vocab_limit,
        one(args.logprobs == 2),
        one(args.temperature),
        one(args.top_k),
        one(args.top_p),
    )
    t = tokens.shape[0]
    last = jnp.clip(args.true_len - 1 - args.start, 0, t - 1)  # its next token is not in `tokens`
    targets = jnp.where(jnp.arange(t) == last, args.next_token, jnp.roll(tokens, -1))

    def prompt(h: jax.Array) -> jax.Array:
        return sampling.pack_rows(ops.logits(params, h, m), targets, args.vocab_limit)

    zeros = lambda h: jnp.zeros((t, first.shape[-1]), jnp.float32)  # noqa: E731
    rows = lax.cond(args.prompt_logprobs > 0, prompt, zeros, hidden)
    return tok[0], jnp.concatenate([rows, first])


def prefill(
    params: dict, tokens: jax.Array, args: PrefillArgs, *, m: ModelSpec, ops: model.Ops, kv_dtype
):
    """A whole prompt in one bucket -> (per-layer (k, v) [T, K, H] in `kv_dtype` (int8 with
    scales), first token, packed logprobs [T + 1, LOGPROB_ROW] (`sample_one`))."""
    logits, kv, h = model.prefill(
        params, tokens, args.true_len, m, ops=ops, kv_dtype=kv_dtype, hidden=True
    )
    return (kv, *sample_one(params, logits, h, tokens, args, m, ops))


def prefill_chunk(
    params: dict, tokens: jax.Array, args: PrefillArgs, prior: list, *, m: ModelSpec, ops, kv_dtype
):
    """One chunk of a long prompt into the donated `prior` buffer -> (buffer, token so far,
    the chunk's packed logprobs)."""
    logits, kv, h = model.prefill(
        params,
        tokens,
        args.true_len,
        m,
        start=args.start,
        prior=prior,
        ops=ops,
        kv_dtype=kv_dtype,
        hidden=True,
    )
    return (kv, *sample_one(params, logits, h, tokens, args, m, ops))


def prefill_paged(
    params: dict,
    state: DecodeState,
    tokens: jax.Array,
    args: PrefillArgs,
    pages: jax.Array,
    scratch: jax.Array,
    prior: list,
    *,
    m: ModelSpec,
    ops: model.Ops,
) -> tuple[DecodeState, jax.Array]:
    """One prompt chunk straight into its sequence's pages of the donated decode state, the
    earlier positions' pages in `prior` (model.gather_pages) -> (state, the token sampled at
    true_len: the first output token on the prompt's last chunk, the chunk's packed logprobs
    (`sample_one`))."""
    logits, cache, h = model.prefill_paged(
        params,
        tokens,
        args.true_len,
        m,
        args.start,
        pages,
        scratch,
        state.cache,
        prior,
        ops=ops,
        hidden=True,
    )
    return (state._replace(cache=cache), *sample_one(params, logits, h, tokens, args, m, ops))


def _decode_step(params, consts, pages, st, forward, *, max_len: int, slots: int) -> tuple:
    """One decode step over every slot row: `forward(st, pos, table)` -> (logits [slots, V],
    cache) runs the model (a plain decode step, or a mixed one). -> (state, packed row [3, rows]:
    tokens, valid, done; logprobs [rows, LOGPROB_ROW])."""
    active = st.active
    pos = jnp.where(active, st.lengths, 0)
    # an inactive row (free, or done earlier in this call) writes into the scratch page, never
    # into pages it held: they may be another sequence's by now, or a shared prefix
    table = jnp.where(active[:, None], pages, 0)
    logits, cache = forward(st, pos, table)
    live = lambda a: a[:slots]
    tok = sampling.sample(
        logits,
        live(st.seed),
        live(pos + 1),
        live(st.temperature),
        live(st.top_k),
        live(st.top_p),
        consts.vocab_limit,
    )
    want = live(active & (st.logprobs > 0))
    lp = sampling.logprob_rows(  # [slots, ROW]
        logits,
        tok,
        want,
        consts.vocab_limit,
        live(st.logprobs == 2),
        live(st.temperature),
        live(st.top_k),
        live(st.top_p),
    )
    tok = jnp.pad(tok, (0, pos.shape[0] - slots))  # spare rows (see JaxEngine.rows)
    lp = jnp.pad(lp, ((0, pos.shape[0] - slots), (0, 0)))
    lengths = st.lengths + active
    generated = st.generated + active
    hit = (tok[:, None] == consts.eos_ids[None, :]).any(axis=1)  # E is 1 to a few ids
    eos = hit & ~st.ignore_eos & (st.generated >= st.min_tokens)
    done = active & (eos | (generated >= st.max_tokens) | (lengths >= max_len))
    st = st._replace(
        cache=cache,
        lengths=lengths,
        generated=generated,
        tokens=jnp.where(active, tok, st.tokens),
        active=active & ~done,
    )
    return st, jnp.stack([tok, active.astype(jnp.int32), done.astype(jnp.int32)]), lp


def _decode_loop(params, state, consts, pages, first: int, out, lps, *, m, ops, **kw) -> tuple:
    """Plain decode steps `first`..consts.n_steps - 1 of a call, into `out` and `lps`."""

    def forward(st, pos, table):
        return model.decode(params, st.cache, st.tokens, pos, table, m, kw["slots"], ops=ops)

    def step(i, carry):
        st, out, lps = carry
        st, row, lp = _decode_step(params, consts, pages, st, forward, **kw)
        out = lax.dynamic_update_index_in_dim(out, row, i, 0)
        return st, out, lax.dynamic_update_index_in_dim(lps, lp.T, i, 0)

    state, out, lps = lax.fori_loop(first, consts.n_steps, step, (state, out, lps))
    packed = jnp.concatenate([out.reshape(out.shape[0] * 3, -1), state.lengths[None]])
    return state, packed, lps


def _outputs(state: DecodeState, max_steps: int) -> tuple[jax.Array, jax.Array]:
    rows = state.lengths.shape[0]
    out = jnp.zeros((max_steps, 3, rows), jnp.int32)
    return out, jnp.zeros((max_steps, LOGPROB_ROW, rows), jnp.float32)


def generate(
    params: dict,
    state: DecodeState,
    consts: StepConsts,
    pages: jax.Array,
    *,
    m: ModelSpec,
    ops: model.Ops,
    max_steps: int,
    max_len: int,
    slots: int,
) -> tuple[DecodeState, jax.Array, jax.Array]:
    """Up to max_steps decode steps (consts.n_steps of them run) -> (state, packed int32 array,
    logprobs f32 [max_steps, LOGPROB_ROW, rows]).

    pages [rows, W]: each row's page table (local page ids), covering every position the call
    writes. packed rows: for each step s, [tokens, valid, done] (3 rows of [rows]), then lengths.
    The logprobs are computed only in steps where an active row asked (zeros otherwise); the
    host copies them only when it wants them.
    """
    out, lps = _outputs(state, max_steps)
    kw = {"m": m, "ops": ops, "max_len": max_len, "slots": slots}
    return _decode_loop(params, state, consts, pages, 0, out, lps, **kw)


def generate_mixed(
    params: dict,
    state: DecodeState,
    consts: StepConsts,
    pages: jax.Array,
    chunk: jax.Array,
    args: PrefillArgs,
    offs: jax.Array,
    lens: jax.Array,
    piece_pages: jax.Array,
    scratch: jax.Array,
    prior: list,
    *,
    m: ModelSpec,
    ops: model.Ops,
    max_steps: int,
    max_len: int,
    slots: int,
) -> tuple:
    """`generate` whose first step also runs prompt pieces in the same forward pass
    (`model.mixed`): their tokens packed in `chunk` [T], piece k's lens[k] tokens from row
    offs[k] with the scalars args[k] (PrefillArgs of [P]: `prefill_paged`'s) into its pages
    piece_pages[k] [W] (then page scratch[k]); `prior` piece 0's earlier pages. The other
    consts.n_steps - 1 steps are plain decode. -> (state, packed, logprobs as `generate`'s,
    then each piece's token [P] and packed logprobs [P, T + 1, ROW] as `prefill_paged`'s)."""
    kept = {}
    t = chunk.shape[0]
    pieces = model.Pieces(offs, lens, args.start, piece_pages, scratch)

    def forward(st, pos, table):
        logits, last, cache, hidden = model.mixed(
            params, st.cache, st.tokens, pos, table, m, chunk, pieces, prior, slots, ops=ops
        )
        hidden, tokens = (jnp.pad(a, [(0, t)] + [(0, 0)] * (a.ndim - 1)) for a in (hidden, chunk))

        def sample(k):  # each piece samples as prefill_paged's chunk, one at a time (lax.map)
            one = jax.tree.map(lambda a: a[k], args)
            h = lax.dynamic_slice_in_dim(hidden, offs[k], t)
            toks = lax.dynamic_slice_in_dim(tokens, offs[k], t)
            return sample_one(params, last[k], h, toks, one, m, ops)

        kept["pieces"] = lax.map(sample, jnp.arange(offs.shape[0]))
        return logits, cache

    kw = {"max_len": max_len, "slots": slots}
    out, lps = _outputs(state, max_steps)
    state, row, lp = _decode_step(params, consts, pages, state, forward, **kw)
    out, lps = out.at[0].set(row), lps.at[0].set(lp.T)
    state, packed, lps = _decode_loop(params, state, consts, pages, 1, out, lps, m=m, ops=ops, **kw)
    return (state, packed, lps, *kept["pieces"])
