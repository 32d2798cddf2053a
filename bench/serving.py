"""Serving benchmark: a load generator for any OpenAI-compatible server (Conduit's gateway,
llama.cpp's llama-server, vLLM), streamed, with TTFT, ITL, TPOT, end-to-end latency and goodput.

    .venv/bin/python bench/serving.py --base-url http://127.0.0.1:8000 --concurrency 1 16 \\
        --num-requests 64 --prompt-len 32 --output-len 128 --tokenizer ../shared/tokenizers/llama2 \\
        --out results.jsonl --plot results.png
    .venv/bin/python bench/serving.py --base-url ... --request-rate 1 2 4 inf --max-concurrency 64 \\
        --prompt-len lognormal:256,0.6,16,1024 --output-len uniform:32,256 --slo-ttft-ms 500 --slo-tpot-ms 50

Every run of a sweep sends the same seeded workload. Length specs: see bench/loadgen/workload.py.
Needs the bench tools (`make bench-setup`) for the progress bar and --plot.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # for bench.loadgen when run as a script

import httpx  # noqa: E402

from bench.loadgen.client import ENDPOINTS, Target  # noqa: E402
from bench.loadgen.metrics import Slo, summarize  # noqa: E402
from bench.loadgen.report import format_run  # noqa: E402
from bench.loadgen.results import RunResult, append_result  # noqa: E402
from bench.loadgen.runner import LoadPlan, run_load  # noqa: E402
from bench.loadgen.workload import LengthDist, PromptBuilder, RequestSpec  # noqa: E402

WARMUP_MAX_TOKENS = 8


@dataclass
class SweepConfig:
    """Everything one call of the benchmark does: one workload, sent once per load plan."""

    target: Target
    plans: list[LoadPlan]
    num_requests: int = 64
    prompt_len: LengthDist = field(default_factory=lambda: LengthDist.parse("32"))
    output_len: LengthDist = field(default_factory=lambda: LengthDist.parse("128"))
    tokenizer: Path | None = None
    seed: int = 0
    warmup: int = 2
    slo: Slo = field(default_factory=Slo)
    label: str = ""
    progress: bool = True
    timeout_s: float = 900.0


def discover_model(base_url: str, api_key: str | None = None) -> str:
    """The first model id of GET /v1/models (each server here serves one)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    reply = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30.0)
    reply.raise_for_status()
    models = reply.json()["data"]
    if not models:
        raise SystemExit(f"{base_url}/v1/models lists no model: pass --model")
    return models[0]["id"]


def _meta(config: SweepConfig, plan: LoadPlan) -> dict:
    t = config.target
    return {
        "label": config.label or t.base_url,
        "base_url": t.base_url,
        "model": t.model,
        "endpoint": t.endpoint,
        "load": plan.label(),
        "mode": plan.mode,
        "value": plan.value,
        "max_concurrency": plan.max_concurrency,
        "num_requests": config.num_requests,
        "prompt_len": config.prompt_len.describe(),
        "output_len": config.output_len.describe(),
        "tokenizer": str(config.tokenizer) if config.tokenizer else None,
        "ignore_eos": t.ignore_eos,
        "temperature": t.temperature,
        "seed": config.seed,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


async def _warm_up(config: SweepConfig, specs: list[RequestSpec]) -> None:
    short = [RequestSpec(s.prompt, s.prompt_tokens, WARMUP_MAX_TOKENS) for s in specs[: config.warmup]]
    if short:
        await run_load(config.target, short, LoadPlan("concurrency", len(short)), timeout_s=config.timeout_s)


async def run_sweep_async(config: SweepConfig) -> list[RunResult]:
    specs = PromptBuilder(config.tokenizer).workload(
        config.num_requests, config.prompt_len, config.output_len, config.seed
    )
    await _warm_up(config, specs)
    results = []
    for plan in config.plans:
        records, duration = await run_load(
            config.target, specs, plan, config.seed, config.progress, config.timeout_s
        )
        summary = summarize(records, duration, config.slo)
        results.append(RunResult(meta=_meta(config, plan), summary=summary, records=records))
    return results


def run_sweep(config: SweepConfig) -> list[RunResult]:
    """Send the workload once per load plan; one RunResult per plan."""
    return asyncio.run(run_sweep_async(config))


def _rate(text: str) -> float:
    value = math.inf if text.lower() in ("inf", "infinity") else float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0, got {text}")
    return value


def _length(text: str) -> LengthDist:
    try:
        return LengthDist.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, without /v1")
    parser.add_argument("--model", help="model name (default: the first of GET /v1/models)")
    parser.add_argument("--endpoint", choices=ENDPOINTS, default="completions")
    parser.add_argument("--api-key")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=_positive_int, nargs="+", help="requests in flight (sweep)")
    load.add_argument("--request-rate", type=_rate, nargs="+", help="Poisson arrivals per s, or inf (sweep)")
    parser.add_argument("--max-concurrency", type=_positive_int, help="cap on in-flight requests with a rate")
    parser.add_argument("--num-requests", type=_positive_int, default=64)
    parser.add_argument(
        "--prompt-len", type=_length, default=LengthDist.parse("32"), help="tokens, BOS included"
    )
    parser.add_argument("--output-len", type=_length, default=LengthDist.parse("128"), help="max_tokens")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer.json (or its folder): exact prompt lengths")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--warmup", type=int, default=2, help="short requests sent before measuring")
    parser.add_argument("--slo-ttft-ms", type=float)
    parser.add_argument("--slo-tpot-ms", type=float)
    parser.add_argument("--slo-e2e-ms", type=float)
    parser.add_argument("--label", default="", help="name of this server in results and plots")
    parser.add_argument("--out", type=Path, help="append one JSON line per run to this file")
    parser.add_argument("--plot", type=Path, help="draw this call's runs into a PNG (see bench/plot.py)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per request")
    return parser


def config_from_args(args: argparse.Namespace) -> SweepConfig:
    base_url = args.base_url.rstrip("/").removesuffix("/v1")
    if args.request_rate:
        plans = [LoadPlan("rate", r, args.max_concurrency) for r in args.request_rate]
    else:
        plans = [LoadPlan("concurrency", c) for c in args.concurrency or [1]]
    target = Target(
        base_url=base_url,
        model=args.model or discover_model(base_url, args.api_key),
        endpoint=args.endpoint,
        ignore_eos=not args.no_ignore_eos,
        temperature=args.temperature,
        api_key=args.api_key,
    )
    return SweepConfig(
        target=target,
        plans=plans,
        num_requests=args.num_requests,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        tokenizer=args.tokenizer,
        seed=args.seed,
        warmup=args.warmup,
        slo=Slo(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms),
        label=args.label,
        progress=not args.no_progress,
        timeout_s=args.timeout,
    )


def main() -> None:
    args = build_parser().parse_args()
    results = run_sweep(config_from_args(args))
    for result in results:
        print(format_run(result), flush=True)
        if args.out:
            append_result(args.out, result)
    if args.plot:
        from bench.plot import plot_runs

        plot_runs(results, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
