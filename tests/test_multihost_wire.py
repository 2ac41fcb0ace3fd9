"""A pass's inputs packed into the fixed-shape array process 0 sends to every process: the
layout by hand, the round trip, and what waits for the next pass."""

from __future__ import annotations

import numpy as np
import pytest

from scaletui.serve.engine.engine_api import SamplingParams
from scaletui.serve.multihost import wire
from scaletui.serve.multihost.wire import Arrival, Cancel, WireShape

SHAPE = WireShape(max_events=3, token_cap=5)


def test_layout_by_hand() -> None:
    params = SamplingParams(
        temperature=0.5, top_k=7, top_p=1.0, seed=2**31 + 9, max_tokens=4, min_tokens=2,
        ignore_eos=True, logprobs=3, prompt_logprobs=None,
    )  # fmt: skip
    events = [Arrival(11, (5, 6, 7), params), Cancel(4, "stop")]
    array, taken = wire.pack(SHAPE, wire.RUN, 42, events)
    assert taken == 2
    assert array.dtype == np.int32 and array.shape == (5 + 3 * 12 + 5,)
    assert array[:5].tolist() == [wire.MAGIC, wire.RUN, 42, 2, 3]  # 2 events, 3 tokens used
    rows = array[5 : 5 + 36].reshape(3, 12)
    # 0.5f is 0x3F000000, 1.0f 0x3F800000; the seed mod 2^31; logprobs (3 + 1) * 64 + (-1 + 1)
    assert rows[0].tolist() == [1, 11, 0, 3, 0x3F000000, 7, 0x3F800000, 9, 4, 2, 1, 4 * 64]
    assert rows[1].tolist() == [2, 4, 2] + [0] * 9  # cancel of request 4, reason "stop"
    assert rows[2].tolist() == [0] * 12
    assert array[-5:].tolist() == [5, 6, 7, 0, 0]


def test_round_trip_keeps_order_and_values() -> None:
    a = SamplingParams(temperature=0.7, top_p=0.9, seed=5, max_tokens=8, prompt_logprobs=0)
    events = [Cancel(1, "abort"), Arrival(2, (9,), a), Arrival(3, (1, 2), SamplingParams())]
    array, taken = wire.pack(SHAPE, wire.STOP, 7, events)
    got = wire.unpack(SHAPE, array)
    assert (got.word, got.number, taken) == (wire.STOP, 7, 3)
    assert got.events[0] == Cancel(1, "abort")
    assert [e.prompt for e in got.events[1:]] == [(9,), (1, 2)]
    sent = got.events[1].params
    assert sent.temperature == pytest.approx(0.7) and sent.top_p == pytest.approx(0.9)
    assert (sent.seed, sent.max_tokens, sent.logprobs, sent.prompt_logprobs) == (5, 8, None, 0)
    assert got.events[2].params == SamplingParams()


def test_what_does_not_fit_waits_for_the_next_pass_in_order() -> None:
    p = SamplingParams()
    events = [Arrival(1, (1, 2, 3), p), Arrival(2, (4, 5, 6), p), Cancel(1, "abort")]
    _, taken = wire.pack(SHAPE, wire.RUN, 0, events)
    assert taken == 1  # the second prompt overflows the 5 tokens; the cancel stays behind it
    _, taken = wire.pack(SHAPE, wire.RUN, 0, [Cancel(i, "abort") for i in range(5)])
    assert taken == 3  # three event rows
    with pytest.raises(ValueError, match="6-token prompt exceeds"):
        wire.pack(SHAPE, wire.RUN, 0, [Arrival(1, tuple(range(6)), p)])


def test_an_array_of_another_shape_is_refused() -> None:
    array, _ = wire.pack(SHAPE, wire.RUN, 0, [])
    with pytest.raises(ValueError, match="not a pass array"):
        wire.unpack(WireShape(max_events=4, token_cap=5), array)
    with pytest.raises(ValueError, match="not a pass array"):
        wire.unpack(SHAPE, np.zeros_like(array))


def test_a_reconfiguration_rides_last_in_its_pass_with_its_changes() -> None:
    shape = WireShape(max_events=4, token_cap=16)
    changes = {"tp": 4, "dp": 1, "slots": 2, "dtype": "bf16"}
    events = [Cancel(3, "reconfigure"), wire.Reconfig(changes), Cancel(5, "abort")]
    array, taken = wire.pack(shape, wire.RUN, 9, events)
    assert taken == 2  # the engines change after it: the cancel behind it waits a pass
    got = wire.unpack(shape, array)
    assert got.events == (Cancel(3, "reconfigure"), wire.Reconfig(changes))
    with pytest.raises(ValueError, match="reconfiguration exceeds"):
        wire.pack(SHAPE, wire.RUN, 0, [wire.Reconfig(changes)])  # 5 tokens: 20 bytes
