"""Sampling text from a GPT: temperature, top-k, top-p, batched prompts, KV cache.

A language model gives p(x_t | x_<t). Generation repeats: run the model, turn the last position's
logits z into a distribution, draw the next token, append it.

    temperature T:  p_i ∝ exp(z_i / T)       T -> 0 is greedy (argmax), T = 1 the model's own distribution
    top-k:          keep the k most likely tokens, renormalise
    top-p (nucleus): keep the smallest set of most likely tokens whose probability reaches p, renormalise

Batches of prompts of different lengths are LEFT-padded, so every row's next token is predicted at
the same (last) column; the attention mask hides the padding and the model's position ids skip it.
Each row stops at its first EOS (later columns are padding, masked out).

With the KV cache, the prompt is run once (prefill) and every later step feeds only the newest
token, reading the keys and values of all earlier ones from the cache. Without it (use_cache=False,
the teaching version), every step re-runs the whole sequence. Both give the same tokens.

`token_logprobs` is the other half of every RL chapter: log p(target_t | prefix) for each position,
computed stably as z_target - logsumexp(z). `sequence_logprobs(model, ids, attention_mask)` applies it
to whole rows (a rollout, a chosen or rejected response), with gradients:

    logp[:, t] = log p_T(ids[:, t+1] | ids[:, ≤t]),   p_T ∝ exp(z / T)   (T: the sampling temperature)

shape (B, T-1), aligned with `Generation.completion_mask[:, 1:]`; left- or right-padded rows give the
values they give alone (position ids follow the mask), and columns without a real target are 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llm_from_scratch.model import GPT, eval_mode


@dataclass
class Generation:
    sequences: torch.Tensor  # (B, P + N) left-padded prompts, then the completions (padding after a row's EOS)
    attention_mask: torch.Tensor  # (B, P + N) 1 on real prompt and completion tokens
    completion_mask: torch.Tensor  # (B, P + N) 1 on completion tokens, up to and including the first EOS
    prompt_length: int  # P: completions start at this column

    def completions(self) -> list[list[int]]:
        """Each row's completion tokens (with its EOS, if it produced one)."""
        return [row[m.bool()].tolist() for row, m in zip(self.sequences, self.completion_mask)]


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of different lengths -> ids (B, P) padded on the left, and the mask (B, P) of real tokens."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate: every prompt needs at least one token")
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), P), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.as_tensor(p, dtype=torch.long)
        mask[i, P - len(p):] = 1
    return ids, mask


