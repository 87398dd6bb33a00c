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
critic in critic/, or with --critic shared the policy with its value head in policy_value/), metrics.jsonl
(objective/kl, objective/kl_coef, objective/entropy, objective/scores, gold/reward, proxy/reward, policy/approxkl,
policy/clipfrac, loss/policy, loss/value, value/explained_variance, value/clipfrac, completions/mean_length, and each
step's time split into generate, reference, reward, update; at each evaluation eval/sampled/* for stories, eval/greedy/*
for word problems: llm_from_scratch/evaluation.py), rollout_samples.jsonl, eval.json (with the weights each model
holds), samples.md, curves.png, report.md and summary.json. An interrupted run resumes from its last evaluation
(--no-resume starts over), and a finished run of the same flags is kept.

--seeds N runs seeds 0..N-1, seed k from chapter 5's runs/sft_seeds/seed<k>, and prints the spread.

    python chapters/ch08_ppo.py                          # PPO on stories, separate critic, adaptive KL
    python chapters/ch08_ppo.py --critic shared
    python chapters/ch08_ppo.py --kl-ctl fixed --kl-coef 0   # no KL penalty: watch the gold reward
    python chapters/ch08_ppo.py --task word-problems
    python chapters/ch08_ppo.py --ptx-coef 1             # PPO-ptx: the SFT loss in every update (the alignment tax)
    python chapters/ch08_ppo.py --quick                  # a smoke run (also LLMFS_QUICK=1)
    python chapters/ch08_ppo.py --async                  # sample step t+1 while step t updates (appendix B)
    torchrun --standalone --nproc_per_node=2 chapters/ch08_ppo.py   # 2 processes share each step's prompts

Under torchrun --prompts is the step's global number: each rank samples its share with its own random stream and
cuts its rows into --minibatches (ppo.ppo_step); rank 0 alone evaluates, records and saves.

With --async a worker process samples step t+1's batch with the weights of step t while step t's update runs: the
policy's clipped terms are weighted by min(π_old / μ, --is-cap) (ppo.py, llm_from_scratch/async_rollouts.py), and
metrics.jsonl logs offpolicy/ratio, ratio_max and capped.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from tqdm import tqdm

import cli  # chapters/cli.py: common flags, one-line errors (also puts the repository on sys.path)
import common  # chapters/common.py: the RL tasks' data, resuming, seed sweeps
from llm_from_scratch import distributed, lora
from llm_from_scratch.checkpoint import append_metrics, atomic_write_text, read_jsonl
from llm_from_scratch.course import prerequisite, quick_mode, require_real, start_run, write_summary
from llm_from_scratch.device import seed_everything
from llm_from_scratch.evaluation import eval_record, greedy_eval, sampled_eval
from llm_from_scratch.plots import save
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

ASYNC_STREAM = 1_000_003  # --async: the worker's sampling stream is seeded apart from the minibatch shuffles


@dataclass(frozen=True)
class Config(common.CommonFlags, common.LoRAFlags, common.AsyncFlags, common.PTXFlags):
    """Every flag, after the task's defaults and quick mode filled them in: parsed once, never changed."""
    task: str = "stories"
    reward: str = "rm"  # what the policy is trained on: "rm" (chapter 6's reward model) or "gold"
    critic: str = "separate"  # a trunk of its own ("separate") or a value head on the policy ("shared")
    critic_head: str = "zero"
    kl_ctl: str = "adaptive"
    kl_coef: float = 0.05
    kl_target: float = 1.0
    kl_horizon: int = 500
    init: Path | None = None
    steps: int = 120
    prompts: int = 64
    k: int = 1
    epochs: int = 2
    minibatches: int = 2
    lr: float = 5e-5
    critic_lr: float = 1e-4
    clip_eps: float = 0.2
    clip_value: float = 0.2
    vf_coef: float = 0.1
    ent_coef: float = 0.0
    gamma: float = 1.0
    lam: float = 0.95
    whiten_rewards: bool = False
    temperature: float = 1.0
    max_new_tokens: int = 128
    missing_eos_penalty: float = 0.0
    eval_interval: int = 20
    eval_examples: int = 1000
    eval_samples: int = 4


