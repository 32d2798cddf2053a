"""Speculative decoding's draft model (method draft_model): found like the target and checked against it
before a weight is loaded. Torch-free."""

from __future__ import annotations

from pathlib import Path

from conduit_engine.errors import ModelLoadError
from conduit_engine.models import source as model_source
from conduit_engine.models.architectures import read_arch_config
from conduit_engine.models.config import ArchConfig
from conduit_engine.models.facts import ModelFacts
from conduit_engine.models.tokenizer import ModelTokenizer

_FIELD = "--speculative-config: model"


def check_draft(
    model: str, target: ModelFacts, revision: str | None = None, download_dir: str | None = None
) -> tuple[Path, ArchConfig]:
    """The draft's folder and architecture; ModelLoadError naming the field when it cannot propose for
    `target`: another vocabulary (size or tokens), or a sliding window (on either model)."""
    try:
        folder = model_source.resolve(model, revision, download_dir).folder
        arch = read_arch_config(folder)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{_FIELD}: {exc}") from None
    if arch.vocab_size != target.arch.vocab_size:
        raise ModelLoadError(
            f"{_FIELD}: the draft's vocabulary has {arch.vocab_size} tokens, the target's "
            f"{target.arch.vocab_size}: a draft must share the target's vocabulary"
        )
    if (folder / "tokenizer.json").is_file() or (folder / "tokenizer.model").is_file():
        draft_vocab = ModelTokenizer(folder).hf.get_vocab(with_added_tokens=True)
        if draft_vocab != target.tokenizer.hf.get_vocab(with_added_tokens=True):
            raise ModelLoadError(
                f"{_FIELD}: the draft's tokenizer maps tokens to other ids than the target's: a draft must "
                "share the target's vocabulary"
            )
    if arch.uniform_window is not None or target.arch.uniform_window is not None:
        raise ModelLoadError(f"{_FIELD}: models with a sliding window cannot use a draft model yet")
    return folder, arch
