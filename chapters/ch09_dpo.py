"""Chapter 9: DPO, IPO and conservative DPO on the tiny world's preference pairs (llm_from_scratch/dpo.py).

The SFT model is the starting policy and the reference. Each step takes --batch-size preference pairs, scores the
chosen and the rejected response under the policy in one forward pass, and descends the DPO loss on their implicit
rewards β (log π − log π_ref). No reward model, no sampling while training: the pairs are the data.

  --reference cached   the reference's log-probs of every pair computed once, before training, and stored in the
                       run folder (reference_logps.safetensors); the reference model is then released, and loaded
                       again only for the sampled evaluations (the default)
  --reference live     the reference model stays in memory and scores every batch again (the same losses)

Every --eval-interval steps: the DPO metrics on all held-out pairs (rewards/chosen, rewards/rejected,
rewards/margins, rewards/accuracies, logps/chosen, logps/rejected), and --eval-samples samples of every held-out
story prompt at --temperature: their gold reward and the KL to the reference (k1 and k3, from these samples), the
same random numbers at every evaluation, so the reference's answers and the policy's sit side by side.

Writes runs/dpo[_<variant>][_live]/: the policy (model.safetensors, config.json, the tokenizer), metrics.jsonl
(train/* per step, val/* (the held-out pairs) and eval/sampled/* per evaluation), reference_logps.safetensors,
side_by_side.jsonl, curves.png, kl_gold.png, logp_shift.png (the per-pair change of the chosen and rejected
log-probs), eval.json (with the implicit reward's accuracy by gold part beside the reward model's, and the paired gain
in gold over the SFT model with its standard error over prompts), samples.md, report.md and summary.json. An
interrupted run resumes from its last evaluation (--no-resume starts over).

--pairs sampled trains on pairs of the SFT model's own stories instead (best and worst of 4 by gold, labelled with
the tiny world's Bradley–Terry noise): on-policy data, into runs/dpo_sampled/.
--seeds N runs seeds 0..N-1, seed k from chapter 5's runs/sft_seeds/seed<k>, and prints the spread.
--compare runs DPO at three β, IPO and conservative DPO on the same data, steps and seed into runs/dpo_compare/.

    python chapters/ch09_dpo.py                       # DPO, β = 0.5, cached reference log-probs
    python chapters/ch09_dpo.py --loss-type ipo       # IPO
    python chapters/ch09_dpo.py --label-smoothing 0.1 # conservative DPO
    python chapters/ch09_dpo.py --compare             # the β / loss-type comparison (notebook 09 reads it)
    python chapters/ch09_dpo.py --pairs sampled       # DPO on pairs of the SFT model's own stories
    python chapters/ch09_dpo.py --quick               # a smoke run (also LLMFS_QUICK=1)
"""

from __future__ import annotations

import gc
import json
import math
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

import cli  # chapters/cli.py: common flags, one-line errors (also puts the repository on sys.path)
import matplotlib.pyplot as plt
import torch
from ch06_reward_model import moving_average  # chapter 6's helper
from ch07_policy_gradient import sft_seed_sweep, task_data  # chapter 7's helpers
from tqdm import tqdm

