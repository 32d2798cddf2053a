"""Shared pieces of the structured-output tests: the stories260K grammar vocabulary, compiling a spec,
and a small batched decode loop on the real model that masks, samples and accepts like the engine will.

The loop is the engine's step reduced to what grammars touch: per step, every live sequence's last
logits row (transformers on ../shared/models/stories260K, KV-cached per sequence) is stacked into one
[B, V] batch; `BitmaskBuilder` fills the constrained rows; `apply_grammar_mask` masks them through
`TorchOps`; the real `Sampler` picks the tokens; each state accepts its token; a sequence ends on EOS,
on `GrammarState.is_finished`, or at max_tokens.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import torch

from conduit_engine.core.stop_rules import blocked_token_ids
from conduit_engine.models.architectures import read_arch_config
from conduit_engine.models.tokenizer import ModelTokenizer
from conduit_engine.ops.torch_ops import TorchOps
from conduit_engine.sampling.grammar_mask import apply_grammar_mask
from conduit_engine.sampling.metadata import build_sampling_metadata
from conduit_engine.sampling.plan import SamplingRow
from conduit_engine.sampling.sampler import Sampler
from conduit_engine.sampling_params import SamplingParams
from conduit_engine.structured.batch_mask import BitmaskBuilder
from conduit_engine.structured.compiler import CompiledStructure, StructuredCompiler
from conduit_engine.structured.spec import StructuredSpec
from conduit_engine.structured.state import GrammarState
from conduit_engine.structured.vocabulary import GrammarVocab
from tests.engine.support.model_factory import load_hf


@functools.cache
def stories_vocab(folder: Path) -> GrammarVocab:
    arch = read_arch_config(folder)
    return GrammarVocab.from_tokenizer(ModelTokenizer(folder).hf, arch.vocab_size, arch.eos_token_ids)


@functools.cache
def stories_compiler(folder: Path) -> StructuredCompiler:
    return StructuredCompiler(stories_vocab(folder))


def spell(vocab: GrammarVocab, text: str) -> list[int]:
    """Token ids spelling `text` exactly (greedy longest match over the vocabulary's bytes), without the
    SentencePiece prefix space that encoding adds at the start; special tokens are never used."""
    special = set(vocab.info.special_token_ids) | set(vocab.eos_token_ids)
    by_bytes = {b: i for i, b in enumerate(vocab.token_bytes) if b and i not in special}
    longest = max(map(len, by_bytes))
    data, ids = text.encode(), []
    while data:
        size = next(n for n in range(min(longest, len(data)), 0, -1) if data[:n] in by_bytes)
        ids.append(by_bytes[data[:size]])
        data = data[size:]
    return ids


def compile_spec(folder: Path, spec: StructuredSpec) -> CompiledStructure:
    return stories_compiler(folder).submit(spec).result(timeout=120)


@dataclass
class Choice:
    """One sequence of the loop: its state (None: unconstrained) and sampling parameters."""

    state: GrammarState | None
    params: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0, max_tokens=64))
    tokens: list[int] = field(default_factory=list)
    finished_by: str | None = None  # "eos", "grammar" or "length"


@torch.inference_mode()
def decode(folder: Path, prompt: list[int], choices: list[Choice]) -> list[Choice]:
    """Run every choice to its end in one batch; return them with tokens and finished_by filled."""
    model = load_hf(folder)
    eos = read_arch_config(folder).eos_token_ids
    builder = BitmaskBuilder(model.config.vocab_size)
    ops, sampler = TorchOps(), Sampler(seed=0)
    caches: list[object] = [None] * len(choices)
    inputs = [torch.tensor([prompt]) for _ in choices]
    while live := [i for i, c in enumerate(choices) if c.finished_by is None]:
        rows = []
        for i in live:
            out = model(input_ids=inputs[i], past_key_values=caches[i], use_cache=True)
            caches[i] = out.past_key_values
            rows.append(out.logits[0, -1].float())
        logits = torch.stack(rows)
        mask = builder.build([(r, choices[i].state) for r, i in enumerate(live) if choices[i].state])
        apply_grammar_mask(logits, mask, ops)
        meta = build_sampling_metadata(
            [_row(choices[i], prompt, eos) for i in live],
            logits.shape[1],
            logits.device,
        )
        for i, token in zip(live, sampler(logits, meta).token_ids, strict=True):
            _advance(choices[i], token, eos)
            inputs[i] = torch.tensor([[token]])
    return choices


def _row(choice: Choice, prompt: list[int], eos: tuple[int, ...]) -> SamplingRow:
    blocked = blocked_token_ids(choice.params, eos, len(choice.tokens))
    return SamplingRow(choice.params, prompt, choice.tokens, None, blocked)


def _advance(choice: Choice, token: int, eos: tuple[int, ...]) -> None:
    """The engine's postprocess for one sampled token (accept_token happens after sampling)."""
    choice.tokens.append(token)
    state = choice.state
    if state is not None and not state.accept(token):
        raise AssertionError(f"the grammar rejected sampled token {token} after {choice.tokens[:-1]}")
    if token in eos:
        choice.finished_by = "eos"
    elif state is not None and state.is_finished:
        choice.finished_by = "grammar"
    elif len(choice.tokens) >= choice.params.max_tokens:
        choice.finished_by = "length"
