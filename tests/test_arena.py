"""The arena: best-of-N (its KL bound against an exact computation, the sampler against plain sampling, the
expected best-of-N against every subset), rejection-sampling fine-tuning, and the one evaluation."""

import itertools
import math

import pytest
import torch

from llm_from_scratch import tasks
from llm_from_scratch.arena import (
    RFTConfig,
    best_of_n,
    best_of_n_curve,
    best_of_n_expected,
    best_of_n_kl_bound,
    best_of_n_weights,
    distinct_n,
    evaluate,
    keep_top,
    rft_round,
    weights_digest,
)
from llm_from_scratch.model import GPT, GPTConfig
from llm_from_scratch.sft import answer, response_logprobs
from llm_from_scratch.tokenizer import Tokenizer


def test_the_kl_bound_by_hand():
    assert best_of_n_kl_bound(1) == 0.0
    assert best_of_n_kl_bound(2) == math.log(2) - 0.5  # 0.193147; exact: the same float64 expression
    assert best_of_n_kl_bound(64) == pytest.approx(4.158883 - 63 / 64, abs=1e-6)  # 3.174508; log 64 to 7 digits (8e-8)
    with pytest.raises(ValueError):
        best_of_n_kl_bound(0)


@pytest.mark.parametrize("n", [1, 2, 4, 16, 64])
def test_the_bound_is_the_exact_kl_for_many_distinct_rewards(n):
    """π uniform over M responses with distinct rewards: the best of n draws is the k-th lowest with probability
    (k/M)^n − ((k−1)/M)^n. Its KL to π, summed exactly, approaches log n − (n−1)/n from below as M grows."""
    # tol is the math's gap, not rounding: the bound minus the KL falls as 1/M², to ≤ 0.017 at M = 100 and ≤ 1.7e-8
    # at M = 100,000 (n = 64 the largest); 1e-3 there let a bound off by 1e-4 pass. + 1e-9: float64's rounding of a
    # sum of 100,000 terms (≲ 1e5·1.1e-16·4 = 4e-11), where the KL equals the bound (n = 1)
    for M, tol in ((100, 0.05), (100_000, 1e-6)):
        k = torch.arange(1, M + 1, dtype=torch.float64)
        p_best = (k / M) ** n - ((k - 1) / M) ** n  # (M,)
        kl = (p_best[p_best > 0] * torch.log(p_best[p_best > 0] * M)).sum().item()
        assert kl <= best_of_n_kl_bound(n) + 1e-9 and kl == pytest.approx(best_of_n_kl_bound(n), abs=tol)


TEXT = "Tell a story. Once upon a time there was a kite. The end. Add 2 and 3. 5 " * 40


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train(TEXT, 300)


def tiny_gpt(tok, context_length=64):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=context_length, n_layer=1, n_head=2,
                         n_embd=32)).eval()


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


# ----------------------------------------------------------------------------- best-of-N from M samples


def brute_force_best_of_n(proxy: list[float], values: list[float], n: int) -> float:
    """The mean, over every n-subset of the samples, of the value of the subset's highest-proxy sample."""
    subsets = list(itertools.combinations(range(len(proxy)), n))
    return sum(values[max(s, key=lambda i: proxy[i])] for s in subsets) / len(subsets)


@pytest.mark.grades("arena.best_of_n_expected")
@pytest.mark.parametrize("n", [1, 2, 3, 5, 6])
def test_best_of_n_expected_averages_every_subset(n):
    g = torch.Generator().manual_seed(n)
    proxy, gold = torch.randn(3, 6, generator=g), torch.rand(3, 6, generator=g)  # 3 prompts x 6 samples
    got = best_of_n_expected(proxy, gold, n)
    want = [brute_force_best_of_n(proxy[i].tolist(), gold[i].tolist(), n) for i in range(3)]
    # float64 both (the brute force in Python floats): means of ≤ 20 values in [0, 1], ≲ 20·1.1e-16 = 2e-15
    assert got.tolist() == pytest.approx(want, abs=1e-12)
    # float64: 6 quotients of integers, each rounded once, then summed: ≲ 11 roundings of 1.1e-16
    assert best_of_n_weights(6, n).sum().item() == pytest.approx(1.0, abs=1e-12)


@pytest.mark.grades("arena.best_of_n_expected")
def test_best_of_n_expected_breaks_ties_as_best_of_n_does():
    proxy = torch.tensor([[1.0, 2.0, 2.0, 0.0, 2.0]])  # three samples tie for the best
    gold = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5]])
    for n in range(1, 6):  # the brute force keeps the first drawn of a subset's tied best
        want = brute_force_best_of_n(proxy[0].tolist(), gold[0].tolist(), n)
        assert best_of_n_expected(proxy, gold, n).item() == pytest.approx(want, abs=1e-12)  # float64, as above


