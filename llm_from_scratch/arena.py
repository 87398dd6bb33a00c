"""The arena (chapter 10): the methods that need no gradient on the reward, and one evaluation for every method.

**Best-of-N.** Sample N responses from the policy π for a prompt and keep the one a reward model scores highest. It
optimises the reward with no gradient step, and its distribution π_N is known in closed form: with the responses
ranked by reward and F the probability that π draws one ranked no higher than y,

    π_N(y) = F(y)^N − F(y⁻)^N                 (the chance that the best of N draws is y)

so its KL to π is bounded by (and, for a continuum of distinct rewards, equal to)

    KL(π_N ‖ π) = log N − (N − 1) / N          (0 for N = 1; 1.84 nats for N = 16; 3.17 for N = 64)

From M ≥ N samples of a prompt, the expected reward of best-of-N is estimated without bias by averaging over all
C(M, N) subsets of the samples: sorted by the proxy (ranks i = 1..M, best last), sample i is a subset's best with
probability C(i − 1, N − 1) / C(M, N), so E[gold of best-of-N] ≈ Σ_i C(i − 1, N − 1) / C(M, N) · gold_i.

**Rejection-sampling fine-tuning (RFT)**, learning from the policy's own best: sample k responses per prompt, keep
the top fraction of each prompt's k by the reward model, fine-tune on the kept ones with the SFT loss (chapter 5's
masked cross-entropy), repeat for a few rounds. Each round is a step of expert iteration: the policy moves towards
its own best-of-k by the reward model, and the next round's best-of-k starts from there, so the rounds compound
(and so does whatever the reward model gets wrong). Unlike best-of-N it pays for its samples once, while training.

**One evaluation** (`evaluate`): the same held-out prompts and the same random draws for every checkpoint
(`evaluation.sampled_eval`): gold reward ± s.e., proxy (reward model), the KL to the SFT model from samples
(k1 and k3), mean length, distinct-n; plus the greedy accuracy on held-out word problems (the verifiable task).
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

from llm_from_scratch.data import sft_collate
from llm_from_scratch.evaluation import greedy_eval, sampled_eval
from llm_from_scratch.model import GPT
from llm_from_scratch.sft import answer
from llm_from_scratch.tokenizer import Tokenizer, encode_chat
from llm_from_scratch.train import lm_loss, optimizer_step

ScoreFn = Callable[[list[str], list[str]], "list[float] | torch.Tensor"]  # (prompts, responses) -> a score each


def on_cpu(scores):
    """A score_fn's scores where float64 exists: a tensor on a GPU comes to the CPU first (MPS has no float64);
    a list, or a tensor already on the CPU, is returned as it is."""
    return scores.detach().cpu() if torch.is_tensor(scores) else scores


# ----------------------------------------------------------------------------- best-of-N


def best_of_n_kl_bound(n: int) -> float:
    """log N − (N − 1)/N: the KL (nats) of best-of-N sampling to the policy it samples from (an upper bound)."""
    if n < 1:
        raise ValueError(f"best_of_n_kl_bound: N must be ≥ 1, got {n}")
    return math.log(n) - (n - 1) / n


@torch.no_grad()
def best_of_n(model: GPT, tok: Tokenizer, prompts: list[str], n: int, score_fn: ScoreFn, temperature: float = 1.0,
              max_new_tokens: int = 128, generator: torch.Generator | None = None) -> list[dict]:
    """For each prompt, n samples at `temperature` and the one score_fn rates highest (the first on a tie):
    {"prompt", "response", "score", "scores"} per prompt, "scores" holding all n in the order drawn."""
    if n < 1:
        raise ValueError(f"best_of_n: n must be ≥ 1, got {n}")
    if temperature <= 0:
        raise ValueError(f"best_of_n: temperature must be > 0 (greedy answers are all the same), got {temperature}")
    repeated = [p for p in prompts for _ in range(n)]  # sample j of prompt i at i * n + j
    responses = [text for text, _ in answer(model, tok, repeated, max_new_tokens, temperature=temperature,
                                            generator=generator)]
    scores = torch.as_tensor(on_cpu(score_fn(repeated, responses)), dtype=torch.float64).view(len(prompts), n)  # (P, n)
    best = scores.argmax(dim=1)  # (P,): the first maximum of each row
    return [{"prompt": p, "response": responses[i * n + int(b)], "score": scores[i, b].item(),
             "scores": scores[i].tolist()} for i, (p, b) in enumerate(zip(prompts, best))]


def best_of_n_weights(m: int, n: int) -> torch.Tensor:
    """(m,) float64: the probability that the sample of rank i (1 = lowest proxy, m = highest) is the best of a
    uniformly drawn n-subset of m samples, C(i − 1, n − 1) / C(m, n). Sums to 1."""
    if not 1 <= n <= m:
        raise ValueError(f"best_of_n_weights: need 1 ≤ n ≤ m, got n = {n}, m = {m}")
    return torch.tensor([math.comb(i - 1, n - 1) / math.comb(m, n) for i in range(1, m + 1)], dtype=torch.float64)


def best_of_n_expected(proxy: torch.Tensor, values: torch.Tensor, n: int) -> torch.Tensor:
    """proxy, values (P, M): M samples of each of P prompts, scored by the proxy that picks and by any other
    measure (gold, length, the proxy itself). Returns (P,): the expected value of the best-of-n pick, averaged over
    every n-subset of a prompt's M samples (unbiased for best-of-n of the policy when the M samples are i.i.d.)."""
    m = proxy.size(1)
    # (P, M): sample indices from the lowest proxy to the highest; of two tied samples the one drawn first ranks
    # higher (as best_of_n and keep_top pick it): sort the reversed rows stably, then map back
    order = (m - 1) - torch.argsort(proxy.double().flip(1), dim=1, stable=True)
    ranked = torch.gather(values.double(), 1, order)  # (P, M) the values in proxy order
    return ranked @ best_of_n_weights(m, n)  # (P,)


