"""The one evaluation: McNemar's exact test and the paired gain against numbers worked out by hand (and a second,
independent computation), the greedy evaluation on a model whose answers are known, and the sampled evaluation on a
tiny GPT: the same draws at every call, the same draws as before it moved here, KL exactly 0 against itself."""

import copy
import math
import statistics

import pytest
import torch

from llm_from_scratch import gold_rewards, tasks
from llm_from_scratch.evaluation import eval_record, greedy_eval, mcnemar_exact, paired_gain, sampled_eval
from llm_from_scratch.model import GPT, GPTConfig
from llm_from_scratch.tokenizer import Tokenizer

# ----------------------------------------------------------------------------- McNemar


@pytest.mark.grades("evaluation.mcnemar_exact")
def test_mcnemar_by_hand():
    # b = 1 right -> wrong, c = 6 wrong -> right: 2 · (C(7,0) + C(7,1)) / 2^7 = 2 · 8 / 128 = 0.125
    assert mcnemar_exact([1] + [0] * 6, [0] + [1] * 6) == {"b": 1, "c": 6, "p_value": 0.125}
    # b = 0, c = 10: 2 · C(10,0) / 2^10 = 2 / 1024
    assert mcnemar_exact([0] * 10, [1] * 10)["p_value"] == 2 / 1024
    # b = c = 3: 2 · (1 + 6 + 15 + 20) / 64 = 84 / 64, clipped to 1; and nothing changed at all: 1
    assert mcnemar_exact([1, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 1])["p_value"] == 1.0
    assert mcnemar_exact([1, 0, 1], [1, 0, 1]) == {"b": 0, "c": 0, "p_value": 1.0}
    # the concordant problems do not count: b = 1, c = 2 among five (2 · (1 + 3) / 8 = 1, clipped)
    assert mcnemar_exact([1, 1, 0, 0, 1], [0, 1, 1, 1, 1]) == {"b": 1, "c": 2, "p_value": 1.0}
    # two-sided: swapping before and after swaps b and c and keeps p (b = 6, c = 1)
    assert mcnemar_exact([0] + [1] * 6, [1] + [0] * 6) == {"b": 6, "c": 1, "p_value": 0.125}
    # gold rewards as floats, and booleans, are answers too
    assert mcnemar_exact([1.0, 0.0, True], [0.0, 1.0, False])["b"] == 2


def binomial_two_sided(k: int, m: int) -> float:
    """An independent two-sided p-value of k successes in m fair trials: the sum of the probabilities of every outcome
    no more likely than k (the rule of scipy's binomtest), with the pmf built by a loop in floats."""
    pmf = [0.5 ** m]
    for i in range(m):
        pmf.append(pmf[-1] * (m - i) / (i + 1))  # C(m, i + 1) / 2^m from C(m, i) / 2^m
    # 1e-7: equal pmf values (i and m − i) reached by ≲ 2m float64 roundings (≲ 1e-14 apart) count as ties; distinct
    # ones differ by a factor ≥ (m/2 + 1)/(m/2) ≥ 1.04
    return min(1.0, sum(p for p in pmf if p <= pmf[k] * (1 + 1e-7)))


@pytest.mark.grades("evaluation.mcnemar_exact")
def test_mcnemar_against_an_independent_computation():
    for b in range(0, 25):
        for c in range(0, 25):
            before, after = [1] * b + [0] * c + [1, 0], [0] * b + [1] * c + [1, 0]  # + one right, one wrong in both
            expected = 1.0 if b + c == 0 else binomial_two_sided(b, b + c)
            # float64: exact integers divided once against ≲ 2·48 roundings of the loop and a sum of ≤ 49 terms,
            # ≲ 1e-14 relative; 1e-9 leaves room for a student's other float route (lgamma, a float pmf)
            assert mcnemar_exact(before, after)["p_value"] == pytest.approx(expected, rel=1e-9), (b, c)
    try:
        from scipy.stats import binomtest
    except ImportError:
        return  # scipy is not a dependency; the loop above is the second computation
    for b, c in ((1, 6), (3, 17), (40, 61)):  # scipy's float64 pmf by another route: ≪ the default rel 1e-6
        assert (mcnemar_exact([1] * b + [0] * c, [0] * b + [1] * c)["p_value"]
                == pytest.approx(binomtest(b, b + c).pvalue))


