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

Each estimator has its own default aggregation (`normalisation`); `PGConfig.loss_type` overrides it for any of them,
with TRL's names for the three that GRPO trainers use (ℓ_it the per-token loss, L_i sequence i's length, B sequences):

    "grpo"     sequence level   (1/B) Σ_i (1/L_i) Σ_t ℓ_it     how="sequence"
    "dr_grpo"  constant level   (1/B) Σ_i (1/L_max) Σ_t ℓ_it   how="constant", L_max = max_new_tokens
    "dapo"     token level      Σ_i Σ_t ℓ_it / Σ_i L_i         how="token"

"grpo" gives each sequence the same total weight, so a token of a short completion weighs more than one of a long
completion: a right answer (A > 0) is pushed up harder the shorter it is, a wrong one (A < 0) pushed down more
softly the longer it is, and wrong answers drift longer (the length bias of Liu et al., "Understanding R1-Zero-Like
Training", 2025). "dr_grpo" and "dapo" weigh every token alike within a batch, which removes it; they differ in the
normaliser ("dr_grpo" a constant, "dapo" the batch's token count, which changes from batch to batch).

DAPO's dynamic sampling (`PGConfig.filter_groups`, Yu et al., 2025): a group (a prompt's k samples) whose rewards
are all equal has advantage 0 under RLOO and GRPO, so it adds no gradient, but it still counts in the loss's
denominator ("dapo": its tokens; the others: its sequences) and so shrinks every other group's step. The filter
(`informative_groups`) drops those groups' rows from the loss (and from the update's forward and backward passes).
It looks at the raw rewards (ro.rewards: the trained reward, any missing-EOS penalty included), as DAPO looks at its
accuracy reward, not at the score after the KL term: with kl_in="reward" each sequence's score is r − β·Σ_t k1, and
the per-sequence KL makes a group's scores unequal almost always, so a filter on them would drop nothing; filtering
the raw rewards also drops that group's share of the KL penalty from the step (kl_in="loss": its k3 term likewise).
With plain REINFORCE (no baseline) an equal group does carry a signal (A = R), so there the filter changes the
estimate. DAPO itself samples more prompts until the batch is full again; we do not refill: on a CPU the rollouts
are the dearest part of a step, and a step on fewer samples costs less instead. When every group is filtered the
step does no update (metrics["train/skipped_step"] = 1).

