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
interrupted run resumes from its last evaluation (--no-resume starts over), and a finished run of the same flags is
kept.

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
    torchrun --standalone --nproc_per_node=2 chapters/ch09_dpo.py   # 2 processes share each step's pairs

Under torchrun --batch-size is the step's global number of pairs: every rank builds the same batch and computes its
share of the pairs (dpo.dpo_step; with --reference live the reference scores only those), and the gradients are
averaged; rank 0 computes the cached reference log-probs (the others read its file), and alone evaluates, records
and saves. --compare runs as one process.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import matplotlib.pyplot as plt
import torch
from tqdm import tqdm

import cli  # chapters/cli.py: common flags, one-line errors (also puts the repository on sys.path)
import common  # chapters/common.py: the story prompts, resuming, seed sweeps
from llm_from_scratch import dataset_files, distributed, gold_rewards
from llm_from_scratch.checkpoint import append_metrics, atomic_write_text, read_jsonl
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
from llm_from_scratch.dpo import (
    LOSS_TYPES,
    DPOConfig,
    cached_reference_logps,
    dpo_loss,
    dpo_step,
    frozen_logps,
    pair_rows,
    preference_batch,
    preference_metrics,
    reference_logps,
    sampled_pairs,
)
from llm_from_scratch.evaluation import eval_record, paired_gain, sampled_eval  # the one evaluation of chapters 5-10
from llm_from_scratch.lora import trainable_parameters
from llm_from_scratch.plots import moving_average, save
from llm_from_scratch.ppo import weights_held
from llm_from_scratch.reward_model import agreement_by_part, gold_sign, load_preferences, ranking_scores
from llm_from_scratch.tokenizer import Tokenizer, encode_chat
from llm_from_scratch.train import TrainConfig, fused_if_cuda, load_gpt, lr_at

DEFAULT = ("sigmoid", 0.5, 0.0)  # the default loss: DPO with β = 0.5 (loss type, β, label smoothing)
COMPARE = [("sigmoid", 0.1, 0.0), DEFAULT, ("sigmoid", 2.0, 0.0), ("ipo", 0.5, 0.0), ("sigmoid", 0.5, 0.1)]


@dataclass(frozen=True)
class Config(common.CommonFlags, common.LoRAFlags):
    """Every flag, after the pairs' defaults and quick mode filled them in: parsed once, never changed (--compare
    makes one Config per loss with dataclasses.replace)."""
    loss_type: str = "sigmoid"
    beta: float = 0.5
    label_smoothing: float = 0.0
    reference: str = "cached"
    init: Path | None = None
    train_pairs: Path | None = None
    pairs: str = "tinyworld"
    samples_per_prompt: int = 4
    steps: int = 300
    batch_size: int = 32
    lr: float = 5e-5
    warmup: int = 20
    eval_interval: int = 50
    eval_prompts: int = 1000
    eval_samples: int = 4
    temperature: float = 1.0
    max_new_tokens: int = 128
    compare: bool = False