def best_of_n_curve(proxy: torch.Tensor, gold: torch.Tensor, ns: list[int]) -> list[dict]:
    """For each N: the KL bound, and the expected proxy and gold of best-of-N (mean over prompts ± its s.e.)."""
    rows = []
    for n in ns:
        g, p = best_of_n_expected(proxy, gold, n), best_of_n_expected(proxy, proxy, n)  # (P,) each
        rows.append({"n": n, "kl": best_of_n_kl_bound(n), "gold": g.mean().item(),
                     "gold_se": (g.std() / math.sqrt(g.numel())).item() if g.numel() > 1 else 0.0,
                     "proxy": p.mean().item()})
    return rows


# ----------------------------------------------------------------------------- rejection-sampling fine-tuning


def keep_top(scores: torch.Tensor, fraction: float) -> torch.Tensor:
    """scores (P, k): k samples of each of P prompts. Returns a (P, k) bool mask keeping, in every row, exactly
    max(1, round(fraction · k)) samples (Python's round: a half goes to the even number, 2.5 -> 2): the highest
    scores (on a tie, the sample drawn first)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"keep_top: fraction must be in (0, 1], got {fraction}")
    k = scores.size(1)
    keep = max(1, round(fraction * k))
    order = torch.argsort(-scores.double(), dim=1, stable=True)[:, :keep]  # (P, keep): the best first
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(1, order, True)


@dataclass
class RFTConfig:
    rounds: int = 4  # sample -> keep -> fine-tune, repeated
    prompts: int = 128  # fresh prompts per round
    k: int = 8  # samples per prompt
    keep: float = 0.125  # the fraction of each prompt's samples kept (1/8 of 8: its best-of-8)
    epochs: int = 2  # passes over the kept samples per round
    batch_size: int = 16
    lr: float = 3e-5
    temperature: float = 1.0
    max_new_tokens: int = 128


def rft_round(policy: GPT, tok: Tokenizer, prompts: list[str], score_fn: ScoreFn, cfg: RFTConfig,
              optimizer: torch.optim.Optimizer, generator: torch.Generator | None = None) -> tuple[dict, list[dict]]:
    """One round of RFT: cfg.k samples per prompt, keep_top by score_fn, then cfg.epochs passes of the SFT loss over
    the kept (prompt, response) pairs. A sample that cannot be a training example never counts as best: one cut
    off before its EOS, or one whose text spells a special token. Returns the round's metrics and the kept rows
    {prompt, response, score}."""
    repeated = [p for p in prompts for _ in range(cfg.k)]  # sample j of prompt i at i * k + j
    was_training = policy.training
    policy.eval()
    drawn = answer(policy, tok, repeated, cfg.max_new_tokens, temperature=cfg.temperature, generator=generator)
    texts = [t for t, _ in drawn]
    scores = torch.as_tensor(on_cpu(score_fn(repeated, texts)), dtype=torch.float64).flatten()  # (P * k,)
    encoded = [_encode(tok, p, t, policy.config.context_length) if e else None
               for p, (t, e) in zip(repeated, drawn)]  # (ids, prompt length) with EOS, or None: not usable
    usable = torch.tensor([e is not None for e in encoded])
    ranked = torch.where(usable, scores, torch.full_like(scores, -math.inf)).view(len(prompts), cfg.k)  # (P, k)
    kept_idx = [i for i in keep_top(ranked, cfg.keep).flatten().nonzero().flatten().tolist() if usable[i]]
    kept = [{"prompt": repeated[i], "response": texts[i], "score": scores[i].item()} for i in kept_idx]
    examples = [encoded[i] for i in kept_idx]
    device = next(policy.parameters()).device
    policy.train()
    losses = []
    for _ in range(cfg.epochs):
        order = torch.randperm(len(examples)).tolist()  # the global random state: seed_everything makes it repeat
        for start in range(0, len(order), cfg.batch_size):
            x, y = sft_collate([examples[i] for i in order[start:start + cfg.batch_size]], tok.pad_id)  # (B, T) each
            loss = lm_loss(policy, x.to(device), y.to(device))
            loss.backward()
            optimizer_step(policy, optimizer)
            losses.append(loss.item())
    policy.train(was_training)
    metrics = {"rft/reward_all": scores.mean().item(),
               "rft/reward_kept": statistics.fmean(r["score"] for r in kept) if kept else float("nan"),
               "rft/kept": len(kept), "rft/usable": usable.float().mean().item(),
               "loss/sft": statistics.fmean(losses) if losses else float("nan")}
    return metrics, kept


def _encode(tok: Tokenizer, prompt: str, response: str, context_length: int) -> tuple[list[int], int] | None:
    """encode_chat's (ids, prompt length), or None when the response spells a special token or does not fit."""
    try:
        ids, n_prompt = encode_chat(tok, prompt, response)
    except ValueError:  # tiktoken refuses text that spells a special token (a sample can decode to one)
        return None
    return (ids, n_prompt) if len(ids) - 1 <= context_length else None


