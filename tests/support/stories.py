"""Known facts of the stories260K test model (../shared/models/stories260K; see DATA.md), for exact asserts.

Transformers reproduces both with the same folder, so they are references for parity, not just examples.
"""

from __future__ import annotations

MODEL = "stories260K"

# `PROMPT` encodes to `PROMPT_IDS`: BOS (1), then its four tokens.
PROMPT = "Once upon a time"
PROMPT_IDS = (1, 403, 407, 261, 378)

# From the single BOS token, `KNOWN_STORY_TOKENS` greedy tokens decode to `KNOWN_STORY`.
KNOWN_STORY_TOKENS = 62
KNOWN_STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
    "One day, she saw a big, red ball. She wanted to play with it, but it was too high."
)