def parse_args(argv=None) -> Config:
    ap = cli.parser(__doc__)
    ap.add_argument("--loss-type", default="sigmoid", choices=LOSS_TYPES, help="sigmoid (DPO, the default) or ipo")
    ap.add_argument("--beta", type=cli.finite_float, default=DEFAULT[1],
                    help=f"β: the implicit reward's scale, the KL weight (default {DEFAULT[1]})")
    ap.add_argument("--label-smoothing", type=cli.finite_float, default=0.0,
                    help="ε > 0: conservative DPO, each label assumed flipped with probability ε (default 0)")
    ap.add_argument("--reference", default="cached", choices=["cached", "live"],
                    help="cached: the reference's log-probs computed once and the model released (default); "
                         "live: the reference model scores every batch")
    ap.add_argument("--init", type=Path,
                    help="policy and reference to start from (default runs/sft); or a Hugging Face GPT-2 "
                         "folder (config.json + model.safetensors), imported once (appendix C)")
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
    ap.add_argument("--lr", type=cli.finite_float,
                    help="peak AdamW learning rate (default 5e-5; with --lora-rank 5e-4)")
    ap.add_argument("--warmup", type=int, default=20, help="steps of linear warmup, then cosine to lr/10 (default 20)")
    ap.add_argument("--eval-interval", type=int, help="steps between evaluations (default 50; --pairs sampled: 20)")
    ap.add_argument("--eval-prompts", type=int, default=1000, help="held-out story prompts to sample (default: all)")
    ap.add_argument("--eval-samples", type=int, default=4,
                    help="samples per held-out prompt (default 4, as chapters 8 and 10 evaluate)")
    ap.add_argument("--temperature", type=cli.finite_float, default=1.0,
                    help="sampling temperature of the evaluations (default 1.0, where SFT leaves the gold reward room)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="length limit of a sampled story (default 128)")
    ap.add_argument("--no-resume", action="store_true",
                    help="start over even if --out holds an interrupted or finished run of the same flags")
    ap.add_argument("--seeds", type=int, default=0, metavar="N",
                    help="run seeds 0..N-1, seed k from chapter 5's runs/sft_seeds/seed<k>, and print the spread")
    ap.add_argument("--compare", action="store_true",
                    help="run DPO at β 0.1, 0.5 and 2, IPO and conservative DPO (β 0.5, ε 0.1) into runs/dpo_compare/ "
                         "and tabulate")
    cli.add_lora_args(ap)
    cli.add_common_args(ap, "dpo[_<variant>][_live][_lora<R>]")
    cli.add_prerequisite_arg(ap)
    a = vars(ap.parse_args(argv))
    cli.check_lora_args(ap, a, 5e-5)
    a["quick"] = a["quick"] or quick_mode()
    a["steps"] = a["steps"] or (80 if a["pairs"] == "sampled" else 300)
    a["eval_interval"] = a["eval_interval"] or (20 if a["pairs"] == "sampled" else 50)
    if a["pairs"] == "sampled" and a["train_pairs"]:
        ap.error("--train-pairs is a file of pairs; --pairs sampled makes its own: choose one")
    if a["beta"] <= 0:
        ap.error("--beta must be > 0")
    if not 0 <= a["label_smoothing"] < 0.5:
        ap.error("--label-smoothing must be in [0, 0.5)")
    if a["label_smoothing"] and a["loss_type"] == "ipo":
        ap.error("--label-smoothing is conservative DPO's: it does not apply to --loss-type ipo")
    if a["temperature"] <= 0:
        ap.error("--temperature must be > 0 (the KL to the reference is estimated from samples)")
    if a["seeds"] < 0:
        ap.error("--seeds must be ≥ 0")
    if a["compare"] and a["pairs"] == "sampled":
        ap.error("--compare compares the losses on the tiny world's pairs; leave out --pairs sampled")
    if a["seeds"] and (a["init"] or a["compare"]):
        ap.error("--seeds starts seed k from runs/sft_seeds/seed<k> (chapter 5's sweep); "
                 "leave out --init and --compare")
    for flag in ("steps", "batch_size", "eval_interval", "eval_prompts", "eval_samples", "max_new_tokens",
                 "samples_per_prompt"):
        if a[flag] < 1:
            ap.error(f"--{flag.replace('_', '-')} must be ≥ 1")
    if a["lr"] <= 0 or a["warmup"] < 0:
        ap.error("--lr must be > 0 and --warmup ≥ 0")
    if a["quick"]:
        a.update(steps=6, batch_size=4, warmup=2, eval_interval=3, eval_prompts=4, eval_samples=1, max_new_tokens=24)
    return Config(**a)



def variant(loss_type: str, beta: float, label_smoothing: float) -> str:
    """'dpo', 'ipo' or 'cdpo<ε>', with its β: the name of a loss configuration."""
    name = {"ipo": "ipo"}.get(loss_type, f"cdpo{label_smoothing:g}" if label_smoothing else "dpo")
    return f"{name}_beta{beta:g}"


def run_name(cfg: Config) -> str:
    default = (cfg.loss_type, cfg.beta, cfg.label_smoothing) == DEFAULT
    return (("dpo" if default else f"dpo_{variant(cfg.loss_type, cfg.beta, cfg.label_smoothing)}")
            + ("_sampled" if cfg.pairs == "sampled" else "") + ("_live" if cfg.reference == "live" else "")
            + (f"_lora{cfg.lora_rank}" if cfg.lora_rank else ""))


def usable_pairs(tok: Tokenizer, rows: list[dict], context_length: int) -> list[dict]:
    """The pairs whose two responses, in the chat template with EOS, fit the model's context."""
    def fits(p):
        return max(len(encode_chat(tok, p["prompt"], p[s])[0]) for s in ("chosen", "rejected")) <= context_length
    return [p for p in rows if fits(p)]


class Pairs(NamedTuple):
    train: list[dict]  # the training pairs that fit the context
    val: list[dict]  # the held-out pairs that fit the context
    val_rows: list[dict]  # every held-out pair (with its story spec: the rankings by gold part read it)
    train_ref: torch.Tensor | None  # (N_train, 2) the reference's log-probs (chosen, rejected); None: --reference live
    val_ref: torch.Tensor | None  # (N_val, 2); None on the ranks other than 0 with --reference live


def training_rows(cfg: Config, run: common.Run, policy, tok, story_prompts: list[dict], resuming: bool) -> list[dict]:
    """The pairs to train on: a file's (the tiny world's, or --train-pairs), or --pairs sampled: the SFT model's own
    stories of `story_prompts`, sampled now (or, when resuming, read back from the run folder)."""
    if cfg.pairs == "tinyworld":  # a malformed line: an error naming it
        return load_preferences(cfg.train_pairs or dataset_paths(cfg)["preferences_train"])
    pairs_file = run.out / "sampled_pairs.jsonl"
    if resuming and pairs_file.is_file():
        return load_preferences(pairs_file)
    t0 = time.perf_counter()
    sft = policy if not resuming else load_gpt(run.init, device=run.device, vocab_size=tok.vocab_size, dropout=0.0)
    rows = sampled_pairs(sft, tok, story_prompts, cfg.samples_per_prompt, cfg.temperature, cfg.max_new_tokens,
                         run.seed)  # the SFT model's own stories (a resumed policy has already moved)
    atomic_write_text(pairs_file, "".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows):,} pairs from {cfg.samples_per_prompt} SFT stories of each of {len(story_prompts):,} story "
          f"prompts (the others tied on gold) in {time.perf_counter() - t0:.0f} s, saved to {shown(pairs_file)}")
    if not rows:
        raise ValueError(f"--pairs sampled: the {cfg.samples_per_prompt} stories of every prompt tied on gold, so the "
                         "model's own stories give no pair; "
                         "raise --samples-per-prompt or start from a better SFT model")
    return rows


