"""Speculative decoding: output tokens/s without speculation, with n-gram prompt lookup and with a draft
model, at concurrency 1 and 16, on an input-grounded and a free-generation workload, in one run.

    .venv/bin/python bench/speculative.py [--rounds 3] [--requests 32] [--k 4] [--no-draft] [--draft-layers 4]
        [--wall] [--tensor-parallel-size N]

Concurrency 1 runs 8 requests one after the other (--max-num-seqs 1), concurrency 16 runs --requests of
them 16 at a time.

The engines run in this process (LLMEngine, greedy, ignore_eos, one torch thread), one per configuration,
each warmed up; the configurations take turns within each round and the best round of each is reported
beside the median, with the median over rounds of the ratio to "off" of the same round. Time is this
process's CPU time by default (the machine is shared: other processes' load stretches wall time at
random, not CPU time); --wall uses wall-clock time. --tensor-parallel-size N (N >= 2) runs the target in N
worker processes (the draft stays in this process) and measures wall-clock time, since the workers'
CPU time is not this process's.

Workloads on stories260K (the only real checkpoint here):
- grounded: prompts holding a passage that the model then continues identically. A passage is the
  model's own greedy continuation of a story opening; the prompt is BOS, the passage, BOS and the
  passage's first `cut` tokens; the model, re-reading the passage's start, repeats it. Each candidate is
  run once without speculation and kept with max_tokens = the number of tokens it repeats exactly (at
  least 24), so every output token lies in the passage: what n-gram lookup can reach at best.
- free: story openings alone, 96 tokens each (whatever the model repeats of its own output is
  proposable, the rest is not).
Draft model: stories260K cut to its first --draft-layers layers of five (the same vocabulary, embeddings
and final norm; no smaller model of this vocabulary exists here), made on first use under .models/.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from common import REPO, stories_path

from conduit_engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from conduit_engine.engine.llm_engine import LLMEngine
from conduit_engine.engine.request import GenerationRequest
from conduit_engine.errors import ModelLoadError
from conduit_engine.sampling_params import SamplingParams
from conduit_engine.speculation.config import SpeculativeConfig

OPENINGS = (
    "Once upon a time",
    "One day, a little boy",
    "Tom and Sue",
    "There was a big dog",
    "Lily wanted to",
    "The sun was shining",
    "Ben had a red ball",
    "Mom said",
    "A little bird",
    "Sara and her mom",
    "Once there was a girl named Amy",
    "The boy saw a",
    "Max was a happy dog",
    "It was a cold day",
    "Anna liked to play",
    "The little fish",
    "Timmy went to the park",
    "One morning",
    "The bear was hungry",
    "Sam found a box",
)
CUTS = (4, 6, 8, 12)
MIN_COPY = 24
CONCURRENCY = (1, 16)
CPU_TIME = True  # --wall: tokens per wall-clock second instead of per CPU second of this process
TENSOR_PARALLEL = 1  # --tensor-parallel-size


def make_engine(folder: Path, max_num_seqs: int, spec: SpeculativeConfig | None) -> LLMEngine:
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(path=str(folder), num_threads=1),
            cache=CacheConfig(num_blocks=40 * max_num_seqs + 64),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=2048),
            speculative=spec,
            parallel=ParallelConfig(tensor_parallel_size=TENSOR_PARALLEL),
        )
    )
    run(engine, [([1, 403, 407], 8)])  # warm-up
    return engine


def run(engine: LLMEngine, requests: list[tuple[list[int], int]]) -> tuple[int, float]:
    """All `requests` through `engine` (as many at once as its max_num_seqs): (tokens, seconds)."""
    engine.block_manager.reset_prefix_cache()
    for i, (prompt, max_tokens) in enumerate(requests):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(GenerationRequest(f"r{i}", params, token_ids=prompt))
    tokens, start, cpu = 0, time.perf_counter(), time.process_time()
    while engine.has_work():
        tokens += sum(len(out.token_ids) for out in engine.step())
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return tokens, cpu if CPU_TIME else wall


def greedy_outputs(engine: LLMEngine, prompts: list[tuple[list[int], int]]) -> list[list[int]]:
    engine.block_manager.reset_prefix_cache()
    outputs: dict[str, list[int]] = {}
    for i, (prompt, max_tokens) in enumerate(prompts):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(GenerationRequest(f"g{i}", params, token_ids=prompt))
    while engine.has_work():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.token_ids)
    return [outputs[f"g{i}"] for i in range(len(prompts))]


def workloads(engine: LLMEngine, count: int) -> dict[str, list[tuple[list[int], int]]]:
    tok = engine.tokenizer.hf
    seeds = [[1, *tok.encode(text, add_special_tokens=False).ids] for text in OPENINGS]
    passages = [
        s[1:] + out for s, out in zip(seeds, greedy_outputs(engine, [(s, 80) for s in seeds]), strict=True)
    ]
    candidates = [([1, *p, 1, *p[:cut]], p[cut:]) for p in passages for cut in CUTS]
    outs = greedy_outputs(engine, [(prompt, len(rest)) for prompt, rest in candidates])
    grounded: list[tuple[list[int], int]] = []
    for (prompt, rest), out in zip(candidates, outs, strict=True):
        copied = next((i for i, (a, b) in enumerate(zip(out, rest, strict=False)) if a != b), len(out))
        if copied >= MIN_COPY:
            grounded.append((prompt, copied))
    if not grounded:
        raise SystemExit("no candidate prompt is continued identically for 24 tokens")
    free = [(s, 96) for s in seeds]
    return {"grounded": _cycle(grounded, count), "free": _cycle(free, count)}


def _cycle(items: list, count: int) -> list:
    return [items[i % len(items)] for i in range(count)]


def draft_folder(target: Path, layers: int = 2) -> Path:
    """stories260K with only its first `layers` decoder layers (same vocabulary, embeddings, norm)."""
    folder = REPO / ".models" / f"stories260K-{layers}layers"
    if (folder / "model.safetensors").is_file():
        return folder
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    folder.mkdir(parents=True, exist_ok=True)
    for item in target.iterdir():
        if item.name not in ("model.safetensors", "config.json") and item.is_file():
            shutil.copy(item, folder / item.name)
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    weights = load_file(target / "model.safetensors")
    kept = {
        name: tensor
        for name, tensor in weights.items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers
    }
    save_file(kept, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=32, help="requests per workload at c=16")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--no-draft", action="store_true")
    parser.add_argument("--draft-layers", type=int, default=4, help="layers of stories260K the draft keeps")
    parser.add_argument("--wall", action="store_true", help="wall-clock seconds, not CPU seconds")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="N >= 2 implies --wall")
    args = parser.parse_args()
    global CPU_TIME, TENSOR_PARALLEL
    TENSOR_PARALLEL = args.tensor_parallel_size
    CPU_TIME = not args.wall and TENSOR_PARALLEL == 1
    target = stories_path()
    configs: dict[str, SpeculativeConfig | None] = {
        "off": None,
        "ngram": SpeculativeConfig("ngram", args.k, prompt_lookup_min=2, prompt_lookup_max=5),
    }
    if not args.no_draft:
        try:
            folder = draft_folder(target, args.draft_layers)
            draft = SpeculativeConfig("draft_model", args.k, model=str(folder))
            make_engine(target, 1, draft).shutdown()
            configs["draft"] = draft
        except (ValueError, ModelLoadError) as exc:
            print(f"draft model: not measured ({exc})")
    probe = make_engine(target, 16, None)
    sets = workloads(probe, args.requests)
    probe.shutdown()
    grounded = sets["grounded"]
    print(
        f"grounded: {len({tuple(p) for p, _ in grounded})} distinct prompts, "
        f"{statistics.mean(n for _, n in grounded):.0f} tokens each on average; free: 96 tokens each"
    )
    clock = "wall-clock" if not CPU_TIME else "CPU (this process, one torch thread)"
    where = f"; target in {TENSOR_PARALLEL} workers" if TENSOR_PARALLEL > 1 else ""
    rounds = f"{args.rounds} rounds{where}"
    print(f"k = {args.k}; {rounds}; tokens per {clock} second, best (median); median ratio")
    print("to off over the rounds (each round runs every configuration back to back)")
    header = f"{'workload':9} {'c':>3} {'config':6} {'tok/s best':>10} {'(median)':>9} {'x off':>6}"
    header += f" {'accept':>7}"
    print(header + "  accepted per position")
    for concurrency in CONCURRENCY:
        engines = {name: make_engine(target, concurrency, spec) for name, spec in configs.items()}
        for workload in ("grounded", "free"):
            requests = sets[workload][: (8 if concurrency == 1 else args.requests)]
            rates: dict[str, list[float]] = {name: [] for name in engines}
            for engine in engines.values():
                run(engine, requests)  # a round outside the measurement: caches, allocator, the gate
            before = {name: _counters(engine) for name, engine in engines.items()}
            for _ in range(args.rounds):
                for name, engine in engines.items():
                    tokens, seconds = run(engine, requests)
                    rates[name].append(tokens / seconds)
            for name, engine in engines.items():
                ratio = statistics.median(r / o for r, o in zip(rates[name], rates["off"], strict=True))
                acc, per_pos = _acceptance(before[name], _counters(engine))
                print(
                    f"{workload:9} {concurrency:>3} {name:6} {max(rates[name]):>10.0f} "
                    f"{statistics.median(rates[name]):>9.0f} {ratio:>6.2f} {acc:>7} {per_pos}"
                )
        for engine in engines.values():
            engine.shutdown()


def _counters(engine: LLMEngine):
    spec = engine.scheduler.spec
    return None if spec is None else spec.counters.copy()


def _acceptance(before, after) -> tuple[str, str]:
    if after is None:
        return "-", ""
    drafts = after.num_drafts - before.num_drafts
    proposed = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    if not proposed:
        return "n/a", "(nothing proposed)"
    per_pos = [a - b for a, b in zip(after.accepted_per_pos, before.accepted_per_pos, strict=True)]
    return f"{accepted / proposed:.0%}", " ".join(f"{n / drafts:.0%}" for n in per_pos)


if __name__ == "__main__":
    main()
