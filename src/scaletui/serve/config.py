"""Frozen server configuration: what the engines are built from and what /admin/config changes."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from scaletui.specs import ModelSpec

MODES = ("interleaved", "disaggregated")
DTYPES = ("f32", "bf16")
KERNELS = ("auto", "native", "xla")
# Keys POST /admin/config may change (live reconfiguration); anything else is rejected.
RECONFIGURABLE = ("slots", "tp", "dp", "mode", "prefill_devices", "decode_steps")


@dataclass(frozen=True)
class ServeConfig:
    """One server's shape. Variants are made with `dataclasses.replace` (or `updated`)."""

    model: ModelSpec
    slots: int = 8  # concurrent sequences in the decode batch (KV cache slots)
    max_seq_len: int = 1024  # KV length per slot: prompt + generated tokens
    decode_steps: int = 4  # decode steps per host sync (tokens per slot per generate call)
    tp: int = 1  # tensor parallelism: the 'model' mesh axis (heads, d_ff)
    dp: int = 1  # data parallelism: the 'data' mesh axis (slots)
    mode: str = "interleaved"  # interleaved | disaggregated prefill/generate device sets
    prefill_devices: int = 0  # disaggregated: devices for prefill (0 = half of them)
    dtype: str = "f32"  # weights, activations and KV cache; f32 on CPU, bf16 on GPU/TPU
    kernels: str = "auto"  # native CPU kernels (serve/native) where usable, else XLA ops
    min_prefill_bucket: int = 16  # smallest power-of-two prompt bucket
    max_prefill_bucket: int = 0  # largest bucket (0 = max_seq_len); longer prompts are chunked
    weights: str | None = None  # HF safetensors dir/file; None = seeded dummy weights
    tokenizer: str | None = None  # HF tokenizer.json; None = byte tokenizer
    seed: int = 0  # dummy-weight seed
    max_waiting: int = 256  # waiting-queue bound in requests; beyond it 429
    max_waiting_tokens: int = 262144  # waiting-queue bound in prompt tokens; beyond it 429
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"slots must be >= 1, got {self.slots}")
        if self.decode_steps < 1:
            raise ValueError(f"decode_steps must be >= 1, got {self.decode_steps}")
        if self.tp < 1 or self.dp < 1:
            raise ValueError(f"tp and dp must be >= 1, got tp={self.tp} dp={self.dp}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {self.kernels!r}")
        if self.prefill_devices < 0:
            raise ValueError(f"prefill_devices must be >= 0, got {self.prefill_devices}")
        if not 2 <= self.max_seq_len <= self.model.max_seq_len:
            raise ValueError(
                f"max_seq_len must be in [2, {self.model.max_seq_len}] for model "
                f"{self.model.name}, got {self.max_seq_len}"
            )
        if self.max_waiting < 1 or self.max_waiting_tokens < 1:  # 0 would refuse every request
            raise ValueError(
                f"max_waiting and max_waiting_tokens must be >= 1, got {self.max_waiting} and "
                f"{self.max_waiting_tokens}"
            )
        if self.slots % self.dp:
            raise ValueError(f"slots ({self.slots}) must be a multiple of dp ({self.dp})")

    @property
    def prefill_buckets(self) -> tuple[int, ...]:
        """Power-of-two prompt lengths compiled at start-up, smallest first."""
        top = self.max_prefill_bucket or self.max_seq_len
        buckets, b = [], self.min_prefill_bucket
        while b < top:
            buckets.append(b)
            b *= 2
        buckets.append(top if top >= self.min_prefill_bucket else self.min_prefill_bucket)
        return tuple(sorted(set(buckets)))

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
            "decode_steps": self.decode_steps,
            "tp": self.tp,
            "dp": self.dp,
            "mode": self.mode,
            "prefill_devices": self.prefill_devices,
            "dtype": self.dtype,
            "kernels": self.kernels,
            "prefill_buckets": list(self.prefill_buckets),
            "weights": self.weights or "dummy",
            "tokenizer": self.tokenizer or "byte",
            "max_waiting": self.max_waiting,
            "max_waiting_tokens": self.max_waiting_tokens,
        }
