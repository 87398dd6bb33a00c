"""Direct preference optimisation: DPO, IPO and conservative DPO (chapter 9).

The KL-regularised RL objective of chapters 7 and 8, max_π E[r(x, y)] − β KL(π ‖ π_ref), has a closed-form optimum

    π*(y | x) = π_ref(y | x) · exp(r(x, y) / β) / Z(x)      so      r(x, y) = β log π*(y|x)/π_ref(y|x) + β log Z(x).

Put that reward into the Bradley–Terry model of chapter 6 and Z(x) cancels in the difference of two responses to the
same prompt. With the *implicit reward* r̂(x, y) = β (log π(y|x) − log π_ref(y|x)) and, for a pair,

    h = (log π(y_c) − log π_ref(y_c)) − (log π(y_r) − log π_ref(y_r))          (sequence log-probs: sums over tokens)

the losses per pair are

    DPO ("sigmoid")         −log σ(β h)                                  (Rafailov et al., 2023)
    conservative DPO        −(1 − ε) log σ(β h) − ε log σ(−β h)          (each label flipped with probability ε)
    IPO ("ipo")             (h − 1/(2β))²                                (Azar et al., 2023: a target margin, not ∞)

The reference never changes during training, so its log-probs can be computed once for the whole dataset and the
reference model released (`reference_logps`, kept in a file by `cached_reference_logps`), or computed live each step
(`frozen_logps`); the losses are the same either way, and caching saves one forward pass of the four a step would
otherwise make (two rows per pair, through the policy forward and backward, through the reference forward only).

On-policy pairs (`sampled_pairs`): the SFT model's own k stories of a prompt, the best and the worst by gold, labelled
as the tiny world labels its pairs (the better one chosen with probability σ(β_BT (gold_a − gold_b)))).

At step 0 the policy is the reference: h = 0, every DPO loss is log 2, and every margin is 0.

Tensors: a batch of N pairs is 2N rows, the N chosen then the N rejected, right-padded (B = 2N, T); a completion mask
(B, T-1) marks the response tokens and the EOS in the log-prob columns (column t scores token t+1).

Several processes (torchrun, see distributed.py): every rank builds the same global batch of N pairs, and rank r
computes its share of the pairs, n_r of them (`pair_rows`: both rows of each, in the same layout), and backpropagates
w_r times their mean loss, w_r = W n_r / N; DDP's average of the gradients is then the gradient of the mean over all
N pairs, the one-process step. The metrics are sums over each rank's pairs, added up over the ranks, over N.
"""

from __future__ import annotations

import gc
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from llm_from_scratch import distributed
from llm_from_scratch.checkpoint import load_tensors, save_tensors
from llm_from_scratch.generation import sequence_logprobs
from llm_from_scratch.gold_rewards import story_reward
from llm_from_scratch.model import GPT, eval_mode
from llm_from_scratch.preferences import BT_BETA, sigmoid
from llm_from_scratch.sft import answer
from llm_from_scratch.tokenizer import Tokenizer, encode_chat, pad_right

LOSS_TYPES = ("sigmoid", "ipo")