@pytest.mark.grades("evaluation.mcnemar_exact")
def test_mcnemar_refuses_what_is_not_a_count():
    with pytest.raises(ValueError, match="right"):
        mcnemar_exact([0.5, 1.0], [1.0, 1.0])  # a story score
    with pytest.raises(ValueError, match="answers"):
        mcnemar_exact([1, 0], [1])


# ----------------------------------------------------------------------------- the paired gain


@pytest.mark.grades("evaluation.paired_gain")
def test_paired_gain_by_hand():
    # 3 prompts x 2 samples, sample j of prompt i at 2i + j:
    after = [1.0, 1.0, 0.5, 1.0, 0.0, 0.0]
    before = [0.0, 1.0, 0.5, 0.5, 0.0, 1.0]
    # differences 1, 0 | 0, 0.5 | 0, -1 -> each prompt's mean 0.5, 0.25, -0.5; their mean, the gain, 0.25 / 3 = 1/12.
    # Deviations 5/12, 2/12, -7/12: squares sum to (25 + 4 + 49) / 144 = 78/144 = 13/24; over P − 1 = 2: s² = 13/48;
    # s.e. = s / √3 = √(13/144) = √13 / 12 = 0.300463
    gain, se = paired_gain(after, before, 2)
    # float64: the differences and prompt means are exact (halves and quarters), the gain rounds once (≤ 7e-18);
    # the s.e. takes ~10 roundings of values ≤ 0.6 (≲ 10·1.1e-16·0.3 = 3e-16)
    assert gain == pytest.approx(1 / 12, abs=1e-15)
    assert se == pytest.approx(math.sqrt(13) / 12, abs=1e-15)
    # (over the 6 samples instead of the prompts it would be 0.2713; with ddof 0 over prompts, 0.2453)
    # the other way round: the same float64 ops with the signs flipped, within approx's default rel 1e-6 as above
    assert paired_gain(before, after, 2) == pytest.approx((-1 / 12, math.sqrt(13) / 12))
    assert paired_gain(after, after, 3) == (0.0, 0.0)


@pytest.mark.grades("evaluation.paired_gain")
def test_paired_gain_is_the_mean_and_se_of_the_prompt_means():
    g = torch.Generator().manual_seed(0)
    a, b = torch.rand(40, generator=g), torch.rand(40, generator=g)
    per_prompt = [statistics.fmean(a[i:i + 4].tolist()) - statistics.fmean(b[i:i + 4].tolist())
                  for i in range(0, 40, 4)]
    gain, se = paired_gain(a.tolist(), b.tolist(), 4)
    # float64 both (statistics rounds its sums exactly): 40 values in [0, 1], ≲ 40·1.1e-16 = 4e-15 apart
    assert gain == pytest.approx(statistics.fmean(per_prompt), abs=1e-12)
    assert se == pytest.approx(statistics.stdev(per_prompt) / math.sqrt(10), abs=1e-12)


@pytest.mark.grades("evaluation.paired_gain")
def test_paired_gain_ends():
    gain, se = paired_gain([1.0, 0.0], [0.0, 0.0], 2)  # one prompt: a mean, no spread to measure
    assert gain == 0.5 and math.isnan(se)
    with pytest.raises(ValueError, match="same draws"):
        paired_gain([1.0, 0.0], [0.0], 1)
    with pytest.raises(ValueError, match="prompts of 4"):
        paired_gain([1.0] * 6, [0.0] * 6, 4)


# ----------------------------------------------------------------------------- greedy

TEXT = "Tell a story. Once upon a time there was a kite. The end. Add 2 and 3. 5 " * 40


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train(TEXT, 300)


class Answers5(GPT):
    """A GPT whose greedy answer to anything is "5" then EOS: after the assistant token it puts all its logit on "5",
    after anything else on EOS."""

    def forward(self, idx, attention_mask=None, kv_cache=None):
        logits = super().forward(idx, attention_mask, kv_cache)  # (B, T, V) (keeps the KV cache in step)
        nxt = torch.where(idx == self.assistant_id, self.five_id, self.eos_id)  # (B, T): the token to put next
        return torch.full_like(logits, -30.0).scatter(-1, nxt[..., None], 30.0)

    @classmethod
    def build(cls, tok):
        torch.manual_seed(0)
        model = cls(GPTConfig(vocab_size=tok.vocab_size, context_length=64, n_layer=1, n_head=2, n_embd=16)).eval()
        (model.five_id,) = tok.encode("5")
        model.assistant_id, model.eos_id = tok.special_tokens["<|assistant|>"], tok.eos_id
        return model


