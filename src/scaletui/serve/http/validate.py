"""OpenAI request bodies -> a validated `Generation`, or an `ApiError` naming the bad field.

Every check here is a 4xx at the API edge (never a 5xx): wrong types, empty prompts, lengths
beyond the context, values outside their range, and behaviour we cannot honour (n > 1,
logprobs, echo, penalties) are refused with a message that says so. Harmless fields vLLM-era
clients send (`user`, `logprobs: null`, `repetition_penalty: 1`, ...) are accepted. Logprobs:
completions' `logprobs: k` and `echo`, chat's `logprobs: true` and `top_logprobs: k`
(`logprob_fields`), k up to engine_api.MAX_LOGPROBS.
A POST /admin/config body is checked in guard.py, with the rest of /admin/*. The errors
themselves are in errors.py.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import orjson

from scaletui.serve.engine.engine_api import MAX_LOGPROBS, SamplingParams
from scaletui.serve.http.chat_template import ChatTemplateError
from scaletui.serve.http.errors import ApiError
from scaletui.serve.http.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant", "tool", "developer")
# Stop strings are searched in the event loop after every token (only the unsent tail, so each
# check costs the new text plus the longest stop string): bound both. OpenAI allows 4.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
# OpenAI's range; below MIN_TEMPERATURE sampling is greedy (as vLLM does: 1/t would overflow)
MAX_TEMPERATURE = 2.0
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class Generation:
    """What a completion or chat request asks the scheduler for."""

    prompt: list[int]
    params: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    continuous_usage: bool
    echo: bool = False  # completions: the prompt's text (and logprobs, if asked) comes first


def parse_json(raw: bytes) -> dict:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ApiError(400, f"request body is not valid JSON: {e}", code="invalid_json") from e
    if not isinstance(body, dict):
        raise ApiError(400, f"request body must be a JSON object, got {_kind(body)}")
    return body


def _kind(value: object) -> str:
    return {
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "string",
        list: "array",
        dict: "object",
        type(None): "null",
    }.get(type(value), type(value).__name__)


def _get(body: dict, name: str, kinds: tuple[type, ...], expected: str, default: object = None):
    value = body.get(name)
    if value is None:
        return default
    # bool is an int subclass: only accept it where a boolean is expected
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise ApiError(400, f"'{name}' must be {expected}, got {_kind(value)} {value!r}", name)
    return value


def _unsupported(body: dict, name: str, harmless: tuple[object, ...], why: str) -> None:
    value = body.get(name)
    if value is not None and value not in harmless:
        raise ApiError(400, f"'{name}'={value!r} is not supported: {why}", name, "unsupported")


def check_model(body: dict, served: str) -> None:
    model = _get(body, "model", (str,), "a string")
    if model is not None and model != served:
        raise ApiError(
            404,
            f"the model '{model}' does not exist; this server serves '{served}'",
            "model",
            "model_not_found",
        )


def completion_prompt(body: dict, tok: Tokenizer, model_vocab: int) -> list[int]:
    """`prompt`: a string, token ids, or a one-element list of either."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) > 1:
            raise ApiError(
                400,
                f"batched prompts ({len(prompt)}) are not supported; send one prompt per request",
                "prompt",
                "unsupported",
            )
        prompt = prompt[0]
    if prompt is None:
        raise ApiError(400, "'prompt' is required", "prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "'prompt' must not be empty", "prompt")
        return ([tok.bos_id] if tok.bos_id >= 0 else []) + tok.encode(prompt)
    if isinstance(prompt, list):
        if not prompt:
            raise ApiError(400, "'prompt' must not be empty", "prompt")
        bad = [
            t
            for t in prompt
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < model_vocab
        ]
        if bad:
            raise ApiError(
                400,
                f"'prompt' token ids must be integers in [0, {model_vocab}), got {bad[:5]!r}",
                "prompt",
            )
        return list(prompt)
    raise ApiError(
        400, f"'prompt' must be a string or a list of token ids, got {_kind(prompt)}", "prompt"
    )


def chat_prompt(body: dict, tok: Tokenizer) -> list[int]:
    """`messages` (plus `chat_template_kwargs`, `add_generation_prompt`) -> the prompt ids of
    the tokenizer's chat template; a template that raises on them is a 400 naming its error."""
    messages = body.get("messages")
    if messages is None:
        raise ApiError(400, "'messages' is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(
            400, "'messages' must be a non-empty array of {role, content} objects", "messages"
        )
    clean = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"'{where}' must be an object, got {_kind(m)}", where)
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ApiError(
                400, f"'{where}.role' must be one of {list(ROLES)}, got {role!r}", f"{where}.role"
            )
        if m.get("tool_calls"):
            raise ApiError(
                400,
                f"'{where}.tool_calls' is not supported: this server has no tool calling",
                f"{where}.tool_calls",
                "unsupported",
            )
        if content is None:
            raise ApiError(
                400, f"'{where}.content' is required (a string or text parts)", f"{where}.content"
            )
        clean.append({"role": role, "content": _text_content(content, f"{where}.content")})
        # a tool result's fields, for templates that print them
        clean[-1].update((k, m[k]) for k in ("name", "tool_call_id") if isinstance(m.get(k), str))
    kwargs = _get(body, "chat_template_kwargs", (dict,), "an object", {})
    if "messages" in kwargs:
        msg = "'chat_template_kwargs.messages' is not allowed: the messages are 'messages'"
        raise ApiError(400, msg, "chat_template_kwargs")
    generation_prompt = _get(body, "add_generation_prompt", (bool,), "a boolean", True)
    try:  # vLLM's order: chat_template_kwargs may override add_generation_prompt
        ids = tok.chat_ids(clean, **{"add_generation_prompt": generation_prompt, **kwargs})
    except ChatTemplateError as e:
        msg = f"{e} (chat template: {tok.chat_source})"
        raise ApiError(400, msg, "messages", "chat_template_error") from e
    if not ids:
        raise ApiError(400, "the chat template rendered these messages as nothing", "messages")
    return ids