Keeping the policy near the reference π_ref (the SFT model), per token, with d = log π − log π_ref:

    k1 = d                     unbiased for KL(π‖π_ref) on samples of π, but negative on some tokens
    k3 = exp(−d) − 1 + d       also unbiased, never negative, lower variance (Schulman's estimator)

GRPO reuses one batch of rollouts for a few inner epochs with PPO's clipped ratio ρ = π / π_old:
loss_t = −min(ρ_t A, clip(ρ_t, 1 − ε, 1 + ε) A); on the first inner epoch ρ = 1 exactly.

Tensors: rewards and advantages (B,) with the k samples of a prompt in consecutive rows; per-token values
(B, T) with a mask (B, T) that is 1 on completion tokens (up to and including the first EOS).

A step: `rollout` samples k completions per prompt with the policy, scores them with any reward callable
(the gold reward, or the chapter-6 reward model) and the frozen reference's log-probs; `pg_update` turns that
batch into advantages and one (or, for GRPO, a few) optimizer steps, and returns the step's metrics.

Rollouts one step stale (`--async`, async_rollouts.py): a batch sampled by an older policy μ (the weights before the
last update) is used to update π_θ. Each per-token loss term is then weighted by the truncated importance ratio
w_t = min(π_old(y_t) / μ(y_t), C), treated as a constant (`truncated_is_weights`; π_old: the policy as the update
starts, the one whose log-probs make the KL and the advantages; C = `PGConfig.is_cap`). The ratio is per token, not
the product over a sequence, and truncated, so the estimator is biased (async_rollouts.py says by how much); when the
batch was sampled by π_old itself every w_t is exactly 1 and the update is the synchronous one.

Several processes (torchrun, see distributed.py): each rank samples its own share of the step's prompts
(`shard_rollout` cuts a rollout the same way), so a prompt's k samples stay on one rank and the group baselines need
no communication. Every aggregation above is a mean over the batch's sequences (or, "token", its tokens): rank r's
mean over its own n_r of them, times w_r = W n_r / N (N: all ranks' count, one all-reduce), makes DDP's average
the one-process loss, however the filter thins the ranks' groups. A rank left with no row still runs its forward
and backward pass (times 0), since DDP's all-reduce needs every rank. The metrics are the whole batch's, and the
moving-average baseline averages every rank's rewards, so every rank holds the same numbers and takes the same
decisions.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from llm_from_scratch import distributed
from llm_from_scratch.generation import generate, sequence_logprobs
from llm_from_scratch.model import GPT, eval_mode
from llm_from_scratch.tokenizer import Tokenizer, encode_chat
from llm_from_scratch.train import lm_loss, optimizer_step


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
    """(B,) rewards, k consecutive samples per prompt -> (B,) R_i minus the mean reward of the prompt's other k−1
    samples."""
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


def informative_groups(rewards: torch.Tensor, k: int) -> torch.Tensor:
    """(B,) rewards, k consecutive samples per prompt -> (B,) bool: True on the rows of the groups whose rewards are
    not all equal (DAPO's dynamic-sampling filter keeps those; an equal group has advantage 0 under RLOO and GRPO)."""
    if k < 2 or rewards.numel() % k:
        raise ValueError(f"informative_groups: {rewards.numel()} rewards do not split into groups of k={k} (≥ 2)")
    r = rewards.view(-1, k)  # (prompts, k)
    varied = r.amax(dim=1) > r.amin(dim=1)  # (prompts,) exact: no std, whose rounding could miss an equal group
    return varied.repeat_interleave(k)  # (B,) each group's verdict on each of its k rows


class MovingAverageBaseline:
    """REINFORCE's baseline: an exponential moving average of past batches' mean reward. `advantages(rewards)`
    uses the baseline from BEFORE this batch (so b does not depend on these samples), then updates it."""

    def __init__(self, decay: float = 0.9):
        self.decay, self.value = decay, None

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        baseline = 0.0 if self.value is None else self.value
        if distributed.world_size() == 1:
            mean = rewards.float().mean().item()
        else:  # every rank's rewards: the same baseline on every rank
            total, count = distributed.all_reduce([rewards.float().sum().item(), rewards.numel()]).tolist()
            mean = total / count
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
                         constant: int | None = None, weights: torch.Tensor | None = None) -> torch.Tensor:
    """The REINFORCE/RLOO surrogate: −A_i · log π(y_it), aggregated. logp (B, T) with gradients, advantages (B,)
    (treated as constants), mask (B, T). Its gradient is minus the policy-gradient estimate. weights (B, T): each
    token's importance weight when the rows were sampled by another policy (`truncated_is_weights`), a constant."""
    per_token = -advantages.detach().unsqueeze(1) * logp  # (B, T)
    if weights is not None:
        per_token = per_token * weights.detach()
    return aggregate(per_token, mask, how, constant)


def clipped_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                        clip_eps: float = 0.2, how: str = "sequence", constant: int | None = None,
                        weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped objective, per token (GRPO uses it over a few inner epochs of the same rollouts):
    ρ = exp(log π − log π_old), loss_t = −min(ρ A, clip(ρ, 1−ε, 1+ε) A). Advantages are one per sequence (B,)
    (GRPO) or one per token (B, T) (PPO, from GAE). weights (B, T): rows sampled by a policy μ other than π_old
    weigh each token's term by min(π_old / μ, C) (`truncated_is_weights`: the clip keeps π near π_old, the weight
    corrects for π_old ≠ μ). Returns (loss, clipfrac): the share of masked tokens where the clipped term was the
    smaller one (where the gradient was cut)."""
    ratio = torch.exp(logp - old_logp.detach())  # (B, T)
    adv = advantages.detach()
    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv  # (B, 1) or (B, T)
    unclipped, clipped = ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv
    per_token = -torch.minimum(unclipped, clipped)  # (B, T)
    if weights is not None:
        per_token = per_token * weights.detach()
    loss = aggregate(per_token, mask, how, constant)
    clipfrac = masked_mean((clipped < unclipped).float(), mask)
    return loss, clipfrac.detach()


def truncated_is_weights(logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor,
                         cap: float = 2.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token importance weights for rows sampled by a policy μ other than the one being updated:
    w_t = min(exp(log π_old − log μ), cap), (B, T), no gradient, 0 off the mask (truncated importance sampling, as in
    IMPALA's V-trace ρ̄ and verl's TIS). Also their statistics over the masked tokens, before the cap: offpolicy/ratio
    (the mean ratio, 1 on-policy), offpolicy/ratio_max and offpolicy/capped (the share of tokens the cap cut). Under
    torchrun: over every rank's tokens, the same on all."""
    if cap < 1:
        raise ValueError(f"truncated_is_weights: the cap must be ≥ 1 (1 would weigh every token ≤ 1), got {cap}")
    ratio = torch.exp(logp.detach() - behaviour_logp) * mask  # (B, T)
    weights = ratio.clamp(max=cap)
    stats = [masked_sum(ratio, mask).item(), masked_sum((ratio > cap).float(), mask).item(), mask.sum().item()]
    top = ratio.max().item() if ratio.numel() else 0.0
    if distributed.world_size() > 1:
        stats = distributed.all_reduce(stats).tolist()
        top = max(distributed.all_gather_objects(top))
    tokens = max(stats[2], 1.0)
    return weights, {"offpolicy/ratio": stats[0] / tokens, "offpolicy/ratio_max": top,
                     "offpolicy/capped": stats[1] / tokens}


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that at least one of k samples is right, estimated without bias from n ≥ k samples of which c
    were right (Chen et al., 2021): 1 − C(n−c, k) / C(n, k), the share of k-subsets that hold a right one."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 0 ≤ c ≤ n and 1 ≤ k ≤ n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


