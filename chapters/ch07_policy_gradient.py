"""Chapter 7: policy gradients (REINFORCE, RLOO, GRPO, Dr. GRPO) on the SFT model.

Each step samples --k completions for each of --prompts prompts with the policy (dropout off, --temperature 0.7),
scores them, and takes a policy-gradient step (llm_from_scratch/policy_gradient.py). The SFT model is both
the starting policy and the frozen reference of the KL penalty.

  --task word-problems   RL from verifiable rewards: the gold reward is 1 when the final number is right.
                         Held-out greedy accuracy on the SFT validation word problems, before, during, after.
  --task stories         RLHF: the reward is the chapter-6 reward model (--reward rm, the default here), and
                         the gold story reward, which the policy never sees, is logged beside it.

Writes runs/pg_<task>_<algo>/ (_<loss-type> and _filter or _nofilter appended where they differ from the task's
recipe): the policy
(model.safetensors, config.json, the tokenizer), metrics.jsonl (reward, gold/reward, proxy/reward, objective/kl
and kl_k3, objective/entropy, completions/*, and the step time split into generate, reference, reward (scoring)
and update; for stories the shares of samples without the asked name or object; at each evaluation eval/greedy/*
and, with --eval-samples, eval/sampled/*: llm_from_scratch/evaluation.py), rollout_samples.jsonl (at each
evaluation, the samples the trained reward liked best), eval.json (for word problems also the SFT model's pass@k
and McNemar's exact test of the greedy answers before and after), samples.md, curves.png, report.md and summary.json. An interrupted run resumes from its last evaluation
(--no-resume starts over).

--seeds N runs seeds 0..N-1, seed k from chapter 5's runs/sft_seeds/seed<k>, into runs/pg_<task>_<algo>_seeds/,
and prints the spread (min / median / max) of the held-out score and of its gain.

TRL's GRPO knobs, for any --algo: --loss-type grpo|dr_grpo|dapo sums the per-token loss per sequence (the mean over
each completion's tokens: favours short right answers and long wrong ones), per constant (Σ_t / --max-new-tokens)
or per token (Σ over the batch's tokens / their number); --loss-type own keeps each algorithm's own (GRPO grpo,
Dr. GRPO dr_grpo, REINFORCE and RLOO the sum over tokens). --filter-groups is DAPO's dynamic-sampling filter: the
prompts whose samples all got the same raw reward are left out of the update (the batch is not refilled);
metrics.jsonl logs frac_reward_zero_std, train/rows (the rows the update used) and train/skipped_step. Each task has
its recipe (TASK_DEFAULTS): word problems dapo with the filter at lr 5e-5, the best of the recipes measured; stories
the algorithm's own loss, no filter, lr 2e-5.

    python chapters/ch07_policy_gradient.py                         # RLOO on word problems
    python chapters/ch07_policy_gradient.py --algo grpo
    python chapters/ch07_policy_gradient.py --task stories --beta 0 # against the reward model, no KL
    python chapters/ch07_policy_gradient.py --loss-type own --no-filter-groups  # RLOO's own loss, no filter
    python chapters/ch07_policy_gradient.py --quick                 # a smoke run (also LLMFS_QUICK=1)
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import cli  # chapters/cli.py: common flags, one-line errors (also puts the repository on sys.path)
import matplotlib.pyplot as plt
import torch
from tqdm import tqdm

from llm_from_scratch import tinyworld
from llm_from_scratch.checkpoint import (
    append_metrics,
    atomic_write_text,
    load_state,
    load_train_state,
    read_jsonl,
    save_train_state,
)
from llm_from_scratch.course import (
    PrerequisiteError,
    finished_run,
    prerequisite,
    quick_mode,
    require_real,
    runs_root,
    shown,
    start_run,
    write_summary,
)
from llm_from_scratch.data import tinyworld_dir
from llm_from_scratch.device import pick_device, seed_everything
from llm_from_scratch.plots import save
from llm_from_scratch.policy_gradient import LOSS_TYPES, normalisation  # --loss-type's choices and their meaning
from llm_from_scratch.evaluation import eval_record as schema_record
from llm_from_scratch.evaluation import greedy_eval, mcnemar_exact, sampled_eval
from llm_from_scratch.policy_gradient import ALGOS, MovingAverageBaseline, PGConfig, pass_at_k, pg_update, rollout
from llm_from_scratch.reward_model import RewardModel, reward_fn
from llm_from_scratch.sft import answer
from llm_from_scratch.tokenizer import Tokenizer
from llm_from_scratch.train import load_gpt, save_gpt

TASKS = {"word-problems": ("verifiable", "word_problem"), "stories": ("stories", "story")}
# Each task's recipe where the command line is silent. Word problems: RLOO with DAPO's token-level loss and its group
# filter at lr 5e-5 gained the most of the four recipes measured from the course's SFT model (README, chapter 7).
# Stories: the reward model's scores of a prompt's samples are never all equal, so the filter has nothing to do there,
# and the arena's story runs keep each estimator's own aggregation at lr 2e-5.
TASK_DEFAULTS = {"word-problems": {"lr": 5e-5, "loss_type": "dapo", "filter_groups": True},
                 "stories": {"lr": 2e-5, "loss_type": None, "filter_groups": False}}


def parse_args(argv=None):
    ap = cli.parser(__doc__)
    ap.add_argument("--algo", default="rloo", choices=ALGOS, help="the estimator (default rloo)")
    ap.add_argument("--task", default="word-problems", choices=sorted(TASKS), help="default word-problems")
    ap.add_argument("--reward", choices=["gold", "rm"],
                    help="what the policy is trained on: the gold reward or the chapter-6 reward model "
                         "(default: gold for word problems, rm for stories)")
    ap.add_argument("--init", type=Path, help="policy and reference to start from (default runs/sft)")
    ap.add_argument("--steps", type=int, default=100, help="policy-gradient steps (default 100)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step (default 8)")
    ap.add_argument("--k", type=int, default=8, help="samples per prompt (default 8)")
    ap.add_argument("--lr", type=float, help="AdamW learning rate (default 5e-5 for word problems, 2e-5 for stories)")
    ap.add_argument("--beta", type=float, default=0.02, help="KL coefficient (default 0.02; 0 = no KL penalty)")
    ap.add_argument("--kl-in", choices=["reward", "loss"],
                    help="where the KL goes: 'reward' (−β·Σ k1 per sequence) or 'loss' (β·k3 per token); "
                         "default: loss for GRPO and Dr. GRPO, reward otherwise")
    ap.add_argument("--inner-epochs", type=int, help="updates per rollout batch (default: 2 for GRPO, 1 otherwise)")
    ap.add_argument("--loss-type", choices=[*LOSS_TYPES, "own"],
                    help="how the per-token loss is summed into one (TRL's names), for any --algo: grpo = the mean "
                         "over each completion's own tokens, then over completions (short right answers and long "
                         "wrong ones are favoured: GRPO's length bias); dr_grpo = the sum over a completion's tokens "
                         "divided by --max-new-tokens, then the mean over completions; dapo = the sum over every token "
                         "of the batch divided by their number (dr_grpo and dapo weigh every token alike: no length "
                         "bias); own = the algorithm's own (grpo for GRPO, dr_grpo for Dr. GRPO, otherwise the sum "
                         "over a completion's tokens, then the mean over completions). Default: dapo for word "
                         "problems, own for stories")
    ap.add_argument("--filter-groups", action=argparse.BooleanOptionalAction,
                    help="DAPO's dynamic-sampling filter: leave out of the update the prompts whose --k samples all "
                         "got the same reward (the raw reward, before the KL term); they carry no signal for RLOO and "
                         "GRPO. The batch is not refilled with new samples; a step where every prompt is filtered "
                         "does no update. Default: on for word problems, off for stories")
    ap.add_argument("--temperature", type=float, default=0.7,
                    help="sampling temperature of the rollouts; log-probs and the KL use the same (default 0.7)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="completion length limit (default 128)")
    ap.add_argument("--missing-eos-penalty", type=float, default=0.0,
                    help="subtracted from the reward of a completion cut off without EOS (default 0)")
    ap.add_argument("--eval-interval", type=int, default=20, help="steps between held-out evaluations (default 20)")
    ap.add_argument("--eval-examples", type=int, default=1000,
                    help="held-out examples of the task to score (default 1000: all there are)")
    ap.add_argument("--pass-at-k", type=int, default=16, metavar="N",
                    help="word problems: before training, draw N samples per held-out problem from the SFT model (at "
                         "--temperature) for its pass@1..N, the ceiling that reweighting its own samples can approach "
                         "(default 16; 0 skips it)")
    ap.add_argument("--eval-samples", type=int, default=0, metavar="N",
                    help="stories: at every evaluation also draw N samples of each held-out prompt at --temperature "
                         "(the same draws every time) for the sampled gold ± s.e., the proxy and the KL to the SFT "
                         "model, as chapters 8-10 do (default 0: greedy stories only)")
    ap.add_argument("--no-resume", action="store_true", help="start over even if --out holds an interrupted run")
    ap.add_argument("--seeds", type=int, default=0, metavar="N",
                    help="run seeds 0..N-1, seed k from chapter 5's runs/sft_seeds/seed<k>, into "
                         "runs/pg_<task>_<algo>_seeds/, and print the spread")
    cli.add_common_args(ap, "pg_<task>_<algo>")
    cli.add_prerequisite_arg(ap)
    args = ap.parse_args(argv)
    args.quick = args.quick or quick_mode()
    args.reward = args.reward or ("gold" if args.task == "word-problems" else "rm")
    for name, value in TASK_DEFAULTS[args.task].items():  # the task's recipe where the command line is silent
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.loss_type = None if args.loss_type == "own" else args.loss_type
    grpo = args.algo in ("grpo", "dr-grpo")
    args.kl_in = args.kl_in or ("loss" if grpo else "reward")
    args.inner_epochs = args.inner_epochs or (2 if grpo else 1)
    if args.seeds < 0:
        ap.error("--seeds must be ≥ 0")
    if args.seeds and args.init:
        ap.error("--seeds starts seed k from runs/sft_seeds/seed<k> (chapter 5's sweep); leave out --init")
    if args.temperature <= 0:
        ap.error("--temperature must be > 0 (RL needs samples; greedy answers are for evaluation)")
    for flag in ("steps", "prompts", "k", "max_new_tokens", "eval_interval", "inner_epochs"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be ≥ 1")
    if args.eval_samples < 0:
        ap.error("--eval-samples must be ≥ 0")
    if args.k < 2 and args.algo != "reinforce":
        ap.error(f"--algo {args.algo} compares samples of one prompt: --k must be ≥ 2")
    if args.k < 2 and args.filter_groups:
        ap.error("--filter-groups (on by default for word problems) compares the samples of one prompt: --k must be "
                 "≥ 2, or add --no-filter-groups")
    if args.quick:
        args.steps, args.prompts, args.k, args.max_new_tokens = 4, 2, 4, 24
        args.eval_interval, args.eval_examples, args.pass_at_k = 2, 8, min(args.pass_at_k, 2)
    return args


def task_data(name: str, quick: bool, eval_examples: int):
    """A task's RL training prompts, its held-out examples (chapter 5's validation set), the prompts by their text,
    and the gold reward of (prompts, completions) as a reward callable."""
    kind, task = TASKS[name]
    sizes = tinyworld.QUICK_SIZES if quick else {}
    paths = tinyworld.ensure_datasets(tinyworld_dir(quick), seed=0, **sizes)
    train_prompts = [p for p in read_jsonl(paths[f"rl_{kind}"]) if p["task"] == task]
    held_out = [e for e in read_jsonl(paths["sft_val"]) if e["task"] == task][:eval_examples]
    by_prompt = {p["prompt"]: p for p in train_prompts}

    def gold_fn(prompts, completions):
        return [tinyworld.gold_reward(by_prompt[p], c) for p, c in zip(prompts, completions)]

    return train_prompts, held_out, by_prompt, gold_fn


def sft_seed_sweep(root: Path, seeds: int) -> Path:
    """Chapter 5's seed sweep, runs/sft_seeds/, where seed k of an RL sweep starts; an error naming the command
    that makes it when a seed is missing."""
    sft_sweep = root / "sft_seeds"
    missing = [k for k in range(seeds) if not finished_run(sft_sweep / f"seed{k}")]
    if missing:
        raise PrerequisiteError(f"--seeds {seeds} starts seed k from {shown(sft_sweep)}/seed<k>, and seeds {missing} "
                                f"are not there: run `python chapters/ch05_sft.py --seeds {seeds}` first")
    return sft_sweep


def evaluate(policy, tok, examples: list[dict], proxy_fn=None) -> dict:
    """Greedy answers to held-out prompts (evaluation.greedy_eval): the gold reward's mean (accuracy for word
    problems), each example's gold (for McNemar's test), the share that ended with EOS, and the trained reward's mean
    when it is not gold (the reward model, for stories)."""
    return greedy_eval(policy, tok, examples, proxy_fn)


def evaluate_held_out(args, policy, reference, tok, examples: list[dict], proxy_fn, seed: int) -> dict:
    """`evaluate`'s greedy answers; for stories with --eval-samples N, also the sampled evaluation of chapters 8-10
    (evaluation.sampled_eval) under "sampled"."""
    result = evaluate(policy, tok, examples, proxy_fn)
    if args.task == "stories" and args.eval_samples:
        sampled = sampled_eval(policy, reference, tok, examples, args.eval_samples, args.temperature,
                               args.max_new_tokens, proxy_fn, seed)
        result["sampled"] = {k: sampled[k] for k in ("gold", "gold_se", "proxy", "has_proxy", "kl", "kl_k3", "n", "length")}
    return result


def eval_record(result: dict) -> dict:
    """The metrics.jsonl keys of one held-out evaluation, in the one schema (evaluation.eval_record):
    eval/greedy/accuracy (word problems) or eval/greedy/gold (stories), eval/greedy/proxy and ended; with
    --eval-samples also eval/sampled/gold, gold_se, proxy, kl, kl_k3, length."""
    record = schema_record(result, "eval/greedy")
    if "sampled" in result:
        record.update(schema_record(result["sampled"], "eval/sampled"))
    return record


def greedy_key(task: str) -> str:
    """The metrics.jsonl key of the greedy held-out score: the accuracy for word problems, the gold reward for stories."""
    return "eval/greedy/accuracy" if task == "word-problems" else "eval/greedy/gold"


def sampled_pass_at_k(policy, tok, examples: list[dict], n: int, temperature: float, seed: int) -> dict[int, float]:
    """pass@k for k = 1, 2, 4, .. n: n sampled answers to each held-out problem, each k scored without bias."""
    generator = torch.Generator(device=next(policy.parameters()).device).manual_seed(seed)
    answers = answer(policy, tok, [e["prompt"] for e in examples for _ in range(n)], temperature=temperature,
                     generator=generator)
    right = [sum(tinyworld.gold_reward(e, answers[i * n + j][0]) for j in range(n)) for i, e in enumerate(examples)]
    ks = [k for k in (1, 2, 4, 8, 16, 32, 64) if k <= n]
    return {k: sum(pass_at_k(n, int(c), k) for c in right) / len(examples) for k in ks}


def story_parts(specs: list[dict], completions: list[str]) -> dict[str, float]:
    """The share of stories that miss the asked name, and that miss the asked colored object: the two parts of the
    gold reward that chapter 6's reward model could not see."""
    parts = [tinyworld.story_reward_parts(s, c) for s, c in zip(specs, completions)]
    return {"gold/wrong_name": sum(p["name"] == 0 for p in parts) / len(parts),
            "gold/wrong_object": sum(p["object"] < 1 for p in parts) / len(parts)}


