"""Log-probabilities of chosen tokens: value, rank and the top-k alternatives, for outputs and prompts.

Rank of a token = 1 + the number of tokens with a strictly higher logprob (1 = most likely), as vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from conduit_engine.sampling.token_logprobs import TokenLogprobs


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, ks: Sequence[int]
) -> list[TokenLogprobs]:
    """Chosen-token logprob, rank and top-`ks[i]` alternatives for each row of [N, V] `logprobs`."""
    if logprobs.shape[0] != len(ks) or token_ids.shape != (len(ks),):
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, token_ids {tuple(token_ids.shape)}, {len(ks)} ks"
        )
    if not ks:
        return []
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=1) + 1
    max_k = min(max(ks), logprobs.shape[1])
    # One transfer to Python per tensor for the whole batch, not one device sync per row.
    top_values_list: list[list[float]] = [[] for _ in ks]
    top_ids_list: list[list[int]] = [[] for _ in ks]
    if max_k > 0:
        top_values, top_ids = logprobs.topk(max_k, dim=1)
        top_values_list, top_ids_list = top_values.tolist(), top_ids.tolist()
    chosen_list = chosen.squeeze(1).tolist()
    rank_list = ranks.tolist()
    ids_list = token_ids.tolist()
    return [
        TokenLogprobs(
            token_id=ids_list[i],
            logprob=chosen_list[i],
            rank=rank_list[i],
            top_ids=top_ids_list[i][:k],
            top_logprobs=top_values_list[i][:k],
        )
        for i, k in enumerate(ks)
    ]


def compute_prompt_logprobs(logits: torch.Tensor, target_ids: Sequence[int], k: int) -> list[TokenLogprobs]:
    """Logprobs of the prompt: row t of [L, V] `logits` predicts `target_ids[t]` (the next prompt token).

    Raw log_softmax of the model's logits, without penalties or temperature, as vLLM does.
    """
    if logits.dim() != 2 or logits.shape[0] != len(target_ids):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(target_ids)} target ids")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if not target_ids:
        return []
    targets = torch.tensor(list(target_ids), dtype=torch.long, device=logits.device)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return gather_logprobs(logprobs, targets, [k] * len(target_ids))
