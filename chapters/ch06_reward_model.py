"""Chapter 6: a reward model trained on preference pairs with the Bradley–Terry loss.

Starts from the SFT model (runs/sft/, chapter 5): its trunk plus a fresh scalar head. Trains on the
tiny world's story preference pairs, whose labels were drawn from a hidden gold reward through
Bradley–Terry noise, so the best accuracy any reward model can reach (the Bayes ceiling) is known.
Then shifts the head's bias so SFT samples score 0 on average, and compares the reward model with the
gold reward on fresh SFT samples: correlation, and the cases where they disagree (what a policy
optimised against this reward model will exploit). Writes runs/reward_model/: the model, the tokenizer,
metrics.jsonl, the figures, sft_samples.jsonl (every scored SFT sample), report.md and summary.json.

    python chapters/ch06_reward_model.py            # the default run: about 3 minutes on 2 CPU cores
    python chapters/ch06_reward_model.py --quick    # a smoke run (also LLMFS_QUICK=1)
    torchrun --standalone --nproc_per_node=2 chapters/ch06_reward_model.py   # 2 processes share each batch of pairs

Under torchrun --batch-size is the global batch (reward_model.train_reward_model shares it out); rank 0 alone
evaluates the trained model, samples, plots and writes.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.pyplot as plt
import torch

import cli  # chapters/cli.py: common flags, one-line errors (also puts the repository on sys.path)
import common  # chapters/common.py: --init from a Hugging Face GPT-2 folder
from llm_from_scratch import dataset_files, distributed, gold_rewards, preferences, tasks
from llm_from_scratch.checkpoint import atomic_write_text, read_jsonl
from llm_from_scratch.course import prerequisite, quick_mode, require_real, runs_root, start_run, write_summary
from llm_from_scratch.data import tinyworld_dir
from llm_from_scratch.device import seed_everything
from llm_from_scratch.plots import moving_average, save
from llm_from_scratch.reward_model import (
    RewardConfig,
    RewardModel,
    agreement_by_part,
    center_rewards,
    encode_pairs,
    gold_sign,
    load_preferences,
    pearson,
    ranking_scores,
    score_pairs,
    score_texts,
    spearman,
    train_reward_model,
)
from llm_from_scratch.sft import answer, response_logprobs
from llm_from_scratch.tokenizer import Tokenizer
from llm_from_scratch.train import load_gpt


def parse_args(argv=None):
    ap = cli.parser(__doc__)
    ap.add_argument("--init", type=Path,
                    help="SFT checkpoint to start from (default runs/sft); or a Hugging Face GPT-2 "
                         "folder (config.json + model.safetensors), imported once (appendix C)")
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    ap.add_argument("--batch-size", type=int, default=32, help="pairs per step (default 32)")
    ap.add_argument("--lr", type=cli.positive_float, default=1e-3, help="peak learning rate (default 1e-3)")
    ap.add_argument("--samples", type=int, default=500,
                    help="fresh SFT samples to centre the rewards and compare with gold (default 500)")
    cli.add_common_args(ap, "reward_model")
    cli.add_prerequisite_arg(ap)
    args = ap.parse_args(argv)
    args.quick = args.quick or quick_mode()
    if args.quick:
        args.steps, args.batch_size, args.samples = 20, 8, 24
    return args


def figures(out: Path, records: list, margins: torch.Tensor, gold: torch.Tensor, rm_scores, gold_scores,
            ceiling: float, gold_bt_loss: float):
    # 1. training curves, against what the gold reward itself scores on the held-out labels
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.5))
    tr = [(r["step"], r["loss/train"], r["rewards/accuracies"]) for r in records if "loss/train" in r]
    va = [(r["step"], r["loss/val"], r["val/accuracy"]) for r in records if "loss/val" in r]
    if tr:
        steps = [s for s, _, _ in tr]
        for a, ys in ((a1, [x for _, x, _ in tr]), (a2, [x for _, _, x in tr])):
            a.plot(steps, ys, alpha=0.25, linewidth=0.8, color="tab:blue", label="train batch")
            a.plot(steps, moving_average(ys, 20), color="tab:blue", label="train, mean of 20 batches")
    a1.plot([s for s, _, _ in va], [x for _, x, _ in va], marker="o", color="tab:orange", label="held out")
    a2.plot([s for s, _, _ in va], [x for _, _, x in va], marker="o", color="tab:orange", label="held out")
    a1.axhline(gold_bt_loss, linestyle="--", color="black", linewidth=1, label=f"gold reward's loss {gold_bt_loss:.3f}")
    a2.axhline(ceiling, linestyle="--", color="black", linewidth=1, label=f"Bayes ceiling {ceiling:.3f}")
    a1.set(xlabel="step", ylabel="Bradley–Terry loss (nats)")
    a2.set(xlabel="step", ylabel="pairwise accuracy")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    save(fig, out / "training.png")
    # 2. margins on held-out pairs, split by whether the (noisy) label agrees with the gold reward
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.hist(margins[gold > 0].numpy(), bins=40, alpha=0.6, label="label agrees with gold")
    ax.hist(margins[gold < 0].numpy(), bins=40, alpha=0.6, label="label went against gold (noise)")
    ax.axvline(0, color="black", linewidth=1)
    ax.set(xlabel="r(chosen) − r(rejected)", ylabel="pairs", title="Reward margins on held-out pairs")
    ax.legend()
    save(fig, out / "margins.png")
    # 3. calibration: predicted P(a ≻ b) = σ(r_a − r_b) against how often a was the chosen one (both orientations)
    p = torch.cat([torch.sigmoid(margins), torch.sigmoid(-margins)])
    y = torch.cat([torch.ones_like(margins), torch.zeros_like(margins)])
    bins = torch.linspace(0, 1, 11)
    which = torch.bucketize(p, bins[1:-1])
    xs, ys = [], []
    for b in range(10):
        sel = which == b
        if sel.sum() >= 5:
            xs.append(p[sel].mean().item())
            ys.append(y[sel].mean().item())
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    ax.plot([0, 1], [0, 1], "--", color="gray", label="perfect calibration")
    ax.plot(xs, ys, marker="o", label="reward model")
    ax.set(xlabel="predicted P(first preferred)", ylabel="observed frequency", title="Calibration on held-out pairs")
    ax.legend()
    save(fig, out / "calibration.png")
    # 4. reward model against gold on fresh SFT samples
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.scatter(gold_scores, rm_scores, s=8, alpha=0.5)
    at_one = sum(g == 1.0 for g in gold_scores) / len(gold_scores)
    ax.set(xlabel="gold reward (hidden preference)", ylabel="reward model score",
           title=f"RM vs gold on SFT samples ({at_one:.0%} at gold 1.0)")
    ax.grid(alpha=0.3)
    save(fig, out / "rm_vs_gold.png")


def main(argv=None) -> dict:
    args = parse_args(argv)
    root = runs_root(args.quick)
    out = args.out or root / "reward_model"
    device = distributed.setup(args.device)  # pick_device, and the process group under torchrun
    seed_everything(args.seed)
    with distributed.main_first():  # rank 0 builds a missing prerequisite and the datasets, the others find them
        init = common.init_folder(args.init, args.quick) if args.init else prerequisite("sft", args.quick,
                                                                                       build=not args.no_build)
        sizes = dataset_files.QUICK_SIZES if args.quick else {}
        paths = dataset_files.ensure_datasets(tinyworld_dir(args.quick), seed=0, **sizes)
    require_real(init, args.quick)
    tok = Tokenizer.load(init)
    sft = load_gpt(init, device=device, vocab_size=tok.vocab_size)
    rm = RewardModel(load_gpt(init, device=device, vocab_size=tok.vocab_size, dropout=0.0)).to(device)
    if distributed.is_main():
        start_run(out, fresh=("metrics.jsonl",))  # a reward-model run starts over: no summary, no old metrics
    distributed.barrier()

    train_rows = load_preferences(paths["preferences_train"])
    val_rows = load_preferences(paths["preferences_val"])
    ctx = rm.gpt.config.context_length
    train_pairs, val_pairs = encode_pairs(tok, train_rows, ctx), encode_pairs(tok, val_rows, ctx)
    if len(val_pairs) != len(val_rows):
        raise ValueError("some held-out pairs do not fit the context; "
                         "the comparison with the Bayes ceiling needs them all")
    ceiling, gold_bt_loss = preferences.bayes_accuracy(val_rows), preferences.gold_loss(val_rows)
    print(f"{len(train_pairs):,} training pairs, {len(val_pairs):,} held-out pairs; "
          f"Bayes ceiling of the held-out labels {ceiling:.3f}, "
          f"the gold reward's own loss on them {gold_bt_loss:.3f} nats"
          + (f"; {distributed.world_size()} processes" if distributed.world_size() > 1 else ""))

    cfg = RewardConfig(max_steps=args.steps, batch_size=args.batch_size, lr=args.lr, min_lr=args.lr / 10,
                       warmup_steps=max(1, args.steps // 20), eval_interval=max(10, args.steps // 3), seed=args.seed)
    best = train_reward_model(rm, train_pairs, val_pairs, cfg, tok.pad_id, out, quiet=args.quiet)
    if not distributed.is_main():  # rank 0 evaluates, samples and writes the rest; every rank returns its result
        return distributed.broadcast_object(None)
    rm = RewardModel.load(out, device=device, vocab_size=tok.vocab_size)
    c, r = score_pairs(rm, val_pairs, tok.pad_id)
    margins = c - r
    gold = gold_sign(val_rows)
    parts = [tuple(gold_rewards.story_reward_parts(p["spec"], p[k]) for k in ("chosen", "rejected")) for p in val_rows]
    accuracy, gold_agreement = ranking_scores(margins, gold)
    print(f"held-out accuracy {accuracy:.3f} (Bayes ceiling {ceiling:.3f}, gap {ceiling - accuracy:+.3f}); "
          f"agrees with the gold ranking on {gold_agreement:.3f} of the pairs gold does not tie")
    by_part = agreement_by_part(parts, margins, gold)
    print("pairs that differ in one part of the gold reward -> share the RM orders as gold does: " +
          ", ".join(f"{k} {v['agreement']:.2f} (n={v['n']})" for k, v in by_part.items()))

    # a baseline before any preference training: rank each pair by the SFT model's mean log-probability per response
    # token
    n = len(val_rows)
    sums, counts = response_logprobs(sft, tok, [p["prompt"] for p in val_rows] * 2,
                                     [p["chosen"] for p in val_rows] + [p["rejected"] for p in val_rows])
    per_token = sums / counts
    sft_margins = per_token[:n] - per_token[n:]
    base_accuracy, base_agreement = ranking_scores(sft_margins, gold)
    sft_baseline = {"accuracy": base_accuracy, "gold_agreement": base_agreement,
                    "by_part": agreement_by_part(parts, sft_margins, gold)}
    print(f"baseline with no preference training, the SFT model's log-likelihood per response token: accuracy "
          f"{sft_baseline['accuracy']:.3f}, gold agreement {sft_baseline['gold_agreement']:.3f}; by part " +
          ", ".join(f"{k} {v['agreement']:.2f}" for k, v in sft_baseline["by_part"].items()))

    # fresh SFT samples on story prompts: centre the rewards on them and compare with gold
    prompts = tasks.rl_prompts("stories", args.samples, seed=12345)
    g = torch.Generator(device=device).manual_seed(args.seed)
    responses = [text for text, _ in answer(sft, tok, [p["prompt"] for p in prompts], temperature=1.0, generator=g)]
    scores = score_texts(rm, tok, [p["prompt"] for p in prompts], responses)
    removed, spread = center_rewards(rm, scores)
    rm.save(out)
    tok.save(out)
    scores = scores - removed
    gold_scores = torch.tensor([gold_rewards.story_reward(p["spec"], resp) for p, resp in zip(prompts, responses)])
    corr, rank_corr = pearson(scores, gold_scores), spearman(scores, gold_scores)
    at_one = (gold_scores == 1.0).float().mean().item()  # most SFT stories are perfect: one big tie for the ranks
    print(f"bias shifted by {-removed:+.3f}: SFT samples now score 0 ± {spread:.3f}; "
          f"{at_one:.0%} of them score gold 1.0; "
          f"correlation with gold on them r = {corr:.3f} (Pearson), ρ = {rank_corr:.3f} (Spearman)")
    figures(out, read_jsonl(out / "metrics.jsonl"), margins, gold, scores.tolist(), gold_scores.tolist(),
            ceiling, gold_bt_loss)

    atomic_write_text(out / "sft_samples.jsonl", "".join(  # every scored sample, for a closer look (notebook 06)
        json.dumps({"prompt": p["prompt"], "response": resp, "rm": s, "gold": g}) + "\n"
        for p, resp, s, g in zip(prompts, responses, scores.tolist(), gold_scores.tolist())))

    # where the reward model and gold disagree most: the openings a policy will find
    z = lambda t: (t - t.mean()) / (t.std() + 1e-8)  # noqa: E731
    gap = z(scores) - z(gold_scores)
    worst = torch.argsort(gap, descending=True)[:5].tolist()
    disagreements = [{"prompt": prompts[i]["prompt"], "response": responses[i], "rm": scores[i].item(),
                      "gold": gold_scores[i].item()} for i in worst]
    result = {"accuracy": accuracy, "bayes_ceiling": ceiling, "gold_loss": gold_bt_loss,
              "gold_agreement": gold_agreement, "by_part": by_part, "sft_gold_at_one": at_one,
              "sft_loglik_baseline": sft_baseline, "best": best,
              "bias_shift": -removed, "sft_reward_std": spread, "rm_gold_correlation": corr,
              "rm_gold_spearman": rank_corr,
              "disagreements": disagreements, "steps": args.steps, "batch_size": args.batch_size,
              "train_pairs": len(train_pairs), "seconds": best["seconds"], "seed": args.seed, "device": str(device),
              "precision": "float32", "processes": distributed.world_size()}
    lines = ["## Chapter 6: the reward model", "",
             f"- held-out pairwise accuracy **{accuracy:.3f}**; Bayes ceiling of the noisy labels {ceiling:.3f}",
             f"- {args.steps} steps in {best['seconds'] / 60:.1f} min on {device}",
             f"- SFT samples: rewards centred (bias {-removed:+.3f}), std {spread:.3f}; {at_one:.0%} at gold 1.0; "
             f"correlation with gold r = {corr:.3f} (Pearson), ρ = {rank_corr:.3f} (Spearman)", "",
             "![training](reward_model/training.png) ![margins](reward_model/margins.png)",
             "![calibration](reward_model/calibration.png) ![rm vs gold](reward_model/rm_vs_gold.png)", "",
             "Held-out pairs that differ in one part of the gold reward: how often the RM orders them as gold does, "
             "and how",
             "often a baseline with no preference training does: the SFT model's log-likelihood per response token",
             f"(on all pairs: accuracy {sft_baseline['accuracy']:.3f}, "
             f"gold agreement {sft_baseline['gold_agreement']:.3f}; "
             f"the reward model's: {accuracy:.3f}, {gold_agreement:.3f})", "",
             "| part | reward model | SFT log-likelihood | pairs |", "|---|---:|---:|---:|",
             *[f"| {k} | {v['agreement']:.2f} | {sft_baseline['by_part'][k]['agreement']:.2f} | {v['n']} |"
               for k, v in by_part.items()], "",
             "Where the reward model likes a response much more than gold does:", "",
             "| RM | gold | prompt | response |", "|---:|---:|---|---|"]
    lines += [f"| {d['rm']:+.2f} | {d['gold']:.2f} | {d['prompt']} | {d['response'][:150]} |" for d in disagreements]
    atomic_write_text(out / "report.md", "\n".join(lines) + "\n")
    write_summary(out, result, args.quick)  # last: marks the run finished
    return distributed.broadcast_object(result)


if __name__ == "__main__":
    cli.run(main)
