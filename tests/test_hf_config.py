"""HF config.json -> ModelSpec: released LLaMA-3.1/3.2, Mistral and Qwen2 configs (their keys
and values are facts, copied from the hub), transformers 5's `rope_parameters`, EOS ids, and
an error naming the field for everything the model code does not compute."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scaletui.specs import RopeScaling, SpecError, as_dict, load_model, model_ref
from scaletui.specs.hf_config import eos_ids

LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.42.3",
    "use_cache": True,
    "vocab_size": 128256,
}
MISTRAL_7B_V03 = {
    "architectures": ["MistralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 32768,
}
QWEN2_05B = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "max_position_embeddings": 131072,
    "max_window_layers": 24,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def write(folder: Path, config: dict, name: str = "config.json") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(config))
    return folder


def test_llama31_maps_with_its_rope_scaling(tmp_path) -> None:
    folder = write(tmp_path / "Llama-3.1-8B-Instruct", LLAMA31_8B)
    m = load_model(str(folder))  # any --model taker goes through load_model
    assert (m.name, m.n_layers, m.d_model, m.d_ff) == ("Llama-3.1-8B-Instruct", 32, 4096, 14336)
    assert (m.n_heads, m.n_kv_heads, m.head_dim, m.vocab_size) == (32, 8, 128, 128256)
    assert (m.rope_theta, m.norm_eps, m.max_seq_len) == (500000.0, 1e-5, 131072)
    assert not m.tied_embeddings and not m.qkv_bias
    assert m.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
    assert m.extra["checkpoint_dir"] == str(folder.resolve()) == model_ref(m)
    assert load_model(model_ref(m)) == m  # the shape's JSON and flags reload it
    assert as_dict(m)["rope_scaling"]["factor"] == 8.0
    # the shipped llama3-8b spec prices the same model
    assert m.d_ff == load_model("llama3-8b").d_ff


def test_mistral_and_qwen2(tmp_path) -> None:
    m = load_model(write(tmp_path / "mistral", MISTRAL_7B_V03))
    assert (m.vocab_size, m.rope_theta, m.head_dim, m.rope_scaling) == (32768, 1e6, 128, None)
    q = load_model(write(tmp_path / "qwen2", QWEN2_05B))
    assert q.qkv_bias and q.tied_embeddings  # Qwen2: q/k/v biases always
    assert (q.d_model, q.n_heads, q.n_kv_heads, q.head_dim, q.norm_eps) == (896, 14, 2, 64, 1e-6)


def test_defaults_and_transformers5_rope_parameters(tmp_path) -> None:
    cfg = {k: v for k, v in LLAMA31_8B.items() if k not in ("rope_scaling", "rope_theta")}
    del cfg["num_key_value_heads"]  # absent: multi-head attention (K = N)
    cfg["rope_parameters"] = {**LLAMA31_8B["rope_scaling"], "rope_theta": 500000.0}
    m = load_model(write(tmp_path / "v5", cfg))
    assert m.n_kv_heads == 32 and m.rope_theta == 500000.0 and m.rope_scaling.factor == 8.0
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    m = load_model(write(tmp_path / "v5", cfg))
    assert m.rope_scaling is None and m.rope_theta == 10000.0


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"architectures": ["GemmaForCausalLM"]}, "'architectures' ['GemmaForCausalLM']"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'rope_scaling.rope_type' 'yarn'"),
        ({"hidden_act": "gelu"}, "'hidden_act' 'gelu' is not supported (supported: 'silu')"),
        ({"mlp_bias": True}, "'mlp_bias' True"),
        ({"attention_bias": True}, "'attention_bias' True"),
        ({"sliding_window": 4096}, "'sliding_window' 4096"),  # Mistral v0.1
        ({"quantization_config": {"quant_method": "awq"}}, "quant_method' 'awq'"),
        ({"hidden_size": 4097, "head_dim": None}, "hidden_size (4097) is not a multiple"),
        ({"num_key_value_heads": 5}, "n_heads (32) must be a multiple of n_kv_heads (5)"),
        ({"vocab_size": None}, "missing required key 'vocab_size'"),
    ],
)
def test_unsupported_fields_are_named(tmp_path, change, named) -> None:
    folder = write(tmp_path / "bad", {**LLAMA31_8B, **change})
    with pytest.raises(SpecError) as e:
        load_model(str(folder))
    assert named in str(e.value) and "config.json" in str(e.value)


def test_qwen2_sliding_window_only_when_used(tmp_path) -> None:
    on = {**QWEN2_05B, "use_sliding_window": True, "sliding_window": 4096}
    with pytest.raises(SpecError, match="'sliding_window' 4096"):
        load_model(write(tmp_path / "q", on))
    window = {**MISTRAL_7B_V03, "sliding_window": 32768}  # no shorter than the context: full
    assert load_model(write(tmp_path / "m", window)).max_seq_len == 32768


def test_eos_ids_from_generation_config_else_config(tmp_path) -> None:
    folder = write(tmp_path / "m", LLAMA31_8B)
    assert eos_ids(folder) == (128001, 128008, 128009)
    write(folder, {"eos_token_id": 128009}, "generation_config.json")
    assert eos_ids(folder) == (128009,)
    write(folder, {"eos_token_id": ["x"]}, "generation_config.json")
    with pytest.raises(SpecError, match="eos_token_id"):
        eos_ids(folder)
    assert eos_ids(write(tmp_path / "none", {})) == ()


def test_a_directory_without_config_is_named(tmp_path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecError, match="has no config.json"):
        load_model(str(tmp_path / "empty"))
    assert load_model("tiny").name == "tiny"  # spec names keep working