def parse_args(argv=None) -> Config:
    ap = cli.parser(__doc__)
    ap.add_argument("--task", default="stories", choices=sorted(common.TASKS), help="default stories")
    ap.add_argument("--reward", choices=["gold", "rm"],
                    help="what the policy is trained on (default: rm for stories, gold for word problems)")
    ap.add_argument("--critic", default="separate", choices=["separate", "shared"],
                    help="separate: a trunk of its own, initialised from the reward model (default); "
                         "shared: a value head on the policy's trunk")
    ap.add_argument("--critic-head", default="zero", choices=["zero", "reward-model"],
                    help="the separate critic's head: zero (V = 0 everywhere to start, the default) or the reward "
                         "model's own head (its scores of unfinished completions as the first values)")
    ap.add_argument("--kl-ctl", default="adaptive", choices=["adaptive", "fixed"], help="default adaptive")
    ap.add_argument("--kl-coef", type=cli.finite_float, default=0.05,
                    help="the KL coefficient: fixed, or the adaptive controller's start (default 0.05)")
    ap.add_argument("--kl-target", type=cli.finite_float,
                    help="adaptive: the KL per completion (nats, k1) to hold (default 1.0 for stories, 0.5 for word "
                         "problems)")
    ap.add_argument("--kl-horizon", type=int, default=500,
                    help="adaptive: samples over which a 20%% error moves the coefficient by 20%% (default 500)")
    ap.add_argument("--init", type=Path,
                    help="policy and reference to start from (default runs/sft); or a Hugging Face GPT-2 "
                         "folder (config.json + model.safetensors), imported once (appendix C)")
    ap.add_argument("--steps", type=int, default=120, help="PPO iterations: one rollout batch each (default 120)")
    ap.add_argument("--prompts", type=int, default=64, help="prompts per rollout batch (default 64)")
    ap.add_argument("--k", type=int, default=1, help="samples per prompt (default 1: the critic is the baseline)")
    ap.add_argument("--epochs", type=int, default=2, help="passes over each rollout batch (default 2)")
    ap.add_argument("--minibatches", type=int, default=2, help="optimizer steps per pass (default 2)")
    ap.add_argument("--lr", type=cli.positive_float,
                    help="the policy's AdamW learning rate (default 5e-5; with --lora-rank 5e-4)")
    ap.add_argument("--critic-lr", type=cli.positive_float, default=1e-4,
                    help="the critic's learning rate (default 1e-4)")
    ap.add_argument("--clip-eps", type=cli.finite_float, default=0.2, help="policy ratio clip (default 0.2)")
    ap.add_argument("--clip-value", type=cli.finite_float, default=0.2,
                    help="value clip, in reward units (default 0.2)")
    ap.add_argument("--vf-coef", type=cli.finite_float, default=0.1, help="weight of the value loss (default 0.1)")
    ap.add_argument("--ent-coef", type=cli.finite_float, default=0.0, help="entropy bonus (default 0)")
    ap.add_argument("--gamma", type=cli.finite_float, default=1.0, help="discount (default 1)")
    ap.add_argument("--lam", type=cli.finite_float, default=0.95, help="GAE's λ (default 0.95)")
    ap.add_argument("--whiten-rewards", action="store_true", help="scale the per-token rewards to unit variance")
    ap.add_argument("--temperature", type=cli.finite_float,
                    help="sampling temperature; log-probs and the KL use the same (default 1.0 for stories, 0.7 for "
                         "word problems, as in chapter 7)")
    ap.add_argument("--max-new-tokens", type=int,
                    help="completion length limit (default 128 for stories, 144 for word problems: chapter 7)")
    ap.add_argument("--missing-eos-penalty", type=cli.finite_float, default=0.0,
                    help="subtracted from the score of a completion cut off without EOS (default 0)")
    ap.add_argument("--eval-interval", type=int, default=20, help="steps between held-out evaluations (default 20)")
    ap.add_argument("--eval-examples", type=int, default=1000, help="held-out prompts of the task (default: all)")
    ap.add_argument("--eval-samples", type=int, default=4,
                    help="stories: samples per held-out prompt for the sampled gold, proxy and KL (default 4)")
    ap.add_argument("--no-resume", action="store_true",
                    help="start over even if --out holds an interrupted or finished run of the same flags")
    ap.add_argument("--seeds", type=int, default=0, metavar="N",
                    help="run seeds 0..N-1, seed k from chapter 5's runs/sft_seeds/seed<k>, and print the spread")
    cli.add_lora_args(ap)
    cli.add_async_args(ap)
    cli.add_ptx_args(ap)
    cli.add_common_args(ap, "ppo_<task>[_shared][_fixed<coef>][_lora<R>][_async][_ptx<γ>]")
    cli.add_prerequisite_arg(ap)
    a = vars(ap.parse_args(argv))
    cli.check_lora_args(ap, a, 5e-5)
    cli.check_async_args(ap, a)
    cli.check_ptx_args(ap, a)
    a["quick"] = a["quick"] or quick_mode()
    a["reward"] = a["reward"] or ("gold" if a["task"] == "word-problems" else "rm")
    a["temperature"] = a["temperature"] or (0.7 if a["task"] == "word-problems" else 1.0)
    if a["max_new_tokens"] is None:  # a word problem's answer restates each event: up to 138 tokens (chapter 7)
        a["max_new_tokens"] = 144 if a["task"] == "word-problems" else 128
    a["kl_target"] = a["kl_target"] or (0.5 if a["task"] == "word-problems" else 1.0)
    if a["seeds"] < 0:
        ap.error("--seeds must be ≥ 0")
    if a["seeds"] and a["init"]:
        ap.error("--seeds starts seed k from runs/sft_seeds/seed<k> (chapter 5's sweep); leave out --init")
    if a["temperature"] <= 0:
        ap.error("--temperature must be > 0 (RL needs samples; greedy answers are for evaluation)")
    for flag in ("steps", "prompts", "k", "epochs", "minibatches", "max_new_tokens", "eval_interval", "eval_samples",
                 "kl_horizon"):
        if a[flag] < 1:
            ap.error(f"--{flag.replace('_', '-')} must be ≥ 1")
    if a["minibatches"] > a["prompts"] * a["k"]:
        ap.error(f"--minibatches {a['minibatches']} is more than the {a['prompts'] * a['k']} samples of a batch")
    if a["kl_coef"] < 0 or a["kl_target"] <= 0:
        ap.error("--kl-coef must be ≥ 0 and --kl-target > 0")
    if a["kl_ctl"] == "adaptive" and a["kl_coef"] == 0:
        ap.error("--kl-ctl adaptive multiplies the coefficient: start it above 0 (or use --kl-ctl fixed --kl-coef 0)")
    if a["quick"]:
        a.update(steps=4, prompts=4, max_new_tokens=24, eval_interval=2, eval_examples=8, eval_samples=2)
    return Config(**a)



