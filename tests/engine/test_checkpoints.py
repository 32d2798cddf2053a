"""Checkpoint dtypes and layout: bf16/f16 checkpoints on the CPU, memory-mapped weights, sharded bf16."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conduit_engine.entrypoints.cli import build_parser, config_from_args
from tests.engine.support.harness import generate, greedy, make_engine
from tests.engine.support.model_factory import greedy_with, load_hf, make_tiny_model
from tests.support.stories import KNOWN_STORY

pytestmark = pytest.mark.unit


def convert(source: Path, target: Path, dtype: torch.dtype) -> Path:
    """A copy of the checkpoint folder `source` with its weights (and torch_dtype) in `dtype`."""
    shutil.copytree(source, target)
    weights = load_file(str(source / "model.safetensors"))
    save_file({name: t.to(dtype) for name, t in weights.items()}, str(target / "model.safetensors"))
    config = json.loads((target / "config.json").read_text())
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.fixture(scope="module")
def f32_story(stories_path) -> list[int]:
    return generate(make_engine(stories_path), {"bos": [1]}, greedy(62))["bos"].token_ids


@pytest.mark.parametrize(
    ("checkpoint", "requested", "computed"),
    [
        (torch.bfloat16, "float32", torch.float32),
        (torch.float16, "float32", torch.float32),
        (torch.float16, "auto", torch.float32),  # the CPU has no fast float16: auto computes in float32
    ],
)
def test_half_checkpoints_in_float32_give_the_float32_story(
    tmp_path, stories_path, f32_story, checkpoint, requested, computed
):
    folder = convert(stories_path, tmp_path / "half", checkpoint)
    engine = make_engine(folder, dtype=requested)
    assert engine.dtype == str(computed).removeprefix("torch.")
    out = generate(engine, {"bos": [1]}, greedy(62))["bos"]
    assert out.token_ids == f32_story
    assert engine.tokenizer.decode(out.token_ids).strip() == KNOWN_STORY


def test_a_bf16_checkpoint_runs_in_bf16_on_the_cpu_like_transformers(tmp_path, stories_path):
    folder = convert(stories_path, tmp_path / "bf16", torch.bfloat16)
    engine = make_engine(folder, dtype="auto")
    assert engine.dtype == "bfloat16"
    out = generate(engine, {"bos": [1]}, greedy(30))["bos"]
    assert out.token_ids == greedy_with(load_hf(folder, torch.bfloat16), [1], 30)


def test_float16_compute_is_refused_on_the_cpu():
    args = build_parser().parse_args(["--model", "m", "--dtype", "float16"])
    with pytest.raises(
        ValueError, match="--dtype float16 needs --device cuda: on the CPU use float32 or bfloat16"
    ):
        config_from_args(args)


def _mapped_files() -> list[tuple[int, int, str]]:
    """(start, end, path) of every file mapping of this process."""
    regions = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            regions.append((start, end, fields[5]))
    return regions


def test_weights_in_the_checkpoint_dtype_are_the_memory_mapped_file(stories_path):
    engine = make_engine(stories_path)  # float32 checkpoint, float32 compute, CPU: no copy
    model = engine.executor.model
    checkpoint = str((stories_path / "model.safetensors").resolve())
    regions = [(start, end) for start, end, path in _mapped_files() if path == checkpoint]
    assert regions, "the checkpoint is not mapped"
    for name in ("embed_tokens.weight", "layers.0.input_layernorm.weight", "layers.4.mlp.down_proj.weight"):
        address = model.get_parameter(name).data_ptr()
        assert any(start <= address < end for start, end in regions), name
    # Fused projections are concatenated copies, by necessity.
    fused = model.get_parameter("layers.0.self_attn.qkv_proj.weight").data_ptr()
    assert not any(start <= fused < end for start, end in regions)


def test_a_sharded_bf16_checkpoint_loads_and_matches(tmp_path):
    folder = make_tiny_model(
        tmp_path / "tiny", family="qwen3", num_layers=3, dtype=torch.bfloat16, norm_noise=0.2
    )
    model = load_hf(folder, torch.bfloat16)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, safe_serialization=True, max_shard_size="30KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(folder / name, sharded / name)
    assert len(list(sharded.glob("model-*.safetensors"))) > 2
    engine = make_engine(sharded, dtype="float32")
    assert engine.dtype == "float32"
    out = generate(engine, {"a": [1, 20, 30, 40]}, greedy(12, ignore_eos=True))["a"]
    assert out.token_ids == greedy_with(load_hf(sharded, torch.float32), [1, 20, 30, 40], 12)
