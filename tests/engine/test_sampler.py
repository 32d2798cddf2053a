"""Sampler against independent references: per-row loops in torch and transformers' logits processors."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from conduit_engine.core.stop_rules import blocked_token_ids
from conduit_engine.engine.request import GenerationRequest
from conduit_engine.errors import InvalidRequestError
from conduit_engine.sampling import truncation
from conduit_engine.sampling.logprobs import compute_prompt_logprobs
from conduit_engine.sampling.metadata import build_sampling_metadata, seeded_uniform
from conduit_engine.sampling.plan import SamplingRow
from conduit_engine.sampling.sampler import Sampler, sample_inverse_cdf
from conduit_engine.sampling.truncation import apply_min_p, apply_top_k_top_p
from conduit_engine.sampling_params import SamplingParams
from tests.engine.support.harness import make_engine
from tests.support.stories import PROMPT_IDS

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")
EOS = 2


def row(prompt=(5, 6, 7), output=(), seed=None, **params) -> SamplingRow:
    p = SamplingParams(**params)
    return SamplingRow(p, list(prompt), list(output), seed, blocked_token_ids(p, (EOS,), len(output)))


def sample(logits: torch.Tensor, rows: list[SamplingRow], sampler: Sampler | None = None):
    meta = build_sampling_metadata(rows, logits.shape[1], logits.device)
    return (sampler or Sampler())(logits, meta)


def random_logits(rows: int, vocab: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def reference_processed(logits: torch.Tensor, r: SamplingRow) -> torch.Tensor:
    """Penalties for one row, written as plain per-token loops (independent of the vectorised code)."""
    x = logits.clone()
    p = r.params
    for token_id, bias in p.logit_bias.items():
        x[token_id] += bias
    if len(r.output_token_ids) < p.min_tokens:
        for token_id in [*p.stop_token_ids, *(() if p.ignore_eos else (EOS,))]:
            x[token_id] = -math.inf
    if p.repetition_penalty != 1.0:
        for token_id in set(r.prompt_token_ids) | set(r.output_token_ids):
            x[token_id] = (
                x[token_id] * p.repetition_penalty if x[token_id] < 0 else x[token_id] / p.repetition_penalty
            )
    for token_id, count in Counter(r.output_token_ids).items():
        x[token_id] -= p.frequency_penalty * count + p.presence_penalty
    return x


def reference_logprobs(logits: torch.Tensor, r: SamplingRow) -> torch.Tensor:
    temperature = 1.0 if r.params.temperature == 0 else r.params.temperature
    return torch.log_softmax(reference_processed(logits, r) / temperature, dim=-1)


def assert_logprobs_match(entry, ref: torch.Tensor, token_id: int, k: int, atol: float = 1e-5) -> None:
    assert entry.token_id == token_id
    assert entry.logprob == pytest.approx(ref[token_id].item(), abs=atol)
    assert entry.rank == 1 + int((ref > ref[token_id]).sum())
    expected_top = torch.topk(ref, k)
    assert entry.top_ids == expected_top.indices.tolist()
    assert entry.top_logprobs == pytest.approx(expected_top.values.tolist(), abs=atol)


def allowed_by(warpers, logits: torch.Tensor) -> set[int]:
    scores = logits.unsqueeze(0)
    for warper in warpers:
        scores = warper(None, scores)
    return set(torch.isfinite(scores[0]).nonzero().flatten().tolist())


# ----- greedy and penalties ----------------------------------------------------------------------------


def test_all_greedy_batch_is_plain_argmax_and_skips_work():
    logits = random_logits(6, 100)
    meta = build_sampling_metadata([row(temperature=0.0) for _ in range(6)], 100, CPU)
    assert meta.all_greedy and not meta.has_penalties and not meta.needs_logprobs
    assert meta.temperature is None and meta.top_k is None and meta.output_counts is None
    out = Sampler()(logits, meta)
    assert out.token_ids == logits.argmax(dim=1).tolist()
    assert out.logprobs == [None] * 6


def test_logit_bias_against_reference():
    logits = random_logits(3, 50, seed=1)
    rows = [
        row(temperature=0.0, logit_bias={3: 2.5, 7: -1.0}, logprobs=5),
        row(temperature=0.7, logit_bias={0: -100.0, 49: 0.5}, logprobs=3, seed=1),
        row(temperature=0.0, logprobs=2),
    ]
    out = sample(logits, rows)
    for i, r in enumerate(rows):
        ref = reference_logprobs(logits[i], r)
        assert_logprobs_match(out.logprobs[i], ref, out.token_ids[i], r.params.logprobs)
    assert out.token_ids[0] == int(reference_processed(logits[0], rows[0]).argmax())


def test_logit_bias_plus_100_forces_the_token():
    logits = random_logits(64, 200, seed=2)
    rows = [row(temperature=1.0, top_p=0.9, logit_bias={123: 100.0}, seed=i) for i in range(32)]
    rows += [row(temperature=0.0, logit_bias={7: 100.0}) for _ in range(32)]
    out = sample(logits, rows)
    assert out.token_ids == [123] * 32 + [7] * 32


def test_min_tokens_blocks_eos_and_stop_token_ids():
    logits = random_logits(4, 40, seed=3)
    logits[:, EOS] = 50.0  # EOS would win every time
    logits[:, 9] = 40.0  # then the stop token
    rows = [
        row(temperature=0.0, min_tokens=3, output=[4, 5], stop_token_ids=[9], logprobs=2),
        row(temperature=1.0, min_tokens=3, output=[4], stop_token_ids=[9], seed=7),
        row(temperature=0.0, min_tokens=3, output=[4, 5, 6], stop_token_ids=[9]),  # reached min_tokens
        row(temperature=0.0, min_tokens=3, output=[], ignore_eos=True),  # EOS does not stop this row
    ]
    out = sample(logits, rows)
    assert out.token_ids[0] not in (EOS, 9) and out.token_ids[1] not in (EOS, 9)
    assert out.token_ids[0] == int(reference_processed(logits[0], rows[0]).argmax())
    assert out.token_ids[2] == EOS
    assert out.token_ids[3] == EOS
    assert out.logprobs[0].top_ids[0] not in (EOS, 9)
    assert_logprobs_match(out.logprobs[0], reference_logprobs(logits[0], rows[0]), out.token_ids[0], 2)
    # Over many seeded draws the blocked tokens never come up, although they hold nearly all the mass.
    many = [row(temperature=1.0, min_tokens=1, stop_token_ids=[9], seed=s) for s in range(200)]
    drawn = sample(logits[:1].expand(200, 40).contiguous(), many)
    assert EOS not in drawn.token_ids and 9 not in drawn.token_ids


def test_repetition_penalty_against_transformers():
    logits = random_logits(3, 60, seed=4)
    rows = [
        row(prompt=[1, 2, 3, 10], output=[10, 11, 59], temperature=0.0, repetition_penalty=1.3, logprobs=4),
        row(prompt=[5, 6], output=[7, 7, 7], temperature=0.9, repetition_penalty=0.7, logprobs=4, seed=3),
        row(prompt=[5, 6], output=[8], temperature=0.0, logprobs=4),  # penalty 1: untouched
    ]
    out = sample(logits, rows)
    for i, r in enumerate(rows):
        ids = torch.tensor([list(r.prompt_token_ids) + list(r.output_token_ids)])
        processed = RepetitionPenaltyLogitsProcessor(r.params.repetition_penalty)(
            ids, logits[i : i + 1].clone()
        )[0]
        temperature = r.params.temperature or 1.0
        ref = torch.log_softmax(processed / temperature, dim=-1)
        assert_logprobs_match(out.logprobs[i], ref, out.token_ids[i], 4)
        assert torch.allclose(ref, reference_logprobs(logits[i], r), atol=1e-6)


def test_presence_and_frequency_penalties_against_reference():
    logits = random_logits(3, 30, seed=5)
    rows = [
        # Prompt tokens do not count for presence/frequency, only the output.
        row(prompt=[1, 1, 1, 4], output=[4, 4, 9, 12], temperature=0.0, presence_penalty=1.5, logprobs=6),
        row(prompt=[2], output=[3, 3, 3, 3, 8], temperature=0.6, frequency_penalty=0.8, logprobs=6, seed=2),
        row(
            prompt=[2],
            output=[3, 3, 8],
            temperature=0.0,
            frequency_penalty=-0.5,
            presence_penalty=-1.0,
            logprobs=6,
        ),
    ]
    out = sample(logits, rows)
    for i, r in enumerate(rows):
        assert_logprobs_match(out.logprobs[i], reference_logprobs(logits[i], r), out.token_ids[i], 6)
    meta = build_sampling_metadata(rows, 30, CPU)
    assert meta.output_counts[1, 3].item() == 4 and meta.output_counts[0, 1].item() == 0


def test_all_penalties_combined_against_reference():
    logits = random_logits(5, 80, seed=6)
    rng = random.Random(6)
    rows = [
        row(
            prompt=[rng.randrange(80) for _ in range(12)],
            output=[rng.randrange(80) for _ in range(9)],
            temperature=[0.0, 0.5, 1.0, 1.7, 0.0][i],
            repetition_penalty=[1.0, 1.2, 0.8, 1.5, 2.0][i],
            presence_penalty=[0.0, 0.3, -0.4, 1.0, 2.0][i],
            frequency_penalty=[0.5, 0.0, 0.2, -1.0, 1.0][i],
            logit_bias={rng.randrange(80): rng.uniform(-5, 5) for _ in range(3)},
            min_tokens=[0, 20, 0, 20, 0][i],
            stop_token_ids=[rng.randrange(3, 80)],
            max_tokens=30,
            logprobs=[5, 0, 20, 1, 3][i],
            seed=i,
        )
        for i in range(5)
    ]
    out = sample(logits, rows)
    for i, r in enumerate(rows):
        assert_logprobs_match(
            out.logprobs[i], reference_logprobs(logits[i], r), out.token_ids[i], r.params.logprobs
        )
    assert out.logprobs[1].top_ids == [] and out.logprobs[1].top_logprobs == []
    assert out.token_ids[0] == int(reference_processed(logits[0], rows[0]).argmax())


# ----- temperature and truncation ------------------------------------------------------------------


def test_temperature_scales_logprobs_and_draw_frequencies():
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0, 2.0]])
    n = 6000
    for temperature in (0.5, 1.0, 2.0):
        rows = [row(temperature=temperature, seed=s, logprobs=2) for s in range(n)]
        out = sample(logits.expand(n, 6).contiguous(), rows)
        expected = torch.softmax(logits[0] / temperature, dim=-1)
        counts = Counter(out.token_ids)
        for token_id in range(6):
            assert abs(counts[token_id] / n - expected[token_id].item()) < 0.025, (temperature, token_id)
        ref = torch.log_softmax(logits[0] / temperature, dim=-1)
        assert_logprobs_match(out.logprobs[0], ref, out.token_ids[0], 2)


@pytest.mark.parametrize("top_k", [1, 3, 10, 64])
def test_top_k_mask_and_draws(top_k):
    logits = random_logits(1, 64, seed=7, scale=1.0)[0]
    allowed = allowed_by([TopKLogitsWarper(top_k)], logits)
    masked = apply_top_k_top_p(logits.unsqueeze(0), torch.tensor([top_k]), None)[0]
    assert set(torch.isfinite(masked).nonzero().flatten().tolist()) == allowed
    assert len(allowed) == top_k
    n = 1500
    out = sample(logits.expand(n, 64).contiguous(), [row(top_k=top_k, seed=s) for s in range(n)])
    drawn = set(out.token_ids)
    assert drawn <= allowed
    if top_k <= 10:
        assert drawn == allowed  # every allowed token shows up in 1500 seeded draws


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.6, 0.9, 1.0])
def test_top_p_mask_and_draws(top_p):
    logits = random_logits(1, 64, seed=8, scale=2.0)[0]
    allowed = allowed_by([TopPLogitsWarper(top_p)], logits)
    masked = apply_top_k_top_p(logits.unsqueeze(0), None, torch.tensor([top_p]))[0]
    assert set(torch.isfinite(masked).nonzero().flatten().tolist()) == allowed
    n = 1500
    out = sample(logits.expand(n, 64).contiguous(), [row(top_p=top_p, seed=s) for s in range(n)])
    assert set(out.token_ids) <= allowed
    if len(allowed) <= 6:
        assert set(out.token_ids) == allowed


@pytest.mark.parametrize("min_p", [0.05, 0.2, 0.5, 1.0])
def test_min_p_mask_and_draws(min_p):
    logits = random_logits(1, 64, seed=9, scale=2.0)[0]
    allowed = allowed_by([MinPLogitsWarper(min_p)], logits)
    masked = apply_min_p(logits.unsqueeze(0), torch.tensor([min_p]))[0]
    assert set(torch.isfinite(masked).nonzero().flatten().tolist()) == allowed
    n = 1500
    out = sample(logits.expand(n, 64).contiguous(), [row(min_p=min_p, seed=s) for s in range(n)])
    assert set(out.token_ids) <= allowed
    if len(allowed) <= 6:
        assert set(out.token_ids) == allowed


def test_per_row_truncation_in_one_batch_matches_sequential_warpers():
    """Different top_k / top_p / min_p / temperature per row; each row as transformers would warp it."""
    logits = random_logits(8, 100, seed=10)
    settings = [
        dict(temperature=0.7, top_k=5),
        dict(temperature=1.3, top_p=0.8),
        dict(temperature=1.0, min_p=0.1),
        dict(temperature=0.5, top_k=20, top_p=0.7, min_p=0.05),
        dict(temperature=1.0),
        dict(temperature=2.0, top_k=2),
        dict(temperature=0.9, top_p=0.95, min_p=0.3),
        dict(temperature=1.1, top_k=50, min_p=0.02),
    ]
    draws: list[set[int]] = [set() for _ in settings]
    for step in range(60):
        rows = [row(seed=1000 * i + step, **s) for i, s in enumerate(settings)]
        out = sample(logits, rows)
        for i, token_id in enumerate(out.token_ids):
            draws[i].add(token_id)
    for i, s in enumerate(settings):
        warpers = []
        if s.get("top_k"):
            warpers.append(TopKLogitsWarper(s["top_k"]))
        if s.get("top_p"):
            warpers.append(TopPLogitsWarper(s["top_p"]))
        if s.get("min_p"):
            warpers.append(MinPLogitsWarper(s["min_p"]))
        assert draws[i] <= allowed_by(warpers, logits[i] / s["temperature"]), i


def test_top_k_and_top_p_together_match_sequential_warpers():
    logits = random_logits(8, 200, seed=13)
    ks = [1, 5, 17, 200, 60, 3, 100, 200]
    ps = [0.5, 0.9, 0.3, 0.75, 1.0, 0.99, 0.05, 1.0]
    masked = apply_top_k_top_p(logits, torch.tensor(ks), torch.tensor(ps))
    for i in range(8):
        allowed = allowed_by([TopKLogitsWarper(ks[i]), TopPLogitsWarper(ps[i])], logits[i])
        assert set(torch.isfinite(masked[i]).nonzero().flatten().tolist()) == allowed, i
        kept = torch.isfinite(masked[i])
        assert torch.equal(masked[i][kept], logits[i][kept])  # survivors keep their logits


@pytest.mark.parametrize("candidates", [8, 1024])
def test_top_p_candidate_path_and_full_sort_agree_with_transformers(monkeypatch, candidates):
    """Large vocabularies: peaked rows stay within the candidates, flat rows fall back to the sort."""
    monkeypatch.setattr(truncation, "_TOP_P_CANDIDATES", candidates)
    vocab = 5000
    scales = [6.0, 6.0, 0.05, 0.05, 2.0, 6.0, 1.0, 0.5]
    logits = torch.cat([random_logits(1, vocab, seed=20 + i, scale=sc) for i, sc in enumerate(scales)])
    ps = [0.9, 0.5, 0.9, 0.2, 1.0, 0.999, 0.7, 0.95]
    ks = [vocab, 3000, vocab, vocab, 50, vocab, 2000, vocab]
    for top_k in (None, torch.tensor(ks)):
        masked = apply_top_k_top_p(logits, top_k, torch.tensor(ps))
        for i in range(len(ps)):
            warpers = [TopPLogitsWarper(ps[i])]
            if top_k is not None:
                warpers.insert(0, TopKLogitsWarper(ks[i]))
            allowed = allowed_by(warpers, logits[i])
            assert set(torch.isfinite(masked[i]).nonzero().flatten().tolist()) == allowed, (i, len(allowed))


def test_inverse_cdf_never_lands_on_a_masked_token():
    logits = torch.tensor([[-math.inf, 0.0, -math.inf, 1.0, -math.inf]] * 4)
    extremes = torch.tensor([0.0, 1e-300, 0.5, 1.0 - 2.0**-53], dtype=torch.float64)
    assert sample_inverse_cdf(logits, extremes).tolist() == [1, 1, 3, 3]
    # The split point is the cumulative probability of token 1.
    p1 = torch.softmax(logits[0].double(), dim=-1)[1].item()
    below, above = p1 * (1 - 1e-6), p1 * (1 + 1e-6)
    uniforms = torch.tensor([below, above], dtype=torch.float64)
    assert sample_inverse_cdf(logits[:2], uniforms).tolist() == [1, 3]


def test_seeded_uniform_is_a_pure_well_spread_function():
    draws = [seeded_uniform(seed, step) for seed in range(50) for step in range(40)]
    assert draws == [seeded_uniform(seed, step) for seed in range(50) for step in range(40)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert len(set(draws)) == len(draws)
    assert abs(sum(draws) / len(draws) - 0.5) < 0.02
    # Every tenth of [0, 1) gets its share: neighbouring seeds and steps are not correlated.
    assert all(abs(Counter(int(u * 10) for u in draws)[b] / len(draws) - 0.1) < 0.02 for b in range(10))
    assert seeded_uniform(-5, 0) != seeded_uniform(5, 0)  # negative seeds are valid and distinct


# ----- batching, seeds and randomness --------------------------------------------------------------


def test_greedy_and_sampled_rows_share_one_batch():
    logits = random_logits(6, 300, seed=11)
    rows = [
        row(temperature=0.0),
        row(temperature=0.8, top_k=40, seed=5),
        row(temperature=0.0, repetition_penalty=1.4, output=[int(logits[2].argmax())]),
        row(temperature=1.2, top_p=0.9, seed=6),
        row(temperature=0.0, logprobs=3),
        row(temperature=0.5, min_p=0.1, seed=7, logprobs=3),
    ]
    out = sample(logits, rows)
    for i in (0, 2, 4):
        assert out.token_ids[i] == int(reference_processed(logits[i], rows[i]).argmax())
    for i in (1, 3, 5):
        alone = sample(logits[i : i + 1].clone(), [rows[i]])
        assert out.token_ids[i] == alone.token_ids[0]
    assert_logprobs_match(out.logprobs[4], reference_logprobs(logits[4], rows[4]), out.token_ids[4], 3)
    assert_logprobs_match(out.logprobs[5], reference_logprobs(logits[5], rows[5]), out.token_ids[5], 3)
    assert out.logprobs[0] is None


def run_seeded_row(seed: int, steps: int, vocab: int, with_others: bool) -> list[int]:
    """Generate `steps` tokens for one seeded row, alone or at a moving place in a batch of 9."""
    rng = random.Random(seed)
    sampler = Sampler()
    output: list[int] = []
    for step in range(steps):
        logits = random_logits(1, vocab, seed=step, scale=1.5)
        me = row(output=output, seed=seed, temperature=0.9, top_k=50, top_p=0.95, presence_penalty=0.3)
        if not with_others:
            token = sample(logits, [me], sampler).token_ids[0]
        else:
            others = [
                row(output=[1, 2], seed=None, temperature=1.0),
                row(output=[3], seed=seed + 1, temperature=0.7, top_k=5),
                row(temperature=0.0, repetition_penalty=1.2),
                row(seed=None, temperature=1.5, min_p=0.05, logprobs=2),
                row(seed=seed, output=[4, 5, 6], temperature=1.0),  # same seed, other step: own stream
                row(temperature=0.0),
                row(seed=None, temperature=0.3, frequency_penalty=1.0, output=[7, 7]),
                row(seed=99, temperature=1.0, logit_bias={3: 4.0}),
            ]
            place = rng.randrange(len(others) + 1)
            rows = others[:place] + [me] + others[place:]
            batch = random_logits(len(rows), vocab, seed=10_000 + step, scale=1.5)
            batch[place] = logits[0]
            token = sample(batch, rows, sampler).token_ids[place]
        output.append(token)
    return output


def test_seeded_row_is_independent_of_the_batch():
    alone = run_seeded_row(seed=1234, steps=40, vocab=500, with_others=False)
    batched = run_seeded_row(seed=1234, steps=40, vocab=500, with_others=True)
    assert alone == batched
    # The seed does matter: another seed gives another sequence.
    assert run_seeded_row(seed=4321, steps=40, vocab=500, with_others=False) != alone


def test_same_seed_draws_depend_on_the_step():
    logits = torch.zeros(2, 1000)  # uniform: the draw is the noise alone
    rows = [row(seed=5, temperature=1.0, output=[]), row(seed=5, temperature=1.0, output=[1, 2, 3])]
    first, second = sample(logits, rows).token_ids
    assert first != second
    assert sample(logits, rows).token_ids == [first, second]  # and only on (seed, step)


def test_unseeded_rows_vary():
    logits = torch.zeros(64, 1000)
    rows = [row(temperature=1.0) for _ in range(64)]
    sampler = Sampler()
    first = sample(logits, rows, sampler).token_ids
    second = sample(logits, rows, sampler).token_ids
    other_sampler = sample(logits, rows, Sampler()).token_ids
    assert first != second and first != other_sampler
    assert len(set(first)) > 40  # rows of one step differ from each other too


# ----- logprobs ------------------------------------------------------------------------------------


def test_prompt_logprobs_match_log_softmax():
    logits = random_logits(7, 90, seed=12)
    targets = [3, 80, 0, 45, 45, 12, 89]
    result = compute_prompt_logprobs(logits, targets, k=4)
    ref = torch.log_softmax(logits, dim=-1)
    assert len(result) == 7
    for t, entry in enumerate(result):
        assert_logprobs_match(entry, ref[t], targets[t], 4)
    assert compute_prompt_logprobs(logits[:0], [], k=2) == []
    assert [e.top_ids for e in compute_prompt_logprobs(logits, targets, k=0)] == [[]] * 7


@pytest.fixture(scope="module")
def story_logits(stories_path):
    """Real logits of stories260K (transformers) after the prompt 'Once upon a time'."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(stories_path), dtype=torch.float32).eval()
    prompt = list(PROMPT_IDS)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0]
    return prompt, logits.float()