# ----------------------------------------------------------------------------- rollouts and the update

RewardFn = Callable[[list[str], list[str]], "torch.Tensor | list[float]"]  # (prompts, completions) -> (N,) scores
ALGOS = ("reinforce", "reinforce-baseline", "rloo", "grpo", "dr-grpo")


@dataclass
class Rollout:
    """k sampled completions per prompt (a prompt's k samples in consecutive rows) and what an update needs."""
    sequences: torch.Tensor  # (B, T) left-padded prompt, then the completion (padding after its EOS)
    attention_mask: torch.Tensor  # (B, T) 1 on real tokens
    mask: torch.Tensor  # (B, T-1) 1 where a log-prob column scores a completion token (up to and incl. its EOS)
    ref_logp: torch.Tensor  # (B, T-1) the frozen reference's log-probs at the sampling temperature, 0 off the mask
    rewards: torch.Tensor  # (B,) what the policy is trained on (the proxy), missing-EOS penalty included
    gold: torch.Tensor  # (B,) the gold reward, logged beside it (the proxy itself when there is no gold)
    ended: torch.Tensor  # (B,) bool: the completion produced EOS
    prompts: list[str]  # (B,) each row's prompt
    completions: list[str]  # (B,) each row's completion text, without its EOS
    k: int
    temperature: float
    seconds: dict[str, float] = field(default_factory=dict)  # wall time of each phase: generate, reference, reward
    # (B, T-1) the sampling policy's own log-probs, 0 off the mask, when the batch may be used by a later policy
    # (async_rollouts.py); None: the batch is on-policy, sampled by the weights it updates
    behaviour_logp: torch.Tensor | None = None