def arithmetic(a: int, b: int) -> dict:
    return {"task": "arithmetic", "prompt": f"Add {a} and {b}.", "answer": a + b}


def test_greedy_eval_by_hand(tok):
    model = Answers5.build(tok)
    examples = [arithmetic(2, 3), arithmetic(1, 1), arithmetic(4, 1), arithmetic(2, 2)]  # "5" is right for 2 of 4
    result = greedy_eval(model, tok, examples, proxy_fn=lambda ps, rs: [float(len(p) + len(r)) for p, r in zip(ps, rs)])
    assert result["gold_each"] == [1.0, 0.0, 1.0, 0.0] and result["gold"] == 0.5 and result["n"] == 4
    assert result["ended"] == 1.0 and result["verifiable"] is True
    assert result["proxy"] == (13 + 13 + 13 + 13) / 4  # "Add a and b." (12 characters) + "5"; exact: 52/4
    assert [s["response"] for s in result["samples"]] == ["5"] * 4 and result["samples"][1]["gold"] == 0.0
    assert "proxy" not in greedy_eval(model, tok, examples)
    cut = greedy_eval(model, tok, examples, max_new_tokens=1)  # room for "5" but not for its EOS
    assert cut["ended"] == 0.0 and cut["gold_each"] == result["gold_each"]
    assert greedy_eval(model, tok, examples) == greedy_eval(model, tok, examples)  # greedy: nothing random
    record = eval_record(result, "eval/greedy")
    assert record == {"eval/greedy/accuracy": 0.5, "eval/greedy/proxy": result["proxy"], "eval/greedy/ended": 1.0}


def test_greedy_eval_of_stories_is_a_gold_score(tok):
    story = next(e.to_dict() for e in tasks.generate_instructions(8, seed=1, tasks=("story",), split="val"))
    result = greedy_eval(Answers5.build(tok), tok, [story, arithmetic(2, 3)])
    assert result["verifiable"] is False and result["gold_each"][1] == 1.0
    assert result["gold_each"][0] == gold_rewards.gold_reward(story, "5")
    assert set(eval_record(result, "eval/greedy")) == {"eval/greedy/gold", "eval/greedy/ended"}
    with pytest.raises(ValueError, match="no held-out"):
        greedy_eval(Answers5.build(tok), tok, [])


# ----------------------------------------------------------------------------- sampled


def tiny_gpt(tok, seed, dropout=0.1):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=64, n_layer=1, n_head=2, n_embd=32, dropout=dropout))


EXAMPLES = [arithmetic(2, 3), arithmetic(1, 4), arithmetic(2, 3),
            {"task": "sort", "prompt": "Sort these words: cat, dog.", "answer": "cat, dog"}]  # 3 distinct prompts


