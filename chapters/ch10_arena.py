"""Chapter 10: the arena. Every method of chapters 5-9, and two that need no reward gradient, on the same held-out
prompts, scored by one evaluation (llm_from_scratch/arena.py).

The methods, each from chapter 5's SFT model:

  SFT                   chapter 5's model itself (runs/sft)
  best-of-N             N samples of the SFT model per prompt, the one the reward model likes best; N = 1, 2, 4 .. 64,
                        from --bon-samples samples per held-out prompt (the expected best-of-N over all subsets)
  RFT                   rejection-sampling fine-tuning: --rft-rounds rounds of sampling 8 stories per prompt, keeping
                        each prompt's best by the reward model, and fine-tuning on those with the SFT loss
  REINFORCE, RLOO, GRPO chapter 7's estimators against the reward model on stories, --rl-steps steps at T = 1.0
                        (chapter 7's script, run by this one into runs/arena/<algo>/)
  RLOO, β = 0           the same RLOO with no KL penalty at 5x the learning rate, 1e-4 (runs/arena/rloo_beta0/):
                        nothing holds it near the SFT model, so it shows over-optimisation: the proxy it climbs
                        against gold
  PPO                   chapter 8's default run (runs/ppo_stories)
  DPO                   chapter 9's default run (runs/dpo)
  RLOO (word problems)  chapter 7's default run, trained on the verifiable reward (runs/pg_word-problems_rloo)

The evaluation, the same for every checkpoint: --eval-samples samples of each of the 123 distinct held-out story
prompts at T = 1.0 (the same random numbers for every checkpoint, and the same draws chapters 8 and 9 evaluate with):
the gold reward ± s.e., the reward model's score (the proxy), the KL to the SFT model from those samples (k1 and k3)
and the mean length; distinct-1/2 of one sample per prompt (the same count of stories for every method); and the
greedy accuracy on the 605 held-out word problems. Best-of-N's KL is its analytic bound log N − (N − 1)/N. A
checkpoint's evaluation is kept in runs/arena/eval/ under a hash of its weights, so a rerun evaluates only what
changed.

Writes runs/arena/: table.md and table.json (every method; the chapters' own recorded numbers beside the arena's where
their settings match), frontier.png (gold and proxy against √KL: best-of-N as a curve, every RL run as its trajectory
over training), best_of_n.json, samples.md (every method's answer to the same prompts), report.md and summary.json;
runs/arena/rft/ (the RFT policy and its metrics) and runs/arena/<algo>/ (chapter 7's runs). Finished pieces are kept;
--no-resume redoes them.

--seeds N runs the whole chain again for seeds 1..N-1 (chapters 5-9 with --seed k, from the same pretrained model, in
runs/arena_seeds/seed<k>/; seed 0 is the course's own chain in runs/), then this arena for each, and writes
runs/arena_seeds/: table.md (every method's gain as median and [min, max] over the seeds, each seed's gain ± s.e., and
the differences between two methods that hold in every seed: the only ones to call), frontier.png (median and range),
seeds.json. Each seed's chain takes about as long as the course from chapter 5 on.

    python chapters/ch10_arena.py            # runs (or reuses) every method, then the evaluation
    python chapters/ch10_arena.py --seeds 3  # the same for three chains, and the spread over them
    python chapters/ch10_arena.py --quick    # a smoke run (also LLMFS_QUICK=1)
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from statistics import median
from typing import NamedTuple

import matplotlib.pyplot as plt
import torch
from tqdm import tqdm

import cli  # chapters/cli.py: common flags, one-line errors (also puts the repository on sys.path)
import common  # chapters/common.py: the RL tasks' prompts and held-out examples
from llm_from_scratch import (
    gold_rewards,
    ppo,  # chapter 8's weights_held: the bytes of weights each network holds
)
from llm_from_scratch.arena import (
    RFTConfig,
    best_of_n_curve,
    best_of_n_expected,
    distinct_n,
    evaluate,
    rft_round,
    weights_digest,
)
from llm_from_scratch.checkpoint import append_metrics, atomic_write_text, read_jsonl
from llm_from_scratch.course import (
    finished_run,
    prerequisite,
    quick_mode,
    require_real,
    runs_root,
    same_cpu_mode,
    shown,
    start_run,
    write_summary,
)
from llm_from_scratch.device import pick_device, seed_everything
from llm_from_scratch.evaluation import eval_record, mcnemar_exact, paired_gain
from llm_from_scratch.plots import save
from llm_from_scratch.reward_model import RewardModel, reward_fn
from llm_from_scratch.sft import answer
from llm_from_scratch.tokenizer import Tokenizer
from llm_from_scratch.train import fused_if_cuda, load_gpt, save_gpt

# label -> (its folder under runs/arena/, chapter 7's --algo, its other flags), --rl-steps each: the three
# estimators at chapter 7's KL penalty, then RLOO with none at all (β = 0) and 5x the learning rate, to show what
# over-optimising the proxy does to gold (at 2e-5 and β = 0, 200 steps only flattened gold while the proxy rose)
RL_RUNS = {"REINFORCE": ("reinforce-baseline", "reinforce-baseline", []), "RLOO": ("rloo", "rloo", []),
           "GRPO": ("grpo", "grpo", []), "RLOO, β = 0": ("rloo_beta0", "rloo", ["--beta", "0", "--lr", "1e-4"])}
CHAPTER_RUNS = {"PPO": "ppo_stories", "DPO": "dpo", "RLOO (word problems)": "pg_word-problems_rloo"}
# appendix A's LoRA runs of chapters 8 and 9 (--lora-rank R), shown beside the full fine-tuning they mirror when
# present and finished: their "weights held" has no second copy for the reference
LORA_RUNS = {"PPO, LoRA r={}": "ppo_stories_lora{}", "DPO, LoRA r={}": "dpo_lora{}"}
BON_SHOWN = (4, 16, 64)  # the best-of-N rows of the table (the frontier draws every power of 2)


def parse_args(argv=None):
    ap = cli.parser(__doc__)
    ap.add_argument("--eval-samples", type=int, default=4,
                    help="samples per held-out story prompt in the evaluation (default 4, as chapter 8)")
    ap.add_argument("--bon-samples", type=int, default=64,
                    help="best-of-N: samples of the SFT model per held-out prompt; N runs over 1, 2, 4 .. this "
                         "(default 64)")
    ap.add_argument("--rl-steps", type=int, default=100,
                    help="REINFORCE, RLOO and GRPO: steps on stories (default 100)")
    ap.add_argument("--rl-eval-interval", type=int, default=25,
                    help="REINFORCE, RLOO and GRPO: steps between held-out evaluations (default 25)")
    ap.add_argument("--rft-rounds", type=int, default=4, help="RFT: sample-keep-fine-tune rounds (default 4)")
    ap.add_argument("--rft-prompts", type=int, default=128, help="RFT: fresh story prompts per round (default 128)")
    ap.add_argument("--rft-k", type=int, default=8, help="RFT: samples per prompt (default 8)")
    ap.add_argument("--rft-keep", type=cli.finite_float, default=0.125,
                    help="RFT: the fraction of each prompt's samples kept (default 0.125: the best of 8)")
    ap.add_argument("--rft-lr", type=cli.positive_float, default=3e-5, help="RFT: AdamW learning rate (default 3e-5)")
    ap.add_argument("--no-resume", action="store_true",
                    help="redo every piece (RL runs, RFT, best-of-N samples, evaluations) even if runs/arena holds it")
    ap.add_argument("--seeds", type=int, default=0, metavar="N",
                    help="the whole chain from chapter 5 on for seeds 0..N-1 (seed 0: runs/; seed k: runs/arena_seeds/"
                         "seed<k>/, sharing chapters 1-4), then every method's gain as median and range over the seeds "
                         "in runs/arena_seeds/")
    cli.add_common_args(ap, "arena")
    cli.add_prerequisite_arg(ap)
    args = ap.parse_args(argv)
    args.quick = args.quick or quick_mode()
    for flag in ("eval_samples", "bon_samples", "rl_steps", "rl_eval_interval", "rft_rounds", "rft_prompts", "rft_k"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be ≥ 1")
    if args.seeds < 0 or args.seeds == 1:
        ap.error("--seeds must be ≥ 2 (or 0: one chain, seed --seed)")
    if not 0 < args.rft_keep <= 1:
        ap.error("--rft-keep must be in (0, 1]")
    if args.quick:
        args.eval_samples, args.bon_samples, args.rl_steps, args.rl_eval_interval = 2, 4, 4, 2
        args.rft_rounds, args.rft_prompts, args.rft_k = 2, 4, 4
    args.max_new_tokens = 24 if args.quick else 128
    args.eval_examples = 8 if args.quick else 1000  # held-out examples per task: chapters 7 and 8 use the same
    return args


# ----------------------------------------------------------------------------- the methods that train


def rl_runs(args, out: Path) -> dict[str, Path]:
    """REINFORCE, RLOO and GRPO on stories against the reward model, and RLOO at β = 0 (lr 1e-4), --rl-steps each:
    chapter 7's script, each in its own process as run_all.py runs it. A finished run is kept without starting a
    process when this arena made it with the same command and the same chapter-7 script (its record, arena_run.json);
    otherwise chapter 7 decides (it keeps a finished run of the same flags)."""
    import run_all  # chapters/run_all.py: one chapter script in its own process

    script = Path(__file__).resolve().parent / "ch07_policy_gradient.py"
    folders = {}
    for label, (name, algo, flags) in RL_RUNS.items():
        folder = out / name
        argv = ["--task", "stories", "--algo", algo, "--temperature", "1.0", "--steps", str(args.rl_steps),
                "--eval-interval", str(args.rl_eval_interval), "--eval-samples", str(args.eval_samples),
                "--seed", str(args.seed), "--out", str(folder), "--device", args.device, *flags]
        argv += ["--no-build"] if args.no_build else []
        record = {"argv": argv, "quick": args.quick, "script": hashlib.sha256(script.read_bytes()).hexdigest()}
        folders[label] = folder
        made = folder / "arena_run.json"
        if (not args.no_resume and same_cpu_mode(finished_run(folder)) and made.is_file()
                and json.loads(made.read_text(encoding="utf-8")) == record):
            print(f"--- {label}: keeping the finished run in {shown(folder)} (the same command)", flush=True)
            continue
        print(f"\n--- {label}: python chapters/ch07_policy_gradient.py {' '.join(argv)}", flush=True)
        env = dict(os.environ, LLMFS_QUICK="1" if args.quick else "0")
        run_all.run_chapter("ch07_policy_gradient.py", args.quick, args.quiet, env, args.no_resume, argv)
        atomic_write_text(made, json.dumps(record))
    return folders


def lora_dirs(root: Path, quick: bool) -> dict[str, Path]:
    """Appendix A's finished LoRA runs of chapters 8 and 9 in `root` (runs/ppo_stories_lora<R>, runs/dpo_lora<R>),
    by label; none are built (the arena's own rows need no LoRA)."""
    found = {}
    for label, pattern in LORA_RUNS.items():
        for folder in sorted(root.glob(pattern.format("*"))):
            rank = folder.name.rsplit("lora", 1)[1]
            done = finished_run(folder)
            if rank.isdigit() and done and done.get("quick", False) == quick:
                found[label.format(rank)] = folder
    return found


class Arena(NamedTuple):
    """What every method of the arena is trained and evaluated with."""
    out: Path  # runs/arena/
    tok: Tokenizer
    sft: torch.nn.Module  # the SFT model: every method's start, and the reference of every KL
    rm_fn: Callable  # chapter 6's reward model as a reward function: the proxy
    stories_rl: list[dict]  # chapter 7's RL story prompts (RFT samples these)
    stories: list[dict]  # the held-out story prompts
    problems: list[dict]  # the held-out word problems
    device: torch.device
    inputs: dict  # the digests of the SFT model's and the reward model's weights


def rft_run(args, arena: Arena, sft: Path) -> Path:
    """Rejection-sampling fine-tuning from the SFT model in `sft` into runs/arena/rft; after every round, the held-out
    evaluation."""
    out, tok, rm_fn, stories_rl, stories, device = (arena.out / "rft", arena.tok, arena.rm_fn, arena.stories_rl,
                                                    arena.stories, arena.device)
    cfg = RFTConfig(rounds=args.rft_rounds, prompts=args.rft_prompts, k=args.rft_k, keep=args.rft_keep, lr=args.rft_lr,
                    max_new_tokens=args.max_new_tokens)
    settings = {"seed": args.seed, "eval_samples": args.eval_samples, "prompts": prompts_digest(stories)}
    done = finished_run(out)
    if done and not args.no_resume and done.get("config") == vars(cfg) and done.get("settings") == settings:
        print(f"RFT: keeping the finished run in {shown(out)}")
        return out
    if out.exists():
        shutil.rmtree(out)
    start_run(out)
    seed_everything(args.seed)
    policy = load_gpt(sft, device=device, vocab_size=tok.vocab_size, dropout=0.0)
    reference = load_gpt(sft, device=device, vocab_size=tok.vocab_size, dropout=0.0).requires_grad_(False)
    params = list(policy.parameters())  # fused AdamW on a CUDA GPU (train.fused_if_cuda); unchanged elsewhere
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0, **fused_if_cuda(params))
    generator = torch.Generator(device=device).manual_seed(args.seed)
    by_prompt = {p["prompt"]: p for p in stories_rl}
    print(f"RFT: {cfg.rounds} rounds of {cfg.prompts} prompts x {cfg.k} samples, keeping each prompt's best "
          f"{max(1, round(cfg.keep * cfg.k))} by the reward model, {cfg.epochs} epochs of the SFT loss on them "
          f"at lr {cfg.lr:g}")

    def held_out(step: int, extra: dict) -> None:
        result = evaluate(policy, reference, tok, stories, [], rm_fn, args.eval_samples, 1.0, args.max_new_tokens,
                          args.seed)
        append_metrics(out / "metrics.jsonl", {"step": step, **extra, **eval_record(result, "eval/sampled")})

    t0 = time.perf_counter()
    held_out(0, {})
    bar = tqdm(range(cfg.rounds), desc="rft", unit="round", disable=args.quiet, dynamic_ncols=True)
    for r in bar:
        # fresh, then again
        prompts = [stories_rl[(r * cfg.prompts + j) % len(stories_rl)]["prompt"] for j in range(cfg.prompts)]
        metrics, kept = rft_round(policy, tok, prompts, rm_fn, cfg, optimizer, generator)
        gold = [gold_rewards.gold_reward(by_prompt[k["prompt"]], k["response"]) for k in kept]
        metrics["rft/gold_kept"] = sum(gold) / max(1, len(gold))
        held_out(r + 1, metrics)
        bar.set_postfix(kept=f"{metrics['rft/reward_kept']:+.2f}", loss=f"{metrics['loss/sft']:.3f}")
    seconds = time.perf_counter() - t0
    save_gpt(policy, out)
    tok.save(out)
    write_summary(out, {"config": vars(cfg), "settings": settings, "seconds": seconds,
                        "prompts_used": cfg.rounds * cfg.prompts}, args.quick)
    return out