@torch.no_grad()
def rollout(policy: GPT, reference: GPT, tok: Tokenizer, prompts: list[str], k: int, reward_fn: RewardFn,
            gold_fn: RewardFn | None = None, max_new_tokens: int = 128, temperature: float = 1.0,
            missing_eos_penalty: float | None = None, generator: torch.Generator | None = None,
            behaviour: bool = False) -> Rollout:
    """Sample k completions for each prompt with the policy (dropout off, KV cache), score them, and
    compute the reference's log-probs of them. A completion cut at max_new_tokens without an EOS loses
    `missing_eos_penalty` from its reward. behaviour=True also keeps the policy's own log-probs of its samples
    (Rollout.behaviour_logp), for an update by a later policy (async_rollouts.py)."""
    if temperature <= 0:
        raise ValueError(f"rollout: RL samples need a temperature > 0, got {temperature}")
    rows = [encode_chat(tok, p)[0] for p in prompts for _ in range(k)]  # (B = len(prompts) * k) token lists
    t0 = time.perf_counter()
    gen = generate(policy, rows, max_new_tokens, temperature=temperature, eos_id=tok.eos_id, pad_id=tok.pad_id,
                   generator=generator)
    mask = gen.completion_mask[:, 1:]  # (B, T-1): column t scores token t+1
    t1 = time.perf_counter()
    with eval_mode(reference):
        ref_logp = sequence_logprobs(reference, gen.sequences, gen.attention_mask, temperature) * mask
    behaviour_logp = None
    if behaviour:  # by the same function as the update's, so a batch used at once has ratios of exactly 1
        with eval_mode(policy):
            behaviour_logp = sequence_logprobs(policy, gen.sequences, gen.attention_mask, temperature) * mask
    t2 = time.perf_counter()
    tokens = gen.completions()
    device = gen.sequences.device  # rewards live where the log-probs do (a CPU reward meets CUDA KL terms)
    ended = torch.tensor([bool(c) and c[-1] == tok.eos_id for c in tokens], device=device)
    texts = [tok.decode(c[:-1] if e else c) for c, e in zip(tokens, ended.tolist())]
    row_prompts = [p for p in prompts for _ in range(k)]
    rewards = torch.as_tensor(reward_fn(row_prompts, texts), dtype=torch.float32).flatten().to(device)
    gold = (rewards.clone() if gold_fn is None
            else torch.as_tensor(gold_fn(row_prompts, texts), dtype=torch.float32).to(device))
    if missing_eos_penalty:
        rewards = rewards - missing_eos_penalty * (~ended).float()
    seconds = {"generate": t1 - t0, "reference": t2 - t1, "reward": time.perf_counter() - t2}
    return Rollout(gen.sequences, gen.attention_mask, mask, ref_logp, rewards, gold, ended, row_prompts, texts, k,
                   temperature, seconds, behaviour_logp)


def shard_rollout(ro: Rollout) -> Rollout:
    """This rank's share of a rollout's prompts under torchrun, each with its k rows (distributed.shard_rows over the
    prompts): the rollout the rank would have sampled for those prompts alone. Without torchrun: `ro` itself."""
    if distributed.world_size() == 1:
        return ro
    groups = distributed.shard_rows(ro.rewards.numel() // ro.k)  # this rank's prompts
    rows = slice(groups.start * ro.k, groups.stop * ro.k)  # their k rows each
    return Rollout(ro.sequences[rows], ro.attention_mask[rows], ro.mask[rows], ro.ref_logp[rows], ro.rewards[rows],
                   ro.gold[rows], ro.ended[rows], ro.prompts[rows], ro.completions[rows], ro.k, ro.temperature,
                   dict(ro.seconds), None if ro.behaviour_logp is None else ro.behaviour_logp[rows])


@dataclass
class PGConfig:
    algo: str = "rloo"  # one of ALGOS
    k: int = 4  # samples per prompt (the group size of RLOO and GRPO)
    beta: float = 0.05  # KL coefficient
    kl_in: str = "reward"  # "reward": r − β·Σ_t k1 per sequence (RLOO's form); "loss": + β·k3 per token (GRPO's)
    inner_epochs: int = 1  # optimizer steps on each rollout batch (GRPO: a few, with the clipped ratio)
    clip_eps: float = 0.2
    max_new_tokens: int = 128  # also Dr. GRPO's constant normaliser
    temperature: float = 1.0
    grad_clip: float = 1.0
    loss_type: str | None = None  # None: the algorithm's own aggregation; else one of LOSS_TYPES (TRL's names)
    filter_groups: bool = False  # DAPO's dynamic sampling, without refilling: drop groups whose rewards are all equal
    is_cap: float = 2.0  # C of the truncated importance weights, for a batch sampled by an older policy (--async)
    ptx_coef: float = 0.0  # γ of PPO-ptx: each optimizer step also minimises γ · the SFT loss of ptx_batch (`ptx_loss`)


LOSS_TYPES = {"grpo": "sequence", "dr_grpo": "constant", "dapo": "token"}  # TRL's loss_type -> `aggregate`'s how


def normalisation(algo: str, loss_type: str | None = None) -> str:
    """How the per-token terms are summed into the loss (see `aggregate`): the loss type's aggregation when one is
    given (LOSS_TYPES), else the estimator's own (GRPO "sequence", Dr. GRPO "constant", the others "sum")."""
    if loss_type is not None:
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"unknown loss_type {loss_type!r}; choose from {tuple(LOSS_TYPES)} (or None)")
        return LOSS_TYPES[loss_type]
    return {"grpo": "sequence", "dr-grpo": "constant"}.get(algo, "sum")


