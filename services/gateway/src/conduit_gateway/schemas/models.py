"""GET /v1/models shapes."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "conduit"
    max_model_len: int | None = None
    root: str | None = Field(None, description="A LoRA adapter: the folder or Hub id it was loaded from.")
    parent: str | None = Field(None, description="A LoRA adapter: the base model it adapts.")


class LoadLoraAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's shape; base_model: which model's engines, when several)."""

    lora_name: str
    lora_path: str
    base_model: str | None = None


class UnloadLoraAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter (vLLM's shape)."""

    lora_name: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