def best_of_n_samples(args, arena: Arena) -> dict:
    """--bon-samples samples of the SFT model for every held-out story prompt, each with its proxy and gold score."""
    sft, tok, rm_fn, stories, inputs = arena.sft, arena.tok, arena.rm_fn, arena.stories, arena.inputs
    file = arena.out / "best_of_n.json"
    settings = {"samples": args.bon_samples, "temperature": 1.0, "max_new_tokens": args.max_new_tokens,
                "seed": args.seed, **inputs, "prompts": prompts_digest(stories)}
    if file.is_file() and not args.no_resume:
        kept = json.loads(file.read_text(encoding="utf-8"))
        if kept["settings"] == settings:
            print(f"best-of-N: keeping the {args.bon_samples} samples per prompt in {shown(file)}")
            return kept
    by_prompt = {e["prompt"]: e for e in stories}
    prompts, m = list(by_prompt), args.bon_samples
    t0 = time.perf_counter()
    generator = torch.Generator(device=next(sft.parameters()).device).manual_seed(20_000 + args.seed)
    texts, lengths = [], []
    bar = tqdm(range(0, len(prompts), 8), desc="best-of-N samples", unit="prompt", unit_scale=8, disable=args.quiet,
               dynamic_ncols=True)
    for i in bar:  # 8 prompts x m samples at a time
        chunk = [p for p in prompts[i:i + 8] for _ in range(m)]
        drawn = answer(sft, tok, chunk, args.max_new_tokens, temperature=1.0, generator=generator)
        texts += [t for t, _ in drawn]
        lengths += [len(tok.encode(t, allowed_special="all")) + int(e) for t, e in drawn]
    repeated = [p for p in prompts for _ in range(m)]
    proxy = torch.as_tensor(rm_fn(repeated, texts)).view(len(prompts), m)
    gold = torch.tensor([gold_rewards.gold_reward(by_prompt[p], t)
                         for p, t in zip(repeated, texts)]).view(len(prompts), m)
    result = {"settings": settings, "prompts": prompts, "texts": texts, "proxy": proxy.tolist(), "gold": gold.tolist(),
              "lengths": lengths, "seconds": time.perf_counter() - t0}
    atomic_write_text(file, json.dumps(result))
    return result


