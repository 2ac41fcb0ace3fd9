"""Exact prompt lengths: a token counter (an HF tokenizer.json, or a server's /tokenize) and
`fit`, which makes a text exactly N tokens long by re-encoding it.

A counter counts as the server does for a completions prompt: `count(text)` includes the
special tokens the tokenizer's post-processor adds (a BOS), `ids(text)` does not. Filler text is
made of whole-word tokens (" word" pieces that encode to themselves), so joined pieces keep
their sum and a shared block of text stays shared; `fit` then corrects what merges at the edges.
"""

from __future__ import annotations

import functools
import re
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import orjson

SERVER = "server"  # --tokenizer server: the server's own /tokenize
FIT_ROUNDS = 16  # re-encode rounds before giving up on an exact length
# Filler for counters whose vocabulary cannot be listed (a server's /tokenize): common words,
# one token each in the large vocabularies of served models.
WORDS = (  # noqa: SIM905 (as a list literal, 140 words fill a page)
    "the of and to in is was for on are with as by at be this from or have an they which one "
    "you were all we her she there would their will when who him been has more if no out do so "
    "can what up said about other into than its time only could new them man some these then "
    "two first may any like now my such make over our even most after also did many before must "
    "through back years where much your way well down should because each just those people how "
    "too little state good very world still own see men work long get here between both life "
    "being under never day same another know while last might us great old year off come since "
    "against go came right used take three"
).split()
_WORD = re.compile(r"^ [a-z]{2,12}$")


class TokenCounter:
    """Counts tokens the way a server would; see HFCounter and ServerCounter."""

    name: str  # where the tokenizer came from, for the report

    def count(self, text: str) -> int:
        """Prompt tokens of `text`, special tokens included."""
        raise NotImplementedError

    def ids(self, text: str) -> list[int]:
        """Token ids of `text` alone (no special tokens)."""
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    @functools.cached_property
    def pool(self) -> list[str]:
        """Filler pieces: " word" strings that encode to one token each (or to a few)."""
        return [" " + w for w in WORDS]


class HFCounter(TokenCounter):
    """A `tokenizers` tokenizer.json (the file, or an HF model directory that holds it)."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        file = Path(path).expanduser()
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise ValueError(
                f"--tokenizer {path}: {file} does not exist (expected an HF tokenizer.json, "
                "a model directory holding one, or 'server')"
            )
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as exc:  # tokenizers raises a bare Exception for a bad file
            raise ValueError(f"--tokenizer {path}: {file} does not load: {exc}") from None
        self.name = str(file)

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=True).ids)

    def ids(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    @functools.cached_property
    def pool(self) -> list[str]:
        """The vocabulary's own whole-word tokens, so filler looks like the model's text."""
        words = []
        for token_id in range(self._tok.get_vocab_size(with_added_tokens=False)):
            piece = self._tok.decode([token_id])
            if _WORD.match(piece) and self.ids(piece) == [token_id]:
                words.append(piece)
        return words if len(words) >= 64 else TokenCounter.pool.func(self)


class ServerCounter(TokenCounter):
    """The server's own tokenizer over vLLM's POST /tokenize and /detokenize. Blocking calls:
    prompts are made before the run (Runner), later conversation turns off the loop."""

    def __init__(self, url: str, model: str | None = None) -> None:
        self.base, self.model, self.name = url.rstrip("/"), model, f"{url} /tokenize"
        try:
            self._post("/tokenize", {"prompt": "hello"})
        except urllib.error.HTTPError as exc:
            raise ValueError(
                f"--tokenizer server: {self.base}/tokenize answered HTTP {exc.code}; this "
                "server cannot count tokens (scaletui serve has no /tokenize): give --tokenizer "
                "PATH to the server's tokenizer.json"
            ) from None
        except (urllib.error.URLError, OSError) as exc:
            raise ValueError(
                f"--tokenizer server: cannot reach {self.base}/tokenize: {exc}"
            ) from None

    def _post(self, path: str, body: dict) -> dict:
        if self.model:
            body = {"model": self.model, **body}
        req = urllib.request.Request(
            self.base + path, orjson.dumps(body), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            return orjson.loads(resp.read())

    def count(self, text: str) -> int:
        return len(self._post("/tokenize", {"prompt": text, "add_special_tokens": True})["tokens"])

    def ids(self, text: str) -> list[int]:
        return self._post("/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]

    def decode(self, ids: list[int]) -> str:
        return self._post("/detokenize", {"tokens": ids})["prompt"]


@functools.lru_cache(maxsize=8)
def load_counter(spec: str, model: str | None = None) -> TokenCounter:
    """The counter for --tokenizer: an http(s) URL is a server's /tokenize, else a path."""
    if spec.startswith(("http://", "https://")):
        return ServerCounter(spec, model)
    return HFCounter(spec)


def filler(counter: TokenCounter, rng: np.random.Generator, n: int) -> str:
    """About n tokens of whole-word filler (exactly n where each piece is one token)."""
    pool = counter.pool
    return "".join(pool[i] for i in rng.integers(0, len(pool), size=max(n, 0)))


def fit(
    counter: TokenCounter, rng: np.random.Generator, text: str, total: int, keep: int = 0
) -> str:
    """`text` grown with filler or cut at its end until `counter.count` is exactly `total`;
    its first `keep` characters stay as they are (a shared prefix stays shared)."""
    for _ in range(FIT_ROUNDS):
        diff = total - counter.count(text)
        if diff == 0:
            return text
        if diff > 0:
            text += filler(counter, rng, diff)
        else:
            tail = counter.ids(text[keep:])
            text = text[:keep] + counter.decode(tail[: max(0, len(tail) + diff)])
    for _ in range(FIT_ROUNDS):  # multi-token words overshoot by more than one: single letters
        diff = total - counter.count(text)
        if diff == 0:
            return text
        if diff > 0:
            text += "".join(" " + chr(97 + i) for i in rng.integers(0, 26, size=diff))
        elif len(text) > keep:
            text = text[:-1]
    raise ValueError(
        f"cannot make a prompt of exactly {total} tokens with {counter.name} "
        f"(got {counter.count(text)}; its special tokens alone may be more)"
    )
