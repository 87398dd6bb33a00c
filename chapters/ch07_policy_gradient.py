"""Chapter 7: policy gradients (REINFORCE, RLOO, GRPO, Dr. GRPO) on the SFT model.

Each step samples --k completions for each of --prompts prompts with the policy (dropout off, --temperature 0.7),
scores them, and takes a policy-gradient step (llm_from_scratch/policy_gradient.py). The SFT model is both
the starting policy and the frozen reference of the KL penalty.

  --task word-problems   RL from verifiable rewards: the gold reward is 1 when the final number is right.
                         Held-out greedy accuracy on the SFT validation word problems, before, during, after.
  --task stories         RLHF: the reward is the chapter-6 reward model (--reward rm, the default here), and
                         the gold story reward, which the policy never sees, is logged beside it.

Writes runs/pg_<task>_<algo>/ (_<loss-type> and _filter or _nofilter appended where they differ from the task's recipe):
the policy (model.safetensors, config.json, the tokenizer), metrics.jsonl (reward, gold/reward, proxy/reward,
objective/kl and kl_k3, objective/entropy, completions/*, and the step time split into generate, reference, reward
(scoring) and update; for stories the shares of samples without the asked name or object; at each evaluation
eval/greedy/* and, with --eval-samples, eval/sampled/*: llm_from_scratch/evaluation.py), rollout_samples.jsonl (at each
evaluation, the samples the trained reward liked best), eval.json (for word problems also pass@k before and after on
the same problems and draws, the kinds of wrong greedy answers before and after: slip, strategy, events, malformed,
tasks.classify_word_problem, and McNemar's exact test of the greedy answers), samples.md, curves.png, pass_at_k.png,
report.md and summary.json. An
interrupted run resumes from its last evaluation (--no-resume starts over), and a finished run of the same flags is
kept.

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
    python chapters/ch07_policy_gradient.py --ptx-coef 1            # PPO-ptx: the SFT loss mixed into each update
    python chapters/ch07_policy_gradient.py --quick                 # a smoke run (also LLMFS_QUICK=1)
    python chapters/ch07_policy_gradient.py --async                 # sample step t+1 while step t updates (appendix B)
    torchrun --standalone --nproc_per_node=2 chapters/ch07_policy_gradient.py   # 2 processes share each step's prompts

Under torchrun --prompts is the step's global number: each rank samples its share (a prompt's k samples on one rank)
with its own random stream; the update averages the gradients (policy_gradient.pg_update); rank 0 alone evaluates,
records and saves, and the checkpoint keeps every rank's stream.

With --async a worker process samples step t+1's batch with the weights of step t while step t's update runs (one
step off-policy): each token's loss is weighted by min(π_old / μ, --is-cap), and metrics.jsonl logs offpolicy/ratio,
ratio_max and capped (llm_from_scratch/async_rollouts.py states the estimator and its bias). A resumed run's first
batch is sampled by the weights it updates, so it is not bit for bit the uninterrupted run.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from tqdm import tqdm

import cli  # chapters/cli.py: common flags, one-line errors (also puts the repository on sys.path)
import common  # chapters/common.py: the RL tasks' data, resuming, seed sweeps
from llm_from_scratch import distributed, gold_rewards
from llm_from_scratch.checkpoint import append_metrics, atomic_write_text, read_jsonl
from llm_from_scratch.course import prerequisite, quick_mode, require_real, start_run, write_summary
from llm_from_scratch.device import seed_everything
from llm_from_scratch.evaluation import eval_record as schema_record
from llm_from_scratch.evaluation import greedy_eval, mcnemar_exact, sampled_eval
from llm_from_scratch.lora import trainable_parameters
from llm_from_scratch.plots import save
from llm_from_scratch.policy_gradient import (
    ALGOS,
    LOSS_TYPES,  # --loss-type's choices, and what each means (normalisation)
    MovingAverageBaseline,
    PGConfig,
    normalisation,
    pass_at_k,
    pg_update,
    rollout,
)
from llm_from_scratch.ppo import weights_held  # bytes of weights each network holds
from llm_from_scratch.reward_model import RewardModel, reward_fn
from llm_from_scratch.sft import answer
from llm_from_scratch.tokenizer import Tokenizer
from llm_from_scratch.train import fused_if_cuda

# Each task's recipe where the command line is silent. Word problems: RLOO with DAPO's token-level loss and its group
# filter at lr 5e-5 gained the most of the four recipes measured from the course's SFT model (README, chapter 7).
# Stories: the reward model's scores of a prompt's samples are never all equal, so the filter has nothing to do there,
# and the arena's story runs keep each estimator's own aggregation at lr 2e-5. A word problem's worked answer is at
# most 138 tokens (each event's sentence restated before its sum), a story's well under 128.
TASK_DEFAULTS = {"word-problems": {"lr": 5e-5, "loss_type": "dapo", "filter_groups": True, "max_new_tokens": 144},
                 "stories": {"lr": 2e-5, "loss_type": None, "filter_groups": False, "max_new_tokens": 128}}


@dataclass(frozen=True)
class Config(common.CommonFlags, common.LoRAFlags, common.AsyncFlags, common.PTXFlags):
    """Every flag, after the task's recipe and quick mode filled in the defaults: parsed once, never changed."""
    algo: str = "rloo"
    task: str = "word-problems"
    reward: str = "gold"  # what the policy is trained on: "gold" or "rm" (the chapter-6 reward model)
    init: Path | None = None
    steps: int = 100
    prompts: int = 8  # prompts per step
    k: int = 8  # samples per prompt
    lr: float = 5e-5
    beta: float = 0.02
    kl_in: str = "reward"
    inner_epochs: int = 1
    loss_type: str | None = "dapo"  # None: the algorithm's own
    filter_groups: bool = True
    temperature: float = 0.7
    max_new_tokens: int = 144
    missing_eos_penalty: float = 0.0
    eval_interval: int = 20
    eval_examples: int = 1000
    pass_at_k: int = 8
    eval_samples: int = 0