def best_of_n_rows(bon: dict) -> tuple[list[dict], dict[int, dict]]:
    """The best-of-N curve (N = 1, 2, 4 .. M) and, for the table's N, rows shaped like an evaluation."""
    proxy, gold = torch.tensor(bon["proxy"]), torch.tensor(bon["gold"])  # (P, M) each
    m = proxy.size(1)
    ns = [2 ** i for i in range(int(math.log2(m)) + 1)]
    curve = best_of_n_curve(proxy, gold, ns)
    first_gold, first_proxy = best_of_n_expected(proxy, gold, 1), best_of_n_expected(proxy, proxy, 1)  # (P,) N = 1
    for c in curve:  # the gain over N = 1 on the same samples, its s.e. over prompts (paired)
        gain = best_of_n_expected(proxy, gold, c["n"]) - first_gold  # (P,)
        c["gain"], c["gain_se"] = gain.mean().item(), (gain.std() / math.sqrt(gain.numel())).item()
        c["proxy_gain"] = (best_of_n_expected(proxy, proxy, c["n"]) - first_proxy).mean().item()
    lengths = torch.tensor(bon["lengths"], dtype=torch.float64).view_as(proxy)
    rows = {}
    for n in [n for n in BON_SHOWN if n <= m]:
        point = next(c for c in curve if c["n"] == n)
        picked = proxy[:, :n].argmax(dim=1)  # one realisation (the first n samples) for the texts' diversity
        texts = [bon["texts"][i * m + int(j)] for i, j in enumerate(picked)]
        rows[n] = {"gold": point["gold"], "gold_se": point["gold_se"], "proxy": point["proxy"], "kl": point["kl"],
                   "gain": point["gain"], "gain_se": point["gain_se"], "proxy_gain": point["proxy_gain"],
                   "kl_k3": None, "length": best_of_n_expected(proxy, lengths, n).mean().item(),
                   "distinct_1": distinct_n(texts, 1), "distinct_2": distinct_n(texts, 2), "texts": texts,
                   "prompts": proxy.size(0), "samples_per_prompt": m}
    return curve, rows


