"""Prompts that cannot fit the context, refused before any engine tokenizes them, and the body limit.

Engines publish a byte bound (GetModelInfo.max_prompt_bytes: text over it needs more tokens than the
context holds). For a model, the loosest of its engines decides, so
nothing is refused here that one of them could serve; an engine without a bound (0) turns the check off.
Chat messages count their contents (what every chat template renders); the engine then checks the
rendered text. Token arrays are checked against max_model_len, as the engine does.

The body limit follows: a JSON string takes at most 6 bytes per byte of text (a \\u escape), so a route
that carries one context's worth of text needs no more than 6 × the bound plus room for its other fields;
completions carry up to MAX_PROMPTS prompts. --max-body-bytes stays the ceiling.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from conduit.engine.v1 import engine_pb2
from conduit_common.prompt_size import context_message, over_bound, too_long_message
from conduit_gateway.errors import invalid_param
from conduit_gateway.http.body_scan import RawString, top_level_strings

if TYPE_CHECKING:
    from conduit_gateway.routing.pool import EnginePool

# OpenAI's own bound on prompts in one completions request; each becomes its own engine stream.
MAX_PROMPTS = 2048

# What a body may carry besides its prompt text: sampling parameters, tool definitions, schemas.
BODY_HEADROOM_BYTES = 1024 * 1024
# Worst case of JSON's escaping: one byte of text as \u00XX; a token id as up to 7 digits and a comma.
_JSON_BYTES_PER_BYTE = 6
_JSON_BYTES_PER_TOKEN = 8
# Routes whose body carries at most one context's worth of prompt text.
_ONE_CONTEXT_ROUTES = (
    "/v1/chat/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
    "/v1/responses/input_tokens",
    "/tokenize",
)


def prompt_param(index: int, count: int) -> str:
    """How errors name a completions prompt: `prompt` when it is the only one, else `prompt[i]`."""
    return "prompt" if count == 1 else f"prompt[{index}]"


@dataclass(frozen=True, slots=True)
class PromptLimit:
    """The loosest bound among the engines of a model."""

    max_bytes: int
    max_model_len: int

    def check_texts(self, param: str, texts: Iterable[str]) -> None:
        size = over_bound(texts, self.max_bytes)
        if size is not None:
            raise invalid_param(param, too_long_message(size, self.max_bytes, self.max_model_len))

    def check_tokens(self, param: str, count: int) -> None:
        if count >= self.max_model_len:
            raise invalid_param(param, context_message(count, self.max_model_len))

    def check_generate(self, param: str, request: engine_pb2.GenerateRequest) -> None:
        """Refuse `request`'s prompt (400 naming `param`) when it cannot fit the context."""
        kind = request.WhichOneof("input")
        if kind == "text":
            self.check_texts(param, (request.text,))
        elif kind == "token_ids":
            self.check_tokens(param, len(request.token_ids.ids))
        elif kind == "chat":
            self.check_chat(param, request.chat)

    def check_chat(self, param: str, chat: engine_pb2.ChatInput) -> None:
        self.check_texts(param, (message.content for message in chat.messages))


def prompt_limit(pool: EnginePool, model: str) -> PromptLimit | None:
    """The bound for `model` (None: unknown, or one of its engines has none)."""
    infos = [node.model_info for node in pool.engines if node.model == model and node.model_info]
    if not infos or any(info.max_prompt_bytes == 0 for info in infos):
        return None
    return PromptLimit(
        max_bytes=max(info.max_prompt_bytes for info in infos),
        max_model_len=max(info.max_model_len for info in infos),
    )


def body_limit(path: str, configured: int, pool: EnginePool) -> int:
    """The largest body `path` accepts: --max-body-bytes, or less when every engine has a bound."""
    if path == "/v1/completions":
        prompts = MAX_PROMPTS
    elif path in _ONE_CONTEXT_ROUTES:
        prompts = 1
    else:
        return configured
    infos = [node.model_info for node in pool.engines if node.model_info is not None]
    if not infos or any(info.max_prompt_bytes == 0 for info in infos):
        return configured
    text = max(info.max_prompt_bytes for info in infos)
    tokens = max(info.max_model_len for info in infos)
    prompt = max(_JSON_BYTES_PER_BYTE * text, _JSON_BYTES_PER_TOKEN * tokens)
    return min(configured, prompts * prompt + BODY_HEADROOM_BYTES)


# Bodies up to this size are parsed before their prompt is checked: parsing them costs little.
_SCAN_FROM_BYTES = 64 * 1024


def refuse_unfit_completion(pool: EnginePool, body: bytes) -> None:
    """Before a /v1/completions body is parsed: when its `prompt` (one string, or a list of strings)
    holds a string whose text is certainly over the bound of the `model` it names, the 400 the handler
    would give after parsing, now (body_scan.py finds both fields without parsing the body). A string
    without escapes is measured exactly; one with escapes by the least its text can be (a sixth of its
    raw bytes: the message then says "at least"). Prompts before it must certainly fit, as the handler
    checks them in order; anything the walk is not sure of goes on to be parsed and checked as before."""
    if len(body) <= _SCAN_FROM_BYTES:
        return
    fields = top_level_strings(body, (b"model", b"prompt"))
    if fields is None:
        return
    model, prompt = fields.get(b"model"), fields.get(b"prompt")
    if not isinstance(model, RawString) or model.escaped or prompt is None:
        return
    try:
        name = body[model.start : model.end].decode()
    except UnicodeDecodeError:
        return
    limit = prompt_limit(pool, name)
    if limit is None or not limit.max_bytes:
        return
    prompts = (prompt,) if isinstance(prompt, RawString) else prompt
    if not prompts or len(prompts) > MAX_PROMPTS:
        return  # the handler's own errors
    for index, text in enumerate(prompts):
        if text.max_text_bytes <= limit.max_bytes:
            continue  # fits: the handler passes it too
        if text.min_text_bytes <= limit.max_bytes:
            return  # it may fit: only its decoded text can tell
        param = prompt_param(index, len(prompts))
        size = text.min_text_bytes
        message = too_long_message(size, limit.max_bytes, limit.max_model_len, at_least=text.escaped)
        raise invalid_param(param, message)
