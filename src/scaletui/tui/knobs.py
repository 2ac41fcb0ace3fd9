"""The knobs a user turns: server shape (slots, tp, dp, mode, weight and KV-cache precision) plus
load and prediction settings.

Frozen; edits make a new `Knobs` (`step`/`replace`). `server_changes` is what POST /admin/config
gets, `shape` the server they describe (its keys are checked by the shape's own rules,
`shape.check`); load and hardware knobs only change the next run and the prediction.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from scaletui.dtypes import STORAGE_DTYPES as PRECISIONS  # the `w`/`k` cycle
from scaletui.dtypes import Precision
from scaletui.shape import MODES, ServerShape, check

__all__ = ["MODES", "Knobs", "Precision", "check_mesh", "next_precision", "step_pow2"]

LOADS = ("concurrency", "qps")
SERVER_KEYS = (
    "slots",
    "tp",
    "dp",
    "mode",
    "prefill_devices",
    "weight_dtype",
    "kv_dtype",
    "page_size",
    "max_batched_tokens",
)


@dataclass(frozen=True)
class Knobs:
    slots: int = 8  # decode batch (KV cache slots)
    tp: int = 1  # tensor parallelism ('model' mesh axis)
    dp: int = 1  # data parallelism ('data' mesh axis)
    mode: str = "interleaved"  # interleaved | disaggregated prefill/generate
    prefill_devices: int = 0  # disaggregated: devices for prefill (0 = half)
    weight_dtype: str = ""  # weight storage: f32 | bf16 | int8; "" = the server's own (its dtype)
    kv_dtype: str = ""  # KV-cache storage: f32 | bf16 | int8; "" = the server's own
    page_size: int = 64  # KV positions per page
    max_batched_tokens: int = 0  # prompt tokens between two generate calls (0: whole prompts)
    load: str = "concurrency"  # concurrency (closed loop) | qps (open loop, Poisson)
    rate: float = 0.0  # concurrency or req/s; concurrency 0 = follow slots
    input_len: int = 128  # prompt tokens per request
    output_len: int = 128  # generated tokens per request
    length_spread: float = 0.25  # lengths uniform within +- this fraction of each (0: fixed)
    hardware: str = ""  # spec for predictions; "" = local if calibrated, else a fallback

    def __post_init__(self) -> None:
        mine = vars(self)  # the server keys by the shape's own rules (a ConfigError names one)
        check({k: mine[k] for k in SERVER_KEYS})
        if self.load not in LOADS:
            raise ValueError(f"load must be one of {LOADS}, got {self.load!r}")
        if self.rate < 0:
            raise ValueError(f"rate must be >= 0, got {self.rate}")
        if self.load == "qps" and self.rate <= 0:
            raise ValueError(f"qps load needs a rate > 0, got {self.rate}")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError(
                f"input/output lengths must be >= 1, got {self.input_len}/{self.output_len}"
            )
        if not 0 <= self.length_spread < 1:
            raise ValueError(f"length_spread must be in [0, 1), got {self.length_spread}")

    @property
    def chips(self) -> int:
        return self.tp * self.dp

    @property
    def concurrency(self) -> int:
        """Closed-loop concurrency: the explicit value, or the slot count when following it."""
        return int(self.rate) if self.rate >= 1 else self.slots

    @property
    def input_spread(self) -> int:
        """Prompt tokens either side of `input_len` (loadgen's `--input-spread`)."""
        return round(self.length_spread * self.input_len)

    @property
    def output_spread(self) -> int:
        """Generated tokens either side of `output_len` (loadgen's `--output-spread`)."""
        return round(self.length_spread * self.output_len)

    @property
    def longest(self) -> int:
        """The most tokens one request holds: its longest prompt plus its longest output."""
        return self.input_len + self.input_spread + self.output_len + self.output_spread

    def lengths_label(self) -> str:
        """'in 128±32 out 128±32', or 'in 128 out 128' when the lengths are fixed."""

        def pm(mean: int, spread: int) -> str:
            return f"{mean}±{spread}" if spread else str(mean)

        inp, out = pm(self.input_len, self.input_spread), pm(self.output_len, self.output_spread)
        return f"in {inp} out {out}"

    def load_label(self, short: bool = False) -> str:
        if self.load == "qps":
            return f"{self.rate:g} req/s"
        follow = "" if self.rate >= 1 or short else " (=slots)"
        return f"conc {self.concurrency}{follow}"

    def mesh_label(self) -> str:
        mode = "" if self.mode == "interleaved" else f" disagg pf{self.prefill_devices or 'auto'}"
        return f"dp{self.dp}·tp{self.tp}{mode}"

    def server_changes(self, applied: Knobs) -> dict:
        """The /admin/config body that turns `applied` into this."""
        mine, theirs = self.to_dict(), applied.to_dict()
        return {k: mine[k] for k in SERVER_KEYS if mine[k] != theirs[k]}

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Knobs:
        """Knobs from `to_dict`'s output (a recorded session's); a recording made before the
        lengths had a spread ran them fixed."""
        names = {f.name for f in fields(cls)}
        return cls(**{"length_spread": 0.0, **{k: v for k, v in data.items() if k in names}})

    def shape(self, server: ServerShape) -> ServerShape:
        """The server these knobs describe: `server` (what runs) with the knobs' server keys;
        a storage dtype the knobs leave "" stays the server's. ConfigError (a ValueError) for
        a shape the server would refuse."""
        mine = self.to_dict()
        return replace(server, **{k: mine[k] for k in SERVER_KEYS if mine[k] != ""})

    def with_server(self, config: dict) -> Knobs:
        """These knobs with the server-side keys taken from a /stats "config"."""
        changes = {k: config[k] for k in SERVER_KEYS if k in config}
        return replace(self, **changes)


def next_precision(dtype: str) -> str:
    """The `w`/`k` cycle: f32 -> bf16 -> int8 -> f32 (an unknown dtype starts it at f32)."""
    if dtype not in PRECISIONS:
        return PRECISIONS[0]
    return PRECISIONS[(PRECISIONS.index(dtype) + 1) % len(PRECISIONS)]


def step_pow2(value: int, up: bool, lo: int, hi: int) -> int:
    """Next power of two above/below `value`, clamped to [lo, hi]."""
    if up:
        nxt = 1
        while nxt <= value:
            nxt *= 2
    else:
        nxt = 1
        while nxt * 2 < value:
            nxt *= 2
    return max(lo, min(hi, nxt))


def check_mesh(knobs: Knobs, n_devices: int) -> str | None:
    """Why this mesh cannot run on `n_devices`, or None when it can."""
    if n_devices < 1:
        return None  # unknown yet (server not up): let the server decide
    need = knobs.chips
    if knobs.mode == "disaggregated":
        need = knobs.chips + (knobs.prefill_devices or knobs.chips)
    if need > n_devices:
        return f"dp{knobs.dp}·tp{knobs.tp} ({knobs.mode}) needs {need} devices, have {n_devices}"
    if n_devices % knobs.tp:
        return f"tp {knobs.tp} does not divide the {n_devices} devices"
    return None