# ----------------------------------------------------------------------------- one evaluation for every checkpoint


def prompts_digest(examples: list[dict]) -> str:
    """A short hash of the prompts a piece of the arena was computed on (kept work is reused only on the same ones)."""
    return hashlib.sha256("\n".join(e["prompt"] for e in examples).encode()).hexdigest()[:16]


def cached_evaluation(args, arena: Arena, name: str, folder: Path) -> dict:
    """evaluate() of the checkpoint in `folder`, kept in runs/arena/eval/<name>.json under its weights' hash, the SFT
    model's and the reward model's (arena.inputs), and the settings."""
    out, tok, stories, problems, inputs = arena.out, arena.tok, arena.stories, arena.problems, arena.inputs
    policy = load_gpt(folder, device=arena.device, vocab_size=tok.vocab_size, dropout=0.0)
    key = {"weights": weights_digest(policy), "eval_samples": args.eval_samples, "temperature": 1.0,
           "max_new_tokens": args.max_new_tokens, "seed": args.seed, **inputs,
           "prompts": prompts_digest(stories + problems)}
    # e.g. RLOO_beta_0.json
    file = out / "eval" / f"{re.sub(r'[^A-Za-z0-9]+', '_', name.replace('β', 'beta')).strip('_')}.json"
    if file.is_file() and not args.no_resume:
        kept = json.loads(file.read_text(encoding="utf-8"))
        if kept["key"] == key:
            return kept["result"]
    t0 = time.perf_counter()
    result = evaluate(policy, arena.sft, tok, stories, problems, arena.rm_fn, args.eval_samples, 1.0,
                      args.max_new_tokens, args.seed)
    result = {k: v for k, v in result.items() if k not in ("samples", "proxy_each")}
    result["seconds"], result["seed"] = time.perf_counter() - t0, args.seed
    atomic_write_text(file, json.dumps({"key": key, "folder": shown(folder), "result": result}))
    print(f"  {name}: evaluated in {result['seconds']:.0f} s")
    return result


def chapter_numbers(name: str, folder: Path, arena_row: dict) -> dict | None:
    """What the chapter's own run recorded at its end, where its evaluation drew as many samples as the arena's, with
    the same seed and at T = 1.0 (the same prompts, samples per prompt and draws: then the numbers must agree)."""
    file = folder / "eval.json"
    if not file.is_file():
        return None
    e = json.loads(file.read_text(encoding="utf-8"))
    temperature = e.get("temperature", e.get("config", {}).get("temperature"))
    if e.get("seed") != arena_row["seed"] or (name != "RLOO (word problems)" and temperature != 1.0):
        return None  # other draws: nothing to compare
    if name == "RLOO (word problems)":  # chapter 7's greedy accuracy on the same held-out problems
        return {"accuracy": e["after"]["gold"]} if e["after"]["n"] == arena_row.get("problems") else None
    after = e["after"].get("sampled", {}) if name in RL_RUNS else e["after"]
    if after.get("n") != arena_row["n"]:
        return None
    return {k: after[k] for k in ("gold", "kl") if k in after}


# ----------------------------------------------------------------------------- figure, table, samples


