"""Best-of-N: its KL bound against an exact computation, and the sampler against plain sampling."""

import math

import pytest
import torch

from llm_from_scratch.arena import best_of_n, best_of_n_kl_bound
from llm_from_scratch.model import GPT, GPTConfig
from llm_from_scratch.sft import answer
from llm_from_scratch.tokenizer import Tokenizer


def test_the_kl_bound_by_hand():
    assert best_of_n_kl_bound(1) == 0.0
    assert best_of_n_kl_bound(2) == pytest.approx(math.log(2) - 0.5)  # 0.193147
    assert best_of_n_kl_bound(64) == pytest.approx(4.158883 - 63 / 64, abs=1e-6)  # 3.174508
    with pytest.raises(ValueError):
        best_of_n_kl_bound(0)


@pytest.mark.parametrize("n", [1, 2, 4, 16, 64])
def test_the_bound_is_the_exact_kl_for_many_distinct_rewards(n):
    """π uniform over M responses with distinct rewards: the best of n draws is the k-th lowest with probability
    (k/M)^n − ((k−1)/M)^n. Its KL to π, summed exactly, approaches log n − (n−1)/n from below as M grows."""
    for M, tol in ((100, 0.05), (100_000, 1e-3)):
        k = torch.arange(1, M + 1, dtype=torch.float64)
        p_best = (k / M) ** n - ((k - 1) / M) ** n  # (M,)
        kl = (p_best[p_best > 0] * torch.log(p_best[p_best > 0] * M)).sum().item()
        assert kl <= best_of_n_kl_bound(n) + 1e-9 and kl == pytest.approx(best_of_n_kl_bound(n), abs=tol)


TEXT = "Tell a story. Once upon a time there was a kite. The end. Add 2 and 3. 5 " * 40


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train(TEXT, 300)


def tiny_gpt(tok):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=64, n_layer=1, n_head=2, n_embd=32)).eval()


def test_best_of_one_is_plain_sampling(tok):
    model, prompts = tiny_gpt(tok), ["Tell a story.", "Add 2 and 3."]
    plain = answer(model, tok, prompts, 12, temperature=1.0, generator=torch.Generator().manual_seed(5))
    best = best_of_n(model, tok, prompts, 1, lambda ps, rs: [float(len(r)) for r in rs], max_new_tokens=12,
                     generator=torch.Generator().manual_seed(5))
    assert [b["response"] for b in best] == [text for text, _ in plain]


def test_best_of_n_keeps_the_highest_score(tok):
    model, prompts, n = tiny_gpt(tok), ["Tell a story.", "Add 2 and 3.", "Tell a story."], 4
    drawn = answer(model, tok, [p for p in prompts for _ in range(n)], 12, temperature=1.0,
                   generator=torch.Generator().manual_seed(7))
    score = lambda ps, rs: [float(len(r)) for r in rs]  # noqa: E731  the longest response wins
    best = best_of_n(model, tok, prompts, n, score, max_new_tokens=12, generator=torch.Generator().manual_seed(7))
    for i, b in enumerate(best):
        mine = [len(t) for t, _ in drawn[i * n:(i + 1) * n]]
        assert b["scores"] == [float(x) for x in mine] and b["score"] == max(mine)
        assert b["response"] == drawn[i * n + mine.index(max(mine))][0]  # the first of the longest