def run_name(cfg: Config) -> str:
    return (f"ppo_{cfg.task}" + ("_shared" if cfg.critic == "shared" else "")
            + (f"_fixed{cfg.kl_coef:g}" if cfg.kl_ctl == "fixed" else "")
            + (f"_lora{cfg.lora_rank}" if cfg.lora_rank else "") + ("_async" if cfg.async_rollouts else "")
            + (f"_ptx{cfg.ptx_coef:g}" if cfg.ptx_coef else ""))


def eval_key(task: str) -> str:
    """The metrics.jsonl key of the held-out score: greedy accuracy for word problems, sampled gold for stories."""
    return "eval/greedy/accuracy" if task == "word-problems" else "eval/sampled/gold"


def describe(result: dict, cfg: Config) -> str:
    if cfg.task == "word-problems":
        return f"held-out greedy accuracy {result['gold']:.3f}"
    return (f"held-out gold {result['gold']:.3f} ± {result['gold_se']:.3f}, reward model {result['proxy']:+.3f}, "
            f"KL {result['kl']:.2f} nats ({result['n']} samples at T = {cfg.temperature})")


def save_policy(folder: Path, policy, critic) -> None:
    """The policy as a GPT checkpoint (what later chapters load; a LoRA policy with its adapters folded in), and the
    critic beside it: critic/ (a separate trunk, kind reward_model) or policy_value/ (the shared trunk with both
    heads)."""
    common.save_policy(actor(policy), folder)
    if critic is not None:
        critic.save(folder / "critic")
    else:
        policy.save(folder / "policy_value", lora.merged_state_dict(policy))


