"""The scheduling decisions, as pure functions of plain values: the deterministic core that every
host of a server runs, and that the simulator replays.

The live scheduler (serve/scheduling/batcher.py) applies them to the engine's results, the simulator
(roofline/simulate.py) to the cost model's times; tests/test_policy.py replays one trace through
both and gets the same `StepPlan`s. One pass of the interleaved loop decides, in this order:
1. admit: the head of the waiting queue (FCFS, nothing jumps it) takes the first free slot whose
   replica has pages for its prompt and the next decode steps (`admit_slot`); again, until none;
2. hit: it reuses the full pages of the longest cached prefix, never the whole prompt
   (`reusable_pages`: one token at least is prefilled, for the first token's logits);
3. chunk: the prefilling prompts run FCFS within the token budget, a piece ending on a page
   boundary or with its prompt (`token_budget`, `chunks`); with mixed batches the first pieces
   ride in the generate call's first step (`riders`: one forward pass, the weights read once)
   and the others run before that call;
4. decode: a generate call of `decode_steps` steps, no more than any sequence still needs (one
   with pieces riding in it); first
   every decoding sequence grows to the pages those steps write, oldest first, and where its
   replica has none left the youngest decoding sequence there is preempted (`make_room`, vLLM's
   recompute policy: it goes back to the head of the queue to prefill prompt and output again);
5. finish: EOS, max_tokens or max_seq_len (`finish_reason`); one that could not resume after a
   preemption ends there (`resumable`). Stop strings and cancels end a request from the API.
Standard library only, no clocks, no randomness: the same state gives the same decisions.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold `tokens` positions."""
    return -(-tokens // page_size)


def token_budget(max_batched_tokens: int, page_size: int) -> int:
    """Prompt tokens per pass between generate calls: --max-batched-tokens rounded down to whole
    pages (a piece starts on a page boundary), at least one page; 0: no budget."""
    if not max_batched_tokens:
        return 0
    return max(page_size, max_batched_tokens // page_size * page_size)


def reusable_pages(tokens: int, page_size: int) -> int:
    """How many leading full pages of a `tokens`-long prompt the prefix cache may serve: never
    the whole prompt, as the last token's logits give the first output token."""
    return max(tokens - 1, 0) // page_size


def admit_pages(tokens: int, decode_steps: int, page_size: int, cap: int) -> int:
    """Free pages a replica needs to admit a `tokens`-long prompt: it and the next decode steps,
    at most `cap` (a sequence's most: its replica's whole pool or max_seq_len's pages)."""
    return min(pages_for(tokens + decode_steps, page_size), cap)


def admit_slot(
    need_pages: int, free_slots: Sequence[int], free_pages: Sequence[int], per_replica: int
) -> int | None:
    """The first free slot whose replica (slot // per_replica) has `need_pages` free pages."""
    return next((b for b in free_slots if free_pages[b // per_replica] >= need_pages), None)


def chunks(lefts: Sequence[int], budget: int, page_size: int) -> list[int]:
    """The prompt tokens each prefilling job (FCFS, `lefts` its tokens still to run) runs this
    pass: all of them without a `budget`; with one, pieces until it is spent, a piece that
    leaves its prompt unfinished cut to whole pages (and none when that is zero)."""
    if not budget:
        return list(lefts)
    out: list[int] = []
    for left in lefts:
        n = left if left <= budget else budget // page_size * page_size
        if n == 0:
            break
        out.append(n)
        budget -= n
        if budget <= 0 or n < left:
            break
    return out


def mix_tokens(mixed: bool, max_batched_tokens: int, page_size: int, mode: str) -> int:
    """The prompt rows a generate call takes along (0: no mixing), for the pieces that ride in
    it (`riders`). A mixed call is compiled for one number of rows, the token budget: without a
    budget a piece is a whole prompt of any length. Under dp the pieces ride in the call of every
    replica (their rows join the one forward pass; each piece's K/V go to its own replica's
    pages)."""
    if not mixed or mode != "interleaved" or not max_batched_tokens:
        return 0
    return token_budget(max_batched_tokens, page_size)


# a mixed call packs at most this many pieces (its program attends each in turn, see
# serve/engine/model.py `mixed`): enough for a budget's worth of short prompts
MIX_PIECES = 4


def riders(
    pieces: Sequence[int], starts: Sequence[int], decoding: int, cap: int, page_size: int
) -> int:
    """How many of the pass's first pieces ride in its generate call (0: none): mixing on
    (`cap`, from `mix_tokens`) and `decoding` sequences running when the pass starts. The pieces
    pack into the call's `cap` prompt rows, each from a page boundary (a piece's rows round up to
    whole pages, but for the last), at most MIX_PIECES of them; only the first may continue its
    prompt (`starts`: tokens already in each piece's pages; the call reads one sequence's
    earlier pages). The rest run as their own calls before it, as without mixing."""
    if not (cap and decoding):
        return 0
    n, rows = 0, 0
    for piece, start in zip(pieces, starts, strict=False):
        if n == MIX_PIECES or (n and start) or rows + piece > cap:
            break
        n, rows = n + 1, rows + pages_for(piece, page_size) * page_size
    return n


def decode_steps(lefts: Sequence[int], steps: int, mixed: bool = False) -> int:
    """Steps of the next generate call: `steps`, but no more than any decoding sequence still
    needs (`lefts`: tokens each may still produce), so a nearly done batch does not idle; one
    when prompt pieces ride in it (`mixed`): a piece's first token is out when its call ends, and
    the next pass goes on decoding with the new sequences in it."""
    if mixed:
        return 1
    return max(1, min(steps, max(lefts, default=1)))


class Seq(NamedTuple):
    """A decoding sequence as the decisions see it (a tuple: the simulator makes many)."""

    slot: int
    order: float  # when it was admitted: the oldest grows first, the youngest is preempted
    length: int  # KV positions it holds
    left: int  # tokens it may still produce (max_tokens less what it has)


@dataclass(frozen=True)
class Grow:
    """Give `slot` pages for its first `tokens` positions (the caller's pool has them)."""

    slot: int
    tokens: int


@dataclass(frozen=True)
class Preempt:
    """Take `slot`'s pages back; its request returns to the head of the waiting queue."""

    slot: int


def make_room(
    decoding: Sequence[Seq],
    held: Mapping[int, Sequence[int]],
    free: Sequence[int],
    steps: int,
    page_size: int,
    max_seq_len: int,
    per_replica: int,
) -> list[Grow | Preempt]:
    """What gives every decoding sequence pages for the positions the next `steps` write, in
    the order to apply it: oldest first, each grows, and where its replica's `free` pages run
    short the youngest decoding sequence there (perhaps itself) is preempted until they do not.
    `held`: the pages every slot holds (prefilling ones too): a preempted sequence's page goes
    back to the free count only if no other slot holds it (a shared prefix page)."""
    want = [
        (s, min(s.length + min(steps, s.left), max_seq_len), s.slot // per_replica)
        for s in sorted(decoding, key=lambda s: s.order)
    ]
    more = [pages_for(tokens, page_size) - len(held.get(s.slot, ())) for s, tokens, _ in want]
    short = list(free)
    for (_, _, replica), m in zip(want, more, strict=True):
        short[replica] -= max(m, 0)
    if min(short, default=0) >= 0:  # room for all: nobody is preempted
        return [Grow(s.slot, tokens) for (s, tokens, _), m in zip(want, more, strict=True) if m > 0]
    free, holds = list(free), {b: list(p) for b, p in held.items()}
    alive = {s.slot: s for s in decoding}
    fresh = -1  # grown pages, held by one slot each
    out: list[Grow | Preempt] = []
    for seq, tokens, replica in want:
        while seq.slot in alive:
            more = pages_for(tokens, page_size) - len(holds.get(seq.slot, ()))
            if more <= free[replica]:
                if more > 0:
                    free[replica] -= more
                    holds.setdefault(seq.slot, []).extend(range(fresh, fresh - more, -1))
                    fresh -= more
                    out.append(Grow(seq.slot, tokens))
                break
            same = [s for s in alive.values() if s.slot // per_replica == replica]
            victim = max(same, key=lambda s: s.order)
            out.append(Preempt(victim.slot))
            del alive[victim.slot]
            gone = holds.pop(victim.slot, [])
            others = Counter(p for pages in holds.values() for p in pages)
            free[replica] += sum(1 for p in set(gone) if not others[p])
    return out


def finish_reason(
    token: int,
    generated: int,
    max_tokens: int,
    *,
    min_tokens: int = 0,
    ignore_eos: bool = False,
    eos_ids: tuple[int, ...] = (),
    length: int = 0,
    max_seq_len: int = 0,
) -> str | None:
    """Why a sequence ends at `token`, its `generated`-th with `length` KV positions, or None:
    "stop" at any of the EOS ids (unless ignored, and after min_tokens), "length" at
    max_tokens or at max_seq_len (0: not checked)."""
    if token in eos_ids and not ignore_eos and generated >= min_tokens:
        return "stop"
    if generated >= max_tokens or (max_seq_len and length >= max_seq_len):
        return "length"
    return None


def resumable(tokens: int, max_seq_len: int) -> bool:
    """Whether a preempted sequence of `tokens` (prompt and output) can prefill them again and
    go on; one that fills max_seq_len ends with "length", as its next step would have."""
    return tokens < max_seq_len


@dataclass
class StepPlan:
    """What one pass of the interleaved loop decided (and which requests it ended), for the
    `on_plan` hook of the scheduler and the simulator; requests by the driver's ids."""

    admitted: list[tuple[int, int, int]] = field(default_factory=list)  # (request, slot, hit)
    chunks: list[tuple[int, int]] = field(default_factory=list)  # (request, prompt tokens run)
    preempted: list[int] = field(default_factory=list)
    steps: int = 0  # the generate call's steps (0: none this pass)
    finished: list[int] = field(default_factory=list)
    mixed: int = 0  # chunks[:mixed] rode in the generate call's first step (mixed batch)

    def __bool__(self) -> bool:
        return bool(self.admitted or self.chunks or self.preempted or self.steps or self.finished)