def ptx_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """InstructGPT's "ptx" term (Ouyang et al. 2022, eq. 2: "PPO-ptx"): the RL objective plus γ times the
    log-likelihood of data the model was trained on; here the SFT loss of a batch of demonstrations (x, y) from
    sft.SFTBatches (y = -100 on the prompt and the padding): −1/|R| Σ_{t ∈ R} log π(y_t | x_≤t), at temperature 1.
    The update minimises L_RL + γ · ptx_loss, which pulls the policy back toward what RL on one task makes it forget."""
    x, y = batch  # (B, T) each
    return lm_loss(model, x, y)


def pg_update(policy: GPT, optimizer: torch.optim.Optimizer, ro: Rollout, cfg: PGConfig,
              baseline: MovingAverageBaseline | None = None,
              ptx_batch: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, float]:
    """Advantages from the rollout's rewards, then cfg.inner_epochs optimizer steps on the same samples.
    The policy runs with dropout off, at the sampling temperature. With cfg.filter_groups the loss is built from
    the rows of the informative groups only (`informative_groups` on the raw rewards); the logged metrics still
    describe the whole batch. Returns the step's metrics, with train/rows (the rows the loss used) and
    train/skipped_step (1 when the filter left none, and no optimizer step was taken). With cfg.ptx_coef > 0 each
    optimizer step also minimises cfg.ptx_coef · ptx_loss(ptx_batch) (logged as loss/ptx; a skipped step skips it too).
    Under torchrun: each rank passes its own rollout and the policy wrapped by distributed.wrap; the loss is scaled
    as the module docstring says, and the metrics returned are every rank's batch together, the same on all."""
    if cfg.algo not in ALGOS:
        raise ValueError(f"unknown algorithm {cfg.algo!r}; choose from {ALGOS}")
    if cfg.kl_in not in ("reward", "loss"):
        raise ValueError(f"kl_in must be 'reward' or 'loss', got {cfg.kl_in!r}")
    if cfg.ptx_coef and (ptx_batch is None or distributed.world_size() > 1):
        raise ValueError("pg_update: ptx_coef > 0 needs a ptx_batch, in one process (not under torchrun)")
    how = normalisation(cfg.algo, cfg.loss_type)
    clipped = cfg.algo in ("grpo", "dr-grpo")
    keep = (informative_groups(ro.rewards, cfg.k) if cfg.filter_groups
            else torch.ones_like(ro.rewards, dtype=torch.bool))  # (B,)
    rows, dropped = keep.nonzero().squeeze(1), (~keep).nonzero().squeeze(1)  # (B',), (B − B',): whole groups
    mask, ref_logp = ro.mask[rows], ro.ref_logp[rows]  # (B', T-1) the rows the loss is built from
    W, scale, kept = distributed.world_size(), 1.0, float(rows.numel())
    if W > 1 and not distributed.is_wrapped(policy):
        raise ValueError("pg_update under torchrun: pass the policy wrapped by distributed.wrap, or the ranks' "
                         "gradients are never averaged and their copies drift apart")
    if W > 1:  # w_r = W n_r / N, n counting the kept rows (how="token": their completion tokens) of every rank
        n_local = float(mask.sum()) if how == "token" else float(rows.numel())
        kept, n_global = distributed.all_reduce([float(rows.numel()), n_local]).tolist()
        scale = distributed.shard_weight(n_local, n_global)

    def logprobs(idx: torch.Tensor, model: torch.nn.Module = policy) -> torch.Tensor:  # (len(idx), T-1)
        return sequence_logprobs(model, ro.sequences[idx], ro.attention_mask[idx], ro.temperature) * ro.mask[idx]

    metrics: dict[str, float] = {"train/rows": kept, "train/skipped_step": float(kept == 0)}
    with eval_mode(policy):
        # the policy that sampled: its log-probs of every row give the KL, the scores, the advantages and the metrics;
        # the kept rows' (with gradients) are also epoch 0's loss, the dropped rows' need no graph. Under torchrun
        # every rank runs this forward pass with gradients here (DDP may synchronise the ranks in it): a rank whose
        # groups were all filtered runs it on one row of its own, for a loss of 0 (`idle`)
        logp = logprobs(rows) if rows.numel() else None  # (B', T-1)
        idle = logprobs(dropped[:1]) if logp is None and W > 1 and kept > 0 else None  # (1, T-1)
        old_all = torch.zeros_like(ro.ref_logp)  # (B, T-1)
        if logp is not None:
            old_all[rows] = logp.detach()
        if dropped.numel():
            with torch.no_grad():  # through the bare network: no DDP bookkeeping for a pass without gradients
                old_all[dropped] = logprobs(dropped, distributed.unwrap(policy))
        kl1, kl3 = kl_k1(old_all, ro.ref_logp) * ro.mask, kl_k3(old_all, ro.ref_logp) * ro.mask  # (B, T-1)
        seq_kl = masked_sum(kl1, ro.mask, dim=1)  # (B,)
        score = ro.rewards - cfg.beta * seq_kl if cfg.kl_in == "reward" else ro.rewards  # (B,)
        adv_all = advantages(cfg.algo, score, cfg.k, baseline)  # (B,) per group, so the kept groups' are unchanged
        metrics.update(estimator_metrics(ro, score, seq_kl, kl3, old_all))
        weights = None  # (B', T-1) with a batch sampled by an older policy: min(π_old / μ, C) per token
        if ro.behaviour_logp is not None:  # the ratios' statistics over every row, the weights of the kept ones
            weights_all, offpolicy = truncated_is_weights(old_all, ro.behaviour_logp, ro.mask, cfg.is_cap)
            weights = weights_all[rows]
            metrics.update(offpolicy)
        if kept == 0:  # every group (of every rank) was filtered: nothing to learn from this batch
            return metrics
        adv, old_logp = adv_all[rows], old_all[rows]  # (B',), (B', T-1)
        for epoch in range(cfg.inner_epochs):
            clipfrac = None
            if logp is None:  # W > 1: this rank's groups were all filtered, but DDP's all-reduce needs its pass
                idle = logprobs(dropped[:1]) if epoch else idle  # (1, T-1)
                loss = idle.sum() * 0.0
            else:
                if epoch:
                    logp = logprobs(rows)  # (B', T-1)
                if clipped:
                    loss, clipfrac = clipped_policy_loss(logp, old_logp, adv, mask, cfg.clip_eps, how,
                                                         cfg.max_new_tokens, weights)
                    if W == 1:
                        metrics["policy/clipfrac"] = clipfrac.item()
                else:
                    loss = policy_gradient_loss(logp, adv, mask, how, cfg.max_new_tokens, weights)
                if cfg.kl_in == "loss":  # the KL's gradient on μ's samples: weighed by the same ratios
                    k3 = kl_k3(logp, ref_logp) * mask  # (B', T-1)
                    k3 = k3 * weights if weights is not None else k3
                    loss = loss + cfg.beta * aggregate(k3, mask, how, cfg.max_new_tokens)
                if W > 1:
                    loss = loss * scale  # w_r L_r: DDP's average is the loss of every rank's rows together
            if cfg.ptx_coef:  # PPO-ptx: the SFT loss of the demonstrations, mixed into the same step
                ptx = ptx_loss(policy, ptx_batch)
                metrics["loss/ptx"] = ptx.item()
                (loss + cfg.ptx_coef * ptx).backward()
            else:
                loss.backward()
            metrics["train/grad_norm"] = optimizer_step(policy, optimizer, cfg.grad_clip)
            if W == 1:
                metrics["loss/policy"] = loss.item()
            else:  # the whole batch's: Σ_r w_r L_r / W, and the clipped tokens over all ranks' tokens
                tokens = float(mask.sum()) if logp is not None else 0.0
                cut = clipfrac.item() * tokens if clipfrac is not None else 0.0
                loss_sum, cut, tokens = distributed.all_reduce([loss.item(), cut, tokens]).tolist()
                metrics["loss/policy"] = loss_sum / W
                if clipped:
                    metrics["policy/clipfrac"] = cut / max(tokens, 1.0)
    return metrics


