"""Frozen server configuration: what the engines are built from and what /admin/config changes."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from scaletui.specs import ModelSpec

MODES = ("interleaved", "disaggregated")
DTYPES = ("f32", "bf16")  # compute (activations) dtypes
STORAGE_DTYPES = ("f32", "bf16", "int8")  # weight and KV-cache storage
BITS = {"f32": 32, "bf16": 16, "int8": 8}
KERNELS = ("auto", "native", "pallas", "xla")
# Keys POST /admin/config may change (live reconfiguration); anything else is rejected.
RECONFIGURABLE = ("slots", "tp", "dp", "mode", "prefill_devices", "decode_steps", "dtype",
                  "weight_dtype", "kv_dtype", "kernels", "page_size", "kv_pages",
                  "max_batched_tokens", "prefix_cache")  # fmt: skip
# Sane ranges, whatever the memory: a decode batch past MAX_SLOTS or more decode steps per host
# sync than MAX_DECODE_STEPS only adds latency (every request waits for the whole k-step call).
MAX_SLOTS = 1024
MAX_DECODE_STEPS = 64
PAGE_SIZES = (16, 32, 64, 128)  # KV positions per page


class ConfigError(ValueError):
    """A config value that cannot work: names the key, its value, why, and what to use instead.

    `str(e)` is for the API (`tp=3 does not divide ...; use tp 1, 2, 4 or 8`); `flag_line()`
    names the command-line flag for `scaletui serve` start-up errors.
    """

    def __init__(self, key: str, value: object, message: str, fix: str = "") -> None:
        self.key, self.value, self.message, self.fix = key, value, message, fix
        super().__init__(f"{message}; {fix}" if fix else message)

    def flag_line(self) -> str:
        return f"--{self.key.replace('_', '-')} {self.value}: {self}"


@dataclass(frozen=True)
class Precision:
    """What a server computes in and stores: the resolved dtype knobs of a ServeConfig."""

    compute: str  # activations and matmul inputs: f32 | bf16
    weights: str  # f32 | bf16 | int8 (symmetric, per output channel, f32 scales)
    kv: str  # f32 | bf16 | int8 (symmetric, per position and KV head, f32 scales)

    def describe(self) -> str:
        """'f32' when all three agree, else 'f32 compute, int8 weights, bf16 KV'."""
        if self.compute == self.weights == self.kv:
            return self.compute
        return f"{self.compute} compute, {self.weights} weights, {self.kv} KV"


def pow2_buckets(lo: int, top: int) -> tuple[int, ...]:
    """lo, 2 lo, 4 lo, ... below top, then top itself: (16, 32, 64, 100) for (16, 100)."""
    out, b = [], lo
    while b < top:
        out.append(b)
        b *= 2
    return (*out, top)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def one_of(values: list[int]) -> str:
    """[1, 2, 4] -> '1, 2 or 4'."""
    words = [str(v) for v in values]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


@dataclass(frozen=True)
class ServeConfig:
    """One server's shape. Variants are made with `dataclasses.replace` (or `updated`)."""

    model: ModelSpec
    slots: int = 8  # running sequences at most: the decode batch's rows (--max-running)
    max_seq_len: int = 1024  # longest sequence: prompt + generated tokens
    page_size: int = 64  # KV positions per page of the paged cache
    kv_pages: int = 0  # KV pages per data-parallel replica; 0 = slots x max_seq_len's worth
    prefix_cache: bool = True  # interleaved: reuse the pages of a prompt's cached prefix
    max_batched_tokens: int = 0  # interleaved: prompt tokens per generate call (0 = no bound)
    decode_steps: int = 4  # decode steps per host sync (tokens per slot per generate call)
    tp: int = 1  # tensor parallelism: the 'model' mesh axis (heads, d_ff)
    dp: int = 1  # data parallelism: the 'data' mesh axis (slots)
    mode: str = "interleaved"  # interleaved | disaggregated prefill/generate device sets
    prefill_devices: int = 0  # disaggregated: devices for prefill (0 = half of them)
    dtype: str = "f32"  # compute (activations); also weights and KV unless set below
    weight_dtype: str = ""  # f32 | bf16 | int8; "" = dtype
    kv_dtype: str = ""  # KV-cache storage: f32 | bf16 | int8; "" = dtype
    # auto: native CPU kernels (serve/native) where usable, JAX's Pallas paged attention on
    # GPU/TPU, else XLA ops; pallas on CPU runs the kernel interpreted (tests: slow)
    kernels: str = "auto"
    min_prefill_bucket: int = 16  # smallest power-of-two prompt bucket
    max_prefill_bucket: int = 0  # largest bucket (0 = max_seq_len); longer prompts are chunked
    weights: str | None = None  # HF safetensors dir/file; None = seeded dummy weights
    tokenizer: str | None = None  # HF tokenizer.json; None = byte tokenizer
    seed: int = 0  # dummy-weight seed
    max_waiting: int = 256  # waiting-queue bound in requests; beyond it 429
    max_waiting_tokens: int = 262144  # waiting-queue bound in prompt tokens; beyond it 429
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        value = vars(self)  # this config's own fields by name

        def bad(key: str, message: str, fix: str = "") -> ConfigError:
            return ConfigError(key, value[key], message, fix)

        if not 1 <= self.slots <= MAX_SLOTS:
            raise bad("slots", f"slots must be in [1, {MAX_SLOTS}], got {self.slots}",
                      f"use 1 to {MAX_SLOTS} (and what fits in memory)")  # fmt: skip
        if not 1 <= self.decode_steps <= MAX_DECODE_STEPS:
            raise bad("decode_steps", f"decode_steps must be in [1, {MAX_DECODE_STEPS}], got "
                      f"{self.decode_steps}", f"use 1 to {MAX_DECODE_STEPS} (4-16 amortise the "
                      "host sync)")  # fmt: skip
        for key in ("tp", "dp"):
            if value[key] < 1:
                raise bad(key, f"tp and dp must be >= 1, got tp={self.tp} dp={self.dp}")
        for key, allowed in (("mode", MODES), ("dtype", DTYPES), ("kernels", KERNELS),
                             ("weight_dtype", ("", *STORAGE_DTYPES)),
                             ("kv_dtype", ("", *STORAGE_DTYPES))):  # fmt: skip
            if value[key] not in allowed:
                shown = tuple(a for a in allowed if a)
                raise bad(key, f"{key} must be one of {shown}, got {value[key]!r}")
        p = self.precision
        for key, stored, what in (("weight_dtype", p.weights, "weights"), ("kv_dtype", p.kv, "KV")):
            if BITS[stored] > BITS[p.compute]:  # stored wider than computed: bytes for nothing
                raise bad(key, f"{key}={stored} is wider than dtype={p.compute}: the {what} "
                          f"would be read in {stored} and rounded to {p.compute} at every step",
                          f"use {key} {p.compute} (or int8), or dtype {stored}")  # fmt: skip
        if self.page_size not in PAGE_SIZES:
            raise bad("page_size", f"page_size must be one of {PAGE_SIZES}, got {self.page_size}")
        if self.kv_pages < 0 or 0 < self.kv_pages < 2:
            raise bad("kv_pages", f"kv_pages must be 0 (sized from slots x max_seq_len) or >= 2 "
                      f"(one is the engine's scratch page), got {self.kv_pages}")  # fmt: skip
        if self.max_batched_tokens < 0:
            raise bad("max_batched_tokens", f"max_batched_tokens must be >= 0 (0: no bound), got "
                      f"{self.max_batched_tokens}")  # fmt: skip
        if self.prefill_devices < 0:
            raise bad(
                "prefill_devices", f"prefill_devices must be >= 0, got {self.prefill_devices}"
            )
        if not 2 <= self.max_seq_len <= self.model.max_seq_len:
            raise bad(
                "max_seq_len",
                f"max_seq_len must be in [2, {self.model.max_seq_len}] for model "
                f"{self.model.name}, got {self.max_seq_len}",
            )
        for key in ("max_waiting", "max_waiting_tokens"):  # 0 would refuse every request
            if value[key] < 1:
                raise bad(key, f"max_waiting and max_waiting_tokens must be >= 1, got "
                          f"{self.max_waiting} and {self.max_waiting_tokens}")  # fmt: skip
        if self.slots % self.dp:
            up = -(-self.slots // self.dp) * self.dp
            raise bad("slots", f"slots ({self.slots}) must be a multiple of dp ({self.dp})",
                      f"use slots {up} or a dp that divides {self.slots}")  # fmt: skip

    @property
    def precision(self) -> Precision:
        """The dtype knobs resolved: unset weight_dtype / kv_dtype follow dtype."""
        return Precision(self.dtype, self.weight_dtype or self.dtype, self.kv_dtype or self.dtype)

    @property
    def pages_per_seq(self) -> int:
        """Pages one sequence of max_seq_len tokens holds: a page table row's width."""
        return -(-self.max_seq_len // self.page_size)

    @property
    def pages(self) -> int:
        """KV pages per data-parallel replica, page 0 (scratch: inactive rows write there)
        included: kv_pages, or as many as every slot at max_seq_len needs."""
        return self.kv_pages or (self.slots // self.dp) * self.pages_per_seq + 1

    @property
    def prefill_buckets(self) -> tuple[int, ...]:
        """Power-of-two prompt lengths compiled at start-up, smallest first."""
        top = self.max_prefill_bucket or self.max_seq_len
        return pow2_buckets(self.min_prefill_bucket, max(top, self.min_prefill_bucket))

    def updated(self, **changes: object) -> ServeConfig:
        """A copy with reconfigurable keys changed; unknown keys fail naming them."""
        unknown = sorted(set(changes) - set(RECONFIGURABLE))
        if unknown:
            raise ValueError(
                f"unknown config key(s) {unknown}; reconfigurable: {list(RECONFIGURABLE)}"
            )
        return replace(self, **changes)

    def public(self) -> dict:
        """JSON-able view for /stats and /admin/config."""
        return {
            "model": self.model.name,
            "slots": self.slots,
            "max_seq_len": self.max_seq_len,
            "page_size": self.page_size,
            "kv_pages": self.pages,
            "prefix_cache": self.prefix_cache,
            "max_batched_tokens": self.max_batched_tokens,
            "decode_steps": self.decode_steps,
            "tp": self.tp,
            "dp": self.dp,
            "mode": self.mode,
            "prefill_devices": self.prefill_devices,
            "dtype": self.dtype,
            "weight_dtype": self.precision.weights,
            "kv_dtype": self.precision.kv,
            "kernels": self.kernels,
            "prefill_buckets": list(self.prefill_buckets),
            "weights": self.weights or "dummy",
            "tokenizer": self.tokenizer or "byte",
            "max_waiting": self.max_waiting,
            "max_waiting_tokens": self.max_waiting_tokens,
        }