def dataset_paths(cfg: Config) -> dict[str, Path]:
    return dataset_files.ensure_datasets(tinyworld_dir(cfg.quick), seed=0,
                                         **(dataset_files.QUICK_SIZES if cfg.quick else {}))


def pair_eval(policy, tok, pairs: list[dict], ref: torch.Tensor, loss: DPOConfig) -> tuple[dict, torch.Tensor]:
    """The DPO loss and metrics on held-out pairs, and the policy's log-probs of them (N, 2)."""
    logps = reference_logps(policy, tok, pairs, 64)  # the same no-grad pass, through the policy
    losses, rc, rr = dpo_loss(logps[:, 0], logps[:, 1], ref[:, 0], ref[:, 1], loss.beta, loss.loss_type,
                              loss.label_smoothing)
    return {"loss": losses.mean().item(), **preference_metrics(rc, rr, logps[:, 0], logps[:, 1])}, logps


def live_reference_logps(live, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """--reference live: the reference's log-probs of a global batch's N pairs, chosen (N,) and rejected (N,). Under
    torchrun the reference scores only this rank's pairs (distributed.shard_rows), the only ones dpo_step reads; the
    other ranks' entries are NaN, so a step that read them would stop on a NaN loss."""
    if distributed.world_size() == 1:
        return frozen_logps(live, *batch)
    n_pairs = batch[0].size(0) // 2
    mine = distributed.shard_rows(n_pairs)
    chosen, rejected = frozen_logps(live, *pair_rows(batch, mine))  # (n_r,) each
    both = torch.full((2, n_pairs), float("nan"), dtype=chosen.dtype, device=chosen.device)  # (2, N)
    both[0, mine], both[1, mine] = chosen, rejected
    return both[0], both[1]


def side_by_side(step: int, before: dict, now: dict) -> list[dict]:
    """The same held-out prompts, answered with the same random numbers by the reference and by the policy."""
    return [{"step": step, "prompt": b["prompt"], "reference": b["response"], "policy": n["response"],
             "gold_reference": b["gold"], "gold_policy": n["gold"]} for b, n in zip(before["samples"], now["samples"])]


def dpo_run(cfg: Config, run: common.Run, shared_cache: Path | None = None) -> dict:
    """One DPO run from the SFT model in run.init into run.out; returns what eval.json holds (on every rank under
    torchrun). shared_cache: --compare's one file of reference log-probs for every loss (the same model, the same
    pairs)."""
    t_run = time.perf_counter()
    out, seed, device = run.out, run.seed, run.device
    rank0, W = distributed.is_main(), distributed.world_size()
    seed_everything(seed)
    tok = Tokenizer.load(run.init)
    policy = load_gpt(run.init, device=device, vocab_size=tok.vocab_size, dropout=0.0)
    base = common.add_lora(cfg, policy)  # --lora-rank: the reference is the policy with its adapters off
    params = trainable_parameters(policy)  # fused AdamW on a CUDA GPU (train.fused_if_cuda), as it was elsewhere
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0, **fused_if_cuda(params))
    weights = common.last_weights(policy)  # what out/last/ holds, for resuming
    state = common.resume(run, cfg, weights, optimizer, logs=("metrics.jsonl", "side_by_side.jsonl"))
    start, before = (state["step"], json.loads(state["before"])) if state else (0, None)
    if rank0:
        start_run(out)

    ctx = policy.config.context_length
    with distributed.main_first():  # rank 0 writes the datasets if they are missing, the others read them
        val_rows = load_preferences(dataset_paths(cfg)["preferences_val"])
    stories = common.task_data("stories", cfg.quick, cfg.eval_prompts)
    with distributed.main_first():  # --pairs sampled: rank 0 samples the pairs and saves them, the others read them
        train_rows = training_rows(cfg, run, policy, tok, stories.train_prompts,
                                   resuming=state is not None or not rank0)
    train, val = usable_pairs(tok, train_rows, ctx), usable_pairs(tok, val_rows, ctx)
    if not train:
        raise ValueError(f"{cfg.train_pairs or dataset_paths(cfg)['preferences_train']}: no pair fits the model's "
                         f"context of {ctx} tokens")
    held_out = stories.held_out
    loss_cfg = DPOConfig(beta=cfg.beta, loss_type=cfg.loss_type, label_smoothing=cfg.label_smoothing)

    def load_reference():
        if base is not None:  # LoRA: no second copy to load
            return base
        return load_gpt(run.init, device=device, vocab_size=tok.vocab_size, dropout=0.0).requires_grad_(False)

    live = load_reference() if cfg.reference == "live" else None
    if live is not None:  # held-out pairs are scored all at once either way (by rank 0: it alone evaluates)
        pairs = Pairs(train, val, val_rows, None, reference_logps(live, tok, val, 64) if rank0 else None)
    else:
        t0 = time.perf_counter()
        cache_file = shared_cache or out / "reference_logps.safetensors"
        with distributed.main_first():  # rank 0 scores the pairs and saves them, the other ranks read its file
            cache, computed = cached_reference_logps(cache_file, load_reference, tok, {"train": train, "val": val},
                                                     reuse=start > 0 or shared_cache is not None or not rank0)
        pairs = Pairs(train, val, val_rows, cache["train"], cache["val"])
        if computed:
            print(f"the reference's log-probs of {len(train):,} + {len(val):,} pairs, once "
                  f"({time.perf_counter() - t0:.0f} s), saved to {shown(cache_file)}; the reference model is released")
    memory = weights_held(common.policy_held(cfg, policy, live))  # cached: the reference is not held
    print(f"{variant(cfg.loss_type, cfg.beta, cfg.label_smoothing)} on {len(train):,} training pairs "
          f"({len(train_rows) - len(train)} too long dropped), {len(val):,} held out; {cfg.steps} steps of "
          f"{cfg.batch_size} pairs ({cfg.steps * cfg.batch_size / len(train):.2f} epochs), lr {cfg.lr:g}; "
          f"reference {cfg.reference}; weights held while training: "
          + ", ".join(f"{k} {v['params'] / 1e6:.2f} M" for k, v in memory.items())
          + (f"; {W} processes share each batch" if W > 1 else ""))
    forward = distributed.wrap(policy)  # DDP under torchrun: dpo_step's gradients averaged over the ranks

    def evaluate(step: int, record: bool = True) -> dict:
        """Held-out pair metrics and the sampled evaluation; appends their record and the side-by-side rows (not
        when `record` is False: a run resumed at its last step has them already). Rank 0's alone, through the bare
        policy (not DDP's wrapper)."""
        metrics, _ = pair_eval(policy, tok, val, pairs.val_ref, loss_cfg)
        reference = live if live is not None else load_reference()  # cached mode: loaded for this evaluation only
        result = sampled_eval(policy, reference, tok, held_out, cfg.eval_samples, cfg.temperature,
                              cfg.max_new_tokens, None, seed)
        if record:
            append_metrics(out / "metrics.jsonl", {"step": step, **{f"val/{k}": v for k, v in metrics.items()},
                                                   **eval_record(result, "eval/sampled")})  # no proxy: gold is all
            for row in side_by_side(step, before or result, result):
                append_metrics(out / "side_by_side.jsonl", row)
        return result

    t0 = time.perf_counter()
    if before is None and rank0:  # rank 0 evaluates and writes; the others go on to the first step and wait there
        before = evaluate(0)
        print(f"SFT model ({time.perf_counter() - t0:.0f} s): held-out gold {before['gold']:.3f} ± "
              f"{before['gold_se']:.3f} ({before['n']} samples at T = {cfg.temperature})")
    schedule = TrainConfig(lr=cfg.lr, min_lr=cfg.lr / 10, warmup_steps=cfg.warmup, max_steps=cfg.steps)
    order = torch.cat([torch.randperm(len(train), generator=torch.Generator().manual_seed(seed * 1000 + e))
                       for e in range(math.ceil(cfg.steps * cfg.batch_size / len(train)))])
    t_start, eval_seconds, result = time.perf_counter(), 0.0, None
    bar = tqdm(range(start, cfg.steps), desc="dpo", unit="step", disable=cfg.quiet or not rank0, dynamic_ncols=True)
    for step in bar:
        idx = order[step * cfg.batch_size:(step + 1) * cfg.batch_size]  # the global batch, the same on every rank
        batch = tuple(t.to(device) for t in preference_batch(tok, [train[i] for i in idx.tolist()]))
        if live is not None:
            ref_chosen, ref_rejected = live_reference_logps(live, batch)
        else:
            ref_chosen, ref_rejected = pairs.train_ref[idx, 0].to(device), pairs.train_ref[idx, 1].to(device)
        lr = lr_at(step, schedule)  # linear warmup, then cosine to lr/10 (chapter 4's schedule)
        for group in optimizer.param_groups:
            group["lr"] = lr
        # under torchrun each rank computes its share of the pairs; the metrics are the global batch's on every rank
        metrics = dpo_step(forward, optimizer, batch, ref_chosen, ref_rejected, loss_cfg)
        common.require_finite_metrics(metrics, ("loss",), step + 1, out)
        if rank0:
            append_metrics(out / "metrics.jsonl", {"step": step + 1, "lr": lr,
                                                   **{f"train/{k}": v for k, v in metrics.items()}})
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc=f"{metrics['rewards/accuracies']:.2f}",
                        margin=f"{metrics['rewards/margins']:.2f}")
        if rank0 and ((step + 1) % cfg.eval_interval == 0 or step + 1 == cfg.steps):  # the others go on and wait
            t_eval = time.perf_counter()
            result = evaluate(step + 1)
            eval_seconds += time.perf_counter() - t_eval
            if not cfg.quiet:
                tqdm.write(f"step {step + 1}: held-out gold {result['gold']:.3f}, KL {result['kl']:.2f} nats")
            common.save_last(out, weights)
            common.save_state(run, cfg, step + 1, optimizer, weights, before=json.dumps(before))
    seconds = time.perf_counter() - t_start
    if not rank0:  # rank 0 evaluates the trained policy and writes the run; every rank returns its result
        return distributed.broadcast_object(None)
    after = result if result is not None else evaluate(cfg.steps, record=False)  # resumed after its last step
    common.save_policy(policy, out)  # a LoRA policy with its adapters folded in
    tok.save(out)
    outcome = {"before": before, "after": after, "seconds": seconds, "eval_seconds": eval_seconds, "memory": memory}
    result = report(cfg, run, policy, tok, pairs, outcome)
    result["wall_seconds"] = time.perf_counter() - t_run  # everything: the reference's pass, evaluations, figures
    atomic_write_text(out / "eval.json", json.dumps(result, indent=2))
    write_summary(out, {k: v for k, v in result.items() if k not in ("flags", "origin")}, cfg.quick)
    print(f"{shown(out)}: {result['wall_seconds'] / 60:.1f} min in all, the reference's pass and every evaluation "
          "included")
    return distributed.broadcast_object(result)