def parse_args(argv=None) -> Config:
    ap = cli.parser(__doc__)
    ap.add_argument("--algo", default="rloo", choices=ALGOS, help="the estimator (default rloo)")
    ap.add_argument("--task", default="word-problems", choices=sorted(common.TASKS), help="default word-problems")
    ap.add_argument("--reward", choices=["gold", "rm"],
                    help="what the policy is trained on: the gold reward or the chapter-6 reward model "
                         "(default: gold for word problems, rm for stories)")
    ap.add_argument("--init", type=Path,
                    help="policy and reference to start from (default runs/sft); or a Hugging Face GPT-2 "
                         "folder (config.json + model.safetensors), imported once (appendix C)")
    ap.add_argument("--steps", type=int, default=100, help="policy-gradient steps (default 100)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step (default 8)")
    ap.add_argument("--k", type=int, default=8, help="samples per prompt (default 8)")
    ap.add_argument("--lr", type=cli.positive_float,
                    help="AdamW learning rate (default 5e-5 for word problems, 2e-5 for stories; with --lora-rank 10x "
                         "those)")
    ap.add_argument("--beta", type=cli.finite_float, default=0.02,
                    help="KL coefficient (default 0.02; 0 = no KL penalty)")
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
    ap.add_argument("--temperature", type=cli.finite_float, default=0.7,
                    help="sampling temperature of the rollouts; log-probs and the KL use the same (default 0.7)")
    ap.add_argument("--max-new-tokens", type=int,
                    help="completion length limit (default 144 for word problems, 128 for stories)")
    ap.add_argument("--missing-eos-penalty", type=cli.finite_float, default=0.0,
                    help="subtracted from the reward of a completion cut off without EOS (default 0)")
    ap.add_argument("--eval-interval", type=int, default=20, help="steps between held-out evaluations (default 20)")
    ap.add_argument("--eval-examples", type=int, default=1000,
                    help="held-out examples of the task to score (default 1000: all there are)")
    ap.add_argument("--pass-at-k", type=int, default=8, metavar="N",
                    help="word problems: draw N samples per held-out problem (at --temperature) from the SFT model "
                         "before training and from the policy after, the same draws, for pass@1..N: the ceiling that "
                         "reweighting its own samples can approach, and whether RL narrows it (default 8, about 50 s "
                         "each time on 2 cores; 0 skips it)")
    ap.add_argument("--eval-samples", type=int, default=0, metavar="N",
                    help="stories: at every evaluation also draw N samples of each held-out prompt at --temperature "
                         "(the same draws every time) for the sampled gold ± s.e., the proxy and the KL to the SFT "
                         "model, as chapters 8-10 do (default 0: greedy stories only)")
    ap.add_argument("--no-resume", action="store_true",
                    help="start over even if --out holds an interrupted or finished run of the same flags")
    ap.add_argument("--seeds", type=int, default=0, metavar="N",
                    help="run seeds 0..N-1, seed k from chapter 5's runs/sft_seeds/seed<k>, into "
                         "runs/pg_<task>_<algo>_seeds/, and print the spread")
    cli.add_lora_args(ap)
    cli.add_async_args(ap)
    cli.add_ptx_args(ap)
    cli.add_common_args(ap, "pg_<task>_<algo>")
    cli.add_prerequisite_arg(ap)
    a = vars(ap.parse_args(argv))
    a["quick"] = a["quick"] or quick_mode()
    a["reward"] = a["reward"] or ("gold" if a["task"] == "word-problems" else "rm")
    cli.check_lora_args(ap, a, TASK_DEFAULTS[a["task"]]["lr"])
    cli.check_async_args(ap, a)
    cli.check_ptx_args(ap, a)
    for name, value in TASK_DEFAULTS[a["task"]].items():  # the task's recipe where the command line is silent
        a[name] = value if a[name] is None else a[name]
    a["loss_type"] = None if a["loss_type"] == "own" else a["loss_type"]
    grpo = a["algo"] in ("grpo", "dr-grpo")
    a["kl_in"] = a["kl_in"] or ("loss" if grpo else "reward")
    a["inner_epochs"] = a["inner_epochs"] or (2 if grpo else 1)
    if a["seeds"] < 0:
        ap.error("--seeds must be ≥ 0")
    if a["seeds"] and a["init"]:
        ap.error("--seeds starts seed k from runs/sft_seeds/seed<k> (chapter 5's sweep); leave out --init")
    if a["temperature"] <= 0:
        ap.error("--temperature must be > 0 (RL needs samples; greedy answers are for evaluation)")
    for flag in ("steps", "prompts", "k", "max_new_tokens", "eval_interval", "inner_epochs"):
        if a[flag] < 1:
            ap.error(f"--{flag.replace('_', '-')} must be ≥ 1")
    if a["eval_samples"] < 0:
        ap.error("--eval-samples must be ≥ 0")
    if a["k"] < 2 and a["algo"] != "reinforce":
        ap.error(f"--algo {a['algo']} compares samples of one prompt: --k must be ≥ 2")
    if a["k"] < 2 and a["filter_groups"]:
        ap.error("--filter-groups (on by default for word problems) compares the samples of one prompt: --k must be "
                 "≥ 2, or add --no-filter-groups")
    if a["quick"]:
        a.update(steps=4, prompts=2, k=4, max_new_tokens=24, eval_interval=2, eval_examples=8,
                 pass_at_k=min(a["pass_at_k"], 2))
    return Config(**a)


