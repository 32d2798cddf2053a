"""`conduit-engine`: command-line flags and CONDUIT_* environment variables → EngineConfig, in one place.

Every flag `--some-flag` can also be set as `CONDUIT_SOME_FLAG`; an explicit flag wins over the variable.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from conduit_common import logs
from conduit_common.env_flags import add_bool_flag, apply_env_defaults, describe_env, env_name, flag_bool
from conduit_common.secret_files import SecretFileError
from conduit_engine.config import (
    CacheConfig,
    DisaggregationConfig,
    EngineConfig,
    LoraConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SecurityConfig,
    ServerConfig,
    TelemetryConfig,
)
from conduit_engine.errors import ModelLoadError, WorkerFailedError
from conduit_engine.models.source import quiet_progress_bars
from conduit_engine.speculation.config import parse_speculative_config

# (flag, type, default, help). None as default means "not set".
FLAGS: tuple[tuple[str, Any, Any, str], ...] = (
    ("--model", str, None, "a Hugging Face model folder, or a Hub id org/name (downloaded into the cache)"),
    ("--revision", str, None, "Hub ids: the branch, tag or commit to serve (default: main)"),
    ("--download-dir", str, None, "Hub ids: download into this cache folder (default: huggingface_hub's)"),
    ("--served-model-name", str, None, "name reported to clients (default: the Hub id or folder name)"),
    ("--host", str, "0.0.0.0", "address to listen on"),
    ("--port", int, 50051, "gRPC port"),
    (
        "--device",
        str,
        "cpu",
        "cpu (the C++ kernels of kernels/cpu, or torch: --cpu-kernels) or cuda (CuPy kernels)",
    ),
    (
        "--dtype",
        str,
        "auto",
        "auto (the checkpoint's; float16 runs in float32 on cpu), float32, bfloat16, float16",
    ),
    (
        "--generation-config",
        str,
        "auto",
        "auto: generation_config.json's EOS ids and sampling defaults; vllm: its EOS ids; none: ignore it",
    ),
    ("--max-model-len", int, None, "longest prompt + completion (default: the model's limit)"),
    ("--max-num-seqs", int, 64, "most sequences in one batch"),
    ("--max-num-batched-tokens", int, 2048, "token budget of one step (chunked prefill)"),
    ("--max-queued-requests", int, 1024, "waiting-queue bound; beyond it Generate fails RESOURCE_EXHAUSTED"),
    (
        "--tokenizer-threads",
        int,
        2,
        "threads that tokenize prompts and render chat templates (off the step loop)",
    ),
    (
        "--queued-hold-fraction",
        float,
        0.5,
        "share of the KV blocks waiting requests may hold on their cached prefix (0: only move it to the "
        "back of the eviction order)",
    ),
    ("--block-size", int, 16, "KV cache block size in tokens (power of two)"),
    ("--kv-cache-blocks", int, None, "number of KV cache blocks (default: from the memory fraction)"),
    ("--kv-cache-memory-fraction", float, 0.1, "share of memory for the KV cache when blocks are not given"),
    (
        "--kv-cache-dtype",
        str,
        "auto",
        "auto (the compute dtype), int8 or fp8 (e4m3): one byte per value + a scale per token and head",
    ),
    ("--enable-prefix-caching", flag_bool, True, "reuse cached KV blocks of shared prompt prefixes"),
    ("--enable-chunked-prefill", flag_bool, True, "split long prompts over several steps"),
    (
        "--max-decode-steps",
        int,
        8,
        "forward passes a step of pure decodes may run back to back (1: one pass per step)",
    ),
    ("--decode-burst-ms", float, 5.0, "longest time those passes may take together"),
    (
        "--speculative-config",
        str,
        None,
        'speculative decoding, JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 5} (default: off)',
    ),
    ("--enforce-eager", flag_bool, False, "on cuda: do not capture CUDA graphs"),
    (
        "--tensor-parallel-size",
        int,
        1,
        "shard the model over this many worker processes (one per GPU on cuda; gloo between CPU processes)",
    ),
    (
        "--worker-process",
        flag_bool,
        False,
        "with --tensor-parallel-size 1: run the model in a worker process",
    ),
    (
        "--drain-seconds",
        float,
        30.0,
        "on SIGTERM, how long in-flight streams may finish before the rest are handed back for migration",
    ),
    ("--grpc-max-message-bytes", int, 64 * 1024 * 1024, "largest gRPC message sent or received"),
    ("--grpc-keepalive", float, 30.0, "HTTP/2 keepalive ping period towards clients, seconds"),
    ("--grpc-min-ping-interval", float, 5.0, "clients may ping no more often than this, seconds"),
    ("--role", str, "both", "both | prefill | decode: the sides of disaggregated requests it serves"),
    (
        "--advertise-address",
        str,
        None,
        "HOST:PORT other engines pull KV from (default: --host:--port; the host name when --host is 0.0.0.0)",
    ),
    ("--kv-transfer-lease-seconds", float, 30.0, "how long a prefill's KV stays pinned for a decode engine"),
    ("--kv-transfer-chunk-bytes", int, 4 * 1024 * 1024, "KV bytes per PullKv message (whole blocks)"),
    ("--kv-transfer-timeout", float, 60.0, "deadline of one KV pull from a prefill engine, seconds"),
    (
        "--kv-transport",
        str,
        "grpc",
        "grpc | shm (shared memory with engines on this host) | nixl (NIXL/UCX one-sided reads): how KV "
        "blocks move between engines; both engines of a pull must name it, else gRPC",
    ),
    ("--tls-cert", str, None, "PEM server certificate (chain): serve gRPC over TLS (with --tls-key)"),
    ("--tls-key", str, None, "PEM private key of --tls-cert"),
    ("--tls-client-ca", str, None, "PEM CA: require client certificates it signed (mTLS)"),
    ("--auth-token-file", str, None, "file holding the bearer token every RPC but health must present"),
    ("--reflection-public", flag_bool, False, "with --auth-token-file: serve reflection without the token"),
    ("--engine-tls-ca", str, None, "towards other engines (PullKv): PEM CA their certificates chain to"),
    ("--engine-tls-cert", str, None, "towards other engines: PEM client certificate (mTLS)"),
    ("--engine-tls-key", str, None, "towards other engines: PEM private key of --engine-tls-cert"),
    ("--engine-tls-server-name", str, None, "towards other engines: name their certificates carry"),
    ("--engine-auth-token-file", str, None, "towards other engines: file holding their bearer token"),
    ("--seed", int, 0, "seed of the engine's unseeded random draws"),
    ("--num-threads", int, 0, "torch CPU threads; 0 = auto (1 for models under 20M parameters)"),
    (
        "--cpu-kernels",
        str,
        "auto",
        "on cpu: auto (kernels/cpu for the best instruction set, else torch ops), torch, avx512bf16, "
        "avx512, avx2 or scalar",
    ),
    (
        "--quantization",
        str,
        "none",
        "none, or int8: projection weights quantized at load to int8 with per-channel scales, activations "
        "per token, int32 sums (W8A8); int8 compressed-tensors checkpoints load as int8 either way",
    ),
    (
        "--quantize-lm-head",
        flag_bool,
        True,
        "with --quantization int8: the LM head in int8 too (false: the compute dtype, like the embedding)",
    ),
    ("--log-level", str, "INFO", "logging level"),
    ("--log-format", str, "text", "text (one line per record) or json (one object per line)"),
    ("--log-prompts", flag_bool, False, "log prompt and completion text (never logged otherwise)"),
    (
        "--metrics-port",
        int,
        None,
        "serve Prometheus metrics on http://HOST:PORT/metrics (unset: no endpoint)",
    ),
    (
        "--metrics-vllm-compat",
        flag_bool,
        False,
        "also export vllm:num_requests_running/waiting, vllm:kv_cache_usage_perc, vllm:cache_config_info",
    ),
    ("--otlp-endpoint", str, None, "send traces over OTLP/gRPC to http(s)://HOST:PORT (unset: no tracing)"),
    ("--enable-lora", flag_bool, False, "serve LoRA adapters (--lora-modules, LoadLoraAdapter)"),
    ("--max-loras", int, 1, "LoRA adapters one batch may mix (slots of the adapter pool)"),
    ("--max-cpu-loras", int, None, "LoRA adapters kept loaded in memory, least recently used evicted"),
    ("--max-lora-rank", int, 16, "highest LoRA rank served (the adapter pool's rank)"),
)


__all__ = ["FLAGS", "build_parser", "config_from_args", "env_name", "main"]


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The flags, with the CONDUIT_* variables of `environ` (default: os.environ) as their defaults."""
    parser = argparse.ArgumentParser(
        prog="conduit-engine",
        description="Conduit engine: serve a Llama-family model over gRPC (conduit.engine.v1.Engine).",
        epilog="Every flag can also be set through the environment variable CONDUIT_<FLAG_NAME>.",
    )
    for flag, kind, default, help_text in FLAGS:
        if kind is flag_bool:
            add_bool_flag(parser, flag, default, help_text)
        else:
            parser.add_argument(flag, type=kind, default=default, help=help_text)
    parser.add_argument(
        "--lora-modules",
        nargs="*",
        default=None,
        metavar="NAME=PATH",
        help="with --enable-lora: adapters loaded at start, each a folder or a Hub id (env: space-separated)",
    )
    apply_env_defaults(parser, os.environ if environ is None else environ)
    describe_env(parser)
    return parser


