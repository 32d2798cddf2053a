"""CPU ops backend on the kernels of kernels/cpu (AVX-512 with or without BF16, AVX2, or portable C++),
and the start-up choice between it and the torch reference (`select_cpu_ops`).

`CpuOps` is `TorchOps` with the step's hot ops replaced: linear on weights prepacked at load (tiles that
stream each weight once per call, at any batch size; int8 weights as W8A8 panels multiplied with VNNI,
AVX-512 BW, AVX2 or portable integer tiles), RMSNorm with and without the residual add, rotary,
the gated activations, KV-cache writes, and paged attention that reads the KV blocks in place (decode and
prefill chunks, sliding windows, soft-capping). `compile_decoder` runs all decoder layers of a step as
one C++ call composed of the same kernels, so a small model pays no Python per op. KV transfer and
grammar masking stay TorchOps'. LoRA deltas (kernels/cpu/lora.cpp) run per adapter slot on the same
linear kernels, inside the compiled decoder too. Every kernel is checked against TorchOps in
tests/kernels/test_cpu_ops.py, and the whole model against transformers in test_cpu_model_parity.py, on
every instruction set the machine runs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from types import ModuleType

import torch

from conduit_engine.config import CPU_KERNEL_CHOICES
from conduit_engine.errors import ModelLoadError
from conduit_engine.ops import cpu_kernels
from conduit_engine.ops.base import DecoderLayerSpec, DecoderRunner, LoraBatch, LoraWeights, Ops, StepContext
from conduit_engine.ops.torch_ops import TorchOps

log = logging.getLogger(__name__)


class CpuOps(TorchOps):
    name = "cpu"

    def __init__(self, isa: str, kernels: ModuleType | None = None) -> None:
        module = kernels if kernels is not None else cpu_kernels.load()
        supported = tuple(module.supported_isas())
        if isa not in supported:
            raise ValueError(f"this CPU cannot run the {isa} kernels (it runs: {', '.join(supported)})")
        self.isa = isa
        self._module = module
        self._k = getattr(module, isa)
        # Prepacked linear weights (kernels/cpu/common.h panels), by the address of the weight's data.
        self._packed: dict[int, object] = {}
        # The LoRA pools' C++ views, by the pool's id (kept with the pool, so the id stays its own).
        self._lora_layers: dict[int, tuple[LoraWeights, object]] = {}

    def describe(self) -> str:
        return f"cpu kernels ({self.isa}), {len(self._packed)} weights prepacked"

    def compile_decoder(self, layers: Sequence[DecoderLayerSpec]) -> DecoderRunner:
        """All layers as one C++ call per step (kernels/cpu/decoder.cpp), composing these same kernels."""
        stack = self._k.decoder_stack([self._layer_weights(spec) for spec in layers])
        return _CompiledDecoder(self._module, stack)

    def prepare_linear(self, weight: torch.Tensor, weight_scale: torch.Tensor | None = None) -> None:
        self._packed_for(weight, weight_scale)

    def quantize_weight(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if weight.dtype in (torch.float32, torch.bfloat16) and weight.is_contiguous():
            return self._module.quantize_rows(weight.detach())  # the reference's bits, one pass, threaded
        return super().quantize_weight(weight)

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        weight_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        packed = self._packed.get(weight.data_ptr())
        if packed is not None:
            return packed.forward(x, bias)
        if weight_scale is not None:  # int8 weights: packed on first use (the tiles need panels)
            return self._packed_for(weight, weight_scale).forward(x, bias)
        # unprepared weights: the unpacked tiles for small batches, else torch's GEMM (ops.cpp)
        return self._k.linear(x, weight, bias)

    def _packed_for(self, weight: torch.Tensor, weight_scale: torch.Tensor | None = None) -> object:
        """The prepacked weight; an int8 one (W8A8, kernels/cpu/int8_impl.h) must come with its scales
        the first time (prepare_linear), after which the decoder stack finds it by the weight alone."""
        packed = self._packed.get(weight.data_ptr())
        if packed is None:
            if weight.dtype == torch.int8:
                if weight_scale is None:
                    raise ValueError("an int8 linear weight needs its weight_scale")
                packed = self._k.pack_linear_int8(weight.detach(), weight_scale.detach())
            else:
                packed = self._k.pack_linear(weight.detach())
            self._packed[weight.data_ptr()] = packed
        return packed

    def _layer_weights(self, spec: DecoderLayerSpec) -> object:
        weights = self._module.LayerWeights()
        for name in _LAYER_TENSORS:
            setattr(weights, name, getattr(spec, name))
        for name in ("qkv", "o", "gate_up", "down"):
            setattr(weights, name, self._packed_for(getattr(spec, name)))
        weights.num_heads, weights.num_kv_heads, weights.head_dim = (
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
        )
        weights.scale, weights.eps, weights.gelu = spec.scale, spec.eps, spec.gelu
        weights.window = spec.sliding_window or 0
        weights.softcap = spec.logit_softcap or 0.0
        for name in ("qkv_lora", "o_lora", "gate_up_lora", "down_lora"):
            pool = getattr(spec, name)
            if pool is not None:
                setattr(weights, name, self._lora_layer(pool))
        return weights

    def _lora_layer(self, w: LoraWeights) -> object:
        """The C++ view of a LoRA pool (its tensors themselves: slots written later are seen)."""
        layer = self._lora_layers.get(id(w))
        if layer is None:
            layer = self._lora_layers[id(w)] = (w, self._module.LoraLayer(w.a, w.b, list(w.splits)))
        return layer[1]

    def lora_delta(self, y: torch.Tensor, x: torch.Tensor, w: LoraWeights, batch: LoraBatch) -> None:
        self._k.lora_delta(y, x, self._lora_layer(w), batch.row_slots)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # per-head q/k norms: [T, H, D]
        return self._k.rms_norm(rows, weight, eps).view(x.shape)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._k.add_rms_norm(x, residual, weight, eps)

    def rotary_embedding(self, q: torch.Tensor, k: torch.Tensor, step: StepContext) -> None:
        self._k.rotary(q, k, step.positions, step.cos_sin_cache)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._k.silu_and_mul(x)

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._k.gelu_tanh_and_mul(x)

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        self._k.write_kv(k, v, k_cache, v_cache, slot_mapping)

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        step: StepContext,
        scale: float,
        *,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> torch.Tensor:
        meta = step.meta
        return self._k.attention(
            q,
            k_cache,
            v_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            scale,
            sliding_window or 0,
            logit_softcap or 0.0,
        )


class _CompiledDecoder:
    """Runs the decoder stack; the step's tensors go to C++ once per step (in the step's scratch)."""

    def __init__(self, module: ModuleType, stack: object) -> None:
        self._step_tensors = module.StepTensors
        self._stack = stack

    def __call__(
        self, x: torch.Tensor, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], step: StepContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tensors = step.scratch.get("cpu_step")
        if tensors is None:
            meta = step.meta
            tensors = step.scratch["cpu_step"] = self._step_tensors(
                step.positions,
                step.cos_sin_cache,
                meta.slot_mapping,
                meta.query_start_loc,
                meta.seq_lens,
                meta.block_tables,
                None if step.lora is None else step.lora.row_slots,
            )
        return self._stack.forward(x, kv_caches, tensors)


# DecoderLayerSpec's tensors that go to the stack as they are (the projections go prepacked).
_LAYER_TENSORS = (
    "input_norm",
    "post_attention_norm",
    "pre_feedforward_norm",
    "post_feedforward_norm",
    "qkv_bias",
    "q_norm",
    "k_norm",
    "o_bias",
    "gate_up_bias",
    "down_bias",
)


def select_cpu_ops(choice: str) -> Ops:
    """The ops of `--cpu-kernels`: auto (the best instruction set this CPU runs, else the torch ops
    with a log line saying why), torch (the reference), or one instruction set (an error if it cannot
    run here)."""
    if choice not in CPU_KERNEL_CHOICES:
        raise ModelLoadError(f"--cpu-kernels must be one of {', '.join(CPU_KERNEL_CHOICES)}, got {choice!r}")
    if choice == "torch":
        log.info("CPU ops: torch (--cpu-kernels torch)")
        return TorchOps()
    try:
        isas = cpu_kernels.supported_isas()
    except cpu_kernels.CpuKernelsUnavailable as exc:
        if choice != "auto":
            raise ModelLoadError(f"--cpu-kernels {choice}: {exc}") from exc
        log.warning("CPU ops: torch, because the CPU kernels are unavailable: %s", exc)
        return TorchOps()
    isa = isas[0] if choice == "auto" else choice
    if isa not in isas:
        raise ModelLoadError(f"--cpu-kernels {choice}: this CPU runs only {', '.join(isas)}")
    log.info("CPU ops: kernels/cpu for %s (this CPU runs %s)", isa, ", ".join(isas))
    return CpuOps(isa)