def run_name(cfg: Config) -> str:
    """The default folder's name: pg_<task>_<algo>, then _<loss-type> (or _own) and _filter (or _nofilter) where those
    differ from the task's recipe (TASK_DEFAULTS), so such a run never overwrites the default run later chapters
    read."""
    recipe = TASK_DEFAULTS[cfg.task]
    return (f"pg_{cfg.task}_{cfg.algo}"
            + (f"_{cfg.loss_type or 'own'}" if cfg.loss_type != recipe["loss_type"] else "")
            + (("_filter" if cfg.filter_groups else "_nofilter") if cfg.filter_groups != recipe["filter_groups"]
               else "")
            + (f"_lora{cfg.lora_rank}" if cfg.lora_rank else "") + ("_async" if cfg.async_rollouts else "")
            + (f"_ptx{cfg.ptx_coef:g}" if cfg.ptx_coef else ""))


def pg_config(cfg: Config) -> PGConfig:
    """The update's settings (eval.json records them under "config")."""
    return PGConfig(algo=cfg.algo, k=cfg.k, beta=cfg.beta, kl_in=cfg.kl_in, inner_epochs=cfg.inner_epochs,
                    max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, loss_type=cfg.loss_type,
                    filter_groups=cfg.filter_groups, is_cap=cfg.is_cap, ptx_coef=cfg.ptx_coef)


