"""Merging the pending messages of a stream into one, for a client that reads slower than tokens arrive.

While the client is behind (its connection holds bytes it has not read), the messages that have arrived
meanwhile become one event per choice instead of one per token: their texts concatenated, their logprobs
one entry per token as before, their token ids in order, the newest usage, and the ending of the last.
OpenAI clients accept deltas of any length, so a slow reader costs one event per read, not per token.
"""

from __future__ import annotations

from conduit.engine.v1 import engine_pb2
from conduit_gateway.handlers.streams import Batch

# What a choice's last message says of its ending, besides finished and finish_reason.
_ENDING_FIELDS = ("stop_string", "stop_token_id", "error")


def merge_batch(batch: Batch) -> Batch:
    """One message per (prompt, choice) of `batch`, in the order each choice first appears; every merged
    message carries its prompt's newest usage of the batch (the engine's usage is prompt-wide)."""
    if len(batch) == 1:
        return batch
    groups: dict[tuple[int, int], list[engine_pb2.GenerateResponse]] = {}
    newest: dict[int, engine_pb2.Usage] = {}
    for prompt_index, message in batch:
        groups.setdefault((prompt_index, message.index), []).append(message)
        newest[prompt_index] = message.usage
    return [
        (prompt_index, merged(messages, newest[prompt_index]))
        for (prompt_index, _), messages in groups.items()
    ]


def merged(
    messages: list[engine_pb2.GenerateResponse], usage: engine_pb2.Usage
) -> engine_pb2.GenerateResponse:
    """Consecutive messages of one choice as one (the first one's other fields, the last one's ending)."""
    first, last = messages[0], messages[-1]
    if len(messages) == 1 and first.usage is usage:
        return first
    out = engine_pb2.GenerateResponse()
    out.CopyFrom(first)
    out.text = "".join(message.text for message in messages)
    for message in messages[1:]:
        out.token_ids.extend(message.token_ids)
        out.logprobs.extend(message.logprobs)
    out.usage.CopyFrom(usage)
    out.finished = last.finished
    out.finish_reason = last.finish_reason
    for name in _ENDING_FIELDS:
        out.ClearField(name)
        if last.HasField(name):
            setattr(out, name, getattr(last, name))
    return out
