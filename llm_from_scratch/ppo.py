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

One PPO step (`ppo_step`) on a batch of rollouts (chapter 7's `rollout`): the sampling policy's log-probs and the
critic's values, once, without gradients; the rewards above, GAE, advantages whitened over the completion tokens;
then several epochs over shuffled minibatches, each an optimizer step on

    loss = clipped policy loss (chapter 7's `clipped_policy_loss`, per-token advantages)
         + vf_coef · clipped value loss − ent_coef · entropy

The critic is a separate trunk initialised from the reward model (`RewardModel` read at every position; chapter 8
resets its head to zero), or a second head on the policy's own trunk (`PolicyValue`): logits and values from one
forward pass, one trunk fewer.

Tensors: per-token values (B, T) with a mask (B, T) that is 1 on completion tokens; a row's completion tokens
are contiguous (left-padded prompt before, padding after its EOS), and padding never counts in a mean.

A batch sampled one update ago (`--async`, async_rollouts.py) was drawn by μ, not by the policy π_old the update
starts from. π_old stays the anchor of the clip (the "proximal" policy of decoupled PPO, Hilton et al., 2021), and
each token's policy term is weighted by min(π_old / μ, C) (policy_gradient.truncated_is_weights); the critic
regresses on μ's samples unweighted. On a batch sampled by π_old itself every weight is exactly 1.

Several processes (torchrun, see distributed.py): each rank passes its own rollout (its share of the prompts) and the
policy (and a separate critic) wrapped by distributed.wrap. Every rank cuts its rows into the same number of
minibatches, so all take the same optimizer steps. The whitening uses every rank's completion tokens (`whiten`), and
each minibatch's loss, a mean over its tokens, is scaled by w_r = W n_r / N (N: the tokens of that minibatch on all
ranks), so DDP's average is the loss of the ranks' minibatches together. The metrics and the KL controller's input are
every rank's, the same on all.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn

from llm_from_scratch import distributed
from llm_from_scratch.checkpoint import load_model, save_model
from llm_from_scratch.generation import token_logprobs
from llm_from_scratch.model import GPT, GPTConfig, eval_mode
from llm_from_scratch.policy_gradient import (
    Rollout,
    clipped_policy_loss,
    kl_k1,
    kl_k3,
    masked_mean,
    masked_sum,
    masked_whiten,
    ptx_loss,
    truncated_is_weights,
)
from llm_from_scratch.train import fused_if_cuda


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
    rewards[rows, last_token_index(mask)] += scores.to(rewards)
    return rewards


def compute_gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
                lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns (B, T) by generalised advantage estimation, right to left over the columns:
    δ_t = r_t + γ V_{t+1} − V_t,  A_t = δ_t + γ λ A_{t+1},  returns R_t = A_t + V_t.

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


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """masked_whiten over every rank's completion tokens under torchrun (the sums and the squared deviations added
    up over the ranks); masked_whiten itself in one process."""
    if distributed.world_size() == 1:
        return masked_whiten(x, mask, shift_mean, eps)
    m = mask.to(x.dtype)
    total, count = distributed.all_reduce([(x * m).sum().item(), m.sum().item()]).tolist()
    mean = total / max(count, 1.0)
    var = distributed.all_reduce([(((x - mean) ** 2) * m).sum().item()]).item() / max(count, 1.0)
    white = (x - mean) / math.sqrt(var + eps)
    if not shift_mean:
        white = white + mean
    return white * m


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
        """β ← β · (1 + clip(KL / target − 1, −0.2, 0.2) · n_steps / horizon)."""
        error = min(max(current_kl / self.target - 1, -0.2), 0.2)  # proportional error, clipped to ±0.2
        self.value *= 1 + error * n_steps / self.horizon


# ----------------------------------------------------------------------------- the critic, and one PPO step

class PolicyValue(nn.Module):
    """The shared critic: the policy's GPT with a second head on its trunk. One forward pass gives the next-token
    logits and a value for every position; the value loss's gradient reaches the trunk the policy also uses."""

    def __init__(self, gpt: GPT):
        super().__init__()
        self.gpt = gpt
        self.value_head = nn.Linear(gpt.config.n_embd, 1)
        nn.init.zeros_(self.value_head.weight)  # V = 0 everywhere to start: no opinion, and no gradient into
        nn.init.zeros_(self.value_head.bias)  # the trunk until the head has learned something

    def forward(self, ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """ids (B, T) -> logits (B, T, vocab) and values (B, T)."""
        h = self.gpt.trunk(ids, attention_mask)  # (B, T, C)
        return self.gpt.lm_head(h), self.value_head(h).squeeze(-1)

    def save(self, folder: str | Path, state: dict | None = None) -> Path:
        """A "policy_value" checkpoint (`state`: a state dict to write in place of this module's own, e.g. with LoRA
        adapters folded in)."""
        return save_model(self, folder, "policy_value", asdict(self.gpt.config), state)

    @classmethod
    def load(cls, folder: str | Path, device: str | torch.device = "cpu", vocab_size: int | None = None) -> PolicyValue:
        return load_model(folder, "policy_value", lambda config: cls(GPT(GPTConfig(**{**config, "dropout": 0.0}))),
                          device, vocab_size)


def weights_held(models: dict[str, nn.Module]) -> dict[str, dict]:
    """Parameters and bytes of the weights each named model holds (`parameters()` yields a tied matrix once)."""
    return {name: {"params": sum(p.numel() for p in model.parameters()),
                   "bytes": sum(p.numel() * p.element_size() for p in model.parameters())}
            for name, model in models.items()}


def actor(policy: nn.Module) -> GPT:
    """The GPT that samples: the policy itself, or the GPT inside a PolicyValue."""
    return policy.gpt if isinstance(policy, PolicyValue) else policy


def logprobs_and_values(policy: nn.Module, critic: nn.Module | None, ids: torch.Tensor, attention_mask: torch.Tensor,
                        temperature: float,
                        entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows (B, T) -> (log-probs, values, entropies), each (B, T-1). Column t is about the action ids[:, t+1] taken
    in the state ids[:, ≤t]: its log-prob at `temperature`, the critic's value of that state, and the entropy of
    the policy's next-token distribution there. critic=None: the policy is a PolicyValue (the shared critic).
    Mask the result with the rollout's completion mask."""
    mask = None if bool(attention_mask.all()) else attention_mask  # None: the fast causal path
    if critic is None:
        logits, values = policy(ids, mask)  # (B, T, V), (B, T): one trunk
    else:
        logits, values = policy(ids, mask), critic(ids, attention_mask, per_token=True)  # two trunks
    logits = logits[:, :-1].float() / temperature  # (B, T-1, V): the distribution each action was drawn from
    logp = token_logprobs(logits, ids[:, 1:])  # (B, T-1)
    z = logits if entropy_grad else logits.detach()  # the entropy is a diagnostic unless it is in the loss
    entropy = torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)  # (B, T-1): H = log Z − Σ p z
    return logp, values[:, :-1], entropy


def make_optimizer(policy: nn.Module, critic: nn.Module | None, lr: float, critic_lr: float) -> torch.optim.AdamW:
    """AdamW with two parameter groups: the policy's weights (with a shared critic: the GPT, trunk included) at
    `lr`, the critic's own (the separate trunk and its head, or only the value head) at `critic_lr`; fused on a CUDA
    GPU (train.fused_if_cuda)."""
    if critic is None:
        groups = [list(policy.gpt.parameters()), list(policy.value_head.parameters())]
    else:
        groups = [list(policy.parameters()), list(critic.parameters())]
    groups = [[p for p in g if p.requires_grad] for g in groups]  # a frozen weight (LoRA's base) needs no state
    return torch.optim.AdamW([{"params": groups[0], "lr": lr}, {"params": groups[1], "lr": critic_lr}],
                             betas=(0.9, 0.95), weight_decay=0.0, **fused_if_cuda(groups[0] + groups[1]))


@dataclass
class PPOConfig:
    epochs: int = 2  # passes over one rollout batch
    minibatches: int = 2  # optimizer steps per pass, each on a shuffled share of the batch
    clip_eps: float = 0.2  # the policy ratio stays in [1 − ε, 1 + ε]
    clip_value: float = 0.2  # a value moves at most this far from its old value (in reward units)
    vf_coef: float = 0.1  # weight of the value loss
    ent_coef: float = 0.0  # entropy bonus (0: entropy only logged)
    gamma: float = 1.0
    lam: float = 0.95
    whiten_rewards: bool = False  # scale the per-token rewards to unit variance (their mean kept) before GAE
    grad_clip: float = 1.0  # applied to the policy's and the critic's parameter groups separately
    is_cap: float = 2.0  # C of the truncated importance weights, for a batch sampled by an older policy (--async)
    ptx_coef: float = 0.0  # γ of PPO-ptx: every optimizer step adds γ · the SFT loss of ptx_batch (`ptx_loss`)


def ppo_step(policy: nn.Module, critic: nn.Module | None, optimizer: torch.optim.Optimizer, ro: Rollout,
             kl_ctl: AdaptiveKLController | FixedKLController, cfg: PPOConfig,
             generator: torch.Generator | None = None,
             ptx_batch: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, float]:
    """One PPO iteration on a rollout batch (see the module docstring); updates kl_ctl after. Returns the metrics.
    With cfg.ptx_coef > 0 (PPO-ptx) every optimizer step also minimises cfg.ptx_coef · ptx_loss(ptx_batch).
    critic=None: the policy is a PolicyValue (the shared critic). Under torchrun: this rank's rollout, the models
    wrapped by distributed.wrap, and the metrics of every rank's rollout together (the module docstring)."""
    B, W = ro.sequences.size(0), distributed.world_size()
    if not 1 <= cfg.minibatches <= B:
        raise ValueError(f"ppo_step: {cfg.minibatches} minibatches do not fit a batch of {B} rollouts")
    if cfg.ptx_coef and (ptx_batch is None or W > 1):
        raise ValueError("ppo_step: ptx_coef > 0 needs a ptx_batch, in one process (not under torchrun)")
    if W > 1 and not all(distributed.is_wrapped(m) for m in (policy, critic) if m is not None):
        raise ValueError("ppo_step under torchrun: pass the policy (and critic) wrapped by distributed.wrap, or the "
                         "ranks' gradients are never averaged and their copies drift apart")
    mask = ro.mask.float()  # (B, T-1)
    where = generator.device if generator is not None else "cpu"  # a CUDA generator draws only on its own device
    orders = [torch.randperm(B, generator=generator, device=where) for _ in range(cfg.epochs)]  # each epoch's shuffle
    models = (policy,) if critic is None else (policy, critic)
    bare = (distributed.unwrap(policy), distributed.unwrap(critic) if critic is not None else None)  # no DDP
    stats = defaultdict(list)
    with eval_mode(*models):  # dropout off: the old and new log-probs must come from the same function
        # 1. the policy and critic that sampled, without gradients, minibatch by minibatch as epoch 0 will see
        #    them: the first minibatch's ratio is then exactly 1
        old_logp, old_values = torch.zeros_like(mask), torch.zeros_like(mask)  # (B, T-1)
        with torch.no_grad():
            for rows in orders[0].chunk(cfg.minibatches):
                logp, values, entropy = logprobs_and_values(*bare, ro.sequences[rows], ro.attention_mask[rows],
                                                            ro.temperature)
                old_logp[rows], old_values[rows] = logp * mask[rows], values * mask[rows]
                stats["policy/entropy"].append(masked_mean(entropy, mask[rows]).item())
        # 2. rewards per token, then advantages and returns by GAE
        rewards = per_token_rewards(ro.rewards, old_logp, ro.ref_logp, mask, kl_ctl.value)  # (B, T-1)
        if cfg.whiten_rewards:
            rewards = whiten(rewards, mask, shift_mean=False)
        advantages, returns = compute_gae(rewards, old_values, mask, cfg.gamma, cfg.lam)  # (B, T-1) each
        advantages = whiten(advantages, mask)  # over the batch's completion tokens only (every rank's)
        weights, offpolicy = None, {}  # (B, T-1) with a batch sampled by an older policy μ: min(π_old / μ, C)
        if ro.behaviour_logp is not None:
            weights, offpolicy = truncated_is_weights(old_logp, ro.behaviour_logp, mask, cfg.is_cap)
        # each minibatch's tokens here and on every rank: its loss's share w_r = W n_r / N (W = 1: not used)
        tokens = [mask[rows].sum().item() for order in orders for rows in order.chunk(cfg.minibatches)]
        tokens_all = distributed.all_reduce(tokens).tolist() if W > 1 else tokens
        # 3. epochs of clipped updates over shuffled minibatches
        for epoch, order in enumerate(orders):
            for i, rows in enumerate(order.chunk(cfg.minibatches)):
                m, old = mask[rows], old_logp[rows]
                logp, values, entropy = logprobs_and_values(policy, critic, ro.sequences[rows], ro.attention_mask[rows],
                                                            ro.temperature, entropy_grad=cfg.ent_coef > 0)
                logp = logp * m
                if epoch == 0 and i == 0:  # nothing has changed yet: ρ = 1 on every token, to the last bit
                    stats["policy/first_ratio_error"].append((torch.exp(logp - old) - 1).abs().max().item())
                pg_loss, pg_clipfrac = clipped_policy_loss(logp, old, advantages[rows], m, cfg.clip_eps, how="token",
                                                           weights=None if weights is None else weights[rows])
                vf_loss, vf_clipfrac = clipped_value_loss(values, old_values[rows], returns[rows], m, cfg.clip_value)
                loss = pg_loss + cfg.vf_coef * vf_loss - cfg.ent_coef * masked_mean(entropy, m)
                if cfg.ptx_coef:  # PPO-ptx: the SFT loss of the demonstrations, in every optimizer step
                    ptx = ptx_loss(actor(policy), ptx_batch)
                    loss = loss + cfg.ptx_coef * ptx
                    stats["loss/ptx"].append(ptx.item())
                if W > 1:  # w_r times this rank's token mean: DDP's average is the mean over the ranks' minibatches
                    j = epoch * cfg.minibatches + i
                    loss = loss * distributed.shard_weight(tokens[j], tokens_all[j])
                loss.backward()
                for name, group in zip(("policy/grad_norm", "value/grad_norm"), optimizer.param_groups):
                    norm = torch.nn.utils.clip_grad_norm_(group["params"], cfg.grad_clip or float("inf"))
                    stats[name].append(norm.item())
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                stats["loss/policy"].append(pg_loss.item())
                stats["loss/value"].append(vf_loss.item())
                stats["policy/clipfrac"].append(pg_clipfrac.item())
                stats["value/clipfrac"].append(vf_clipfrac.item())
                stats["policy/approxkl"].append(0.5 * masked_mean((logp.detach() - old) ** 2, m).item())

    kl = masked_sum(kl_k1(old_logp, ro.ref_logp), mask, dim=1)  # (B,) per sequence, at the sampling policy
    kl3 = masked_sum(kl_k3(old_logp, ro.ref_logp), mask, dim=1)
    if W > 1:
        metrics = shared_ppo_metrics(stats, tokens, tokens_all, cfg.minibatches, ro, mask, kl, kl3, rewards, old_logp,
                                     old_values, returns, kl_ctl.value)
        kl_ctl.update(metrics["objective/kl"], int(metrics.pop("rows")))  # every rank's samples
        return {**metrics, **offpolicy}
    metrics = {k: sum(v) / len(v) for k, v in stats.items()}
    metrics["policy/first_ratio_error"] = stats["policy/first_ratio_error"][0]
    metrics.update({
        "objective/kl": kl.mean().item(), "objective/kl_k3": kl3.mean().item(), "objective/kl_coef": kl_ctl.value,
        "objective/scores": ro.rewards.mean().item(),
        "objective/non_score_reward": (-kl_ctl.value * kl).mean().item(),
        "objective/rlhf_reward": masked_sum(rewards, mask, dim=1).mean().item(),  # score − kl_coef · Σ k1, as used
        "objective/entropy": masked_mean(-old_logp, mask).item(),  # E[−log π] of the sampled tokens
        "proxy/reward": ro.rewards.mean().item(), "gold/reward": ro.gold.mean().item(),
        "value/explained_variance": explained_variance(old_values, returns, mask),
        "value/mean": masked_mean(old_values, mask).item(), "value/return": masked_mean(returns, mask).item(),
        "completions/mean_length": mask.sum(dim=1).mean().item(),
        "completions/clipped_ratio": (~ro.ended).float().mean().item(),
    })
    kl_ctl.update(metrics["objective/kl"], B)  # the coefficient for the next batch
    return {**metrics, **offpolicy}


def shared_ppo_metrics(stats: dict[str, list[float]], tokens: list[float], tokens_all: list[float], minibatches: int,
                       ro: Rollout, mask: torch.Tensor, kl: torch.Tensor, kl3: torch.Tensor, rewards: torch.Tensor,
                       old_logp: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       kl_coef: float) -> dict[str, float]:
    """ppo_step's metrics over every rank's rollout (torchrun), in two all-reduces: each minibatch's token-mean
    statistics weighted by its tokens on each rank (then averaged over the minibatches, as in one process), the
    batch's sums over sequences and tokens, and the squared deviations the explained variance needs. Also "rows":
    the number of sequences of every rank, for the KL controller."""
    steps = len(tokens)  # epochs × minibatches, the same on every rank
    weighted = ("loss/policy", "loss/value", "policy/clipfrac", "value/clipfrac", "policy/approxkl")
    local = [v * tokens[j] for name in weighted for j, v in enumerate(stats[name])]
    local += [v * tokens[j] for j, v in enumerate(stats["policy/entropy"])]  # epoch 0's minibatches
    m = mask
    sums = {"rows": float(kl.numel()), "tokens": m.sum().item(), "kl": kl.sum().item(), "kl3": kl3.sum().item(),
            "scores": ro.rewards.sum().item(), "rlhf": masked_sum(rewards, m, dim=1).sum().item(),
            "neglogp": masked_sum(-old_logp, m).item(), "gold": ro.gold.sum().item(),
            "values": masked_sum(old_values, m).item(), "returns": masked_sum(returns, m).item(),
            "clipped": (~ro.ended).float().sum().item()}
    reduced = distributed.all_reduce(local + list(sums.values())).tolist()
    total = dict(zip(sums, reduced[len(local):]))
    n, T = total["rows"], total["tokens"]
    metrics = {}
    for k, name in enumerate(weighted):
        metrics[name] = sum(reduced[k * steps + j] / tokens_all[j] for j in range(steps)) / steps
    entropy_at = len(weighted) * steps
    metrics["policy/entropy"] = sum(reduced[entropy_at + j] / tokens_all[j] for j in range(minibatches)) / minibatches
    metrics["policy/first_ratio_error"] = max(distributed.all_gather_objects(stats["policy/first_ratio_error"][0]))
    for name in ("policy/grad_norm", "value/grad_norm"):  # of the all-reduced gradients: the same on every rank
        metrics[name] = sum(stats[name]) / len(stats[name])
    mean_return, mean_value = total["returns"] / T, total["values"] / T
    residual = returns - old_values
    deviations = distributed.all_reduce([masked_sum((returns - mean_return) ** 2, m).item(),
                                         masked_sum((residual - (mean_return - mean_value)) ** 2, m).item()]).tolist()
    var_returns, var_residual = deviations[0] / T, deviations[1] / T
    metrics.update({
        "objective/kl": total["kl"] / n, "objective/kl_k3": total["kl3"] / n, "objective/kl_coef": kl_coef,
        "objective/scores": total["scores"] / n, "objective/non_score_reward": -kl_coef * total["kl"] / n,
        "objective/rlhf_reward": total["rlhf"] / n, "objective/entropy": total["neglogp"] / T,
        "proxy/reward": total["scores"] / n, "gold/reward": total["gold"] / n,
        "value/explained_variance": 1 - var_residual / var_returns if var_returns > 0 else float("nan"),
        "value/mean": mean_value, "value/return": mean_return, "completions/mean_length": T / n,
        "completions/clipped_ratio": total["clipped"] / n, "rows": n,
    })
    return metrics
