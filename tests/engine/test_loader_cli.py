"""Checkpoint loading (sharded, errors) and the CLI/env-var mapping."""

from __future__ import annotations

import json

import pytest

from conduit_engine.entrypoints.cli import build_parser, config_from_args, env_name
from conduit_engine.errors import ModelLoadError
from tests.engine.support.harness import generate, greedy, make_engine
from tests.engine.support.model_factory import greedy_with, load_hf, make_tiny_model
from tests.support.stories import PROMPT

pytestmark = pytest.mark.unit


def test_sharded_checkpoint_loads_and_matches(tmp_path):
    folder = make_tiny_model(tmp_path / "sharded", family="llama", num_layers=3)
    # re-save sharded: several safetensors files plus model.safetensors.index.json
    model = load_hf(folder)
    sharded = tmp_path / "sharded2"
    model.save_pretrained(sharded, safe_serialization=True, max_shard_size="40KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (sharded / name).write_bytes((folder / name).read_bytes())
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    engine = make_engine(sharded)
    out = generate(engine, {"a": [1, 20, 30]}, greedy(10, ignore_eos=True))["a"]
    assert out.token_ids == greedy_with(model, [1, 20, 30], 10)


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    folder = make_tiny_model(tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="unsupported architecture.*GPT2LMHeadModel"):
        make_engine(folder)


@pytest.mark.parametrize("missing", ["config.json", "model.safetensors", "tokenizer.json"])
def test_missing_file_is_a_clear_error(tmp_path, missing):
    folder = make_tiny_model(tmp_path / "m")
    (folder / missing).unlink()
    with pytest.raises(ModelLoadError, match=missing.replace(".", r"\.")):
        make_engine(folder)


def test_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        make_engine(tmp_path / "nope")


def test_flags_and_env_vars_map_onto_config(monkeypatch):
    monkeypatch.setenv("CONDUIT_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("CONDUIT_ENABLE_PREFIX_CACHING", "false")
    monkeypatch.setenv("CONDUIT_MODEL", "/models/x")
    args = build_parser().parse_args(["--port", "6000", "--block-size", "32"])
    config = config_from_args(args)
    assert config.model.path == "/models/x"
    assert config.scheduler.max_num_seqs == 7
    assert config.cache.enable_prefix_caching is False
    assert config.server.port == 6000 and config.cache.block_size == 32
    # an explicit flag wins over the variable
    args = build_parser().parse_args(["--max-num-seqs", "9"])
    assert config_from_args(args).scheduler.max_num_seqs == 9
    assert env_name("--kv-cache-blocks") == "CONDUIT_KV_CACHE_BLOCKS"


def test_observability_flags_map_onto_config(monkeypatch):
    monkeypatch.setenv("CONDUIT_LOG_PROMPTS", "false")
    argv = ["--model", "m", "--metrics-port", "9400", "--metrics-vllm-compat", "--log-format", "json"]
    telemetry = config_from_args(
        build_parser().parse_args([*argv, "--otlp-endpoint", "http://otel:4317"])
    ).telemetry
    assert (telemetry.metrics_port, telemetry.metrics_vllm_compat) == (9400, True)
    assert (telemetry.log_format, telemetry.log_prompts) == ("json", False)
    assert telemetry.otlp_endpoint == "http://otel:4317"
    # Off unless asked for: no endpoint, no vLLM names, no tracing, no prompts in the logs.
    defaults = config_from_args(build_parser().parse_args(["--model", "m"])).telemetry
    assert defaults.metrics_port is None and not defaults.metrics_vllm_compat
    assert defaults.otlp_endpoint is None and not defaults.log_prompts and defaults.log_format == "text"
    assert config_from_args(
        build_parser().parse_args(["--model", "m", "--log-prompts"])
    ).telemetry.log_prompts


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "m", "--block-size", "12"], "--block-size must be a power of two"),
        (["--model", "m", "--device", "tpu"], "--device must be cpu or cuda"),
        (["--model", "m", "--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
        ([], "--model is required"),
        (["--model", "m", "--metrics-port", "70000"], "--metrics-port must be in"),
        (["--model", "m", "--log-format", "xml"], "--log-format must be text or json"),
        (["--model", "m", "--otlp-endpoint", "localhost:4317"], "--otlp-endpoint: expected http://HOST:PORT"),
    ],
)
def test_bad_flags_are_refused(argv, message, monkeypatch):
    monkeypatch.delenv("CONDUIT_MODEL", raising=False)
    with pytest.raises(ValueError, match=message):
        config_from_args(build_parser().parse_args(argv))


def test_chat_without_max_tokens_runs_until_the_context_is_full(stories_path):
    from conduit.engine.v1 import engine_pb2 as pb
    from conduit_engine.config import EngineConfig, ModelConfig
    from conduit_engine.engine.llm_engine import LLMEngine
    from conduit_engine.entrypoints.proto_mapping import request_from_pb
    from tests.engine.support.harness import run_to_completion

    chat = pb.ChatInput(messages=[pb.ChatMessage(role="user", content="Hi")])
    req = request_from_pb(
        pb.GenerateRequest(request_id="c", chat=chat, sampling=pb.SamplingParams(ignore_eos=True))
    )
    assert req.params.max_tokens is None  # not set: admission decides, by the kind of input
    text_req = request_from_pb(
        pb.GenerateRequest(request_id="t", text="Hi", sampling=pb.SamplingParams(ignore_eos=True))
    )
    engine = LLMEngine(EngineConfig(model=ModelConfig(path=str(stories_path), max_model_len=40)))
    prompt = engine.add_request(req)
    engine.add_request(text_req)
    results = run_to_completion(engine)
    out = results[("c", 0)]
    assert len(out.token_ids) == 40 - len(prompt)
    assert out.final.finish_reason.value == "length"
    assert len(results[("t", 0)].token_ids) == 16  # completions keep OpenAI's default
    assert req.params.max_tokens is None and text_req.params.max_tokens is None  # callers' params untouched


def test_token_text_keeps_the_leading_space(stories_path):
    from conduit_engine.models.tokenizer import ModelTokenizer

    tok = ModelTokenizer(stories_path)
    ids = tok.encode(PROMPT)
    assert [tok.token_text(i) for i in ids] == ["<s>", " Once", " upon", " a", " time"]


def test_request_ids_reach_the_engine_log(stories_path, caplog):
    from conduit_engine.engine.request import GenerationRequest
    from conduit_engine.sampling_params import SamplingParams
    from tests.engine.support.harness import run_to_completion

    engine = make_engine(stories_path)
    with caplog.at_level("INFO", logger="conduit_engine.engine.llm_engine"):
        engine.add_request(GenerationRequest("req-abc-123", SamplingParams(max_tokens=3), token_ids=[1]))
        run_to_completion(engine)
    messages = [r.getMessage() for r in caplog.records]
    assert any("req-abc-123 queued" in m for m in messages)
    assert any("req-abc-123 finished" in m for m in messages)
