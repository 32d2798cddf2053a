"""The gateway's configuration: one frozen dataclass, validated on construction.

The CLI and the CONDUIT_* environment variables map onto it in `cli.py`; nothing else reads the environment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from conduit_common.logs import LOG_FORMATS
from conduit_common.tracing import check_otlp_endpoint
from conduit_gateway.parsers.reasoning import reasoning_parser_names
from conduit_gateway.parsers.tool_calls import tool_call_parser_names
from conduit_gateway.routing.admin_nodes import parse_allow_list
from conduit_gateway.routing.selection import strategy_names

ROUTING_STRATEGIES = strategy_names()
TOOL_CALL_PARSERS = tool_call_parser_names()
REASONING_PARSERS = reasoning_parser_names()
MAX_WORKERS = 256


class ConfigError(ValueError):
    """A configuration value is wrong; the message starts with the option's name."""


def parse_engine_address(address: str, field: str = "engine") -> str:
    """Return `address` stripped, or raise ConfigError (naming `field`) unless it reads HOST:PORT with
    1 <= PORT <= 65535."""
    text = address.strip()
    host, sep, port = text.rpartition(":")
    # No spaces or slashes: the address is also a path segment of the admin API.
    bad_host = not host or any(char in host for char in " /")
    if not sep or bad_host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"{field}: expected HOST:PORT with a port in [1, 65535], got {address!r}")
    return text


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Everything the gateway needs to run; see `cli.py` for the matching flags."""

    # Static engine addresses; may be empty when nodes come from DNS or the admin API.
    engines: tuple[str, ...]
    host: str = "0.0.0.0"
    port: int = 8000
    # Keys are secrets: never in a repr (and so never in a log line that prints the config).
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    # YAML or JSON keys with names and per-minute limits (keys/keys_file.py); re-read on SIGHUP.
    api_keys_file: str | None = None
    routing: str = "round_robin"
    # HOST:PORT whose every A record is an engine (a Kubernetes headless Service), re-resolved periodically.
    engine_dns: str | None = None
    # Prefill/decode disaggregation: the prefill and decode pools (static addresses and DNS names, as for
    # `engines`). With both pools, a request runs its prompt on a prefill engine and decodes elsewhere.
    prefill_engines: tuple[str, ...] = ()
    decode_engines: tuple[str, ...] = ()
    prefill_engine_dns: str | None = None
    decode_engine_dns: str | None = None
    dns_interval_s: float = 10.0
    # Keys of the /admin API; none means the admin API does not exist.
    admin_keys: tuple[str, ...] = field(default=(), repr=False)
    # Serve /admin on this port only (not on `port`); None: /admin is on `port`.
    admin_port: int | None = None
    # What the admin API may add: hosts inside these CIDRs or matching these patterns (empty: any
    # HOST:PORT), and at most admin_max_nodes nodes of its own (routing/admin_nodes.py).
    admin_node_allow: tuple[str, ...] = ()
    admin_max_nodes: int = 64
    # How often each SERVING engine is asked for its load (GetLoad).
    load_interval_s: float = 1.0
    # Extra attempts on other engines for a request refused (UNAVAILABLE, RESOURCE_EXHAUSTED) before output.
    retries: int = 1
    # How many times a request's running streams may move to another engine when theirs fails (0: never).
    migration_limit: int = 3
    # prefix_affinity: how much of the prompt's start picks the engine, and how far above the average
    # in-flight count an engine may go before requests spill to the next one on the ring.
    affinity_prefix_chars: int = 256
    affinity_load_factor: float = 2.0
    # kv_aware: score = kv_overlap_weight × cached blocks − active blocks; router_temperature 0 takes the
    # best score, above 0 samples from a softmax of the normalised scores; the index holds at most
    # kv_index_max_blocks block hashes per engine. The load bound (affinity_load_factor) keeps a cached
    # engine from being overloaded, so within it a cached block may outweigh an active one (8: measured
    # with bench/kv_router.py, README).
    kv_overlap_weight: float = 8.0
    router_temperature: float = 0.0
    kv_index_max_blocks: int = 1_000_000
    # Requests in flight at once; one more gets 429 rather than queueing in the gateway.
    max_concurrent_requests: int = 1024
    max_body_bytes: int = 8 * 1024 * 1024
    retry_after_s: int = 1
    # Longest wait between attempts to re-open an engine's health watch (the backoff starts at
    # reconnect_backoff_s).
    health_interval_s: float = 2.0
    # None: generation streams have no deadline (they may legitimately run for minutes).
    request_timeout_s: float | None = None
    # Deadlines of the short control calls: a health Check (GET /health, a request finding no ready
    # engine), a GetLoad poll, and the GetModelInfo that precedes a node's return to rotation.
    health_check_timeout_s: float = 1.0
    load_timeout_s: float = 1.0
    model_info_timeout_s: float = 2.0
    # Engine channels: message size limit; HTTP/2 keepalive pings every grpc_keepalive_s while calls are
    # open, and a ping unanswered for grpc_keepalive_timeout_s (at most the period) breaks the connection.
    grpc_max_message_bytes: int = 64 * 1024 * 1024
    # Generations to an engine that serves GenerateStream share one such stream per channel
    # (routing/generate_mux.py); False: one Generate call each.
    engine_multiplex: bool = True
    grpc_keepalive_s: float = 30.0
    grpc_keepalive_timeout_s: float = 10.0
    # Reconnecting to an engine after a restart: the first wait (of the channel and of the health watch),
    # doubling up to max_reconnect_backoff_s for the channel; short, so a restarted engine is back quickly.
    reconnect_backoff_s: float = 0.2
    max_reconnect_backoff_s: float = 2.0
    # Gateway processes sharing the port (SO_REUSEPORT) under one supervisor (workers/supervisor.py);
    # 1: this process serves, with no supervisor.
    workers: int = 1
    # On SIGTERM, how long open HTTP connections (streams included) may finish before they are closed.
    shutdown_grace_s: float = 10.0
    log_level: str = "info"
    # HTTPS for clients: PEM certificate chain and key (re-read on SIGHUP).
    tls_cert: str | None = None
    tls_key: str | None = None
    # Towards the engines: TLS trusting engine_tls_ca (a client certificate for mTLS), the name the engines'
    # certificates carry when it is not the dialled host, and the bearer token file (re-read on SIGHUP).
    engine_tls_ca: str | None = None
    engine_tls_cert: str | None = None
    engine_tls_key: str | None = None
    engine_tls_server_name: str | None = None
    engine_auth_token_file: str | None = None
    # Slow or oversized clients: a request's line and headers must arrive within header_timeout_s and fit
    # max_header_bytes (else 408 / 431), its body within body_timeout_s (else 408).
    max_header_bytes: int = 16 * 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    # How `tool_choice: auto` finds tool calls in the model's text; None: auto is refused (400).
    tool_call_parser: str | None = None
    # How reasoning is split from the answer (reasoning_content); None: the text is all content.
    reasoning_parser: str | None = None
    # Logs: text or json lines; prompt and completion text only with log_prompts.
    log_format: str = "text"
    log_prompts: bool = False
    # OTLP/gRPC receiver of the gateway's spans (http(s)://HOST:PORT); None: no tracing.
    otlp_endpoint: str | None = None
    # The Responses API's store: "memory" (this process), "none" (store: true refused), or a Redis URL
    # (redis://HOST:PORT/DB, rediss:// for TLS) shared by replicas; records live ttl seconds, and the
    # memory store holds at most max_bytes (oldest evicted first).
    response_store: str = "memory"
    response_store_ttl_s: float = 3600.0
    response_store_max_bytes: int = 256 * 1024 * 1024
    response_store_password_file: str | None = None

    def __post_init__(self) -> None:
        self._check_engine_sources()
        self._check_http()
        self._check_routing()
        self._check_engine_calls()
        self._check_parsers()
        self._check_security()
        self._check_telemetry()
        self._check_response_store()

    def _check_telemetry(self) -> None:
        if self.log_level not in ("critical", "error", "warning", "info", "debug", "trace"):
            raise ConfigError(f"log_level: unknown level {self.log_level!r}")
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(f"log_format: must be text or json, got {self.log_format!r}")
        if self.otlp_endpoint is not None:
            try:
                check_otlp_endpoint(self.otlp_endpoint, flag="otlp_endpoint")
            except ValueError as exc:
                raise ConfigError(str(exc)) from None

    @property
    def disaggregated(self) -> bool:
        """Whether prefill and decode pools are configured (they may also come from the admin API)."""
        return bool(self.prefill_engines or self.prefill_engine_dns) and bool(
            self.decode_engines or self.decode_engine_dns
        )

    def _check_engine_sources(self) -> None:
        has_prefill = bool(self.prefill_engines or self.prefill_engine_dns)
        has_decode = bool(self.decode_engines or self.decode_engine_dns)
        if not (self.engines or self.engine_dns or has_prefill or has_decode or self.admin_keys):
            raise ConfigError(
                "engine: at least one HOST:PORT is required (or --engine-dns, --prefill-engine with "
                "--decode-engine, or --admin-key to add engines at run time)"
            )
        if has_prefill != has_decode and not self.admin_keys:
            given, missing = ("prefill", "decode") if has_prefill else ("decode", "prefill")
            raise ConfigError(
                f"{missing}_engine: --{given}-engine needs {missing} engines too (--{missing}-engine or "
                f"--{missing}-engine-dns, or --admin-key to add them at run time)"
            )
        self._check_addresses()
        _positive("dns_interval", self.dns_interval_s)
        if any(not key for key in self.admin_keys):
            raise ConfigError("admin_key: keys must not be empty")
        if set(self.admin_keys) & set(self.api_keys):
            raise ConfigError("admin_key: must differ from every api_key (an API key must not grant admin)")

    def _check_addresses(self) -> None:
        seen: dict[str, str] = {}
        for pool in ("engines", "prefill_engines", "decode_engines"):
            name = pool.removesuffix("s")
            for address in getattr(self, pool):
                address = parse_engine_address(address, field=name)
                if address in seen and seen[address] != name:
                    raise ConfigError(
                        f"{name}: {address} is also given as {seen[address]}; an engine serves one pool"
                    )
                seen[address] = name
        for dns in ("engine_dns", "prefill_engine_dns", "decode_engine_dns"):
            if getattr(self, dns) is not None:
                parse_engine_address(getattr(self, dns), field=dns)

    def _check_http(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port: must be in [0, 65535], got {self.port}")
        if any(not key for key in self.api_keys):
            raise ConfigError("api_key: keys must not be empty")
        _positive("max_concurrent_requests", self.max_concurrent_requests)
        _positive("max_body_bytes", self.max_body_bytes)
        if self.retry_after_s < 0:
            raise ConfigError(f"retry_after: must be >= 0, got {self.retry_after_s}")
        _positive("shutdown_grace", self.shutdown_grace_s)
        if not 1 <= self.workers <= MAX_WORKERS:
            raise ConfigError(f"workers: must be in [1, {MAX_WORKERS}], got {self.workers}")

    def _check_routing(self) -> None:
        if self.routing not in ROUTING_STRATEGIES:
            raise ConfigError(
                f"routing: must be one of {', '.join(ROUTING_STRATEGIES)}, got {self.routing!r}"
            )
        if self.retries < 0:
            raise ConfigError(f"retries: must be >= 0, got {self.retries}")
        if self.migration_limit < 0:
            raise ConfigError(f"migration_limit: must be >= 0, got {self.migration_limit}")
        _positive("affinity_prefix_chars", self.affinity_prefix_chars)
        if not (self.affinity_load_factor >= 1 and math.isfinite(self.affinity_load_factor)):
            raise ConfigError(f"affinity_load_factor: must be >= 1, got {self.affinity_load_factor}")
        if not (self.kv_overlap_weight >= 0 and math.isfinite(self.kv_overlap_weight)):
            raise ConfigError(f"kv_overlap_weight: must be >= 0, got {self.kv_overlap_weight}")
        if not (self.router_temperature >= 0 and math.isfinite(self.router_temperature)):
            raise ConfigError(f"router_temperature: must be >= 0, got {self.router_temperature}")
        _positive("kv_index_max_blocks", self.kv_index_max_blocks)

    def _check_engine_calls(self) -> None:
        for name in (
            "health_interval",
            "load_interval",
            "health_check_timeout",
            "load_timeout",
            "model_info_timeout",
            "grpc_keepalive",
            "grpc_keepalive_timeout",
            "reconnect_backoff",
            "max_reconnect_backoff",
        ):
            _positive(name, getattr(self, f"{name}_s"))
        _positive("grpc_max_message_bytes", self.grpc_max_message_bytes)
        if self.request_timeout_s is not None:
            _positive("request_timeout", self.request_timeout_s)
        if self.max_reconnect_backoff_s < self.reconnect_backoff_s:
            raise ConfigError(
                f"max_reconnect_backoff: must be >= reconnect_backoff ({self.reconnect_backoff_s}), "
                f"got {self.max_reconnect_backoff_s}"
            )

    def _check_parsers(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ConfigError(
                f"tool_call_parser: must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                f"got {self.tool_call_parser!r}"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ConfigError(
                f"reasoning_parser: must be one of {', '.join(REASONING_PARSERS)}, "
                f"got {self.reasoning_parser!r}"
            )

    def _check_security(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("tls_cert: give both tls_cert and tls_key (the HTTPS certificate and its key)")
        if self.engine_tls_ca is None:
            for name in ("engine_tls_cert", "engine_tls_key", "engine_tls_server_name"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"{name}: needs engine_tls_ca (TLS towards the engines)")
        if (self.engine_tls_cert is None) != (self.engine_tls_key is None):
            raise ConfigError("engine_tls_cert: give both engine_tls_cert and engine_tls_key (mTLS)")
        if self.admin_port is not None:
            if not 1 <= self.admin_port <= 65535 or self.admin_port == self.port:
                raise ConfigError(
                    f"admin_port: must be in [1, 65535] and differ from port, got {self.admin_port}"
                )
            if not self.admin_keys:
                raise ConfigError("admin_port: needs admin_key (without admin keys there is no admin API)")
        if self.admin_node_allow and not self.admin_keys:
            raise ConfigError("admin_node_allow: needs admin_key (without admin keys there is no admin API)")
        try:
            parse_allow_list(tuple(self.admin_node_allow))
        except ValueError as exc:
            raise ConfigError(f"admin_node_allow: {exc}") from None
        if self.admin_max_nodes < 0:
            raise ConfigError(f"admin_max_nodes: must be >= 0, got {self.admin_max_nodes}")
        _positive("max_header_bytes", self.max_header_bytes)
        _positive("header_timeout", self.header_timeout_s)
        _positive("body_timeout", self.body_timeout_s)

    def _check_response_store(self) -> None:
        store = self.response_store
        if store not in ("memory", "none") and not store.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(
                f"response_store: must be memory, none or a redis://, rediss:// or unix:// URL, got {store!r}"
            )
        _positive("response_store_ttl", self.response_store_ttl_s)
        _positive("response_store_max_bytes", self.response_store_max_bytes)
        if self.response_store_password_file is not None and store in ("memory", "none"):
            raise ConfigError("response_store_password_file: needs a Redis --response-store")


def _positive(name: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{name}: must be > 0, got {value}")
