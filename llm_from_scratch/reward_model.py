"""Reward model: the GPT trunk plus a scalar head, trained on human (here: simulated) preferences.

A reward model r(x, y) scores a response y to a prompt x. We only ever see comparisons: for a pair
the labeller preferred y_c ("chosen") over y_r ("rejected"). Bradley–Terry models such a label as

    P(y_c ≻ y_r | x) = σ( r(x, y_c) − r(x, y_r) )

so maximum likelihood means minimising   L = −log σ(r_c − r_r)   over the pairs. Only differences of
rewards matter: any constant can be added to r. After training we use that freedom to shift the
head's bias so the rewards of typical (SFT) responses have mean 0, which keeps RL's advantages and
KL trade-off on a sensible scale.

The score is read at the last real token of prompt + response (its EOS): thanks to causal attention
that is the only position that has seen the whole response. The module finds that token from the
attention mask itself, whether the rows are padded on the right (preference data) or on the left
(a batch from `generation.generate`), so `rm(gen.sequences, gen.attention_mask)` scores a rollout as
it is. With `per_token=True` it returns the head at every position (B, T): a value head (chapter 8)
is this same module on another trunk.

Against the gold reward (the tiny world knows it): `ranking_scores` (accuracy on the noisy labels and
agreement with gold), `agreement_by_part` (which parts of the gold reward the model sees), and
Pearson's and Spearman's correlations on policy samples.

Several processes (torchrun, see distributed.py): every rank draws the same global batch of B pairs and scores its
own share of them, n_r pairs (both responses of each). Rank r backpropagates w_r L_r, with L_r the mean loss of its
pairs and w_r = W n_r / B, so DDP's average of the gradients, (1/W) Σ_r w_r L_r = (1/B) Σ_pairs ℓ, is the one-process
gradient of the whole batch, however unevenly the B pairs fall. The numbers logged are the global batch's (sums over
the ranks' pairs, divided by B), the held-out pairs are shared out and their rewards gathered, and only rank 0 writes.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from llm_from_scratch import distributed
from llm_from_scratch.checkpoint import append_metrics, load_model, read_jsonl, save_model
from llm_from_scratch.model import GPT, GPTConfig, eval_mode
from llm_from_scratch.tokenizer import Tokenizer, encode_chat, pad_right
from llm_from_scratch.train import configure_optimizer, lr_at, optimizer_step, require_finite


class RewardModel(nn.Module):
    def __init__(self, gpt: GPT):
        super().__init__()
        self.gpt = gpt  # its LM head is unused; its dropout must be 0 (a noisy score is a noisy label)
        C = gpt.config.n_embd
        self.head = nn.Linear(C, 1)
        nn.init.normal_(self.head.weight, std=1.0 / math.sqrt(C + 1))  # small: initial rewards of order 1
        nn.init.zeros_(self.head.bias)

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor, per_token: bool = False) -> torch.Tensor:
        """ids, attention_mask (B, T), padded on either side -> the reward of each row (B,), read at its last
        real token; per_token=True: the head at every position (B, T), padding included (mask it)."""
        h = self.gpt.trunk(ids, attention_mask)  # (B, T, C)
        if per_token:
            return self.head(h).squeeze(-1)  # (B, T)
        T = ids.size(1)
        last = (attention_mask.bool() * torch.arange(1, T + 1, device=ids.device)).argmax(-1)  # (B,) last real token
        h_last = h[torch.arange(ids.size(0), device=ids.device), last]  # (B, C)
        return self.head(h_last).squeeze(-1)  # (B,)

    def save(self, folder: str | Path) -> Path:
        return save_model(self, folder, "reward_model", asdict(self.gpt.config))

    @classmethod
    def load(cls, folder: str | Path, device: str | torch.device = "cpu", vocab_size: int | None = None) -> RewardModel:
        return load_model(folder, "reward_model", lambda config: cls(GPT(GPTConfig(**{**config, "dropout": 0.0}))),
                          device, vocab_size)


def bradley_terry_loss(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> torch.Tensor:
    """Mean of −log σ(r_c − r_r) (logsigmoid is exact for large margins of either sign)."""
    return -F.logsigmoid(chosen_rewards - rejected_rewards).mean()


def preference_metrics(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> dict[str, float]:
    """accuracy (share of pairs ranked right), margin (mean r_c − r_r), and the spread of all rewards."""
    both = torch.cat([chosen_rewards, rejected_rewards]).float()
    return {"accuracy": (chosen_rewards > rejected_rewards).float().mean().item(),
            "margin": (chosen_rewards - rejected_rewards).float().mean().item(),
            "mean_reward": both.mean().item(), "min_reward": both.min().item(), "max_reward": both.max().item()}


# ----------------------------------------------------------------------------- data

PAIR_FIELDS = ("prompt", "chosen", "rejected")


def load_preferences(path: str | Path) -> list[dict]:
    """Preference pairs from JSONL; a malformed line, a missing field or an empty response is a ValueError
    naming the file and the line."""
    path = Path(path)
    pairs = read_jsonl(path)
    for lineno, row in enumerate(pairs, start=1):  # read_jsonl skips blank lines: count them back in for the message
        for field in PAIR_FIELDS:
            if field not in row:
                raise ValueError(f"{path}, line {_line_of(path, lineno)}: missing field {field!r}")
            if not isinstance(row[field], str) or not row[field].strip():
                raise ValueError(f"{path}, line {_line_of(path, lineno)}: field {field!r} is empty")
    if not pairs:
        raise ValueError(f"{path}: no preference pairs")
    return pairs


def _line_of(path: Path, record: int) -> int:
    """The file line of the record-th non-blank line."""
    seen = 0
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        seen += bool(line.strip())
        if seen == record:
            return lineno
    return record


def encode_pairs(tok: Tokenizer, pairs: list[dict], context_length: int) -> list[tuple[list[int], list[int]]]:
    """(chosen ids, rejected ids) in the chat template, each ending with EOS; pairs too long are dropped."""
    out = []
    for p in pairs:
        chosen = encode_chat(tok, p["prompt"], p["chosen"])[0]
        rejected = encode_chat(tok, p["prompt"], p["rejected"])[0]
        if max(len(chosen), len(rejected)) <= context_length:
            out.append((chosen, rejected))
    return out


def score_rows(rm: RewardModel, rows: list[list[int]], pad_id: int, chunk_rows: int = 16) -> torch.Tensor:
    """Rewards (N,) of token rows (each ending with its EOS), in the order given, differentiable.

    Rows are sorted by length and scored in chunks of `chunk_rows` rows of similar length, then put back
    in order. The tiny world's stories run from about 30 to 200 tokens, so one padded batch
    (`data.preference_collate`) spends about half its compute on padding; benchmarks/bench_reward_model.py
    measures what the chunks save. Each row's reward is the same either way, up to float rounding: a
    right-padded row's real tokens never attend to its padding."""
    device = next(rm.parameters()).device
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    chunks = []
    for k in range(0, len(rows), chunk_rows):
        ids, mask, _ = (t.to(device) for t in pad_right([rows[i] for i in order[k:k + chunk_rows]], pad_id))
        chunks.append(rm(ids, mask))  # (chunk,)
    by_length = torch.cat(chunks)  # (N,) in sorted order
    return by_length[torch.argsort(torch.tensor(order, device=device))]  # back to the given order


