"""Reward model: the GPT trunk plus a scalar head, trained on human (here: simulated) preferences.

A reward model r(x, y) scores a response y to a prompt x. We only ever see comparisons: for a pair
the labeller preferred y_c ("chosen") over y_r ("rejected"). Bradley–Terry models such a label as

    P(y_c ≻ y_r | x) = σ( r(x, y_c) − r(x, y_r) )

so maximum likelihood means minimising   L = −log σ(r_c − r_r)   over the pairs. Only differences of
rewards matter: any constant can be added to r. After training we use that freedom to shift the
head's bias so the rewards of typical (SFT) responses have mean 0, which keeps RL's advantages and
KL trade-off on a sensible scale.

The score is read at the last real token of prompt + response (its EOS): thanks to causal attention
that is the only position that has seen the whole response.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from llm_from_scratch.checkpoint import append_metrics, atomic_write_text, load_tensors, save_tensors
from llm_from_scratch.data import pad_right
from llm_from_scratch.model import GPT, GPTConfig
from llm_from_scratch.sft import encode_chat
from llm_from_scratch.tokenizer import Tokenizer
from llm_from_scratch.train import TrainConfig, configure_optimizer, lr_at


class RewardModel(nn.Module):
    def __init__(self, gpt: GPT):
        super().__init__()
        self.gpt = gpt  # its LM head is unused; its dropout must be 0 (a noisy score is a noisy label)
        C = gpt.config.n_embd
        self.head = nn.Linear(C, 1)
        nn.init.normal_(self.head.weight, std=1.0 / math.sqrt(C + 1))  # small: initial rewards of order 1
        nn.init.zeros_(self.head.bias)

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor, last_index: torch.Tensor) -> torch.Tensor:
        """ids, attention_mask (B, T); last_index (B,) the position of each row's last real token -> rewards (B,)."""
        h = self.gpt.trunk(ids, attention_mask)  # (B, T, C)
        h_last = h[torch.arange(ids.size(0), device=ids.device), last_index]  # (B, C)
        return self.head(h_last).squeeze(-1)  # (B,)

    def save(self, folder: str | Path) -> Path:
        folder = Path(folder)
        save_tensors(folder / "model.safetensors", self.state_dict())
        atomic_write_text(folder / "config.json", self.gpt.config.to_json() + "\n")
        return folder

    @classmethod
    def load(cls, folder: str | Path, device: str | torch.device = "cpu") -> RewardModel:
        folder = Path(folder)
        config = GPTConfig.from_json((folder / "config.json").read_text())
        rm = cls(GPT(config))
        state = load_tensors(folder / "model.safetensors")
        state.setdefault("gpt.lm_head.weight", state["gpt.wte.weight"])
        rm.load_state_dict(state)
        return rm.to(device)


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
    pairs = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}, line {lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not valid JSON ({err.msg})") from err
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object with {', '.join(PAIR_FIELDS)}")
        for field in PAIR_FIELDS:
            if field not in row:
                raise ValueError(f"{where}: missing field {field!r}")
            if not isinstance(row[field], str) or not row[field].strip():
                raise ValueError(f"{where}: field {field!r} is empty")
        pairs.append(row)
    if not pairs:
        raise ValueError(f"{path}: no preference pairs")
    return pairs


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
    (`data.preference_collate`) spends about half its compute on padding; on a CPU the chunks make a
    training step about 1.8x faster (benchmarks/bench_reward_model.py). Each row's reward is the same
    either way, up to float rounding: a right-padded row's real tokens never attend to its padding."""
    device = next(rm.parameters()).device
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    chunks = []
    for k in range(0, len(rows), chunk_rows):
        ids, mask, last = (t.to(device) for t in pad_right([rows[i] for i in order[k:k + chunk_rows]], pad_id))
        chunks.append(rm(ids, mask, last))  # (chunk,)
    by_length = torch.cat(chunks)  # (N,) in sorted order
    return by_length[torch.argsort(torch.tensor(order, device=device))]  # back to the given order


@torch.no_grad()
def score_pairs(rm: RewardModel, encoded: list, pad_id: int, chunk_rows: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards of every chosen and rejected response: two (N,) tensors."""
    was_training = rm.training
    rm.eval()
    r = score_rows(rm, [c for c, _ in encoded] + [rj for _, rj in encoded], pad_id, chunk_rows).cpu()
    rm.train(was_training)
    return r[:len(encoded)], r[len(encoded):]


@torch.no_grad()
def score_texts(rm: RewardModel, tok: Tokenizer, prompts: list[str], responses: list[str], chunk_rows: int = 64) -> torch.Tensor:
    """Rewards (N,) of responses to prompts (each templated and closed with EOS)."""
    was_training = rm.training
    rm.eval()
    r = score_rows(rm, [encode_chat(tok, p, y)[0] for p, y in zip(prompts, responses)], tok.pad_id, chunk_rows).cpu()
    rm.train(was_training)
    return r


# ----------------------------------------------------------------------------- training


def train_reward_model(rm: RewardModel, train_pairs: list, val_pairs: list, cfg: TrainConfig, pad_id: int,
                       out_dir: str | Path, quiet: bool = False, chunk_rows: int = 16) -> dict:
    """Minimise the Bradley–Terry loss with chapter 4's optimiser conventions (AdamW with decay on matrices,
    warmup + cosine, clipping). Logs TRL-style metrics; keeps the model with the best validation accuracy.
    A step scores its 2 x batch_size responses in length-sorted chunks of chunk_rows (see score_rows)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    optimizer = configure_optimizer(rm, cfg)
    g = torch.Generator().manual_seed(cfg.seed)
    best = {"accuracy": -1.0}
    rm.train()
    bar = tqdm(range(cfg.max_steps), desc="reward model", unit="step", disable=quiet, dynamic_ncols=True)
    t0 = time.perf_counter()
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        pick = torch.randint(0, len(train_pairs), (cfg.batch_size,), generator=g).tolist()
        batch = [train_pairs[i] for i in pick]
        r = score_rows(rm, [c for c, _ in batch] + [rj for _, rj in batch], pad_id, chunk_rows)  # (2B,) chosen first
        r_c, r_r = r[: cfg.batch_size], r[cfg.batch_size:]
        loss = bradley_terry_loss(r_c, r_r)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"reward model loss is {loss.item()} at step {step}")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(rm.parameters(), cfg.grad_clip or float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        done = step + 1
        if done % cfg.log_interval == 0:
            m = preference_metrics(r_c.detach(), r_r.detach())
            append_metrics(out_dir / "metrics.jsonl", {"step": done, "loss/train": loss.item(),
                                                       "rewards/accuracies": m["accuracy"], "rewards/margins": m["margin"]})
            bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{m['accuracy']:.2f}")
        if done % cfg.eval_interval == 0 or done == cfg.max_steps:
            c, rj = score_pairs(rm, val_pairs, pad_id)
            m = preference_metrics(c, rj)
            record = {"step": done, "loss/val": bradley_terry_loss(c, rj).item(), "val/accuracy": m["accuracy"],
                      "val/margin": m["margin"], "val/mean_reward": m["mean_reward"],
                      "val/min_reward": m["min_reward"], "val/max_reward": m["max_reward"]}
            append_metrics(out_dir / "metrics.jsonl", record)
            if m["accuracy"] > best["accuracy"]:
                best = {**m, "step": done, "loss": record["loss/val"]}
                rm.save(out_dir)
    best["seconds"] = time.perf_counter() - t0
    return best


@torch.no_grad()
def center_rewards(rm: RewardModel, rewards_of_samples: torch.Tensor) -> tuple[float, float]:
    """Shift the head's bias so that these rewards (of typical policy samples) have mean 0.
    Returns (the mean that was removed, their standard deviation)."""
    mean, std = rewards_of_samples.mean().item(), rewards_of_samples.std().item()
    rm.head.bias -= mean
    return mean, std