def score_name(task: str) -> str:
    return "accuracy" if task == "word-problems" else "gold reward"


def greedy_key(task: str) -> str:
    """The metrics.jsonl key of the greedy held-out score: the accuracy for word problems, the gold reward for
    stories."""
    return "eval/greedy/accuracy" if task == "word-problems" else "eval/greedy/gold"


def eval_record(result: dict) -> dict:
    """The metrics.jsonl keys of one held-out evaluation, in the one schema (evaluation.eval_record):
    eval/greedy/accuracy (word problems) or eval/greedy/gold (stories), eval/greedy/proxy and ended; with
    --eval-samples also eval/sampled/gold, gold_se, proxy, kl, kl_k3, length."""
    record = schema_record(result, "eval/greedy")
    if "sampled" in result:
        record.update(schema_record(result["sampled"], "eval/sampled"))
    return record


def sampled_pass_at_k(policy, tok, examples: list[dict], n: int, temperature: float, seed: int) -> dict[int, float]:
    """pass@k for k = 1, 2, 4, .. n: n sampled answers to each held-out problem, each k scored without bias."""
    generator = torch.Generator(device=next(policy.parameters()).device).manual_seed(seed)
    answers = answer(policy, tok, [e["prompt"] for e in examples for _ in range(n)], temperature=temperature,
                     generator=generator)
    right = [sum(gold_rewards.gold_reward(e, answers[i * n + j][0]) for j in range(n)) for i, e in enumerate(examples)]
    ks = [k for k in (1, 2, 4, 8, 16, 32, 64) if k <= n]
    return {k: sum(pass_at_k(n, int(c), k) for c in right) / len(examples) for k in ks}