def trajectory(name: str, folder: Path) -> list[tuple[float, float, float]]:
    """(KL, gold, proxy) at each sampled held-out evaluation of a run's metrics.jsonl (eval/sampled/*, the one schema
    of every chapter; step 0: the SFT model, KL 0). The proxy is nan where the run had none (DPO)."""
    points = []
    for r in read_jsonl(folder / "metrics.jsonl"):
        if "eval/sampled/gold" in r and ("eval/sampled/kl" in r or r.get("step") == 0):
            points.append((r.get("eval/sampled/kl", 0.0), r["eval/sampled/gold"],
                           r.get("eval/sampled/proxy", float("nan"))))
    return points


COLORS = {"SFT": "black", "RFT": "C1", "REINFORCE": "C2", "RLOO": "C0", "GRPO": "C4", "RLOO, β = 0": "C8", "PPO": "C3",
          "DPO": "C5", "RLOO (word problems)": "C7"}


def frontier_figure(out: Path, table: dict, curve: list[dict], trajectories: dict) -> None:
    """Gold gain (left) and proxy gain (right) against √KL: best-of-N as a curve (over N = 1, on its own samples), each
    trained method as its trajectory (the evaluations its run recorded, over the SFT model on the same draws) ending
    at the square where the arena scored its final checkpoint (± 1 s.e. of the paired gain)."""
    fig, axes = plt.subplots(1, 2, figsize=(14, 5), constrained_layout=True)
    base = table["SFT"]
    for ax, key in zip(axes, ("gold", "proxy")):
        gain = "gain" if key == "gold" else "proxy_gain"
        x = [math.sqrt(c["kl"]) for c in curve]
        ax.plot(x, [c[gain] for c in curve], "k--", marker=".", label="best-of-N (N = 1, 2, 4 ..; KL bound)")
        for c in curve:
            if c["n"] in BON_SHOWN:
                ax.annotate(f"N={c['n']}", (math.sqrt(c["kl"]), c[gain]), fontsize=7, xytext=(3, -10),
                            textcoords="offset points")
        for name, points in trajectories.items():
            kl = [math.sqrt(max(p[0], 0.0)) for p in points]
            ys = [(p[1] if key == "gold" else p[2]) - base[key] for p in points]
            ax.plot(kl, ys, marker="o", ms=3, alpha=0.8, color=COLORS.get(name), label=f"{name} (over training)")
        for name, row in table.items():  # every checkpoint as the arena scored it
            if name.startswith("best-of") or name == "SFT":
                continue
            ax.errorbar([math.sqrt(max(row["kl"], 0.0))], [row[gain]], yerr=[row["gain_se"]] if key == "gold" else None,
                        marker="s", ms=7, color=COLORS.get(name), capsize=3, ls="none",
                        label=None if name in trajectories else name)
        ax.axhline(0, color="black", lw=0.6)
        ax.set(xlabel="√KL to the SFT model (√nats per story; best-of-N: its bound)",
               ylabel=("gold gain over the SFT model (held out, sampled)" if key == "gold"
                       else "reward model score (the proxy): gain over the SFT model"),
               title=("Gold gained against √KL" if key == "gold"
                      else "Proxy gained against √KL: what each method optimised"))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="lower left")
    save(fig, out / "frontier.png")


HELD = {"RFT": ("policy", "reward model"), "REINFORCE": ("policy", "reference", "reward model"),
        "RLOO": ("policy", "reference", "reward model"), "GRPO": ("policy", "reference", "reward model"),
        "RLOO, β = 0": ("policy", "reference", "reward model"),
        "RLOO (word problems)": ("policy", "reference")}  # the networks each method holds while it trains


def weights_held(name: str, folder: Path | None, sizes: dict[str, int]) -> dict[str, int] | None:
    """Bytes of each network a method holds while training: recorded by chapters 8 and 9, else from HELD."""
    file = folder / "eval.json" if folder else None
    if file and file.is_file() and "weights_held" in (e := json.loads(file.read_text(encoding="utf-8"))):
        return {k: v["bytes"] for k, v in e["weights_held"].items()}
    if name.startswith("best-of"):
        return {"policy": sizes["policy"], "reward model": sizes["reward model"]}  # at answer time, nothing trained
    return {k: sizes["policy" if k == "reference" else k] for k in HELD[name]} if name in HELD else None


