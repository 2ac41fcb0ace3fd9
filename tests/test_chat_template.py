"""Chat templates: real models' templates render as transformers renders them, the prompt ids
carry exactly one BOS, and template errors are 400s through the server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scaletui.commands import serve
from scaletui.serve.http.api import TOKENIZER
from scaletui.serve.http.chat_template import (
    ChatTemplateError,
    config_template,
    render_chat,
)
from scaletui.serve.http.testing import fake_server
from scaletui.serve.http.tokenizer import load_tokenizer

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "2+2?"},
]
# What apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) gives, by hand
EXPECTED = {
    "llama3.jinja": (
        "<|begin_of_text|>"
        "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    ),
    "qwen2_chatml.jinja": (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    ),
    "mistral_v0.1.jinja": "<s> [INST] Be brief.\n\nHi! [/INST] Hello.</s> [INST] 2+2? [/INST]",
}
SPECIALS = {  # (bos_token, eos_token) of each model's tokenizer_config.json
    "llama3.jinja": ("<|begin_of_text|>", "<|eot_id|>"),
    "qwen2_chatml.jinja": (None, "<|im_end|>"),  # Qwen2 has no BOS
    "mistral_v0.1.jinja": ("<s>", "</s>"),
}


def _template(name: str) -> str:
    return (TEMPLATES / name).read_text()


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_real_templates_render_as_transformers_does(name: str) -> None:
    assert render_chat(_template(name), CHAT, *SPECIALS[name]) == EXPECTED[name]


def test_generation_prompt_kwargs_and_default_system() -> None:
    llama = render_chat(_template("llama3.jinja"), CHAT[:2], "<s>", add_generation_prompt=False)
    assert llama.endswith("Hi!<|eot_id|>") and llama.count("<s>") == 1
    qwen = render_chat(_template("qwen2_chatml.jinja"), CHAT[1:2])  # Qwen2's default system
    assert qwen.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    template = "{{ greeting }}{% for m in messages %}{% if loop.index > 1 %}{% break %}"
    template += (
        "{% endif %}{{ m.content | tojson }}{% endfor %}{% generation %}!{% endgeneration %}"
    )
    text = render_chat(template, [{"role": "user", "content": "<a&b>"}, CHAT[1]], greeting="hey ")
    assert text == 'hey "<a&b>"!'  # loop controls; tojson does not escape HTML
    assert render_chat("{{ strftime_now('%Y') }}", CHAT)[:2] in ("20", "21")
    assert render_chat("{{ tools is none and documents is none }}", CHAT) == "True"


def test_template_errors_name_the_reason() -> None:
    mistral = _template("mistral_v0.1.jinja")
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render_chat(mistral, [CHAT[1], CHAT[1]], "<s>", "</s>")
    with pytest.raises(ChatTemplateError, match="Only user and assistant roles"):
        render_chat(mistral, [CHAT[1], {"role": "tool", "content": "4"}], "<s>", "</s>")
    with pytest.raises(ChatTemplateError, match="TypeError"):
        render_chat("{{ messages[0].content + 1 }}", CHAT)


def test_config_template_forms(tmp_path) -> None:
    where = tmp_path / "tokenizer_config.json"
    assert config_template({}, where) is None
    assert config_template({"chat_template": "T"}, where) == "T"
    named = [{"name": "tool_use", "template": "U"}, {"name": "default", "template": "D"}]
    assert config_template({"chat_template": named}, where) == "D"
    with pytest.raises(ValueError, match=r"\['tool_use'\] but none named 'default'"):
        config_template({"chat_template": named[:1]}, where)
    with pytest.raises(ValueError, match="must be a string or a list"):
        config_template({"chat_template": 5}, where)


def _hf_dir(path: Path, template: object | None, bos: str | None) -> Path:
    """A tiny tokenizer.json whose post-processor adds BOS (as LLaMA's does), and its
    tokenizer_config.json: encoding with special tokens would double a template's BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    hf.train_from_iterator([m["content"] for m in CHAT] * 5, trainer)
    hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    hf.save(str(path / "tokenizer.json"))
    config: dict = {"bos_token": bos, "eos_token": {"content": "</s>"}}
    if template is not None:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_hf_chat_ids_are_the_rendered_text_with_one_bos(tmp_path) -> None:
    tok = load_tokenizer(
        str(_hf_dir(tmp_path, "{{ bos_token }}" + _template("qwen2_chatml.jinja"), "<s>")), 512
    )
    assert tok.chat_source == "model"
    ids = tok.chat_ids(CHAT)
    text = "<s>" + EXPECTED["qwen2_chatml.jinja"]
    assert ids == tok.encode(text) and ids.count(tok.bos_id) == 1 and ids[0] == tok.bos_id
    assert ids.count(2) == 5 and ids.count(3) == 4  # the markers are single special ids
    assert tok.decode(ids) == text.replace("<s>", "").replace("<|im_start|>", "").replace(
        "<|im_end|>", ""
    )  # special tokens skipped on decode


def test_model_sidecar_fallback_and_override(tmp_path) -> None:
    (tmp_path / "m").mkdir()
    tok = load_tokenizer(str(_hf_dir(tmp_path / "m", None, "<s>")), 512)
    assert tok.chat_source == "llama3 fallback"
    ids = tok.chat_ids(CHAT[1:2])  # the fallback: BOS by id, then the LLaMA-3 markup
    assert ids == [tok.bos_id, *tok.encode(tok.apply_chat_template(CHAT[1:2]))]
    (tmp_path / "m" / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0].content }}")
    tok = load_tokenizer(str(tmp_path / "m"), 512)  # the sidecar file, as transformers reads it
    assert tok.chat_source == "model" and tok.chat_ids(CHAT[1:2]) == tok.encode("<s>Hi!")
    (tmp_path / "m" / "chat_template.jinja").write_text("{% if %}")
    with pytest.raises(ValueError, match=r"chat_template.jinja is not valid Jinja: line 1"):
        load_tokenizer(str(tmp_path / "m"), 512)
    good = tmp_path / "t.jinja"
    good.write_text("{{ eos_token }}")
    tok = load_tokenizer(str(tmp_path / "m"), 512, str(good))  # overrides the broken model one
    assert tok.chat_source == f"file {good}" and tok.chat_ids(CHAT) == tok.encode("</s>")
    with pytest.raises(ValueError, match="cannot read the chat template file /nonexistent.jinja"):
        load_tokenizer(None, 512, "/nonexistent.jinja")


