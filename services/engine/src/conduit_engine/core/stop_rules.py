"""When a choice stops: EOS, stop token ids, max_tokens and the context length (stop strings are matched
by the detokenizer, on the output side).

`min_tokens` holds off every kind of stop until that many output tokens exist; this module is the one
place that rule lives. The sampler asks `blocked_token_ids` which ids it must not pick yet, and the
engine's update loop asks `StopRules` whether a token it appended ends its choice. Pure: nothing here
changes a sequence. Plain Python: no torch.
"""

from __future__ import annotations

from conduit_engine.core.sequence import Sequence
from conduit_engine.sampling_params import SamplingParams


def may_stop(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether a choice that has `num_output_tokens` (the newest included) may stop now."""
    return num_output_tokens >= params.min_tokens


def blocked_token_ids(
    params: SamplingParams, eos_token_ids: tuple[int, ...], num_output_tokens: int
) -> tuple[int, ...]:
    """Token ids the sampler must not pick as the next token: the stop token ids, and EOS unless
    ignore_eos (as in vLLM: with ignore_eos EOS ends nothing, so there is nothing to hold off)."""
    if num_output_tokens >= params.min_tokens:
        return ()
    eos = () if params.ignore_eos else eos_token_ids
    return tuple(sorted(set(params.stop_token_ids) | set(eos)))


class StopRules:
    """The token and length stops of every choice of one engine (EOS ids, the context length)."""

    def __init__(self, eos_token_ids: tuple[int, ...], max_model_len: int) -> None:
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def is_stop_token(self, params: SamplingParams, token_id: int) -> bool:
        """Whether `token_id` ends a choice of `params` that may stop: a stop token id, or EOS."""
        return token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids)

    def reached_length(self, seq: Sequence) -> bool:
        """Whether `seq` has all the output tokens it may have: max_tokens, or the context is full."""
        return seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len
