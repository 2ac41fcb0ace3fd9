"""Typed loader for the YAML model and hardware specs; imports nothing of ours.

A spec argument is a name (`llama3-8b`, `h200`, `local`) or a path to a YAML file. Required keys
are checked with the file, the key and what was expected named in the error; any other key
(sources, notes) is kept in `extra` and otherwise ignored.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import yaml

from scaletui.specs.errors import SpecError

__all__ = [
    "HardwareSpec",
    "ModelSpec",
    "RopeScaling",
    "SpecError",
    "hardware_names",
    "load_hardware",
    "load_model",
    "local_hardware_path",
    "model_from_mapping",
    "model_names",
    "model_ref",
    "user_config_dir",
]


@dataclass(frozen=True)
class RopeScaling:
    """LLaMA-3.1's RoPE frequency scaling (`rope_scaling` of type `llama3` in an HF config):
    wavelengths longer than original_max_position_embeddings / low_freq_factor are divided by
    `factor`, shorter than ... / high_freq_factor are kept, and those between are blended."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: str = "llama3"


@dataclass(frozen=True)
class ModelSpec:
    """A LLaMA-style decoder (GQA, gated MLP, RoPE). Shapes use the book's letters."""

    name: str
    n_layers: int  # L
    d_model: int  # D
    d_ff: int  # F
    n_heads: int  # N query heads
    n_kv_heads: int  # K key/value heads
    head_dim: int  # H
    vocab_size: int  # V
    tied_embeddings: bool  # one D*V table for input and output, or two
    rope_theta: float
    norm_eps: float
    max_seq_len: int
    n_experts: int = 0  # 0: dense
    experts_per_token: int = 0
    qkv_bias: bool = False  # Qwen2-style biases on the q, k and v projections
    rope_scaling: RopeScaling | None = None  # None: plain RoPE at rope_theta
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def q_per_kv(self) -> int:
        """G = N / K query heads sharing one KV head."""
        return self.n_heads // self.n_kv_heads


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator chip (or a CPU host) as the roofline sees it. SI bytes and seconds."""

    name: str
    kind: str  # tpu | gpu | cpu
    flops_per_s: dict[str, float]  # peak per chip by dtype: bf16, int8, fp8, f32
    hbm_bytes: float  # memory per chip
    hbm_bw: float  # memory bandwidth per chip, bytes/s
    ici_bw: float  # per-chip collective bandwidth, bytes/s, one direction (ICI / NVLink)
    ici_bidirectional: bool  # ring collectives may use both directions (wraparound)
    # per-chip bandwidth off the host (GPU box) or slice (TPU), bytes/s one direction: the chip's
    # share of its host's NICs (host egress = dcn_bw * chips_per_host). None: unknown (an
    # explicit null in the YAML, with a note); pricing a layout that crosses hosts then fails
    dcn_bw: float | None
    chips_per_host: int
    ici_latency_s: float = 1e-6  # per hop
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def flops(self, dtype: str) -> float:
        """Peak FLOP/s for a compute dtype; fails naming the dtypes this spec has."""
        value = self.flops_per_s.get(dtype)
        if not value:
            known = ", ".join(k for k, v in self.flops_per_s.items() if v)
            raise SpecError(f"hardware {self.name!r} has no flops_per_s.{dtype} (has: {known})")
        return float(value)


_MODEL_TYPES = {
    "name": str,
    "n_layers": int,
    "d_model": int,
    "d_ff": int,
    "n_heads": int,
    "n_kv_heads": int,
    "head_dim": int,
    "vocab_size": int,
    "tied_embeddings": bool,
    "rope_theta": float,
    "norm_eps": float,
    "max_seq_len": int,
}
_MODEL_OPTIONAL = {
    "n_experts": int,
    "experts_per_token": int,
    "qkv_bias": bool,
    "rope_scaling": dict,
}
_ROPE_SCALING_TYPES = {
    "factor": float,
    "low_freq_factor": float,
    "high_freq_factor": float,
    "original_max_position_embeddings": int,
}
_HARDWARE_TYPES = {
    "name": str,
    "kind": str,
    "flops_per_s": dict,
    "hbm_bytes": float,
    "hbm_bw": float,
    "ici_bw": float,
    "ici_bidirectional": bool,
    "dcn_bw": float,
    "chips_per_host": int,
}
_HARDWARE_OPTIONAL = {"ici_latency_s": float}
_NULLABLE = {"dcn_bw"}  # required keys that may be an explicit null (unknown)
_KINDS = ("tpu", "gpu", "cpu")
_DTYPES = ("bf16", "int8", "fp8", "f32")


def user_config_dir() -> Path:
    """$XDG_CONFIG_HOME/scaletui, else ~/.config/scaletui."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "scaletui"


