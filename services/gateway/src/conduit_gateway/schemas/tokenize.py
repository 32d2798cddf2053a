"""POST /tokenize and /detokenize (vLLM's shapes): a prompt or chat messages in, token ids out, and back."""

from __future__ import annotations

from pydantic import BaseModel, Field

from conduit_gateway.schemas.chat import ChatMessageParam
from conduit_gateway.schemas.common import StrictModel
from conduit_gateway.schemas.structured import ToolDefinition


class TokenizeRequest(StrictModel):
    model: str | None = Field(None, description="Served model (may be left out when one is served).")
    prompt: str | None = Field(None, description="Text to tokenize (or `messages`).")
    messages: list[ChatMessageParam] | None = Field(None, description="Chat rendered by the template.")
    add_special_tokens: bool | None = Field(None, description="Text: add BOS (default true).")
    add_generation_prompt: bool | None = Field(None, description="Chat: the assistant opener (default true).")
    tools: list[ToolDefinition] | None = None
    return_token_strs: bool | None = Field(None, description="Also return each token's text.")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]
    skip_special_tokens: bool | None = Field(None, description="Leave BOS/EOS out (default true).")


class DetokenizeResponse(BaseModel):
    prompt: str