def top_samples(ro, step: int, by_prompt: dict, task: str, n: int = 2) -> list[dict]:
    """The n samples of a rollout that the trained reward liked best, with their gold reward (and, for stories,
    whether they kept the asked name and object): where a policy exploits its reward, these show how."""
    best = torch.argsort(ro.rewards, descending=True)[:n].tolist()
    rows = [{"step": step, "prompt": ro.prompts[i], "completion": ro.completions[i], "proxy": ro.rewards[i].item(),
             "gold": ro.gold[i].item()} for i in best]
    if task == "stories":
        for r in rows:
            parts = tinyworld.story_reward_parts(by_prompt[r["prompt"]]["spec"], r["completion"])
            r["name_ok"], r["object_ok"] = parts["name"] == 1, parts["object"] == 1
    return rows


def curves(out: Path, records: list[dict], task: str, ceiling: dict | None = None) -> None:
    steps = [r["step"] for r in records if "reward" in r]
    evals = [r for r in records if greedy_key(task) in r]
    fig, axes = plt.subplots(1, 3 if task == "stories" else 2, figsize=(15 if task == "stories" else 10, 3.5))
    a1, a2 = axes[:2]
    a1.plot(steps, [r["proxy/reward"] for r in records if "reward" in r], alpha=0.6, label="sampled: trained reward")
    if task == "stories":
        a1.plot(steps, [r["gold/reward"] for r in records if "reward" in r], alpha=0.6, label="sampled: gold reward")
    a1.plot([r["step"] for r in evals], [r[greedy_key(task)] for r in evals], marker="o",
            label="held out, greedy: " + ("accuracy" if task == "word-problems" else "gold reward"))
    for k, value in (ceiling or {}).items():  # the SFT model's pass@k: what reweighting its samples can reach
        if int(k) in (1, 4, 16):
            a1.axhline(value, ls=":", color="grey")
            a1.annotate(f"SFT pass@{k}", (steps[0] if steps else 0, value), fontsize=7, color="grey", va="bottom")
    a1.set(xlabel="step", ylabel="reward")
    a2.plot(steps, [r["objective/kl"] for r in records if "reward" in r], label="KL (k1, per sequence)")
    a2.plot(steps, [r["objective/kl_k3"] for r in records if "reward" in r], label="KL (k3, per sequence)")
    a2.set(xlabel="step", ylabel="nats")
    if task == "stories":  # the two parts of the gold reward that the reward model cannot see
        for key, label in (("gold/wrong_name", "without the asked name"), ("gold/wrong_object", "without the asked object")):
            axes[2].plot(steps, [r[key] for r in records if "reward" in r], alpha=0.7, label=label)
        axes[2].set(xlabel="step", ylabel="share of sampled stories")
    for a in axes:
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    save(fig, out / "curves.png")


