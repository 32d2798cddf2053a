"""The three servers that bench/peers.py compares, each started on a free port of 127.0.0.1 and stopped
with its whole process group: Conduit (engine + gateway, exactly as `make run` starts them), llama.cpp's
llama-server on a GGUF of the same weights, and vLLM's CPU build.

The peers are built by the scripts in ../shared/peers/ (see its README) into $PEERS_DIR (default
~/.cache/conduit-peers); GGUF files are written there too. Nothing of theirs enters the repository.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO.parent / "shared" / "peers"
PEERS_DIR = Path(os.environ.get("PEERS_DIR", Path.home() / ".cache" / "conduit-peers"))
LLAMA_SERVER = PEERS_DIR / "llama.cpp" / "build" / "bin" / "llama-server"
VLLM_PYTHON = PEERS_DIR / "vllm-venv" / "bin" / "python"
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16"}
# vLLM 0.32 CPU attention (vllm/v1/attention/backends/cpu_attn.py) supports these head sizes only.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

sys.path.insert(0, str(REPO))  # for tests.support.processes
from tests.support.processes import ManagedProcess, free_port  # noqa: E402

START_TIMEOUT_S = {"conduit": 600.0, "llama.cpp": 300.0, "vllm": 900.0}


@dataclass(frozen=True)
class ServeJob:
    """What every server gets: the same weights, dtype, batch width and context per sequence."""

    model_dir: Path
    name: str
    dtype: str
    max_num_seqs: int
    context_per_seq: int
    threads: int
    # "int8": Conduit --quantization int8, llama-server on a q8_0 GGUF of the same weights (vLLM: none)
    quantization: str = "none"
    # Each server's own speculative decoding: "ngram" (Conduit's prompt lookup, llama-server's
    # ngram-simple) or "draft" (draft_model; llama-server -md on a GGUF of it), proposing `spec_k` tokens.
    speculative: str = "none"
    spec_k: int = 4
    draft_dir: Path | None = None
    # llama-server repacks weights for the CPU's fastest kernels (AMX on Sapphire Rapids); False passes
    # --no-repack, for CPUs where that path crashes at start (peers.py falls back to it then)
    llama_repack: bool = True


def run_script(script: str, *args: str) -> str:
    """Run one of ../shared/peers/*.sh; returns the last line it prints (the path it made)."""
    path = SCRIPTS / script
    if not path.is_file():
        raise SystemExit(f"{path} is missing: ../shared/peers must sit beside the checkout")
    done = subprocess.run(["bash", str(path), *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{script} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""


def ensure_built(peers: list[str]) -> None:
    """Build what is missing (each script returns at once when its peer is already there)."""
    if "llama.cpp" in peers and not LLAMA_SERVER.is_file():
        print("building llama-server (about 10 min on 2 cores) ...", flush=True)
        run_script("llama_server.sh")
    if "vllm" in peers and not VLLM_PYTHON.is_file():
        print("installing vLLM CPU (about 3 min) ...", flush=True)
        run_script("vllm_cpu.sh")


def to_gguf(model_dir: Path, name: str, dtype: str, quantization: str = "none") -> Path:
    """The GGUF of `model_dir` in `dtype` (q8_0 for --quantization int8), converted once by llama.cpp's
    converter and cached."""
    outtype = "q8_0" if quantization == "int8" else GGUF_TYPES[dtype]
    out = PEERS_DIR / "gguf" / f"{name}-{outtype}.gguf"
    weights = max(p.stat().st_mtime for p in model_dir.glob("*.safetensors"))
    if out.is_file() and out.stat().st_mtime > weights:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"converting {model_dir} to {out.name} ...", flush=True)
    run_script("to_gguf.sh", str(model_dir), str(out), outtype)
    return out


def vllm_refusal(model_dir: Path) -> str | None:
    """Why vLLM CPU cannot serve this model, or None."""
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if head_dim not in VLLM_CPU_HEAD_SIZES:
        return f"vLLM CPU cannot serve head_dim {head_dim}"
    return None


def _conduit(job: ServeJob) -> tuple[list[str], dict[str, str], int]:
    port = free_port()
    args = [sys.executable, "-m", "conduit_engine.entrypoints.run_stack", "--model", str(job.model_dir)]
    args += ["--engine-port", str(free_port()), "--gateway-port", str(port)]
    # run_stack takes no engine flags: the engine reads these from its CONDUIT_* environment.
    env = {"CONDUIT_DTYPE": job.dtype, "CONDUIT_MAX_NUM_SEQS": str(job.max_num_seqs)}
    env["CONDUIT_QUANTIZATION"] = job.quantization
    if job.speculative == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": job.spec_k, "prompt_lookup_min": 2}
        env["CONDUIT_SPECULATIVE_CONFIG"] = json.dumps({**spec, "prompt_lookup_max": 5})
    elif job.speculative == "draft":
        spec = {"method": "draft_model", "model": str(job.draft_dir), "num_speculative_tokens": job.spec_k}
        env["CONDUIT_SPECULATIVE_CONFIG"] = json.dumps(spec)
    return args, env, port


def _llama_cpp(job: ServeJob) -> tuple[list[str], dict[str, str], int]:
    port = free_port()
    gguf = to_gguf(job.model_dir, job.name, job.dtype, job.quantization)
    args = [str(LLAMA_SERVER), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    # -np slots share -c: each sequence gets context_per_seq tokens, as in the other servers.
    args += ["-np", str(job.max_num_seqs), "-c", str(job.max_num_seqs * job.context_per_seq)]
    args += ["-t", str(job.threads), "--alias", job.name]
    if not job.llama_repack:
        args.append("--no-repack")
    if job.speculative == "ngram":  # look up the last 2 tokens in the context, propose the k after them
        args += ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "2"]
        args += ["--spec-ngram-simple-size-m", str(job.spec_k)]
    elif job.speculative == "draft":
        assert job.draft_dir is not None
        draft = to_gguf(job.draft_dir, job.draft_dir.name, job.dtype, job.quantization)
        args += ["--spec-type", "draft-simple", "-md", str(draft), "--spec-draft-n-max", str(job.spec_k)]
    return args, {}, port


def _vllm(job: ServeJob) -> tuple[list[str], dict[str, str], int]:
    port = free_port()
    args = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(job.model_dir)]
    args += ["--host", "127.0.0.1", "--port", str(port), "--dtype", job.dtype]
    args += ["--max-num-seqs", str(job.max_num_seqs), "--max-model-len", str(job.context_per_seq)]
    args += ["--served-model-name", job.name]
    return args, {"VLLM_CPU_KVCACHE_SPACE": "2"}, port


LAUNCHERS: dict[str, Callable[[ServeJob], tuple[list[str], dict[str, str], int]]] = {
    "conduit": _conduit,
    "llama.cpp": _llama_cpp,
    "vllm": _vllm,
}


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


class PeerServer:
    """One server process (and the children it spawns, all in its own session), ready to serve."""

    def __init__(self, peer: str, job: ServeJob) -> None:
        args, env, port = LAUNCHERS[peer](job)
        self.peer = peer
        self.process = ManagedProcess(peer, args, port, env)
        self.url = self.process.url

    def __enter__(self) -> PeerServer:
        try:
            self.process.wait_ready(lambda: _healthy(self.url), START_TIMEOUT_S[self.peer])
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def stop(self) -> None:
        pid = self.process.process.pid
        self.process.stop(grace_s=40.0)
        try:  # children left behind (vLLM's engine core, Conduit's engine if the launcher was killed)
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
