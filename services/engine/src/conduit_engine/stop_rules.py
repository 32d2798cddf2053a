"""When a choice stops: EOS, stop token ids, stop strings, max_tokens and the context length.

`min_tokens` holds off every kind of stop until that many output tokens exist; this module is the one
place that rule lives. The sampler asks `blocked_token_ids` which ids it must not pick yet, and
`StopRules.accept` applies the rules to each sampled token. Plain Python: no torch.
"""

from __future__ import annotations

from conduit_engine.detokenizer import IncrementalDetokenizer
from conduit_engine.sampling_params import SamplingParams
from conduit_engine.sequence import FinishReason, Sequence


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
    """Applies the stop rules to one choice's tokens and turns them into released text."""

    def __init__(
        self,
        detokenizer: IncrementalDetokenizer,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
    ) -> None:
        self.detokenizer = detokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def accept(self, seq: Sequence, token_id: int) -> str:
        """Append a sampled token to `seq`, finish it if a rule says so, and return the released text."""
        seq.append_token(token_id)
        params = seq.params
        detok = self.detokenizer
        if seq.grammar is not None and not seq.grammar.accept(token_id):
            # Only possible if the row went unmasked: a bug, reported as an error, never silent output.
            seq.finish(FinishReason.ERROR)
            return detok.finish()
        can_stop = may_stop(params, seq.num_output_tokens)
        if can_stop and (
            token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids)
        ):
            seq.stop_token_id = token_id
            seq.finish(FinishReason.STOP)
            if not params.include_stop_str_in_output:
                return detok.finish()
        delta = detok.step([token_id], match_stops=can_stop)
        text = delta.text
        if delta.stop_string is not None:
            seq.stop_string = delta.stop_string
            seq.finish(FinishReason.STOP)
            return text
        if seq.is_finished:
            return text + detok.finish()
        if seq.grammar is not None and seq.grammar.is_finished:
            # The structure is complete and only EOS could follow: stop here, whatever ignore_eos and
            # min_tokens say (the structure cannot continue); before max_tokens, so a structure that
            # completes on the last allowed token is a stop, not a length.
            seq.finish(FinishReason.STOP)
            return text + detok.finish()
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            text += detok.finish()
            # The held-back tail may complete a stop string only now: that is a stop, not a length.
            seq.stop_string = detok.stop_string
            seq.finish(FinishReason.STOP if detok.stop_string is not None else FinishReason.LENGTH)
        return text