def ppo_run(cfg: Config, run: common.Run) -> dict:
    """One PPO run from the SFT model in run.init into run.out; returns what eval.json holds."""
    out, seed, device = run.out, run.seed, run.device
    seed_everything(seed)
    tok = Tokenizer.load(run.init)
    gpt, reference = common.policy_and_reference(cfg, run, tok)  # with --lora-rank: one network, adapters off
    rm_dir = None  # chapter 6's run: the reward, the separate critic's start, or both
    if cfg.reward == "rm" or cfg.critic == "separate":
        with distributed.main_first():  # under torchrun rank 0 builds it if it is missing
            rm_dir = prerequisite("reward_model", cfg.quick, build=not cfg.no_build)
        require_real(rm_dir, cfg.quick)
    rm = None
    if cfg.reward == "rm":
        rm = RewardModel.load(rm_dir, device=device, vocab_size=tok.vocab_size).requires_grad_(False)
    critic = None
    if cfg.critic == "separate":  # a trunk of its own, from the reward model: it already reads stories
        critic = RewardModel.load(rm_dir, device=device, vocab_size=tok.vocab_size)
        if cfg.critic_head == "zero":  # the reward model's head scores finished completions, not returns to come
            torch.nn.init.zeros_(critic.head.weight)
            torch.nn.init.zeros_(critic.head.bias)
        policy = gpt
    else:
        policy = PolicyValue(gpt)
    held = {**common.policy_held(cfg, policy, reference), **({"reward model": rm} if rm is not None else {}),
            **({"critic": critic} if critic is not None else {})}

    data = common.task_data(cfg.task, cfg.quick, cfg.eval_examples)
    rm_fn = reward_fn(rm, tok) if rm is not None else None
    train_fn = data.gold_fn if cfg.reward == "gold" else rm_fn
    ppo_cfg = PPOConfig(epochs=cfg.epochs, minibatches=cfg.minibatches, clip_eps=cfg.clip_eps,
                        clip_value=cfg.clip_value, vf_coef=cfg.vf_coef, ent_coef=cfg.ent_coef, gamma=cfg.gamma,
                        lam=cfg.lam, whiten_rewards=cfg.whiten_rewards, is_cap=cfg.is_cap, ptx_coef=cfg.ptx_coef)
    ptx = common.ptx_batches(cfg, cfg.quick, tok, gpt.config.context_length, seed, device)  # PPO-ptx's SFT batches
    kl_ctl = (AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon) if cfg.kl_ctl == "adaptive"
              else FixedKLController(cfg.kl_coef))
    optimizer = make_optimizer(policy, critic, cfg.lr, cfg.critic_lr)
    memory = weights_held(held)
    print(f"PPO on {cfg.task} ({len(data.train_prompts):,} training prompts, {len(data.held_out)} held out), reward: "
          f"{'gold' if cfg.reward == 'gold' else 'the reward model'}; {cfg.prompts * cfg.k} samples per step at "
          f"T = {cfg.temperature}, {cfg.epochs} epochs x {cfg.minibatches} minibatches; critic: {cfg.critic}; KL: "
          f"{cfg.kl_ctl} from {cfg.kl_coef}" + (f" toward {cfg.kl_target} nats" if cfg.kl_ctl == "adaptive" else "")
          + f"; {cfg.steps} steps\nweights held: "
          + ", ".join(f"{k} {v['params'] / 1e6:.2f} M" for k, v in memory.items()))
    sampler = actor(policy)

    def evaluate() -> dict:
        """Stories: the sampled evaluation; word problems: the greedy accuracy, as chapter 7."""
        if cfg.task == "word-problems":
            return greedy_eval(sampler, tok, data.held_out, rm_fn)
        return sampled_eval(sampler, reference, tok, data.held_out, cfg.eval_samples, cfg.temperature,
                            cfg.max_new_tokens, rm_fn, seed)

    def record_of(result: dict) -> dict:
        """One held-out evaluation's metrics.jsonl keys, in the one schema (evaluation.eval_record)."""
        return eval_record(result, "eval/greedy" if cfg.task == "word-problems" else "eval/sampled")

    weights = ({"policy_value/model.safetensors": policy} if critic is None  # the shared trunk: one file
               else {"model.safetensors": policy, "critic/model.safetensors": critic})
    if cfg.lora_rank:  # the frozen weights are run.init's: only what trains
        weights = {"adapters.safetensors": lora.Adapters(gpt), **(
            {"value_head.safetensors": policy.value_head} if critic is None else {"critic/model.safetensors": critic})}
    state = common.resume(run, cfg, weights, optimizer, logs=("metrics.jsonl", "rollout_samples.jsonl"))
    start, before = (state["step"], json.loads(state["before"])) if state else (0, None)
    kl_ctl.value = state["kl_coef"] if state else kl_ctl.value
    rank0, W = distributed.is_main(), distributed.world_size()
    forward = distributed.wrap(policy)  # DDP under torchrun (and the separate critic too)
    forward_critic = distributed.wrap(critic) if critic is not None else None
    if rank0:
        start_run(out)
    if before is None and rank0:  # rank 0 evaluates and writes; the others go on to the first step and wait there
        t0 = time.perf_counter()
        before = evaluate()
        append_metrics(out / "metrics.jsonl", {"step": 0, **record_of(before)})
        print(f"SFT model ({time.perf_counter() - t0:.0f} s): " + describe(before, cfg))

    # the rollouts' (and minibatches') random numbers, each rank its own stream under torchrun; with --async the
    # worker samples from a stream of its own (`sampling`), and `generator` only shuffles the minibatches
    generator = torch.Generator(device=device).manual_seed(seed + 7919 * distributed.rank())
    sampling = torch.Generator(device=device).manual_seed(seed + 7919 * distributed.rank() + ASYNC_STREAM)
    if state:  # where the interrupted run's were: a resumed run samples what an uninterrupted one would have
        common.restore_streams(generator, state)
        common.restore_streams(sampling, state, "sampling")

    def prompts_of(step: int) -> list[str]:  # this rank's share of the step's prompts (all of them in one process)
        prompts = common.batch_prompts(data.train_prompts, step, cfg.prompts)
        return prompts[distributed.shard_rows(len(prompts))] if W > 1 else prompts

    t_start = time.perf_counter()
    bar = tqdm(range(start, cfg.steps), desc="ppo", unit="step", disable=cfg.quiet or not rank0, dynamic_ncols=True)
    with common.rollout_worker(cfg, run, rm_dir, sampling) as worker:  # --async: the sampler in its own process
        if worker is not None and start < cfg.steps:
            worker.submit(sampler, prompts_of(start))  # the first batch: sampled with the weights before any update
        for step in bar:
            t0 = time.perf_counter()
            if worker is None:
                ro = rollout(sampler, reference, tok, prompts_of(step), cfg.k, train_fn,
                             None if cfg.reward == "gold" else data.gold_fn, cfg.max_new_tokens, cfg.temperature,
                             cfg.missing_eos_penalty, generator)
            else:  # sampled one update ago; the next batch is sampled with these weights while this update runs
                ro = worker.receive()
                sampling.set_state(worker.stream)  # the worker's stream, for the checkpoint
                if step + 1 < cfg.steps:
                    worker.submit(sampler, prompts_of(step + 1))
            t1 = time.perf_counter()
            metrics = ppo_step(forward, forward_critic, optimizer, ro, kl_ctl, ppo_cfg, generator,  # every rank's
                               ptx(step) if ptx else None)
            t2 = time.perf_counter()
            common.require_finite_metrics(metrics, ("loss/policy", "loss/value", "loss/ptx"), step + 1, out)
            if cfg.task == "stories":
                parts = common.story_parts([data.by_prompt[p]["spec"] for p in ro.prompts], ro.completions)
                metrics.update(common.shared_shares(parts, len(ro.prompts)))
            record = common.step_record(step + 1, metrics, ro, t1 - t0, t2 - t1)
            evaluating = (step + 1) % cfg.eval_interval == 0 or step + 1 == cfg.steps
            streams = None  # every rank's, for the checkpoint
            if evaluating:
                streams = {**common.rollout_streams(generator),
                           **(common.rollout_streams(sampling, "sampling") if worker is not None else {})}
            if rank0:  # rank 0 evaluates, records and saves
                if evaluating:
                    record.update(record_of(evaluate()))
                    for row in common.top_samples(ro, step + 1, data.by_prompt, cfg.task):
                        append_metrics(out / "rollout_samples.jsonl", row)
                append_metrics(out / "metrics.jsonl", record)
                if evaluating:  # the checkpoint after the records it covers: a kill between the two loses nothing
                    common.save_last(out, weights)
                    common.save_state(run, cfg, step + 1, optimizer, weights, **streams, kl_coef=kl_ctl.value,
                                      before=json.dumps(before))
            bar.set_postfix(reward=f"{metrics['proxy/reward']:.3f}", kl=f"{metrics['objective/kl']:.2f}",
                            coef=f"{kl_ctl.value:.3f}")
    seconds = time.perf_counter() - t_start
    if not rank0:  # rank 0 evaluates the trained policy and writes the run; every rank returns its result
        return distributed.broadcast_object(None)

    after = evaluate()
    save_policy(out, policy, critic)
    tok.save(out)
    return distributed.broadcast_object(report(cfg, run, before, after, seconds, memory))