def table_markdown(table: dict, seconds: dict, matches: dict, held: dict) -> str:
    lines = ["| method | gold ± s.e. | gold gain ± s.e.* | proxy (RM) | KL k1 | KL k3 | word problems (greedy) | "
             "length | distinct-2* | training time | weights held |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, r in table.items():
        kl3 = "—" if r.get("kl_k3") is None else f"{r['kl_k3']:.2f}"
        acc = f"{r['accuracy']:.1%} ± {r['accuracy_se']:.1%}" if "accuracy" in r else "—"
        acc += f" (p = {r['accuracy_mcnemar']['p_value']:.2g})" if "accuracy_mcnemar" in r else ""
        kl = f"{r['kl']:.2f}" + (" (bound)" if name.startswith("best-of") else "")
        t, h = seconds.get(name), held.get(name)
        h = f"{sum(h.values()) / 2 ** 20:.1f} MiB: {', '.join(h)}" if h else "—"
        g = f"{r['gain']:+.3f} ± {r['gain_se']:.3f}" if "gain" in r else "—"
        lines.append(f"| {name} | {r['gold']:.3f} ± {r['gold_se']:.3f} | {g} | {r['proxy']:+.3f} | {kl} | {kl3} | "
                     f"{acc} | {r['length']:.1f} | {r['distinct_2']:.3f} | "
                     f"{t if isinstance(t, str) else f'{t / 60:.1f} min' if t else '—'} | {h} |")
    agree = [f"{name}: {', '.join(f'{k} {v:.3f} (chapter) vs {table[name][k]:.3f} (arena)' for k, v in m.items())}"
             for name, m in matches.items() if m]
    lines.append("\n*gold gain: over the SFT model on the same draws (best-of-N: over N = 1 on its own samples), its "
                 "standard error over the prompts (paired). distinct-2: distinct word pairs over all word pairs of one "
                 "sample per prompt (best-of-N: the pick among the first N samples), the same number of stories for "
                 "every row. p: McNemar's exact test of the greedy word-problem answers against the SFT model's (the "
                 "same problems; two-sided).")
    return "\n".join(lines) + ("\n\nThe chapters' own records, where their evaluation had these settings: "
                               + "; ".join(agree) + "." if agree else "")


def samples_markdown(table: dict, texts: dict, prompts: list[str], n: int = 3) -> str:
    """Every method's first sample for each of the first n held-out prompts, one table."""
    cell = lambda s: s.replace("\n", " ").replace("|", "/")[:260]  # noqa: E731
    rows = ["| prompt | method | response |", "|---|---|---|"]
    for i, p in enumerate(prompts[:n]):
        rows += [f"| {cell(p) if j == 0 else ''} | {name} | {cell(texts[name][i])} |"
                 for j, name in enumerate(name for name in table if name in texts)]
    return "\n".join(rows) + "\n"


# ----------------------------------------------------------------------------- seeds: the chain again, and the spread

SHARED_STAGES = ("tokenizer", "pretrain")  # chapters 1-4: every seed's chain starts from the same pretrained model
SEED_STAGES = [("ch05_sft.py", "sft"), ("ch06_reward_model.py", "reward_model"),
               ("ch07_policy_gradient.py", "pg_word-problems_rloo"), ("ch08_ppo.py", "ppo_stories"),
               ("ch09_dpo.py", "dpo")]


def arena_argv(args, seed: int) -> list[str]:
    """This arena's flags for one seed's run (every setting as given, the seed replaced, no --seeds)."""
    argv = ["--seed", str(seed), "--device", args.device]
    for flag in ("eval_samples", "bon_samples", "rl_steps", "rl_eval_interval", "rft_rounds", "rft_prompts", "rft_k",
                 "rft_keep", "rft_lr"):
        argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    return argv + [f"--{f.replace('_', '-')}" for f in ("quick", "quiet", "no_build", "no_resume") if getattr(args, f)]


def seed_chain(args, seed: int, root: Path) -> Path:
    """Seed `seed`'s chain in root/arena_seeds/seed<seed>/: chapters 1-4's runs copied from root, then chapters 5-9
    with --seed (a finished stage of this seed is kept, until one runs: every later stage runs again), then this arena.
    Each stage is its own process, as in run_all.py. Returns the seed's arena folder."""
    import run_all  # chapters/run_all.py: one chapter script in its own process

    base = root / "arena_seeds" / f"seed{seed}"
    env = dict(os.environ, LLMFS_RUNS_DIR=str(base), LLMFS_QUICK="1" if args.quick else "0")
    stage_root = base / "quick" if args.quick else base  # what runs_root() is inside the seed's processes
    for stage in SHARED_STAGES:
        if finished_run(stage_root / stage) is None:
            shutil.rmtree(stage_root / stage, ignore_errors=True)
            shutil.copytree(prerequisite(stage, args.quick, build=not args.no_build), stage_root / stage,
                            ignore=shutil.ignore_patterns("last"))
    ran = args.no_resume
    for script, folder in SEED_STAGES:
        done = finished_run(stage_root / folder)
        if done and done.get("seed") == seed and bool(done.get("quick")) == args.quick and not ran:
            print(f"seed {seed}: keeping {shown(stage_root / folder)}", flush=True)
            continue
        print(f"\n=== seed {seed}: {script} --seed {seed} (into {shown(stage_root / folder)})", flush=True)
        run_all.run_chapter(script, args.quick, args.quiet, env, fresh=ran, extra=["--seed", str(seed)])
        ran = True
    print(f"\n=== seed {seed}: the arena", flush=True)
    done = subprocess.run([sys.executable, str(Path(__file__).resolve())] + arena_argv(args, seed), env=env)
    if done.returncode != 0:
        raise SystemExit(f"the arena of seed {seed} failed (exit code {done.returncode}); what it finished is kept in "
                         f"{shown(base)}, and the same command picks up from there")
    return stage_root / "arena"


def seed_spread(tables: list[dict]) -> dict[str, dict]:
    """For every method in every seed's table: its gold gain (and KL, and word-problem accuracy) in each seed, their
    median and range."""
    spread = {}
    for name in tables[0]["table"]:
        rows = [t["table"][name] for t in tables if name in t["table"]]
        if len(rows) < len(tables) or name == "SFT":
            continue
        each = {k: [r[k] for r in rows] for k in ("gain", "gain_se", "kl", "gold", "accuracy")
                if all(k in r for r in rows)}
        sft_acc = [t["table"]["SFT"].get("accuracy") for t in tables]
        if "accuracy" in each and None not in sft_acc:
            each["accuracy_gain"] = [a - b for a, b in zip(each["accuracy"], sft_acc)]
        spread[name] = {k: {"each": v, "median": median(v), "min": min(v), "max": max(v)} for k, v in each.items()}
    return spread


def every_seed_wins(spread: dict) -> list[tuple[str, str]]:
    """(A, B) for every two methods where A's gold gain is above B's in every seed: the only differences to call."""
    return [(a, b) for a in spread for b in spread if a != b and all(
        x > y for x, y in zip(spread[a]["gain"]["each"], spread[b]["gain"]["each"]))]


def seeds_markdown(spread: dict, seeds: list[int], wins: list[tuple[str, str]]) -> str:
    lines = [f"| method | gold gain: median [min, max] over {len(seeds)} seeds | each seed (gain ± s.e.) | KL: median "
             "[min, max] | word problems (greedy): gain in points, median [min, max] |", "|---|---:|---|---:|---:|"]
    for name, r in spread.items():
        g, kl = r["gain"], r["kl"]
        each = ", ".join(f"{x:+.3f} ± {e:.3f}" for x, e in zip(g["each"], r["gain_se"]["each"]))
        acc = r.get("accuracy_gain")
        acc = f"{100 * acc['median']:+.1f} [{100 * acc['min']:+.1f}, {100 * acc['max']:+.1f}]" if acc else "—"
        lines.append(f"| {name} | {g['median']:+.3f} [{g['min']:+.3f}, {g['max']:+.3f}] | {each} | "
                     f"{kl['median']:.2f} [{kl['min']:.2f}, {kl['max']:.2f}] | {acc} |")
    beats = {a: [b for x, b in wins if x == a] for a in spread}
    lines += ["", f"Above in every seed (seeds {', '.join(map(str, seeds))}): a difference between two methods is "
              "called only where it holds in each seed's chain."]
    lines += [f"- {a} > {', '.join(bs)}" for a, bs in beats.items() if bs] or ["- none"]
    return "\n".join(lines)


def seeds_figure(out: Path, spread: dict, curves: list[list[dict]]) -> None:
    """Gold gain against √KL over seeds: each method at its median, bars from its smallest to its largest gain (and
    KL) over the seeds; best-of-N as the median curve."""
    fig, ax = plt.subplots(figsize=(8, 5), constrained_layout=True)
    ns = [c["n"] for c in curves[0]]
    x = [math.sqrt(median([c[i]["kl"] for c in curves])) for i in range(len(ns))]
    ax.plot(x, [median([c[i]["gain"] for c in curves]) for i in range(len(ns))], "k--", marker=".",
            label="best-of-N, median over seeds (N = 1, 2, 4 ..; KL bound)")
    for name, r in spread.items():
        if name.startswith("best-of"):
            continue
        g, kl = r["gain"], r["kl"]
        xm = math.sqrt(max(kl["median"], 0.0))
        ax.errorbar([xm], [g["median"]], yerr=[[g["median"] - g["min"]], [g["max"] - g["median"]]],
                    xerr=[[xm - math.sqrt(max(kl["min"], 0.0))], [math.sqrt(max(kl["max"], 0.0)) - xm]],
                    marker="s", ms=7, capsize=3, ls="none", color=COLORS.get(name), label=name)
    ax.axhline(0, color="black", lw=0.6)
    ax.set(xlabel="√KL to the SFT model (√nats per story)", ylabel="gold gain over the SFT model (paired, sampled)",
           title=f"Gold gained against √KL over {len(curves)} seeds: median, bars from min to max")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower left")
    save(fig, out / "frontier.png")


def seed_sweep(args) -> dict:
    """--seeds N: seed 0's chain is the course's own (runs/), seeds 1..N-1 each their own chain; then the spread."""
    root = runs_root(args.quick)
    folders = [None] * args.seeds
    main(arena_argv(args, 0))  # seed 0: the default chain, its prerequisites built as usual
    folders[0] = root / "arena"
    for k in range(1, args.seeds):
        folders[k] = seed_chain(args, k, root)
    tables = [json.loads((f / "table.json").read_text(encoding="utf-8")) for f in folders]
    spread, seeds = seed_spread(tables), list(range(args.seeds))
    wins = every_seed_wins(spread)
    out = args.out or root / "arena_seeds"
    out.mkdir(parents=True, exist_ok=True)
    seeds_figure(out, spread, [t["best_of_n"] for t in tables])
    text = seeds_markdown(spread, seeds, wins)
    print(f"\n{args.seeds} seeds, each its own chain from chapter 5 on:\n\n{text}")
    atomic_write_text(out / "table.md", text + "\n")
    result = {"seeds": seeds, "spread": spread, "every_seed": wins, "arenas": [shown(f) for f in folders]}
    atomic_write_text(out / "seeds.json", json.dumps(result, indent=2))
    atomic_write_text(out / "report.md", "\n".join([
        f"## Chapter 10 over {args.seeds} seeds", "",
        f"`python chapters/ch10_arena.py --seeds {args.seeds}`: seed 0 is the course's chain; seed k ran chapters 5-10 "
        "again with --seed k from the same pretrained model.", "", text, "",
        f"![frontier over seeds]({out.name}/frontier.png)", ""]))
    write_summary(out, {"seeds": seeds, "every_seed": wins}, args.quick)
    return result


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.seeds:
        return seed_sweep(args)
    root = runs_root(args.quick)
    out = args.out or root / "arena"
    device = pick_device(args.device)
    t_start = time.perf_counter()
    build = not args.no_build
    sft_dir = prerequisite("sft", args.quick, build=build)
    rm_dir = prerequisite("reward_model", args.quick, build=build)
    chapter_dirs = {name: prerequisite(stage, args.quick, build=build) for name, stage in CHAPTER_RUNS.items()}
    chapter_dirs.update(lora_dirs(root, args.quick))
    for folder in (sft_dir, rm_dir, *chapter_dirs.values()):
        require_real(folder, args.quick)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").unlink(missing_ok=True)

    tok = Tokenizer.load(sft_dir)
    sft = load_gpt(sft_dir, device=device, vocab_size=tok.vocab_size, dropout=0.0).requires_grad_(False)
    rm = RewardModel.load(rm_dir, device=device, vocab_size=tok.vocab_size).requires_grad_(False)
    rm_fn = reward_fn(rm, tok)
    inputs = {"sft": weights_digest(sft), "reward_model": weights_digest(rm)}
    if (out / "inputs.json").is_file() and json.loads((out / "inputs.json").read_text(encoding="utf-8")) != inputs:
        print("the SFT model or the reward model changed since the arena last ran: its RL and RFT runs start over")
        for stale in ("rft", *(folder for folder, *_ in RL_RUNS.values())):
            shutil.rmtree(out / stale, ignore_errors=True)
    atomic_write_text(out / "inputs.json", json.dumps(inputs))

    # the methods this chapter trains: REINFORCE, RLOO, GRPO on stories (chapter 7's script), then RFT
    rl_dirs = rl_runs(args, out)
    stories_rl, stories, _, _ = common.task_data("stories", args.quick, args.eval_examples)
    problems = common.task_data("word-problems", args.quick, args.eval_examples).held_out
    print(f"\n--- RFT and best-of-N ({len({s['prompt'] for s in stories})} held-out story prompts, {len(problems)} "
          f"held-out word problems)", flush=True)
    arena = Arena(out, tok, sft, rm_fn, stories_rl, stories, problems, device, inputs)
    rft_dir = rft_run(args, arena, sft_dir)
    bon = best_of_n_samples(args, arena)
    curve, bon_rows = best_of_n_rows(bon)

    # one evaluation for every checkpoint
    checkpoints = {"SFT": sft_dir, "RFT": rft_dir, **rl_dirs, **chapter_dirs}
    print(f"\n--- the evaluation: {args.eval_samples} samples of each held-out story prompt at T = 1.0, greedy word "
          f"problems; {len(checkpoints)} checkpoints", flush=True)
    table, texts = {}, {}
    for name, folder in checkpoints.items():
        table[name] = cached_evaluation(args, arena, name, folder)
        texts[name] = table[name]["completions"][::args.eval_samples]  # sample 0 of each prompt
        if name == "SFT":
            for n, row in bon_rows.items():
                table[f"best-of-{n}"] = row
                texts[f"best-of-{n}"] = row["texts"]
    order = (["SFT"] + [f"best-of-{n}" for n in bon_rows] + ["RFT", *RL_RUNS, "PPO", "DPO"]
             + [name for name in chapter_dirs if "LoRA" in name] + ["RLOO (word problems)"])
    table = {k: table[k] for k in order}
    for name, row in table.items():  # diversity over the same number of texts for every row: one per prompt
        row["distinct_1"], row["distinct_2"] = distinct_n(texts[name], 1), distinct_n(texts[name], 2)
        if "gold_each" in row:  # the gain over the SFT model on the same draws, its s.e. over prompts (paired)
            row["gain"], row["gain_se"] = paired_gain(row["gold_each"], table["SFT"]["gold_each"], args.eval_samples)
            row["proxy_gain"] = row["proxy"] - table["SFT"]["proxy"]
        if name != "SFT" and "right_each" in row and "right_each" in table["SFT"]:  # the same word problems: paired
            row["accuracy_mcnemar"] = mcnemar_exact(table["SFT"]["right_each"], row["right_each"])

    # the chapters' own numbers, and what each method cost
    matches = {name: chapter_numbers(name, folder, table[name]) for name, folder in {**rl_dirs, **chapter_dirs}.items()}
    seconds = {name: (finished_run(folder) or {}).get("seconds") for name, folder in
               {"RFT": rft_dir, **rl_dirs, **chapter_dirs}.items()}
    for n in bon_rows:
        seconds[f"best-of-{n}"] = f"none ({n} samples per answer)"
    trajectories = {name: trajectory(name, folder) for name, folder in
                    {"RFT": rft_dir, **rl_dirs, **{k: v for k, v in chapter_dirs.items() if k != "RLOO (word problems)"}
                     }.items()}
    sizes = {k: v["bytes"] for k, v in ppo.weights_held({"policy": sft, "reward model": rm}).items()}
    folders = {"RFT": rft_dir, **rl_dirs, **chapter_dirs}
    held = {name: weights_held(name, folders.get(name), sizes) for name in table if name != "SFT"}
    frontier_figure(out, table, curve, trajectories)
    text = table_markdown(table, seconds, matches, held)
    print("\n" + text)
    strip = lambda r: {k: v for k, v in r.items() if k not in ("completions", "texts", "gold_each", "right_each")}  # noqa: E731
    result = {"table": {k: strip(v) for k, v in table.items()}, "best_of_n": curve, "chapter_numbers": matches,
              "trajectories": trajectories, "seconds": {k: v for k, v in seconds.items() if not isinstance(v, str)},
              "weights_held": held,
              "eval_samples": args.eval_samples, "story_prompts": len({s["prompt"] for s in stories}),
              "word_problems": len(problems), "seed": args.seed, "device": str(device)}
    atomic_write_text(out / "table.json", json.dumps(result, indent=2))
    atomic_write_text(out / "table.md", text + "\n")
    atomic_write_text(out / "samples.md", samples_markdown(table, texts, bon["prompts"]))
    wall = time.perf_counter() - t_start
    atomic_write_text(out / "report.md", "\n".join([
        "## Chapter 10: the arena", "",
        f"Every checkpoint scored by one evaluation: {args.eval_samples} samples of each of the "
        f"{result['story_prompts']} held-out story prompts at T = 1.0 (gold ± s.e., the reward model's score, the KL "
        f"to the SFT model from the samples, length, distinct-2) and greedy answers to the {len(problems)} held-out "
        f"word problems. Best-of-N from {args.bon_samples} samples per prompt; its KL is the bound log N − (N − 1)/N.",
        "", text, "",
        f"![frontier]({out.name}/frontier.png)", "", "Every method's first sample for the same prompts:", "",
        samples_markdown(table, texts, bon["prompts"], 2)]))
    write_summary(out, {"seconds": wall, "table": result["table"]}, args.quick)
    print(f"\nthe arena took {wall / 60:.1f} min; wrote {shown(out)}/table.md, frontier.png, samples.md, report.md")
    return result


if __name__ == "__main__":
    cli.run(main)
