"""`conduit-gateway`: command-line flags and CONDUIT_* environment variables → GatewayConfig → uvicorn.

Each flag --some-name can also come from CONDUIT_SOME_NAME; a flag given on the command line wins. The
flags are one table: each row names its GatewayConfig field, so parsing is one loop.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from conduit_common import logs
from conduit_common.env_flags import add_bool_flag, apply_env_defaults, describe_env
from conduit_gateway.config import (
    REASONING_PARSERS,
    ROUTING_STRATEGIES,
    TOOL_CALL_PARSERS,
    ConfigError,
    GatewayConfig,
)

# `kind` of a flag: a value of `type`, a list (repeated or comma-separated), or a bool (`--flag` alone: true).
VALUE, LIST, BOOL = "value", "list", "bool"


@dataclass(frozen=True, slots=True)
class Flag:
    flag: str
    field: str  # the GatewayConfig field it sets
    help: str
    type: Any = str
    default: Any = None
    kind: str = VALUE
    choices: tuple[str, ...] | None = None


FLAGS: tuple[Flag, ...] = (
    Flag(
        "--engine", "engines", "engine address HOST:PORT; comma-separated or repeated for several", kind=LIST
    ),
    Flag("--host", "host", "address to listen on (default 0.0.0.0)", default="0.0.0.0"),
    Flag("--port", "port", "port to listen on (default 8000)", int, 8000),
    Flag(
        "--api-key",
        "api_keys",
        "accepted API key (Authorization: Bearer KEY); repeat or comma-separate for several",
        kind=LIST,
    ),
    Flag(
        "--api-keys-file",
        "api_keys_file",
        "YAML or JSON list of keys with a name and per-minute limits (requests, tokens); re-read on SIGHUP",
    ),
    Flag("--tls-cert", "tls_cert", "PEM certificate chain: serve HTTPS (with --tls-key)"),
    Flag("--tls-key", "tls_key", "PEM private key of --tls-cert"),
    Flag("--engine-tls-ca", "engine_tls_ca", "PEM CA of the engines' certificates: dial TLS"),
    Flag("--engine-tls-cert", "engine_tls_cert", "PEM client certificate towards engines (mTLS)"),
    Flag("--engine-tls-key", "engine_tls_key", "PEM private key of --engine-tls-cert"),
    Flag(
        "--engine-tls-server-name",
        "engine_tls_server_name",
        "name the engines' certificates carry when not the dialled host (engines found by DNS are IPs)",
    ),
    Flag(
        "--engine-auth-token-file",
        "engine_auth_token_file",
        "file holding the engines' bearer token (SIGHUP re-reads)",
    ),
    Flag("--admin-port", "admin_port", "serve the admin API on this port only (not on --port)", int),
    Flag(
        "--max-header-bytes", "max_header_bytes", "request line + headers limit; more get 431", int, 16 * 1024
    ),
    Flag(
        "--header-timeout",
        "header_timeout_s",
        "seconds a request's line and headers may take to arrive (slow clients get 408; default 10)",
        float,
        10.0,
    ),
    Flag(
        "--body-timeout",
        "body_timeout_s",
        "seconds a request body may take to arrive (slow clients get 408; default 30)",
        float,
        30.0,
    ),
    Flag(
        "--routing",
        "routing",
        "engine selection strategy (default round_robin)",
        default="round_robin",
        choices=ROUTING_STRATEGIES,
    ),
    Flag(
        "--engine-dns",
        "engine_dns",
        "HOST:PORT whose every A record is an engine (e.g. a Kubernetes headless Service)",
    ),
    Flag(
        "--prefill-engine",
        "prefill_engines",
        "prefill engine HOST:PORT (disaggregation, with --decode-engine); comma-separated or repeated",
        kind=LIST,
    ),
    Flag(
        "--decode-engine",
        "decode_engines",
        "decode engine HOST:PORT (disaggregation, with --prefill-engine); comma-separated or repeated",
        kind=LIST,
    ),
    Flag("--prefill-engine-dns", "prefill_engine_dns", "HOST:PORT whose every A record is a prefill engine"),
    Flag("--decode-engine-dns", "decode_engine_dns", "HOST:PORT whose every A record is a decode engine"),
    Flag("--dns-interval", "dns_interval_s", "seconds between DNS resolutions (default 10)", float, 10.0),
    Flag(
        "--admin-key",
        "admin_keys",
        "key of the /admin API (Authorization: Bearer KEY); repeat or comma-separate; none = no API",
        kind=LIST,
    ),
    Flag(
        "--admin-node-allow",
        "admin_node_allow",
        "CIDR or host pattern (*.svc.cluster.local) the admin API may add nodes in; repeat or "
        "comma-separate; none = any HOST:PORT",
        kind=LIST,
    ),
    Flag(
        "--admin-max-nodes",
        "admin_max_nodes",
        "most nodes the admin API may have added at once (more get 409; default 64)",
        int,
        64,
    ),
    Flag("--load-interval", "load_interval_s", "seconds between GetLoad polls per engine", float, 1.0),
    Flag(
        "--retries",
        "retries",
        "other engines tried after a refusal (UNAVAILABLE, RESOURCE_EXHAUSTED) before the first token",
        int,
        1,
    ),
    Flag(
        "--migration-limit",
        "migration_limit",
        "times a request's running streams may move to another engine when theirs fails (0: never)",
        int,
        3,
    ),
    Flag(
        "--affinity-prefix-chars",
        "affinity_prefix_chars",
        "prefix_affinity: leading prompt characters hashed to pick the engine (default 256)",
        int,
        256,
    ),
    Flag(
        "--affinity-load-factor",
        "affinity_load_factor",
        "prefix_affinity, kv_aware: no engine above this many times the mean in-flight load (default 2)",
        float,
        2.0,
    ),
    Flag(
        "--kv-overlap-weight",
        "kv_overlap_weight",
        "kv_aware: weight of a cached prompt block against one active block (default 8)",
        float,
        8.0,
    ),
    Flag(
        "--router-temperature",
        "router_temperature",
        "kv_aware: softmax temperature over the engines' scores; 0 takes the best (default 0)",
        float,
        0.0,
    ),
    Flag(
        "--kv-index-max-blocks",
        "kv_index_max_blocks",
        "kv_aware: most block hashes the KV index keeps per engine (default 1000000, about 100 MB)",
        int,
        1_000_000,
    ),
    Flag("--max-concurrent-requests", "max_concurrent_requests", "more get 429 (default 1024)", int, 1024),
    Flag("--max-body-bytes", "max_body_bytes", "larger bodies get 413", int, 8 * 1024 * 1024),
    Flag("--retry-after", "retry_after_s", "Retry-After seconds on 429 (default 1)", int, 1),
    Flag(
        "--health-interval",
        "health_interval_s",
        "longest wait between attempts to re-open an engine's health watch, seconds (default 2)",
        float,
        2.0,
    ),
    Flag("--request-timeout", "request_timeout_s", "deadline of one generation, seconds", float),
    Flag(
        "--engine-multiplex",
        "engine_multiplex",
        "carry the generations sent to an engine on one GenerateStream, where the engine serves it "
        "(default true; false: one Generate call per prompt)",
        default=True,
        kind=BOOL,
    ),
    Flag("--grpc-max-message-bytes", "grpc_max_message_bytes", "gRPC message limit", int, 64 * 1024 * 1024),
    Flag("--grpc-keepalive", "grpc_keepalive_s", "HTTP/2 keepalive ping period, seconds", float, 30.0),
    Flag(
        "--grpc-keepalive-timeout",
        "grpc_keepalive_timeout_s",
        "seconds a keepalive ping may go unanswered before the engine connection counts as broken "
        "(at most --grpc-keepalive; default 10)",
        float,
        10.0,
    ),
    Flag(
        "--reconnect-backoff",
        "reconnect_backoff_s",
        "first wait before reconnecting to an engine or re-opening its health watch, seconds (default 0.2)",
        float,
        0.2,
    ),
    Flag(
        "--max-reconnect-backoff",
        "max_reconnect_backoff_s",
        "longest wait between reconnection attempts of an engine channel, seconds (default 2)",
        float,
        2.0,
    ),
    Flag(
        "--health-check-timeout",
        "health_check_timeout_s",
        "deadline of a grpc.health Check of an engine (GET /health), seconds (default 1)",
        float,
        1.0,
    ),
    Flag("--load-timeout", "load_timeout_s", "deadline of a GetLoad poll, seconds (default 1)", float, 1.0),
    Flag(
        "--model-info-timeout",
        "model_info_timeout_s",
        "deadline of the GetModelInfo call before an engine joins the rotation, seconds (default 2)",
        float,
        2.0,
    ),
    Flag(
        "--workers",
        "workers",
        "gateway processes sharing --port (SO_REUSEPORT) under a supervisor; key limits, the admin API "
        "and /metrics cover all of them (default 1: one process, no supervisor)",
        int,
        1,
    ),
    Flag(
        "--shutdown-grace",
        "shutdown_grace_s",
        "on SIGTERM, seconds open connections (streams included) may finish (default 10)",
        float,
        10.0,
    ),
    Flag(
        "--tool-call-parser",
        "tool_call_parser",
        "format of the model's tool calls, for tool_choice auto (default none: auto is refused)",
        choices=TOOL_CALL_PARSERS,
    ),
    Flag(
        "--reasoning-parser",
        "reasoning_parser",
        "split the model's reasoning into reasoning_content (default none)",
        choices=REASONING_PARSERS,
    ),
    Flag("--log-level", "log_level", "critical|error|warning|info|debug|trace", default="info"),
    Flag(
        "--log-format",
        "log_format",
        "text (one line per record) or json (one object per line)",
        default="text",
    ),
    Flag(
        "--log-prompts", "log_prompts", "log prompt and completion text (never logged otherwise)", kind=BOOL
    ),
    Flag(
        "--otlp-endpoint",
        "otlp_endpoint",
        "send traces over OTLP/gRPC to http(s)://HOST:PORT (default: no tracing)",
    ),
    Flag(
        "--response-store",
        "response_store",
        "where /v1/responses keeps stored responses: memory (default, this process), none, or "
        "redis://HOST:PORT/DB (rediss:// for TLS) shared by every replica",
        default="memory",
    ),
    Flag(
        "--response-store-ttl",
        "response_store_ttl_s",
        "seconds a stored response (input, output, events) is kept (default 3600)",
        float,
        3600.0,
    ),
    Flag(
        "--response-store-max-bytes",
        "response_store_max_bytes",
        "memory store: most bytes held, oldest responses evicted first (default 256 MiB)",
        int,
        256 * 1024 * 1024,
    ),
    Flag(
        "--response-store-password-file",
        "response_store_password_file",
        "file holding the Redis password of --response-store",
    ),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="conduit-gateway",
        description="OpenAI-compatible HTTP gateway in front of Conduit engines.",
        epilog="Every flag can also be set as CONDUIT_<FLAG> (e.g. CONDUIT_ENGINE=127.0.0.1:50051).",
    )
    for flag in FLAGS:
        if flag.kind == BOOL:
            add_bool_flag(parser, flag.flag, bool(flag.default), flag.help)
        elif flag.kind == LIST:
            parser.add_argument(flag.flag, action="append", help=flag.help)
        else:
            parser.add_argument(
                flag.flag, type=flag.type, default=flag.default, choices=flag.choices, help=flag.help
            )
    describe_env(parser)
    return parser


def _split(values: Sequence[str] | None) -> tuple[str, ...]:
    return tuple(item.strip() for value in values or () for item in value.split(",") if item.strip())


def config_from_args(argv: Sequence[str], environ: Mapping[str, str]) -> GatewayConfig:
    """Parse flags and environment; raise ConfigError naming the option on a bad value."""
    parser = build_parser()
    from_env = apply_env_defaults(parser, environ)
    args = vars(parser.parse_args(list(argv)))
    fields: dict[str, Any] = {}
    for flag in FLAGS:
        dest = flag.flag.removeprefix("--").replace("-", "_")
        value = args[dest]
        if flag.kind == LIST:
            value = _split(value or [from_env.get(dest, "")])
        fields[flag.field] = value
    fields["log_level"] = fields["log_level"].lower()
    return GatewayConfig(**fields)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of `conduit-gateway`."""
    try:
        config = config_from_args(sys.argv[1:] if argv is None else argv, os.environ)
    except ConfigError as exc:
        build_parser().error(str(exc))
    from conduit_common.secret_files import SecretFileError
    from conduit_gateway.keys.keys_file import KeysFileError

    logs.configure("DEBUG" if config.log_level == "trace" else config.log_level, config.log_format)
    try:
        if config.workers > 1:
            _check_files(config)
        else:
            from conduit_gateway.http.app import create_app
            from conduit_gateway.http.server import serve

            serve(config, create_app(config))
            return
    except (SecretFileError, KeysFileError) as exc:
        build_parser().error(str(exc))
    from conduit_gateway.workers.supervisor import supervise

    sys.exit(supervise(config))


def _check_files(config: GatewayConfig) -> None:
    """--workers: read the keys, TLS and token files once before any worker starts, so a bad one stops
    the supervisor with its reason (KeysFileError, SecretFileError) rather than each worker in a loop."""
    from conduit_gateway.context import GatewayContext
    from conduit_gateway.http.server import check_server_files

    GatewayContext.create(config)
    check_server_files(config)


if __name__ == "__main__":
    main()
