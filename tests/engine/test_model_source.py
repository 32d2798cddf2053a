"""Models named as users name them: Hub ids through huggingface_hub's real cache and error paths.

There is no network to the Hub here. The cache is laid out as `snapshot_download` leaves it
(tests/support/hub.py), so the offline paths are the real library's. The errors a Hub answers with
(unknown repo, gated repo, unknown revision, a server error) come from huggingface_hub parsing a real
HTTP answer of a fault-injecting endpoint on 127.0.0.1 (HF_ENDPOINT); "not cached while offline" and
"not cached while the Hub is unreachable" need no fake at all.
"""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import pytest
from huggingface_hub import constants
from huggingface_hub.utils import filter_repo_objects

from conduit.engine.v1 import engine_pb2 as pb
from conduit.engine.v1 import engine_pb2_grpc
from conduit_engine.errors import ModelLoadError
from conduit_engine.models.source import SERVING_FILES, resolve
from tests.support.hub import COMMIT, FaultyHub, lay_out_hub_cache
from tests.support.processes import free_port, start_engine
from tests.support.stories import KNOWN_STORY

pytestmark = pytest.mark.integration

REPO = "conduit-test/stories260K"


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """huggingface_hub as the engine process would configure it from its environment: offline, an
    empty default cache, no token."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "default-cache"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def cache(tmp_path, stories_path):
    lay_out_hub_cache(tmp_path / "cache", REPO, stories_path)
    return tmp_path / "cache"


def test_a_cached_hub_id_resolves_offline_to_its_snapshot(hub, cache):
    source = resolve(REPO, download_dir=str(cache))
    assert source.folder == cache / "models--conduit-test--stories260K" / "snapshots" / COMMIT
    assert (source.name, source.repo_id) == (REPO, REPO)
    assert resolve(REPO, revision=COMMIT, download_dir=str(cache)).folder == source.folder
    hub.setattr(constants, "HF_HUB_CACHE", str(cache))  # the default cache, as HF_HUB_CACHE sets it
    assert resolve(REPO).folder == source.folder


def test_only_the_files_serving_needs_are_fetched():
    repo = [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "model-00001-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
        "consolidated.safetensors",  # Mistral's own layout of the same weights
        "pytorch_model.bin",
        "tokenizer.model",
        "onnx/model.onnx",
        "README.md",
    ]
    fetched = list(
        filter_repo_objects(repo, allow_patterns=list(SERVING_FILES))
    )  # what snapshot_download keeps
    assert fetched == repo[:9]


def test_offline_with_nothing_cached_says_so(hub, tmp_path):
    with pytest.raises(ModelLoadError) as err:
        resolve("conduit-test/missing", download_dir=str(tmp_path / "empty"))
    message = str(err.value)
    assert message.startswith(f"model 'conduit-test/missing' is not in the cache {tmp_path / 'empty'}")
    assert "the Hub is offline (HF_HUB_OFFLINE=1)" in message


def test_an_uncached_revision_offline_says_so(hub, cache):
    with pytest.raises(ModelLoadError, match=f"model '{REPO}' at revision 'v2' is not in the cache"):
        resolve(REPO, revision="v2", download_dir=str(cache))


def test_a_snapshot_missing_files_lists_them(hub, tmp_path, stories_path):
    cache = tmp_path / "partial"
    lay_out_hub_cache(cache, REPO, stories_path, skip=("tokenizer.json", "model.safetensors"))
    with pytest.raises(ModelLoadError) as err:
        resolve(REPO, download_dir=str(cache))
    assert f"model '{REPO}' (snapshot " in str(err.value)
    assert "lacks tokenizer.json, model.safetensors (or model.safetensors.index.json" in str(err.value)


def test_local_folders_and_paths(hub, tmp_path, stories_path):
    assert resolve(str(stories_path)).name == "stories260K"
    with pytest.raises(ModelLoadError, match="--revision 'main' applies to Hub ids"):
        resolve(str(stories_path), revision="main")
    with pytest.raises(ModelLoadError, match="does not exist \\(and it is not a Hub id"):
        resolve(str(tmp_path / "no" / "such" / "folder"))
    (tmp_path / "empty-model").mkdir()
    with pytest.raises(ModelLoadError, match="lacks config.json, tokenizer.json, model.safetensors"):
        resolve(str(tmp_path / "empty-model"))


@pytest.mark.parametrize(
    ("status", "code", "message"),
    [
        (404, "RepoNotFound", "is neither a local folder nor a repository on the Hugging Face Hub"),
        (401, "RepoNotFound", "is neither a local folder nor a repository on the Hugging Face Hub"),
        (403, "GatedRepo", "is gated: accept its terms at {url}/conduit-test/private and set HF_TOKEN"),
        (404, "RevisionNotFound", "has no revision 'main' on the Hub"),
        (
            500,
            None,
            "is not in the cache {cache} and the Hugging Face Hub at {url} answered with an error "
            "(Server error '500",
        ),
    ],
)
def test_hub_answers_become_clear_errors(hub, tmp_path, status, code, message):
    hub.setattr(constants, "HF_HUB_OFFLINE", False)
    with FaultyHub(status, code) as faulty:
        hub.setattr(constants, "ENDPOINT", faulty.url)
        with pytest.raises(ModelLoadError) as err:
            resolve("conduit-test/private", revision="main", download_dir=str(tmp_path / "c"))
    assert message.format(url=faulty.url, cache=tmp_path / "c") in str(err.value)
    assert faulty.authorizations == [None]  # one request, and no token was sent
    if code in ("RepoNotFound", "GatedRepo"):
        assert str(err.value).endswith("(no HF_TOKEN is set)")


def test_hf_token_is_sent_and_named_in_the_error(hub, tmp_path):
    hub.setattr(constants, "HF_HUB_OFFLINE", False)
    hub.setenv("HF_TOKEN", "hf_conduit_test_token")
    with FaultyHub(403, "GatedRepo") as faulty:
        hub.setattr(constants, "ENDPOINT", faulty.url)
        with pytest.raises(ModelLoadError, match=r"a token is set, but it has no access\)$"):
            resolve("conduit-test/gated", download_dir=str(tmp_path / "c"))
    assert faulty.authorizations == ["Bearer hf_conduit_test_token"]


def test_an_unreachable_hub_falls_back_to_the_cache(hub, cache, tmp_path):
    hub.setattr(constants, "HF_HUB_OFFLINE", False)
    hub.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    assert resolve(REPO, download_dir=str(cache)).folder.name == COMMIT
    with pytest.raises(ModelLoadError, match=r"cannot be reached \(\[Errno 111\] Connection refused\)"):
        resolve("conduit-test/other", download_dir=str(cache))


def test_the_engine_serves_a_hub_id_offline_and_reproduces_the_known_story(tmp_path, stories_path):
    cache = tmp_path / "hub"
    lay_out_hub_cache(cache, REPO, stories_path)
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_HOME": str(tmp_path / "home")}
    engine = start_engine(REPO, "--kv-cache-blocks", "64", env=env)
    try:
        with grpc.insecure_channel(engine.address) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
            assert (info.model, info.architecture) == (REPO, "LlamaForCausalLM")
            request = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=[1]),
                model=REPO,
                sampling=pb.SamplingParams(max_tokens=62, temperature=0.0),
            )
            text = "".join(chunk.text for chunk in stub.Generate(request, timeout=60))
        assert text.strip() == KNOWN_STORY
    finally:
        engine.stop()
    log = engine.output_tail(20_000)
    assert "Loading weights" in log  # the progress bar
    assert "loaded LlamaForCausalLM (0.3M parameters, float32, no quantization) in" in log
    assert "peak process memory" in log


def test_the_engine_exits_with_a_message_not_a_traceback(tmp_path):
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "empty"), "HF_HOME": str(tmp_path / "home")}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "conduit_engine.entrypoints.cli",
            "--model",
            "conduit-test/nothing",
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )
    assert result.returncode == 2
    assert "cannot load the model: model 'conduit-test/nothing' is not in the cache" in result.stderr
    assert "Traceback" not in result.stderr