def report(cfg: Config, run: common.Run, policy, tok, pairs: Pairs, outcome: dict) -> dict:
    """The final numbers, the figures, samples.md and report.md; what eval.json will hold."""
    out, before, after = run.out, outcome["before"], outcome["after"]
    loss_cfg = DPOConfig(beta=cfg.beta, loss_type=cfg.loss_type, label_smoothing=cfg.label_smoothing)
    val_metrics, logps = pair_eval(policy, tok, pairs.val, pairs.val_ref, loss_cfg)
    shift = logps - pairs.val_ref  # (N, 2): how far each held-out response's log-prob moved
    logp_shift_figure(out, shift)
    records = read_jsonl(out / "metrics.jsonl")
    curves(out, records)
    kl_gold_figure(out, records, before)

    # which parts of the gold reward each ranking sees: the implicit reward, the SFT model's per-token likelihood,
    # and (when chapter 6 has run) the reward model
    lengths = torch.tensor([[len(tok.encode(p[s])) + 1 for s in ("chosen", "rejected")] for p in pairs.val])
    per_token = pairs.val_ref / lengths
    margins = {"implicit reward (DPO)": cfg.beta * (shift[:, 0] - shift[:, 1]),
               "SFT log-lik per token": per_token[:, 0] - per_token[:, 1]}
    ranked, parts = rankings(pairs.val_rows, pairs.val, margins)
    rm_run = finished_run(runs_root(cfg.quick) / "reward_model")  # chapter 6's numbers, as they are now
    if rm_run and "by_part" in rm_run:
        parts["reward model (ch. 6)"] = rm_run["by_part"]
        ranked["reward model (ch. 6)"] = {"accuracy": rm_run["accuracy"], "gold_agreement": rm_run["gold_agreement"]}
    gain_mean, gain_se = paired_gain(after["gold_each"], before["gold_each"], cfg.eval_samples)  # the same draws
    both_fell = ((shift[:, 0] < 0) & (shift[:, 1] < 0)).float().mean().item()
    seconds, eval_seconds = outcome["seconds"], outcome["eval_seconds"]
    train_seconds = seconds - eval_seconds
    print(f"after {cfg.steps} steps ({seconds / 60:.1f} min, of which {eval_seconds / 60:.1f} evaluating)\n"
          f"held-out pairs: accuracy {val_metrics['rewards/accuracies']:.3f}"
          + (f" (the reward model of chapter 6: {rm_run['accuracy']:.3f})" if rm_run else "")
          + f", margin {val_metrics['rewards/margins']:+.3f}, chosen {val_metrics['rewards/chosen']:+.3f}, rejected "
          f"{val_metrics['rewards/rejected']:+.3f}; both log-probs fell in {both_fell:.0%} of the pairs\n"
          f"sampled stories: gold {before['gold']:.3f} → {after['gold']:.3f} (paired gain {gain_mean:+.3f} ± "
          f"{gain_se:.3f}) at a KL of {after['kl']:.2f} nats (k3 {after['kl_k3']:.2f})")
    strip = lambda d: {k: v for k, v in d.items() if k not in ("samples", "gold_each", "proxy_each", "completions")}  # noqa: E731
    result = {"pairs": cfg.pairs, "loss_type": cfg.loss_type, "beta": cfg.beta, "label_smoothing": cfg.label_smoothing,
              "variant": variant(cfg.loss_type, cfg.beta, cfg.label_smoothing), "reference": cfg.reference,
              "val": val_metrics, "accuracy": val_metrics["rewards/accuracies"], "rankings": ranked, "by_part": parts,
              "before": strip(before), "after": strip(after), "gold_gain": gain_mean, "gold_gain_se": gain_se,
              "kl": after["kl"], "kl_k3": after["kl_k3"], "both_fell": both_fell,
              "shift_mean": {"chosen": shift[:, 0].mean().item(), "rejected": shift[:, 1].mean().item()},
              "steps": cfg.steps, "batch_size": cfg.batch_size, "lr": cfg.lr, "warmup": cfg.warmup, "seed": run.seed,
              "init": str(run.init), "train_pairs": len(pairs.train), "val_pairs": len(pairs.val),
              "epochs": cfg.steps * cfg.batch_size / len(pairs.train), "seconds": seconds,
              "train_seconds": train_seconds, "seconds_per_step": train_seconds / max(1, cfg.steps),
              "eval_samples": cfg.eval_samples, "temperature": cfg.temperature, "weights_held": outcome["memory"],
              "device": str(run.device), "processes": distributed.world_size(), "flags": common.flags_record(cfg),
              "origin": common.origin(run)}
    cell = lambda s: common.markdown_cell(s, 220)  # noqa: E731
    rows = side_by_side(cfg.steps, before, after)
    samples = ["| prompt | reference (SFT) | gold | after DPO | gold |", "|---|---|---:|---|---:|"]
    samples += [f"| {cell(r['prompt'])} | {cell(r['reference'])} | {r['gold_reference']:.2f} | {cell(r['policy'])} | "
                f"{r['gold_policy']:.2f} |" for r in rows]
    atomic_write_text(out / "samples.md", "\n".join(samples) + "\n")
    data = "the SFT model's own stories" if cfg.pairs == "sampled" else "the tiny world's pairs"
    atomic_write_text(out / "report.md", "\n".join(
        [f"## Chapter 9: {result['variant']} on {data} (reference {cfg.reference})", "", headline(result, rm_run), "",
         parts_markdown(parts, ranked), "", f"![curves]({out.name}/curves.png)", "",
         f"![KL and gold]({out.name}/kl_gold.png)", "", f"![log-prob shifts]({out.name}/logp_shift.png)", "",
         "\n".join(samples), ""]))
    return result


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
            ax.plot(vsteps, [r[f"val/{key}"] for r in val], color=f"C{i}", marker="o", ls="--",
                    label=f"{key}: held out")
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
    a2.set(xlabel="KL to the reference (k1, nats per story)", ylabel="gold reward (sampled)",
           title="gold reward against KL")
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
    a1.set(xlabel="log π(y|x) − log π_ref(y|x) (nats)", ylabel="held-out pairs",
           title="how each response's log-prob moved")
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