from llm_from_scratch import tinyworld
from llm_from_scratch.checkpoint import (
    append_metrics,
    atomic_write_text,
    load_state,
    load_tensors,
    load_train_state,
    read_jsonl,
    save_tensors,
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
from llm_from_scratch.data import tinyworld_dir
from llm_from_scratch.device import pick_device, seed_everything
from llm_from_scratch.dpo import (LOSS_TYPES, DPOConfig, dpo_loss, dpo_step, frozen_logps, preference_batch,
                                  preference_metrics, reference_logps)
from llm_from_scratch.plots import save
from llm_from_scratch.evaluation import eval_record, paired_gain, sampled_eval  # the one evaluation of chapters 5-10
from llm_from_scratch.ppo import weights_held
from llm_from_scratch.reward_model import agreement_by_part, gold_sign, load_preferences, ranking_scores
from llm_from_scratch.sft import answer
from llm_from_scratch.tokenizer import Tokenizer, encode_chat
from llm_from_scratch.train import load_gpt, save_gpt

DEFAULT = ("sigmoid", 0.5, 0.0)  # the default loss: DPO with β = 0.5 (loss type, β, label smoothing)
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")


def parse_args(argv=None):
    ap = cli.parser(__doc__)
    ap.add_argument("--loss-type", default="sigmoid", choices=LOSS_TYPES, help="sigmoid (DPO, the default) or ipo")
    ap.add_argument("--beta", type=float, default=DEFAULT[1],
                    help=f"β: the implicit reward's scale, the KL weight (default {DEFAULT[1]})")
    ap.add_argument("--label-smoothing", type=float, default=0.0,
                    help="ε > 0: conservative DPO, each label assumed flipped with probability ε (default 0)")
    ap.add_argument("--reference", default="cached", choices=["cached", "live"],
                    help="cached: the reference's log-probs computed once and the model released (default); "
                         "live: the reference model scores every batch")
    ap.add_argument("--init", type=Path, help="policy and reference to start from (default runs/sft)")
    ap.add_argument("--train-pairs", type=Path,
                    help="a JSONL file of {prompt, chosen, rejected} to train on (default: the tiny world's "
                         "preferences_train.jsonl); the held-out pairs stay the tiny world's")
    ap.add_argument("--pairs", default="tinyworld", choices=["tinyworld", "sampled"],
                    help="tinyworld: the tiny world's 10,000 labelled pairs, written by its generator (the default); "
                         "sampled: pairs of the SFT model's own stories, --samples-per-prompt for each of the RL story "
                         "prompts, the best and the worst by gold, labelled as the tiny world labels (on-policy data)")
    ap.add_argument("--samples-per-prompt", type=int, default=4, help="--pairs sampled: stories per prompt (default 4)")
    ap.add_argument("--steps", type=int,
                    help="optimizer steps (default 300; --pairs sampled: 80, about 1.3 epochs of ~2,000 pairs)")
    ap.add_argument("--batch-size", type=int, default=32, help="pairs per step (default 32)")
    ap.add_argument("--lr", type=float, default=5e-5, help="peak AdamW learning rate (default 5e-5)")
    ap.add_argument("--warmup", type=int, default=20, help="steps of linear warmup, then cosine to lr/10 (default 20)")
    ap.add_argument("--eval-interval", type=int, help="steps between evaluations (default 50; --pairs sampled: 20)")
    ap.add_argument("--eval-prompts", type=int, default=1000, help="held-out story prompts to sample (default: all)")
    ap.add_argument("--eval-samples", type=int, default=4,
                    help="samples per held-out prompt (default 4, as chapters 8 and 10 evaluate)")
    ap.add_argument("--temperature", type=float, default=1.0,
                    help="sampling temperature of the evaluations (default 1.0, where SFT leaves the gold reward room)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="length limit of a sampled story (default 128)")
    ap.add_argument("--no-resume", action="store_true", help="start over even if --out holds an interrupted run")
    ap.add_argument("--seeds", type=int, default=0, metavar="N",
                    help="run seeds 0..N-1, seed k from chapter 5's runs/sft_seeds/seed<k>, and print the spread")
    ap.add_argument("--compare", action="store_true",
                    help="run DPO at β 0.1, 0.5 and 2, IPO and conservative DPO (β 0.5, ε 0.1) into runs/dpo_compare/ "
                         "and tabulate")
    cli.add_common_args(ap, "dpo[_<variant>][_live]")
    cli.add_prerequisite_arg(ap)
    args = ap.parse_args(argv)
    args.quick = args.quick or quick_mode()
    args.steps = args.steps or (80 if args.pairs == "sampled" else 300)
    args.eval_interval = args.eval_interval or (20 if args.pairs == "sampled" else 50)
    if args.pairs == "sampled" and args.train_pairs:
        ap.error("--train-pairs is a file of pairs; --pairs sampled makes its own: choose one")
    if args.beta <= 0:
        ap.error("--beta must be > 0")
    if not 0 <= args.label_smoothing < 0.5:
        ap.error("--label-smoothing must be in [0, 0.5)")
    if args.label_smoothing and args.loss_type == "ipo":
        ap.error("--label-smoothing is conservative DPO's: it does not apply to --loss-type ipo")
    if args.temperature <= 0:
        ap.error("--temperature must be > 0 (the KL to the reference is estimated from samples)")
    if args.seeds < 0:
        ap.error("--seeds must be ≥ 0")
    if args.compare and args.pairs == "sampled":
        ap.error("--compare compares the losses on the tiny world's pairs; leave out --pairs sampled")
    if args.seeds and (args.init or args.compare):
        ap.error("--seeds starts seed k from runs/sft_seeds/seed<k> (chapter 5's sweep); leave out --init and --compare")
    for flag in ("steps", "batch_size", "eval_interval", "eval_prompts", "eval_samples", "max_new_tokens",
                 "samples_per_prompt"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be ≥ 1")
    if args.lr <= 0 or args.warmup < 0:
        ap.error("--lr must be > 0 and --warmup ≥ 0")
    if args.quick:
        args.steps, args.batch_size, args.warmup, args.eval_interval = 6, 4, 2, 3
        args.eval_prompts, args.eval_samples, args.max_new_tokens = 4, 1, 24
    return args


def variant(loss_type: str, beta: float, label_smoothing: float) -> str:
    """'dpo', 'ipo' or 'cdpo<ε>', with its β: the name of a loss configuration."""
    name = {"ipo": "ipo"}.get(loss_type, f"cdpo{label_smoothing:g}" if label_smoothing else "dpo")
    return f"{name}_beta{beta:g}"


def run_name(args) -> str:
    default = (args.loss_type, args.beta, args.label_smoothing) == DEFAULT
    return ("dpo" if default else f"dpo_{variant(args.loss_type, args.beta, args.label_smoothing)}") + \
        ("_sampled" if args.pairs == "sampled" else "") + ("_live" if args.reference == "live" else "")


def lr_at(step: int, args) -> float:
    """Linear warmup, then cosine from lr to lr/10 at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr / 10 + 0.9 * args.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def usable_pairs(tok: Tokenizer, rows: list[dict], context_length: int) -> list[dict]:
    """The pairs whose two responses, in the chat template with EOS, fit the model's context."""
    fits = lambda p: max(len(encode_chat(tok, p["prompt"], p[s])[0]) for s in ("chosen", "rejected")) <= context_length  # noqa: E731
    return [p for p in rows if fits(p)]


def sampled_pairs(model, tok, prompts: list[dict], k: int, temperature: float, max_new_tokens: int,
                  seed: int) -> list[dict]:
    """Preference pairs from the model's own stories: k samples of each prompt, the best and the worst by the gold
    reward (a prompt whose k stories tie is dropped), labelled as the tiny world labels its pairs: the better story
    is the chosen one with probability σ(8 (gold_a − gold_b)). On-policy data: the differences are the model's own
    mistakes, not the generator's corruptions."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(20_000 + seed)
    stories = [text for text, _ in answer(model, tok, [p["prompt"] for p in prompts for _ in range(k)], max_new_tokens,
                                          temperature=temperature, generator=generator)]
    rng, pairs = random.Random(seed), []
    for i, p in enumerate(prompts):
        cands = [s for s in stories[i * k:(i + 1) * k] if "<|" not in s]  # a sampled special token: not text to re-encode
        golds = [tinyworld.story_reward(p["spec"], s) for s in cands]
        if len(cands) < 2 or max(golds) == min(golds):
            continue
        hi, lo = golds.index(max(golds)), golds.index(min(golds))
        p_better = tinyworld.sigmoid(tinyworld.BT_BETA * (golds[hi] - golds[lo]))
        (c, gc), (r, gr) = ((cands[hi], golds[hi]), (cands[lo], golds[lo]))
        if rng.random() >= p_better:  # the labeller's noise
            (c, gc), (r, gr) = (r, gr), (c, gc)
        pairs.append({"prompt": p["prompt"], "chosen": c, "rejected": r, "gold_chosen": gc, "gold_rejected": gr,
                      "p_chosen": tinyworld.sigmoid(tinyworld.BT_BETA * (gc - gr)), "spec": p["spec"]})
    return pairs


def cached_reference(file: Path, init: Path, tok, device, train_pairs, val_pairs,
                     reuse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's log-probs of every training and held-out pair, (N, 2) each: read from `file` when `reuse` (an
    interrupted start of this run, or another variant of a --compare, computed them), else computed now by the
    reference model, which is then released, and saved to `file`."""
    if reuse and file.is_file():
        cache = load_tensors(file)
        if cache["train"].shape[0] == len(train_pairs) and cache["val"].shape[0] == len(val_pairs):
            return cache["train"], cache["val"]
    reference = load_gpt(init, device=device, vocab_size=tok.vocab_size, dropout=0.0).requires_grad_(False)
    t0 = time.perf_counter()
    train_ref, val_ref = reference_logps(reference, tok, train_pairs, 64), reference_logps(reference, tok, val_pairs, 64)
    del reference  # released: training holds the policy's weights only
    gc.collect()
    save_tensors(file, {"train": train_ref, "val": val_ref}, {"init": str(init)})
    print(f"the reference's log-probs of {len(train_pairs):,} + {len(val_pairs):,} pairs, once "
          f"({time.perf_counter() - t0:.0f} s), saved to {shown(file)}; the reference model is released")
    return train_ref, val_ref


def pair_eval(policy, tok, pairs: list[dict], ref: torch.Tensor, cfg: DPOConfig) -> tuple[dict, torch.Tensor]:
    """The DPO loss and metrics on held-out pairs, and the policy's log-probs of them (N, 2)."""
    logps = reference_logps(policy, tok, pairs, 64)  # the same no-grad pass, through the policy
    losses, rc, rr = dpo_loss(logps[:, 0], logps[:, 1], ref[:, 0], ref[:, 1], cfg.beta, cfg.loss_type, cfg.label_smoothing)
    return {"loss": losses.mean().item(), **preference_metrics(rc, rr, logps[:, 0], logps[:, 1])}, logps


def reference_model(live, init: Path, tok, device):
    """The live reference, or (cached mode) the reference loaded from its checkpoint for one evaluation."""
    return live if live is not None else load_gpt(init, device=device, vocab_size=tok.vocab_size,
                                                  dropout=0.0).requires_grad_(False)


def curves(out: Path, records: list[dict]) -> None:
    """Loss, preference accuracy, the implicit rewards and their margin, the log-probs: train (each batch and a
    20-step mean) and held out."""
    train = [r for r in records if "train/loss" in r]
    val = [r for r in records if "val/loss" in r]
    steps, vsteps = [r["step"] for r in train], [r["step"] for r in val]
    fig, axes = plt.subplots(1, 4, figsize=(22, 4), constrained_layout=True)
    panels = [(axes[0], ["loss"], "loss (nats)"), (axes[1], ["rewards/accuracies"], "preference accuracy"),
              (axes[2], ["rewards/chosen", "rewards/rejected", "rewards/margins"], "implicit reward β log π/π_ref"),
              (axes[3], ["logps/chosen", "logps/rejected"], "sequence log-prob (nats)")]
    for ax, keys, title in panels:
        for i, key in enumerate(keys):
            if train:
                ys = [r[f"train/{key}"] for r in train]
                ax.plot(steps, ys, color=f"C{i}", alpha=0.15, lw=0.8)
                ax.plot(steps, moving_average(ys, 20), color=f"C{i}", label=f"{key}: train, 20-step mean")
            ax.plot(vsteps, [r[f"val/{key}"] for r in val], color=f"C{i}", marker="o", ls="--", label=f"{key}: held out")
        ax.set(xlabel="step", title=title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].axhline(math.log(2), color="grey", lw=0.8, ls=":")
    axes[1].axhline(0.5, color="grey", lw=0.8, ls=":")
    save(fig, out / "curves.png")


def kl_gold_figure(out: Path, records: list[dict], before: dict) -> None:
    """The KL to the reference over training, and the gold reward of the sampled stories against it."""
    evals = [r for r in records if "eval/sampled/kl" in r]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    steps = [r["step"] for r in evals]
    a1.plot(steps, [r["eval/sampled/kl"] for r in evals], marker="o", label="k1")
    a1.plot(steps, [r["eval/sampled/kl_k3"] for r in evals], marker="s", label="k3")
    a1.set(xlabel="step", ylabel="nats per story", title="KL(policy ‖ reference) on held-out prompts")
    kls, golds, ses = ([r[f"eval/sampled/{k}"] for r in evals] for k in ("kl", "gold", "gold_se"))
    a2.errorbar(kls, golds, yerr=ses, marker="o", capsize=3, label="DPO, each evaluation (± 1 s.e.)")
    for kl, gold, step in zip(kls, golds, steps):
        a2.annotate(str(step), (kl, gold), fontsize=7, textcoords="offset points", xytext=(4, -8))
    a2.axhline(before["gold"], color="grey", ls=":", label=f"SFT model {before['gold']:.3f}")
    a2.set(xlabel="KL to the reference (k1, nats per story)", ylabel="gold reward (sampled)", title="gold reward against KL")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    save(fig, out / "kl_gold.png")


def logp_shift_figure(out: Path, shift: torch.Tensor) -> None:
    """shift (N, 2): log π − log π_ref of each held-out pair's chosen and rejected response."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    lo, hi = shift.min().item(), shift.max().item()
    bins = torch.linspace(lo, hi, 50).tolist()
    a1.hist(shift[:, 0].numpy(), bins=bins, alpha=0.6, label=f"chosen (mean {shift[:, 0].mean():+.2f})")
    a1.hist(shift[:, 1].numpy(), bins=bins, alpha=0.6, label=f"rejected (mean {shift[:, 1].mean():+.2f})")
    a1.axvline(0, color="black", lw=0.8)
    a1.set(xlabel="log π(y|x) − log π_ref(y|x) (nats)", ylabel="held-out pairs", title="how each response's log-prob moved")
    both_fell = ((shift[:, 0] < 0) & (shift[:, 1] < 0)).float().mean().item()
    a2.scatter(shift[:, 1].numpy(), shift[:, 0].numpy(), s=5, alpha=0.4)
    a2.axline((0, 0), slope=1, color="grey", lw=0.8, label="margin 0")
    a2.axhline(0, color="black", lw=0.6)
    a2.axvline(0, color="black", lw=0.6)
    a2.set(xlabel="change of the rejected log-prob", ylabel="change of the chosen log-prob",
           title=f"both fell in {both_fell:.0%} of the pairs")
    a2.legend(fontsize=8)
    for a in (a1, a2):
        a.grid(alpha=0.3)
    a1.legend(fontsize=8)
    save(fig, out / "logp_shift.png")


def side_by_side(step: int, before: dict, now: dict) -> list[dict]:
    """The same held-out prompts, answered with the same random numbers by the reference and by the policy."""
    return [{"step": step, "prompt": b["prompt"], "reference": b["response"], "policy": n["response"],
             "gold_reference": b["gold"], "gold_policy": n["gold"]} for b, n in zip(before["samples"], now["samples"])]


def dpo_run(args, out: Path, seed: int, init: Path, device) -> dict:
    """One DPO run from the SFT model in `init` into `out`; returns what eval.json holds."""
    t_run = time.perf_counter()
    seed_everything(seed)
    tok = Tokenizer.load(init)
    policy = load_gpt(init, device=device, vocab_size=tok.vocab_size, dropout=0.0)
    ctx = policy.config.context_length
    paths = tinyworld.ensure_datasets(tinyworld_dir(args.quick), seed=0, **(tinyworld.QUICK_SIZES if args.quick else {}))
    val_rows = load_preferences(paths["preferences_val"])
    state_file = out / "last" / "train_state.pt"
    if (args.no_resume or finished_run(out)) and out.exists():  # a finished run is made anew, not resumed
        shutil.rmtree(out)
    pairs_file = out / "sampled_pairs.jsonl"
    if args.pairs == "tinyworld":  # a malformed line: an error naming it
        train_rows = load_preferences(args.train_pairs or paths["preferences_train"])
    elif state_file.is_file() and pairs_file.is_file():  # resuming: the pairs this run sampled
        train_rows = load_preferences(pairs_file)
    else:
        t0 = time.perf_counter()
        story_prompts, _, _, _ = task_data("stories", args.quick, 0)
        train_rows = sampled_pairs(policy, tok, story_prompts, args.samples_per_prompt, args.temperature,
                                   args.max_new_tokens, seed)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(pairs_file, "".join(json.dumps(r) + "\n" for r in train_rows))
        print(f"{len(train_rows):,} pairs from {args.samples_per_prompt} SFT stories of each of {len(story_prompts):,} "
              f"story prompts (the others tied on gold) in {time.perf_counter() - t0:.0f} s, saved to {shown(pairs_file)}")
        if not train_rows:
            raise ValueError(f"--pairs sampled: the {args.samples_per_prompt} stories of every prompt tied on gold, so the "
                             "model's own stories give no pair; raise --samples-per-prompt or start from a better SFT model")
    train_pairs, val_pairs = usable_pairs(tok, train_rows, ctx), usable_pairs(tok, val_rows, ctx)
    if not train_pairs:
        raise ValueError(f"{args.train_pairs or paths['preferences_train']}: no pair fits the model's context of {ctx} tokens")
    _, held_out, _, _ = task_data("stories", args.quick, args.eval_prompts)
    cfg = DPOConfig(beta=args.beta, loss_type=args.loss_type, label_smoothing=args.label_smoothing)
    start, before = 0, None
    if state_file.is_file():
        state = load_train_state(state_file)
        start, before = state["step"], json.loads(state["before"])
    start_run(out, fresh=() if start else ("metrics.jsonl", "side_by_side.jsonl"))
    live = None
    if args.reference == "live":
        live = load_gpt(init, device=device, vocab_size=tok.vocab_size, dropout=0.0).requires_grad_(False)
        train_ref = None
        val_ref = reference_logps(live, tok, val_pairs, 64)  # held-out pairs are scored all at once either way
    else:
        shared = getattr(args, "shared_cache", None)  # --compare: one cache for every variant (the same model and pairs)
        train_ref, val_ref = cached_reference(shared or out / "reference_logps.safetensors", init, tok, device,
                                              train_pairs, val_pairs, reuse=start > 0 or shared is not None)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    memory = weights_held({"policy": policy, **({"reference": live} if live is not None else {})})
    print(f"{variant(args.loss_type, args.beta, args.label_smoothing)} on {len(train_pairs):,} training pairs "
          f"({len(train_rows) - len(train_pairs)} too long dropped), {len(val_pairs):,} held out; {args.steps} steps of "
          f"{args.batch_size} pairs ({args.steps * args.batch_size / len(train_pairs):.2f} epochs), lr {args.lr:g}; "
          f"reference {args.reference}; weights held while training: " +
          ", ".join(f"{k} {v['params'] / 1e6:.2f} M" for k, v in memory.items()))
    if start:
        load_state(policy, out / "last" / "model.safetensors")
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        print(f"resuming {shown(out)} at step {start}")

    def evaluate(step: int) -> dict:
        """Held-out pair metrics and the sampled evaluation; appends the side-by-side rows."""
        metrics, _ = pair_eval(policy, tok, val_pairs, val_ref, cfg)
        result = sampled_eval(policy, reference_model(live, init, tok, device), tok, held_out, args.eval_samples,
                              args.temperature, args.max_new_tokens, None, seed)
        record = {"step": step, **{f"val/{k}": v for k, v in metrics.items()},
                  **eval_record(result, "eval/sampled")}  # gold, gold_se, kl, kl_k3, length (no proxy: gold is all)
        append_metrics(out / "metrics.jsonl", record)
        for row in side_by_side(step, before or result, result):
            append_metrics(out / "side_by_side.jsonl", row)
        return result

    t0 = time.perf_counter()
    if before is None:
        before = evaluate(0)
        print(f"SFT model ({time.perf_counter() - t0:.0f} s): held-out gold {before['gold']:.3f} ± {before['gold_se']:.3f} "
              f"({before['n']} samples at T = {args.temperature})")
    order = torch.cat([torch.randperm(len(train_pairs), generator=torch.Generator().manual_seed(seed * 1000 + e))
                       for e in range(math.ceil(args.steps * args.batch_size / len(train_pairs)))])
    t_start, eval_seconds = time.perf_counter(), 0.0
    bar = tqdm(range(start, args.steps), desc="dpo", unit="step", disable=args.quiet, dynamic_ncols=True)
    for step in bar:
        idx = order[step * args.batch_size:(step + 1) * args.batch_size]
        batch = tuple(t.to(device) for t in preference_batch(tok, [train_pairs[i] for i in idx.tolist()]))
        if live is not None:
            ref_chosen, ref_rejected = frozen_logps(live, *batch)
        else:
            ref_chosen, ref_rejected = train_ref[idx, 0].to(device), train_ref[idx, 1].to(device)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        metrics = dpo_step(policy, optimizer, batch, ref_chosen, ref_rejected, cfg)
        append_metrics(out / "metrics.jsonl", {"step": step + 1, "lr": lr_at(step, args),
                                               **{f"train/{k}": v for k, v in metrics.items()}})
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc=f"{metrics['rewards/accuracies']:.2f}",
                        margin=f"{metrics['rewards/margins']:.2f}")
        if (step + 1) % args.eval_interval == 0 or step + 1 == args.steps:
            t_eval = time.perf_counter()
            result = evaluate(step + 1)
            eval_seconds += time.perf_counter() - t_eval
            if not args.quiet:
                tqdm.write(f"step {step + 1}: held-out gold {result['gold']:.3f}, KL {result['kl']:.2f} nats")
            save_gpt(policy, out / "last")
            save_train_state(state_file, {"step": step + 1, "optimizer": optimizer.state_dict(),
                                          "rng": torch.get_rng_state(), "before": json.dumps(before)})
    seconds = time.perf_counter() - t_start
    after = result if start < args.steps else evaluate(args.steps)
    result = finish(args, out, seed, init, device, policy, tok, train_pairs, val_rows, val_pairs, val_ref, cfg, before,
                    after, seconds, eval_seconds, memory)
    result["wall_seconds"] = time.perf_counter() - t_run  # everything: the reference's pass, evaluations, figures
    atomic_write_text(out / "eval.json", json.dumps(result, indent=2))
    write_summary(out, result, args.quick)
    print(f"{shown(out)}: {result['wall_seconds'] / 60:.1f} min in all, the reference's pass and every evaluation included")
    return result


def rankings(val_rows, val_pairs, margins: dict[str, torch.Tensor]) -> tuple[dict[str, dict], dict[str, dict]]:
    """For each named ranking of the held-out pairs (margins: name -> (N,)): its accuracy against the labels and its
    agreement with the gold ranking (chapter 6's ranking_scores), and chapter 6's agreement_by_part."""
    kept = {(p["prompt"], p["chosen"], p["rejected"]) for p in val_pairs}
    rows = [p for p in val_rows if (p["prompt"], p["chosen"], p["rejected"]) in kept]
    parts = [tuple(tinyworld.story_reward_parts(p["spec"], p[k]) for k in ("chosen", "rejected")) for p in rows]
    gold = gold_sign(rows)
    scores = {name: dict(zip(("accuracy", "gold_agreement"), ranking_scores(m, gold))) for name, m in margins.items()}
    return scores, {name: agreement_by_part(parts, m, gold) for name, m in margins.items()}


def finish(args, out, seed, init, device, policy, tok, train_pairs, val_rows, val_pairs, val_ref, cfg, before, after,
           seconds, eval_seconds, memory) -> dict:
    """The final numbers, the checkpoint, the figures, samples.md and report.md; what eval.json will hold."""
    save_gpt(policy, out)
    tok.save(out)
    val_metrics, logps = pair_eval(policy, tok, val_pairs, val_ref, cfg)
    shift = logps - val_ref  # (N, 2): how far each held-out response's log-prob moved
    logp_shift_figure(out, shift)
    records = read_jsonl(out / "metrics.jsonl")
    curves(out, records)
    kl_gold_figure(out, records, before)

    # which parts of the gold reward each ranking sees: the implicit reward, the SFT model's per-token likelihood,
    # and (when chapter 6 has run) the reward model
    lengths = torch.tensor([[len(tok.encode(p[s])) + 1 for s in ("chosen", "rejected")] for p in val_pairs])
    per_token = val_ref / lengths
    margins = {"implicit reward (DPO)": cfg.beta * (shift[:, 0] - shift[:, 1]),
               "SFT log-lik per token": per_token[:, 0] - per_token[:, 1]}
    ranked, parts = rankings(val_rows, val_pairs, margins)
    rm_run = finished_run(runs_root(args.quick) / "reward_model")  # chapter 6's numbers, as they are now
    if rm_run and "by_part" in rm_run:
        parts["reward model (ch. 6)"] = rm_run["by_part"]
        ranked["reward model (ch. 6)"] = {"accuracy": rm_run["accuracy"], "gold_agreement": rm_run["gold_agreement"]}
    gain_mean, gain_se = paired_gain(after["gold_each"], before["gold_each"], args.eval_samples)  # the same draws
    both_fell = ((shift[:, 0] < 0) & (shift[:, 1] < 0)).float().mean().item()
    train_seconds = seconds - eval_seconds
    print(f"after {args.steps} steps ({seconds / 60:.1f} min, of which {eval_seconds / 60:.1f} evaluating)\n"
          f"held-out pairs: accuracy {val_metrics['rewards/accuracies']:.3f}"
          + (f" (the reward model of chapter 6: {rm_run['accuracy']:.3f})" if rm_run else "") +
          f", margin {val_metrics['rewards/margins']:+.3f}, "
          f"chosen {val_metrics['rewards/chosen']:+.3f}, rejected {val_metrics['rewards/rejected']:+.3f}; both log-probs "
          f"fell in {both_fell:.0%} of the pairs\nsampled stories: gold {before['gold']:.3f} → {after['gold']:.3f} "
          f"(paired gain {gain_mean:+.3f} ± {gain_se:.3f}) at a KL of {after['kl']:.2f} nats (k3 "
          f"{after['kl_k3']:.2f})")
    strip = lambda d: {k: v for k, v in d.items() if k not in ("samples", "gold_each", "proxy_each", "completions")}  # noqa: E731
    result = {"pairs": args.pairs, "loss_type": args.loss_type, "beta": args.beta, "label_smoothing": args.label_smoothing,
              "variant": variant(args.loss_type, args.beta, args.label_smoothing), "reference": args.reference,
              "val": val_metrics, "accuracy": val_metrics["rewards/accuracies"], "rankings": ranked, "by_part": parts,
              "before": strip(before), "after": strip(after), "gold_gain": gain_mean, "gold_gain_se": gain_se,
              "kl": after["kl"], "kl_k3": after["kl_k3"], "both_fell": both_fell,
              "shift_mean": {"chosen": shift[:, 0].mean().item(), "rejected": shift[:, 1].mean().item()},
              "steps": args.steps, "batch_size": args.batch_size, "lr": args.lr, "warmup": args.warmup, "seed": seed,
              "init": str(init), "train_pairs": len(train_pairs), "val_pairs": len(val_pairs),
              "epochs": args.steps * args.batch_size / len(train_pairs), "seconds": seconds,
              "train_seconds": train_seconds, "seconds_per_step": train_seconds / max(1, args.steps),
              "eval_samples": args.eval_samples, "temperature": args.temperature, "weights_held": memory,
              "device": str(device)}
    cell = lambda s: s.replace("\n", " ").replace("|", "/")[:220]  # noqa: E731
    rows = side_by_side(args.steps, before, after)
    samples = ["| prompt | reference (SFT) | gold | after DPO | gold |", "|---|---|---:|---|---:|"]
    samples += [f"| {cell(r['prompt'])} | {cell(r['reference'])} | {r['gold_reference']:.2f} | {cell(r['policy'])} | "
                f"{r['gold_policy']:.2f} |" for r in rows]
    atomic_write_text(out / "samples.md", "\n".join(samples) + "\n")
    atomic_write_text(out / "report.md", "\n".join(
        [f"## Chapter 9: {result['variant']} on {'the SFT model' + chr(39) + 's own stories' if args.pairs == 'sampled' else 'the tiny world' + chr(39) + 's pairs'} (reference {args.reference})", "", headline(result, rm_run), "",
         parts_markdown(parts, ranked), "", f"![curves]({out.name}/curves.png)", "", f"![KL and gold]({out.name}/kl_gold.png)",
         "", f"![log-prob shifts]({out.name}/logp_shift.png)", "", "\n".join(samples), ""]))
    return result


def headline(r: dict, rm_run: dict | None) -> str:
    rm = f" (the reward model of chapter 6: {rm_run['accuracy']:.3f})" if rm_run else ""
    return (f"{r['steps']} steps of {r['batch_size']} pairs ({r['epochs']:.2f} epochs) in {r['seconds'] / 60:.1f} min on "
            f"{r['device']}. Held-out preference accuracy of the implicit reward **{r['accuracy']:.3f}**{rm}; margin "
            f"{r['val']['rewards/margins']:+.3f}. Sampled stories at T = {r['temperature']}: gold "
            f"**{r['before']['gold']:.3f} → {r['after']['gold']:.3f}** (paired gain {r['gold_gain']:+.3f} ± "
            f"{r['gold_gain_se']:.3f}) at a KL of {r['kl']:.2f} nats per story. Both log-probs of a pair fell in "
            f"{r['both_fell']:.0%} of the held-out pairs.")


def parts_markdown(parts: dict[str, dict], ranked: dict[str, dict]) -> str:
    """Every held-out pair: each ranking's accuracy against the labels and agreement with gold; then the pairs that
    differ in one part of the gold reward: how often each ranking orders them as gold does."""
    names = list(parts)
    keys = sorted({k for p in parts.values() for k in p}, key=lambda k: -max(p.get(k, {}).get("n", 0) for p in parts.values()))
    lines = ["| held-out pairs | pairs | " + " | ".join(names) + " |", "|---|---:|" + "---:|" * len(names)]
    for key, label in (("accuracy", "all: accuracy against the labels"), ("gold_agreement", "all: agreement with gold")):
        lines.append(f"| {label} | | " + " | ".join(f"{ranked[n][key]:.3f}" if n in ranked else "–" for n in names) + " |")
    for k in keys:
        n = max(p.get(k, {}).get("n", 0) for p in parts.values())
        lines.append(f"| differ only in {k} | {n} | " + " | ".join(f"{p[k]['agreement']:.2f}" if k in p else "–" for p in parts.values())
                     + " |")
    return "\n".join(lines)


CONFIG_KEYS = ("pairs", "loss_type", "beta", "label_smoothing", "steps", "batch_size", "lr", "warmup", "eval_samples",
               "temperature")


def finished_result(args, out: Path, seed: int) -> dict | None:
    """The result of a finished run of this very configuration in `out`, else None."""
    if args.no_resume or not finished_run(out) or not (out / "eval.json").is_file():
        return None
    result = json.loads((out / "eval.json").read_text(encoding="utf-8"))
    if result.get("seed") != seed or any(result.get(k) != getattr(args, k) for k in CONFIG_KEYS):
        return None
    print(f"keeping the finished run in {shown(out)}")
    return result


COMPARE = [("sigmoid", 0.1, 0.0), DEFAULT, ("sigmoid", 2.0, 0.0), ("ipo", 0.5, 0.0), ("sigmoid", 0.5, 0.1)]


def compare(args, root: Path, device) -> dict:
    """Every loss of COMPARE on the same data, seed and steps; a table and a figure in runs/dpo_compare/."""
    init = args.init or prerequisite("sft", args.quick, build=not args.no_build)
    require_real(init, args.quick)
    folder = args.out or root / "dpo_compare"
    args.shared_cache = folder / "reference_logps.safetensors"  # the first variant that trains computes it
    args.shared_cache.unlink(missing_ok=True)  # never one of an earlier SFT model
    results = []
    for loss_type, beta, ls in COMPARE:
        args.loss_type, args.beta, args.label_smoothing = loss_type, beta, ls
        out = folder / variant(loss_type, beta, ls)
        default = root / "dpo" if (loss_type, beta, ls) == DEFAULT and args.out is None else None
        kept = (finished_result(args, default, args.seed) if default and args.reference == "cached" else None) or \
            finished_result(args, out, args.seed)
        print(f"\n=== {variant(loss_type, beta, ls)} ===")
        results.append(kept or dpo_run(args, out, args.seed, init, device))
    lines = ["| loss | β | ε | held-out accuracy | margin | chosen | rejected | both fell | gold (SFT → after) | KL (k1) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in results:
        v = r["val"]
        lines.append(f"| {r['loss_type']} | {r['beta']:g} | {r['label_smoothing']:g} | {r['accuracy']:.3f} | "
                     f"{v['rewards/margins']:+.3f} | {v['rewards/chosen']:+.3f} | {v['rewards/rejected']:+.3f} | "
                     f"{r['both_fell']:.0%} | {r['before']['gold']:.3f} → {r['after']['gold']:.3f} "
                     f"({r['gold_gain']:+.3f} ± {r['gold_gain_se']:.3f}) | {r['kl']:.2f} |")
    text = "\n".join(lines)
    print(f"\nthe same {args.steps} steps of {args.batch_size} pairs, seed {args.seed}, for each loss:\n{text}")
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    for i, r in enumerate(results):
        a1.scatter(r["kl"], r["accuracy"], color=f"C{i}", label=r["variant"])
        a2.errorbar(r["kl"], r["after"]["gold"], yerr=r["gold_gain_se"], color=f"C{i}", marker="o", capsize=3,
                    label=r["variant"])
    a2.axhline(results[0]["before"]["gold"], color="grey", ls=":", label="SFT model")
    a1.set(xlabel="KL to the reference (nats per story)", ylabel="held-out preference accuracy")
    a2.set(xlabel="KL to the reference (nats per story)", ylabel="gold reward of sampled stories")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    save(fig, folder / "compare.png")
    command = f"python chapters/ch09_dpo.py {' '.join(sys.argv[1:])}".strip()
    atomic_write_text(folder / "compare.md", f"`{command}`\n\n{text}\n")
    summary = {"variants": [{k: r[k] for k in ("variant", "loss_type", "beta", "label_smoothing", "accuracy", "kl",
                                                 "gold_gain", "gold_gain_se", "both_fell")} | {"gold": r["after"]["gold"]}
                            for r in results]}
    write_summary(folder, summary, args.quick)
    return summary


def main(argv=None) -> dict:
    args = parse_args(argv)
    root = runs_root(args.quick)
    device = pick_device(args.device)
    if args.train_pairs:  # bad input fails now, naming the file and line, before any earlier chapter is built
        load_preferences(args.train_pairs)
    if args.compare:
        return compare(args, root, device)
    if not args.seeds:
        init = args.init or prerequisite("sft", args.quick, build=not args.no_build)
        require_real(init, args.quick)
        out = args.out or root / run_name(args)
        return dpo_run(args, out, args.seed, init, device)

    sft_sweep = sft_seed_sweep(root, args.seeds)  # seed k of DPO starts from seed k of SFT
    sweep_dir = args.out or root / f"{run_name(args)}_seeds"
    results = [finished_result(args, sweep_dir / f"seed{k}", k) or
               dpo_run(args, sweep_dir / f"seed{k}", k, sft_sweep / f"seed{k}", device) for k in range(args.seeds)]
    rows = {"held-out preference accuracy": [r["accuracy"] for r in results],
            "gold reward, SFT (sampled)": [r["before"]["gold"] for r in results],
            "gold reward, after DPO": [r["after"]["gold"] for r in results],
            "gold gain (paired)": [r["gold_gain"] for r in results], "KL (k1, nats per story)": [r["kl"] for r in results],
            "training minutes": [r["seconds"] / 60 for r in results]}
    lines = ["| | min | median | max | seeds 0.. |", "|---|---:|---:|---:|---|"]
    for name, xs in rows.items():
        f = "{:+.3f}".format if "gain" in name else "{:.3f}".format
        lines.append(f"| {name} | {f(min(xs))} | {f(statistics.median(xs))} | {f(max(xs))} | {', '.join(map(f, xs))} |")
    text = "\n".join(lines)
    print(f"\n{args.seeds} seeds of {variant(args.loss_type, args.beta, args.label_smoothing)}, each from the SFT model "
          f"of the same seed:\n{text}")
    command = f"python chapters/ch09_dpo.py {' '.join(argv if argv is not None else sys.argv[1:])}".strip()
    atomic_write_text(sweep_dir / "sweep.md", f"`{command}`\n\n{text}\n")
    summary = {"seeds": list(range(args.seeds)),
               "spread": {k: {"min": min(v), "median": statistics.median(v), "max": max(v), "runs": v}
                          for k, v in rows.items()}}
    write_summary(sweep_dir, summary, args.quick)
    return summary


if __name__ == "__main__":
    cli.run(main)