def preference_batch(tok: Tokenizer, pairs: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """N pairs {"prompt", "chosen", "rejected"} -> ids and attention mask (2N, T), right-padded, chosen rows first,
    and the completion mask (2N, T-1): 1 where a log-prob column scores a response token or its EOS."""
    encoded = [encode_chat(tok, p["prompt"], p[side]) for side in ("chosen", "rejected") for p in pairs]
    ids, mask, _ = pad_right([e for e, _ in encoded], tok.pad_id)  # (2N, T)
    position = torch.arange(1, ids.size(1))[None]  # (1, T-1): the position of the token each column scores
    start = torch.tensor([n for _, n in encoded])[:, None]  # (2N, 1): the first response position of each row
    completion = ((position >= start) & mask[:, 1:].bool()).long()  # (2N, T-1)
    return ids, mask, completion


def concatenated_logps(model: GPT, ids: torch.Tensor, attention_mask: torch.Tensor,
                       completion_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward pass over the 2N rows -> the sequence log-probs (sums over each response's tokens and EOS) of the
    chosen (N,) and the rejected (N,) responses. Differentiable; runs in the model's current mode."""
    logp = sequence_logprobs(model, ids, attention_mask)  # (2N, T-1)
    sums = (logp * completion_mask.to(logp.dtype)).sum(dim=1)  # (2N,)
    n = ids.size(0) // 2
    return sums[:n], sums[n:]


def dpo_loss(policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
             ref_rejected_logps: torch.Tensor, beta: float = 0.1, loss_type: str = "sigmoid",
             label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses (N,) and the implicit rewards β (log π − log π_ref) of the chosen and the rejected responses
    (N,) each, detached. All log-probs are sequence sums. With h = (log π(y_c) − log π_ref(y_c)) − (log π(y_r) −
    log π_ref(y_r)) (y_c chosen, y_r rejected; the reference's log-probs are constants):
        sigmoid (DPO):  −(1 − ε) log σ(β h) − ε log σ(−β h)   (ε = label_smoothing: conservative DPO)
        ipo (IPO):      (h − 1/(2β))²"""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"dpo_loss: loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if beta <= 0:
        raise ValueError(f"dpo_loss: beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"dpo_loss: label_smoothing must be in [0, 0.5), got {label_smoothing}")
    chosen_ratio = policy_chosen_logps - ref_chosen_logps.detach()  # (N,) log π/π_ref of the chosen response
    rejected_ratio = policy_rejected_logps - ref_rejected_logps.detach()
    h = chosen_ratio - rejected_ratio  # (N,)
    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    else:
        losses = (h - 1 / (2 * beta)) ** 2
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def preference_columns(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, chosen_logps: torch.Tensor,
                       rejected_logps: torch.Tensor) -> dict[str, torch.Tensor]:
    """The standard DPO diagnostics (TRL's names) of each pair, (N,) each: preference_metrics averages them."""
    return {"rewards/chosen": chosen_rewards, "rewards/rejected": rejected_rewards,
            "rewards/margins": chosen_rewards - rejected_rewards,
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float(),
            "logps/chosen": chosen_logps.detach(), "logps/rejected": rejected_logps.detach()}


def preference_metrics(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, chosen_logps: torch.Tensor,
                       rejected_logps: torch.Tensor) -> dict[str, float]:
    """The standard DPO diagnostics (TRL's names), means over the pairs."""
    columns = preference_columns(chosen_rewards, rejected_rewards, chosen_logps, rejected_logps)
    return {name: values.mean().item() for name, values in columns.items()}


def pair_rows(batch: tuple[torch.Tensor, ...], pairs: slice) -> tuple[torch.Tensor, ...]:
    """The rows of some of a batch's pairs (batch: 2N rows, the N chosen then the N rejected, as preference_batch
    makes them): the chosen rows of `pairs`, then their rejected rows, (2n, ...) each: the same layout for n pairs."""
    N = batch[0].size(0) // 2
    mine = torch.arange(N)[pairs]  # (n,) the pairs' indices
    rows = torch.cat([mine, N + mine])  # (2n,) their chosen rows, then their rejected rows
    return tuple(t[rows.to(t.device)] for t in batch)


@torch.no_grad()
def frozen_logps(model: GPT, ids: torch.Tensor, attention_mask: torch.Tensor,
                 completion_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """concatenated_logps of a model that does not learn (the live reference): no graph, dropout off."""
    with eval_mode(model):
        return concatenated_logps(model, ids, attention_mask, completion_mask)


@torch.no_grad()
def reference_logps(reference: GPT, tok: Tokenizer, pairs: list[dict], batch_size: int = 32) -> torch.Tensor:
    """A frozen model's sequence log-probs of every pair, once: (N, 2), chosen then rejected, on the CPU.
    Stored with the dataset, the reference's let the reference model go before training starts; the same pass
    over held-out pairs scores the policy at an evaluation."""
    device = next(reference.parameters()).device
    length = [max(len(p["chosen"]), len(p["rejected"])) + len(p["prompt"]) for p in pairs]
    order = sorted(range(len(pairs)), key=length.__getitem__)  # batches of similar length: little padding
    out = torch.empty(len(pairs), 2)
    for i in range(0, len(pairs), batch_size):
        rows = order[i:i + batch_size]
        batch = (t.to(device) for t in preference_batch(tok, [pairs[j] for j in rows]))
        out[rows] = torch.stack(frozen_logps(reference, *batch), dim=1).cpu()  # back in the pairs' order
    return out


def cached_reference_logps(file: str | Path, load_reference: Callable[[], GPT], tok: Tokenizer,
                           pairs: dict[str, list[dict]], reuse: bool) -> tuple[dict[str, torch.Tensor], bool]:
    """The reference's log-probs of every pair of each named set (N, 2), and whether they were computed now: read from
    `file` when `reuse` and it holds sets of the same sizes; else the model `load_reference()` returns scores them,
    is released (training then holds the policy's weights only), and the log-probs are saved to `file`."""
    file = Path(file)
    if reuse and file.is_file():
        cache = load_tensors(file)
        if all(name in cache and cache[name].shape[0] == len(rows) for name, rows in pairs.items()):
            return {name: cache[name] for name in pairs}, False
    reference = load_reference()
    cache = {name: reference_logps(reference, tok, rows, 64) for name, rows in pairs.items()}
    del reference
    gc.collect()
    save_tensors(file, cache)
    return cache, True


def sampled_pairs(model: GPT, tok: Tokenizer, prompts: list[dict], k: int, temperature: float, max_new_tokens: int,
                  seed: int) -> list[dict]:
    """Preference pairs from the model's own stories: k samples of each story prompt ({"prompt", "spec"}), the best and
    the worst by the gold reward (a prompt whose k stories tie is dropped), labelled as the tiny world labels its
    pairs: the better story is the chosen one with probability σ(BT_BETA (gold_a − gold_b)). On-policy data: the
    differences are the model's own mistakes, not the generator's corruptions."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(20_000 + seed)
    stories = [text for text, _ in answer(model, tok, [p["prompt"] for p in prompts for _ in range(k)], max_new_tokens,
                                          temperature=temperature, generator=generator)]
    rng, pairs = random.Random(seed), []
    for i, p in enumerate(prompts):
        cands = [s for s in stories[i * k:(i + 1) * k] if "<|" not in s]  # a sampled special token: not text to encode
        golds = [story_reward(p["spec"], s) for s in cands]
        if len(cands) < 2 or max(golds) == min(golds):
            continue
        hi, lo = golds.index(max(golds)), golds.index(min(golds))
        p_better = sigmoid(BT_BETA * (golds[hi] - golds[lo]))
        (c, gc_), (r, gr) = ((cands[hi], golds[hi]), (cands[lo], golds[lo]))
        if rng.random() >= p_better:  # the labeller's noise
            (c, gc_), (r, gr) = (r, gr), (c, gc_)
        pairs.append({"prompt": p["prompt"], "chosen": c, "rejected": r, "gold_chosen": gc_, "gold_rejected": gr,
                      "p_chosen": sigmoid(BT_BETA * (gc_ - gr)), "spec": p["spec"]})
    return pairs


@dataclass
class DPOConfig:
    beta: float = 0.1              # the KL weight of the objective DPO optimises: the implicit reward's scale
    loss_type: str = "sigmoid"     # "sigmoid" (DPO, with label_smoothing > 0 conservative DPO) or "ipo"
    label_smoothing: float = 0.0   # ε: the assumed probability that a label is flipped
    max_grad_norm: float = 1.0


def dpo_step(policy: torch.nn.Module, optimizer: torch.optim.Optimizer,
             batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor], ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, cfg: DPOConfig) -> dict[str, float]:
    """One optimizer step on a batch of N pairs (batch = preference_batch(...) on the policy's device) whose
    reference log-probs (N,) each come from the cache or from frozen_logps. Returns the loss, the standard
    metrics and the gradient norm before clipping.

    Under torchrun every rank passes the same global batch and reference log-probs, and the policy wrapped by
    distributed.wrap (only DDP's own forward pass makes the backward all-reduce the gradients): the rank computes its
    pairs, distributed.shard_rows(N), and backpropagates shard_weight · their mean loss (see the module docstring).
    The numbers returned are the global batch's, the same on every rank."""
    W, N = distributed.world_size(), batch[0].size(0) // 2
    if W > 1 and not distributed.is_wrapped(policy):
        raise ValueError("dpo_step under torchrun: pass the policy wrapped by distributed.wrap, or the ranks' "
                         "gradients are never averaged and their copies drift apart")
    if W > 1:
        mine = distributed.shard_rows(N)  # this rank's n_r pairs
        batch = pair_rows(batch, mine)  # (2n_r, T) ...: their chosen rows, then their rejected rows
        ref_chosen, ref_rejected = ref_chosen[mine], ref_rejected[mine]  # (n_r,) each
    chosen, rejected = concatenated_logps(policy, *batch)  # (n,), (n,): one forward pass over 2n rows
    losses, chosen_rewards, rejected_rewards = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, cfg.beta,
                                                        cfg.loss_type, cfg.label_smoothing)
    optimizer.zero_grad(set_to_none=True)
    loss = losses.mean()
    if W > 1:  # w_r times the mean over this rank's pairs: DDP's average is then the mean over all N
        loss = loss * distributed.shard_weight(len(losses), N)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(distributed.unwrap(policy).parameters(), cfg.max_grad_norm)
    optimizer.step()
    if W == 1:
        return {"loss": losses.mean().item(), **preference_metrics(chosen_rewards, rejected_rewards, chosen, rejected),
                "grad_norm": grad_norm.item()}
    columns = {"loss": losses, **preference_columns(chosen_rewards, rejected_rewards, chosen, rejected)}
    return {**distributed.global_means(columns, N), "grad_norm": grad_norm.item()}  # the global batch's means
