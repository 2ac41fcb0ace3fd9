"""OpenAI logprobs objects from the engine's `TokenLogprobs`, one burst of tokens at a time.

Completions (`openai.types.completion_choice.Logprobs`): {"tokens", "token_logprobs",
"top_logprobs" ({token text: logprob}: the top k and the chosen token, so up to k + 1 entries,
as OpenAI and vLLM give them; ids that share a text, like lone UTF-8 bytes, share one key, the
likeliest's value), "text_offset"}; an echoed prompt's first token has None for its logprob
and its top. Chat (`openai.types.chat.ChatCompletionTokenLogprob`): {"content":
[{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}] (the top k)}]}. A value below
-9999 (an id the tokenizer cannot produce) is written as -9999.0, OpenAI's "very unlikely".
"""

from __future__ import annotations

from collections.abc import Sequence

from scaletui.serve.engine.engine_api import TokenLogprobs
from scaletui.serve.http.tokenizer import Tokenizer

FLOOR = -9999.0  # OpenAI's value for a token far outside the top candidates
KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")  # completions' lists


def _value(x: float) -> float:
    return max(x, FLOOR)


class LogprobWriter:
    """One request's logprobs: `add` turns a burst into its chunk's object and keeps it for
    `total` (the non-streamed answer). Completions' `text_offset` runs on across bursts, from
    the echoed prompt's text on."""

    def __init__(self, tok: Tokenizer, chat: bool) -> None:
        self.tok, self.chat = tok, chat
        self.offset = 0  # completions: characters of token text written so far
        self._texts: dict[int, bytes] = {}
        self._parts: list[dict] = []

    def _bytes(self, token_id: int) -> bytes:
        b = self._texts.get(token_id)
        if b is None:
            b = self._texts[token_id] = self.tok.token_bytes(token_id)
        return b

    def _text(self, token_id: int) -> str:
        return self._bytes(token_id).decode("utf-8", errors="replace")

    def add(self, ids: Sequence[int], lps: Sequence[TokenLogprobs | None]) -> dict:
        """The logprobs object of `ids` (each with its entry; None: an echoed first token)."""
        assert len(ids) == len(lps), (len(ids), len(lps))
        part = self._chat(ids, lps) if self.chat else self._completion(ids, lps)
        self._parts.append(part)
        return part

    def total(self) -> dict:
        """Every burst's object joined, as a non-streamed answer carries them."""
        if self.chat:
            return {"content": [e for p in self._parts for e in p["content"]]}
        return {k: [x for p in self._parts for x in p[k]] for k in KEYS}

    def _completion(self, ids: Sequence[int], lps: Sequence[TokenLogprobs | None]) -> dict:
        out: dict[str, list] = {k: [] for k in KEYS}
        for token_id, lp in zip(ids, lps, strict=True):
            text = self._text(token_id)
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
            if lp is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            top: dict[str, float] = {}
            for i, v in (*lp.top, (token_id, lp.logprob)):  # the chosen token is always there
                top.setdefault(self._text(i), _value(v))  # a shared text: the likeliest id's
            out["token_logprobs"].append(_value(lp.logprob))
            out["top_logprobs"].append(top)
        return out

    def _chat(self, ids: Sequence[int], lps: Sequence[TokenLogprobs | None]) -> dict:
        content = []
        for token_id, lp in zip(ids, lps, strict=True):
            assert lp is not None, "chat has no echoed prompt"
            entry = self._entry(token_id, lp.logprob)
            entry["top_logprobs"] = [self._entry(i, v) for i, v in lp.top]
            content.append(entry)
        return {"content": content}

    def _entry(self, token_id: int, logprob: float) -> dict:
        b = self._bytes(token_id)
        text = b.decode("utf-8", errors="replace")
        return {"token": text, "logprob": _value(logprob), "bytes": list(b)}
