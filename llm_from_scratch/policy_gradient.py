"""Policy gradients for language models: the shared RL math (chapter 7; PPO, DPO and the arena reuse it).

A completion y = (y_1 .. y_L) to a prompt x gets one reward R. The policy-gradient theorem for a sequence:

    ∇ E_y~π[R] = E[ (R − b) · Σ_t ∇ log π(y_t | x, y_<t) ]

for any baseline b that does not depend on y (it shifts the estimate's variance, not its mean). The
estimators differ only in the advantage A = R − b they put in front of the log-probs:

    REINFORCE            b = 0, or a moving average of past rewards
    RLOO                 k samples per prompt; sample i's baseline is the mean reward of the OTHER k−1:
                         A_i = R_i − (Σ_j R_j − R_i) / (k − 1)        (unbiased: b_i does not see R_i)
    GRPO                 A_i = (R_i − mean_group) / std_group          (scale="group")
    Dr. GRPO             A_i =  R_i − mean_group                       (scale="none": no std, no length bias)

and in how the per-token terms are summed into one loss (`aggregate`): "sum" (Σ_t per sequence, then the
mean over sequences: the REINFORCE/RLOO form), "sequence" (the mean over a sequence's own tokens, then over
sequences: GRPO, which favours short right answers and long wrong ones), "token" (every token of the batch
weighs the same) and "constant" (Σ_t divided by one fixed length for every sequence: Dr. GRPO).

Keeping the policy near the reference π_ref (the SFT model), per token, with d = log π − log π_ref:

    k1 = d                     unbiased for KL(π‖π_ref) on samples of π, but negative on some tokens
    k3 = exp(−d) − 1 + d       also unbiased, never negative, lower variance (Schulman's estimator)

GRPO reuses one batch of rollouts for a few inner epochs with PPO's clipped ratio ρ = π / π_old:
loss_t = −min(ρ_t A, clip(ρ_t, 1 − ε, 1 + ε) A); on the first inner epoch ρ = 1 exactly.

Tensors: rewards and advantages (B,) with the k samples of a prompt in consecutive rows; per-token values
(B, T) with a mask (B, T) that is 1 on completion tokens (up to and including the first EOS).
"""

from __future__ import annotations

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ x over the positions where mask is 1 (all of them, or along `dim`)."""
    x = x * mask.to(x.dtype)
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The mean of x over the positions where mask is 1: padding never counts. A row with no such position gives 0."""
    count = mask.to(x.dtype).sum() if dim is None else mask.to(x.dtype).sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x − mean) / std over the masked positions (the std uses those positions only); padding stays 0."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    white = (x - mean) / torch.sqrt(var + eps)
    if not shift_mean:
        white = white + mean
    return white * mask.to(x.dtype)


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k1 = log π − log π_ref (on samples of π its mean is KL(π‖π_ref); single values can be < 0)."""
    return logp - ref_logp


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 = exp(−d) − 1 + d, d = log π − log π_ref: ≥ 0 everywhere, 0 only where π = π_ref."""
    d = logp - ref_logp
    return torch.expm1(-d) + d


def rloo_advantages(rewards: torch.Tensor, k: int) -> torch.Tensor:
    """(B,) rewards, k consecutive samples per prompt -> (B,) R_i minus the mean reward of the prompt's other k−1 samples."""
    if k < 2:
        raise ValueError(f"rloo_advantages: the leave-one-out baseline needs k ≥ 2 samples per prompt, got k={k}")
    if rewards.numel() % k:
        raise ValueError(f"rloo_advantages: {rewards.numel()} rewards do not split into groups of k={k}")
    r = rewards.view(-1, k)  # (prompts, k)
    others = (r.sum(dim=1, keepdim=True) - r) / (k - 1)  # (prompts, k): each sample's leave-one-out mean
    return (r - others).view(-1)


def grpo_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", eps: float = 1e-4) -> torch.Tensor:
    """(B,) rewards in consecutive groups -> (B,) R_i − group mean, divided by the group's (sample) standard
    deviation + eps when scale="group" (GRPO), left unscaled when scale="none" (Dr. GRPO). A group whose
    rewards are all equal gets advantage 0: it carries no signal."""
    if scale not in ("group", "none"):
        raise ValueError(f"grpo_advantages: scale must be 'group' or 'none', got {scale!r}")
    if group_size < 2 or rewards.numel() % group_size:
        raise ValueError(f"grpo_advantages: {rewards.numel()} rewards do not split into groups of {group_size} (≥ 2)")
    r = rewards.view(-1, group_size)  # (prompts, G)
    adv = r - r.mean(dim=1, keepdim=True)
    if scale == "group":
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    return adv.view(-1)


class MovingAverageBaseline:
    """REINFORCE's baseline: an exponential moving average of past batches' mean reward. `advantages(rewards)`
    uses the baseline from BEFORE this batch (so b does not depend on these samples), then updates it."""

    def __init__(self, decay: float = 0.9):
        self.decay, self.value = decay, None

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        baseline = 0.0 if self.value is None else self.value
        mean = rewards.float().mean().item()
        self.value = mean if self.value is None else self.decay * self.value + (1 - self.decay) * mean
        return rewards - baseline


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, how: str, constant: int | None = None) -> torch.Tensor:
    """Sum a per-token loss (B, T) into one number, over the masked tokens:
    "sum"      mean over sequences of Σ_t            (REINFORCE, RLOO: the policy-gradient theorem as written)
    "sequence" mean over sequences of mean_t         (GRPO: each sequence weighs the same, whatever its length)
    "token"    Σ over all tokens / number of tokens  (each token weighs the same)
    "constant" mean over sequences of Σ_t / constant (Dr. GRPO: one fixed normaliser, e.g. max_new_tokens)"""
    if how == "sum":
        return masked_sum(per_token, mask, dim=1).mean()
    if how == "sequence":
        return masked_mean(per_token, mask, dim=1).mean()
    if how == "token":
        return masked_mean(per_token, mask)
    if how == "constant":
        if not constant:
            raise ValueError("aggregate: how='constant' needs the constant (for example max_new_tokens)")
        return (masked_sum(per_token, mask, dim=1) / constant).mean()
    raise ValueError(f"aggregate: how must be 'sum', 'sequence', 'token' or 'constant', got {how!r}")


def policy_gradient_loss(logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, how: str = "sum",
                         constant: int | None = None) -> torch.Tensor:
    """The REINFORCE/RLOO surrogate: −A_i · log π(y_it), aggregated. logp (B, T) with gradients, advantages (B,)
    (treated as constants), mask (B, T). Its gradient is minus the policy-gradient estimate."""
    per_token = -advantages.detach().unsqueeze(1) * logp  # (B, T)
    return aggregate(per_token, mask, how, constant)


def clipped_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                        clip_eps: float = 0.2, how: str = "sequence",
                        constant: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped objective, per token (GRPO uses it over a few inner epochs of the same rollouts):
    ρ = exp(log π − log π_old), loss_t = −min(ρ A, clip(ρ, 1−ε, 1+ε) A). Returns (loss, clipfrac): the share of
    masked tokens where the clipped term was the smaller one (where the gradient was cut)."""
    ratio = torch.exp(logp - old_logp.detach())  # (B, T)
    adv = advantages.detach().unsqueeze(1)  # (B, 1)
    unclipped, clipped = ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv
    loss = aggregate(-torch.minimum(unclipped, clipped), mask, how, constant)
    clipfrac = masked_mean((clipped < unclipped).float(), mask)
    return loss, clipfrac.detach()
