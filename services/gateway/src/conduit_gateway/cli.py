"""`conduit-gateway`: command-line flags and CONDUIT_* environment variables → GatewayConfig → uvicorn.

Each flag --some-name can also come from CONDUIT_SOME_NAME; a flag given on the command line wins.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence

from conduit_common import logs
from conduit_common.env_flags import add_bool_flag, apply_env_defaults, describe_env
from conduit_gateway.config import (
    REASONING_PARSERS,
    ROUTING_STRATEGIES,
    TOOL_CALL_PARSERS,
    ConfigError,
    GatewayConfig,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="conduit-gateway",
        description="OpenAI-compatible HTTP gateway in front of Conduit engines.",
        epilog="Every flag can also be set as CONDUIT_<FLAG> (e.g. CONDUIT_ENGINE=127.0.0.1:50051).",
    )
    parser.add_argument(
        "--engine",
        action="append",
        help="engine address HOST:PORT; comma-separated or repeated for several",
    )
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    parser.add_argument(
        "--api-key",
        action="append",
        help="accepted API key (Authorization: Bearer KEY); repeat or comma-separate for several",
    )
    parser.add_argument(
        "--api-keys-file",
        default=None,
        help="YAML or JSON list of keys with a name and per-minute limits (requests, tokens); re-read on "
        "SIGHUP",
    )
    parser.add_argument(
        "--tls-cert", default=None, help="PEM certificate chain: serve HTTPS (with --tls-key)"
    )
    parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    parser.add_argument("--engine-tls-ca", default=None, help="PEM CA of the engines' certificates: dial TLS")
    parser.add_argument(
        "--engine-tls-cert", default=None, help="PEM client certificate towards engines (mTLS)"
    )
    parser.add_argument("--engine-tls-key", default=None, help="PEM private key of --engine-tls-cert")
    parser.add_argument(
        "--engine-tls-server-name",
        default=None,
        help="name the engines' certificates carry when not the dialled host (engines found by DNS are IPs)",
    )
    parser.add_argument(
        "--engine-auth-token-file",
        default=None,
        help="file holding the engines' bearer token (SIGHUP re-reads)",
    )
    parser.add_argument(
        "--admin-port", type=int, default=None, help="serve the admin API on this port only (not on --port)"
    )
    parser.add_argument(
        "--max-header-bytes", type=int, default=16 * 1024, help="request line + headers limit; more get 431"
    )
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a request's line and headers may take to arrive (slow clients get 408; default 10)",
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds a request body may take to arrive (slow clients get 408; default 30)",
    )
    parser.add_argument(
        "--routing",
        default="round_robin",
        choices=ROUTING_STRATEGIES,
        help="engine selection strategy (default round_robin)",
    )
    parser.add_argument(
        "--engine-dns",
        default=None,
        help="HOST:PORT whose every A record is an engine (e.g. a Kubernetes headless Service)",
    )
    parser.add_argument(
        "--prefill-engine",
        action="append",
        help="prefill engine HOST:PORT (disaggregation, with --decode-engine); comma-separated or repeated",
    )
    parser.add_argument(
        "--decode-engine",
        action="append",
        help="decode engine HOST:PORT (disaggregation, with --prefill-engine); comma-separated or repeated",
    )
    parser.add_argument(
        "--prefill-engine-dns", default=None, help="HOST:PORT whose every A record is a prefill engine"
    )
    parser.add_argument(
        "--decode-engine-dns", default=None, help="HOST:PORT whose every A record is a decode engine"
    )
    parser.add_argument(
        "--dns-interval", type=float, default=10.0, help="seconds between DNS resolutions (default 10)"
    )
    parser.add_argument(
        "--admin-key",
        action="append",
        help="key of the /admin API (Authorization: Bearer KEY); repeat or comma-separate; none = no API",
    )
    parser.add_argument(
        "--load-interval", type=float, default=1.0, help="seconds between GetLoad polls per engine"
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=1,
        help="other engines tried after a refusal (UNAVAILABLE, RESOURCE_EXHAUSTED) before the first token",
    )
    parser.add_argument(
        "--affinity-prefix-chars",
        type=int,
        default=256,
        help="prefix_affinity: leading prompt characters hashed to pick the engine (default 256)",
    )
    parser.add_argument(
        "--affinity-load-factor",
        type=float,
        default=2.0,
        help="prefix_affinity: spill to the next engine above this many times the mean in-flight load "
        "(default 2)",
    )
    parser.add_argument(
        "--max-concurrent-requests", type=int, default=1024, help="more get 429 (default 1024)"
    )
    parser.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024, help="larger bodies get 413")
    parser.add_argument("--retry-after", type=int, default=1, help="Retry-After seconds on 429 (default 1)")
    parser.add_argument(
        "--health-interval",
        type=float,
        default=2.0,
        help="longest wait between attempts to re-open an engine's health watch, seconds (default 2)",
    )
    parser.add_argument(
        "--request-timeout", type=float, default=None, help="deadline of one generation, seconds"
    )
    parser.add_argument(
        "--grpc-max-message-bytes", type=int, default=64 * 1024 * 1024, help="gRPC message limit"
    )
    parser.add_argument(
        "--grpc-keepalive", type=float, default=30.0, help="HTTP/2 keepalive ping period, seconds"
    )
    parser.add_argument(
        "--grpc-keepalive-timeout",
        type=float,
        default=10.0,
        help="seconds a keepalive ping may go unanswered before the engine connection counts as broken "
        "(at most --grpc-keepalive; default 10)",
    )
    parser.add_argument(
        "--reconnect-backoff",
        type=float,
        default=0.2,
        help="first wait before reconnecting to an engine or re-opening its health watch, seconds "
        "(default 0.2)",
    )
    parser.add_argument(
        "--max-reconnect-backoff",
        type=float,
        default=2.0,
        help="longest wait between reconnection attempts of an engine channel, seconds (default 2)",
    )
    parser.add_argument(
        "--health-check-timeout",
        type=float,
        default=1.0,
        help="deadline of a grpc.health Check of an engine (GET /health), seconds (default 1)",
    )
    parser.add_argument(
        "--load-timeout", type=float, default=1.0, help="deadline of a GetLoad poll, seconds (default 1)"
    )
    parser.add_argument(
        "--model-info-timeout",
        type=float,
        default=2.0,
        help="deadline of the GetModelInfo call before an engine joins the rotation, seconds (default 2)",
    )
    parser.add_argument(
        "--shutdown-grace",
        type=float,
        default=10.0,
        help="on SIGTERM, seconds open connections (streams included) may finish (default 10)",
    )
    parser.add_argument(
        "--tool-call-parser",
        default=None,
        choices=TOOL_CALL_PARSERS,
        help="format of the model's tool calls, for tool_choice auto (default none: auto is refused)",
    )
    parser.add_argument(
        "--reasoning-parser",
        default=None,
        choices=REASONING_PARSERS,
        help="split the model's reasoning into reasoning_content (default none)",
    )
    parser.add_argument("--log-level", default="info", help="critical|error|warning|info|debug|trace")
    parser.add_argument(
        "--log-format", default="text", help="text (one line per record) or json (one object per line)"
    )
    add_bool_flag(parser, "--log-prompts", False, "log prompt and completion text (never logged otherwise)")
    parser.add_argument(
        "--otlp-endpoint",
        default=None,
        help="send traces over OTLP/gRPC to http(s)://HOST:PORT (default: no tracing)",
    )
    parser.add_argument(
        "--response-store",
        default="memory",
        help="where /v1/responses keeps stored responses: memory (default, this process), none, or "
        "redis://HOST:PORT/DB (rediss:// for TLS) shared by every replica",
    )
    parser.add_argument(
        "--response-store-ttl",
        type=float,
        default=3600.0,
        help="seconds a stored response (input, output, events) is kept (default 3600)",
    )
    parser.add_argument(
        "--response-store-max-bytes",
        type=int,
        default=256 * 1024 * 1024,
        help="memory store: most bytes held, oldest responses evicted first (default 256 MiB)",
    )
    parser.add_argument(
        "--response-store-password-file",
        default=None,
        help="file holding the Redis password of --response-store",
    )
    describe_env(parser)
    return parser


def _split(values: Sequence[str] | None) -> tuple[str, ...]:
    return tuple(item.strip() for value in values or () for item in value.split(",") if item.strip())


def config_from_args(argv: Sequence[str], environ: Mapping[str, str]) -> GatewayConfig:
    """Parse flags and environment; raise ConfigError naming the option on a bad value."""
    parser = build_parser()
    from_env = apply_env_defaults(parser, environ)
    args = parser.parse_args(list(argv))
    return GatewayConfig(
        engines=_split(args.engine or [from_env.get("engine", "")]),
        host=args.host,
        port=args.port,
        api_keys=_split(args.api_key or [from_env.get("api_key", "")]),
        api_keys_file=args.api_keys_file,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        engine_tls_ca=args.engine_tls_ca,
        engine_tls_cert=args.engine_tls_cert,
        engine_tls_key=args.engine_tls_key,
        engine_tls_server_name=args.engine_tls_server_name,
        engine_auth_token_file=args.engine_auth_token_file,
        admin_port=args.admin_port,
        max_header_bytes=args.max_header_bytes,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        routing=args.routing,
        engine_dns=args.engine_dns,
        prefill_engines=_split(args.prefill_engine or [from_env.get("prefill_engine", "")]),
        decode_engines=_split(args.decode_engine or [from_env.get("decode_engine", "")]),
        prefill_engine_dns=args.prefill_engine_dns,
        decode_engine_dns=args.decode_engine_dns,
        dns_interval_s=args.dns_interval,
        admin_keys=_split(args.admin_key or [from_env.get("admin_key", "")]),
        load_interval_s=args.load_interval,
        retries=args.retries,
        affinity_prefix_chars=args.affinity_prefix_chars,
        affinity_load_factor=args.affinity_load_factor,
        max_concurrent_requests=args.max_concurrent_requests,
        max_body_bytes=args.max_body_bytes,
        retry_after_s=args.retry_after,
        health_interval_s=args.health_interval,
        request_timeout_s=args.request_timeout,
        grpc_max_message_bytes=args.grpc_max_message_bytes,
        grpc_keepalive_s=args.grpc_keepalive,
        grpc_keepalive_timeout_s=args.grpc_keepalive_timeout,
        reconnect_backoff_s=args.reconnect_backoff,
        max_reconnect_backoff_s=args.max_reconnect_backoff,
        health_check_timeout_s=args.health_check_timeout,
        load_timeout_s=args.load_timeout,
        model_info_timeout_s=args.model_info_timeout,
        shutdown_grace_s=args.shutdown_grace,
        log_level=args.log_level.lower(),
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        log_format=args.log_format,
        log_prompts=args.log_prompts,
        otlp_endpoint=args.otlp_endpoint,
        response_store=args.response_store,
        response_store_ttl_s=args.response_store_ttl,
        response_store_max_bytes=args.response_store_max_bytes,
        response_store_password_file=args.response_store_password_file,
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of `conduit-gateway`."""
    try:
        config = config_from_args(sys.argv[1:] if argv is None else argv, os.environ)
    except ConfigError as exc:
        build_parser().error(str(exc))
    from conduit_common.secret_files import SecretFileError
    from conduit_gateway.http.app import create_app
    from conduit_gateway.http.server import serve
    from conduit_gateway.keys.keys_file import KeysFileError

    logs.configure("DEBUG" if config.log_level == "trace" else config.log_level, config.log_format)
    try:
        app = create_app(config)
        serve(config, app)
    except (SecretFileError, KeysFileError) as exc:
        build_parser().error(str(exc))


if __name__ == "__main__":
    main()
