"""One scheduling pass's inputs as one fixed-shape int32 array: what process 0 sends every other
process before each pass (pure numpy, no JAX, no sockets).

A pass's inputs are a control word (run or stop), the pass number, and an ordered list of
events that reached process 0 since the last pass: new requests (id, prompt token ids,
sampling parameters), cancels (id, why) and a reconfiguration (the `/admin/config` changes, as
JSON bytes in the token area; the last event of its pass). Every process applies them in that
order, so their request books and engines stay identical. The array's layout, for a
`WireShape` (sizes fixed at start-up):

    header    [HEADER]                       magic, word, pass number, events, tokens used
    events    [max_events, EVENT_FIELDS]     kind, request id, then the kind's fields
    tokens    [token_cap]                    the new prompts' ids, back to back

Floats (temperature, top_p) ride as their float32 bits. `pack` takes the longest prefix of the
events that fits and says how many it took; the rest wait for the next pass, in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import orjson

from scaletui.serve.engine.engine_api import SamplingParams

MAGIC = 0x5C7A  # a frame that does not start with it is not ours (a torn read, a stray peer)
RUN, STOP = 1, 2  # control words
NEW, CANCEL, RECONFIG = 1, 2, 3  # event kinds
REASONS = ("abort", "stop", "reconfigure")  # a cancel's reason, sent as its index + 1
HEADER = 5  # magic, word, pass number, events, tokens used
EVENT_FIELDS = 12  # kind, id, offset, length, temperature, top_k, top_p, seed, max, min, eos, lp


@dataclass(frozen=True)
class WireShape:
    """The fixed size of every pass's array (the same on every process)."""

    max_events: int = 64  # new requests + cancels per pass; more wait for the next pass
    token_cap: int = 4096  # prompt tokens per pass; at least the longest prompt (max_seq_len)

    def __post_init__(self) -> None:
        if self.max_events < 1 or self.token_cap < 1:
            raise ValueError(f"a wire needs room for an event and a token, got {self}")

    @property
    def size(self) -> int:
        """int32 values in one pass's array."""
        return HEADER + self.max_events * EVENT_FIELDS + self.token_cap

    @classmethod
    def for_server(cls, max_seq_len: int) -> WireShape:
        """Room for two prompts of the longest length, so any one prompt fits in a pass."""
        return cls(token_cap=2 * max_seq_len)


@dataclass(frozen=True)
class Arrival:
    """A new request: its id (process 0's), prompt and sampling parameters."""

    id: int
    prompt: tuple[int, ...]
    params: SamplingParams


@dataclass(frozen=True)
class Cancel:
    """A cancel of request `id`: "abort" (client gone) or "stop" (a stop string was seen)."""

    id: int
    reason: str


@dataclass(frozen=True)
class Reconfig:
    """Rebuild the engines with `changes` (ServerShape.updated's keys) at this pass."""

    changes: dict

    @property
    def data(self) -> bytes:
        return orjson.dumps(self.changes, option=orjson.OPT_SORT_KEYS)

    @property
    def words(self) -> int:
        """int32 values of the token area it takes."""
        return -(-len(self.data) // 4)


Event = Arrival | Cancel | Reconfig


@dataclass(frozen=True)
class PassInput:
    """What every process applies before pass `number`."""

    word: int  # RUN | STOP
    number: int
    events: tuple[Event, ...] = ()


def _f32_bits(x: float) -> int:
    return int(np.array(x, np.float32).view(np.int32))


def _f32(bits: int) -> float:
    return float(np.array(bits, np.int32).view(np.float32))


def _opt(k: int | None) -> int:
    return -1 if k is None else k


def _unopt(v: int) -> int | None:
    return None if v < 0 else int(v)


def pack(
    shape: WireShape, word: int, number: int, events: Sequence[Event]
) -> tuple[np.ndarray, int]:
    """(the pass's array, how many of `events` it carries): the longest prefix that fits."""
    out = np.zeros(shape.size, np.int32)
    rows = out[HEADER : HEADER + shape.max_events * EVENT_FIELDS].reshape(-1, EVENT_FIELDS)
    tokens = out[HEADER + shape.max_events * EVENT_FIELDS :]
    used = taken = 0
    for e in events[: shape.max_events]:
        if isinstance(e, Cancel):
            rows[taken, :3] = (CANCEL, e.id, REASONS.index(e.reason) + 1)
        elif isinstance(e, Reconfig):
            data, n = e.data, e.words
            if used + n > shape.token_cap:
                if n > shape.token_cap:
                    raise ValueError(f"a {len(data)}-byte reconfiguration exceeds the wire")
                break
            tokens[used : used + n] = np.frombuffer(data.ljust(4 * n, b" "), "<i4")
            rows[taken, :4] = (RECONFIG, 0, used, len(data))
            used += n
            taken += 1
            break  # the engines change after it: nothing else rides in its pass
        else:
            n = len(e.prompt)
            if used + n > shape.token_cap:
                if n > shape.token_cap:
                    raise ValueError(f"a {n}-token prompt exceeds the wire's {shape.token_cap}")
                break
            tokens[used : used + n] = e.prompt
            p = e.params
            rows[taken] = (
                NEW,
                e.id,
                used,
                n,
                _f32_bits(p.temperature),
                p.top_k,
                _f32_bits(p.top_p),
                p.seed % 2**31,  # the engine keys its PRNG on the seed mod 2^31
                p.max_tokens,
                p.min_tokens,
                int(p.ignore_eos),
                # logprobs and prompt_logprobs (each -1 for None, else 0-20) in one field
                (_opt(p.logprobs) + 1) * 64 + _opt(p.prompt_logprobs) + 1,
            )
            used += n
        taken += 1
    out[:HEADER] = (MAGIC, word, number % 2**31, taken, used)
    return out, taken


def unpack(shape: WireShape, array: np.ndarray) -> PassInput:
    """The inverse of `pack`; ValueError for an array that is not a pass of this shape."""
    if array.shape != (shape.size,) or array.dtype != np.int32 or array[0] != MAGIC:
        raise ValueError(f"not a pass array of {shape}: {array.dtype} {array.shape}")
    _, word, number, n, _ = (int(v) for v in array[:HEADER])
    rows = array[HEADER : HEADER + shape.max_events * EVENT_FIELDS].reshape(-1, EVENT_FIELDS)
    tokens = array[HEADER + shape.max_events * EVENT_FIELDS :]
    events: list[Event] = []
    for r in rows[:n].tolist():
        if r[0] == CANCEL:
            events.append(Cancel(r[1], REASONS[r[2] - 1]))
            continue
        if r[0] == RECONFIG:
            off, nbytes = r[2], r[3]
            data = tokens[off : off + -(-nbytes // 4)].astype("<i4").tobytes()[:nbytes]
            events.append(Reconfig(orjson.loads(data)))
            continue
        kind, rid, off, length, temp, top_k, top_p, seed, most, least, eos, lps = r
        assert kind == NEW, f"unknown event kind {kind}"
        params = SamplingParams(
            temperature=_f32(temp),
            top_k=top_k,
            top_p=_f32(top_p),
            seed=seed,
            max_tokens=most,
            min_tokens=least,
            ignore_eos=bool(eos),
            logprobs=_unopt(lps // 64 - 1),
            prompt_logprobs=_unopt(lps % 64 - 1),
        )
        events.append(Arrival(rid, tuple(tokens[off : off + length].tolist()), params))
    return PassInput(word, number, tuple(events))