def pg_run(cfg: Config, run: common.Run) -> dict:
    """One policy-gradient run from the SFT model in run.init into run.out; returns what eval.json holds."""
    out, seed, device = run.out, run.seed, run.device
    seed_everything(seed)
    tok = Tokenizer.load(run.init)
    policy, reference = common.policy_and_reference(cfg, run, tok)  # with --lora-rank: one network, adapters off
    rm = rm_dir = None
    if cfg.reward == "rm" or cfg.task == "stories":
        with distributed.main_first():  # under torchrun rank 0 builds it if it is missing
            rm_dir = prerequisite("reward_model", cfg.quick, build=not cfg.no_build)
        require_real(rm_dir, cfg.quick)
        rm = RewardModel.load(rm_dir, device=device, vocab_size=tok.vocab_size).requires_grad_(False)
    data = common.task_data(cfg.task, cfg.quick, cfg.eval_examples)
    rm_fn = reward_fn(rm, tok) if rm is not None else None
    train_fn = data.gold_fn if cfg.reward == "gold" else rm_fn
    proxy_fn = None if cfg.reward == "gold" else rm_fn  # what held-out answers score on the trained reward
    update_cfg = pg_config(cfg)
    params = trainable_parameters(policy)  # fused AdamW on a CUDA GPU (train.fused_if_cuda), as it was elsewhere
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0, **fused_if_cuda(params))
    baseline = MovingAverageBaseline()
    ptx = common.ptx_batches(cfg, cfg.quick, tok, policy.config.context_length, seed, device)  # PPO-ptx: SFT batches
    print(f"{cfg.algo} on {cfg.task} ({len(data.train_prompts):,} training prompts, {len(data.held_out)} held out), "
          f"reward: {'gold' if cfg.reward == 'gold' else 'the reward model'}; {cfg.prompts} prompts x {cfg.k} samples "
          f"per step, β = {cfg.beta} (KL in the {cfg.kl_in}), lr {cfg.lr}, {cfg.steps} steps; the per-token loss "
          f"aggregated as \"{normalisation(cfg.algo, cfg.loss_type)}\" ("
          + (f"--loss-type {cfg.loss_type}" if cfg.loss_type else f"{cfg.algo}'s own") + ")"
          + ("; prompts whose samples all got the same reward left out of the update (--filter-groups)"
             if cfg.filter_groups else ""))

    def evaluate() -> dict:
        """Greedy answers to the held-out prompts (evaluation.greedy_eval); for stories with --eval-samples N, also
        the sampled evaluation of chapters 8-10 (evaluation.sampled_eval) under "sampled"."""
        result = greedy_eval(policy, tok, data.held_out, proxy_fn)
        if cfg.task == "stories" and cfg.eval_samples:
            sampled = sampled_eval(policy, reference, tok, data.held_out, cfg.eval_samples, cfg.temperature,
                                   cfg.max_new_tokens, proxy_fn, seed)
            keys = ("gold", "gold_se", "proxy", "has_proxy", "kl", "kl_k3", "n", "length")
            result["sampled"] = {k: sampled[k] for k in keys}
        return result

    weights = common.last_weights(policy)  # what out/last/ holds, for resuming
    state = common.resume(run, cfg, weights, optimizer, logs=("metrics.jsonl", "rollout_samples.jsonl"))
    start, before = (state["step"], json.loads(state["before"])) if state else (0, None)
    if before and "pass_at_k" in before:  # JSON made its keys strings
        before["pass_at_k"] = {int(k): v for k, v in before["pass_at_k"].items()}
    baseline.value = state["baseline"] if state else baseline.value
    rank0, W = distributed.is_main(), distributed.world_size()
    forward = distributed.wrap(policy)  # DDP under torchrun: the update's gradients averaged over the ranks
    if rank0:
        start_run(out)
    if before is None and rank0:  # rank 0 evaluates and writes; the others go on to the first step and wait there
        before = evaluate()
        if cfg.task == "word-problems" and cfg.pass_at_k:
            t0 = time.perf_counter()
            before["pass_at_k"] = sampled_pass_at_k(policy, tok, data.held_out, cfg.pass_at_k, cfg.temperature, seed)
            print(f"SFT model, {cfg.pass_at_k} samples per held-out problem at T = {cfg.temperature} "
                  f"({time.perf_counter() - t0:.0f} s): "
                  + ", ".join(f"pass@{k} {v:.3f}" for k, v in before["pass_at_k"].items()))
        append_metrics(out / "metrics.jsonl", {"step": 0, **eval_record(before)})
    if rank0:
        print(f"before: held-out {score_name(cfg.task)} {before['gold']:.3f}")

    # the rollouts' random numbers (each rank its own stream under torchrun)
    generator = torch.Generator(device=device).manual_seed(seed + 7919 * distributed.rank())
    if state:  # where the interrupted run's were: a resumed run samples what an uninterrupted one would have
        common.restore_streams(generator, state)
    def prompts_of(step: int) -> list[str]:  # this rank's share of the step's prompts (all of them in one process)
        prompts = common.batch_prompts(data.train_prompts, step, cfg.prompts)
        return prompts[distributed.shard_rows(len(prompts))] if W > 1 else prompts

    t_start = time.perf_counter()
    bar = tqdm(range(start, cfg.steps), desc=cfg.algo, unit="step", disable=cfg.quiet or not rank0,
               dynamic_ncols=True)
    with common.rollout_worker(cfg, run, rm_dir, generator) as worker:  # --async: the sampler in its own process
        if worker is not None and start < cfg.steps:
            worker.submit(policy, prompts_of(start))  # the first batch: sampled with the weights before any update
        for step in bar:
            t0 = time.perf_counter()
            if worker is None:
                ro = rollout(policy, reference, tok, prompts_of(step), cfg.k, train_fn,  # gold is always logged;
                             None if cfg.reward == "gold" else data.gold_fn,  # when it is the reward, the rollout
                             cfg.max_new_tokens, cfg.temperature, cfg.missing_eos_penalty, generator)  # copies it
            else:  # sampled one update ago; the next batch is sampled with these weights while this update runs
                ro = worker.receive()
                generator.set_state(worker.stream)  # the worker's stream, for the checkpoint
                if step + 1 < cfg.steps:
                    worker.submit(policy, prompts_of(step + 1))
            t1 = time.perf_counter()
            metrics = pg_update(forward, optimizer, ro, update_cfg, baseline,  # every rank's batch: the same numbers
                                ptx(step) if ptx else None)
            t2 = time.perf_counter()
            common.require_finite_metrics(metrics, ("loss/policy", "loss/ptx"), step + 1, out)
            if cfg.task == "stories":
                parts = common.story_parts([data.by_prompt[p]["spec"] for p in ro.prompts], ro.completions)
                metrics.update(common.shared_shares(parts, len(ro.prompts)))
            record = common.step_record(step + 1, metrics, ro, t1 - t0, t2 - t1)
            evaluating = (step + 1) % cfg.eval_interval == 0 or step + 1 == cfg.steps
            streams = common.rollout_streams(generator) if evaluating else None  # every rank's, for the checkpoint
            if rank0:  # rank 0 evaluates, records and saves
                if evaluating:
                    record.update(eval_record(evaluate()))
                    for row in common.top_samples(ro, step + 1, data.by_prompt, cfg.task):
                        append_metrics(out / "rollout_samples.jsonl", row)
                append_metrics(out / "metrics.jsonl", record)
                if evaluating:  # the checkpoint after the records it covers: a kill between the two loses nothing
                    common.save_last(out, weights)
                    common.save_state(run, cfg, step + 1, optimizer, weights, **streams, baseline=baseline.value,
                                      before=json.dumps(before))
            bar.set_postfix(reward=f"{metrics['reward']:.3f}", kl=f"{metrics['objective/kl']:.3f}")
    seconds = time.perf_counter() - t_start
    if not rank0:  # rank 0 evaluates the trained policy and writes the run; every rank returns its result
        return distributed.broadcast_object(None)

    after = evaluate()
    if cfg.task == "word-problems" and cfg.pass_at_k:  # the same problems and draws as before: does RL narrow pass@k?
        after["pass_at_k"] = sampled_pass_at_k(policy, tok, data.held_out, cfg.pass_at_k, cfg.temperature, seed)
    common.save_policy(policy, out)  # a LoRA policy with its adapters folded in
    tok.save(out)
    held = {**common.policy_held(cfg, policy, reference), **({"reward model": rm} if rm is not None else {})}
    return distributed.broadcast_object(report(cfg, run, before, after, seconds, weights_held(held)))


