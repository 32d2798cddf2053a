"""Which linear weights load as int8, and the checkpoint quantization configs Conduit understands.

Two sources of int8 weights (both W8A8 at run time: ops/quant.py):
- `--quantization int8`: every float projection weight is quantized at load, one scale per output
  channel, the LM head too unless `--quantize-lm-head false` (measured: on a 32k vocabulary the float
  head is about half of what an int8 decode step reads; on stories260K int8 costs it no perplexity);
  the embedding stays in the compute dtype;
- a compressed-tensors checkpoint (config.json `quantization_config.quant_method` "compressed-tensors",
  format "int-quantized" or "naive-quantized"): its `*.weight` int8 tensors with `*.weight_scale`
  (per channel [N, 1] or per tensor [1]) load as they are, without re-quantizing; the layers it leaves
  in float (its `ignore` list) stay float.
Any other quantization config (GPTQ, AWQ, FP8, 4-bit, static activation scales, a quantized KV cache,
group-wise or asymmetric weights) is refused at start with a ModelLoadError naming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conduit_engine.config import QUANTIZATION_CHOICES
from conduit_engine.errors import ModelLoadError

_FORMATS = ("int-quantized", "naive-quantized")


@dataclass(frozen=True, slots=True)
class QuantizationPlan:
    """What load_model does with the projections: quantize float weights at load (`quantize_float`),
    and whether the LM head is among them; int8 checkpoint tensors always load as int8."""

    quantize_float: bool = False
    quantize_lm_head: bool = True
    checkpoint: str | None = None  # the checkpoint's own scheme ("compressed-tensors W8A8 int8"), if any

    @property
    def active(self) -> bool:
        return self.quantize_float or self.checkpoint is not None

    def describe(self) -> str:
        parts = []
        if self.checkpoint:
            parts.append(f"{self.checkpoint} checkpoint")
        if self.quantize_float:
            parts.append(
                "int8 weights quantized at load" + (" (LM head too)" if self.quantize_lm_head else "")
            )
        return ", ".join(parts) or "no quantization"


def plan_quantization(
    folder: Path, quantization: str = "none", quantize_lm_head: bool = True
) -> QuantizationPlan:
    """The plan for `folder` under `--quantization` (raises ModelLoadError for an unsupported
    `--quantization` value or checkpoint config, naming it)."""
    if quantization not in QUANTIZATION_CHOICES:
        raise ModelLoadError(
            f"--quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {quantization!r}"
        )
    checkpoint = checkpoint_scheme(folder)
    return QuantizationPlan(
        quantize_float=quantization == "int8",
        quantize_lm_head=quantize_lm_head and quantization == "int8",
        checkpoint=checkpoint,
    )


def checkpoint_scheme(folder: Path) -> str | None:
    """None for a float checkpoint; a description of a supported quantized one; ModelLoadError else."""
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # the config reader reports a missing or broken config.json
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ModelLoadError(f"{path}: quantization_config must be an object")
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise ModelLoadError(
            f"{path}: quantization_config.quant_method {method!r} is not supported "
            "(Conduit loads compressed-tensors W8A8 int8 checkpoints, or quantizes float ones: "
            "--quantization int8)"
        )
    fmt = qc.get("format")
    if fmt not in _FORMATS:
        raise ModelLoadError(
            f"{path}: quantization_config.format {fmt!r} is not supported (supported: {', '.join(_FORMATS)})"
        )
    if qc.get("kv_cache_scheme") is not None:
        raise ModelLoadError(f"{path}: quantization_config.kv_cache_scheme is not supported")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise ModelLoadError(f"{path}: quantization_config.config_groups is empty")
    strategies = set()
    for name, group in groups.items():
        where = f"{path}: quantization_config.config_groups.{name}"
        if not isinstance(group, dict):
            raise ModelLoadError(f"{where} must be an object")
        strategies.add(_check_weights(group.get("weights"), f"{where}.weights"))
        _check_activations(group.get("input_activations"), f"{where}.input_activations")
        if group.get("output_activations") is not None:
            raise ModelLoadError(f"{where}.output_activations is not supported")
    return f"compressed-tensors W8A8 int8 ({'/'.join(sorted(strategies))} weight scales)"


def _check_weights(w: Any, where: str) -> str:
    if not isinstance(w, dict):
        raise ModelLoadError(f"{where}: int8 weights are required")
    _check_int8(w, where)
    strategy = w.get("strategy")
    if strategy not in ("channel", "tensor"):
        raise ModelLoadError(f"{where}.strategy {strategy!r} is not supported (channel or tensor)")
    if w.get("dynamic"):
        raise ModelLoadError(f"{where}.dynamic true is not supported")
    return str(strategy)


def _check_activations(a: Any, where: str) -> None:
    if a is None:
        return  # weight-only: the activations are still quantized per token at run time
    if not isinstance(a, dict):
        raise ModelLoadError(f"{where} must be an object")
    _check_int8(a, where)
    if not a.get("dynamic"):
        raise ModelLoadError(f"{where}: static activation scales are not supported (dynamic per-token only)")
    if a.get("strategy") not in ("token", "tensor"):
        raise ModelLoadError(f"{where}.strategy {a.get('strategy')!r} is not supported (token)")


def _check_int8(spec: dict[str, Any], where: str) -> None:
    if spec.get("type", "int") != "int" or spec.get("num_bits") != 8:
        raise ModelLoadError(
            f"{where}: {spec.get('type', 'int')}{spec.get('num_bits')} is not supported (8-bit int only)"
        )
    if spec.get("symmetric") is False:
        raise ModelLoadError(f"{where}.symmetric false is not supported")
    if spec.get("group_size") is not None:
        raise ModelLoadError(f"{where}.group_size is not supported")
