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
reference model released (`reference_logps`), or computed live each step; the losses are the same either way.

Tensors: a batch of N pairs is 2N rows, the N chosen then the N rejected, right-padded (B = 2N, T); a completion mask
(B, T-1) marks the response tokens and the EOS in the log-prob columns (column t scores token t+1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llm_from_scratch.generation import sequence_logprobs
from llm_from_scratch.model import GPT, eval_mode
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
    (N,) each, detached. All log-probs are sequence sums. See the module docstring for the three losses."""
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


def preference_metrics(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, chosen_logps: torch.Tensor,
                       rejected_logps: torch.Tensor) -> dict[str, float]:
    """The standard DPO diagnostics (TRL's names), means over the pairs."""
    return {"rewards/chosen": chosen_rewards.mean().item(), "rewards/rejected": rejected_rewards.mean().item(),
            "rewards/margins": (chosen_rewards - rejected_rewards).mean().item(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean().item(),
            "logps/chosen": chosen_logps.detach().mean().item(), "logps/rejected": rejected_logps.detach().mean().item()}


@torch.no_grad()
def reference_logps(reference: GPT, tok: Tokenizer, pairs: list[dict], batch_size: int = 32) -> torch.Tensor:
    """The reference's sequence log-probs of every pair, once, without gradients: (N, 2), chosen then rejected.
    Stored with the dataset, they let the reference model go before training starts."""
    device = next(reference.parameters()).device
    out = []
    with eval_mode(reference):
        for i in range(0, len(pairs), batch_size):
            ids, mask, completion = (t.to(device) for t in preference_batch(tok, pairs[i:i + batch_size]))
            chosen, rejected = concatenated_logps(reference, ids, mask, completion)
            out.append(torch.stack([chosen, rejected], dim=1).cpu())
    return torch.cat(out)
