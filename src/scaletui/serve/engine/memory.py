"""What a ServerShape holds in memory, from the roofline's pure counts, and whether it fits.

`footprint(config)` gives the parameter count, weight bytes and KV-cache bytes in the config's
precision (int8 weights: one byte per matrix parameter plus an f32 scale per output channel,
norms in the compute dtype; int8 KV: one byte per value plus an f32 scale per position and KV
head; no JAX): the
start-up banner prints it, and `check_fits` compares it with the devices' memory before
anything is built, so `--slots 100000` or `{"slots": 100000}` is a 400 naming the largest slot
count that fits, not an OOM kill on the first request. Capacity is an accelerator's
`bytes_limit` per device, or on CPU the host's available RAM (all virtual devices share it)
plus what this server's engines hold now (a rebuild frees them), less a margin. The estimate
leaves out activations and compile scratch; the margin is for them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from scaletui.dtypes import DTYPE_BYTES, SCALE_BYTES, Precision
from scaletui.roofline import costinputs
from scaletui.roofline.costs import param_count, params_by_part
from scaletui.shape import ConfigError, ServerShape
from scaletui.specs import ModelSpec

log = logging.getLogger("scaletui.serve")
DEVICE_FRACTION = 0.9  # of an accelerator's bytes_limit: the rest for activations, scratch
HOST_MARGIN = 0.1  # of the host's total RAM kept free on CPU


@dataclass(frozen=True)
class Footprint:
    """One server's memory by part (one copy of the weights; the whole KV cache)."""

    params: int
    weight_bytes: int
    kv_bytes: int  # the page pools of every data-parallel replica
    kv_page_bytes: int  # one page: page_size positions of K and V in every layer
    host_bytes: int = 0  # the host params at load: as made (f32 for int8) and, if any, converted

    def describe(self, config: ServerShape) -> str:
        return (
            f"{config.model.name}: {_count(self.params)} parameters, "
            f"{config.precision.describe()}, weights "
            f"{gib(self.weight_bytes)}, KV cache {gib(self.kv_bytes)} ({config.dp} x "
            f"{config.pages} pages of {config.page_size} tokens; {config.slots} sequences of up "
            f"to {config.max_seq_len} tokens)"
        )


@dataclass(frozen=True)
class Capacity:
    """Bytes a config may use: on one accelerator device, or in the host's RAM (CPU)."""

    bytes: int
    per_device: bool
    what: str  # where the number comes from, for the error message


def weight_bytes(m: ModelSpec, p: Precision) -> int:
    """Bytes of one copy of the weights stored as `p` says (what the engine places)."""
    norms = params_by_part(m)["norms"]
    matrices = param_count(m) - norms
    scales = 0
    if p.weights == "int8":  # one per output channel of every matrix; a table's per row
        per_layer = (m.n_heads + 2 * m.n_kv_heads) * m.head_dim + 2 * m.d_model + 2 * m.d_ff
        tables = 1 if m.tied_embeddings else 2
        scales = (m.n_layers * per_layer + tables * m.vocab_size) * SCALE_BYTES
    return matrices * DTYPE_BYTES[p.weights] + norms * DTYPE_BYTES[p.compute] + scales


def kv_token_bytes(m: ModelSpec, kv: str) -> int:
    """K and V bytes per token in every layer (int8: with a scale per KV head), as the roofline
    counts them."""
    return int(costinputs.kv_token_bytes(m, kv))


def footprint(config: ServerShape) -> Footprint:
    m, p = config.model, config.precision
    page = kv_token_bytes(m, p.kv) * config.page_size
    stored = weight_bytes(m, p)
    made = stored if p.weights != "int8" else param_count(m) * DTYPE_BYTES["f32"] + stored
    return Footprint(param_count(m), stored, page * config.pages * config.dp, page, made)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def _split(config: ServerShape, capacity: Capacity, replicas: int) -> tuple[float, float]:
    """(fixed bytes, bytes per KV page of one replica) where `capacity` counts: the busiest
    device (a tp shard of the weights, its replica's pages) or the host's RAM (every device's
    copy, and the host copies the weights are placed from)."""
    fp, tp = footprint(config), config.tp
    kv_split = tp if config.model.n_kv_heads % tp == 0 else 1  # else KV heads are replicated
    if capacity.per_device:
        return fp.weight_bytes // tp, fp.kv_page_bytes / kv_split
    fixed = fp.weight_bytes * replicas + fp.host_bytes
    return fixed, fp.kv_page_bytes * config.dp * tp / kv_split


def pages_that_fit(config: ServerShape, capacity: Capacity, fraction: float, replicas: int) -> int:
    """KV pages per replica in `fraction` of what `capacity` leaves after the weights
    (`--kv-memory-fraction`); at least 2 (a scratch page and one more)."""
    fixed, per_page = _split(config, capacity, replicas)
    return max(2, int(max(0, capacity.bytes - fixed) * fraction // per_page))


def check_fits(config: ServerShape, replicas: int, capacity: Capacity) -> None:
    """ConfigError naming `kv_pages` or `slots` (and the most that fit) when `config` needs more
    memory than `capacity`; `replicas`: weight copies the plan places (one per data-parallel
    mesh row)."""
    fixed, per_page = _split(config, capacity, replicas)
    kv = per_page * config.pages
    need = fixed + kv
    if need <= capacity.bytes:
        return
    where = " per device" if capacity.per_device else ""
    message = (
        f"{config.pages} KV pages of {config.page_size} tokens (slots={config.slots}, "
        f"max_seq_len={config.max_seq_len}) need {gib(need)}{where} ({gib(fixed)} weights + "
        f"{gib(kv)} KV cache), but {gib(capacity.bytes)} {capacity.what}"
    )
    pages = int((capacity.bytes - fixed) // per_page) if capacity.bytes > fixed else 0
    if pages >= 2 and config.kv_pages:
        raise ConfigError("kv_pages", config.kv_pages, message, f"use kv_pages <= {pages}")
    most = (pages - 1) // config.pages_per_seq * config.dp  # slots whose full rows fit
    if most >= 1:
        raise ConfigError(
            "slots",
            config.slots,
            message,
            f"use slots <= {most}, a smaller "
            f"max_seq_len, or kv_pages <= {pages} (sequences share the pages "
            "they use)",
        )
    raise ConfigError(
        "model",
        config.model.name,
        message,
        "the weights alone do not fit: use "
        "weight_dtype bf16 or int8, a larger tp or a smaller model",
    )


def capacity(devices: list, held_bytes: int = 0) -> Capacity | None:
    """What the devices offer; None where nothing reports memory (the check is skipped)."""
    if not devices or devices[0].platform == "cpu":
        import psutil

        vm = psutil.virtual_memory()
        free = vm.available + held_bytes - int(HOST_MARGIN * vm.total)
        what = "of host RAM is free (available, less a 10% margin)"
        return Capacity(max(0, free), False, what)
    limits = []
    for d in devices:
        try:
            stats = d.memory_stats() or {}
        except Exception:  # a backend without memory stats
            stats = {}
        if stats.get("bytes_limit"):
            limits.append(int(stats["bytes_limit"]))
    if not limits:
        log.debug("no device reports bytes_limit; the memory check is skipped")
        return None
    what = f"is usable per device ({DEVICE_FRACTION:.0%} of bytes_limit)"
    return Capacity(int(min(limits) * DEVICE_FRACTION), True, what)