def pg_config(args) -> PGConfig:
    """The update's settings from the command line (eval.json records them under "config")."""
    return PGConfig(algo=args.algo, k=args.k, beta=args.beta, kl_in=args.kl_in, inner_epochs=args.inner_epochs,
                    max_new_tokens=args.max_new_tokens, temperature=args.temperature, loss_type=args.loss_type,
                    filter_groups=args.filter_groups)


def pg_run(args, out: Path, seed: int, init: Path, device) -> dict:
    """One policy-gradient run from the SFT model in `init` into `out`; returns what eval.json holds."""
    seed_everything(seed)
    tok = Tokenizer.load(init)
    policy = load_gpt(init, device=device, vocab_size=tok.vocab_size, dropout=0.0)
    reference = load_gpt(init, device=device, vocab_size=tok.vocab_size, dropout=0.0).requires_grad_(False)
    rm = None
    if args.reward == "rm" or args.task == "stories":
        rm_dir = prerequisite("reward_model", args.quick, build=not args.no_build)
        require_real(rm_dir, args.quick)
        rm = RewardModel.load(rm_dir, device=device, vocab_size=tok.vocab_size).requires_grad_(False)

    train_prompts, held_out, by_prompt, gold_fn = task_data(args.task, args.quick, args.eval_examples)
    rm_fn = reward_fn(rm, tok) if rm is not None else None
    train_fn = gold_fn if args.reward == "gold" else rm_fn
    proxy_fn = None if args.reward == "gold" else rm_fn  # what held-out answers score on the trained reward
    cfg = pg_config(args)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    baseline = MovingAverageBaseline()
    print(f"{args.algo} on {args.task} ({len(train_prompts):,} training prompts, {len(held_out)} held out), reward: "
          f"{'gold' if args.reward == 'gold' else 'the reward model'}; {args.prompts} prompts x {args.k} samples per "
          f"step, β = {args.beta} (KL in the {args.kl_in}), lr {args.lr}, {args.steps} steps; the per-token loss "
          f"aggregated as \"{normalisation(args.algo, args.loss_type)}\" ("
          + (f"--loss-type {args.loss_type}" if args.loss_type else f"{args.algo}'s own") + ")"
          + ("; prompts whose samples all got the same reward left out of the update (--filter-groups)"
             if args.filter_groups else ""))

    state_file = out / "last" / "train_state.pt"
    if args.no_resume and out.exists():
        shutil.rmtree(out)
    start, before = 0, None
    if state_file.is_file():
        state = load_train_state(state_file)
        load_state(policy, out / "last" / "model.safetensors")
        optimizer.load_state_dict(state["optimizer"])
        start, baseline.value, before = state["step"], state["baseline"], json.loads(state["before"])
        torch.set_rng_state(state["rng"])
        print(f"resuming {shown(out)} at step {start}")
    start_run(out, fresh=() if start else ("metrics.jsonl", "rollout_samples.jsonl"))
    if before is None:
        before = evaluate_held_out(args, policy, reference, tok, held_out, proxy_fn, seed)
        if args.task == "word-problems" and args.pass_at_k:
            t0 = time.perf_counter()
            before["pass_at_k"] = sampled_pass_at_k(policy, tok, held_out, args.pass_at_k, args.temperature, seed)
            print(f"SFT model, {args.pass_at_k} samples per held-out problem at T = {args.temperature} "
                  f"({time.perf_counter() - t0:.0f} s): " + ", ".join(f"pass@{k} {v:.3f}" for k, v in before["pass_at_k"].items()))
        append_metrics(out / "metrics.jsonl", {"step": 0, **eval_record(before)})
    print(f"before: held-out {'accuracy' if args.task == 'word-problems' else 'gold reward'} {before['gold']:.3f}")

    generator = torch.Generator(device=device).manual_seed(seed + start)
    t_start = time.perf_counter()
    bar = tqdm(range(start, args.steps), desc=args.algo, unit="step", disable=args.quiet, dynamic_ncols=True)
    for step in bar:
        prompts = [train_prompts[(step * args.prompts + j) % len(train_prompts)]["prompt"] for j in range(args.prompts)]
        t0 = time.perf_counter()
        ro = rollout(policy, reference, tok, prompts, args.k, train_fn,  # gold is always logged; when it is the reward,
                     None if args.reward == "gold" else gold_fn, args.max_new_tokens,  # the rollout copies it
                     args.temperature, args.missing_eos_penalty, generator)
        t1 = time.perf_counter()
        metrics = pg_update(policy, optimizer, ro, cfg, baseline)
        t2 = time.perf_counter()
        if args.task == "stories":
            metrics.update(story_parts([by_prompt[p]["spec"] for p in ro.prompts], ro.completions))
        record = {"step": step + 1, **metrics, **{f"time/{k}_s": v for k, v in ro.seconds.items()},
                  "time/rollout_s": t1 - t0, "time/update_s": t2 - t1}
        if (step + 1) % args.eval_interval == 0 or step + 1 == args.steps:
            record.update(eval_record(evaluate_held_out(args, policy, reference, tok, held_out, proxy_fn, seed)))
            for row in top_samples(ro, step + 1, by_prompt, args.task):
                append_metrics(out / "rollout_samples.jsonl", row)
            save_gpt(policy, out / "last")
            save_train_state(state_file, {"step": step + 1, "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state(),
                                          "baseline": baseline.value, "before": json.dumps(before)})
        append_metrics(out / "metrics.jsonl", record)
        bar.set_postfix(reward=f"{metrics['reward']:.3f}", kl=f"{metrics['objective/kl']:.3f}")
    seconds = time.perf_counter() - t_start

    after = evaluate_held_out(args, policy, reference, tok, held_out, proxy_fn, seed)
    save_gpt(policy, out)
    tok.save(out)
    records = read_jsonl(out / "metrics.jsonl")
    curves(out, records, args.task, before.get("pass_at_k"))
    last = [r for r in records if "objective/kl" in r][-10:]
    kl = sum(r["objective/kl"] for r in last) / max(1, len(last))  # k1: unbiased, can dip below 0 on a batch
    kl3 = sum(r["objective/kl_k3"] for r in last) / max(1, len(last))  # k3: never below 0
    if args.filter_groups:  # what DAPO's filter left the updates (it does not refill the batch)
        steps = [r for r in records if "train/rows" in r]
        used = sum(r["train/rows"] for r in steps) / max(1, len(steps) * args.prompts * args.k)
        skipped = sum(r["train/skipped_step"] for r in steps)
        print(f"--filter-groups: the updates used {used:.1%} of the sampled rows; {skipped:.0f} of {len(steps)} steps "
              "had no group left and did no update")
    name = "accuracy" if args.task == "word-problems" else "gold reward"
    print(f"after {args.steps} steps ({seconds / 60:.1f} min): held-out {name} {before['gold']:.3f} -> {after['gold']:.3f} "
          f"at KL {kl:.3f} (k1) / {kl3:.3f} (k3) nats per sequence (mean of the last 10 steps)"
          + (f"; sampled at T = {args.temperature}: gold {before['sampled']['gold']:.3f} -> {after['sampled']['gold']:.3f} "
             f"± {after['sampled']['gold_se']:.3f}, held-out KL {after['sampled']['kl']:.2f}" if "sampled" in after else ""))
    mcnemar = None
    if args.task == "word-problems" and "gold_each" in before:  # the same problems before and after: a paired test
        mcnemar = mcnemar_exact(before["gold_each"], after["gold_each"])
        print(f"McNemar's exact test on the {len(held_out)} held-out problems: {mcnemar['b']} right before and wrong "
              f"after, {mcnemar['c']} wrong before and right after, p = {mcnemar['p_value']:.2g}")
    result = {"algo": args.algo, "task": args.task, "reward": args.reward, "mcnemar": mcnemar,
              "before": {k: v for k, v in before.items() if k != "samples"},
              "after": {k: v for k, v in after.items() if k != "samples"}, "kl": kl, "kl_k3": kl3, "steps": args.steps,
              "seconds": seconds, "seed": seed, "init": str(init), "config": vars(cfg), "lr": args.lr, "prompts": args.prompts,
              "eval_samples": args.eval_samples if args.task == "stories" else 0,
              "device": str(device)}
    atomic_write_text(out / "eval.json", json.dumps(result, indent=2))
    cell = lambda s: s.replace("\n", " ").replace("|", "/")  # noqa: E731
    samples = ["| prompt | response after RL | gold |", "|---|---|---:|"]
    samples += [f"| {cell(s['prompt'])[:200]} | {cell(s['response'])[:200]} | {s['gold']:.2f} |" for s in after["samples"]]
    atomic_write_text(out / "samples.md", "\n".join(samples) + "\n")
    headline = (f"{args.steps} steps ({args.prompts} prompts x {args.k} samples) in {seconds / 60:.1f} min on {device}; "
                f"reward: {args.reward}; β = {args.beta}. Held-out {name} **{before['gold']:.3f} → {after['gold']:.3f}** "
                f"at a KL of {kl:.3f} nats per sequence.")
    atomic_write_text(out / "report.md", "\n".join([f"## Chapter 7: {args.algo} on {args.task}", "", headline, "",
                                                    f"![curves]({out.name}/curves.png)", "", "\n".join(samples), ""]))
    write_summary(out, {k: v for k, v in result.items() if k != "config"}, args.quick)
    return result