# ----------------------------------------------------------------------------- one evaluation for every checkpoint


def distinct_n(texts: list[str], n: int) -> float:
    """Distinct word n-grams over all n-grams of the texts (1.0: nothing repeats; near 0: the same words again)."""
    grams = [tuple(words[i:i + n]) for words in (t.split() for t in texts) for i in range(len(words) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


@torch.no_grad()
def verifiable_accuracy(policy: GPT, tok: Tokenizer, problems: list[dict], max_new_tokens: int = 160) -> dict:
    """Greedy answers to held-out verifiable problems (word problems), by evaluation.greedy_eval: the share right,
    ± its standard error √(p (1 − p) / n), and each problem's 1/0 in order (right_each, for McNemar's test)."""
    greedy = greedy_eval(policy, tok, problems, max_new_tokens=max_new_tokens)
    acc, n = greedy["gold"], greedy["n"]
    return {"accuracy": acc, "accuracy_se": math.sqrt(acc * (1 - acc) / n), "problems": n,
            "right_each": greedy["gold_each"]}


def evaluate(policy: GPT, reference: GPT, tok: Tokenizer, stories: list[dict], problems: list[dict],
             proxy_fn: ScoreFn | None, n: int = 4, temperature: float = 1.0, max_new_tokens: int = 128,
             seed: int = 0) -> dict:
    """The arena's evaluation of one checkpoint against the reference (the SFT model): sampled_eval's gold ± s.e.,
    proxy, KL k1/k3 and length over n samples of each held-out story prompt (the draws of chapters 8 and 9's
    evaluations, so a checkpoint scores here what its chapter recorded), distinct-1/2 of those samples, and the
    greedy accuracy on the held-out word problems. Deterministic: the same checkpoint and seed give the same numbers."""
    sampled = sampled_eval(policy, reference, tok, stories, n, temperature, max_new_tokens, proxy_fn, seed)
    sampled["distinct_1"] = distinct_n(sampled["completions"], 1)
    sampled["distinct_2"] = distinct_n(sampled["completions"], 2)
    return {**sampled, **(verifiable_accuracy(policy, tok, problems) if problems else {})}


def weights_digest(model: torch.nn.Module) -> str:
    """A short hash of a model's weights (names, shapes and values): the key under which its evaluation is kept."""
    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        h.update(name.encode())
        h.update(str(tuple(tensor.shape)).encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]