@torch.no_grad()
def score_pairs(rm: RewardModel, encoded: list, pad_id: int, chunk_rows: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards of every chosen and rejected response: two (N,) tensors."""
    with eval_mode(rm):
        r = score_rows(rm, [c for c, _ in encoded] + [rj for _, rj in encoded], pad_id, chunk_rows).cpu()
    return r[:len(encoded)], r[len(encoded):]


def score_pairs_shared(rm: RewardModel, encoded: list, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """score_pairs, the pairs shared out between the ranks under torchrun (every rank must call it then): rank r scores
    its contiguous share (distributed.shard_rows) and every rank gets all N rewards back, in order, the same tensors
    on every rank. One process, or fewer pairs than ranks: score_pairs itself."""
    if distributed.world_size() == 1 or len(encoded) < distributed.world_size():
        return score_pairs(rm, encoded, pad_id)
    shares = distributed.all_gather_objects(score_pairs(rm, encoded[distributed.shard_rows(len(encoded))], pad_id))
    return torch.cat([c for c, _ in shares]), torch.cat([r for _, r in shares])  # (N,) each, in rank order = pair order


@torch.no_grad()
def response_row(tok: Tokenizer, prompt: str, response: str) -> list[int]:
    """The token ids the reward model reads for (prompt, response): the chat template, the response, EOS.

    The response is encoded as it stands, special-token text included: a policy's sample may have written
    "<|assistant|>", and that sample must be scored as it was written, not refused (encode_chat refuses it)."""
    return encode_chat(tok, prompt)[0] + tok.encode(response, allowed_special="all") + [tok.eos_id]


@torch.no_grad()
def score_texts(rm: RewardModel, tok: Tokenizer, prompts: list[str], responses: list[str],
                chunk_rows: int = 64) -> torch.Tensor:
    """Rewards (N,) of responses to prompts (each encoded by response_row), no gradients."""
    with eval_mode(rm):
        return score_rows(rm, [response_row(tok, p, y) for p, y in zip(prompts, responses)], tok.pad_id,
                          chunk_rows).cpu()


def reward_fn(rm: RewardModel, tok: Tokenizer, chunk_rows: int = 64):
    """The reward model as an RL reward callable: (prompts, completions) -> (N,) rewards, no gradients.
    The same path as score_texts: a completion is scored as it was sampled, special tokens and all."""
    def score(prompts: list[str], completions: list[str]) -> torch.Tensor:
        return score_texts(rm, tok, prompts, completions, chunk_rows)
    return score


# ----------------------------------------------------------------------------- training


@dataclass
class RewardConfig:
    max_steps: int = 300
    batch_size: int = 32  # pairs per step (2 x batch_size responses scored)
    lr: float = 1e-3  # peak learning rate
    min_lr: float = 1e-4  # the cosine decays to this
    warmup_steps: int = 15
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 = off
    eval_interval: int = 100
    log_interval: int = 10
    chunk_rows: int = 16  # responses scored per forward pass (length-sorted, see score_rows)
    seed: int = 0


def train_reward_model(rm: RewardModel, train_pairs: list, val_pairs: list, cfg: RewardConfig, pad_id: int,
                       out_dir: str | Path, quiet: bool = False) -> dict:
    """Minimise the Bradley–Terry loss with chapter 4's optimiser conventions (AdamW with decay on matrices,
    warmup + cosine, clipping). Logs TRL-style metrics; keeps the model with the best validation accuracy.

    Under torchrun every rank calls it alike (see the module docstring): the model is wrapped in DDP here, each rank
    scores its share of each global batch of cfg.batch_size pairs, the held-out pairs are shared out, rank 0 alone
    appends the metrics and saves the best model, and every rank returns the same summary once rank 0's files are
    written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    W, main = distributed.world_size(), distributed.is_main()
    optimizer = configure_optimizer(rm, cfg)
    forward = distributed.wrap(rm)  # DDP under torchrun: only its own forward pass makes the backward all-reduce
    g = torch.Generator().manual_seed(cfg.seed)
    best = {"accuracy": -1.0}
    rm.train()
    bar = tqdm(range(cfg.max_steps), desc="reward model", unit="step", disable=quiet or not main, dynamic_ncols=True)
    t0 = time.perf_counter()
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        pick = torch.randint(0, len(train_pairs), (cfg.batch_size,), generator=g).tolist()  # the same on every rank
        batch = [train_pairs[i] for i in pick]  # the global batch, B pairs
        if W > 1:
            batch = batch[distributed.shard_rows(cfg.batch_size)]  # this rank's n_r pairs
        n = len(batch)
        r = score_rows(forward, [c for c, _ in batch] + [rj for _, rj in batch], pad_id,
                       cfg.chunk_rows)  # (2n,) chosen first
        r_c, r_r = r[:n], r[n:]
        loss = bradley_terry_loss(r_c, r_r)  # L_r, the mean over this rank's pairs
        if W > 1:  # w_r L_r: DDP's average over the ranks is then the mean over the B pairs
            loss = loss * distributed.shard_weight(n, cfg.batch_size)
        loss_value = loss.item() if W == 1 else distributed.all_reduce([loss.item()]).item() / W  # the same on all
        require_finite(loss_value, "the reward model's loss", step, out_dir if "step" in best else None)
        loss.backward()
        grad_norm = optimizer_step(rm, optimizer, cfg.grad_clip)  # on the all-reduced gradients: the same on all
        done = step + 1
        if done % cfg.log_interval == 0:
            if W == 1:
                m = preference_metrics(r_c.detach(), r_r.detach())
            else:  # the global batch's accuracy and margin, not this rank's
                m = distributed.global_means({"accuracy": (r_c > r_r).float(), "margin": r_c - r_r}, cfg.batch_size)
            if main:
                append_metrics(out_dir / "metrics.jsonl",
                               {"step": done, "loss/train": loss_value, "train/grad_norm": grad_norm,
                                "rewards/accuracies": m["accuracy"], "rewards/margins": m["margin"]})
            bar.set_postfix(loss=f"{loss_value:.3f}", acc=f"{m['accuracy']:.2f}")
        if done % cfg.eval_interval == 0 or done == cfg.max_steps:
            c, rj = score_pairs_shared(rm, val_pairs, pad_id)  # every held-out reward, the same on every rank
            m = preference_metrics(c, rj)
            record = {"step": done, "loss/val": bradley_terry_loss(c, rj).item(), "val/accuracy": m["accuracy"],
                      "val/margin": m["margin"], "val/mean_reward": m["mean_reward"],
                      "val/min_reward": m["min_reward"], "val/max_reward": m["max_reward"]}
            if main:
                append_metrics(out_dir / "metrics.jsonl", record)
            if m["accuracy"] > best["accuracy"]:  # the same decision on every rank: the same numbers
                best = {**m, "step": done, "loss": record["loss/val"]}
                if main:
                    rm.save(out_dir)
    best["seconds"] = time.perf_counter() - t0
    distributed.barrier()  # rank 0's files are written before any rank reads them
    return best