def run_name(args) -> str:
    """The default folder's name: pg_<task>_<algo>, then _<loss-type> (or _own) and _filter (or _nofilter) where those
    differ from the task's recipe (TASK_DEFAULTS), so such a run never overwrites the default run later chapters read."""
    recipe = TASK_DEFAULTS[args.task]
    return (f"pg_{args.task}_{args.algo}"
            + (f"_{args.loss_type or 'own'}" if args.loss_type != recipe["loss_type"] else "")
            + (("_filter" if args.filter_groups else "_nofilter") if args.filter_groups != recipe["filter_groups"] else ""))


def finished_seed(args, out: Path, seed: int) -> dict | None:
    """The result of a finished run of this very configuration in `out` (a sweep picks up where it stopped), else None."""
    if args.no_resume or not finished_run(out) or not (out / "eval.json").is_file():
        return None
    result = json.loads((out / "eval.json").read_text(encoding="utf-8"))
    same = {"steps": args.steps, "seed": seed, "lr": args.lr, "prompts": args.prompts, "algo": args.algo}
    same_cfg = {"k": args.k, "beta": args.beta, "temperature": args.temperature, "inner_epochs": args.inner_epochs,
                "loss_type": args.loss_type, "filter_groups": args.filter_groups}
    older = {"loss_type": None, "filter_groups": False}  # what runs from before these knobs did
    if result.get("eval_samples", 0) != (args.eval_samples if args.task == "stories" else 0):  # (older runs: 0)
        return None
    if any(result.get(k) != v for k, v in same.items()) or any(result["config"].get(k, older.get(k)) != v
                                                               for k, v in same_cfg.items()):
        return None
    print(f"seed {seed}: keeping the finished run in {shown(out)}")
    return result


