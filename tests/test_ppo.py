"""PPO's pieces against numbers worked out by hand (chapter 8)."""

import pytest
import torch

from llm_from_scratch.ppo import (
    AdaptiveKLController,
    FixedKLController,
    clipped_value_loss,
    compute_gae,
    explained_variance,
    last_token_index,
    per_token_rewards,
)

# A 4-token episode, γ = 0.9, λ = 0.8 (γλ = 0.72), worked right to left:
#   δ3 = 2 + 0.9·0   − 0.2 =  1.8      A3 = 1.8
#   δ2 = 0 + 0.9·0.2 − 0.3 = −0.12     A2 = −0.12 + 0.72·1.8     = 1.176
#   δ1 = 0 + 0.9·0.3 − 0.4 = −0.13     A1 = −0.13 + 0.72·1.176   = 0.71672
#   δ0 = 1 + 0.9·0.4 − 0.5 =  0.86     A0 =  0.86 + 0.72·0.71672 = 1.3760384
REWARDS = [1.0, 0.0, 0.0, 2.0]
VALUES = [0.5, 0.4, 0.3, 0.2]
ADVANTAGES = [1.3760384, 0.71672, 1.176, 1.8]
RETURNS = [a + v for a, v in zip(ADVANTAGES, VALUES)]


def test_gae_by_hand():
    adv, ret = compute_gae(torch.tensor([REWARDS]), torch.tensor([VALUES]), torch.ones(1, 4), gamma=0.9, lam=0.8)
    assert torch.allclose(adv, torch.tensor([ADVANTAGES]), atol=1e-6)
    assert torch.allclose(ret, torch.tensor([RETURNS]), atol=1e-6)


def test_gae_limits_lambda_one_is_return_minus_value_and_zero_is_the_td_error():
    r, v, m = torch.tensor([REWARDS]), torch.tensor([VALUES]), torch.ones(1, 4)
    mc, _ = compute_gae(r, v, m, gamma=1.0, lam=1.0)
    assert torch.allclose(mc, torch.tensor([[3.0 - 0.5, 2.0 - 0.4, 2.0 - 0.3, 2.0 - 0.2]]))  # reward-to-go − V
    td, _ = compute_gae(r, v, m, gamma=0.9, lam=0.0)
    assert torch.allclose(td, torch.tensor([[0.86, -0.13, -0.12, 1.8]]))


def test_gae_of_padded_rows_equals_each_row_alone():
    # row 0: the episode after 2 prompt columns; row 1 (in the middle): a 2-token episode, then padding;
    # row 2: the episode right-padded. Values and rewards on padding are junk that must not leak in.
    junk = 9.0
    rewards = torch.tensor([[junk, junk] + REWARDS, [0.5, 1.0, junk, junk, junk, junk], REWARDS + [junk, junk]])
    values = torch.tensor([[junk, junk] + VALUES, [0.1, 0.2, junk, junk, junk, junk], VALUES + [junk, junk]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]])
    adv, ret = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8)
    assert torch.allclose(adv[0, 2:], torch.tensor(ADVANTAGES), atol=1e-6)
    assert torch.allclose(adv[2, :4], torch.tensor(ADVANTAGES), atol=1e-6)
    alone, _ = compute_gae(torch.tensor([[0.5, 1.0]]), torch.tensor([[0.1, 0.2]]), torch.ones(1, 2), gamma=0.9, lam=0.8)
    assert torch.allclose(adv[1, :2], alone[0])
    assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()


def test_the_score_lands_on_the_last_real_token():
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    assert last_token_index(mask).tolist() == [3, 1]
    logp = torch.full((2, 5), -1.0)
    ref_logp = torch.full((2, 5), -1.5)  # k1 = 0.5 on every token
    r = per_token_rewards(torch.tensor([2.0, -1.0]), logp, ref_logp, mask, kl_coef=0.1)
    assert torch.allclose(r, torch.tensor([[0, -0.05, -0.05, 2 - 0.05, 0], [-0.05, -1 - 0.05, 0, 0, 0]]))


def test_clipped_value_loss_by_hand():
    # inside the range: V = 1.1, V_old = 1.0, R = 2 -> both errors 0.81, loss ½·0.81, not clipped
    loss, frac = clipped_value_loss(torch.tensor([[1.1]]), torch.tensor([[1.0]]), torch.tensor([[2.0]]), torch.ones(1, 1))
    assert loss.item() == pytest.approx(0.405) and frac.item() == 0
    # outside: V = 1.5 is clipped to 1.2; the clipped error (0.8² = 0.64) beats the unclipped (0.5² = 0.25)
    loss, frac = clipped_value_loss(torch.tensor([[1.5]]), torch.tensor([[1.0]]), torch.tensor([[2.0]]), torch.ones(1, 1))
    assert loss.item() == pytest.approx(0.32) and frac.item() == 1
    # moving away from R past the clip: the unclipped error is the larger, the gradient still flows
    v = torch.tensor([[0.5]], requires_grad=True)
    loss, frac = clipped_value_loss(v, torch.tensor([[1.0]]), torch.tensor([[2.0]]), torch.ones(1, 1))
    loss.backward()
    assert loss.item() == pytest.approx(0.5 * 1.5 ** 2) and frac.item() == 0 and v.grad.item() == pytest.approx(-1.5)
    # padding never counts
    loss, _ = clipped_value_loss(torch.tensor([[1.1, 50.0]]), torch.tensor([[1.0, 0.0]]), torch.tensor([[2.0, 0.0]]),
                                 torch.tensor([[1, 0]]))
    assert loss.item() == pytest.approx(0.405)


def test_explained_variance():
    returns, mask = torch.tensor([[1.0, 2.0, 3.0, 99.0]]), torch.tensor([[1, 1, 1, 0]])
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full((1, 4), 2.0), returns, mask) == pytest.approx(0.0)  # the mean return
    assert explained_variance(torch.tensor([[3.0, 2.0, 1.0, 0.0]]), returns, mask) == pytest.approx(-3.0)


def test_adaptive_kl_controller_follows_the_formula():
    kl = AdaptiveKLController(0.1, target=6.0, horizon=10_000)
    kl.update(9.0, n_steps=256)  # 9/6 − 1 = 0.5, clipped to 0.2: × (1 + 0.2 · 256 / 10,000)
    assert kl.value == pytest.approx(0.1 * 1.00512)
    kl.update(3.0, n_steps=256)  # 3/6 − 1 = −0.5, clipped to −0.2
    assert kl.value == pytest.approx(0.1 * 1.00512 * 0.99488)
    kl.update(6.6, n_steps=1000)  # +0.1, inside the clip
    assert kl.value == pytest.approx(0.1 * 1.00512 * 0.99488 * 1.01)
    fixed = FixedKLController(0.05)
    fixed.update(100.0, 256)
    assert fixed.value == 0.05
    with pytest.raises(ValueError):
        AdaptiveKLController(0.1, target=0.0, horizon=10)