def advantages(algo: str, score: torch.Tensor, k: int, baseline: MovingAverageBaseline | None = None) -> torch.Tensor:
    """(B,) advantages of one rollout batch's scores for the given estimator."""
    if algo == "reinforce":
        return score
    if algo == "reinforce-baseline":
        if baseline is None:
            raise ValueError("reinforce-baseline needs a MovingAverageBaseline that lives across steps")
        return baseline.advantages(score)
    if algo == "rloo":
        return rloo_advantages(score, k)
    return grpo_advantages(score, k, scale="group" if algo == "grpo" else "none")


def estimator_metrics(ro: Rollout, score: torch.Tensor, seq_kl: torch.Tensor, kl3: torch.Tensor,
                      logp: torch.Tensor) -> dict[str, float]:
    """The standard diagnostics of one rollout batch (names as in TRL/CleanRL); under torchrun, of every rank's
    rollout together (`shared_estimator_metrics`)."""
    if distributed.world_size() > 1:
        return shared_estimator_metrics(ro, score, seq_kl, kl3, logp)
    lengths = ro.mask.sum(dim=1).float()  # (B,) completion tokens, EOS included
    return {
        "reward": score.mean().item(), "reward_std": score.std().item() if score.numel() > 1 else 0.0,
        "proxy/reward": ro.rewards.mean().item(), "gold/reward": ro.gold.mean().item(),
        "objective/kl": seq_kl.mean().item(), "objective/kl_k3": masked_sum(kl3, ro.mask, dim=1).mean().item(),
        "objective/entropy": masked_mean(-logp, ro.mask).item(),  # per token: E[−log π] on the policy's own samples
        "completions/mean_length": lengths.mean().item(),
        "completions/clipped_ratio": (~ro.ended).float().mean().item(),
        # the share of groups whose rewards are all equal: what --filter-groups drops
        "frac_reward_zero_std": 1.0 - informative_groups(ro.rewards, ro.k).float().mean().item() if ro.k > 1 else 0.0,
    }