def spread_table(results: list[dict], name: str, percent: bool = True) -> tuple[str, dict]:
    """min / median / max over the seeds: the held-out score before and after, the gain, the KL, the minutes.
    percent=False shows the scores as they are (a mean reward, not an accuracy)."""
    rows = {"before": [r["before"]["gold"] for r in results], "after": [r["after"]["gold"] for r in results]}
    rows["gain"] = [a - b for a, b in zip(rows["after"], rows["before"])]
    rows["kl"] = [r["kl"] for r in results]
    rows["minutes"] = [r["seconds"] / 60 for r in results]
    spread = {k: {"min": min(v), "median": statistics.median(v), "max": max(v), "runs": v} for k, v in rows.items()}
    label = {"before": f"held-out {name}, SFT", "after": f"held-out {name}, after RL", "gain": "gain",
             "kl": "KL (k1, nats/sequence)", "minutes": "training minutes"}
    fmt = {"kl": "{:.3f}".format, "minutes": "{:.1f}".format,
           "gain": (lambda x: f"{100 * x:+.1f} pts") if percent else "{:+.3f}".format}
    lines = ["| | min | median | max | seeds 0.. |", "|---|---:|---:|---:|---|"]
    for k, v in spread.items():
        f = fmt.get(k, "{:.1%}".format if percent else "{:.3f}".format)
        lines.append(f"| {label[k]} | {f(v['min'])} | {f(v['median'])} | {f(v['max'])} | {', '.join(map(f, v['runs']))} |")
    return "\n".join(lines), spread


