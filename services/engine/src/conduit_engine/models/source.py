"""Where a model comes from: a local folder, or a Hugging Face Hub id (`org/name`) fetched into the cache.

Hub ids go through huggingface_hub's `snapshot_download`, which owns the cache layout, `HF_TOKEN`,
`HF_ENDPOINT`, `HF_HUB_OFFLINE` (then only the cache is used) and the download progress bars. Only what
serving needs is fetched (`SERVING_FILES`). Every way this can fail becomes a ModelLoadError whose
message says what to do; the engine prints it and exits.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from conduit_engine.errors import ModelLoadError

# Transformers-format weights only (a Mistral repo also holds consolidated.safetensors, the same
# weights in another layout), tokenizer files, chat templates, generation defaults.
SERVING_FILES = (
    "config.json",
    "generation_config.json",
    "model*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclass(frozen=True, slots=True)
class ModelSource:
    folder: Path  # a complete model folder on local disk
    name: str  # the name to serve it under by default: the Hub id, or the folder's name
    repo_id: str | None = None  # the Hub id it came from


def is_hub_id(model: str) -> bool:
    return _HUB_ID.fullmatch(model) is not None and ".." not in model


def resolve(model: str, revision: str | None = None, download_dir: str | None = None) -> ModelSource:
    """The local folder of `model`: the folder itself, or the Hub snapshot (downloaded if needed)."""
    path = Path(model).expanduser()
    if path.is_dir():
        if revision is not None:
            raise ModelLoadError(f"--revision {revision!r} applies to Hub ids; {model} is a local folder")
        check_model_folder(path)
        return ModelSource(path, path.resolve().name)
    if not is_hub_id(model):
        raise ModelLoadError(f"model folder {model} does not exist (and it is not a Hub id like org/name)")
    folder = Path(_download(model, revision, download_dir))
    check_model_folder(folder, repo_id=model)
    return ModelSource(folder, model, repo_id=model)


def check_model_folder(folder: Path, repo_id: str | None = None) -> None:
    """Every file serving needs is there; else one error listing all that are missing."""
    missing = [name for name in ("config.json", "tokenizer.json") if not (folder / name).is_file()]
    has_weights = (folder / "model.safetensors").is_file() or (
        folder / "model.safetensors.index.json"
    ).is_file()
    if not has_weights:
        missing.append("model.safetensors (or model.safetensors.index.json with its shards)")
    if missing:
        where = f"model {repo_id!r} (snapshot {folder})" if repo_id else f"model folder {folder}"
        raise ModelLoadError(
            f"{where} lacks {', '.join(missing)}: a model needs config.json, safetensors weights in the "
            "transformers layout and tokenizer.json"
        )


def resolve_files(
    model: str, patterns: tuple[str, ...], revision: str | None = None, download_dir: str | None = None
) -> Path:
    """The local folder of `model` (a folder, or a Hub id whose files matching `patterns` are fetched into
    the cache): how a LoRA adapter comes from the same places as a base model."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if not is_hub_id(model):
        raise ModelLoadError(f"folder {model} does not exist (and it is not a Hub id like org/name)")
    return Path(_download(model, revision, download_dir, patterns))


def _download(
    repo_id: str, revision: str | None, download_dir: str | None, patterns: tuple[str, ...] = SERVING_FILES
) -> str:
    # The Hub client only for Hub ids: a local folder starts without it (it costs ~0.5 s to import).
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache = download_dir or constants.HF_HUB_CACHE
    try:
        return snapshot_download(
            repo_id, revision=revision, cache_dir=download_dir, allow_patterns=list(patterns)
        )
    except GatedRepoError as exc:  # before RepositoryNotFoundError, its base class
        raise ModelLoadError(
            f"model {repo_id!r} is gated: accept its terms at {constants.ENDPOINT}/{repo_id} and set "
            "HF_TOKEN to an access token of that account" + _token_note()
        ) from exc
    except RepositoryNotFoundError as exc:
        raise ModelLoadError(
            f"model {repo_id!r} is neither a local folder nor a repository on the Hugging Face Hub "
            "(if it is private, set HF_TOKEN to a token that can read it)" + _token_note()
        ) from exc
    except RevisionNotFoundError as exc:
        raise ModelLoadError(f"model {repo_id!r} has no revision {revision!r} on the Hub") from exc
    except IncompleteSnapshotError as exc:  # before LocalEntryNotFoundError, its base class
        raise ModelLoadError(
            f"the cached copy of model {repo_id!r} in {cache} is incomplete and the Hub cannot be reached "
            f"to finish it: {exc}"
        ) from exc
    except LocalEntryNotFoundError as exc:
        raise ModelLoadError(_not_cached(repo_id, revision, cache, exc)) from exc
    except HfHubHTTPError as exc:
        raise ModelLoadError(
            f"the Hugging Face Hub refused to serve model {repo_id!r}: {_first_line(exc)}"
        ) from exc
    except OSError as exc:  # the cache folder cannot be written, the disk is full
        raise ModelLoadError(f"cannot store model {repo_id!r} in {cache}: {exc}") from exc


def _not_cached(repo_id: str, revision: str | None, cache: str, exc: Exception) -> str:
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    what = f"model {repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    if constants.HF_HUB_OFFLINE or isinstance(exc.__cause__, OfflineModeIsEnabled):
        why = "the Hub is offline (HF_HUB_OFFLINE=1)"
        fix = "fetch it once with network access (or unset HF_HUB_OFFLINE)"
    else:
        cause = exc.__cause__ or exc
        failed = "answered with an error" if isinstance(cause, HfHubHTTPError) else "cannot be reached"
        why = f"the Hugging Face Hub at {constants.ENDPOINT} {failed} ({_first_line(cause)})"
        fix = "check the network, or fetch it where the Hub is reachable and copy the cache"
    return f"{what} is not in the cache {cache} and {why}: {fix}, or pass --model a local folder"


def _token_note() -> str:
    from huggingface_hub import get_token

    return " (a token is set, but it has no access)" if get_token() is not None else " (no HF_TOKEN is set)"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def main(argv: list[str] | None = None) -> None:
    """`python -m conduit_engine.models.source MODEL`: fetch MODEL (progress on stderr), print its folder.

    On failure it prints the reason as the one line of stdout and exits with status 2 (no traceback):
    a launcher runs it in a child process to learn whether a model is available.
    """
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m conduit_engine.models.source MODEL")
    try:
        print(resolve(args[0]).folder, flush=True)
    except ModelLoadError as exc:
        print(exc, flush=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()


def quiet_progress_bars() -> None:
    """No progress bars from the Hub client (the weights' loading bar): with --log-format json, stderr
    stays one JSON object per line."""
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()
