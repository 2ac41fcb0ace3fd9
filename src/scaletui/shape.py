"""A server's shape: the one frozen record that the CLI, the admin API, the TUI, the simulator and
the calibrated fits all spell a server with (its dtypes' rules: `scaletui.dtypes`).

JAX-free (stdlib, `specs` and `dtypes` only), so `scaletui simulate`, `scaletui roofline` and the
TUI use it without importing JAX. `ServerShape` validates at construction (`check`: its rules,
which the TUI's knobs share; `ConfigError` names the key and the fix), converts to and from the
admin JSON (`to_json` / `from_json`) and `scaletui serve`'s flags (`to_flags`, `from_args`; the
flags themselves, one per field, are `shape_flags.add_flags`').
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from scaletui import policy
from scaletui.dtypes import DTYPE_BYTES, DTYPES, STORAGE_DTYPES, Precision
from scaletui.specs import ModelSpec, load_model, model_ref

MODES = ("interleaved", "disaggregated")
KERNELS = ("auto", "native", "pallas", "xla")
PAGE_SIZES = (16, 32, 64, 128)  # KV positions per page
# Keys POST /admin/config may change (live reconfiguration); anything else is rejected.
RECONFIGURABLE = (
    "slots",
    "tp",
    "dp",
    "mode",
    "prefill_devices",
    "decode_steps",
    "dtype",
    "weight_dtype",
    "kv_dtype",
    "kernels",
    "page_size",
    "kv_pages",
    "max_batched_tokens",
    "mixed_batches",
    "prefix_cache",
)
# The keys of `to_json` a calibrated fit is made for and looked up by (`fit_key`).
FIT_KEYS = ("model", "dtype", "weight_dtype", "kv_dtype", "tp", "dp", "kernels")
# Sane ranges, whatever the memory: a decode batch past MAX_SLOTS or more decode steps per host
# sync than MAX_DECODE_STEPS only adds latency (every request waits for the whole k-step call).
MAX_SLOTS = 1024
MAX_DECODE_STEPS = 64


class ConfigError(ValueError):
    """A config value that cannot work: names the key, its value, why, and what to use instead.

    `str(e)` is for the API (`tp=3 does not divide ...; use tp 1, 2, 4 or 8`); `flag_line()`
    names the command-line flag for `scaletui serve` start-up errors.
    """

    def __init__(self, key: str, value: object, message: str, fix: str = "") -> None:
        self.key, self.value, self.message, self.fix = key, value, message, fix
        super().__init__(f"{message}; {fix}" if fix else message)

    def flag_line(self) -> str:
        return f"{flag(self.key)} {self.value}: {self}"


def pow2_buckets(lo: int, top: int) -> tuple[int, ...]:
    """lo, 2 lo, 4 lo, ... below top, then top itself: (16, 32, 64, 100) for (16, 100)."""
    out, b = [], lo
    while b < top:
        out.append(b)
        b *= 2
    return (*out, top)


def check(value: Mapping[str, Any]) -> None:
    """`ServerShape`'s rules, for the fields in `value` (by name) that each rule reads: a whole
    shape's at construction, or part of one (the TUI's knobs check theirs by the same rules).
    A rule whose fields are not all there is skipped; ConfigError names the first bad key."""

    def bad(key: str, message: str, fix: str = "") -> ConfigError:
        return ConfigError(key, value[key], message, fix)

    def has(*keys: str) -> bool:
        return all(k in value for k in keys)

    if has("slots") and not 1 <= value["slots"] <= MAX_SLOTS:
        raise bad(
            "slots",
            f"slots must be in [1, {MAX_SLOTS}], got {value['slots']}",
            f"use 1 to {MAX_SLOTS} (and what fits in memory)",
        )
    if has("decode_steps") and not 1 <= value["decode_steps"] <= MAX_DECODE_STEPS:
        raise bad(
            "decode_steps",
            f"decode_steps must be in [1, {MAX_DECODE_STEPS}], got {value['decode_steps']}",
            f"use 1 to {MAX_DECODE_STEPS} (4-16 amortise the host sync)",
        )
    for key in ("tp", "dp"):
        if has("tp", "dp") and value[key] < 1:
            raise bad(key, f"tp and dp must be >= 1, got tp={value['tp']} dp={value['dp']}")
    for key, allowed in (
        ("mode", MODES),
        ("dtype", DTYPES),
        ("kernels", KERNELS),
        ("weight_dtype", ("", *STORAGE_DTYPES)),
        ("kv_dtype", ("", *STORAGE_DTYPES)),
    ):
        if has(key) and value[key] not in allowed:
            shown = tuple(a for a in allowed if a)
            raise bad(key, f"{key} must be one of {shown}, got {value[key]!r}")
    if has("dtype", "weight_dtype", "kv_dtype"):
        compute = value["dtype"]
        for key, what in (("weight_dtype", "weights"), ("kv_dtype", "KV")):
            stored = value[key] or compute
            if DTYPE_BYTES[stored] > DTYPE_BYTES[compute]:  # stored wider than computed
                raise bad(
                    key,
                    f"{key}={stored} is wider than dtype={compute}: the {what} "
                    f"would be read in {stored} and rounded to {compute} at every step",
                    f"use {key} {compute} (or int8), or dtype {stored}",
                )
    if has("page_size") and value["page_size"] not in PAGE_SIZES:
        raise bad("page_size", f"page_size must be one of {PAGE_SIZES}, got {value['page_size']}")
    if has("kv_pages") and (value["kv_pages"] < 0 or 0 < value["kv_pages"] < 2):
        raise bad(
            "kv_pages",
            f"kv_pages must be 0 (sized from slots x max_seq_len) or >= 2 "
            f"(one is the engine's scratch page), got {value['kv_pages']}",
        )
    if has("max_batched_tokens") and value["max_batched_tokens"] < 0:
        raise bad(
            "max_batched_tokens",
            f"max_batched_tokens must be >= 0 (0: no bound), got {value['max_batched_tokens']}",
        )
    if has("prefill_devices") and value["prefill_devices"] < 0:
        raise bad(
            "prefill_devices", f"prefill_devices must be >= 0, got {value['prefill_devices']}"
        )
    if has("model", "max_seq_len") and not 2 <= value["max_seq_len"] <= value["model"].max_seq_len:
        model = value["model"]
        raise bad(
            "max_seq_len",
            f"max_seq_len must be in [2, {model.max_seq_len}] for model "
            f"{model.name}, got {value['max_seq_len']}",
        )
    if has("min_prefill_bucket", "max_prefill_bucket") and (
        value["min_prefill_bucket"] < 1 or value["max_prefill_bucket"] < 0
    ):
        key = "min_prefill_bucket" if value["min_prefill_bucket"] < 1 else "max_prefill_bucket"
        raise bad(
            key,
            f"min_prefill_bucket must be >= 1 and max_prefill_bucket >= 0 "
            f"(0: max_seq_len), got {value['min_prefill_bucket']} and "
            f"{value['max_prefill_bucket']}",
        )
    for key in ("max_waiting", "max_waiting_tokens"):  # 0 would refuse every request
        if has("max_waiting", "max_waiting_tokens") and value[key] < 1:
            raise bad(
                key,
                f"max_waiting and max_waiting_tokens must be >= 1, got "
                f"{value['max_waiting']} and {value['max_waiting_tokens']}",
            )
    if has("slots", "dp") and value["dp"] >= 1 and value["slots"] % value["dp"]:
        slots, dp = value["slots"], value["dp"]
        raise bad(
            "slots",
            f"slots ({slots}) must be a multiple of dp ({dp})",
            f"use slots {-(-slots // dp) * dp} or a dp that divides {slots}",
        )


@dataclass(frozen=True)
class ServerShape:
    """One server's shape. Variants are made with `dataclasses.replace` (or `updated`)."""

    model: ModelSpec
    slots: int = 8  # running sequences at most: the decode batch's rows (--max-running)
    max_seq_len: int = 1024  # longest sequence: prompt + generated tokens
    page_size: int = 64  # KV positions per page of the paged cache
    kv_pages: int = 0  # KV pages per data-parallel replica; 0 = slots x max_seq_len's worth
    prefix_cache: bool = True  # interleaved: reuse the pages of a prompt's cached prefix
    max_batched_tokens: int = 0  # interleaved: prompt tokens per generate call (0 = no bound)
    # interleaved, with a token budget: a pass's first prompt piece rides in the generate call's
    # first step, one forward pass with the decode rows (policy.mix_tokens)
    mixed_batches: bool = True
    decode_steps: int = 4  # decode steps per host sync (tokens per slot per generate call)
    tp: int = 1  # tensor parallelism: the 'model' mesh axis (heads, d_ff)
    dp: int = 1  # data parallelism: the 'data' mesh axis (slots)
    mode: str = "interleaved"  # interleaved | disaggregated prefill/generate device sets
    prefill_devices: int = 0  # disaggregated: devices for prefill (0 = half of them)
    dtype: str = "f32"  # compute (activations); also weights and KV unless set below
    weight_dtype: str = ""  # f32 | bf16 | int8; "" = dtype
    kv_dtype: str = ""  # KV-cache storage: f32 | bf16 | int8; "" = dtype
    # auto: native CPU kernels (serve/engine/native) where usable, JAX's Pallas paged attention on
    # GPU/TPU, else XLA ops; pallas on CPU runs the kernel interpreted (tests: slow)
    kernels: str = "auto"
    min_prefill_bucket: int = 16  # smallest power-of-two prompt bucket
    max_prefill_bucket: int = 0  # largest bucket (0 = max_seq_len); longer prompts are chunked
    weights: str | None = None  # HF safetensors dir/file; None = seeded dummy weights
    tokenizer: str | None = None  # HF tokenizer.json; None = byte tokenizer
    seed: int = 0  # dummy-weight seed
    max_waiting: int = 256  # waiting-queue bound in requests; beyond it 429
    max_waiting_tokens: int = 262144  # waiting-queue bound in prompt tokens; beyond it 429

    def __post_init__(self) -> None:
        check(vars(self))

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
    def mixing(self) -> int:
        """The longest prompt piece a generate call takes along (0: none): `policy.mix_tokens`."""
        return policy.mix_tokens(
            self.mixed_batches, self.max_batched_tokens, self.page_size, self.mode
        )

    @property
    def prefill_buckets(self) -> tuple[int, ...]:
        """Power-of-two prompt lengths compiled at start-up, smallest first, none past
        max_seq_len (the largest is the chunk a longer prompt is prefilled in)."""
        top = self.max_prefill_bucket or self.max_seq_len
        buckets = pow2_buckets(self.min_prefill_bucket, max(top, self.min_prefill_bucket))
        return tuple(b for b in buckets if b <= self.max_seq_len) or (self.max_seq_len,)

    @property
    def decode_buckets(self) -> tuple[int, ...]:
        """KV lengths the generate step is compiled for: 2^i pages, up to max_seq_len's."""
        return tuple(b * self.page_size for b in pow2_buckets(1, self.pages_per_seq))

    def updated(self, **changes: object) -> ServerShape:
        """A copy with reconfigurable keys changed; unknown keys fail naming them."""
        unknown = sorted(set(changes) - set(RECONFIGURABLE))
        if unknown:
            raise ValueError(
                f"unknown config key(s) {unknown}; reconfigurable: {list(RECONFIGURABLE)}"
            )
        return replace(self, **changes)

    def to_json(self) -> dict:
        """The JSON-able view of /stats and /admin/config: dtypes and pages resolved, the
        prefill buckets spelled out, "dummy" weights and the "byte" tokenizer named."""
        return {
            "model": model_ref(self.model),
            "slots": self.slots,
            "max_seq_len": self.max_seq_len,
            "page_size": self.page_size,
            "kv_pages": self.pages,
            "prefix_cache": self.prefix_cache,
            "max_batched_tokens": self.max_batched_tokens,
            "mixed_batches": self.mixed_batches,
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
            "seed": self.seed,
            "max_waiting": self.max_waiting,
            "max_waiting_tokens": self.max_waiting_tokens,
        }

    @classmethod
    def from_json(cls, data: dict, model: ModelSpec | None = None) -> ServerShape:
        """The shape `to_json` wrote (keys it lacks take their defaults; unknown keys, such as
        /stats' running-state ones, are ignored). `model` stands in for loading data["model"]
        by name. from_json(s.to_json()).to_json() == s.to_json()."""
        names = {f.name for f in fields(cls)} - {"model"}
        kw = {k: v for k, v in data.items() if k in names}
        if kw.get("weights") == "dummy":
            kw["weights"] = None
        if kw.get("tokenizer") == "byte":
            kw["tokenizer"] = None
        buckets = [int(b) for b in data.get("prefill_buckets") or ()]
        if buckets and "min_prefill_bucket" not in kw:
            kw["min_prefill_bucket"] = buckets[0]
            top = buckets[-1]
            kw["max_prefill_bucket"] = 0 if top == data.get("max_seq_len", 1024) else top
        return cls(model or load_model(data["model"]), **kw)

    def fit_key(self) -> dict:
        """The keys of `to_json` that a calibrated fit is made for (FIT_KEYS), the model by
        its name (as the fit's `model` names it; a checkpoint directory's is its basename)."""
        j = {**self.to_json(), "model": self.model.name}
        return {k: j[k] for k in FIT_KEYS}

    def to_flags(self, keys: Iterable[str] | None = None) -> list[str]:
        """`scaletui serve`'s argv for this shape: the flags of the fields in `keys` (default:
        all), in field order, but unset storage dtypes and None; from_args(parse(to_flags()))
        == self."""
        wanted = {f.name for f in fields(self)} if keys is None else set(keys)
        argv = []
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name not in wanted or v is None or v == "":
                continue
            if f.name == "model":
                argv += ["--model", model_ref(self.model)]
            elif f.name == "prefix_cache":
                argv += [] if v else ["--no-prefix-cache"]
            elif isinstance(v, bool):
                argv += [flag(f.name), "on" if v else "off"]
            else:
                argv += [flag(f.name), str(v)]
        return argv

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, omit: tuple[str, ...] = (), **overrides: object
    ) -> ServerShape:
        """The shape `add_flags`' flags parsed into `args` ask for (but `omit`'s): flags left
        unset (None) take the fields' defaults, --max-seq-len min(1024, the model's);
        `overrides` win (a model already loaded, a default dtype found on the devices).
        ConfigError names the bad flag's key."""
        model = overrides.pop("model", None) or load_model(args.model)
        given = vars(args)
        kw = {
            f.name: given[f.name]
            for f in fields(cls)
            if f.name not in ("model", *omit) and given.get(f.name) is not None
        }
        kw.setdefault("max_seq_len", min(1024, model.max_seq_len))
        return cls(model, **{**kw, **overrides})


def flag(name: str) -> str:
    """A field's command-line flag: its name with dashes (`max_seq_len` -> `--max-seq-len`)."""
    return f"--{name.replace('_', '-')}"