def main(argv=None) -> dict:
    args = parse_args(argv)
    root = runs_root(args.quick)
    device = pick_device(args.device)
    if not args.seeds:
        init = args.init or prerequisite("sft", args.quick, build=not args.no_build)
        return pg_run(args, args.out or root / run_name(args), args.seed, init, device)

    sft_sweep = sft_seed_sweep(root, args.seeds)  # seed k of RL starts from seed k of SFT
    sweep_dir = args.out or root / f"{run_name(args)}_seeds"
    results = []
    for k in range(args.seeds):
        out = sweep_dir / f"seed{k}"
        results.append(finished_seed(args, out, k) or pg_run(args, out, k, sft_sweep / f"seed{k}", device))
    name = "accuracy" if args.task == "word-problems" else "gold reward"
    text, spread = spread_table(results, name)
    print(f"\n{args.seeds} seeds of {args.algo} on {args.task}, each from the SFT model of the same seed:\n{text}")
    command = f"python chapters/ch07_policy_gradient.py {' '.join(argv if argv is not None else sys.argv[1:])}"
    atomic_write_text(sweep_dir / "sweep.md", f"`{command.strip()}`\n\n{text}\n")
    summary = {"seeds": list(range(args.seeds)), "spread": spread, "algo": args.algo, "task": args.task}
    write_summary(sweep_dir, summary, args.quick)
    return summary


if __name__ == "__main__":
    cli.run(main)
