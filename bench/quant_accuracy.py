"""Accuracy of `--quantization int8` against float32 (the table in services/engine/README.md):
stories260K (trained) and the random test models of every architecture: perplexity of a held-out text,
greedy agreement (the share of the first N tokens before the first divergence, and the prompts whose N
tokens are all float32's), the largest logprob difference on float32's greedy path (all vocabulary
entries, and the chosen tokens). tests/engine/test_quantization.py pins bounds on these.

    .venv/bin/python bench/quant_accuracy.py [--cpu-kernels auto] [--float-lm-head] [--skip-random]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from common import REPO, stories_path
from tokenizers import Tokenizer

sys.path.insert(0, str(REPO))
from tests.engine.support import quant_eval
from tests.engine.support.model_factory import make_tiny_model
from tests.engine.test_architectures import ARCHS


def row(name: str, acc: quant_eval.Accuracy, prompts: int, tokens: int) -> str:
    return (
        f"| {name} | {acc.ppl_float:.4f} | {acc.ppl_int8:.4f} | {100 * acc.ppl_increase:+.2f}% | "
        f"{100 * acc.agreement:.1f}% | {acc.identical_prompts}/{prompts} | "
        f"{acc.max_chosen_logprob_diff:.3f} | {acc.max_logprob_diff:.3f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-kernels", default="auto")
    parser.add_argument("--float-lm-head", action="store_true", help="--quantize-lm-head false")
    parser.add_argument("--skip-random", action="store_true")
    args = parser.parse_args()
    print(
        "| model | ppl f32 | ppl int8 | Δppl | greedy agreement | identical | max Δlogprob chosen | "
        "max Δlogprob |"
    )
    print("|---|---|---|---|---|---|---|---|")
    folder = stories_path()
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ref = quant_eval.load(folder, "none", args.cpu_kernels)
    int8 = quant_eval.load(folder, "int8", args.cpu_kernels, lm_head=not args.float_lm_head)
    prompts = quant_eval.story_prompts(tok)
    acc = quant_eval.compare(ref, int8, [tok.encode(quant_eval.HELD_OUT).ids], prompts)
    print(row("stories260K, 50 prompts x 64 tokens", acc, len(prompts), 64), flush=True)
    if args.skip_random:
        return
    with tempfile.TemporaryDirectory() as tmp:
        for name, kw in sorted(ARCHS.items()):
            folder = make_tiny_model(Path(tmp) / name, **kw)
            ref = quant_eval.load(folder, "none", args.cpu_kernels)
            int8 = quant_eval.load(folder, "int8", args.cpu_kernels, lm_head=not args.float_lm_head)
            acc = quant_eval.compare(ref, int8, quant_eval.RANDOM_TEXTS, quant_eval.RANDOM_PROMPTS, 16)
            print(row(f"random {name}, 5 x 16", acc, len(quant_eval.RANDOM_PROMPTS), 16), flush=True)


if __name__ == "__main__":
    main()