def rankings(val_rows, val_pairs, margins: dict[str, torch.Tensor]) -> tuple[dict[str, dict], dict[str, dict]]:
    """For each named ranking of the held-out pairs (margins: name -> (N,)): its accuracy against the labels and its
    agreement with the gold ranking (chapter 6's ranking_scores), and chapter 6's agreement_by_part."""
    kept = {(p["prompt"], p["chosen"], p["rejected"]) for p in val_pairs}
    rows = [p for p in val_rows if (p["prompt"], p["chosen"], p["rejected"]) in kept]
    parts = [tuple(gold_rewards.story_reward_parts(p["spec"], p[k]) for k in ("chosen", "rejected")) for p in rows]
    gold = gold_sign(rows)
    scores = {name: dict(zip(("accuracy", "gold_agreement"), ranking_scores(m, gold))) for name, m in margins.items()}
    return scores, {name: agreement_by_part(parts, m, gold) for name, m in margins.items()}


def headline(r: dict, rm_run: dict | None) -> str:
    rm = f" (the reward model of chapter 6: {rm_run['accuracy']:.3f})" if rm_run else ""
    return (f"{r['steps']} steps of {r['batch_size']} pairs ({r['epochs']:.2f} epochs) in {r['seconds'] / 60:.1f} min "
            f"on {r['device']}. Held-out preference accuracy of the implicit reward **{r['accuracy']:.3f}**{rm}; "
            f"margin {r['val']['rewards/margins']:+.3f}. Sampled stories at T = {r['temperature']}: gold "
            f"**{r['before']['gold']:.3f} → {r['after']['gold']:.3f}** (paired gain {r['gold_gain']:+.3f} ± "
            f"{r['gold_gain_se']:.3f}) at a KL of {r['kl']:.2f} nats per story. Both log-probs of a pair fell in "
            f"{r['both_fell']:.0%} of the held-out pairs.")