def report(cfg: Config, run: common.Run, before: dict, after: dict, seconds: float, held: dict) -> dict:
    """The figures, the printed summary, McNemar's test, eval.json, samples.md, report.md and summary.json."""
    out = run.out
    records = read_jsonl(out / "metrics.jsonl")
    curves(out, records, cfg.task, before.get("pass_at_k"))
    last = [r for r in records if "objective/kl" in r][-10:]
    kl = sum(r["objective/kl"] for r in last) / max(1, len(last))  # k1: unbiased, can dip below 0 on a batch
    kl3 = sum(r["objective/kl_k3"] for r in last) / max(1, len(last))  # k3: never below 0
    if cfg.filter_groups:  # what DAPO's filter left the updates (it does not refill the batch)
        steps = [r for r in records if "train/rows" in r]
        used = sum(r["train/rows"] for r in steps) / max(1, len(steps) * cfg.prompts * cfg.k)
        skipped = sum(r["train/skipped_step"] for r in steps)
        print(f"--filter-groups: the updates used {used:.1%} of the sampled rows; {skipped:.0f} of {len(steps)} steps "
              "had no group left and did no update")
    name = score_name(cfg.task)
    print(f"after {cfg.steps} steps ({seconds / 60:.1f} min): held-out {name} {before['gold']:.3f} -> "
          f"{after['gold']:.3f} at KL {kl:.3f} (k1) / {kl3:.3f} (k3) nats per sequence (mean of the last 10 steps)"
          + (f"; sampled at T = {cfg.temperature}: gold {before['sampled']['gold']:.3f} -> "
             f"{after['sampled']['gold']:.3f} ± {after['sampled']['gold_se']:.3f}, held-out KL "
             f"{after['sampled']['kl']:.2f}" if "sampled" in after else ""))
    mcnemar = None
    if cfg.task == "word-problems" and "gold_each" in before:  # the same problems before and after: a paired test
        mcnemar = mcnemar_exact(before["gold_each"], after["gold_each"])
        print(f"McNemar's exact test on the {len(before['gold_each'])} held-out problems: {mcnemar['b']} right before "
              f"and wrong after, {mcnemar['c']} wrong before and right after, p = {mcnemar['p_value']:.2g}")
    if "errors" in before and "errors" in after:  # what kind of mistakes RL removed (tasks.classify_word_problem)
        print("wrong answers, share of the held-out problems before -> after: " + ", ".join(
            f"{kind} {before['errors'][kind]:.1%} -> {after['errors'][kind]:.1%}" for kind in before["errors"]))
    if "pass_at_k" in before and "pass_at_k" in after:
        pass_at_k_figure(out, before["pass_at_k"], after["pass_at_k"], cfg.temperature)
        print(f"pass@k over {cfg.pass_at_k} samples at T = {cfg.temperature}, before -> after: " + ", ".join(
            f"@{k} {before['pass_at_k'][k]:.3f} -> {after['pass_at_k'][k]:.3f}" for k in before["pass_at_k"]))
    result = {"algo": cfg.algo, "task": cfg.task, "reward": cfg.reward, "mcnemar": mcnemar,
              "before": {k: v for k, v in before.items() if k != "samples"},
              "after": {k: v for k, v in after.items() if k != "samples"}, "kl": kl, "kl_k3": kl3, "steps": cfg.steps,
              "seconds": seconds, "seed": run.seed, "init": str(run.init), "config": vars(pg_config(cfg)),
              "lr": cfg.lr, "prompts": cfg.prompts, "eval_samples": cfg.eval_samples if cfg.task == "stories" else 0,
              "weights_held": held, "device": str(run.device), "processes": distributed.world_size(),
              "flags": common.flags_record(cfg),
              "origin": common.origin(run)}
    atomic_write_text(out / "eval.json", json.dumps(result, indent=2))
    cell = common.markdown_cell
    samples = ["| prompt | response after RL | gold |", "|---|---|---:|"]
    samples += [f"| {cell(s['prompt'])} | {cell(s['response'])} | {s['gold']:.2f} |" for s in after["samples"]]
    atomic_write_text(out / "samples.md", "\n".join(samples) + "\n")
    headline = (f"{cfg.steps} steps ({cfg.prompts} prompts x {cfg.k} samples) in {seconds / 60:.1f} min on "
                f"{run.device}; reward: {cfg.reward}; β = {cfg.beta}. Held-out {name} **{before['gold']:.3f} → "
                f"{after['gold']:.3f}** at a KL of {kl:.3f} nats per sequence.")
    anatomy = []
    if "errors" in before and "errors" in after:
        anatomy += ["| wrong answers (share of the held-out problems) | before | after |", "|---|---:|---:|"]
        anatomy += [f"| {kind} | {before['errors'][kind]:.1%} | {after['errors'][kind]:.1%} |"
                    for kind in before["errors"]]
        anatomy.append("")
    if "pass_at_k" in before and "pass_at_k" in after:
        anatomy += [f"pass@k over {cfg.pass_at_k} samples per problem at T = {cfg.temperature}, before → after: "
                    + ", ".join(f"@{k} {before['pass_at_k'][k]:.3f} → {after['pass_at_k'][k]:.3f}"
                                for k in before["pass_at_k"]), "", f"![pass@k]({out.name}/pass_at_k.png)", ""]
    atomic_write_text(out / "report.md", "\n".join([f"## Chapter 7: {cfg.algo} on {cfg.task}", "", headline, "",
                                                    f"![curves]({out.name}/curves.png)", "", *anatomy,
                                                    "\n".join(samples), ""]))
    write_summary(out, {k: v for k, v in result.items() if k not in ("config", "flags", "origin")}, cfg.quick)
    return result