def curves(out: Path, records: list[dict], cfg: Config) -> None:
    """Reward (sampled and held out), KL with its target band and the coefficient, the critic's fit, clipping."""
    steps = [r["step"] for r in records if "objective/kl" in r]
    train = [r for r in records if "objective/kl" in r]
    evals = [r for r in records if eval_key(cfg.task) in r]
    fig, axes = plt.subplots(1, 4, figsize=(22, 4), constrained_layout=True)
    a = axes[0]
    a.plot(steps, [r["proxy/reward"] for r in train], alpha=0.6, label="sampled: trained reward")
    if cfg.task == "stories":
        a.plot(steps, [r["gold/reward"] for r in train], alpha=0.6, label="sampled: gold reward")
    a.plot([r["step"] for r in evals], [r[eval_key(cfg.task)] for r in evals], marker="o", label="held out: "
           + ("greedy accuracy" if cfg.task == "word-problems" else f"gold, T = {cfg.temperature}"))
    a.set(xlabel="step", ylabel="reward", title="reward")
    a = axes[1]
    a.plot(steps, [r["objective/kl"] for r in train], label="KL (k1, per completion)")
    if cfg.kl_ctl == "adaptive":
        a.axhspan(0.7 * cfg.kl_target, 1.3 * cfg.kl_target, color="green", alpha=0.12, label="target ± 30%")
        a.axhline(cfg.kl_target, color="green", lw=0.8)
    a.set(xlabel="step", ylabel="nats", title="KL to the SFT model")
    twin = a.twinx()
    twin.plot(steps, [r["objective/kl_coef"] for r in train], color="C3", ls="--", label="kl_coef (right axis)")
    twin.set_ylabel("kl_coef")
    twin.legend(fontsize=8, loc="lower right")
    a = axes[2]
    a.plot(steps, [r["loss/value"] for r in train], label="value loss")
    a.set(xlabel="step", ylabel="value loss", title="the critic")
    twin = axes[2].twinx()
    twin.plot(steps, [max(-1.0, r["value/explained_variance"]) for r in train], color="C2",
              label="explained variance (right)")
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


