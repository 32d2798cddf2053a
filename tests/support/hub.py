"""The Hugging Face Hub without a network: a real cache layout on disk, and a fault-injecting endpoint.

`lay_out_hub_cache` writes what `snapshot_download` leaves behind (blobs named by their sha256,
`snapshots/<commit>/` of relative symlinks to them, `refs/main`), so huggingface_hub itself finds the
model offline. `FaultyHub` is an HTTP server for HF_ENDPOINT that answers every request with one error
status and the `X-Error-Code` header the Hub sends, so huggingface_hub raises its own
RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError or HfHubHTTPError from a real response;
it records each request's Authorization header.
"""

from __future__ import annotations

import hashlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def lay_out_hub_cache(
    cache: Path, repo_id: str, source: Path, commit: str = COMMIT, skip: tuple[str, ...] = ()
) -> Path:
    """Put the files of `source` (except `skip`) into `cache` as repo `repo_id` at `commit` on main;
    returns the snapshot folder. The source is copied, never linked."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in sorted(source.iterdir()):
        if not file.is_file() or file.name in skip:
            continue
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


class FaultyHub:
    """`with FaultyHub(404, "RepoNotFound") as hub:` then point HF_ENDPOINT at `hub.url`."""

    def __init__(self, status: int, error_code: str | None) -> None:
        self.status = status
        self.error_code = error_code
        self.authorizations: list[str | None] = []  # one per request, in order
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                hub.authorizations.append(self.headers.get("Authorization"))
                self.send_response(hub.status)
                if hub.error_code is not None:
                    self.send_header("X-Error-Code", hub.error_code)
                    self.send_header("X-Error-Message", f"injected {hub.error_code}")
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_HEAD = do_POST = _answer

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FaultyHub:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.shutdown()
        self._server.server_close()
