"""One evaluation (chapter 5 on; chapters 7–10 and the arena call it): how good a policy's answers are, and whether
a change between two checkpoints is real.

**Sampled** (`sampled_eval`): n samples y_ij of each distinct held-out prompt x_i (i = 1..P, j = 1..n) at temperature
T, drawn with the same random numbers at every call (a generator seeded 10_000 + seed), so two checkpoints meet the
same draws. It reports the mean gold reward ḡ = 1/(Pn) Σ_ij g_ij with std(g) / √(Pn) as its standard error, the
proxy's mean (a reward model; gold when there is none), and the KL to the reference per completion from these very
samples, with d_t = log π(y_t | x, y_<t) − log π_ref(y_t | x, y_<t) at temperature T:

    k1 = Σ_t d_t                       unbiased for KL(π‖π_ref), a single completion's can be < 0
    k3 = Σ_t (exp(−d_t) − 1 + d_t)     also unbiased, never < 0

**Greedy** (`greedy_eval`): one greedy answer to each held-out example, its gold reward g_i (1/0 for the verifiable
tasks, so the mean is the accuracy; the story score for stories), the share that ended with EOS, the proxy's mean.

**Paired gain** (`paired_gain`): two checkpoints a (after) and b (before) scored on the same draws. The prompt is the
unit, since the n samples of one prompt are correlated:

    Δ_i = 1/n Σ_j (a_ij − b_ij)        gain = 1/P Σ_i Δ_i        s.e. = s / √P,  s² = 1/(P − 1) Σ_i (Δ_i − gain)²

(the sample standard deviation over prompts, ddof = 1; with one prompt the s.e. is nan).

**McNemar's exact test** (`mcnemar_exact`): two checkpoints right or wrong on the same problems. Only the discordant
problems speak: b = right before and wrong after, c = wrong before and right after. If nothing changed, each of the
b + c goes either way with probability 1/2, so b ~ Binomial(b + c, 1/2), and the exact two-sided p-value is

    p = min(1, 2 · Σ_{i ≤ min(b, c)} C(b + c, i) / 2^(b + c))            (p = 1 when b + c = 0)

**One schema** (`eval_record`) for metrics.jsonl: `eval/sampled/{gold, gold_se, proxy, kl, kl_k3, length}`,
`eval/greedy/{accuracy | gold, proxy, ended}` (accuracy for verifiable tasks, gold for stories; word problems also
`eval/greedy/errors/{slip, strategy, events, malformed}`); `val/` is left to
validation losses and `value/` to the critic.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from llm_from_scratch.generation import generate, sequence_logprobs
from llm_from_scratch.gold_rewards import gold_reward
from llm_from_scratch.model import GPT, eval_mode
from llm_from_scratch.sft import answer
from llm_from_scratch.tasks import WP_ERROR_CLASSES, classify_word_problem
from llm_from_scratch.tokenizer import Tokenizer, encode_chat

ScoreFn = Callable[[list[str], list[str]], "torch.Tensor | list[float]"]  # (prompts, completions) -> (N,) scores


# the per-token KL estimators, written here as well as in policy_gradient.py (kl_k1, kl_k3: chapter 7, which this
# chapter-5 module may not import); d = log π − log π_ref, both (B, T-1)
def _k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp


def _k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    d = logp - ref_logp
    return torch.expm1(-d) + d


# ----------------------------------------------------------------------------- sampled


@torch.no_grad()
def sampled_eval(policy: GPT, reference: GPT, tok: Tokenizer, examples: list[dict], n: int, temperature: float,
                 max_new_tokens: int, proxy_fn: ScoreFn | None, seed: int) -> dict:
    """The held-out evaluation of chapters 7–10: n samples of every distinct held-out prompt at `temperature`, drawn
    with the same random numbers at every call (so two checkpoints are compared on the same draws). Returns their
    mean gold reward (gold_rewards.gold_reward) with its standard error, the proxy's mean (proxy_fn; gold when None,
    and then has_proxy is False), the KL to the reference per completion (k1 and k3, from these samples), the mean
    completion length in tokens (EOS included), and every completion (sample j of prompt i at [i * n + j], as in
    gold_each and proxy_each). Both models run with dropout off."""
    if temperature <= 0:
        raise ValueError(f"sampled_eval: the samples need a temperature > 0, got {temperature}")
    by_prompt = {e["prompt"]: e for e in examples}
    prompts = [p for p in by_prompt for _ in range(n)]  # (B = P * n,) sample j of prompt i at i * n + j
    rows = [encode_chat(tok, p)[0] for p in prompts]
    generator = torch.Generator(device=next(policy.parameters()).device).manual_seed(10_000 + seed)
    gen = generate(policy, rows, max_new_tokens, temperature=temperature, eos_id=tok.eos_id, pad_id=tok.pad_id,
                   generator=generator)
    mask = gen.completion_mask[:, 1:]  # (B, T-1): column t scores token t+1, 1 on the completion (EOS included)
    with eval_mode(reference):
        ref_logp = sequence_logprobs(reference, gen.sequences, gen.attention_mask, temperature) * mask  # (B, T-1)
    with eval_mode(policy):
        logp = sequence_logprobs(policy, gen.sequences, gen.attention_mask, temperature) * mask  # (B, T-1)
    m = mask.to(logp.dtype)
    kl1, kl3 = (_k1(logp, ref_logp) * m).sum(1), (_k3(logp, ref_logp) * m).sum(1)  # (B,) per completion

    device = gen.sequences.device
    tokens = gen.completions()
    ended = [bool(c) and c[-1] == tok.eos_id for c in tokens]
    texts = [tok.decode(c[:-1] if e else c) for c, e in zip(tokens, ended)]
    gold = torch.as_tensor([gold_reward(by_prompt[p], c) for p, c in zip(prompts, texts)],
                           dtype=torch.float32).to(device)  # (B,)
    proxy = gold.clone() if proxy_fn is None else \
        torch.as_tensor(proxy_fn(prompts, texts), dtype=torch.float32).flatten().to(device)  # (B,)
    return {"gold": gold.mean().item(), "gold_se": (gold.std() / math.sqrt(gold.numel())).item(),
            "proxy": proxy.mean().item(), "has_proxy": proxy_fn is not None,
            "kl": kl1.mean().item(), "kl_k3": kl3.mean().item(), "n": gold.numel(),
            "length": mask.sum(1).float().mean().item(),
            "gold_each": gold.tolist(), "proxy_each": proxy.tolist(), "completions": texts,
            "samples": [{"prompt": p, "response": c, "gold": g} for p, c, g in
                        zip(prompts[::n][:6], texts[::n][:6], gold[::n][:6].tolist())]}


# ----------------------------------------------------------------------------- greedy


@torch.no_grad()
def greedy_eval(policy: GPT, tok: Tokenizer, examples: list[dict], proxy_fn: ScoreFn | None = None,
                max_new_tokens: int = 160) -> dict:
    """Greedy answers to held-out examples: the gold reward's mean (the accuracy when every example is a verifiable
    task: then verifiable is True), the share that ended with EOS, the proxy's mean when proxy_fn is given, every
    example's gold in order (gold_each, for paired tests), the first 6 answers, and when every example is a word
    problem the share of the answers that are each kind of error ("errors": slip, strategy, events, malformed)."""
    if not examples:
        raise ValueError("greedy_eval: no held-out examples to answer")
    prompts = [e["prompt"] for e in examples]
    answers = answer(policy, tok, prompts, max_new_tokens)
    gold = [gold_reward(e, text) for e, (text, _) in zip(examples, answers)]
    result = {"gold": sum(gold) / len(gold), "n": len(gold), "ended": sum(e for _, e in answers) / len(answers),
              "verifiable": all(e["task"] != "story" for e in examples), "gold_each": gold}
    if proxy_fn is not None:
        result["proxy"] = float(torch.as_tensor(proxy_fn(prompts, [t for t, _ in answers])).mean())
    if all(e["task"] == "word_problem" for e in examples):  # what kind of mistake each wrong answer is
        kinds = [classify_word_problem(e["prompt"], t) for e, (t, _) in zip(examples, answers)]
        result["errors"] = {kind: kinds.count(kind) / len(kinds) for kind in WP_ERROR_CLASSES if kind != "right"}
    result["samples"] = [{"prompt": e["prompt"], "response": t, "gold": g}
                         for e, (t, _), g in zip(examples[:6], answers, gold)]
    return result


# ----------------------------------------------------------------------------- is the change real?


def paired_gain(after_each: Sequence[float], before_each: Sequence[float], n_per_prompt: int) -> tuple[float, float]:
    """The mean gain a − b of two checkpoints scored on the same draws (n_per_prompt consecutive samples per prompt,
    as sampled_eval orders gold_each), and its standard error over prompts: each prompt's mean difference first,
    then their sample standard deviation (ddof 1) / √prompts. The s.e. is nan for a single prompt."""
    a = torch.as_tensor(after_each, dtype=torch.float64)
    b = torch.as_tensor(before_each, dtype=torch.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired_gain: {a.numel()} scores after but {b.numel()} before; they must be the same draws")
    if n_per_prompt < 1 or a.numel() == 0 or a.numel() % n_per_prompt:
        raise ValueError(f"paired_gain: {a.numel()} scores do not split into prompts of {n_per_prompt} samples")
    per_prompt = (a - b).view(-1, n_per_prompt).mean(dim=1)  # (P,) each prompt's mean difference
    if per_prompt.numel() < 2:
        return per_prompt.mean().item(), float("nan")
    return per_prompt.mean().item(), (per_prompt.std() / math.sqrt(per_prompt.numel())).item()


def mcnemar_exact(before_correct: Sequence, after_correct: Sequence) -> dict:
    """McNemar's exact test of two checkpoints' right (1) / wrong (0) answers to the same problems, in the same order:
    b (right before, wrong after), c (wrong before, right after), and the exact two-sided p-value of "nothing changed",
    min(1, 2 · P[X ≤ min(b, c)]) for X ~ Binomial(b + c, 1/2); 1 when no answer changed."""
    if len(before_correct) != len(after_correct):
        raise ValueError(f"mcnemar_exact: {len(before_correct)} answers before but {len(after_correct)} after")
    before, after = [float(x) for x in before_correct], [float(x) for x in after_correct]
    if any(x not in (0.0, 1.0) for x in before + after):
        raise ValueError("mcnemar_exact: every answer must be right (1) or wrong (0); a graded score is not a count")
    b = sum(1 for x, y in zip(before, after) if x == 1.0 and y == 0.0)
    c = sum(1 for x, y in zip(before, after) if x == 0.0 and y == 1.0)
    m = b + c
    tail = sum(math.comb(m, i) for i in range(min(b, c) + 1))  # 2^m · P[X ≤ min(b, c)], exactly, in integers
    return {"b": b, "c": c, "p_value": 1.0 if m == 0 else min(1.0, 2 * tail / 2 ** m)}


# ----------------------------------------------------------------------------- one schema

SAMPLED_KEYS = ("gold", "gold_se", "proxy", "kl", "kl_k3", "length")
GREEDY_KEYS = ("gold", "proxy", "ended")


def eval_record(result: dict, prefix: str) -> dict[str, float]:
    """The metrics.jsonl keys of one evaluation. prefix "eval/sampled": a sampled_eval result -> eval/sampled/gold,
    gold_se, proxy (only when there was one), kl, kl_k3, length; prefix "eval/greedy": a greedy_eval result ->
    eval/greedy/accuracy (verifiable tasks) or eval/greedy/gold (stories), proxy (when scored), ended, and for word
    problems eval/greedy/errors/{slip, strategy, events, malformed} (shares of all the answers)."""
    if prefix == "eval/sampled":
        keys = [k for k in SAMPLED_KEYS if k in result and (k != "proxy" or result.get("has_proxy", True))]
        return {f"{prefix}/{k}": result[k] for k in keys}
    if prefix == "eval/greedy":
        name = {"gold": "accuracy" if result.get("verifiable") else "gold"}
        record = {f"{prefix}/{name.get(k, k)}": result[k] for k in GREEDY_KEYS if k in result}
        record.update({f"{prefix}/errors/{kind}": share for kind, share in result.get("errors", {}).items()})
        return record
    raise ValueError(f"eval_record: prefix must be 'eval/sampled' or 'eval/greedy', got {prefix!r}")
