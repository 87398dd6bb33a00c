"""PPO for language models: per-token rewards, GAE, the clipped value loss, KL control (chapter 8).

Chapter 7 gave each completion one advantage. PPO gives each *token* its own, from a critic V that predicts,
at every completion token, the return still to come. With the KL penalty spread over the tokens:

    r_t = −β · k1_t              at every completion token t   (k1_t = log π(y_t|..) − log π_ref(y_t|..))
        + score                  added at the completion's last real token (the reward model's or the gold score)

    δ_t = r_t + γ V_{t+1} − V_t                        the TD error (V after the last token is 0: the episode ends)
    A_t = δ_t + γλ A_{t+1}                             generalised advantage estimation (GAE)
    returns_t = A_t + V_t                              what the critic is trained to predict

λ = 1 gives the Monte-Carlo advantage (return − V, unbiased, noisy), λ = 0 the one-step TD error (biased by V,
quiet). The critic's loss is clipped like the policy's: ½ max((V − R)², (clip(V, V_old ± ε) − R)²).

The KL coefficient β is fixed, or adapted towards a target KL per completion (Ziegler et al., 2019):

    e = clip(KL / target − 1, −0.2, 0.2),    β ← β · (1 + e · n / horizon)      (n: samples since the last update)

Tensors: per-token values (B, T) with a mask (B, T) that is 1 on completion tokens; a row's completion tokens
are contiguous (left-padded prompt before, padding after its EOS), and padding never counts in a mean.
"""

from __future__ import annotations

import torch

from llm_from_scratch.policy_gradient import masked_mean


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) mask -> (B,) the column of each row's last 1 (a row without one gives 0)."""
    positions = torch.arange(mask.size(1), device=mask.device).expand_as(mask)  # (B, T)
    return (positions * mask.long()).max(dim=1).values


def per_token_rewards(scores: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor,
                      kl_coef: float) -> torch.Tensor:
    """(B,) sequence scores and (B, T) log-probs -> (B, T) rewards: −kl_coef · k1 on every completion token, plus
    the score on each completion's last real token; 0 off the mask."""
    rewards = -kl_coef * (logp - ref_logp) * mask.to(logp.dtype)  # (B, T)
    rows = torch.arange(mask.size(0), device=mask.device)
    rewards[rows, last_token_index(mask)] += scores.to(rewards.dtype)
    return rewards


def compute_gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
                lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns (B, T) by generalised advantage estimation, right to left over the columns.

    Off the mask both are 0, and nothing crosses it: after a row's last real token the next value and the next
    advantage are 0 (the episode ended there), whatever padding follows."""
    mask = mask.to(values.dtype)
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])  # (B,) V_{t+1}
    next_advantage = torch.zeros_like(values[:, 0])  # (B,) A_{t+1}
    for t in reversed(range(values.size(1))):
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # (B,) the TD error
        next_advantage = (delta + gamma * lam * next_advantage) * mask[:, t]  # padding resets the recursion
        next_value = values[:, t] * mask[:, t]
        advantages[:, t] = next_advantage
    returns = (advantages + values) * mask
    return advantages, returns


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                       clip_range: float = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    """½ · masked mean of max((V − R)², (clip(V, V_old − ε, V_old + ε) − R)²) over completion tokens.
    Returns (loss, clipfrac): the share of tokens where the clipped error was the larger one."""
    returns, old_values = returns.detach(), old_values.detach()
    clipped = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
    unclipped_error, clipped_error = (values - returns) ** 2, (clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(unclipped_error, clipped_error), mask)
    clipfrac = masked_mean((clipped_error > unclipped_error).float(), mask)
    return loss, clipfrac.detach()


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 − Var(returns − values) / Var(returns) over the completion tokens: 1 is a perfect critic, 0 one no better
    than predicting the mean return, below 0 worse than that."""
    var_returns = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
    residual = returns - values
    var_residual = masked_mean((residual - masked_mean(residual, mask)) ** 2, mask)
    return (1 - var_residual / var_returns).item() if var_returns > 0 else float("nan")


class FixedKLController:
    """A constant KL coefficient (update does nothing)."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    """The KL coefficient of Ziegler et al. (2019): nudged up when the KL per completion is above `target`, down
    when below, by at most 20% of n_steps / horizon per update (n_steps: samples since the last update)."""

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        if target <= 0 or horizon <= 0:
            raise ValueError(f"AdaptiveKLController: target and horizon must be > 0, got {target} and {horizon}")
        self.value, self.target, self.horizon = init_kl_coef, target, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1, -0.2), 0.2)  # proportional error, clipped to ±0.2
        self.value *= 1 + error * n_steps / self.horizon
