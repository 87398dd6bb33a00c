"""The shared RL math of chapter 7, against numbers worked out by hand or from explicit distributions."""

import math

import pytest
import torch

from llm_from_scratch.policy_gradient import (
    MovingAverageBaseline,
    aggregate,
    clipped_policy_loss,
    grpo_advantages,
    kl_k1,
    kl_k3,
    masked_mean,
    masked_whiten,
    policy_gradient_loss,
    rloo_advantages,
)


def test_rloo_leaves_each_sample_out_of_its_own_baseline():
    # prompt A: rewards 1, 0, 0, 1 -> sample 0's baseline is mean(0, 0, 1) = 1/3, so its advantage is 2/3
    # prompt B: rewards 3, 1, 2, 2 -> sample 0's baseline is mean(1, 2, 2) = 5/3, so 4/3; sample 1: 1 - 7/3 = -4/3
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 2.0, 2.0])
    expected = torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 4 / 3, -4 / 3, 0.0, 0.0])
    assert torch.allclose(rloo_advantages(rewards, k=4), expected)
    # equivalently k/(k-1) times the deviation from the group mean; and a group of equal rewards carries no signal
    assert torch.allclose(rloo_advantages(rewards, 4), 4 / 3 * (rewards.view(2, 4) - rewards.view(2, 4).mean(1, True)).view(-1))
    assert torch.equal(rloo_advantages(torch.tensor([0.5, 0.5, 0.5]), 3), torch.zeros(3))


def test_rloo_baseline_never_sees_the_sample_it_judges():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    changed = rewards.clone()
    changed[0] = 10.0  # sample 0's own reward moves its advantage one for one, not through its baseline
    assert rloo_advantages(changed, 4)[0] - rloo_advantages(rewards, 4)[0] == pytest.approx(9.0)
    with pytest.raises(ValueError, match="k ≥ 2"):
        rloo_advantages(rewards, 1)
    with pytest.raises(ValueError, match="groups"):
        rloo_advantages(rewards, 3)


def test_grpo_advantages_by_hand():
    # group 1: rewards 1, 0, 0, 1: mean 1/2, sample std sqrt(((1/2)^2 * 4) / 3) = sqrt(1/3)
    # group 2: all equal -> every advantage 0 (not nan), whatever the scale
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    std = math.sqrt(1 / 3)
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-4)
    adv = grpo_advantages(rewards, 4)
    assert torch.allclose(adv[:4], expected) and torch.equal(adv[4:], torch.zeros(4))
    assert torch.allclose(grpo_advantages(rewards, 4, scale="none"), torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))
    with pytest.raises(ValueError, match="scale"):
        grpo_advantages(rewards, 4, scale="batch")


def test_kl_estimators_on_explicit_distributions():
    # pi = (0.5, 0.3, 0.2), ref = (0.2, 0.3, 0.5): KL(pi||ref) = sum pi log(pi/ref), by hand
    pi, ref = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.3, 0.5])
    kl = (0.5 * math.log(0.5 / 0.2) + 0.3 * 0.0 + 0.2 * math.log(0.2 / 0.5))
    logp, ref_logp = pi.log(), ref.log()
    # both estimators are unbiased: their expectation under pi is the KL
    assert (pi * kl_k1(logp, ref_logp)).sum().item() == pytest.approx(kl, rel=1e-6)
    assert (pi * kl_k3(logp, ref_logp)).sum().item() == pytest.approx(kl, rel=1e-6)
    # k1 is negative where pi < ref; k3 never is; k3 by hand at the first token: ref/pi - 1 - log(ref/pi)
    assert kl_k1(logp, ref_logp)[2] < 0 and (kl_k3(logp, ref_logp) >= 0).all()
    assert kl_k3(logp, ref_logp)[0].item() == pytest.approx(0.4 - 1 - math.log(0.4), rel=1e-6)
    # both are exactly 0 where the policies agree
    assert torch.equal(kl_k1(logp, logp), torch.zeros(3)) and torch.equal(kl_k3(logp, logp), torch.zeros(3))


