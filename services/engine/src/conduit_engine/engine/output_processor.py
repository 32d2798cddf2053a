"""What a sampled token does to its choice: appended, fed to the grammar, checked against the stop rules
and detokenized into the text it releases. The engine's update loop calls `accept_token` once per token,
for one token per step or several (a decode burst); a consumed request's first tokens replay through it.
Plain Python: no torch.
"""

from __future__ import annotations

from conduit_engine.core.sequence import FinishReason, Sequence
from conduit_engine.core.stop_rules import StopRules, may_stop
from conduit_engine.engine.detokenizer import IncrementalDetokenizer


def accept_token(seq: Sequence, token_id: int, detok: IncrementalDetokenizer, rules: StopRules) -> str:
    """Append a sampled token to `seq`, finish it if a rule says so, and return the released text."""
    seq.append_token(token_id)
    params = seq.params
    if seq.grammar is not None and not seq.grammar.accept(token_id):
        # Only possible if the row went unmasked: a bug, reported as an error, never silent output.
        seq.finish(FinishReason.ERROR)
        return detok.finish()
    can_stop = may_stop(params, seq.num_output_tokens)
    if can_stop and rules.is_stop_token(params, token_id):
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
    if rules.reached_length(seq):
        text += detok.finish()
        # The held-back tail may complete a stop string only now: that is a stop, not a length.
        seq.stop_string = detok.stop_string
        seq.finish(FinishReason.STOP if detok.stop_string is not None else FinishReason.LENGTH)
    return text
