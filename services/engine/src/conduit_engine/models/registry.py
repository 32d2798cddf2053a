"""The model class of each architecture `models/architectures.py` names."""

from __future__ import annotations

from conduit_engine.models.base import CausalLM
from conduit_engine.models.gemma2 import Gemma2ForCausalLM
from conduit_engine.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from conduit_engine.models.phi3 import Phi3ForCausalLM
from conduit_engine.models.qwen3 import Qwen3ForCausalLM

_CLASSES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
}


def model_class(architecture: str) -> type[CausalLM]:
    """The class of an architecture `architectures.arch_config` accepted."""
    return _CLASSES[architecture]