def test_real_logits_penalties_and_logprobs(story_logits):
    prompt, logits = story_logits
    last = logits[-1]
    vocab = last.shape[0]
    story = [*PROMPT_IDS[1:], 29, 331, 285, 261, 350, 435, 420]  # tokens of a story so far
    rows = [
        row(prompt=prompt, output=story, temperature=0.0, repetition_penalty=1.3, logprobs=5),
        row(
            prompt=prompt,
            output=story,
            temperature=0.8,
            presence_penalty=0.6,
            frequency_penalty=0.4,
            logprobs=5,
            seed=1,
        ),
        row(
            prompt=prompt, output=story, temperature=1.0, logit_bias={261: -3.0, 40: 2.0}, logprobs=20, seed=2
        ),
        row(prompt=prompt, output=story[:2], temperature=0.0, min_tokens=5, logprobs=1),
        row(prompt=prompt, output=story, temperature=0.0, logprobs=3),
    ]
    out = sample(last.expand(len(rows), vocab).contiguous(), rows)
    for i, r in enumerate(rows):
        ids = torch.tensor([prompt + story if i != 3 else prompt + story[:2]])
        processed = RepetitionPenaltyLogitsProcessor(r.params.repetition_penalty)(
            ids, last.unsqueeze(0).clone()
        )[0]
        for token_id, bias in r.params.logit_bias.items():
            processed[token_id] += bias
        if i == 3:
            processed[EOS] = -math.inf
        for token_id, count in Counter(r.output_token_ids).items():
            processed[token_id] -= r.params.frequency_penalty * count + r.params.presence_penalty
        ref = torch.log_softmax(processed / (r.params.temperature or 1.0), dim=-1)
        assert_logprobs_match(out.logprobs[i], ref, out.token_ids[i], r.params.logprobs, atol=1e-4)
    # Plain greedy row: logprobs are the model's log_softmax.
    assert out.token_ids[4] == int(last.argmax())
    assert out.logprobs[4].logprob == pytest.approx(torch.log_softmax(last, -1).max().item(), abs=1e-4)
    assert out.logprobs[4].rank == 1


