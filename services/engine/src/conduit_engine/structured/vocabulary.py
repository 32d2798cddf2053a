"""The grammar backend's view of the model's vocabulary (`GrammarVocab`), built once at start-up.

Built from the model's tokenizer.json (`ModelTokenizer.hf`, a `tokenizers.Tokenizer`) with:
- the model's vocabulary size, the width of its logits. It may exceed the tokenizer's (lm_head padded
  to a multiple of 64 or 128): the extra ids have no text and are never allowed. It may also be smaller
  (added tokens the model cannot produce): those ids are dropped.
- the model's EOS ids (config.json and generation_config.json, as the engine reads them): a grammar
  allows them exactly where the structure is complete.
- special tokens (`<s>`, `<unk>`, chat markers) with no text, so a grammar never allows them as text
  (the output drops them, so a JSON string "containing" `<s>` would not be what the client receives).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from conduit_engine.structured.backend import xgrammar as xgr


@dataclass(frozen=True, eq=False)
class GrammarVocab:
    """info: what grammars are compiled against; token_bytes[i]: the bytes token i adds to the output
    text with special tokens spelled out (the `after` gate reads these); words: int32 words per
    bitmask row."""

    info: xgr.TokenizerInfo
    token_bytes: tuple[bytes, ...] = field(repr=False)
    eos_token_ids: tuple[int, ...]
    vocab_size: int

    @property
    def words(self) -> int:
        return (self.vocab_size + 31) // 32

    @classmethod
    def from_tokenizer(
        cls, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]
    ) -> GrammarVocab:
        """`vocab_size`: the model's (its logits' width); `eos_token_ids`: the model's EOS ids."""
        eos = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        if vocab_size <= 0:
            raise ValueError(f"vocab_size: must be positive, got {vocab_size}")
        if not eos or not all(0 <= i < vocab_size for i in eos):
            raise ValueError(f"eos_token_ids: need at least one id in [0, {vocab_size}), got {list(eos)}")
        # The public constructor detects how the vocabulary spells bytes (byte-fallback, byte-level,
        # raw) and whether SentencePiece adds a prefix space; its decoded vocabulary is the gate's view.
        detected = xgr.TokenizerInfo.from_huggingface(
            PreTrainedTokenizerFast(tokenizer_object=tokenizer),
            vocab_size=vocab_size,
            stop_token_ids=list(eos),
        )
        encoded = [""] * vocab_size
        for token, token_id in tokenizer.get_vocab(with_added_tokens=True).items():
            if token_id < vocab_size:
                encoded[token_id] = token
        # An empty entry is a special token to the backend: never allowed as text.
        for token_id, added in tokenizer.get_added_tokens_decoder().items():
            if added.special and token_id < vocab_size:
                encoded[token_id] = ""
        info = xgr.TokenizerInfo(
            encoded,
            vocab_type=detected.vocab_type,
            vocab_size=vocab_size,
            stop_token_ids=list(eos),
            add_prefix_space=detected.add_prefix_space,
        )
        return cls(
            info=info,
            token_bytes=tuple(detected.decoded_vocab),
            eos_token_ids=eos,
            vocab_size=vocab_size,
        )
