"""The dtypes a server computes in and stores, their bytes, and which compute dtype a server
starts with: one table and one rule for the serve side, the roofline, the simulator and the TUI.

JAX-free (stdlib only): the CPU's flags are read from /proc/cpuinfo.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DTYPES = ("f32", "bf16")  # compute (activations) dtypes
STORAGE_DTYPES = ("f32", "bf16", "int8")  # weight and KV-cache storage
# bytes per element: stored weights and KV, and the dtypes hardware specs give peak FLOP/s for
DTYPE_BYTES = {"f32": 4, "bf16": 2, "fp8": 1, "int8": 1}
SCALE_BYTES = 4  # an int8 entry's f32 scale: per output channel (weights), position and KV head


@dataclass(frozen=True)
class Precision:
    """What a server computes in and stores, resolved (no "" left): compute, weights, KV."""

    compute: str  # activations and matmul inputs: f32 | bf16
    weights: str  # f32 | bf16 | int8 (symmetric, per output channel, f32 scales)
    kv: str  # f32 | bf16 | int8 (symmetric, per position and KV head, f32 scales)

    @classmethod
    def of(cls, knobs: object, config: dict, compute: str) -> Precision:
        """The storage dtypes `knobs` asks (its `weight_dtype` / `kv_dtype`; "" = not asked),
        else the server's (its /stats `config`), else `compute`."""
        weights = getattr(knobs, "weight_dtype", "") or config.get("weight_dtype") or compute
        kv = getattr(knobs, "kv_dtype", "") or config.get("kv_dtype") or compute
        return cls(compute, str(weights), str(kv))

    @property
    def uniform(self) -> bool:
        return self.compute == self.weights == self.kv

    def describe(self) -> str:
        """'f32' when all three agree, else 'f32 compute, int8 weights, bf16 KV'."""
        if self.uniform:
            return self.compute
        return f"{self.compute} compute, {self.weights} weights, {self.kv} KV"

    def label(self) -> str:
        """The short form for a status bar: 'f32', or the compute dtype and what differs from
        it, 'f32·w int8·kv bf16'."""
        parts = [self.compute]
        if self.weights != self.compute:
            parts.append(f"w {self.weights}")
        if self.kv != self.compute:
            parts.append(f"kv {self.kv}")
        return "·".join(parts)


def default_compute_dtype(
    platform: str,
    bf16_pairs: Callable[[], bool],
    kernels: str = "auto",
    tp: int = 1,
    dp: int = 1,
    weight_dtype: str | None = None,
    kv_dtype: str | None = None,
) -> str:
    """The compute dtype a server starts with when none is asked: bf16 off CPU; on CPU bf16 only
    where the native kernels run (unsharded, not kernels xla) and multiply bf16 pairs
    (`bf16_pairs()`, asked only then: AVX512_BF16), else f32 (XLA's CPU bf16 matmuls run far
    slower than f32 at batch 1); f32 too when the weights or the KV cache are asked in f32.
    The server, `calibrate --model` and `simulate --hardware local` agree through this rule."""
    if "f32" in (weight_dtype, kv_dtype):
        return "f32"
    if platform != "cpu":
        return "bf16"
    if kernels == "xla" or tp * dp != 1:
        return "f32"
    return "bf16" if bf16_pairs() else "f32"


def cpu_flags() -> set[str]:
    """This CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith(("flags", "Features"))), "")
    return set(line.partition(":")[2].split())


def cpu_bf16_pairs() -> bool:
    """Whether the native kernels here would multiply bf16 pairs, read without JAX or building
    them: the CPU has AVX512_BF16 and SCALETUI_NATIVE_KERNELS is not 0."""
    if os.environ.get("SCALETUI_NATIVE_KERNELS", "1") == "0":
        return False
    return "avx512_bf16" in cpu_flags()