def test_real_prompt_logprobs(story_logits):
    prompt, logits = story_logits
    result = compute_prompt_logprobs(logits[:-1], prompt[1:], k=5)
    ref = torch.log_softmax(logits[:-1], dim=-1)
    assert len(result) == len(prompt) - 1
    for t, entry in enumerate(result):
        assert_logprobs_match(entry, ref[t], prompt[t + 1], 5, atol=1e-4)


# ----- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_kwargs", "field"),
    [
        ({"params": SamplingParams(logit_bias={600: 1.0}), "token_ids": [1]}, "logit_bias"),
        ({"params": SamplingParams(min_tokens=2, stop_token_ids=[512]), "token_ids": [1]}, "stop_token_ids"),
        ({"params": SamplingParams(repetition_penalty=1.1), "token_ids": [1, 512]}, "token_ids"),
    ],
)
def test_out_of_vocabulary_ids_are_refused_at_admission_naming_the_field(stories_path, request_kwargs, field):
    # Checked once, when the request arrives: the sampler never sees an id outside the vocabulary.
    engine = make_engine(stories_path, num_blocks=16)
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request(GenerationRequest("bad", **request_kwargs))
    assert err.value.field == field
    assert not engine.has_work()


def test_logits_shape_must_match_the_metadata():
    meta = build_sampling_metadata([row(), row()], 50, CPU)
    with pytest.raises(ValueError, match="logits shape"):
        Sampler()(torch.zeros(3, 50), meta)
    with pytest.raises(ValueError, match="logits shape"):
        Sampler()(torch.zeros(2, 49), meta)
    with pytest.raises(ValueError, match="at least one row"):
        build_sampling_metadata([], 50, CPU)