def kl_in_band(train: list[dict], steps: int, target: float) -> tuple[float, float]:
    """The share of the second half's steps whose KL was within ±30% of the target: one batch's KL (64 samples, noisy)
    and its mean over the last 10 steps."""
    kls = [r["objective/kl"] for r in train]
    smooth = [sum(kls[max(0, i - 9):i + 1]) / len(kls[max(0, i - 9):i + 1]) for i in range(len(kls))]
    half = [i for i, r in enumerate(train) if r["step"] > steps // 2]
    share = lambda xs: sum(abs(xs[i] / target - 1) <= 0.3 for i in half) / max(1, len(half))  # noqa: E731
    return share(kls), share(smooth)


def report(cfg: Config, run: common.Run, before: dict, after: dict, seconds: float, memory: dict) -> dict:
    """The figures, the printed summary, eval.json, samples.md, report.md and summary.json."""
    out = run.out
    records = read_jsonl(out / "metrics.jsonl")
    curves(out, records, cfg)
    train = [r for r in records if "objective/kl" in r]
    in_band, in_band_smooth = kl_in_band(train, cfg.steps, cfg.kl_target)
    last = train[-10:]
    kl = sum(r["objective/kl"] for r in last) / max(1, len(last))
    step_s = sum(r["time/rollout_s"] + r["time/update_s"] for r in train) / max(1, len(train))
    band = (f"within ±30% of the target {cfg.kl_target}: the 10-step mean KL at {in_band_smooth:.0%} of the steps, "
            f"one batch's KL at {in_band:.0%}")
    print(f"after {cfg.steps} steps ({seconds / 60:.1f} min, {step_s:.2f} s per step): {describe(after, cfg)}; "
          f"sampled KL {kl:.2f} nats per completion (mean of the last 10 steps)"
          + (f"; second half {band}" if cfg.kl_ctl == "adaptive" else ""))
    strip = lambda d: {k: v for k, v in d.items() if k not in ("samples", "gold_each", "proxy_each", "completions")}  # noqa: E731
    flags = common.flags_record(cfg)
    result = {"task": cfg.task, "reward": cfg.reward, "critic": cfg.critic, "kl_ctl": cfg.kl_ctl,
              "kl_coef": cfg.kl_coef, "kl_target": cfg.kl_target, "kl_coef_final": train[-1]["objective/kl_coef"],
              "kl_in_band_second_half": in_band, "kl_in_band_second_half_smoothed": in_band_smooth,
              "before": strip(before), "after": strip(after), "kl": kl, "steps": cfg.steps, "seconds": seconds,
              "seconds_per_step": step_s, "seed": run.seed, "init": str(run.init), "lr": cfg.lr,
              "critic_lr": cfg.critic_lr, "prompts": cfg.prompts, "k": cfg.k, "temperature": cfg.temperature,
              "config": {k: flags[k] for k in CONFIG_KEYS}, "weights_held": memory, "device": str(run.device),
              "processes": distributed.world_size(),
              "flags": flags, "origin": common.origin(run)}
    atomic_write_text(out / "eval.json", json.dumps(result, indent=2))
    cell = common.markdown_cell
    samples = ["| prompt | response after PPO | gold |", "|---|---|---:|"]
    samples += [f"| {cell(s['prompt'])} | {cell(s['response'])} | {s['gold']:.2f} |" for s in after["samples"]]
    atomic_write_text(out / "samples.md", "\n".join(samples) + "\n")
    name = "accuracy (greedy)" if cfg.task == "word-problems" else f"gold reward (sampled, T = {cfg.temperature})"
    headline = (f"{cfg.steps} steps ({cfg.prompts * cfg.k} samples each, {cfg.epochs} epochs x {cfg.minibatches} "
                f"minibatches) in {seconds / 60:.1f} min on {run.device}, {step_s:.2f} s per step; critic: "
                f"{cfg.critic}; KL control: {cfg.kl_ctl}. Held-out {name} **{before['gold']:.3f} → "
                f"{after['gold']:.3f}** at a KL of {kl:.2f} nats per completion"
                + (f" (target {cfg.kl_target}; in the second half the 10-step mean KL was within ±30% of it at "
                   f"{in_band_smooth:.0%} of the steps, one batch's KL at {in_band:.0%})"
                   if cfg.kl_ctl == "adaptive" else "") + ".")
    atomic_write_text(out / "report.md", "\n".join([f"## Chapter 8: PPO on {cfg.task}", "", headline, "",
                                                    f"![curves]({out.name}/curves.png)", "", "\n".join(samples), ""]))
    write_summary(out, {k: v for k, v in result.items() if k not in ("config", "flags", "origin")}, cfg.quick)
    return result


# the settings eval.json lists under "config" (beside the top-level ones): what notebook 08 reads
CONFIG_KEYS = ("critic_head", "epochs", "minibatches", "clip_eps", "clip_value", "vf_coef", "ent_coef", "gamma", "lam",
               "whiten_rewards", "kl_horizon", "max_new_tokens", "missing_eos_penalty", "reward")


def main(argv=None) -> dict:
    cfg = parse_args(argv)
    runs = common.runs_of(cfg, run_name(cfg))  # one run, or one per seed (seed k from chapter 5's seed k)
    results = [common.finished_result(cfg, run) or ppo_run(cfg, run) for run in runs]
    if not cfg.seeds:
        return results[0]
    words = cfg.task == "word-problems"
    rows = common.gain_rows(results, "accuracy" if words else "gold reward (sampled)", percent=words)
    in_band = [r["kl_in_band_second_half"] for r in results]
    in_band_smooth = [r["kl_in_band_second_half_smoothed"] for r in results]
    if cfg.kl_ctl == "adaptive":
        rows["band_smooth"] = ("second-half steps with the 10-step mean KL within ±30% of the target", in_band_smooth,
                               "{:.0%}".format)
        rows["band"] = ("second-half steps with one batch's KL within ±30% of the target", in_band, "{:.0%}".format)
    text, spread = common.spread_table(rows)
    spread = {k: v for k, v in spread.items() if not k.startswith("band")}
    print(f"\n{cfg.seeds} seeds of PPO on {cfg.task}, each from the SFT model of the same seed:\n{text}")
    summary = {"seeds": list(range(cfg.seeds)), "spread": spread, "task": cfg.task, "critic": cfg.critic,
               "kl_ctl": cfg.kl_ctl, "kl_in_band_second_half": in_band,
               "kl_in_band_second_half_smoothed": in_band_smooth}
    common.write_sweep(runs[0].out.parent, "ch08_ppo.py", argv, text, summary, cfg.quick)
    return summary


if __name__ == "__main__":
    cli.run(main)
