"""How noisy is each policy-gradient estimator? Measured on the SFT model, in one run.

For a fixed policy (the chapter-5 SFT model) and a fixed batch of prompts, draw `--batches` independent
rollout batches (k samples per prompt at --temperature) and score them: word problems with the gold reward
(1 when the final number is right), stories with the chapter-6 reward model. For each batch
and each estimator, compute the gradient of its surrogate loss on the SAME samples, so the estimators differ
only in their advantages:

    reinforce            A = R
    reinforce-baseline   A = R − b, b = the mean reward of the batches drawn before (a moving average)
    rloo                 A = R − mean of the prompt's other k − 1 rewards
    grpo                 A = (R − group mean) / group std

and report, over the batches, the total variance of the gradient estimate (the trace of its covariance: the
summed variance of every parameter's gradient), the variance of its projection on the mean gradient of all
estimators (the direction that matters), each as a ratio to REINFORCE without a baseline, and the
noise-to-signal ratio trace(Cov) / |mean gradient|^2, which does not depend on the advantages' scale (GRPO
divides by the group's std, so its raw variance is not comparable). All four use the per-sequence sum of
log-probs ("sum"), so only the advantages differ. Word-problem rewards are 0 or 1, so a group that is all
right or all wrong carries no signal for RLOO and GRPO at all. The numbers go to runs/bench_pg_variance/<task>.json
(notebook 07 draws them).

    python benchmarks/bench_pg_variance.py                        # word problems: 30 batches of 8 prompts x 8 samples
    python benchmarks/bench_pg_variance.py --task stories         # against the reward model
    python benchmarks/bench_pg_variance.py --batches 60
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llm_from_scratch import dataset_files, gold_rewards  # noqa: E402
from llm_from_scratch.checkpoint import atomic_write_text, read_jsonl
from llm_from_scratch.course import prerequisite, runs_root, shown  # noqa: E402
from llm_from_scratch.data import tinyworld_dir  # noqa: E402
from llm_from_scratch.generation import sequence_logprobs  # noqa: E402
from llm_from_scratch.model import eval_mode  # noqa: E402
from llm_from_scratch.policy_gradient import grpo_advantages, policy_gradient_loss, rloo_advantages, rollout  # noqa: E402
from llm_from_scratch.reward_model import RewardModel, reward_fn  # noqa: E402
from llm_from_scratch.tokenizer import Tokenizer  # noqa: E402
from llm_from_scratch.train import load_gpt  # noqa: E402

ESTIMATORS = ("reinforce", "reinforce-baseline", "rloo", "grpo")


def flat_grad(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def sample_grad_norms(policy, ro) -> list[tuple[float, float]]:
    """(reward, |∇ Σ_t log π(y_t)|^2) of every sample of a rollout, each sample on its own (no padding)."""
    out = []
    for i in range(ro.sequences.size(0)):
        keep = ro.attention_mask[i].bool()
        ids = ro.sequences[i][keep][None]  # (1, T_i) the row without its padding
        mask = ro.mask[i][keep[1:] & keep[:-1]][None]  # (1, T_i - 1): the columns whose target and prefix are real
        policy.zero_grad(set_to_none=True)
        with eval_mode(policy):
            (sequence_logprobs(policy, ids, temperature=ro.temperature) * mask).sum().backward()
        out.append((ro.rewards[i].item(), flat_grad(policy).pow(2).sum().item()))
    policy.zero_grad(set_to_none=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=30, help="independent rollout batches (default 30)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per batch (default 8)")
    ap.add_argument("--k", type=int, default=8, help="samples per prompt (default 8)")
    ap.add_argument("--task", default="word-problems", choices=["word-problems", "stories"],
                    help="word problems with the gold reward, or stories with the reward model (default word-problems)")
    ap.add_argument("--reward", choices=["gold", "rm"], help="stories: score with the reward model (default) or the "
                    "gold story reward, a score in [0, 1] that sits near 1 (word problems: always gold)")
    ap.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default 0.7, chapter 7's)")
    ap.add_argument("--norm-batches", type=int, default=3,
                    help="batches whose samples also get their own gradient norm |∇ log π(y)|^2, to compare right and "
                         "wrong samples and find the best constant baseline (default 3)")
    ap.add_argument("--quick", action="store_true", help="a smoke run on the quick runs")
    args = ap.parse_args()
    if args.quick:
        args.batches, args.prompts, args.k, args.norm_batches = 3, 2, 4, 1
    args.reward = "gold" if args.task == "word-problems" else (args.reward or "rm")
    torch.manual_seed(0)
    sft = prerequisite("sft", args.quick)
    tok = Tokenizer.load(sft)
    policy = load_gpt(sft, vocab_size=tok.vocab_size, dropout=0.0)
    sizes = dataset_files.QUICK_SIZES if args.quick else {}
    paths = dataset_files.ensure_datasets(tinyworld_dir(args.quick), seed=0, **sizes)
    kind, task = ("verifiable", "word_problem") if args.task == "word-problems" else ("stories", "story")
    max_new = 144 if args.task == "word-problems" else 128  # as chapter 7: a word problem restates each event
    rows = [p for p in read_jsonl(paths[f"rl_{kind}"]) if p["task"] == task][: args.prompts]
    by_prompt = {p["prompt"]: p for p in rows}

    def gold(prompts, completions):
        return [gold_rewards.gold_reward(by_prompt[p], c) for p, c in zip(prompts, completions)]

    score = gold
    if args.reward == "rm":
        rm = RewardModel.load(prerequisite("reward_model", args.quick), vocab_size=tok.vocab_size).requires_grad_(False)
        score = reward_fn(rm, tok)

    grads, norms = {name: [] for name in ESTIMATORS}, []  # norms: (reward, |∇ log π(y)|^2) per sample
    past_means, zero_std, t0 = [], 0, time.perf_counter()
    generator = torch.Generator().manual_seed(0)
    for b in range(args.batches):
        ro = rollout(policy, policy, tok, [p["prompt"] for p in rows], args.k, score, max_new_tokens=max_new,
                     temperature=args.temperature, generator=generator)
        zero_std += int((ro.rewards.view(-1, args.k).std(dim=1) == 0).sum())
        baseline = sum(past_means) / len(past_means) if past_means else 0.0  # the moving average, before this batch
        advantages = {"reinforce": ro.rewards, "reinforce-baseline": ro.rewards - baseline,
                      "rloo": rloo_advantages(ro.rewards, args.k), "grpo": grpo_advantages(ro.rewards, args.k)}
        past_means.append(ro.rewards.mean().item())
        for name in ESTIMATORS:
            policy.zero_grad(set_to_none=True)
            with eval_mode(policy):
                logp = sequence_logprobs(policy, ro.sequences, ro.attention_mask, ro.temperature) * ro.mask
                policy_gradient_loss(logp, advantages[name], ro.mask, "sum").backward()
            grads[name].append(flat_grad(policy).clone())
        if b < args.norm_batches:
            norms += sample_grad_norms(policy, ro)
        print(f"batch {b + 1}/{args.batches}: mean reward {past_means[-1]:.3f}", flush=True)

    stacked = {name: torch.stack(g) for name, g in grads.items()}  # (batches, params) each
    direction = torch.stack([g.mean(0) for g in stacked.values()]).mean(0)
    direction = direction / direction.norm()
    seconds, mean_reward = time.perf_counter() - t0, sum(past_means) / len(past_means)
    zero_share = zero_std / (args.batches * args.prompts)
    print(f"\n{args.task}: {args.batches} rollout batches of {args.prompts} prompts x {args.k} samples at T = "
          f"{args.temperature} in {seconds:.0f} s; mean reward {mean_reward:.3f}; {zero_share:.0%} of the groups "
          f"had one reward for all samples")
    print(f"{'estimator':20s} {'total variance':>15s} {'vs reinforce':>12s} {'along the mean':>15s} "
          f"{'vs reinforce':>12s} {'noise/signal':>13s}")
    ratio = lambda a, b: a / b if b > 0 else float("nan")  # noqa: E731  (a smoke run's rewards can all be 0)
    ref_total, ref_proj = stacked["reinforce"].var(dim=0).sum().item(), (stacked["reinforce"] @ direction).var().item()
    results = {}
    for name, g in stacked.items():
        total, proj = g.var(dim=0).sum().item(), (g @ direction).var().item()
        noise = ratio(total, g.mean(0).pow(2).sum().item())  # trace(Cov) / |E g|^2: free of the advantages' scale
        results[name] = {"total": total, "total_ratio": ratio(total, ref_total), "along_mean": proj,
                         "along_mean_ratio": ratio(proj, ref_proj), "noise_to_signal": noise}
        print(f"{name:20s} {total:15.4g} {ratio(total, ref_total):11.2f}x {proj:15.4g} {ratio(proj, ref_proj):11.2f}x "
              f"{noise:13.3g}")
    r, n2 = torch.tensor([x for x, _ in norms]), torch.tensor([y for _, y in norms])
    # argmin_b E[(R - b)^2 |g|^2]: the best constant baseline
    best_b = (r * n2).sum().item() / max(n2.sum().item(), 1e-30)
    binary = args.task == "word-problems"  # 0/1 rewards: right and wrong; otherwise the better and the worse half
    high = r > 0.5 if binary else r > r.median()
    by_reward = {"high": n2[high].mean().item() if high.any() else float("nan"),
                 "low": n2[~high].mean().item() if (~high).any() else float("nan")}
    split = "" if not 0 < int(high.sum()) < len(r) else (
        f"{by_reward['high']:.4g} for the {'right' if binary else 'better half'} ones, {by_reward['low']:.4g} for the "
        f"{'wrong' if binary else 'worse half'} ones; ")
    print(f"per-sample |∇ log π(y)|^2 over {len(norms)} samples: {split}the best constant baseline "
          f"E[R |g|^2] / E[|g|^2] = {best_b:.3f} (the mean reward is {r.mean().item():.3f})")
    name = (args.task if args.reward == ("gold" if args.task == "word-problems" else "rm")
            else f"{args.task}_{args.reward}")
    out = runs_root(args.quick) / "bench_pg_variance" / f"{name}.json"
    atomic_write_text(out, json.dumps({"task": args.task, "reward": args.reward, "batches": args.batches,
                                       "prompts": args.prompts, "k": args.k, "temperature": args.temperature,
                                       "seconds": seconds, "mean_reward": mean_reward, "zero_std_groups": zero_share,
                                       "estimators": results, "grad_norm2": {**by_reward, "samples": len(norms)},
                                       "best_constant_baseline": best_b}, indent=2))
    print(f"wrote {shown(out)}")


if __name__ == "__main__":
    main()