def filter_logits(logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
    """Set the logits outside the top-k / top-p set to -inf. logits: (B, V).

    top-k keeps the k largest logits of each row (ties with the k-th included). top-p (nucleus) keeps the smallest
    set of most likely tokens whose probabilities sum to at least p: token i stays when the tokens ranked above it
    hold less than p (so the most likely token always stays)."""
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1) the k-th largest logit
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (B, V)
        probs = F.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above each one
        drop_sorted = mass_before >= top_p  # the set already reached p without this token (the top one always stays)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row from the last position's logits (B, V) -> (B,). temperature 0 is greedy.

    Sampling by the inverse CDF: one uniform u per row, scaled to the row's total probability, and the first
    token whose running sum of probabilities exceeds it. Token i owns the interval [cdf_{i-1}, cdf_i) of width
    p_i, so it is drawn with probability p_i, and a token of probability 0 owns no interval at all.
    (torch.multinomial draws one exponential random number per vocabulary entry instead: at batch 32 and a
    4,096-token vocabulary that was 37% of a sampled generation's time on a 2-core CPU, measured by
    `python benchmarks/bench_generate.py --profile 32`.)"""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = filter_logits(logits.float() / temperature, top_k, top_p)
    probs = F.softmax(logits, dim=-1)  # (B, V)
    # float64 running sums keep even a 1e-9 probability's interval its own width (MPS has no float64)
    cdf = probs.to(torch.float32 if probs.device.type == "mps" else torch.float64).cumsum(dim=-1)  # (B, V)
    u = torch.rand(probs.size(0), 1, generator=generator, device=probs.device, dtype=cdf.dtype) * cdf[:, -1:]  # (B, 1)
    token = torch.searchsorted(cdf, u, right=True).squeeze(-1)  # (B,) the first index whose cdf exceeds u
    return token.clamp_(max=probs.size(-1) - 1)  # u rounded up onto the total: the last token (once in ~1e16 draws)


@torch.no_grad()
def generate(model: GPT, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, eos_id: int | None = None, pad_id: int = 0,
             use_cache: bool = True, generator: torch.Generator | None = None) -> Generation:
    """Complete a batch of token-id prompts. Runs in eval mode (dropout off) and restores the mode after.

    generator: a torch.Generator on the model's device, for repeatable sampling.
    """
    if temperature < 0:
        raise ValueError(f"generate: temperature must be ≥ 0, got {temperature}")
    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, pad_id)
    ids, mask = ids.to(device), mask.to(device)
    B, P = ids.shape
    limit = model.config.context_length
    if P > limit:
        raise ValueError(f"generate: a prompt of {P} tokens is longer than the model's context ({limit} tokens)")
    if P + max_new_tokens > limit:
        raise ValueError(f"generate: {P} prompt tokens + {max_new_tokens} new tokens exceed the context "
                         f"({limit} tokens); ask for at most {limit - P} new tokens")

    with eval_mode(model):
        # the whole output is allocated once and each step writes one column in place (no growing list, no cat)
        seq = torch.full((B, P + max_new_tokens), pad_id, dtype=torch.long, device=device)  # (B, P + N)
        seq_mask = torch.zeros((B, P + max_new_tokens), dtype=torch.long, device=device)  # (B, P + N)
        seq[:, :P], seq_mask[:, :P] = ids, mask
        cache = model.new_kv_cache(B, P + max_new_tokens) if use_cache else None
        all_real = bool(mask.all())  # no padding: the fast causal path needs no mask
        logits = model(ids, attention_mask=None if all_real else mask, kv_cache=cache)[:, -1]  # (B, V)
        finished = torch.zeros(B, dtype=torch.bool, device=device)
        end = P  # columns written so far
        for step in range(max_new_tokens):
            token = sample_next(logits, temperature, top_k, top_p, generator)  # (B,)
            token = token.masked_fill(finished, pad_id)
            seq[:, end], seq_mask[:, end] = token, (~finished).long()
            end += 1
            if eos_id is not None:
                finished |= token == eos_id
            if step == max_new_tokens - 1 or bool(finished.all()):
                break
            if use_cache:  # feed only the new token; the cache holds everything before it
                full_mask = None if all_real and not bool(finished.any()) else seq_mask[:, :end]
                logits = model(token[:, None], attention_mask=full_mask, kv_cache=cache)[:, -1]
            else:  # the teaching version: re-run the whole sequence
                logits = model(seq[:, :end], attention_mask=seq_mask[:, :end])[:, -1]

    attention_mask = seq_mask[:, :end].clone()  # (B, P + n): n ≤ N when every row ended early
    completion_mask = attention_mask.clone()
    completion_mask[:, :P] = 0
    return Generation(seq[:, :end].clone(), attention_mask, completion_mask, P)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(targets) under logits: (B, T, V), (B, T) -> (B, T), computed in float32 as z_y - logsumexp(z)."""
    logits = logits.float()
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def sequence_logprobs(model: GPT, ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                      temperature: float = 1.0) -> torch.Tensor:
    """Per-token log-probs of the given rows, differentiable: ids, attention_mask (B, T) -> (B, T-1).

    Column t is log p(ids[:, t+1] | ids[:, ≤t]) under the model's logits divided by `temperature` (use the
    temperature the tokens were sampled with, or the log-probs belong to another distribution). Columns
    whose target is padding, or is a row's first real token (it has no prefix), are 0. Runs in the model's current
    mode: call it under eval_mode (or with dropout 0) when the values must not be noisy, as in every RL step."""
    if temperature <= 0:
        raise ValueError(f"sequence_logprobs: temperature must be > 0, got {temperature}")
    all_real = attention_mask is None or bool(attention_mask.all())
    # the logits predict tokens 1..T-1
    logits = model(ids, attention_mask=None if all_real else attention_mask)[:, :-1]  # (B, T-1, V)
    logp = token_logprobs(logits.float() / temperature, ids[:, 1:])  # (B, T-1)
    if attention_mask is not None:  # a log-prob needs a real target and a real token before it (a row's first has none)
        logp = logp * (attention_mask[:, 1:] * attention_mask[:, :-1]).to(logp.dtype)
    return logp
