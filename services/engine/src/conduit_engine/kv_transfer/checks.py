"""The checks of a request's kv_transfer part against this engine, made once when the request is admitted.

Plain Python: no torch. A produce request needs a role that serves the prefill side; a consume request a
role that serves the decode side, a handle of this engine's KV layout holding exactly the prompt, and
first tokens for existing choices inside the vocabulary. Models whose every layer attends through one
sliding window free the blocks before the window as a sequence grows, so a finished prefill no longer
holds its whole prompt: they are refused for disaggregation.
"""

from __future__ import annotations

from dataclasses import dataclass

from conduit_engine.config import DisaggregationConfig
from conduit_engine.errors import InvalidRequestError
from conduit_engine.kv_transfer.errors import KvLayoutMismatchError
from conduit_engine.kv_transfer.layout import KvLayoutSpec
from conduit_engine.kv_transfer.params import KvConsume, KvHandleRef

_HANDLE = "kv_transfer.consume.handle"
_FIRST_TOKENS = "kv_transfer.consume.first_tokens"


@dataclass(frozen=True, slots=True)
class KvTransferLimits:
    """What a kv_transfer request is checked against."""

    config: DisaggregationConfig
    layout: KvLayoutSpec
    vocab_size: int
    sliding_window: int | None  # the window every layer shares, if any


def check_transfer_request(
    produce: bool, consume: KvConsume | None, n: int, prompt_len: int, limits: KvTransferLimits
) -> None:
    """Raise InvalidRequestError (or KvLayoutMismatchError) naming the field unless this engine can run the
    kv_transfer side a request asks for (`produce`, or `consume`). `n` and `prompt_len` are the admitted
    request's."""
    if not produce and consume is None:
        return
    side = "produce" if produce else "consume"
    if not (limits.config.produces if produce else limits.config.consumes):
        wanted = "prefill" if produce else "decode"
        raise InvalidRequestError(
            f"kv_transfer.{side}",
            f"this engine's role is {limits.config.role}: it does not serve the {wanted} side of "
            "disaggregated requests",
        )
    if limits.sliding_window is not None:
        raise InvalidRequestError(
            f"kv_transfer.{side}",
            f"this model attends through a sliding window of {limits.sliding_window} tokens on every layer; "
            "its prompt KV is freed as it leaves the window, so it cannot be handed to another engine",
        )
    if consume is not None:
        _check_consume(consume, n, prompt_len, limits)


def check_layout(handle: KvHandleRef, layout: KvLayoutSpec) -> None:
    """Refuse a handle whose layout differs from this (the puller's) layout (FAILED_PRECONDITION)."""
    if handle.layout_fingerprint != layout.fingerprint:
        raise KvLayoutMismatchError(
            f"{_HANDLE}.layout.fingerprint: {handle.layout_fingerprint or '(empty)'} differs from this "
            f"engine's {layout.fingerprint}: the two engines cannot exchange KV blocks"
        )


def _check_consume(consume: KvConsume, n: int, prompt_len: int, limits: KvTransferLimits) -> None:
    check_layout(consume.handle, limits.layout)
    if consume.handle.num_tokens != prompt_len:
        raise InvalidRequestError(
            f"{_HANDLE}.num_tokens",
            f"the handle holds {consume.handle.num_tokens} tokens but the prompt has {prompt_len}: send the "
            "same prompt as to the prefill engine",
        )
    for first in consume.first_tokens:
        if first.index >= n:
            raise InvalidRequestError(_FIRST_TOKENS, f"choice index {first.index} is not below n ({n})")
        if first.token_id >= limits.vocab_size:
            raise InvalidRequestError(
                _FIRST_TOKENS,
                f"token id {first.token_id} is outside the vocabulary [0, {limits.vocab_size})",
            )
