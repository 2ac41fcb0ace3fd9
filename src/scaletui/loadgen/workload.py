"""What to send and when: a frozen Workload -> a deterministic stream of requests for a seed.

Lengths are fixed, uniform or normal (mean, spread), or come from a ShareGPT-format file cut to
the first turn; shared-prefix groups prepend one of G fixed prefixes. With a tokenizer
(tokens.py) text prompts are exactly their length; without one lengths are estimates (one
character per token for synthetic text, `chars_per_token` for a dataset). With `turns` each
request opens a conversation whose later turns the runner sends after each reply; a `trace`
(replay.py) replaces all of this with its own rows and times. Arrival offsets are
precomputed and absolute (seconds after the run's t0): Poisson, gamma with vLLM's burstiness
(shape k, scale 1/(rate*k); k=1 is Poisson, CV = 1/sqrt(k)) or constant. Closed-loop runs
(`concurrency` without `qps`) have no offsets: a request goes when a permit frees.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson

from scaletui.loadgen.replay import TraceOptions, trace_requests
from scaletui.loadgen.request_spec import RequestSpec, Turn, random_text
from scaletui.loadgen.tokens import filler, fit, load_counter

DISTS = ("fixed", "uniform", "normal", "lognormal")
ARRIVALS = ("poisson", "gamma", "constant")
PROMPT_FORMATS = ("text", "ids")
# Token ids for `ids` prompts: printable ASCII, valid in byte-level and BPE vocabularies alike.
ID_LOW, ID_HIGH = 33, 127


@dataclass(frozen=True)
class Lengths:
    """A token-length distribution; samples are integers >= 1."""

    mean: int
    dist: str = "fixed"  # fixed | uniform (mean +- spread) | normal (std dev = spread)
    # | lognormal (mean `mean`, sigma of the log = spread: ShareGPT's lengths without a download)
    spread: float = 0.0

    def __post_init__(self) -> None:
        if self.mean < 1:
            raise ValueError(f"length mean must be >= 1, got {self.mean}")
        if self.dist not in DISTS:
            raise ValueError(f"length distribution must be one of {DISTS}, got {self.dist!r}")
        if self.spread < 0:
            raise ValueError(f"length spread must be >= 0, got {self.spread}")

    def sample(self, rng: np.random.Generator) -> int:
        if self.dist == "fixed" or self.spread == 0:
            return self.mean
        if self.dist == "uniform":
            lo, hi = self.mean - self.spread, self.mean + self.spread
            value = rng.integers(math.floor(lo), math.floor(hi) + 1)
        elif self.dist == "lognormal":
            value = rng.lognormal(math.log(self.mean) - self.spread**2 / 2, self.spread)
        else:
            value = rng.normal(self.mean, self.spread)
        return max(1, int(round(value)))


@dataclass(frozen=True)
class Workload:
    """Everything that decides the request list; equal Workloads give identical requests."""

    input: Lengths = Lengths(128)  # prompt tokens (after the shared prefix)
    output: Lengths = Lengths(128)  # max_tokens asked for (ignore_eos makes it exact)
    dataset: str | None = None  # ShareGPT-format JSON; replaces the synthetic prompts
    dataset_output: bool = True  # with a dataset: output length from the reply, not `output`
    chars_per_token: float = 4.0  # dataset reply chars per output token (no tokenizer here)
    prefix_len: int = 0  # shared-prefix tokens prepended to every prompt
    prefix_groups: int = 1  # number of distinct shared prefixes (request i uses i % G)
    prompt_format: str = "text"  # text (any API) | ids (token-id list, /v1/completions only)
    qps: float | None = None  # offered rate; None = closed loop; inf = all at once
    arrival: str = "poisson"  # poisson | gamma | constant
    burstiness: float = 1.0  # gamma shape k: < 1 burstier than Poisson, > 1 smoother
    concurrency: int | None = None  # cap on requests in flight (closed loop without qps)
    cancel_rate: float = 0.0  # fraction of requests aborted mid-stream
    seed: int = 0
    tokenizer: str | None = None  # tokenizer.json / HF dir / a server URL: exact lengths
    dataset_fit: bool = False  # with a dataset and a tokenizer: cut or pad to `input`
    turns: Lengths | None = None  # user turns per conversation; None = single requests
    think_time: float = 0.0  # s from a reply's last token to the next user turn
    trace: str | None = None  # Mooncake / BurstGPT / plain trace file (traces.py)
    trace_speedup: float = 1.0  # trace times are divided by this
    trace_block: int = 512  # tokens per Mooncake hash_id block

    def __post_init__(self) -> None:
        if self.qps is None and self.concurrency is None and self.trace is None:
            raise ValueError("a workload needs qps (open loop) and/or concurrency (closed loop)")
        if self.trace is not None and self.qps is not None:
            raise ValueError(
                "a trace is sent at its own timestamps: drop qps (scale time with trace_speedup)"
            )
        if self.trace is not None and self.turns is not None:
            raise ValueError("a trace has its own conversations (session_id): drop turns")
        if not self.trace_speedup > 0 or self.trace_block < 1:
            raise ValueError(
                f"need trace_speedup > 0 and trace_block >= 1, got {self.trace_speedup}, "
                f"{self.trace_block}"
            )
        if not self.think_time >= 0:
            raise ValueError(f"think_time must be >= 0 s, got {self.think_time}")
        if self.turns is not None and self.prompt_format == "ids":
            raise ValueError("conversations carry text history: use prompt_format 'text'")
        if self.dataset_fit and not (self.dataset and self.tokenizer):
            raise ValueError("dataset_fit needs a dataset and a tokenizer to measure it with")
        if self.qps is not None and not self.qps > 0:
            raise ValueError(f"qps must be > 0, got {self.qps}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be one of {ARRIVALS}, got {self.arrival!r}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(
                f"prompt_format must be one of {PROMPT_FORMATS}, got {self.prompt_format!r}"
            )
        if self.prefix_len < 0 or self.prefix_groups < 1:
            raise ValueError(
                f"need prefix_len >= 0 and prefix_groups >= 1, got {self.prefix_len}, "
                f"{self.prefix_groups}"
            )
        if not 0.0 <= self.cancel_rate <= 1.0:
            raise ValueError(f"cancel_rate must be in [0, 1], got {self.cancel_rate}")
        if self.dataset and self.prompt_format == "ids":
            raise ValueError("a ShareGPT dataset has text prompts; use prompt_format 'text'")
        if not self.chars_per_token > 0:
            raise ValueError(f"chars_per_token must be > 0, got {self.chars_per_token}")

    @property
    def closed_loop(self) -> bool:
        return self.qps is None and self.trace is None


def iter_gaps(
    qps: float, arrival: str = "poisson", burstiness: float = 1.0, seed: int = 0
) -> Iterator[float]:
    """Endless inter-arrival gaps in seconds (vLLM's gamma parameterisation; inf qps -> 0)."""
    rng = np.random.default_rng([seed, 1])
    shape = 1.0 if arrival == "poisson" else burstiness
    while True:
        if math.isinf(qps):
            batch = np.zeros(4096)
        elif arrival == "constant":
            batch = np.full(4096, 1.0 / qps)
        else:
            batch = rng.gamma(shape, 1.0 / (qps * shape), size=4096)
        yield from batch.tolist()


def arrival_offsets(
    n: int, qps: float, arrival: str = "poisson", burstiness: float = 1.0, seed: int = 0
) -> np.ndarray:
    """Absolute send offsets of the first n requests (as iter_requests makes them)."""
    gaps = iter_gaps(qps, arrival, burstiness, seed)
    out = np.zeros(n)
    for i in range(1, n):
        out[i] = out[i - 1] + next(gaps)
    return out


@functools.lru_cache(maxsize=2)  # the preflight and the run read it once between them
def load_sharegpt(path: str | Path) -> list[tuple[str, str]]:
    """(first human turn, first reply) pairs from a ShareGPT-format JSON file (not to be
    changed: the list is shared)."""
    try:
        data = orjson.loads(Path(path).read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        raise ValueError(f"cannot read ShareGPT dataset {path}: {exc}") from exc
    if not isinstance(data, list):
        raise ValueError(f"ShareGPT dataset {path} must be a JSON list of conversations")
    pairs = []
    for item in data:
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        prompt, reply = turns[0].get("value"), turns[1].get("value")
        if isinstance(prompt, str) and isinstance(reply, str) and prompt:
            pairs.append((prompt, reply))
    if not pairs:
        raise ValueError(f"ShareGPT dataset {path} has no conversation with two turns")
    return pairs


def _ids(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(ID_LOW, ID_HIGH, size=n).tolist()


def _no_ids(rng: np.random.Generator, n: int) -> list[int]:
    return []


def _no_text(rng: np.random.Generator, n: int) -> str:
    return ""


def iter_requests(workload: Workload, prompts: bool = True) -> Iterator[RequestSpec]:
    """The endless, deterministic request stream of a workload (take what the run needs).
    `prompts=False` leaves synthetic prompts empty (their lengths, offsets and cancels are the
    same: each has its own random stream) for a caller that needs only the shapes."""
    w = workload
    if w.trace is not None:
        yield from trace_requests(
            TraceOptions(
                w.trace,
                w.seed,
                w.trace_block,
                w.trace_speedup,
                w.tokenizer,
                w.chars_per_token,
                w.output.sample,
            ),
            prompts,
        )
        return
    counter = load_counter(w.tokenizer) if w.tokenizer and w.prompt_format == "text" else None
    rng_len = np.random.default_rng([w.seed, 2])
    rng_prompt = np.random.default_rng([w.seed, 3])
    rng_cancel = np.random.default_rng([w.seed, 4])
    if prompts:
        make = _ids if w.prompt_format == "ids" else random_text
    else:
        make = _no_ids if w.prompt_format == "ids" else _no_text
    if counter is not None and prompts:
        make = functools.partial(filler, counter)
    rng_turns = np.random.default_rng([w.seed, 6])  # own stream: single requests stay the same
    prefixes = [make(rng_prompt, w.prefix_len) for _ in range(w.prefix_groups)]
    pairs = load_sharegpt(w.dataset) if w.dataset else None
    if pairs is not None:
        order = np.random.default_rng([w.seed, 5]).permutation(len(pairs))
    gaps = None if w.closed_loop else iter_gaps(w.qps, w.arrival, w.burstiness, w.seed)
    offset = 0.0
    for i in range(2**62):
        if pairs is not None:
            prompt_text, reply = pairs[order[i % len(pairs)]]
            body: str | list[int] = prompt_text
            if counter is None:
                input_len = max(1, round(len(prompt_text) / w.chars_per_token))
            elif w.dataset_fit:
                input_len = w.input.sample(rng_len)
            if not w.dataset_output:
                max_tokens = w.output.sample(rng_len)
            elif counter is None:
                max_tokens = max(1, round(len(reply) / w.chars_per_token))
            else:
                max_tokens = max(1, len(counter.ids(reply)))
        else:
            input_len = w.input.sample(rng_len)
            max_tokens = w.output.sample(rng_len)
            body = make(rng_prompt, input_len)
        prefix = prefixes[i % w.prefix_groups] if w.prefix_len else body[:0]
        body = prefix + body
        if counter is not None and prompts and (pairs is None or w.dataset_fit):
            body = fit(counter, rng_prompt, body, input_len + w.prefix_len, keep=len(prefix))
        elif counter is not None:  # a dataset prompt as it is: measured
            input_len = counter.count(body) - w.prefix_len
        later: tuple[Turn, ...] = ()
        if w.turns is not None:
            later = tuple(_turn(w, rng_turns, make) for _ in range(w.turns.sample(rng_turns) - 1))
        cancel_after = None
        if w.cancel_rate and rng_cancel.random() < w.cancel_rate:
            cancel_after = int(rng_cancel.integers(1, max(2, max_tokens)))
        if i and gaps is not None:
            offset += next(gaps)
        yield RequestSpec(
            i,
            offset,
            body,
            input_len + w.prefix_len,
            max_tokens,
            cancel_after,
            conversation=w.turns is not None,
            later=later,
        )


def _turn(w: Workload, rng: np.random.Generator, make) -> Turn:
    """A later user turn: its own lengths and text, from the conversation stream `rng`."""
    n, out = w.input.sample(rng), w.output.sample(rng)
    text = make(rng, n)
    if w.tokenizer and isinstance(text, str) and text:
        text = fit(load_counter(w.tokenizer), rng, text, n)
    return Turn(text if isinstance(text, str) else "", n, out, w.think_time)


def schedule(
    workload: Workload, n: int | None, duration: float | None = None, most: int = 1_000_000
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(offsets, input_len, output_len) of the first n requests as `iter_requests` draws them,
    or (n None) of those an open loop schedules before `duration`, at most `most`; no prompt
    text is made."""
    rows = []
    for spec in itertools.islice(iter_requests(workload, prompts=False), n or most):
        if n is None and not workload.closed_loop and spec.offset >= (duration or 0.0):
            break
        rows.append((spec.offset, spec.input_len, spec.max_tokens))
    offsets, inp, out = zip(*rows, strict=True) if rows else ((), (), ())
    return np.array(offsets, float), np.array(inp, int), np.array(out, int)