def _text_content(content: object, where: str) -> str:
    """A message's content: a string, or its text parts joined by newlines (as vLLM joins
    them for templates that take string content)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(
            400,
            f"'{where}' must be a string or an array of text parts, got {_kind(content)}",
            where,
        )
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type", "text") if isinstance(part, dict) else None
        if isinstance(part, dict) and kind != "text":
            raise ApiError(
                400,
                f"'{where}[{j}].type' {kind!r} is not supported: only text parts",
                f"{where}[{j}].type",
                "unsupported",
            )
        if not isinstance(part, dict) or not isinstance(part.get("text"), str):
            raise ApiError(
                400, f"'{where}[{j}]' must be a text part {{type: 'text', text: string}}", where
            )
        texts.append(part["text"])
    return "\n".join(texts)


def generation(body: dict, prompt: list[int], max_seq_len: int, chat: bool) -> Generation:
    """Sampling and streaming fields, checked against the prompt length and the context."""
    where = "messages" if chat else "prompt"
    if len(prompt) >= max_seq_len:
        raise ApiError(
            400,
            f"the prompt has {len(prompt)} tokens, but the model's context "
            f"(max_seq_len) is {max_seq_len} tokens; shorten the prompt",
            where,
            "context_length_exceeded",
        )
    left = max_seq_len - len(prompt)
    # chat: max_completion_tokens wins when present (0 and false are errors, not "unset")
    newer = chat and body.get("max_completion_tokens") is not None
    name = "max_completion_tokens" if newer else "max_tokens"
    max_tokens = _get(body, name, (int,), "an integer", left if chat else min(16, left))
    if max_tokens <= 0:
        raise ApiError(400, f"'{name}' must be >= 1, got {max_tokens}", name)
    if max_tokens > left:
        raise ApiError(
            400,
            f"'{name}' is {max_tokens}, but only {left} tokens of context are "
            f"left (max_seq_len {max_seq_len} - prompt {len(prompt)})",
            name,
            "context_length_exceeded",
        )
    temperature = float(_get(body, "temperature", (int, float), "a number", 1.0))
    if not 0 <= temperature <= MAX_TEMPERATURE:  # NaN fails too
        raise ApiError(
            400,
            f"'temperature' must be in [0, {MAX_TEMPERATURE:g}], got {temperature}",
            "temperature",
        )
    if temperature < MIN_TEMPERATURE:
        temperature = 0.0
    top_p = float(_get(body, "top_p", (int, float), "a number", 1.0))
    if not 0 < top_p <= 1:
        raise ApiError(400, f"'top_p' must be in (0, 1], got {top_p}", "top_p")
    top_k = _get(body, "top_k", (int,), "an integer", 0)
    if top_k < -1:
        raise ApiError(400, f"'top_k' must be -1, 0 (off) or positive, got {top_k}", "top_k")
    seed = _get(body, "seed", (int,), "an integer", None)
    n = _get(body, "n", (int,), "an integer", 1)
    if n != 1:
        raise ApiError(
            400,
            f"'n'={n} is not supported: this server returns one choice per request (n=1)",
            "n",
            "unsupported",
        )
    min_tokens = _get(body, "min_tokens", (int,), "an integer", 0)
    if not 0 <= min_tokens <= max_tokens:
        raise ApiError(
            400,
            f"'min_tokens' must be in [0, max_tokens={max_tokens}], got {min_tokens}",
            "min_tokens",
        )
    ignore_eos = _get(body, "ignore_eos", (bool,), "a boolean", False)
    stop = _get(body, "stop", (str, list), "a string or an array of strings", [])
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > MAX_STOP_STRINGS:
        raise ApiError(
            400, f"'stop' has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed", "stop"
        )
    if not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, f"'stop' must hold non-empty strings, got {stop!r}", "stop")
    if longest := max((len(s) for s in stop if len(s) > MAX_STOP_CHARS), default=0):
        raise ApiError(
            400,
            f"'stop' strings must be at most {MAX_STOP_CHARS} characters, got one of {longest}",
            "stop",
        )
    stream = _get(body, "stream", (bool,), "a boolean", False)
    options = _get(body, "stream_options", (dict,), "an object", None)
    if options is not None and not stream:
        raise ApiError(
            400, "'stream_options' is only allowed with 'stream': true", "stream_options"
        )
    options = options or {}
    include = _get(options, "include_usage", (bool,), "a boolean", False)
    continuous = _get(options, "continuous_usage_stats", (bool,), "a boolean", False)
    logprobs, echo = logprob_fields(body, chat)
    _unsupported(body, "best_of", (1,), "one sequence per request")
    _unsupported(body, "presence_penalty", (0, 0.0), "penalties are not implemented")
    _unsupported(body, "frequency_penalty", (0, 0.0), "penalties are not implemented")
    _unsupported(body, "repetition_penalty", (1, 1.0), "penalties are not implemented")
    params = SamplingParams(
        temperature=temperature,
        top_k=min(max(0, top_k), 2**31 - 1),  # any k >= vocab means off; the engine packs int32
        top_p=top_p,
        seed=seed if seed is not None else random.getrandbits(31),
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        ignore_eos=ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=logprobs if echo else None,
    )
    return Generation(prompt, params, tuple(stop), stream, include, continuous, echo)


def _top_count(body: dict, name: str) -> int | None:
    k = _get(body, name, (int,), f"an integer in [0, {MAX_LOGPROBS}]", None)
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise ApiError(400, f"'{name}' must be in [0, {MAX_LOGPROBS}], got {k}", name)
    return k


def logprob_fields(body: dict, chat: bool) -> tuple[int | None, bool]:
    """(top candidates per token, or None for no logprobs; echo). Completions: `logprobs: k`
    and `echo`; chat: `logprobs: true` with `top_logprobs: k` (0 when absent)."""
    if not chat:
        if body.get("top_logprobs") not in (None, 0):
            raise ApiError(
                400,
                "'top_logprobs' is a chat field; on /v1/completions ask with 'logprobs': k",
                "top_logprobs",
            )
        return _top_count(body, "logprobs"), _get(body, "echo", (bool,), "a boolean", False)
    _unsupported(body, "echo", (False,), "chat does not echo the prompt")
    wanted = _get(body, "logprobs", (bool,), "a boolean", False)
    k = _top_count(body, "top_logprobs")
    if k and not wanted:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (k or 0) if wanted else None, False