def parts_markdown(parts: dict[str, dict], ranked: dict[str, dict]) -> str:
    """Every held-out pair: each ranking's accuracy against the labels and agreement with gold; then the pairs that
    differ in one part of the gold reward: how often each ranking orders them as gold does."""
    names = list(parts)
    keys = sorted({k for p in parts.values() for k in p},
                  key=lambda k: -max(p.get(k, {}).get("n", 0) for p in parts.values()))
    lines = ["| held-out pairs | pairs | " + " | ".join(names) + " |", "|---|---:|" + "---:|" * len(names)]
    for key, label in (("accuracy", "all: accuracy against the labels"),
                       ("gold_agreement", "all: agreement with gold")):
        lines.append(f"| {label} | | "
                     + " | ".join(f"{ranked[n][key]:.3f}" if n in ranked else "–" for n in names) + " |")
    for k in keys:
        n = max(p.get(k, {}).get("n", 0) for p in parts.values())
        lines.append(f"| differ only in {k} | {n} | "
                     + " | ".join(f"{p[k]['agreement']:.2f}" if k in p else "–" for p in parts.values())
                     + " |")
    return "\n".join(lines)


def compare(cfg: Config, root: Path, device) -> dict:
    """Every loss of COMPARE on the same data, seed and steps; a table and a figure in runs/dpo_compare/."""
    init = cfg.init or prerequisite("sft", cfg.quick, build=not cfg.no_build)
    require_real(init, cfg.quick)
    folder = cfg.out or root / "dpo_compare"
    shared_cache = folder / "reference_logps.safetensors"  # the first variant that trains computes it
    shared_cache.unlink(missing_ok=True)  # never one of an earlier SFT model
    results = []
    for loss_type, beta, ls in COMPARE:
        one = dataclasses.replace(cfg, loss_type=loss_type, beta=beta, label_smoothing=ls, compare=False)  # one run
        run = common.Run(folder / variant(loss_type, beta, ls), cfg.seed, init, device)
        default = (loss_type, beta, ls) == DEFAULT and cfg.out is None  # chapter 9's default run may be it
        kept = ((common.finished_result(one, run._replace(out=root / "dpo")) if default else None)
                or common.finished_result(one, run))
        print(f"\n=== {variant(loss_type, beta, ls)} ===")
        results.append(kept or dpo_run(one, run, shared_cache))
    lines = ["| loss | β | ε | held-out accuracy | margin | chosen | rejected | both fell | "
             "gold (SFT → after) | KL (k1) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in results:
        v = r["val"]
        lines.append(f"| {r['loss_type']} | {r['beta']:g} | {r['label_smoothing']:g} | {r['accuracy']:.3f} | "
                     f"{v['rewards/margins']:+.3f} | {v['rewards/chosen']:+.3f} | {v['rewards/rejected']:+.3f} | "
                     f"{r['both_fell']:.0%} | {r['before']['gold']:.3f} → {r['after']['gold']:.3f} "
                     f"({r['gold_gain']:+.3f} ± {r['gold_gain_se']:.3f}) | {r['kl']:.2f} |")
    text = "\n".join(lines)
    print(f"\nthe same {cfg.steps} steps of {cfg.batch_size} pairs, seed {cfg.seed}, for each loss:\n{text}")
    compare_figure(folder, results)
    keys = ("variant", "loss_type", "beta", "label_smoothing", "accuracy", "kl", "gold_gain", "gold_gain_se",
            "both_fell")
    summary = {"variants": [{k: r[k] for k in keys} | {"gold": r["after"]["gold"]} for r in results]}
    command = f"python chapters/ch09_dpo.py {' '.join(sys.argv[1:])}".strip()
    atomic_write_text(folder / "compare.md", f"`{command}`\n\n{text}\n")
    write_summary(folder, summary, cfg.quick)
    return summary


def compare_figure(folder: Path, results: list[dict]) -> None:
    """Each loss's held-out preference accuracy and gold against its KL to the reference."""
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


def main(argv=None) -> dict:
    cfg = parse_args(argv)
    if cfg.train_pairs:  # bad input fails now, naming the file and line, before any earlier chapter is built
        load_preferences(cfg.train_pairs)
    if cfg.compare:
        common.refuse_torchrun("chapter 9 (DPO) --compare")  # one process: its variants share one reference cache
        return compare(cfg, runs_root(cfg.quick), pick_device(cfg.device))
    runs = common.runs_of(cfg, run_name(cfg))  # one run, or one per seed (seed k from chapter 5's seed k)
    results = [common.finished_result(cfg, run) or dpo_run(cfg, run) for run in runs]
    if not cfg.seeds:
        return results[0]
    f3, signed = "{:.3f}".format, "{:+.3f}".format
    rows = {name: (name, values, fmt) for name, values, fmt in (
        ("held-out preference accuracy", [r["accuracy"] for r in results], f3),
        ("gold reward, SFT (sampled)", [r["before"]["gold"] for r in results], f3),
        ("gold reward, after DPO", [r["after"]["gold"] for r in results], f3),
        ("gold gain (paired)", [r["gold_gain"] for r in results], signed),
        ("KL (k1, nats per story)", [r["kl"] for r in results], f3),
        ("training minutes", [r["seconds"] / 60 for r in results], f3))}
    text, spread = common.spread_table(rows)
    print(f"\n{cfg.seeds} seeds of {variant(cfg.loss_type, cfg.beta, cfg.label_smoothing)}, each from the SFT model "
          f"of the same seed:\n{text}")
    summary = {"seeds": list(range(cfg.seeds)), "spread": spread}
    common.write_sweep(runs[0].out.parent, "ch09_dpo.py", argv, text, summary, cfg.quick)
    return summary


if __name__ == "__main__":
    cli.run(main)