def local_hardware_path() -> Path:
    """Where `scaletui calibrate` writes the `local` hardware spec."""
    return user_config_dir() / "hardware" / "local.yaml"


def _builtin_dir(kind: str) -> Path:
    return Path(str(resources.files("scaletui.specs") / kind))


def model_names() -> list[str]:
    return sorted(p.stem for p in _builtin_dir("models").glob("*.yaml"))


def hardware_names() -> list[str]:
    names = {p.stem for p in _builtin_dir("hardware").glob("*.yaml")}
    if local_hardware_path().exists():
        names.add("local")
    return sorted(names)


def _resolve(ref: str | os.PathLike, kind: str) -> Path:
    text = os.fspath(ref)
    looks_like_path = text.endswith((".yaml", ".yml")) or os.sep in text
    if looks_like_path:
        path = Path(text).expanduser()
        if not path.is_file():
            raise SpecError(f"{kind} spec file {path} does not exist")
        return path
    if kind == "hardware" and text == "local":
        path = local_hardware_path()
        if not path.is_file():
            raise SpecError(
                f"hardware spec 'local' not found at {path}: run `scaletui calibrate` first"
            )
        return path
    folder = "models" if kind == "model" else "hardware"
    path = _builtin_dir(folder) / f"{text}.yaml"
    if not path.is_file():
        known = model_names() if kind == "model" else hardware_names()
        raise SpecError(f"unknown {kind} spec {text!r}; known: {', '.join(known)}")
    return path