@pytest.mark.grades("arena.best_of_n_expected")
def test_best_of_n_expected_ends():
    proxy, gold = torch.tensor([[0.3, -1.0, 2.0, 0.1]]), torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    # exact in float64 (quarters of small integers); the default rel 1e-6 leaves room for a student's other route
    assert best_of_n_expected(proxy, gold, 1).item() == pytest.approx(2.5)  # N = 1: the plain mean
    assert best_of_n_expected(proxy, gold, 4).item() == pytest.approx(3.0)  # N = M: the highest proxy's gold
    assert best_of_n_weights(4, 2).tolist() == [0, 1 / 6, 2 / 6, 3 / 6]  # C(i-1, 1) / C(4, 2): the same divisions
    with pytest.raises(ValueError):
        best_of_n_weights(4, 5)


def test_best_of_n_curve():
    proxy = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    gold = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
    one, two = best_of_n_curve(proxy, gold, [1, 2])
    # exact in float64: halves and quarters, and the KL bound's own expression
    assert (one["n"], one["kl"], one["gold"], one["proxy"]) == (1, 0.0, 0.5, 0.5)
    assert two["gold"] == 0.25 and two["proxy"] == 1.0  # the proxy picks gold 0 and 0.5
    # sample std 0.5/√2, over √2 prompts (float64: two square roots and a division, ≲ 3 roundings of 1.1e-16)
    assert two["kl"] == math.log(2) - 0.5 and two["gold_se"] == pytest.approx(0.25)


# ----------------------------------------------------------------------------- rejection-sampling fine-tuning


@pytest.mark.grades("arena.keep_top")
def test_keep_top_keeps_exactly_the_top_fraction():
    scores = torch.tensor([[0.1, 0.9, 0.5, 0.7], [3.0, 1.0, 2.0, 0.0], [1.0, 1.0, 0.0, 1.0]])
    assert keep_top(scores, 0.5).tolist() == [[False, True, False, True], [True, False, True, False],
                                              [True, True, False, False]]  # a tie keeps the one drawn first
    assert keep_top(scores, 0.25).tolist() == [[False, True, False, False], [True, False, False, False],
                                               [True, False, False, False]]
    assert keep_top(scores, 0.01).sum(1).tolist() == [1, 1, 1]  # never nothing
    assert keep_top(scores, 0.7).sum(1).tolist() == [3, 3, 3]  # 2.8 rounds to 3
    assert keep_top(scores, 1.0).all()
    g = torch.Generator().manual_seed(0)
    big = torch.randn(50, 8, generator=g)
    kept = keep_top(big, 0.375)
    assert kept.sum(1).tolist() == [3] * 50
    for row, k in zip(big, kept):
        assert row[k].min() > row[~k].max()
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError):
            keep_top(scores, bad)


class Nudged(GPT):
    """A random tiny GPT with a fixed vector added to its logits: one that ends a response often and never writes a
    special token other than EOS, or one that writes a few words over and over."""

    def forward(self, idx, attention_mask=None, kv_cache=None):
        logits = super().forward(idx, attention_mask, kv_cache)  # (B, T, V)
        return logits + self.nudge

    @classmethod
    def build(cls, tok, context_length=64, eos=1.5, favour=()):
        torch.manual_seed(0)
        model = cls(GPTConfig(vocab_size=tok.vocab_size, context_length=context_length, n_layer=1, n_head=2,
                              n_embd=32)).eval()
        model.nudge = torch.zeros(tok.vocab_size)
        model.nudge[list(tok.special_tokens.values())] = -1e4
        model.nudge[tok.eos_id] = eos
        for word in favour:
            model.nudge[tok.encode(word)] = 8.0
        return model


def test_rft_round_keeps_the_best_and_learns_them(tok):
    model = Nudged.build(tok)
    prompts = ["Tell a story.", "Add 2 and 3."]
    cfg = RFTConfig(prompts=2, k=8, keep=0.25, epochs=3, batch_size=2, lr=3e-3, max_new_tokens=10)
    score = lambda ps, rs: [float(r.count("a")) - 0.01 * len(r) for r in rs]  # noqa: E731
    rows = [p for p in prompts for _ in range(cfg.k)]
    drawn = answer(model, tok, rows, cfg.max_new_tokens, temperature=1.0, generator=torch.Generator().manual_seed(3))
    assert 0 < sum(e for _, e in drawn) < len(drawn)  # some samples ended, some were cut off
    before = response_logprobs(model, tok, rows, [t for t, _ in drawn])[0]
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    metrics, kept = rft_round(model, tok, prompts, score, cfg, optimizer, torch.Generator().manual_seed(3))
    kept_rows = []
    for i, p in enumerate(prompts):  # each prompt keeps its 2 best-scored samples among those that ended
        mine = range(i * cfg.k, (i + 1) * cfg.k)
        ended = [j for j in mine if drawn[j][1]]
        best = sorted(ended, key=lambda j: -score([p], [drawn[j][0]])[0])[:2]
        assert sorted(r["response"] for r in kept if r["prompt"] == p) == sorted(drawn[j][0] for j in best)
        kept_rows += best
    assert metrics["rft/kept"] == len(kept) == len(kept_rows)
    after = response_logprobs(model, tok, rows, [t for t, _ in drawn])[0]
    assert all(after[j] > before[j] for j in kept_rows)  # the kept responses became more likely
    ended = [score([rows[j]], [t])[0] for j, (t, e) in enumerate(drawn) if e]
    assert metrics["rft/reward_kept"] >= sum(ended) / len(ended)


