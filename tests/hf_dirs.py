"""Test helper: an HF checkpoint directory written by our own tools (no `transformers`).

`write_checkpoint(folder, spec)` writes what `save_pretrained` would for a LLaMA model: a
config.json for `spec`, seeded dummy weights as safetensors (one file or sharded with an index),
a small byte-level BPE tokenizer.json with `<s>`/`</s>`, and, when given, a
generation_config.json with its EOS ids.
"""

from __future__ import annotations

import json
from pathlib import Path

from scaletui.serve.weights import checkpoint, weights
from scaletui.specs import ModelSpec

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "tokens and more tokens"]


def hf_config(spec: ModelSpec, arch: str = "LlamaForCausalLM", **extra) -> dict:
    """The config.json `transformers` writes for `spec` (LLaMA keys)."""
    return {
        "architectures": [arch],
        "model_type": {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}.get(arch, "x"),
        "hidden_size": spec.d_model,
        "intermediate_size": spec.d_ff,
        "num_hidden_layers": spec.n_layers,
        "num_attention_heads": spec.n_heads,
        "num_key_value_heads": spec.n_kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "tie_word_embeddings": spec.tied_embeddings,
        "rope_theta": spec.rope_theta,
        "rms_norm_eps": spec.norm_eps,
        "max_position_embeddings": spec.max_seq_len,
        "hidden_act": "silu",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "float32",
        **extra,
    }


def write_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    hf.train_from_iterator(TEXTS * 20, trainer)
    hf.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"})
    )


def write_checkpoint(
    folder: Path,
    spec: ModelSpec,
    seed: int = 0,
    *,
    shards: int = 1,
    eos: list[int] | None = None,
    **config,
) -> dict:
    """A checkpoint directory for `spec` with dummy weights of `seed`; returns the params."""
    folder.mkdir(parents=True, exist_ok=True)
    params = weights.dummy_params(spec, seed)
    checkpoint.save_safetensors(params, spec, folder, shards=shards)
    (folder / "config.json").write_text(json.dumps(hf_config(spec, **config), indent=1))
    write_tokenizer(folder)
    if eos is not None:
        gen = {"bos_token_id": 0, "eos_token_id": eos}
        (folder / "generation_config.json").write_text(json.dumps(gen))
    return params