def test_serve_refuses_a_bad_chat_template_file_before_binding(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    assert serve.main(["--model", "tiny", "--fake", "--chat-template", str(bad)]) == 2
    assert f"chat template from file {bad} is not valid Jinja" in capsys.readouterr().err


async def test_template_through_the_server_and_errors_are_400() -> None:
    async with fake_server() as (client, _):
        assert (await (await client.get("/stats")).json())["chat_template"] == "llama3 fallback"
        tok = client.server.app[TOKENIZER]
        tok.chat_template = load_tokenizer(
            None, 512, str(TEMPLATES / "mistral_v0.1.jinja")
        ).chat_template
        assert (await (await client.get("/stats")).json())["chat_template"].startswith("file ")
        body = {"messages": [CHAT[1], CHAT[1]], "max_tokens": 2}
        r = await client.post("/v1/chat/completions", json=body)
        err = (await r.json())["error"]
        assert r.status == 400 and err["param"] == "messages", err
        assert err["code"] == "chat_template_error" and "roles must alternate" in err["message"]
        parts = [{"type": "text", "text": "ab"}, {"text": "c"}]  # joined by "\n", as vLLM does
        body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 3}
        r = await client.post("/v1/chat/completions", json=body | {"temperature": 0})
        full = await r.json()
        # " [INST] ab\nc [/INST]" in bytes (the byte tokenizer has no BOS text): the fake
        # engine continues from the last byte, "]"
        assert full["usage"]["prompt_tokens"] == len(" [INST] ab\nc [/INST]"), full
        assert full["choices"][0]["message"]["content"] == "^_`"
        image = {"type": "image_url", "image_url": {"url": "x"}}
        body = {"messages": [{"role": "user", "content": [image]}]}
        err = (await (await client.post("/v1/chat/completions", json=body)).json())["error"]
        assert err["param"] == "messages[0].content[0].type" and "'image_url'" in err["message"]
        body = {"messages": [CHAT[1]], "chat_template_kwargs": []}
        err = (await (await client.post("/v1/chat/completions", json=body)).json())["error"]
        assert err["param"] == "chat_template_kwargs", err