def _model_config(args: argparse.Namespace) -> ModelConfig:
    if not args.model:
        raise ValueError("--model is required (or CONDUIT_MODEL)")
    return ModelConfig(
        path=args.model,
        served_name=args.served_model_name,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        seed=args.seed,
        num_threads=args.num_threads,
        revision=args.revision,
        download_dir=args.download_dir,
        generation_config=args.generation_config,
        cpu_kernels=args.cpu_kernels,
        quantization=args.quantization,
        quantize_lm_head=args.quantize_lm_head,
    )


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=_model_config(args),
        cache=CacheConfig(
            block_size=args.block_size,
            num_blocks=args.kv_cache_blocks,
            memory_fraction=args.kv_cache_memory_fraction,
            enable_prefix_caching=args.enable_prefix_caching,
            kv_cache_dtype=args.kv_cache_dtype,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_queued_requests=args.max_queued_requests,
            enable_chunked_prefill=args.enable_chunked_prefill,
            max_decode_steps=args.max_decode_steps,
            decode_burst_ms=args.decode_burst_ms,
            tokenizer_threads=args.tokenizer_threads,
            queued_hold_fraction=args.queued_hold_fraction,
        ),
        server=ServerConfig(
            host=args.host,
            port=args.port,
            drain_seconds=args.drain_seconds,
            max_message_bytes=args.grpc_max_message_bytes,
            keepalive_seconds=args.grpc_keepalive,
            min_ping_interval_seconds=args.grpc_min_ping_interval,
        ),
        telemetry=TelemetryConfig(
            metrics_port=args.metrics_port,
            metrics_vllm_compat=args.metrics_vllm_compat,
            otlp_endpoint=args.otlp_endpoint,
            log_format=args.log_format,
            log_prompts=args.log_prompts,
        ),
        disaggregation=DisaggregationConfig(
            role=args.role,
            advertise_address=args.advertise_address,
            lease_seconds=args.kv_transfer_lease_seconds,
            chunk_bytes=args.kv_transfer_chunk_bytes,
            pull_timeout_seconds=args.kv_transfer_timeout,
            kv_transport=args.kv_transport,
        ),
        parallel=ParallelConfig(
            tensor_parallel_size=args.tensor_parallel_size, worker_process=args.worker_process
        ),
        security=SecurityConfig(
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            tls_client_ca=args.tls_client_ca,
            auth_token_file=args.auth_token_file,
            reflection_public=args.reflection_public,
            engine_tls_ca=args.engine_tls_ca,
            engine_tls_cert=args.engine_tls_cert,
            engine_tls_key=args.engine_tls_key,
            engine_tls_server_name=args.engine_tls_server_name,
            engine_auth_token_file=args.engine_auth_token_file,
        ),
        speculative=parse_speculative_config(args.speculative_config),
        lora=LoraConfig(
            enable_lora=args.enable_lora,
            lora_modules=parse_lora_modules(args.lora_modules),
            max_loras=args.max_loras,
            max_cpu_loras=args.max_cpu_loras,
            max_lora_rank=args.max_lora_rank,
        ),
        enforce_eager=args.enforce_eager,
    )


def parse_lora_modules(values: list[str] | str | None) -> tuple[tuple[str, str], ...]:
    """--lora-modules a=/path b=org/name (the variable: one space-separated string) → ((name, path), ...)."""
    items = values.split() if isinstance(values, str) else values or []
    modules = []
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules: expected NAME=PATH, got {item!r}")
        modules.append((name, path))
    return tuple(modules)


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    logs.configure(args.log_level, config.telemetry.log_format)
    if config.telemetry.log_format == "json":
        quiet_progress_bars()  # stderr stays one JSON object per line
    from conduit_engine.entrypoints.server import EngineServer

    async def run() -> None:
        server = EngineServer(config)
        await server.serve()

    try:
        asyncio.run(run())
    except ModelLoadError as exc:
        logging.getLogger("conduit_engine").error("cannot load the model: %s", exc)
        sys.exit(2)
    except SecretFileError as exc:
        parser.error(str(exc))
    except WorkerFailedError as exc:
        # Non-zero, so that a supervisor (Kubernetes) restarts the engine with fresh workers.
        logging.getLogger("conduit_engine").error("the engine stopped: %s", exc)
        sys.exit(3)


if __name__ == "__main__":
    main()
