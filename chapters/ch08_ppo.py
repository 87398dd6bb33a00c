"""Chapter 8: PPO with a critic, GAE, clipping and a KL penalty that holds a target (llm_from_scratch/ppo.py).

Each step samples one completion for each of --prompts prompts with the policy (dropout off), scores it, and
runs --epochs passes of --minibatches clipped updates over the batch. Each token gets its own advantage from
the critic by GAE; the reward is the score at the completion's last token minus kl_coef · k1 at every token.
The SFT model is the starting policy and the frozen reference.

  --task stories          RLHF (the default): the reward is chapter 6's reward model; the gold story reward,
                          which the policy never sees, is logged beside it. Sampled at --temperature 1.0,
                          where the SFT model leaves room (its greedy stories already score 1.0). Evaluated on
                          --eval-samples samples of every held-out story prompt: gold, proxy and KL.
  --task word-problems    RL from verifiable rewards (compare chapter 7's RLOO): held-out greedy accuracy.

  --critic separate       the critic is a second trunk initialised from the reward model, with a head that
                          starts at zero (the default; --critic-head reward-model keeps the reward model's head)
  --critic shared         a value head on the policy's own trunk: one forward pass, one trunk fewer
  --kl-ctl adaptive       kl_coef moves so the KL per completion stays near --kl-target (the default)
  --kl-ctl fixed          kl_coef stays at --kl-coef (--kl-coef 0: no penalty, and over-optimisation)

Writes runs/ppo_<task>[_shared][_fixed<coef>]/: the policy (model.safetensors, config.json, the tokenizer; the
critic in critic/, or with --critic shared the policy with its value head in policy_value/), metrics.jsonl (objective/kl, objective/kl_coef, objective/entropy, objective/scores,
gold/reward, proxy/reward, policy/approxkl, policy/clipfrac, loss/policy, loss/value, value/explained_variance,
value/clipfrac, completions/mean_length, and each step's time split into generate, reference, reward, update; at each
evaluation eval/sampled/* for stories, eval/greedy/* for word problems: llm_from_scratch/evaluation.py),
rollout_samples.jsonl, eval.json (with the weights each model holds), samples.md, curves.png, report.md and
summary.json. An interrupted run resumes from its last evaluation (--no-resume starts over).

--seeds N runs seeds 0..N-1, seed k from chapter 5's runs/sft_seeds/seed<k>, and prints the spread.

    python chapters/ch08_ppo.py                          # PPO on stories, separate critic, adaptive KL
    python chapters/ch08_ppo.py --critic shared
    python chapters/ch08_ppo.py --kl-ctl fixed --kl-coef 0   # no KL penalty: watch the gold reward
    python chapters/ch08_ppo.py --task word-problems
    python chapters/ch08_ppo.py --quick                  # a smoke run (also LLMFS_QUICK=1)
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import cli  # chapters/cli.py: common flags, one-line errors (also puts the repository on sys.path)
import matplotlib.pyplot as plt
import torch
from ch07_policy_gradient import (TASKS, sft_seed_sweep, spread_table, story_parts, task_data,  # chapter 7's helpers
                                  top_samples)
from tqdm import tqdm

from llm_from_scratch.checkpoint import (
    append_metrics,
    atomic_write_text,
    load_state,
    load_train_state,
    read_jsonl,
    save_train_state,
)
from llm_from_scratch.course import (
    finished_run,
    prerequisite,
    quick_mode,
    require_real,
    runs_root,
    shown,
    start_run,
    write_summary,
)
from llm_from_scratch.device import pick_device, seed_everything
from llm_from_scratch.plots import save
from llm_from_scratch.evaluation import eval_record, greedy_eval, sampled_eval
from llm_from_scratch.policy_gradient import rollout
from llm_from_scratch.ppo import (
    AdaptiveKLController,
    FixedKLController,
    PolicyValue,
    PPOConfig,
    actor,
    make_optimizer,
    ppo_step,
    weights_held,
)
from llm_from_scratch.reward_model import RewardModel, reward_fn
from llm_from_scratch.tokenizer import Tokenizer
from llm_from_scratch.train import load_gpt, save_gpt


def parse_args(argv=None):
    ap = cli.parser(__doc__)
    ap.add_argument("--task", default="stories", choices=sorted(TASKS), help="default stories")
    ap.add_argument("--reward", choices=["gold", "rm"],
                    help="what the policy is trained on (default: rm for stories, gold for word problems)")
    ap.add_argument("--critic", default="separate", choices=["separate", "shared"],
                    help="separate: a trunk of its own, initialised from the reward model (default); "
                         "shared: a value head on the policy's trunk")
    ap.add_argument("--critic-head", default="zero", choices=["zero", "reward-model"],
                    help="the separate critic's head: zero (V = 0 everywhere to start, the default) or the reward "
                         "model's own head (its scores of unfinished completions as the first values)")
    ap.add_argument("--kl-ctl", default="adaptive", choices=["adaptive", "fixed"], help="default adaptive")
    ap.add_argument("--kl-coef", type=float, default=0.05,
                    help="the KL coefficient: fixed, or the adaptive controller's start (default 0.05)")
    ap.add_argument("--kl-target", type=float,
                    help="adaptive: the KL per completion (nats, k1) to hold (default 1.0 for stories, 0.5 for word problems)")
    ap.add_argument("--kl-horizon", type=int, default=500,
                    help="adaptive: samples over which a 20%% error moves the coefficient by 20%% (default 500)")
    ap.add_argument("--init", type=Path, help="policy and reference to start from (default runs/sft)")
    ap.add_argument("--steps", type=int, default=120, help="PPO iterations: one rollout batch each (default 120)")
    ap.add_argument("--prompts", type=int, default=64, help="prompts per rollout batch (default 64)")
    ap.add_argument("--k", type=int, default=1, help="samples per prompt (default 1: the critic is the baseline)")
    ap.add_argument("--epochs", type=int, default=2, help="passes over each rollout batch (default 2)")
    ap.add_argument("--minibatches", type=int, default=2, help="optimizer steps per pass (default 2)")
    ap.add_argument("--lr", type=float, default=5e-5, help="the policy's AdamW learning rate (default 5e-5)")
    ap.add_argument("--critic-lr", type=float, default=1e-4, help="the critic's learning rate (default 1e-4)")
    ap.add_argument("--clip-eps", type=float, default=0.2, help="policy ratio clip (default 0.2)")
    ap.add_argument("--clip-value", type=float, default=0.2, help="value clip, in reward units (default 0.2)")
    ap.add_argument("--vf-coef", type=float, default=0.1, help="weight of the value loss (default 0.1)")
    ap.add_argument("--ent-coef", type=float, default=0.0, help="entropy bonus (default 0)")
    ap.add_argument("--gamma", type=float, default=1.0, help="discount (default 1)")
    ap.add_argument("--lam", type=float, default=0.95, help="GAE's λ (default 0.95)")
    ap.add_argument("--whiten-rewards", action="store_true", help="scale the per-token rewards to unit variance")
    ap.add_argument("--temperature", type=float,
                    help="sampling temperature; log-probs and the KL use the same (default 1.0 for stories, 0.7 for "
                         "word problems, as in chapter 7)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="completion length limit (default 128)")
    ap.add_argument("--missing-eos-penalty", type=float, default=0.0,
                    help="subtracted from the score of a completion cut off without EOS (default 0)")
    ap.add_argument("--eval-interval", type=int, default=20, help="steps between held-out evaluations (default 20)")
    ap.add_argument("--eval-examples", type=int, default=1000, help="held-out prompts of the task (default: all)")
    ap.add_argument("--eval-samples", type=int, default=4,
                    help="stories: samples per held-out prompt for the sampled gold, proxy and KL (default 4)")
    ap.add_argument("--no-resume", action="store_true", help="start over even if --out holds an interrupted run")
    ap.add_argument("--seeds", type=int, default=0, metavar="N",
                    help="run seeds 0..N-1, seed k from chapter 5's runs/sft_seeds/seed<k>, and print the spread")
    cli.add_common_args(ap, "ppo_<task>[_shared][_fixed<coef>]")
    cli.add_prerequisite_arg(ap)
    args = ap.parse_args(argv)
    args.quick = args.quick or quick_mode()
    args.reward = args.reward or ("gold" if args.task == "word-problems" else "rm")
    args.temperature = args.temperature or (0.7 if args.task == "word-problems" else 1.0)
    args.kl_target = args.kl_target or (0.5 if args.task == "word-problems" else 1.0)
    if args.seeds < 0:
        ap.error("--seeds must be ≥ 0")
    if args.seeds and args.init:
        ap.error("--seeds starts seed k from runs/sft_seeds/seed<k> (chapter 5's sweep); leave out --init")
    if args.temperature <= 0:
        ap.error("--temperature must be > 0 (RL needs samples; greedy answers are for evaluation)")
    for flag in ("steps", "prompts", "k", "epochs", "minibatches", "max_new_tokens", "eval_interval", "eval_samples",
                 "kl_horizon"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be ≥ 1")
    if args.minibatches > args.prompts * args.k:
        ap.error(f"--minibatches {args.minibatches} is more than the {args.prompts * args.k} samples of a batch")
    if args.kl_coef < 0 or args.kl_target <= 0:
        ap.error("--kl-coef must be ≥ 0 and --kl-target > 0")
    if args.kl_ctl == "adaptive" and args.kl_coef == 0:
        ap.error("--kl-ctl adaptive multiplies the coefficient: start it above 0 (or use --kl-ctl fixed --kl-coef 0)")
    if args.quick:
        args.steps, args.prompts, args.max_new_tokens = 4, 4, 24
        args.eval_interval, args.eval_examples, args.eval_samples = 2, 8, 2
    return args


def run_name(args) -> str:
    return (f"ppo_{args.task}" + ("_shared" if args.critic == "shared" else "")
            + (f"_fixed{args.kl_coef:g}" if args.kl_ctl == "fixed" else ""))


def curves(out: Path, records: list[dict], args) -> None:
    """Reward (sampled and held out), KL with its target band and the coefficient, the critic's fit, clipping."""
    steps = [r["step"] for r in records if "objective/kl" in r]
    train = [r for r in records if "objective/kl" in r]
    evals = [r for r in records if eval_key(args.task) in r]
    fig, axes = plt.subplots(1, 4, figsize=(22, 4), constrained_layout=True)
    a = axes[0]
    a.plot(steps, [r["proxy/reward"] for r in train], alpha=0.6, label="sampled: trained reward")
    if args.task == "stories":
        a.plot(steps, [r["gold/reward"] for r in train], alpha=0.6, label="sampled: gold reward")
    a.plot([r["step"] for r in evals], [r[eval_key(args.task)] for r in evals], marker="o",
           label="held out: " + ("greedy accuracy" if args.task == "word-problems" else f"gold, T = {args.temperature}"))
    a.set(xlabel="step", ylabel="reward", title="reward")
    a = axes[1]
    a.plot(steps, [r["objective/kl"] for r in train], label="KL (k1, per completion)")
    if args.kl_ctl == "adaptive":
        a.axhspan(0.7 * args.kl_target, 1.3 * args.kl_target, color="green", alpha=0.12, label="target ± 30%")
        a.axhline(args.kl_target, color="green", lw=0.8)
    a.set(xlabel="step", ylabel="nats", title="KL to the SFT model")
    twin = a.twinx()
    twin.plot(steps, [r["objective/kl_coef"] for r in train], color="C3", ls="--", label="kl_coef (right axis)")
    twin.set_ylabel("kl_coef")
    twin.legend(fontsize=8, loc="lower right")
    a = axes[2]
    a.plot(steps, [r["loss/value"] for r in train], label="value loss")
    a.set(xlabel="step", ylabel="value loss", title="the critic")
    twin = axes[2].twinx()
    twin.plot(steps, [max(-1.0, r["value/explained_variance"]) for r in train], color="C2", label="explained variance (right)")
    twin.set(ylim=(-1.05, 1.05), ylabel="explained variance")
    twin.legend(fontsize=8, loc="lower right")
    a = axes[3]
    for key, label in (("policy/clipfrac", "policy clip fraction"), ("value/clipfrac", "value clip fraction"),
                       ("policy/approxkl", "approx KL(old ‖ new)")):
        a.plot(steps, [r[key] for r in train], label=label, alpha=0.8)
    a.set(xlabel="step", title="how far each update moved")
    for a, loc in zip(axes, ("center right", "upper left", "upper left", "upper right")):
        a.grid(alpha=0.3)
        a.legend(fontsize=8, loc=loc)
    save(fig, out / "curves.png")


