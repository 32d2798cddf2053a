"""Parsers of generated text: reasoning (`reasoning/`) and tool calls (`tool_calls/`), each a registry of
small formats, plus what they share (`markers.py`). They work on streamed text and are chunk-invariant:
whatever the split of the text into deltas, the concatenated output is the same, so a non-streamed
response is the streamed parse of its whole text in one piece."""