def _read(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SpecError(f"{path}: cannot read YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise SpecError(f"{path}: expected a mapping of keys, got {type(data).__name__}")
    return data


def _coerce(path: Path, key: str, value: object, expected: type) -> object:
    """Check one value's type; ints are accepted for floats (1e9 may be written 1000000000)."""
    if expected is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if expected is float and isinstance(value, str):
        try:
            return float(value)  # YAML reads "1e9" (no dot) as a string
        except ValueError:
            pass
    if expected is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if expected in (str, bool, dict) and isinstance(value, expected):
        return value
    raise SpecError(
        f"{path}: key {key!r} should be {expected.__name__}, got {value!r} ({type(value).__name__})"
    )


def _fields(path: Path, data: dict, required: dict, optional: dict) -> tuple[dict, dict]:
    values = {}
    for key, expected in required.items():
        if key not in data:
            raise SpecError(f"{path}: missing required key {key!r} ({expected.__name__})")
        if data[key] is None and key in _NULLABLE:
            values[key] = None
            continue
        values[key] = _coerce(path, key, data[key], expected)
    for key, expected in optional.items():
        if key in data and data[key] is not None:
            values[key] = _coerce(path, key, data[key], expected)
    extra = {k: v for k, v in data.items() if k not in required and k not in optional}
    return values, extra


def _positive(path: Path, values: dict, keys: list[str]) -> None:
    for key in keys:
        if values[key] is not None and values[key] <= 0:
            raise SpecError(f"{path}: key {key!r} should be > 0, got {values[key]!r}")


def rope_scaling_from(path: Path | str, data: dict) -> RopeScaling:
    """A RopeScaling from its mapping (`rope_type` or `type` must be `llama3`)."""
    kind = data.get("rope_type", data.get("type"))
    if kind != "llama3":
        raise SpecError(
            f"{path}: key 'rope_scaling.rope_type' {kind!r} is not supported (supported: 'llama3')"
        )
    values, _ = _fields(Path(path), data, _ROPE_SCALING_TYPES, {})
    _positive(Path(path), values, list(_ROPE_SCALING_TYPES))
    return RopeScaling(**values)


def load_model(ref: str | os.PathLike) -> ModelSpec:
    """Load a model spec by name (`specs/models/NAME.yaml`), by YAML path, or from a Hugging
    Face checkpoint directory (one holding `config.json`: `hf_config.model_from_hf_config`)."""
    folder = Path(os.fspath(ref)).expanduser()
    if folder.is_dir() and (folder / "config.json").is_file():
        from scaletui.specs.hf_config import spec_mapping

        return model_from_mapping(*spec_mapping(folder))
    if folder.is_dir() and os.sep in os.fspath(ref):
        raise SpecError(f"model directory {folder} has no config.json (expected an HF checkpoint)")
    path = _resolve(ref, "model")
    return model_from_mapping(path, _read(path))


def model_ref(spec: ModelSpec) -> str:
    """The `--model` argument that loads `spec` again: its checkpoint directory (an HF
    config's), else its name."""
    return spec.extra.get("checkpoint_dir") or spec.name


def model_from_mapping(path: Path | str, data: dict) -> ModelSpec:
    """A ModelSpec from a mapping of our keys (a YAML file's, or one mapped from an HF config),
    each checked; `path` names the source in errors."""
    path = Path(path)
    values, extra = _fields(path, data, _MODEL_TYPES, _MODEL_OPTIONAL)
    if "rope_scaling" in values:
        values["rope_scaling"] = rope_scaling_from(path, values["rope_scaling"])
    _positive(path, values, [k for k, t in _MODEL_TYPES.items() if t in (int, float)])
    if values["n_heads"] % values["n_kv_heads"]:
        raise SpecError(
            f"{path}: n_heads ({values['n_heads']}) must be a multiple of "
            f"n_kv_heads ({values['n_kv_heads']})"
        )
    return ModelSpec(**values, extra=extra)


def load_hardware(ref: str | os.PathLike) -> HardwareSpec:
    """Load a hardware spec by name (`specs/hardware/NAME.yaml`, or `local`) or by path."""
    path = _resolve(ref, "hardware")
    values, extra = _fields(path, _read(path), _HARDWARE_TYPES, _HARDWARE_OPTIONAL)
    if values["kind"] not in _KINDS:
        raise SpecError(f"{path}: key 'kind' should be one of {_KINDS}, got {values['kind']!r}")
    flops = {}
    for dtype, value in values["flops_per_s"].items():
        if dtype not in _DTYPES:
            raise SpecError(f"{path}: key 'flops_per_s.{dtype}': expected one of {_DTYPES}")
        flops[dtype] = 0.0 if value is None else _coerce(path, f"flops_per_s.{dtype}", value, float)
    if not any(flops.values()):
        raise SpecError(f"{path}: key 'flops_per_s' needs at least one dtype with a value > 0")
    values["flops_per_s"] = flops
    _positive(path, values, ["hbm_bytes", "hbm_bw", "ici_bw", "dcn_bw", "chips_per_host"])
    if values.get("ici_latency_s", 0.0) < 0:
        raise SpecError(
            f"{path}: key 'ici_latency_s' should be >= 0, got {values['ici_latency_s']!r}"
        )
    return HardwareSpec(**values, extra=extra)


def as_dict(spec: ModelSpec | HardwareSpec) -> dict:
    """The spec as plain YAML-able data (the `extra` keys folded back in)."""
    data = {k: v for k, v in vars(spec).items() if k != "extra"}
    if isinstance(data.get("rope_scaling"), RopeScaling):
        data["rope_scaling"] = vars(data["rope_scaling"]).copy()
    return {**data, **spec.extra}
