"""How noisy is each policy-gradient estimator? Measured on the SFT model, in one run.

For a fixed policy (the chapter-5 SFT model) and a fixed batch of word-problem prompts, draw `--batches`
independent rollout batches (k samples per prompt, gold reward: the final number is right). For each batch
and each estimator, compute the gradient of its surrogate loss on the SAME samples, so the estimators differ
only in their advantages:

    reinforce            A = R
    reinforce-baseline   A = R − b, b = the mean reward of the batches drawn before (a moving average)
    rloo                 A = R − mean of the prompt's other k − 1 rewards
    grpo                 A = (R − group mean) / group std

and report, over the batches, the total variance of the gradient estimate (the trace of its covariance: the
summed variance of every parameter's gradient) and the variance of its projection on the mean gradient of
all estimators (the direction that matters), each as a ratio to REINFORCE without a baseline. All four use
the per-sequence sum of log-probs ("sum"), so only the advantages differ. Word-problem rewards are 0 or 1,
so a batch of groups that are all right or all wrong carries no signal for RLOO and GRPO at all.

    python benchmarks/bench_pg_variance.py                # 30 batches of 8 prompts x 8 samples
    python benchmarks/bench_pg_variance.py --batches 60
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llm_from_scratch import tinyworld  # noqa: E402
from llm_from_scratch.checkpoint import prerequisite, read_jsonl  # noqa: E402
from llm_from_scratch.data import tinyworld_dir  # noqa: E402
from llm_from_scratch.generation import sequence_logprobs  # noqa: E402
from llm_from_scratch.model import eval_mode  # noqa: E402
from llm_from_scratch.policy_gradient import grpo_advantages, policy_gradient_loss, rloo_advantages, rollout  # noqa: E402
from llm_from_scratch.tokenizer import Tokenizer  # noqa: E402
from llm_from_scratch.train import load_gpt  # noqa: E402

ESTIMATORS = ("reinforce", "reinforce-baseline", "rloo", "grpo")


def flat_grad(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=30, help="independent rollout batches (default 30)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per batch (default 8)")
    ap.add_argument("--k", type=int, default=8, help="samples per prompt (default 8)")
    ap.add_argument("--quick", action="store_true", help="a smoke run on the quick runs")
    args = ap.parse_args()
    if args.quick:
        args.batches, args.prompts, args.k = 3, 2, 4
    torch.manual_seed(0)
    sft = prerequisite("sft", args.quick)
    tok = Tokenizer.load(sft)
    policy = load_gpt(sft, vocab_size=tok.vocab_size, dropout=0.0)
    paths = tinyworld.ensure_datasets(tinyworld_dir(args.quick), seed=0, **(tinyworld.QUICK_SIZES if args.quick else {}))
    rows = [p for p in read_jsonl(paths["rl_verifiable"]) if p["task"] == "word_problem"][: args.prompts]
    by_prompt = {p["prompt"]: p for p in rows}

    def gold(prompts, completions):
        return [tinyworld.gold_reward(by_prompt[p], c) for p, c in zip(prompts, completions)]

    grads = {name: [] for name in ESTIMATORS}
    past_means, zero_std, t0 = [], 0, time.perf_counter()
    generator = torch.Generator().manual_seed(0)
    for b in range(args.batches):
        ro = rollout(policy, policy, tok, [p["prompt"] for p in rows], args.k, gold, max_new_tokens=128,
                     generator=generator)
        zero_std += int((ro.rewards.view(-1, args.k).std(dim=1) == 0).sum())
        baseline = sum(past_means) / len(past_means) if past_means else 0.0  # the moving average, before this batch
        advantages = {"reinforce": ro.rewards, "reinforce-baseline": ro.rewards - baseline,
                      "rloo": rloo_advantages(ro.rewards, args.k), "grpo": grpo_advantages(ro.rewards, args.k)}
        past_means.append(ro.rewards.mean().item())
        for name in ESTIMATORS:
            policy.zero_grad(set_to_none=True)
            with eval_mode(policy):
                logp = sequence_logprobs(policy, ro.sequences, ro.attention_mask) * ro.mask
                policy_gradient_loss(logp, advantages[name], ro.mask, "sum").backward()
            grads[name].append(flat_grad(policy).clone())
        print(f"batch {b + 1}/{args.batches}: mean reward {past_means[-1]:.3f}", flush=True)

    stacked = {name: torch.stack(g) for name, g in grads.items()}  # (batches, params) each
    direction = torch.stack([g.mean(0) for g in stacked.values()]).mean(0)
    direction = direction / direction.norm()
    print(f"\n{args.batches} rollout batches of {args.prompts} prompts x {args.k} samples in "
          f"{time.perf_counter() - t0:.0f} s; mean reward {sum(past_means) / len(past_means):.3f}; "
          f"{zero_std / (args.batches * args.prompts):.0%} of the groups had one reward for all samples")
    print(f"{'estimator':20s} {'total variance':>16s} {'vs reinforce':>12s} {'variance along the mean':>24s} {'vs reinforce':>12s}")
    ref_total = ref_proj = None
    for name, g in stacked.items():
        total = g.var(dim=0).sum().item()
        proj = (g @ direction).var().item()
        ref_total, ref_proj = ref_total or total, ref_proj or proj
        print(f"{name:20s} {total:16.4g} {total / ref_total:11.2f}x {proj:24.4g} {proj / ref_proj:11.2f}x")


if __name__ == "__main__":
    main()
