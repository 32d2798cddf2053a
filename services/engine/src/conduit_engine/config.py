"""Engine configuration: one frozen dataclass per concern, validated on construction.

The CLI and the CONDUIT_* environment variables map onto these in one place (`cli.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from conduit_common.logs import LOG_FORMATS
from conduit_common.tracing import check_otlp_endpoint
from conduit_engine.kv_format import KV_CACHE_DTYPES
from conduit_engine.speculation.config import SpeculativeConfig

GENERATION_CONFIG_MODES = ("auto", "vllm", "none")
ROLES = ("both", "prefill", "decode")
# the CPU ops backend: the best instruction set of kernels/cpu, the torch reference, or one set
CPU_KERNEL_CHOICES = ("auto", "torch", "avx512bf16", "avx512", "avx2", "scalar")
# --quantization: float weights as the checkpoint has them, or int8 projections (W8A8)
QUANTIZATION_CHOICES = ("none", "int8")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What to load and how to run it."""

    path: str  # a local model folder, or a Hugging Face Hub id (org/name)
    served_name: str | None = None  # None → the Hub id, or the folder's name
    device: str = "cpu"
    dtype: str = "auto"  # auto → the checkpoint's torch_dtype; on the CPU float16 checkpoints run in float32
    max_model_len: int | None = None  # None → the model's context (max_position_embeddings, RoPE-scaled)
    seed: int = 0
    num_threads: int = 0  # torch intra-op threads on CPU; 0 → auto (1 for tiny models, else torch's default)
    revision: str | None = None  # Hub ids: branch, tag or commit (None → main)
    download_dir: str | None = None  # Hub ids: the cache to download into (None → huggingface_hub's)
    generation_config: str = "auto"  # auto | vllm | none: what generation_config.json contributes
    cpu_kernels: str = "auto"  # auto | torch | avx512bf16 | avx512 | avx2 | scalar: the CPU ops backend
    quantization: str = "none"  # none | int8: projections quantized at load (W8A8, models/quantization.py)
    quantize_lm_head: bool = True  # with --quantization int8: the LM head too (false: compute dtype)

    def __post_init__(self) -> None:
        _require(self.num_threads >= 0, f"--num-threads must be >= 0, got {self.num_threads}")
        _require(self.device in ("cpu", "cuda"), f"--device must be cpu or cuda, got {self.device!r}")
        _require(
            self.dtype in ("auto", "float32", "bfloat16", "float16"),
            f"--dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}",
        )
        _require(
            not (self.dtype == "float16" and self.device == "cpu"),
            "--dtype float16 needs --device cuda: on the CPU use float32 or bfloat16",
        )
        _require(
            self.max_model_len is None or self.max_model_len >= 1,
            f"--max-model-len must be >= 1, got {self.max_model_len}",
        )
        _require(
            self.cpu_kernels in CPU_KERNEL_CHOICES,
            f"--cpu-kernels must be one of {', '.join(CPU_KERNEL_CHOICES)}, got {self.cpu_kernels!r}",
        )
        _require(
            self.quantization in QUANTIZATION_CHOICES,
            f"--quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {self.quantization!r}",
        )
        _require(
            self.generation_config in GENERATION_CONFIG_MODES,
            f"--generation-config must be auto, vllm or none, got {self.generation_config!r}",
        )


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Paged KV cache geometry."""

    block_size: int = 16
    num_blocks: int | None = None  # None → sized from memory_fraction
    memory_fraction: float = 0.1  # of total (CPU) or free (GPU) memory, when num_blocks is None
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # auto (the compute dtype) | int8 | fp8 (kv_format.py)

    def __post_init__(self) -> None:
        _require(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}",
        )
        _require(
            self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
            f"--block-size must be a power of two, got {self.block_size}",
        )
        _require(
            self.num_blocks is None or self.num_blocks >= 1,
            f"--kv-cache-blocks must be >= 1, got {self.num_blocks}",
        )
        _require(
            0.0 < self.memory_fraction <= 0.95,
            f"--kv-cache-memory-fraction must be in (0, 0.95], got {self.memory_fraction}",
        )


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Admission and per-step budgets."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_queued_requests: int = 1024
    enable_chunked_prefill: bool = True
    # Decode bursts (decode_bursts.py): forward passes one step of pure decodes may run back to back,
    # and how long they may take together.
    max_decode_steps: int = 8
    decode_burst_ms: float = 5.0
    # Threads that tokenize prompts and render chat templates, off the step loop.
    tokenizer_threads: int = 2
    # Share of the KV blocks that waiting sequences may hold on their cached prefixes (0: none is held, a
    # queued prompt's cached prefix is only moved to the back of the eviction order).
    queued_hold_fraction: float = 0.5

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        _require(
            self.tokenizer_threads >= 1, f"--tokenizer-threads must be >= 1, got {self.tokenizer_threads}"
        )
        _require(
            0.0 <= self.queued_hold_fraction <= 1.0,
            f"--queued-hold-fraction must be in [0, 1], got {self.queued_hold_fraction}",
        )
        _require(self.max_decode_steps >= 1, f"--max-decode-steps must be >= 1, got {self.max_decode_steps}")
        _require(self.decode_burst_ms > 0, f"--decode-burst-ms must be > 0, got {self.decode_burst_ms}")
        _require(
            self.max_num_batched_tokens >= 1,
            f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}",
        )
        _require(
            self.max_queued_requests >= 0,
            f"--max-queued-requests must be >= 0, got {self.max_queued_requests}",
        )


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """gRPC listener."""

    host: str = "0.0.0.0"
    port: int = 50051
    drain_seconds: float = 30.0
    max_message_bytes: int = 64 * 1024 * 1024
    keepalive_seconds: float = 30.0  # HTTP/2 ping period towards clients with open calls
    min_ping_interval_seconds: float = 5.0  # clients may ping no more often than this

    def __post_init__(self) -> None:
        _require(0 <= self.port <= 65535, f"--port must be in [0, 65535], got {self.port}")
        _require(self.drain_seconds >= 0, f"--drain-seconds must be >= 0, got {self.drain_seconds}")
        _require(
            self.max_message_bytes >= 1024,
            f"--grpc-max-message-bytes must be >= 1024, got {self.max_message_bytes}",
        )
        _require(self.keepalive_seconds > 0, f"--grpc-keepalive must be > 0, got {self.keepalive_seconds}")
        _require(
            self.min_ping_interval_seconds >= 0,
            f"--grpc-min-ping-interval must be >= 0, got {self.min_ping_interval_seconds}",
        )


@dataclass(frozen=True, slots=True)
class TelemetryConfig:
    """Metrics, traces and logs."""

    metrics_port: int | None = None  # Prometheus endpoint; None: none (0: any free port, for tests)
    metrics_vllm_compat: bool = False  # also export vLLM's names for Kubernetes inference routers
    otlp_endpoint: str | None = None  # OTLP/gRPC receiver of the spans; None: no tracing
    log_format: str = "text"
    log_prompts: bool = False  # prompt and completion text in the logs (never by default)

    def __post_init__(self) -> None:
        _require(
            self.metrics_port is None or 0 <= self.metrics_port <= 65535,
            f"--metrics-port must be in [0, 65535], got {self.metrics_port}",
        )
        if self.otlp_endpoint is not None:
            check_otlp_endpoint(self.otlp_endpoint)
        _require(
            self.log_format in LOG_FORMATS, f"--log-format must be text or json, got {self.log_format!r}"
        )


KV_TRANSPORTS = ("grpc", "shm", "nixl")


@dataclass(frozen=True, slots=True)
class DisaggregationConfig:
    """This engine's side of prefill/decode disaggregation (KV transfers between engines)."""

    role: str = "both"  # both | prefill | decode: which sides of a disaggregated request it serves
    advertise_address: str | None = None  # HOST:PORT other engines pull from; None → derived at start
    lease_seconds: float = 30.0  # how long a produced transfer stays pinned when nobody pulls it
    chunk_bytes: int = 4 * 1024 * 1024  # KV payload per PullKv message (whole blocks, at least one)
    pull_timeout_seconds: float = 60.0  # deadline of one pull from a source engine
    kv_transport: str = "grpc"  # grpc | shm | nixl: how KV blocks move (grpc is always the fallback)

    def __post_init__(self) -> None:
        _require(self.role in ROLES, f"--role must be both, prefill or decode, got {self.role!r}")
        _require(
            self.kv_transport in KV_TRANSPORTS,
            f"--kv-transport must be grpc, shm or nixl, got {self.kv_transport!r}",
        )
        if self.advertise_address is not None:
            host, sep, port = self.advertise_address.rpartition(":")
            _require(
                bool(sep and host) and port.isdigit() and 1 <= int(port) <= 65535,
                f"--advertise-address must be HOST:PORT, got {self.advertise_address!r}",
            )
        _require(self.lease_seconds > 0, f"--kv-transfer-lease-seconds must be > 0, got {self.lease_seconds}")
        _require(self.chunk_bytes >= 1, f"--kv-transfer-chunk-bytes must be >= 1, got {self.chunk_bytes}")
        _require(
            self.pull_timeout_seconds > 0,
            f"--kv-transfer-timeout must be > 0, got {self.pull_timeout_seconds}",
        )

    @property
    def produces(self) -> bool:
        """Whether this engine runs the prefill side (Generate with kv_transfer.produce)."""
        return self.role in ("both", "prefill")

    @property
    def consumes(self) -> bool:
        """Whether this engine runs the decode side (Generate with kv_transfer.consume)."""
        return self.role in ("both", "decode")


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """Where the model runs: in the engine process, or in worker processes (one per tensor-parallel rank)."""

    tensor_parallel_size: int = 1
    worker_process: bool = False  # with one rank: still run the model in a worker process

    def __post_init__(self) -> None:
        _require(
            self.tensor_parallel_size >= 1,
            f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}",
        )

    @property
    def uses_workers(self) -> bool:
        return self.tensor_parallel_size > 1 or self.worker_process