def curves(out: Path, records: list[dict], task: str, ceiling: dict | None = None) -> None:
    """The sampled rewards (and their moving average over 10 steps) and the held-out score; the KL (k1 and k3); for
    stories the gold parts the reward model cannot see, for word problems the kinds of wrong greedy answers."""
    train = [r for r in records if "reward" in r]
    steps = [r["step"] for r in train]
    evals = [r for r in records if greedy_key(task) in r]
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.5))
    a1, a2, a3 = axes
    trained = [r["proxy/reward"] for r in train]
    a1.plot(steps, trained, alpha=0.3, label="sampled: trained reward")
    window = [sum(trained[max(0, i - 9):i + 1]) / len(trained[max(0, i - 9):i + 1]) for i in range(len(trained))]
    a1.plot(steps, window, color="C0", label="sampled: trained reward, mean of the last 10 steps")
    if task == "stories":
        a1.plot(steps, [r["gold/reward"] for r in train], alpha=0.6, label="sampled: gold reward")
    a1.plot([r["step"] for r in evals], [r[greedy_key(task)] for r in evals], marker="o",
            label="held out, greedy: " + score_name(task))
    top = max((int(k) for k in ceiling or {}), default=0)
    for k, value in (ceiling or {}).items():  # the SFT model's pass@k: what reweighting its samples can reach
        if int(k) in (1, 4, top):
            a1.axhline(value, ls=":", color="grey")
            a1.annotate(f"SFT pass@{k}", (steps[0] if steps else 0, value), fontsize=7, color="grey", va="bottom")
    a1.set(xlabel="step", ylabel="reward")
    a2.plot(steps, [r["objective/kl"] for r in train], label="KL (k1, per sequence)")
    a2.plot(steps, [r["objective/kl_k3"] for r in train], label="KL (k3, per sequence)")
    a2.set(xlabel="step", ylabel="nats")
    if task == "stories":  # the two parts of the gold reward that the reward model cannot see
        for key, label in (("gold/wrong_name", "without the asked name"),
                           ("gold/wrong_object", "without the asked object")):
            a3.plot(steps, [r[key] for r in train], alpha=0.7, label=label)
        a3.set(xlabel="step", ylabel="share of sampled stories")
    else:  # what kind of mistake each wrong greedy answer is (tasks.classify_word_problem)
        for kind in ("strategy", "slip", "events", "malformed"):
            key = f"eval/greedy/errors/{kind}"
            a3.plot([r["step"] for r in evals if key in r], [r[key] for r in evals if key in r], marker="o",
                    label=kind)
        a3.set(xlabel="step", ylabel="share of held-out problems", title="wrong greedy answers, by kind")
    for a in axes:
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    save(fig, out / "curves.png")


