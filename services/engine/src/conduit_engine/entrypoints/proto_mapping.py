"""Pure conversions between the gRPC messages and the engine's domain objects."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

from conduit.engine.v1 import engine_pb2 as pb
from conduit_engine.core.sequence import FinishReason
from conduit_engine.engine.continuation import Continuation, ContinuedChoice
from conduit_engine.engine.request import GenerationRequest, RequestOutput
from conduit_engine.errors import InvalidRequestError
from conduit_engine.kv_transfer.proto import consume_from_pb
from conduit_engine.kv_transfer.registry import KvTransfer
from conduit_engine.models.tokenizer import ChatMessage
from conduit_engine.sampling.token_logprobs import TokenLogprobs
from conduit_engine.sampling_params import SamplingParams
from conduit_engine.structured.spec import StructuredKind, StructuredSpec

_FINISH = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
    FinishReason.KV_HANDOFF: pb.FINISH_REASON_KV_HANDOFF,
    FinishReason.MIGRATE: pb.FINISH_REASON_MIGRATE,
}

# Proto fields copied as they are when present: (proto field, SamplingParams field)
_SCALARS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "n",
)


def sampling_from_pb(msg: pb.SamplingParams) -> SamplingParams:
    kwargs: dict[str, object] = {name: getattr(msg, name) for name in _SCALARS if msg.HasField(name)}
    kwargs["stop"] = list(msg.stop)
    kwargs["stop_token_ids"] = list(msg.stop_token_ids)
    kwargs["logit_bias"] = dict(msg.logit_bias)
    kwargs["structured"] = structured_from_pb(msg)
    return SamplingParams.from_request(**kwargs)


def structured_from_pb(msg: pb.SamplingParams) -> StructuredSpec | None:
    """The `structured` oneof and its two modifiers as a validated spec (None when the oneof is unset)."""
    kind = msg.WhichOneof("structured")
    if kind is None:
        for name in ("structured_any_whitespace", "structured_after"):
            if msg.HasField(name):
                raise InvalidRequestError(f"sampling.{name}", "applies only with a structured constraint")
        return None
    structured = StructuredKind(kind)
    return StructuredSpec(
        kind=structured,
        text=getattr(msg, kind) if kind in ("json_schema", "regex", "grammar") else "",
        choices=tuple(msg.choice.choices) if structured is StructuredKind.CHOICE else (),
        any_whitespace=msg.structured_any_whitespace,
        after=msg.structured_after if msg.HasField("structured_after") else None,
    )


def messages_from_pb(chat: pb.ChatInput) -> list[ChatMessage]:
    return [
        ChatMessage(
            role=m.role,
            content=m.content,
            name=m.name if m.HasField("name") else None,
            tool_calls=tuple(
                {
                    "id": c.id,
                    "type": c.type or "function",
                    "function": {"name": c.function_name, "arguments": c.function_arguments},
                }
                for c in m.tool_calls
            ),
            tool_call_id=m.tool_call_id if m.HasField("tool_call_id") else None,
        )
        for m in chat.messages
    ]


def template_extras_from_pb(chat: pb.ChatInput) -> tuple[list[Any] | None, list[Any] | None]:
    """(tools, documents) for the chat template from their JSON fields; absent fields are None."""
    return _json_array(chat, "tools_json"), _json_array(chat, "documents_json")


def _json_array(chat: pb.ChatInput, name: str) -> list[Any] | None:
    if not chat.HasField(name):
        return None
    try:
        value = json.loads(getattr(chat, name))
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"chat.{name}", f"is not valid JSON: {exc}") from exc
    if not isinstance(value, list):
        raise InvalidRequestError(f"chat.{name}", f"must be a JSON array, got {type(value).__name__}")
    return value


def request_from_pb(msg: pb.GenerateRequest) -> GenerationRequest:
    params = sampling_from_pb(msg.sampling)  # a bad structured spec is refused here, naming its field
    req = GenerationRequest(
        request_id=msg.request_id or f"req-{uuid.uuid4().hex}",
        params=params,
        priority=msg.priority if msg.HasField("priority") else 0,
    )
    kind = msg.WhichOneof("input")
    if kind == "text":
        req.text = msg.text
    elif kind == "token_ids":
        req.token_ids = list(msg.token_ids.ids)
    elif kind == "chat":
        req.messages = messages_from_pb(msg.chat)
        req.tools, req.documents = template_extras_from_pb(msg.chat)
        if msg.chat.HasField("add_generation_prompt"):
            req.add_generation_prompt = msg.chat.add_generation_prompt
    if msg.HasField("kv_transfer"):
        mode = msg.kv_transfer.WhichOneof("mode")
        if mode is None:
            raise InvalidRequestError("kv_transfer", "set produce or consume")
        req.kv_produce = mode == "produce"
        if mode == "consume":
            req.kv_consume = consume_from_pb(msg.kv_transfer.consume)
    if msg.HasField("continuation"):
        if msg.HasField("kv_transfer"):
            raise InvalidRequestError("continuation", "cannot be combined with kv_transfer")
        req.continuation = continuation_from_pb(msg.continuation)
    return req


def continuation_from_pb(msg: pb.Continuation) -> Continuation:
    return Continuation(
        tuple(ContinuedChoice(index=c.index, token_ids=tuple(c.token_ids), text=c.text) for c in msg.choices)
    )


def _logprob_pb(lp: TokenLogprobs, decode: Callable[[int], str]) -> pb.PositionLogprobs:
    return pb.PositionLogprobs(
        token=pb.TokenLogprob(
            token_id=lp.token_id, text=decode(lp.token_id), logprob=lp.logprob, rank=lp.rank
        ),
        top=[
            pb.TokenLogprob(token_id=t, text=decode(t), logprob=v, rank=r + 1)
            for r, (t, v) in enumerate(zip(lp.top_ids, lp.top_logprobs, strict=True))
        ],
    )


def output_to_pb(
    out: RequestOutput,
    decode: Callable[[int], str],
    handle: Callable[[KvTransfer], pb.KvHandle] | None = None,
) -> pb.GenerateResponse:
    """`decode(token_id) -> str` gives the text of one token for logprob entries; `handle(transfer)` the
    KvHandle a KV_HANDOFF output carries."""
    msg = pb.GenerateResponse(
        request_id=out.request_id,
        index=out.index,
        text=out.text,
        token_ids=out.token_ids,
        usage=pb.Usage(
            prompt_tokens=out.usage.prompt_tokens,
            completion_tokens=out.usage.completion_tokens,
            cached_tokens=out.usage.cached_tokens,
        ),
        finished=out.finished,
        logprobs=[_logprob_pb(lp, decode) for lp in out.logprobs],
    )
    if out.finished and out.finish_reason is not None:
        msg.finish_reason = _FINISH[out.finish_reason]
        if out.stop_string is not None:
            msg.stop_string = out.stop_string
        if out.stop_token_id is not None:
            msg.stop_token_id = out.stop_token_id
    if out.error is not None:
        msg.error = out.error
    if out.kv_transfer is not None and handle is not None:
        msg.kv_handle.CopyFrom(handle(out.kv_transfer))
    if out.prompt_token_ids is not None:
        msg.prompt_token_ids.extend(out.prompt_token_ids)
    if out.prompt_logprobs is not None:
        msg.prompt_logprobs.extend(_logprob_pb(lp, decode) for lp in out.prompt_logprobs)
    return msg