def test_rft_trains_on_the_responses_only(tok, monkeypatch):
    """The SFT loss of a round sees, as targets, the kept responses and their EOS, never the prompt tokens: the
    targets that reach lm_loss (captured here) are exactly each kept response's tokens plus EOS."""
    import llm_from_scratch.arena as arena

    seen, real = [], arena.lm_loss

    def spy(model, x, y):
        seen.append(y.clone())
        return real(model, x, y)

    monkeypatch.setattr(arena, "lm_loss", spy)
    model = Nudged.build(tok)
    cfg = RFTConfig(prompts=2, k=8, keep=0.25, epochs=2, batch_size=3, lr=0.0, max_new_tokens=10)
    score = lambda ps, rs: [float(len(r)) for r in rs]  # noqa: E731
    metrics, kept = rft_round(model, tok, ["Tell a story.", "Add 2 and 3."], score, cfg,
                              torch.optim.SGD(model.parameters(), lr=0.0), torch.Generator().manual_seed(3))
    assert len(kept) == metrics["rft/kept"] > 0
    expected = sorted(tuple(tok.encode(r["response"]) + [tok.eos_id]) for r in kept)  # response + EOS per kept row
    targets = sorted(tuple(row[row != -100].tolist()) for y in seen for row in y)  # over both epochs
    assert targets == sorted(expected * cfg.epochs)
    assert sum(int((y != -100).sum()) for y in seen) == cfg.epochs * sum(len(t) for t in expected)


# ----------------------------------------------------------------------------- the evaluation


def test_distinct_n_by_hand():
    assert distinct_n(["a b a b"], 1) == 0.5  # {a, b} of 4 words
    assert distinct_n(["a b a b"], 2) == 2 / 3  # {ab, ba} of ab, ba, ab; exact: the same division of 2 by 3
    assert distinct_n(["a b", "c d"], 2) == 1.0 and distinct_n(["a"], 2) == 0.0


def test_evaluate_is_the_same_for_the_same_checkpoint_and_seed(tok):
    world = tasks.generate_instructions(12, seed=1, tasks=("story", "word_problem"), split="val")
    stories = [e.to_dict() for e in world if e.task == "story"][:3]
    problems = [e.to_dict() for e in world if e.task == "word_problem"][:3]
    assert stories and problems
    reference = tiny_gpt(tok, 512)  # word problems are long prompts
    # repeats itself: distinct-n well below 1
    policy = Nudged.build(tok, 512, eos=-2.0, favour=(" a", " kite", " time"))
    a = evaluate(policy, reference, tok, stories, problems, None, n=3, max_new_tokens=10, seed=4)
    torch.manual_seed(123)  # the global random state must not matter
    b = evaluate(policy, reference, tok, stories, problems, None, n=3, max_new_tokens=10, seed=4)
    assert a == b and a["n"] == 3 * len({s["prompt"] for s in stories}) and a["kl_k3"] > 0  # k3 is never below 0
    c = evaluate(policy, reference, tok, stories, problems, None, n=3, max_new_tokens=10, seed=5)
    assert c["completions"] != a["completions"]  # another seed, other draws
    same = evaluate(reference, reference, tok, stories, problems, None, n=3, max_new_tokens=10, seed=4)
    assert same["kl"] == 0.0 and same["kl_k3"] == 0.0  # one model as both: the same log-probs, exactly
    assert {"accuracy", "distinct_1", "distinct_2", "length", "proxy", "gold_se"} <= set(a)
    assert (a["distinct_1"], a["distinct_2"]) == (distinct_n(a["completions"], 1), distinct_n(a["completions"], 2))
    assert a["distinct_1"] < a["distinct_2"] < 1  # ~3 words: few distinct ones, more distinct pairs
    # a float32 mean of 9 golds in [0, 1] against the float64 mean of the same floats: ≲ 9·u = 5.4e-7 relative
    assert a["gold"] == pytest.approx(sum(a["gold_each"]) / len(a["gold_each"]))


def test_weights_digest(tok):
    a, b = tiny_gpt(tok), tiny_gpt(tok)
    assert weights_digest(a) == weights_digest(b)
    with torch.no_grad():
        b.lm_head.weight[0, 0] += 1e-6
    assert weights_digest(a) != weights_digest(b)
