"""Rollouts one step stale (async_rollouts.py, appendix B): the truncated importance weights, the update they change,
and the worker process (chapter 7 with --async, killed and resumed: tests/test_chapters.py).

With staleness 0 (a batch sampled by the weights it updates) the update must be the synchronous one bit for bit; with
staleness 1 the ratios must be against the policy that sampled (a test where it differs from the one updated)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from llm_from_scratch.async_rollouts import RolloutWorker
from llm_from_scratch.generation import sequence_logprobs
from llm_from_scratch.model import GPT, GPTConfig, eval_mode
from llm_from_scratch.policy_gradient import (
    PGConfig,
    masked_sum,
    pg_update,
    rloo_advantages,
    rollout,
    truncated_is_weights,
)
from llm_from_scratch.ppo import AdaptiveKLController, PolicyValue, PPOConfig, make_optimizer, ppo_step
from llm_from_scratch.tokenizer import Tokenizer

TEXT = "Add 2 and 3. 5 Sort these words: cat, dog. cat, dog Once upon a time there was a kite. The end. " * 30
PROMPTS = ["Add 2 and 3.", "Sort these words: cat, dog.", "Once upon a time"]


def length_reward(prompts: list[str], completions: list[str]) -> list[float]:
    return [float(len(c) % 3 == 0) + 0.1 * len(c) for c in completions]  # never all equal in a group


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train(TEXT, 300)


def tiny_gpt(tok: Tokenizer, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=64, n_layer=1, n_head=2, n_embd=32))


def own_logprobs(policy, ro) -> torch.Tensor:  # (B, T-1): the policy's log-probs of the batch, as the update has them
    with eval_mode(policy), torch.no_grad():
        return sequence_logprobs(policy, ro.sequences, ro.attention_mask, ro.temperature) * ro.mask


# ----------------------------------------------------------------------------- the weights, by hand

def test_truncated_is_weights_by_hand():
    """π_old / μ = 0.5/0.25, 0.2/0.4, 0.9/0.3 = 2, 0.5, 3 on the three real tokens; the cap 2 cuts only the 3 (a
    ratio equal to the cap is not cut); the padded token weighs 0 and counts nowhere."""
    logp = torch.log(torch.tensor([[0.5, 0.2], [0.9, 0.7]]))
    mu = torch.log(torch.tensor([[0.25, 0.4], [0.3, 0.1]]))
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    weights, stats = truncated_is_weights(logp, mu, mask, cap=2.0)
    # float32: each ratio is exp(log a − log b) of rounded probabilities: ≲ 8 roundings ≈ 5e-7 relative; the cap
    # (2.0) and the padded 0 are exact. The mean adds a 3-term sum and a divide: ≲ 6e-7 < approx's rel 1e-6
    assert torch.allclose(weights, torch.tensor([[2.0, 0.5], [2.0, 0.0]]))
    assert stats["offpolicy/ratio"] == pytest.approx((2 + 0.5 + 3) / 3)
    assert stats["offpolicy/ratio_max"] == pytest.approx(3.0)
    assert stats["offpolicy/capped"] == 1 / 3  # exact: a count (1.0) over a count (3.0), divided as here
    on_policy, stats = truncated_is_weights(logp, logp.clone(), mask)
    assert torch.equal(on_policy, mask) and stats["offpolicy/ratio"] == 1.0 and stats["offpolicy/capped"] == 0.0
    with pytest.raises(ValueError, match="cap must be ≥ 1"):
        truncated_is_weights(logp, mu, mask, cap=0.5)


# ----------------------------------------------------------------------------- the update, staleness 0 and 1

CASES = {"rloo": dict(algo="rloo", beta=0.05), "grpo_kl_loss": dict(algo="grpo", inner_epochs=2, kl_in="loss",
                                                                     beta=0.05)}


@pytest.mark.parametrize("case", CASES)
def test_staleness_zero_is_the_synchronous_update_bit_for_bit(tok, case):
    """A batch whose behaviour log-probs are the updated policy's own: every weight is exactly 1, and the metrics and
    the weights after the update are those of the update without them."""
    policy, reference = tiny_gpt(tok), tiny_gpt(tok, 1)
    cfg = PGConfig(k=4, max_new_tokens=6, **CASES[case])
    ro = rollout(policy, reference, tok, PROMPTS, 4, length_reward, max_new_tokens=6,
                 generator=torch.Generator().manual_seed(0), behaviour=True)
    assert torch.equal(ro.behaviour_logp, own_logprobs(policy, ro))  # the rollout kept the sampler's own log-probs
    results = []
    for behaviour in (ro.behaviour_logp, None):
        model = copy.deepcopy(policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
        ro.behaviour_logp = behaviour
        results.append((pg_update(model, optimizer, ro, cfg), model))
    (stale, a), (sync, b) = results
    assert stale.pop("offpolicy/ratio") == 1.0 and stale.pop("offpolicy/capped") == 0.0
    assert stale.pop("offpolicy/ratio_max") == 1.0
    assert stale == sync
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_staleness_one_weighs_by_the_sampler_not_the_updated_policy(tok):
    """Sampled by θ0, updated at θ1 (one RLOO step later): the logged ratios are π_θ1 / π_θ0 of the sampled tokens,
    and the loss is −mean_i Σ_t min(π_θ1/π_θ0, C)_it · A_i · log π_θ1(y_it), computed here independently. A ratio
    against the updated policy itself (all 1) or against the reference gives another loss."""
    policy, reference = tiny_gpt(tok), tiny_gpt(tok, 1)
    cfg = PGConfig(k=4, max_new_tokens=6, beta=0.0, is_cap=1.2)
    g = torch.Generator().manual_seed(0)
    stale = rollout(policy, reference, tok, PROMPTS, 4, length_reward, max_new_tokens=6, generator=g, behaviour=True)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-2, weight_decay=0.0)
    pg_update(policy, optimizer, rollout(policy, reference, tok, PROMPTS, 4, length_reward, max_new_tokens=6,
                                         generator=g), cfg)  # θ0 -> θ1
    logp1 = own_logprobs(policy, stale)  # (B, T-1) at θ1
    mask = stale.mask.float()  # (B, T-1)
    ratio = torch.exp(logp1 - stale.behaviour_logp) * mask
    assert not torch.allclose(ratio, mask)  # the policy moved: the ratios differ from 1 by O(0.1), not by rounding
    adv = rloo_advantages(stale.rewards, 4)
    expected = -(masked_sum(ratio.clamp(max=1.2) * adv[:, None] * logp1, stale.mask, dim=1)).mean().item()
    wrong = {"the updated policy": mask, "the reference": (torch.exp(logp1 - stale.ref_logp) * mask).clamp(max=1.2)}
    metrics = pg_update(copy.deepcopy(policy), torch.optim.AdamW(policy.parameters(), lr=0.0), stale, cfg)
    # the update's own forward pass (with gradients) may order its sums otherwise: a log-prob (a logsumexp of ~300
    # logits, |logp| ≲ 6) off by ~√300·6e-8 ≈ 1e-6, so a ratio by ~1e-6 relative; the mean sums 71 ratios ~1:
    # ≲ 71·6e-8 ≈ 4e-6 relative. The share above the cap counts the same tokens (no ratio within 1% of 1.2 here):
    # float64 against float32 division, ≤ 6e-8 relative
    assert metrics["offpolicy/ratio"] == pytest.approx((ratio.sum() / mask.sum()).item(), rel=1e-5)
    assert metrics["offpolicy/ratio_max"] == pytest.approx(ratio.max().item(), rel=1e-5)
    assert metrics["offpolicy/capped"] == pytest.approx(((ratio > 1.2).float().sum() / mask.sum()).item())
    # the loss sums ≤ 6 tokens per row and averages 12 rows of terms w·A·logp that nearly cancel (Σ|terms| ≈ 16 a
    # row against a loss of ~0.7): two orders and product roundings give ≲ (6 + 12 + 3)·6e-8·16 ≈ 2e-5
    assert metrics["loss/policy"] == pytest.approx(expected, rel=1e-5, abs=3e-5)
    for name, w in wrong.items():
        other = -(masked_sum(w * adv[:, None] * logp1, stale.mask, dim=1)).mean().item()
        assert not math.isclose(other, expected, rel_tol=1e-4), name  # they differ by ~20%: far beyond 3e-5


def test_ppo_weighs_its_clipped_terms_and_is_unchanged_at_staleness_zero(tok):
    """PPO on a batch with the sampler's log-probs: at staleness 0 the same metrics and weights as without them (the
    ratios are 1 to the last bit: the first minibatch's old log-probs are computed as the sampler's were); a batch
    sampled by another policy weighs the clipped terms and logs ratios ≠ 1."""
    reference = tiny_gpt(tok, 1)
    policy = PolicyValue(tiny_gpt(tok))
    ro = rollout(policy.gpt, reference, tok, PROMPTS, 4, length_reward, max_new_tokens=6,
                 generator=torch.Generator().manual_seed(0), behaviour=True)
    cfg = PPOConfig(epochs=2, minibatches=1)
    runs = []
    for behaviour in (ro.behaviour_logp, None):
        model = copy.deepcopy(policy)
        ro.behaviour_logp = behaviour
        metrics = ppo_step(model, None, make_optimizer(model, None, 1e-2, 1e-2), ro,
                           AdaptiveKLController(0.05, 1.0, 100), cfg, torch.Generator().manual_seed(1))
        runs.append((metrics, model))
    (stale, a), (sync, b) = runs
    assert stale.pop("offpolicy/ratio") == 1.0 and stale.pop("offpolicy/capped") == 0.0
    stale.pop("offpolicy/ratio_max")
    assert stale == sync and all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    ro.behaviour_logp = own_logprobs(tiny_gpt(tok, 2), ro)  # as if another policy had sampled
    metrics = ppo_step(copy.deepcopy(policy), None, make_optimizer(policy, None, 0.0, 0.0), ro,
                       AdaptiveKLController(0.05, 1.0, 100), cfg, torch.Generator().manual_seed(1))
    # another policy's log-probs move the ratios and the loss by O(1), far beyond approx's default rel 1e-6
    assert metrics["offpolicy/ratio"] != pytest.approx(1.0) and metrics["loss/policy"] != pytest.approx(
        sync["loss/policy"])


# ----------------------------------------------------------------------------- the worker process

def toy_sampler(seed: int):
    """A RolloutWorker build function (module level: it crosses to the spawned process by name)."""
    tok = Tokenizer.train(TEXT, 300)
    policy, reference = tiny_gpt(tok), tiny_gpt(tok, 1)
    generator = torch.Generator().manual_seed(seed)

    def sample(weights, prompts):
        if not prompts:
            raise ValueError("no prompts")
        policy.load_state_dict(weights)
        ro = rollout(policy, reference, tok, prompts, 4, length_reward, max_new_tokens=6, generator=generator,
                     behaviour=True)
        return ro, generator.get_state()

    return sample


def test_the_worker_samples_what_this_process_would_and_reports_its_errors(tok):
    """The worker, sent these weights, returns the rollout this process samples with the same weights and random
    stream, with the sampler's log-probs; while it holds a request the trainer's weights may change without reaching
    it; an error in the worker comes back as one naming it."""
    policy, reference = tiny_gpt(tok, 5), tiny_gpt(tok, 1)
    here_g = torch.Generator().manual_seed(3)
    with RolloutWorker(toy_sampler, 3) as worker:
        worker.submit(policy, PROMPTS)
        with torch.no_grad():  # the trainer's update, while the worker samples with the weights it was sent
            for p in policy.parameters():
                p.add_(1.0)
        ro = worker.receive()
        with torch.no_grad():
            for p in policy.parameters():
                p.sub_(1.0)
        here = rollout(policy, reference, tok, PROMPTS, 4, length_reward, max_new_tokens=6, generator=here_g)
        assert torch.equal(ro.sequences, here.sequences) and ro.completions == here.completions
        assert torch.equal(worker.stream, here_g.get_state())
        # the same forward pass in the worker, on 1 thread against this process's 2: another split of its sums.
        # A log-prob (a logsumexp of ~300 logits, |logp| ≲ 6) moves by ≲ 300·6e-8 ≈ 2e-5 worst case, ~1e-6
        # typical; allclose's atol 1e-5 + rtol 1e-5 × |logp| covers it
        assert torch.allclose(ro.behaviour_logp, own_logprobs(policy, here), atol=1e-5)
        assert torch.allclose(ro.ref_logp, here.ref_logp, atol=1e-5)
        worker.submit(policy, [])
        with pytest.raises(RuntimeError, match="rollout worker failed:(.|\n)*ValueError: no prompts"):
            worker.receive()