def eval_key(task: str) -> str:
    """The metrics.jsonl key of the held-out score: the greedy accuracy for word problems, the sampled gold for stories."""
    return "eval/greedy/accuracy" if task == "word-problems" else "eval/sampled/gold"


def held_out_record(args, result: dict) -> dict:
    """One held-out evaluation's metrics.jsonl keys, in the one schema (evaluation.eval_record)."""
    return eval_record(result, "eval/greedy" if args.task == "word-problems" else "eval/sampled")


def held_out_eval(args, policy, reference, tok, held_out, proxy_fn, seed) -> dict:
    """Stories: the sampled evaluation; word problems: the greedy accuracy (evaluation.greedy_eval), as chapter 7."""
    if args.task == "word-problems":
        return greedy_eval(policy, tok, held_out, proxy_fn)
    return sampled_eval(policy, reference, tok, held_out, args.eval_samples, args.temperature, args.max_new_tokens,
                        proxy_fn, seed)


def ppo_run(args, out: Path, seed: int, init: Path, device) -> dict:
    """One PPO run from the SFT model in `init` into `out`; returns what eval.json holds."""
    seed_everything(seed)
    tok = Tokenizer.load(init)
    gpt = load_gpt(init, device=device, vocab_size=tok.vocab_size, dropout=0.0)
    reference = load_gpt(init, device=device, vocab_size=tok.vocab_size, dropout=0.0).requires_grad_(False)
    rm_dir = None  # chapter 6's run: the reward, the separate critic's start, or both
    if args.reward == "rm" or args.critic == "separate":
        rm_dir = prerequisite("reward_model", args.quick, build=not args.no_build)
        require_real(rm_dir, args.quick)
    rm = None
    if args.reward == "rm":
        rm = RewardModel.load(rm_dir, device=device, vocab_size=tok.vocab_size).requires_grad_(False)
    critic = None
    if args.critic == "separate":  # a trunk of its own, from the reward model: it already reads stories
        critic = RewardModel.load(rm_dir, device=device, vocab_size=tok.vocab_size)
        if args.critic_head == "zero":  # the reward model's head scores finished completions, not returns to come
            torch.nn.init.zeros_(critic.head.weight)
            torch.nn.init.zeros_(critic.head.bias)
        policy = gpt
    else:
        policy = PolicyValue(gpt)
    held = {"policy": policy, "reference": reference, **({"reward model": rm} if rm is not None else {}),
            **({"critic": critic} if critic is not None else {})}

    train_prompts, held_out, by_prompt, gold_fn = task_data(args.task, args.quick, args.eval_examples)
    rm_fn = reward_fn(rm, tok) if rm is not None else None
    train_fn = gold_fn if args.reward == "gold" else rm_fn
    cfg = PPOConfig(epochs=args.epochs, minibatches=args.minibatches, clip_eps=args.clip_eps, clip_value=args.clip_value,
                    vf_coef=args.vf_coef, ent_coef=args.ent_coef, gamma=args.gamma, lam=args.lam,
                    whiten_rewards=args.whiten_rewards)
    kl_ctl = (AdaptiveKLController(args.kl_coef, args.kl_target, args.kl_horizon) if args.kl_ctl == "adaptive"
              else FixedKLController(args.kl_coef))
    optimizer = make_optimizer(policy, critic, args.lr, args.critic_lr)
    memory = weights_held(held)
    print(f"PPO on {args.task} ({len(train_prompts):,} training prompts, {len(held_out)} held out), reward: "
          f"{'gold' if args.reward == 'gold' else 'the reward model'}; {args.prompts * args.k} samples per step at "
          f"T = {args.temperature}, {args.epochs} epochs x {args.minibatches} minibatches; critic: {args.critic}; KL: "
          f"{args.kl_ctl} from {args.kl_coef}" + (f" toward {args.kl_target} nats" if args.kl_ctl == "adaptive" else "")
          + f"; {args.steps} steps\nweights held: " + ", ".join(f"{k} {v['params'] / 1e6:.2f} M" for k, v in memory.items()))

    state_file = out / "last" / "train_state.pt"
    if args.no_resume and out.exists():
        shutil.rmtree(out)
    start, before = 0, None
    if state_file.is_file():
        state = load_train_state(state_file)
        if critic is None:  # the shared PolicyValue: trunk, LM head and value head in one file
            load_state(policy, out / "last" / "policy_value" / "model.safetensors")
        else:
            load_state(policy, out / "last" / "model.safetensors")
            load_state(critic, out / "last" / "critic" / "model.safetensors")
        optimizer.load_state_dict(state["optimizer"])
        start, kl_ctl.value, before = state["step"], state["kl_coef"], json.loads(state["before"])
        torch.set_rng_state(state["rng"])
        print(f"resuming {shown(out)} at step {start}")
    start_run(out, fresh=() if start else ("metrics.jsonl", "rollout_samples.jsonl"))
    sampler = actor(policy)
    if before is None:
        t0 = time.perf_counter()
        before = held_out_eval(args, sampler, reference, tok, held_out, rm_fn, seed)
        append_metrics(out / "metrics.jsonl", {"step": 0, **held_out_record(args, before)})
        print(f"SFT model ({time.perf_counter() - t0:.0f} s): " + describe(before, args))

    generator = torch.Generator(device=device).manual_seed(seed + start)
    t_start = time.perf_counter()
    bar = tqdm(range(start, args.steps), desc="ppo", unit="step", disable=args.quiet, dynamic_ncols=True)
    for step in bar:
        prompts = [train_prompts[(step * args.prompts + j) % len(train_prompts)]["prompt"] for j in range(args.prompts)]
        t0 = time.perf_counter()
        ro = rollout(sampler, reference, tok, prompts, args.k, train_fn, None if args.reward == "gold" else gold_fn,
                     args.max_new_tokens, args.temperature, args.missing_eos_penalty, generator)
        t1 = time.perf_counter()
        metrics = ppo_step(policy, critic, optimizer, ro, kl_ctl, cfg, generator)
        t2 = time.perf_counter()
        if args.task == "stories":
            metrics.update(story_parts([by_prompt[p]["spec"] for p in ro.prompts], ro.completions))
        record = {"step": step + 1, **metrics, **{f"time/{k}_s": v for k, v in ro.seconds.items()},
                  "time/rollout_s": t1 - t0, "time/update_s": t2 - t1}
        if (step + 1) % args.eval_interval == 0 or step + 1 == args.steps:
            result = held_out_eval(args, sampler, reference, tok, held_out, rm_fn, seed)
            record.update(held_out_record(args, result))
            for row in top_samples(ro, step + 1, by_prompt, args.task):
                append_metrics(out / "rollout_samples.jsonl", row)
            save_critic(out / "last", sampler, policy, critic)
            save_train_state(state_file, {"step": step + 1, "optimizer": optimizer.state_dict(), "kl_coef": kl_ctl.value,
                                          "rng": torch.get_rng_state(), "before": json.dumps(before)})
        append_metrics(out / "metrics.jsonl", record)
        bar.set_postfix(reward=f"{metrics['proxy/reward']:.3f}", kl=f"{metrics['objective/kl']:.2f}",
                        coef=f"{kl_ctl.value:.3f}")
    seconds = time.perf_counter() - t_start
    return finish(args, out, seed, init, device, sampler, policy, critic, reference, tok, held_out, rm_fn, before,
                  seconds, memory)


