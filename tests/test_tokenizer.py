"""Tokenizer: byte round trips, streaming decode that never splits a character, HF json."""

from __future__ import annotations

import json

import pytest

from scaletui.serve.http.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

TEXTS = ["hello", "héllo wörld", "日本語のテキスト", "emoji 🙂🚀 mixed ascii", "a\nb\tc"]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_round_trip_and_streaming_concatenates(text: str) -> None:
    tok = load_tokenizer(None, 512)
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) and tok.decode(ids) == text
    dec = tok.decoder()
    pieces = [dec.push(i) for i in ids]
    assert "".join(pieces) + dec.flush() == text
    assert all("\ufffd" not in p for p in pieces)  # no half characters leak out


def test_byte_specials_and_vocab() -> None:
    tok = ByteTokenizer()
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (256, 257, 259)
    assert tok.decode([tok.bos_id, 104, 105, tok.eos_id]) == "hi"
    with pytest.raises(ValueError, match="vocab_size >= 259, got 100"):
        load_tokenizer(None, 100)
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer("/nonexistent/tokenizer.json", 512)


def test_multibyte_character_held_back_until_complete() -> None:
    dec = ByteTokenizer().decoder()
    first, second, third, fourth = "🙂".encode()
    assert [dec.push(first), dec.push(second), dec.push(third)] == ["", "", ""]
    assert dec.push(fourth) == "🙂"


def test_chat_template_orders_roles_and_ends_with_assistant_header() -> None:
    tok = ByteTokenizer()
    text = tok.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    )
    assert text.index("system") < text.index("be brief") < text.index("user") < text.index("hi")
    assert text == "<|system|>\nbe brief<|eot|>\n<|user|>\nhi<|eot|>\n<|assistant|>\n"
    hf_style = Tokenizer.apply_chat_template(tok, [{"role": "user", "content": "hi"}])
    assert hf_style.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_hf_tokenizer_json(tmp_path) -> None:
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
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}})
    )
    tok = load_tokenizer(str(tmp_path), 512)
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    assert tok.vocab_size == hf.get_vocab_size()
    for text in [*TEXTS, "unseen: ünïcødé 🚀🧪 字"]:  # unseen text splits characters into bytes
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        dec = tok.decoder()
        assert "".join(dec.push(i) for i in ids) + dec.flush() == text
    small = load_tokenizer(str(tmp_path / "tokenizer.json"), 200)
    assert small.vocab_size == 200  # never beyond the model's vocabulary