@torch.no_grad()
def center_rewards(rm: RewardModel, rewards_of_samples: torch.Tensor) -> tuple[float, float]:
    """Shift the head's bias so that these rewards (of typical policy samples) have mean 0.
    Returns (the mean that was removed, their standard deviation)."""
    mean, std = rewards_of_samples.mean().item(), rewards_of_samples.std().item()
    rm.head.bias -= mean
    return mean, std


# ----------------------------------------------------------------------------- against the gold reward


def gold_sign(rows: list[dict]) -> torch.Tensor:
    """(N,) +1 where gold prefers the chosen response, -1 where it prefers the rejected one, 0 on a tie."""
    return torch.tensor([float((r["gold_chosen"] > r["gold_rejected"]) - (r["gold_chosen"] < r["gold_rejected"]))
                         for r in rows])


def ranking_scores(margins: torch.Tensor, gold: torch.Tensor) -> tuple[float, float]:
    """(accuracy against the noisy labels, agreement with the gold ranking on the pairs gold does not tie) of a
    ranking given by margins = score(chosen) - score(rejected); gold = gold_sign(rows)."""
    decided = gold != 0
    agreement = ((margins[decided] > 0) == (gold[decided] > 0)).float().mean().item()
    return (margins > 0).float().mean().item(), agreement


