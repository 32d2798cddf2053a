"""Maps the sampling fields both APIs share onto engine_pb2.SamplingParams."""

from __future__ import annotations

from conduit.engine.v1 import engine_pb2
from conduit_gateway.errors import invalid_param
from conduit_gateway.handlers import fields
from conduit_gateway.schemas.common import SamplingRequest

_SEED_MODULUS = 2**64


def sampling_params(
    body: SamplingRequest,
    *,
    max_tokens: tuple[str, int | None],
    logprobs: tuple[str, int | None],
) -> engine_pb2.SamplingParams:
    """Build the engine's sampling set; `max_tokens` and `logprobs` are (field name, value) because the
    two APIs spell them differently."""
    params = engine_pb2.SamplingParams()
    max_tokens_name, max_tokens_value = max_tokens
    if max_tokens_value is not None:
        params.max_tokens = fields.uint32(max_tokens_name, max_tokens_value, minimum=1)
    logprobs_name, logprobs_value = logprobs
    if logprobs_value is not None:
        params.logprobs = fields.uint32(logprobs_name, logprobs_value)
    for name in (
        "temperature",
        "top_p",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    ):
        value = getattr(body, name)
        if value is not None:
            setattr(params, name, fields.float32(name, value))
    if body.n is not None:
        params.n = fields.uint32("n", body.n, minimum=1)
    if body.seed is not None:
        # OpenAI seeds are signed; the proto's is uint64. Modulo keeps every seed distinct and reproducible.
        params.seed = body.seed % _SEED_MODULUS
    if body.top_k is not None:
        params.top_k = fields.int32("top_k", body.top_k)
    if body.prompt_logprobs is not None:
        params.prompt_logprobs = fields.uint32("prompt_logprobs", body.prompt_logprobs)
    if body.min_tokens is not None:
        params.min_tokens = fields.uint32("min_tokens", body.min_tokens)
    for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
        value = getattr(body, name)
        if value is not None:
            setattr(params, name, value)
    if body.stop is not None:
        stops = [body.stop] if isinstance(body.stop, str) else body.stop
        params.stop.extend(fields.text("stop", stop) for stop in stops)
    if body.stop_token_ids is not None:
        for token in body.stop_token_ids:
            params.stop_token_ids.append(fields.uint32("stop_token_ids", token))
    if body.logit_bias is not None:
        for key, bias in body.logit_bias.items():
            params.logit_bias[_token_key(key)] = fields.float32("logit_bias", bias)
    return params


def _token_key(key: str) -> int:
    try:
        token = int(key)
    except ValueError:
        raise invalid_param("logit_bias", f"keys must be token ids, got {key!r}") from None
    return fields.uint32("logit_bias", token)