@dataclass(frozen=True, slots=True)
class SecurityConfig:
    """Who may call this engine (TLS, mTLS, a bearer token) and how it calls other engines (PullKv).

    Paths only: the files are read (and re-read on SIGHUP) by `server_security`.
    """

    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None  # set: mTLS, clients need a certificate this CA signed
    auth_token_file: str | None = None  # set: every RPC but health needs `authorization: Bearer <token>`
    reflection_public: bool = False  # reflection without the token (it is always open without one)
    # Towards other engines (disaggregation's PullKv): the gateway's flags of the same names.
    engine_tls_ca: str | None = None
    engine_tls_cert: str | None = None
    engine_tls_key: str | None = None
    engine_tls_server_name: str | None = None
    engine_auth_token_file: str | None = None

    def __post_init__(self) -> None:
        _require(
            (self.tls_cert is None) == (self.tls_key is None),
            "--tls-cert and --tls-key: give both (the server certificate and its key) or neither",
        )
        _require(
            self.tls_client_ca is None or self.tls_cert is not None,
            "--tls-client-ca: needs --tls-cert and --tls-key (mTLS is TLS with client certificates)",
        )


@dataclass(frozen=True, slots=True)
class LoraConfig:
    """LoRA adapters (vLLM's flags): served at all (--enable-lora), loaded at start (--lora-modules), how
    many one batch mixes (the pool's slots), how many stay loaded in memory, the pool's rank."""

    enable_lora: bool = False
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, folder or Hub id), loaded at start
    max_loras: int = 1
    max_cpu_loras: int | None = None  # None → max_loras
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        _require(self.max_loras >= 1, f"--max-loras must be >= 1, got {self.max_loras}")
        _require(self.max_lora_rank >= 1, f"--max-lora-rank must be >= 1, got {self.max_lora_rank}")
        _require(
            self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
            f"--max-cpu-loras ({self.max_cpu_loras}) must be >= --max-loras ({self.max_loras})",
        )
        _require(self.enable_lora or not self.lora_modules, "--lora-modules needs --enable-lora")
        names = [name for name, _ in self.lora_modules]
        _require(len(set(names)) == len(names), f"--lora-modules: a name is given twice in {names}")

    @property
    def cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    server: ServerConfig = ServerConfig()
    security: SecurityConfig = SecurityConfig()
    parallel: ParallelConfig = ParallelConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    disaggregation: DisaggregationConfig = DisaggregationConfig()
    speculative: SpeculativeConfig | None = None  # --speculative-config (None: no speculative decoding)
    lora: LoraConfig = LoraConfig()
    enforce_eager: bool = False