def test_masked_means_ignore_padding():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 0.0, -7.0, -7.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    assert masked_mean(x, mask).item() == pytest.approx((1 + 2 + 3 + 4 + 0) / 5)
    assert torch.allclose(masked_mean(x, mask, dim=1), torch.tensor([2.0, 2.0]))
    white = masked_whiten(x, mask)
    assert (white[mask == 0] == 0).all()
    assert masked_mean(white, mask).item() == pytest.approx(0.0, abs=1e-6)
    assert masked_mean(white ** 2, mask).item() == pytest.approx(1.0, rel=1e-4)


def test_aggregate_normalisations_by_hand():
    # two sequences, lengths 3 and 1; per-token values 1, 2, 3 and 10
    per_token = torch.tensor([[1.0, 2.0, 3.0, 9.0], [10.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    assert aggregate(per_token, mask, "sum").item() == pytest.approx((6 + 10) / 2)
    assert aggregate(per_token, mask, "sequence").item() == pytest.approx((2 + 10) / 2)
    assert aggregate(per_token, mask, "token").item() == pytest.approx(16 / 4)
    assert aggregate(per_token, mask, "constant", constant=8).item() == pytest.approx((6 / 8 + 10 / 8) / 2)
    with pytest.raises(ValueError):
        aggregate(per_token, mask, "constant")


def test_policy_gradient_step_moves_probability_to_the_rewarded_token():
    """A one-step 'language model' over two tokens; token 1 is rewarded. Sampled with RLOO, a few steps of the
    surrogate's gradient raise p(token 1)."""
    torch.manual_seed(0)
    logits = torch.zeros(2, requires_grad=True)
    opt = torch.optim.SGD([logits], lr=0.5)
    for _ in range(20):
        tokens = torch.multinomial(torch.softmax(logits.detach(), -1), 8, replacement=True)  # 2 prompts x 4 samples
        rewards = (tokens == 1).float()
        logp = torch.log_softmax(logits, -1)[tokens].unsqueeze(1)  # (8, 1): one token per completion
        loss = policy_gradient_loss(logp, rloo_advantages(rewards, 4), torch.ones(8, 1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert torch.softmax(logits, -1)[1] > 0.9


def test_clipped_loss_ratio_is_one_on_the_first_epoch_and_clips_after():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.7]], requires_grad=True)
    mask = torch.ones(2, 2)
    adv = torch.tensor([1.0, -2.0])
    loss, clipfrac = clipped_policy_loss(logp, logp, adv, mask)  # old log-probs are constants, even when the same tensor
    # ratio 1 everywhere: the loss is -mean(A), its gradient the plain policy gradient, nothing clipped
    assert loss.item() == pytest.approx(-(1.0 - 2.0) / 2) and clipfrac.item() == 0.0
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-0.5, -0.5], [1.0, 1.0]]) / 2)
    # the policy moved: ratio e^0.5 ≈ 1.65 on row 0 (A > 0) is clipped to 1.2, and its gradient is cut
    moved = (logp.detach() + torch.tensor([[0.5, 0.5], [0.0, 0.0]])).requires_grad_()
    loss, clipfrac = clipped_policy_loss(moved, logp.detach(), adv, mask)
    loss.backward()
    assert clipfrac.item() == pytest.approx(0.5) and torch.equal(moved.grad[0], torch.zeros(2))
    assert loss.item() == pytest.approx((-1.2 * 1.0 + 2.0) / 2)


def test_moving_average_baseline_uses_only_past_batches():
    b = MovingAverageBaseline(decay=0.5)
    assert torch.equal(b.advantages(torch.tensor([1.0, 3.0])), torch.tensor([1.0, 3.0]))  # no past: baseline 0
    assert b.value == 2.0
    assert torch.equal(b.advantages(torch.tensor([0.0, 4.0])), torch.tensor([-2.0, 2.0]))  # baseline 2, from before
    assert b.value == pytest.approx(0.5 * 2.0 + 0.5 * 2.0)
