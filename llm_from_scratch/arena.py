"""The arena (chapter 10): methods that need no training, set beside the trained ones. This file starts with best-of-N.

Best-of-N: sample N responses from the policy π for a prompt and keep the one a reward model scores highest. It
optimises the reward with no gradient step, and its distribution π_N is known in closed form: with the responses
ranked by reward and F the probability that π draws one ranked no higher than y,

    π_N(y) = F(y)^N − F(y⁻)^N                 (the chance that the best of N draws is y)

so its KL to π is bounded by (and, for a continuum of distinct rewards, equal to)

    KL(π_N ‖ π) = log N − (N − 1) / N          (0 for N = 1; 2.20 nats for N = 16; 3.17 for N = 64)

This is the yardstick the trained methods are read against: reward gained at a KL.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from llm_from_scratch.model import GPT
from llm_from_scratch.sft import answer
from llm_from_scratch.tokenizer import Tokenizer

ScoreFn = Callable[[list[str], list[str]], "list[float] | torch.Tensor"]  # (prompts, responses) -> a score each


def best_of_n_kl_bound(n: int) -> float:
    """log N − (N − 1)/N: the KL (nats) of best-of-N sampling to the policy it samples from (an upper bound)."""
    if n < 1:
        raise ValueError(f"best_of_n_kl_bound: N must be ≥ 1, got {n}")
    return math.log(n) - (n - 1) / n


@torch.no_grad()
def best_of_n(model: GPT, tok: Tokenizer, prompts: list[str], n: int, score_fn: ScoreFn, temperature: float = 1.0,
              max_new_tokens: int = 128, generator: torch.Generator | None = None) -> list[dict]:
    """For each prompt, n samples at `temperature` and the one score_fn rates highest (the first on a tie):
    {"prompt", "response", "score", "scores"} per prompt, "scores" holding all n in the order drawn."""
    if n < 1:
        raise ValueError(f"best_of_n: n must be ≥ 1, got {n}")
    if temperature <= 0:
        raise ValueError(f"best_of_n: temperature must be > 0 (greedy answers are all the same), got {temperature}")
    repeated = [p for p in prompts for _ in range(n)]  # sample j of prompt i at i * n + j
    responses = [text for text, _ in answer(model, tok, repeated, max_new_tokens, temperature=temperature,
                                            generator=generator)]
    scores = torch.as_tensor(score_fn(repeated, responses), dtype=torch.float64).view(len(prompts), n)  # (P, n)
    best = scores.argmax(dim=1)  # (P,): the first maximum of each row
    return [{"prompt": p, "response": responses[i * n + int(b)], "score": scores[i, b].item(),
             "scores": scores[i].tolist()} for i, (p, b) in enumerate(zip(prompts, best))]