def save_critic(folder: Path, sampler, policy, critic) -> None:
    """The policy as a GPT checkpoint (what later chapters load), and the critic beside it: critic/ (a separate
    trunk, kind reward_model) or policy_value/ (the shared trunk with both heads)."""
    save_gpt(sampler, folder)
    if critic is not None:
        critic.save(folder / "critic")
    else:
        policy.save(folder / "policy_value")


def describe(result: dict, args) -> str:
    if args.task == "word-problems":
        return f"held-out greedy accuracy {result['gold']:.3f}"
    return (f"held-out gold {result['gold']:.3f} ± {result['gold_se']:.3f}, reward model {result['proxy']:+.3f}, "
            f"KL {result['kl']:.2f} nats ({result['n']} samples at T = {args.temperature})")


def kl_in_band(train: list[dict], steps: int, target: float) -> tuple[float, float]:
    """The share of the second half's steps whose KL was within ±30% of the target: one batch's KL (64 samples, noisy)
    and its mean over the last 10 steps."""
    kls = [r["objective/kl"] for r in train]
    smooth = [sum(kls[max(0, i - 9):i + 1]) / len(kls[max(0, i - 9):i + 1]) for i in range(len(kls))]
    half = [i for i, r in enumerate(train) if r["step"] > steps // 2]
    share = lambda xs: sum(abs(xs[i] / target - 1) <= 0.3 for i in half) / max(1, len(half))  # noqa: E731
    return share(kls), share(smooth)


def finish(args, out, seed, init, device, sampler, policy, critic, reference, tok, held_out, rm_fn, before, seconds,
           memory) -> dict:
    """The final evaluation, the checkpoint, the figures, eval.json, samples.md, report.md and summary.json."""
    after = held_out_eval(args, sampler, reference, tok, held_out, rm_fn, seed)
    save_critic(out, sampler, policy, critic)
    tok.save(out)
    records = read_jsonl(out / "metrics.jsonl")
    curves(out, records, args)
    train = [r for r in records if "objective/kl" in r]
    in_band, in_band_smooth = kl_in_band(train, args.steps, args.kl_target)
    last = train[-10:]
    kl = sum(r["objective/kl"] for r in last) / max(1, len(last))
    step_s = sum(r["time/rollout_s"] + r["time/update_s"] for r in train) / max(1, len(train))
    print(f"after {args.steps} steps ({seconds / 60:.1f} min, {step_s:.2f} s per step): {describe(after, args)}; "
          f"sampled KL {kl:.2f} nats per completion (mean of the last 10 steps)"
          + (f"; second half within ±30% of the target {args.kl_target}: the 10-step mean KL at {in_band_smooth:.0%} of "
             f"the steps, one batch's KL at {in_band:.0%}" if args.kl_ctl == "adaptive" else ""))
    strip = lambda d: {k: v for k, v in d.items() if k not in ("samples", "gold_each", "proxy_each", "completions")}  # noqa: E731
    result = {"task": args.task, "reward": args.reward, "critic": args.critic, "kl_ctl": args.kl_ctl,
              "kl_coef": args.kl_coef, "kl_target": args.kl_target, "kl_coef_final": train[-1]["objective/kl_coef"],
              "kl_in_band_second_half": in_band, "kl_in_band_second_half_smoothed": in_band_smooth, "before": strip(before), "after": strip(after), "kl": kl,
              "steps": args.steps, "seconds": seconds, "seconds_per_step": step_s, "seed": seed, "init": str(init),
              "lr": args.lr, "critic_lr": args.critic_lr, "prompts": args.prompts, "k": args.k,
              "temperature": args.temperature, "config": {k: v for k, v in vars(args).items() if k in CONFIG_KEYS},
              "weights_held": memory, "device": str(device)}
    atomic_write_text(out / "eval.json", json.dumps(result, indent=2))
    cell = lambda s: s.replace("\n", " ").replace("|", "/")  # noqa: E731
    samples = ["| prompt | response after PPO | gold |", "|---|---|---:|"]
    samples += [f"| {cell(s['prompt'])[:200]} | {cell(s['response'])[:200]} | {s['gold']:.2f} |" for s in after["samples"]]
    atomic_write_text(out / "samples.md", "\n".join(samples) + "\n")
    name = "accuracy (greedy)" if args.task == "word-problems" else f"gold reward (sampled, T = {args.temperature})"
    headline = (f"{args.steps} steps ({args.prompts * args.k} samples each, {args.epochs} epochs x {args.minibatches} "
                f"minibatches) in {seconds / 60:.1f} min on {device}, {step_s:.2f} s per step; critic: {args.critic}; "
                f"KL control: {args.kl_ctl}. Held-out {name} **{before['gold']:.3f} → {after['gold']:.3f}** at a KL of "
                f"{kl:.2f} nats per completion" + (f" (target {args.kl_target}; in the second half the 10-step mean KL was "
                                                    f"within ±30% of it at {in_band_smooth:.0%} of the steps, one batch's "
                                                    f"KL at {in_band:.0%})" if args.kl_ctl == "adaptive" else "") + ".")
    atomic_write_text(out / "report.md", "\n".join([f"## Chapter 8: PPO on {args.task}", "", headline, "",
                                                    f"![curves]({out.name}/curves.png)", "", "\n".join(samples), ""]))
    write_summary(out, {k: v for k, v in result.items() if k != "config"}, args.quick)
    return result


CONFIG_KEYS = ("critic_head", "epochs", "minibatches", "clip_eps", "clip_value", "vf_coef", "ent_coef", "gamma", "lam", "whiten_rewards",
               "kl_horizon", "max_new_tokens", "missing_eos_penalty", "reward")


def finished_seed(args, out: Path, seed: int) -> dict | None:
    """The result of a finished run of this very configuration in `out` (a sweep picks up where it stopped), else None."""
    if args.no_resume or not finished_run(out) or not (out / "eval.json").is_file():
        return None
    result = json.loads((out / "eval.json").read_text(encoding="utf-8"))
    same = {"steps": args.steps, "seed": seed, "lr": args.lr, "critic_lr": args.critic_lr, "prompts": args.prompts,
            "k": args.k, "critic": args.critic, "kl_ctl": args.kl_ctl, "kl_coef": args.kl_coef,
            "kl_target": args.kl_target, "temperature": args.temperature, "task": args.task}
    if any(result.get(k) != v for k, v in same.items()) or any(result["config"].get(k) != getattr(args, k)
                                                               for k in CONFIG_KEYS):
        return None
    print(f"seed {seed}: keeping the finished run in {shown(out)}")
    return result


def main(argv=None) -> dict:
    args = parse_args(argv)
    root = runs_root(args.quick)
    device = pick_device(args.device)
    if not args.seeds:
        init = args.init or prerequisite("sft", args.quick, build=not args.no_build)
        return ppo_run(args, args.out or root / run_name(args), args.seed, init, device)

    sft_sweep = sft_seed_sweep(root, args.seeds)  # seed k of PPO starts from seed k of SFT
    sweep_dir = args.out or root / f"{run_name(args)}_seeds"
    results = []
    for k in range(args.seeds):
        out = sweep_dir / f"seed{k}"
        results.append(finished_seed(args, out, k) or ppo_run(args, out, k, sft_sweep / f"seed{k}", device))
    name = "accuracy" if args.task == "word-problems" else "gold reward (sampled)"
    text, spread = spread_table(results, name, percent=args.task == "word-problems")
    in_band = [r["kl_in_band_second_half"] for r in results]
    in_band_smooth = [r["kl_in_band_second_half_smoothed"] for r in results]
    for label, xs in (("second-half steps with the 10-step mean KL within ±30% of the target", in_band_smooth),
                      ("second-half steps with one batch's KL within ±30% of the target", in_band)):
        if args.kl_ctl == "adaptive":
            text += (f"\n| {label} | {min(xs):.0%} | {statistics.median(xs):.0%} | {max(xs):.0%} | "
                     + ", ".join(f"{x:.0%}" for x in xs) + " |")
    print(f"\n{args.seeds} seeds of PPO on {args.task}, each from the SFT model of the same seed:\n{text}")
    command = f"python chapters/ch08_ppo.py {' '.join(argv if argv is not None else sys.argv[1:])}"
    atomic_write_text(sweep_dir / "sweep.md", f"`{command.strip()}`\n\n{text}\n")
    summary = {"seeds": list(range(args.seeds)), "spread": spread, "task": args.task, "critic": args.critic,
               "kl_ctl": args.kl_ctl, "kl_in_band_second_half": in_band,
               "kl_in_band_second_half_smoothed": in_band_smooth}
    write_summary(sweep_dir, summary, args.quick)
    return summary


if __name__ == "__main__":
    cli.run(main)
