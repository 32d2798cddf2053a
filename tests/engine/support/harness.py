"""Drive an in-process LLMEngine synchronously: submit requests, step until done, collect per choice."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from conduit_engine.config import (
    CacheConfig,
    DisaggregationConfig,
    EngineConfig,
    LoraConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from conduit_engine.engine.llm_engine import LLMEngine
from conduit_engine.engine.request import GenerationRequest, RequestOutput
from conduit_engine.sampling_params import SamplingParams
from conduit_engine.speculation.config import SpeculativeConfig


@dataclass
class Collected:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    outputs: list[RequestOutput] = field(default_factory=list)

    @property
    def final(self) -> RequestOutput:
        return self.outputs[-1]


def make_engine(
    model: Path,
    *,
    num_blocks: int | None = 256,
    block_size: int = 16,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 2048,
    enable_prefix_caching: bool = True,
    max_queued_requests: int = 1024,
    dtype: str = "float32",
    generation_config: str = "auto",
    max_model_len: int | None = None,
    tensor_parallel_size: int = 1,
    worker_process: bool = False,
    role: str = "both",
    cpu_kernels: str = "auto",
    max_decode_steps: int = 8,
    decode_burst_ms: float = 5.0,
    speculative: SpeculativeConfig | None = None,
    quantization: str = "none",
    kv_cache_dtype: str = "auto",
    lora: LoraConfig | None = None,
) -> LLMEngine:
    """An engine on `model`; with tensor_parallel_size > 1 or worker_process, its worker processes run
    until `engine.shutdown()`."""
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(
                path=str(model),
                dtype=dtype,
                generation_config=generation_config,
                max_model_len=max_model_len,
                cpu_kernels=cpu_kernels,
                quantization=quantization,
            ),
            cache=CacheConfig(
                block_size=block_size,
                num_blocks=num_blocks,
                enable_prefix_caching=enable_prefix_caching,
                kv_cache_dtype=kv_cache_dtype,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_queued_requests=max_queued_requests,
                max_decode_steps=max_decode_steps,
                decode_burst_ms=decode_burst_ms,
            ),
            parallel=ParallelConfig(tensor_parallel_size, worker_process),
            disaggregation=DisaggregationConfig(role=role),
            speculative=speculative,
            lora=lora or LoraConfig(),
        )
    )


def greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)  # type: ignore[arg-type]


def run_to_completion(engine: LLMEngine, max_steps: int = 100_000) -> dict[tuple[str, int], Collected]:
    results: dict[tuple[str, int], Collected] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            break
        for out in engine.step():
            c = results.setdefault((out.request_id, out.index), Collected())
            c.token_ids.extend(out.token_ids)
            c.text += out.text
            c.outputs.append(out)
    assert not engine.has_work(), "engine did not finish"
    engine.check_integrity()
    assert engine.block_manager.stats().used == 0
    return results


def generate(
    engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams
) -> dict[str, Collected]:
    for rid, ids in prompts.items():
        engine.add_request(GenerationRequest(rid, params, token_ids=ids))
    return {rid: c for (rid, _), c in run_to_completion(engine).items()}