def pass_at_k_figure(out: Path, before: dict, after: dict, temperature: float) -> None:
    """pass@k against k before and after RL, on the same held-out problems and draws."""
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for name, values in (("SFT model", before), ("after RL", after)):
        ks = sorted(int(k) for k in values)
        ax.plot(ks, [values.get(k, values.get(str(k))) for k in ks], marker="o", label=name)
    ax.set(xscale="log", xlabel="k (samples per problem)", ylabel="pass@k",
           title=f"held-out word problems, T = {temperature}")
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, out / "pass_at_k.png")


def main(argv=None) -> dict:
    cfg = parse_args(argv)
    runs = common.runs_of(cfg, run_name(cfg))  # one run, or one per seed (seed k from chapter 5's seed k)
    results = [common.finished_result(cfg, run) or pg_run(cfg, run) for run in runs]
    if not cfg.seeds:
        return results[0]
    text, spread = common.spread_table(common.gain_rows(results, score_name(cfg.task)))
    print(f"\n{cfg.seeds} seeds of {cfg.algo} on {cfg.task}, each from the SFT model of the same seed:\n{text}")
    summary = {"seeds": list(range(cfg.seeds)), "spread": spread, "algo": cfg.algo, "task": cfg.task}
    common.write_sweep(runs[0].out.parent, "ch07_policy_gradient.py", argv, text, summary, cfg.quick)
    return summary


if __name__ == "__main__":
    cli.run(main)
