"""Chat templates: Jinja2 rendered the way transformers' `apply_chat_template` renders them.

A template comes from the model directory (`chat_template.jinja` beside tokenizer.json, which
wins as in transformers >= 4.47, else `chat_template` in tokenizer_config.json: a string, or a
list of {name, template} of which "default" is used) or from `--chat-template FILE`. Without
one, the tokenizer's LLaMA-3 markup is the fallback (our own spec models). The environment is
transformers' (`utils/chat_template_utils.py`): sandboxed, trim_blocks + lstrip_blocks, loop
controls, `raise_exception`, `strftime_now` and a `tojson` that does not escape HTML. The
rendered text is then tokenized with no special tokens added, so a template that writes
`{{ bos_token }}` gets exactly one BOS.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

FALLBACK = "llama3 fallback"  # /stats: no template, the tokenizer's own LLaMA-3 markup
MODEL_TEMPLATE_FILE = "chat_template.jinja"


class ChatTemplateError(ValueError):
    """The template raised on these messages: `raise_exception`, an undefined name, a type
    error. A client error (the messages do not fit the template), never a server fault."""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` as plain output: transformers uses the tag to
    mask assistant tokens in training; a template that has it must still parse here."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: object,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; templates expect plain JSON
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_template(text: str) -> jinja2.Template:
    """`text` compiled in transformers' environment (cached by text); raises
    jinja2.TemplateSyntaxError for text that is not valid Jinja."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(text)


def render_chat(
    template: str, messages: list[dict], bos: str | None = None, eos: str | None = None, **kw
) -> str:
    """`template` applied to `messages` as `apply_chat_template(messages, tokenize=False,
    add_generation_prompt=True)` applies it. `bos`/`eos` are the special tokens' text (None:
    left undefined, as transformers leaves a tokenizer's unset tokens); `kw` (a request's
    `chat_template_kwargs`) are more variables and may override `add_generation_prompt`.
    Raises ChatTemplateError when the template fails on these messages.
    """
    variables: dict[str, object] = {"tools": None, "documents": None}
    variables["add_generation_prompt"] = True
    if bos is not None:
        variables["bos_token"] = bos
    if eos is not None:
        variables["eos_token"] = eos
    variables.update(kw)
    variables["messages"] = messages
    compiled = compile_template(template)
    try:
        return compiled.render(**variables)
    except jinja2.TemplateError as e:  # raise_exception's message, or an undefined name
        raise ChatTemplateError(f"chat template error: {e}") from e
    except Exception as e:  # anything else the template did with the client's values
        raise ChatTemplateError(f"chat template error: {type(e).__name__}: {e}") from e


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template, where it came from, and the special tokens' text it may print."""

    text: str
    source: str  # "model" or "file PATH", as /stats shows it
    bos: str | None = None  # bos_token's text (tokenizer_config.json); None: undefined
    eos: str | None = None

    def render(self, messages: list[dict], **kw) -> str:
        return render_chat(self.text, messages, self.bos, self.eos, **kw)


def token_text(value: object) -> str | None:
    """A tokenizer_config.json special token: a string, or an AddedToken dict's "content"."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def compiled(
    text: str, source: str, bos: str | None, eos: str | None, where: str | None = None
) -> ChatTemplate:
    """A ChatTemplate whose text compiles; else ValueError naming `where` (default: `source`),
    the line and the reason."""
    try:
        compile_template(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(
            f"the chat template from {where or source} is not valid Jinja: "
            f"line {e.lineno}: {e.message}"
        ) from e
    return ChatTemplate(text, source, bos, eos)


def config_template(config: dict, where: Path) -> str | None:
    """`chat_template` of a tokenizer_config.json: a string, or a list of {name, template}
    of which "default" is used (as transformers does). None when there is none."""
    value = config.get("chat_template")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(
        isinstance(t, dict) and isinstance(t.get("template"), str) for t in value
    ):
        named = {t.get("name"): t["template"] for t in value}
        if "default" in named:
            return named["default"]
        raise ValueError(
            f"{where} has chat templates named {sorted(map(str, named))} but none named "
            "'default'; pass --chat-template FILE to choose one"
        )
    raise ValueError(
        f"'chat_template' in {where} must be a string or a list of {{name, template}}, "
        f"got {type(value).__name__}"
    )


def model_template(directory: Path, config: dict) -> tuple[str, str] | None:
    """(text, the file it came from) of the model's own template: `chat_template.jinja` in
    `directory` (as in transformers, it wins), else tokenizer_config.json's; None: neither."""
    sidecar = directory / MODEL_TEMPLATE_FILE
    if sidecar.is_file():
        return read_template(sidecar, str(sidecar)), str(sidecar)
    where = directory / "tokenizer_config.json"
    text = config_template(config, where)
    return None if text is None else (text, str(where))


def read_template(path: Path, what: str) -> str:
    """The text of a template file; ValueError naming `what` when it cannot be read."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the chat template {what}: {e}") from e
