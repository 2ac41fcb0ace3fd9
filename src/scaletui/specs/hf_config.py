"""A Hugging Face checkpoint directory's `config.json` mapped to our model spec's keys, and its
EOS ids (`specs.load_model(DIR)` builds the ModelSpec).

LLaMA (2, 3, 3.1, 3.2), Mistral and Qwen2 decoders map one to one onto the spec: GQA, SwiGLU,
RMSNorm, rotate-half RoPE (plain, or LLaMA-3.1's `llama3` scaling), tied or untied embeddings,
Qwen2's q/k/v biases. Anything the model code would silently compute differently (another
architecture or activation, another rope type, a sliding window shorter than the context, MLP
or output-projection biases, a pre-quantized checkpoint) is a SpecError naming the field, its
value and what is supported. Both spellings of RoPE settings are read: `rope_theta` /
`rope_scaling` (transformers 4) and `rope_parameters` (transformers 5).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from scaletui.specs.errors import SpecError

# architecture -> whether its q/k/v projections always carry biases
ARCHITECTURES = {"LlamaForCausalLM": False, "MistralForCausalLM": False, "Qwen2ForCausalLM": True}
_ROPE_TYPES = ("default", "llama3")
# our key -> the config.json key it is read from, where that has no default
_REQUIRED = {
    "n_layers": "num_hidden_layers",
    "d_model": "hidden_size",
    "d_ff": "intermediate_size",
    "n_heads": "num_attention_heads",
    "head_dim": "head_dim",
    "vocab_size": "vocab_size",
}


def read_json(path: Path) -> dict:
    """A JSON object from `path`; a file that is not one is a SpecError naming it."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SpecError(f"{path}: cannot read JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise SpecError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _unsupported(path: Path, key: str, value: object, supported: str) -> SpecError:
    return SpecError(f"{path}: key {key!r} {value!r} is not supported (supported: {supported})")


def _architecture(path: Path, cfg: dict) -> str:
    archs = cfg.get("architectures")
    if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise _unsupported(path, "architectures", archs, ", ".join(ARCHITECTURES))
    return archs[0]


def _rope(path: Path, cfg: dict) -> tuple[object, dict | None]:
    """(rope_theta, the llama3 scaling mapping or None) from either spelling."""
    params = cfg.get("rope_parameters")  # transformers >= 5: theta and scaling in one mapping
    theta, scaling = cfg.get("rope_theta"), cfg.get("rope_scaling")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        scaling = scaling or params
    key = "rope_parameters" if isinstance(params, dict) else "rope_scaling"
    if scaling is None:
        return (10000.0 if theta is None else theta), None
    if not isinstance(scaling, dict):
        raise SpecError(f"{path}: key {key!r} should be a mapping, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in _ROPE_TYPES:
        raise _unsupported(path, f"{key}.rope_type", kind, ", ".join(map(repr, _ROPE_TYPES)))
    return (10000.0 if theta is None else theta), (None if kind == "default" else scaling)


def _check_attention(path: Path, cfg: dict, arch: str, max_pos: object) -> None:
    """Sliding windows (Mistral v0.1; Qwen2 with use_sliding_window) shorter than the context."""
    window = cfg.get("sliding_window")
    if arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
        window = None  # Qwen2 configs carry a window that is off unless use_sliding_window
    if window is not None and (not isinstance(max_pos, int) or window < max_pos):
        raise _unsupported(
            path,
            "sliding_window",
            window,
            f"none, or one >= max_position_embeddings ({max_pos}): only full causal attention",
        )
    layer_types = cfg.get("layer_types") or ()
    if arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
        layer_types = ()
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
        raise _unsupported(path, "layer_types", other, "'full_attention' only")


def _check_unsupported(path: Path, cfg: dict, arch: str) -> None:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise _unsupported(path, "hidden_act", act, "'silu'")
    if cfg.get("mlp_bias"):
        raise _unsupported(path, "mlp_bias", cfg["mlp_bias"], "false")
    if not ARCHITECTURES[arch] and cfg.get("attention_bias"):
        # LLaMA's attention_bias also puts a bias on o_proj, which our model has no place for
        raise _unsupported(
            path, "attention_bias", cfg["attention_bias"], "false (q/k/v-only biases: Qwen2)"
        )
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "?")
        raise _unsupported(
            path, "quantization_config.quant_method", method, "none: float weights (bf16/f16/f32)"
        )


def spec_mapping(folder: str | os.PathLike) -> tuple[Path, dict]:
    """(config.json's path, the model spec's keys) of an HF LLaMA / Mistral / Qwen2 checkpoint
    directory, for `specs.model_from_mapping` (which checks each value): named by the
    directory, which `checkpoint_dir` keeps (absolute) for the weights and reloads."""
    folder = Path(os.fspath(folder)).expanduser().resolve()
    path = folder / "config.json"
    cfg = read_json(path)
    arch = _architecture(path, cfg)
    _check_unsupported(path, cfg, arch)
    max_pos = cfg.get("max_position_embeddings", 2048)
    _check_attention(path, cfg, arch, max_pos)
    heads = cfg.get("num_attention_heads")
    hidden = cfg.get("hidden_size")
    head_dim = cfg.get("head_dim")
    if head_dim is None and isinstance(heads, int) and isinstance(hidden, int) and heads > 0:
        if hidden % heads:
            raise SpecError(
                f"{path}: hidden_size ({hidden}) is not a multiple of num_attention_heads "
                f"({heads}) and no head_dim is given"
            )
        head_dim = hidden // heads
    theta, scaling = _rope(path, cfg)
    kv_heads = cfg.get("num_key_value_heads")
    data = {
        "name": folder.name,
        "n_layers": cfg.get("num_hidden_layers"),
        "d_model": hidden,
        "d_ff": cfg.get("intermediate_size"),
        "n_heads": heads,
        "n_kv_heads": heads if kv_heads is None else kv_heads,
        "head_dim": head_dim,
        "vocab_size": cfg.get("vocab_size"),
        "tied_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "rope_theta": theta,
        "norm_eps": cfg.get("rms_norm_eps", 1e-6),
        "max_seq_len": max_pos,
        "qkv_bias": ARCHITECTURES[arch],  # LLaMA's attention_bias is refused above
        "checkpoint_dir": str(folder),
        "architecture": arch,
    }
    for ours, key in _REQUIRED.items():
        if data[ours] is None:
            raise SpecError(f"{path}: missing required key {key!r}")
    if scaling is not None:
        data["rope_scaling"] = scaling
    return path, data


def eos_ids(folder: str | os.PathLike) -> tuple[int, ...]:
    """The EOS ids of a checkpoint directory: `eos_token_id` (an int or a list) from
    generation_config.json, else config.json; () when neither names one."""
    folder = Path(os.fspath(folder)).expanduser()
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        if not path.is_file():
            continue
        value = read_json(path).get("eos_token_id")
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        if not ids or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
        ):
            raise SpecError(
                f"{path}: key 'eos_token_id' should be a token id or a list of them, got {value!r}"
            )
        return tuple(dict.fromkeys(ids))
    return ()
