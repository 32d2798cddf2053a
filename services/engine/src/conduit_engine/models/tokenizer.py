"""The model's tokenizer: tokenizer.json through `tokenizers`, plus its chat template (Jinja, like HF).

A template is rendered with what transformers' apply_chat_template gives it: `messages`, `tools` and
`documents` (None when absent), `add_generation_prompt`, the special tokens (`bos_token`, `eos_token`,
`unk_token`, `pad_token`), the helpers `raise_exception` and `strftime_now`, a `tojson` filter with
transformers' arguments, loop controls ({% break %}, {% continue %}) and the {% generation %} block.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from conduit_engine.errors import InvalidRequestError, ModelLoadError


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str
    name: str | None = None
    tool_calls: tuple[dict[str, Any], ...] = ()
    tool_call_id: str | None = None

    def as_template_dict(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = list(self.tool_calls)
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ModelTokenizer:
    def __init__(self, folder: Path) -> None:
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{folder}: no tokenizer.json")
        self.hf = Tokenizer.from_file(str(path))
        self.config = _read_json(folder / "tokenizer_config.json")
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.special_tokens = {
            name: text
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (text := _token_text(self.config.get(name))) is not None
        }
        self.chat_template = _chat_template(folder, self.config)
        self.vocab_size = self.hf.get_vocab_size(with_added_tokens=True)
        self.special_ids = frozenset(
            i for i, tok in self.hf.get_added_tokens_decoder().items() if tok.special
        )
        # Decoders strip the leading space of the first token; decoding after an anchor token keeps it.
        self._anchor = self.hf.encode("a", add_special_tokens=False).ids[-1]
        self._anchor_text = self.hf.decode([self._anchor], skip_special_tokens=False)
        self._token_texts: dict[int, str] = {}
        self._template = None
        if self.chat_template is not None:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationBlock]
            )
            env.globals["raise_exception"] = _raise_template_error
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            env.filters["tojson"] = _tojson
            try:
                self._template = env.from_string(self.chat_template)
            except TemplateError as exc:
                raise ModelLoadError(f"{folder}: the chat template does not parse: {exc}") from exc

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text one token adds after other text (keeps SentencePiece's leading space: " there")."""
        cached = self._token_texts.get(token_id)
        if cached is None:
            with_anchor = self.hf.decode([self._anchor, token_id], skip_special_tokens=False)
            cached = with_anchor[len(self._anchor_text) :]
            self._token_texts[token_id] = cached
        return cached

    def render_chat(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        tools: list[Any] | None = None,
        documents: list[Any] | None = None,
    ) -> str:
        if self._template is None:
            raise InvalidRequestError("messages", "this model has no chat template; send text or token ids")
        if not messages:
            raise InvalidRequestError("messages", "must contain at least one message")
        try:
            return self._template.render(
                {"bos_token": "", "eos_token": ""}
                | self.special_tokens
                | {
                    "messages": [m.as_template_dict() for m in messages],
                    "tools": tools,
                    "documents": documents,
                    "add_generation_prompt": add_generation_prompt,
                }
            )
        except Exception as exc:  # a template is code: raise_exception, undefined names, type errors
            raise InvalidRequestError("messages", f"chat template rejected the messages: {exc}") from exc

    def encode_chat(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        tools: list[Any] | None = None,
        documents: list[Any] | None = None,
    ) -> list[int]:
        # As transformers' apply_chat_template: the template places special tokens itself.
        text = self.render_chat(messages, add_generation_prompt, tools, documents)
        return self.encode(text, add_special_tokens=False)


def _raise_template_error(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' tojson: unlike Jinja's own, it keeps non-ASCII text and does not escape HTML."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _GenerationBlock(Extension):
    """{% generation %}...{% endgeneration %}: transformers marks the assistant's tokens with it (for
    training masks); rendering keeps the body as it is."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path}: invalid JSON: {exc}") from exc


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """chat_template.jinja, else chat_template.json (its "chat_template"), else tokenizer_config.json's."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = _read_json(folder / "chat_template.json").get("chat_template") or config.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None
