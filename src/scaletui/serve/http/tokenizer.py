"""Text <-> token ids: a byte tokenizer (default, no downloads) or an HF tokenizer.json.

`load_tokenizer(None, model_vocab)` gives ids 0-255 for bytes plus BOS/EOS specials (vocab 259);
`load_tokenizer("tokenizer.json", model_vocab)` wraps the `tokenizers` library. Streaming goes
through `decoder()`, whose `push(id)` returns only newly completed text, holding back partial
UTF-8, so the streamed pieces concatenate to the full decode. `chat_ids` turns chat messages
into prompt ids: the model's Jinja chat template (chat_template.py) when it has one or
`--chat-template` names one, else LLaMA-3's markup (the fallback for our own spec models).
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path

from scaletui.serve.http.chat_template import (
    FALLBACK,
    ChatTemplate,
    compiled,
    model_template,
    read_template,
    token_text,
)

# LLaMA-3's chat markup, as text: with the byte tokenizer it is plain bytes; an HF LLaMA-3
# tokenizer.json maps the markers to its special ids.
_HEADER = "<|start_header_id|>{role}<|end_header_id|>\n\n"
_EOT = "<|eot_id|>"
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
_EOS_NAMES = ("<|eot_id|>", "<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>")


class IncrementalDecoder:
    """Turns a stream of ids into text pieces; never splits a multi-byte character.

    HF tokenizers decode a short window (vLLM's prefix/read offsets): the text of
    ids[prefix:] minus that of ids[prefix:read], so each push costs O(window), not O(length),
    and decoders that treat the first token specially (a leading "▁") see context.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = self._read = 0
        self._bytes = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Text completed by this token ("" while a character is still partial)."""
        if isinstance(self._tok, ByteTokenizer):
            return self._bytes.decode(self._tok.token_bytes(token_id))
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever is still held back (a dangling partial character decodes as U+FFFD)."""
        if isinstance(self._tok, ByteTokenizer):
            return self._bytes.decode(b"", final=True)
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        seen = self._tok.decode(self._ids[self._prefix : self._read])
        text = self._tok.decode(self._ids[self._prefix :])
        if len(text) <= len(seen) or (text.endswith("\ufffd") and not final):
            return ""  # nothing new, or a partial character: wait for the rest
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(seen) :]


class Tokenizer:
    """The interface the API uses; see `ByteTokenizer` and `HFTokenizer`."""

    bos_id: int
    eos_id: int
    vocab_size: int  # ids this tokenizer can decode; the engine never samples beyond
    chat_template: ChatTemplate | None = None  # None: the LLaMA-3 markup of apply_chat_template

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def decoder(self) -> IncrementalDecoder:
        return IncrementalDecoder(self)

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own bytes, as logprobs show it (special tokens by their name)."""
        return self.decode([token_id]).encode()

    def special_texts(self) -> tuple[str | None, str | None]:
        """(bos_token, eos_token) as a chat template prints them; None: no text form."""
        return None, None

    @property
    def chat_source(self) -> str:
        """Which chat template is in use: "model", "file PATH" or "llama3 fallback"."""
        return self.chat_template.source if self.chat_template else FALLBACK

    def chat_ids(self, messages: list[dict], **kw) -> list[int]:
        """The prompt ids of a chat. With a Jinja template: its text encoded with no special
        tokens added, the ids of transformers' `apply_chat_template(messages, tokenize=True,
        add_generation_prompt=True)`; `kw` are template variables (chat_template_kwargs).
        Without: BOS, then the LLaMA-3 markup (`kw` unused). Raises ChatTemplateError."""
        if self.chat_template is not None:
            return self.encode(self.chat_template.render(messages, **kw))
        bos = [self.bos_id] if self.bos_id >= 0 else []
        return bos + self.encode(self.apply_chat_template(messages))

    def apply_chat_template(self, messages: list[dict]) -> str:
        """The fallback markup, LLaMA-3 style: one header + content + end-of-turn per
        message, then the assistant's header."""
        parts = []
        for m in messages:
            parts.append(_HEADER.format(role=m["role"]) + str(m.get("content") or "") + _EOT)
        parts.append(_HEADER.format(role="assistant"))
        return "".join(parts)


class ByteTokenizer(Tokenizer):
    """ids 0-255 are the UTF-8 bytes; 256 BOS, 257 EOS, 258 PAD."""

    def __init__(self) -> None:
        self.bos_id, self.eos_id, self.pad_id = 256, 257, 258
        self.vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def apply_chat_template(self, messages: list[dict]) -> str:
        """LLaMA-3's shape in short markers: every byte of markup costs a token here."""
        turns = "".join(f"<|{m['role']}|>\n{m.get('content') or ''}<|eot|>\n" for m in messages)
        return turns + "<|assistant|>\n"

    def token_bytes(self, token_id: int) -> bytes:
        return bytes((token_id,)) if 0 <= token_id < 256 else b""

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer(Tokenizer):
    """A `tokenizers` tokenizer.json; BOS/EOS from tokenizer_config.json beside it, else by name."""

    def __init__(self, path: Path, model_vocab: int, read_model_template: bool = True) -> None:
        from tokenizers import Tokenizer as _HF

        self._tok = _HF.from_file(str(path))
        self.vocab_size = min(self._tok.get_vocab_size(with_added_tokens=True), model_vocab)
        config = _read_config(path.parent / "tokenizer_config.json")
        self._texts = (token_text(config.get("bos_token")), token_text(config.get("eos_token")))
        self.bos_id = self._special(self._texts[0], _BOS_NAMES)
        self.eos_id = self._special(self._texts[1], _EOS_NAMES)
        found = model_template(path.parent, config) if read_model_template else None
        if found is not None:
            text, where = found
            self.chat_template = compiled(text, "model", *self._texts, where=where)

    def special_texts(self) -> tuple[str | None, str | None]:
        return self._texts

    def _special(self, configured: str | None, names: tuple[str, ...]) -> int:
        for name in ((configured,) if configured is not None else ()) + names:
            token_id = self._tok.token_to_id(name)
            if token_id is not None and token_id < self.vocab_size:
                return token_id
        return -1  # none: generation then stops only on max_tokens / stop strings

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        return self._tok.decode([token_id], skip_special_tokens=False).encode()


def _read_config(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def load_tokenizer(
    path: str | None, vocab_size: int, chat_template: str | None = None
) -> Tokenizer:
    """The byte tokenizer when `path` is None, else the HF tokenizer.json at `path`.

    `vocab_size` is the model's vocabulary: the tokenizer must fit in it. `chat_template`, a
    Jinja file, overrides the model's template (`--chat-template`); it must read and compile.
    """
    if path is None:
        tok: Tokenizer = ByteTokenizer()
        if vocab_size < tok.vocab_size:
            raise ValueError(
                f"the byte tokenizer needs a model vocab_size >= {tok.vocab_size}, got {vocab_size}"
            )
    else:
        file = Path(path).expanduser()
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise ValueError(
                f"tokenizer file {file} does not exist (expected an HF tokenizer.json)"
            )
        tok = HFTokenizer(file, vocab_size, read_model_template=chat_template is None)
    if chat_template is not None:
        source = f"file {chat_template}"
        text = read_template(Path(chat_template).expanduser(), source)
        tok.chat_template = compiled(text, source, *tok.special_texts())
    return tok