def test_sampled_eval_draws_the_same_every_call_and_kl_is_zero_against_itself(tok):
    policy, reference = tiny_gpt(tok, 0), tiny_gpt(tok, 1)  # dropout 0.1: the evaluation must turn it off
    policy.train()
    a = sampled_eval(policy, reference, tok, EXAMPLES, 4, 0.8, 8, None, seed=3)
    torch.manual_seed(123)  # the global random state must not matter
    b = sampled_eval(policy, reference, tok, EXAMPLES, 4, 0.8, 8, None, seed=3)
    assert a == b and policy.training  # and the mode is given back
    assert a["n"] == 12 and len(a["completions"]) == len(a["gold_each"]) == 12
    assert sampled_eval(policy, reference, tok, EXAMPLES, 4, 0.8, 8, None, seed=4)["completions"] != a["completions"]
    prompts = ["Add 2 and 3.", "Add 1 and 4.", "Sort these words: cat, dog."]
    by_prompt = {e["prompt"]: e for e in EXAMPLES}
    for i, text in enumerate(a["completions"]):  # sample j of prompt i at i * n + j, each scored by the gold reward
        assert a["gold_each"][i] == gold_rewards.gold_reward(by_prompt[prompts[i // 4]], text)
    # float32 against float64 on the same 12 golds, each 0 or 1: the float32 sum is exact and k/12 rounds once
    assert a["gold"] == pytest.approx(statistics.fmean(a["gold_each"]))
    # the float32 s.e. (mean, 12 deviations squared and summed, /11, sqrt, /√12) takes ≲ 12 roundings of u, ≲ 7e-7
    # relative: abs 1e-7 on a s.e. up to 0.15 had no margin, so rel 2e-6
    assert a["gold_se"] == pytest.approx(statistics.stdev(a["gold_each"]) / math.sqrt(12), rel=2e-6)
    assert a["proxy_each"] == a["gold_each"] and a["has_proxy"] is False
    assert [s["prompt"] for s in a["samples"]] == prompts and a["kl_k3"] > 0 and 1 <= a["length"] <= 8

    same = sampled_eval(reference, copy.deepcopy(reference), tok, EXAMPLES, 4, 0.8, 8, None, seed=3)
    assert same["kl"] == 0.0 and same["kl_k3"] == 0.0  # log π − log π_ref = 0 on every token, exactly

    proxy = sampled_eval(policy, reference, tok, EXAMPLES, 4, 0.8, 8, lambda ps, cs: [float(len(c)) for c in cs],
                         seed=3)
    assert proxy["completions"] == a["completions"] and proxy["proxy_each"] == [float(len(c)) for c in a["completions"]]
    assert set(eval_record(proxy, "eval/sampled")) == {f"eval/sampled/{k}" for k in
                                                        ("gold", "gold_se", "proxy", "kl", "kl_k3", "length")}
    assert "eval/sampled/proxy" not in eval_record(a, "eval/sampled")  # the proxy was gold itself
    with pytest.raises(ValueError, match="temperature"):
        sampled_eval(policy, reference, tok, EXAMPLES, 4, 0.0, 8, None, seed=3)
    with pytest.raises(ValueError, match="prefix"):
        eval_record(a, "eval")


def old_sampled_eval(policy, reference, tok, examples, n, temperature, max_new_tokens, proxy_fn, seed):
    """policy_gradient.sampled_eval as it was before it moved to evaluation.py (chapter 7's rollout underneath)."""
    from llm_from_scratch.generation import sequence_logprobs
    from llm_from_scratch.model import eval_mode
    pg = pytest.importorskip("llm_from_scratch.policy_gradient")  # absent from a copy of evaluation.py alone
    by_prompt = {e["prompt"]: e for e in examples}

    def gold_fn(prompts, completions):
        return [gold_rewards.gold_reward(by_prompt[p], c) for p, c in zip(prompts, completions)]

    generator = torch.Generator(device=next(policy.parameters()).device).manual_seed(10_000 + seed)
    ro = pg.rollout(policy, reference, tok, list(by_prompt), n, proxy_fn or gold_fn, gold_fn, max_new_tokens,
                    temperature, None, generator)
    with eval_mode(policy):
        logp = sequence_logprobs(policy, ro.sequences, ro.attention_mask, temperature) * ro.mask
    kl1 = pg.masked_sum(pg.kl_k1(logp, ro.ref_logp), ro.mask, 1)
    kl3 = pg.masked_sum(pg.kl_k3(logp, ro.ref_logp), ro.mask, 1)
    return {"gold": ro.gold.mean().item(), "gold_se": (ro.gold.std() / math.sqrt(ro.gold.numel())).item(),
            "proxy": ro.rewards.mean().item(), "kl": kl1.mean().item(), "kl_k3": kl3.mean().item(),
            "n": ro.gold.numel(), "length": ro.mask.sum(1).float().mean().item(),
            "gold_each": ro.gold.tolist(), "proxy_each": ro.rewards.tolist(), "completions": ro.completions,
            "samples": [{"prompt": p, "response": c, "gold": g} for p, c, g in
                        zip(ro.prompts[::n][:6], ro.completions[::n][:6], ro.gold[::n][:6].tolist())]}


@pytest.mark.parametrize("proxy", [None, "length"])
def test_sampled_eval_gives_the_numbers_it_gave_in_chapter_7(tok, proxy):
    """The same draws, completions and numbers, bit for bit, as the implementation on chapter 7's rollout."""
    policy, reference = tiny_gpt(tok, 0), tiny_gpt(tok, 1)
    proxy_fn = None if proxy is None else (lambda ps, cs: torch.tensor([float(len(c)) for c in cs]))
    for seed in (0, 7):
        new = sampled_eval(policy, reference, tok, EXAMPLES, 3, 0.7, 10, proxy_fn, seed)
        old = old_sampled_eval(policy, reference, tok, EXAMPLES, 3, 0.7, 10, proxy_fn, seed)
        assert new.pop("has_proxy") is (proxy is not None)
        assert new == old