def agreement_by_part(parts: list[tuple[dict, dict]], margins: torch.Tensor, gold: torch.Tensor) -> dict[str, dict]:
    """For the pairs whose two responses differ in exactly one part of the gold reward (parts: the gold reward's
    parts of (chosen, rejected), e.g. gold_rewards.story_reward_parts) and whose gold rewards differ: how often the
    margins order them as gold does, by part. The parts a model gets wrong are what it has not learned to see."""
    out: dict[str, list[int]] = {}
    for (pc, pr), m, g in zip(parts, margins.tolist(), gold.tolist()):
        differ = [k for k in pc if abs(pc[k] - pr[k]) > 1e-9]
        if len(differ) == 1 and g != 0:
            out.setdefault(differ[0], []).append(int((m > 0) == (g > 0)))
    return {k: {"agreement": sum(v) / len(v), "n": len(v)} for k, v in sorted(out.items(), key=lambda kv: -len(kv[1]))}


def pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    """Pearson's correlation of two (N,) tensors (nan when one is constant)."""
    a, b = a.cpu().double(), b.cpu().double()  # float64 on the CPU: MPS has none (no copy when already there)
    a, b = a - a.mean(), b - b.mean()
    denom = (a.norm() * b.norm()).item()
    return (a @ b).item() / denom if denom > 0 else float("nan")


def average_ranks(x: torch.Tensor) -> torch.Tensor:
    """Ranks 1..N of x's values, ties sharing the mean of their ranks: average_ranks([5, 1, 5]) = [2.5, 1, 2.5]
    (float64, on the CPU)."""
    x = x.cpu().double()  # float64 on the CPU: MPS has none
    ranks = torch.empty_like(x)
    ranks[torch.argsort(x)] = torch.arange(1, len(x) + 1, dtype=x.dtype)
    _, group = torch.unique(x, return_inverse=True)
    sums = torch.zeros(int(group.max()) + 1, dtype=x.dtype).index_add_(0, group, ranks)
    return (sums / torch.bincount(group).to(x.dtype))[group]


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's rank correlation: Pearson's on the ranks (ties averaged). Unlike Pearson's it does not care how
    far apart the scores are, only their order; useful when most samples share one gold score."""
    return pearson(average_ranks(a), average_ranks(b))