def shared_estimator_metrics(ro: Rollout, score: torch.Tensor, seq_kl: torch.Tensor, kl3: torch.Tensor,
                             logp: torch.Tensor) -> dict[str, float]:
    """estimator_metrics over every rank's rows at once: each rank's sums, added up in one all-reduce, then divided
    by the global counts (the reward's std from Σ s and Σ s², with n − 1 as estimator_metrics has it; Σ s² in
    float64 on the CPU: MPS has no float64)."""
    mask = ro.mask.float()  # (B, T-1)
    equal = 1.0 - informative_groups(ro.rewards, ro.k).float() if ro.k > 1 else torch.zeros_like(ro.rewards)
    sums = {"rows": float(ro.rewards.numel()), "tokens": mask.sum().item(), "reward": score.sum().item(),
            "reward_sq": (score.detach().cpu().double() ** 2).sum().item(), "proxy/reward": ro.rewards.sum().item(),
            "gold/reward": ro.gold.sum().item(), "objective/kl": seq_kl.sum().item(),
            "objective/kl_k3": masked_sum(kl3, ro.mask, dim=1).sum().item(),
            "objective/entropy": masked_sum(-logp, ro.mask).item(), "completions/mean_length": mask.sum().item(),
            "completions/clipped_ratio": (~ro.ended).float().sum().item(), "frac_reward_zero_std": equal.sum().item()}
    total = dict(zip(sums, distributed.all_reduce(list(sums.values())).tolist()))
    n = total["rows"]
    mean = total["reward"] / n
    var = (total["reward_sq"] - n * mean**2) / (n - 1) if n > 1 else 0.0
    metrics = {name: total[name] / n for name in sums if name not in ("rows", "tokens", "reward_sq")}
    metrics["reward_std"] = math.sqrt(max(var, 0.0))
    metrics["objective/entropy"] = total["objective/entropy"] / max(total["tokens"], 1.0)  # per token
    return metrics
