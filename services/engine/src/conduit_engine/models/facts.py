"""What the engine learns about its model without loading a weight: where it is (a folder, or a Hub id
resolved to its snapshot), its architecture, tokenizer, EOS ids, generation defaults, context length and
compute dtype. Torch-free: the engine process reads these before (or without) importing the model code."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from conduit_engine.config import EngineConfig
from conduit_engine.errors import ModelLoadError
from conduit_engine.models import source as model_source
from conduit_engine.models.architectures import read_arch_config
from conduit_engine.models.config import ArchConfig
from conduit_engine.models.generation_defaults import GenerationDefaults, read_generation_defaults
from conduit_engine.models.prompt_bound import prompt_bound
from conduit_engine.models.tokenizer import ModelTokenizer

log = logging.getLogger(__name__)

# Compute dtypes by name, with their bytes per element.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the engine learns from the model folder and the flags, without loading any weight."""

    name: str  # served model name
    folder: Path  # the local folder (a Hub id resolved to its snapshot)
    arch: ArchConfig
    tokenizer: ModelTokenizer
    eos_token_ids: tuple[int, ...]
    generation_defaults: GenerationDefaults
    max_model_len: int
    dtype: str  # a DTYPE_BYTES name: the weights' and the KV cache's dtype


def describe(config: EngineConfig) -> ModelFacts:
    """Find the model of `config` and read its config, tokenizer and generation defaults; raises
    ModelLoadError with a clear message."""
    mc = config.model
    source = model_source.resolve(mc.path, mc.revision, mc.download_dir)
    folder = source.folder
    arch = read_arch_config(folder)
    tokenizer = ModelTokenizer(folder)
    defaults = read_generation_defaults(folder, mc.generation_config)
    log.info(
        "generation defaults from %s (--generation-config %s): %s",
        folder.name,
        mc.generation_config,
        defaults.described,
    )
    return ModelFacts(
        name=mc.served_name or source.name,
        folder=folder,
        arch=arch,
        tokenizer=tokenizer,
        eos_token_ids=eos_token_ids(arch, defaults),
        generation_defaults=defaults,
        max_model_len=max_model_len(config, arch),
        dtype=resolve_dtype(mc.dtype, arch, mc.device),
    )


def resolve_dtype(requested: str, arch: ArchConfig, device: str) -> str:
    """--dtype, or for `auto` the checkpoint's dtype, except float16 on the CPU (computed in float32:
    the CPU has no fast float16 matmul)."""
    if requested != "auto":
        return requested
    if arch.torch_dtype in DTYPE_BYTES and not (device == "cpu" and arch.torch_dtype == "float16"):
        return arch.torch_dtype
    return "float32"


def eos_token_ids(arch: ArchConfig, defaults: GenerationDefaults) -> tuple[int, ...]:
    """The EOS ids of config.json and generation_config.json that lie within the vocabulary."""
    ids = list(dict.fromkeys((*arch.eos_token_ids, *defaults.eos_token_ids)))
    # An id the model has no logit for can never be sampled; keeping it would only mislead.
    return tuple(i for i in ids if 0 <= i < arch.vocab_size)


def max_model_len(config: EngineConfig, arch: ArchConfig) -> int:
    """The longest prompt + completion: --max-model-len, which may not exceed the model's own limit."""
    limit = arch.context_limit
    requested = config.model.max_model_len
    if requested is None:
        return limit
    if requested > limit:
        raise ModelLoadError(f"--max-model-len {requested} exceeds the model's limit of {limit}")
    return requested


def request_bytes_limit(config: EngineConfig) -> int | None:
    """The largest legitimate Generate or Tokenize message for a model in a local folder (read before the
    gRPC server starts, so that its receive limit can be this rather than --grpc-max-message-bytes);
    None for a Hub id (not fetched yet), a tokenizer without a byte bound, or a folder that will fail to
    load (the load reports why)."""
    folder = Path(config.model.path).expanduser()
    if not folder.is_dir():
        return None
    try:
        tokenizer = ModelTokenizer(folder)
        context = max_model_len(config, read_arch_config(folder))
    except (ModelLoadError, OSError, ValueError):
        return None
    return prompt_bound(tokenizer.hf, context).max_request_bytes
