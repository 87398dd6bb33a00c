"""Chapter 4: pretrain a GPT on the tiny world (or on any text with --text).

Tokenizes the corpus with the chapter-1 tokenizer (running chapter 1 first if its run is missing),
trains the chosen GPT preset with AdamW (warmup + cosine), evaluates the validation loss against the
tiny world's entropy floor, prints samples before and after, and saves the checkpoint that chapter 5
(SFT) starts from in runs/pretrain/: model.safetensors + config.json + the tokenizer, metrics.jsonl,
loss.png and summary.json.

The validation loss is measured on whole validation documents, each window starting at a document
boundary (data.document_windows), so it is comparable with the entropy floor of the same documents:
a window cut mid-document has lost the context its first tokens depend on.

Runs resume: run the same command again after Ctrl-C and it continues where it stopped
(--no-resume starts over).

    python chapters/ch04_pretrain.py                 # the default run: about 5 minutes on 2 CPU cores
    python chapters/ch04_pretrain.py --quick         # a smoke run (also LLMFS_QUICK=1)
    python chapters/ch04_pretrain.py --text my.txt   # any UTF-8 corpus (trains a tokenizer for it)
    torchrun --standalone --nproc_per_node=2 chapters/ch04_pretrain.py   # 2 processes (GPUs, or CPU with gloo)

Under torchrun the --batch-size is the global batch, shared out between the processes (distributed.py): the same
run, the same losses, on 1 or W processes.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch

import cli  # chapters/cli.py: common flags, one-line errors (also puts the repository on sys.path)
from llm_from_scratch import dataset_files, distributed
from llm_from_scratch.checkpoint import atomic_write_text, read_jsonl
from llm_from_scratch.course import prerequisite, quick_mode, runs_root, shown, start_run, write_summary
from llm_from_scratch.data import WindowSampler, document_windows, read_text, tinyworld_dir
from llm_from_scratch.device import choose_dtype, seed_everything
from llm_from_scratch.generation import generate
from llm_from_scratch.model import GPT, PRESETS, GPTConfig
from llm_from_scratch.plots import loss_plot
from llm_from_scratch.tokenizer import EOS_TOKEN, Tokenizer
from llm_from_scratch.train import TrainConfig, load_gpt, train

PROMPTS = ["Once upon a time,", "Mia found a", "23 plus 45:", "Cats say"]


def parse_args(argv=None):
    ap = cli.parser(__doc__)
    ap.add_argument("--preset", default="tiny", choices=[p for p in PRESETS if not p.startswith("gpt2")],
                    help="model size (default tiny)")
    ap.add_argument("--text", type=Path,
                    help="pretrain on this UTF-8 file instead of the tiny world (last 5%% = validation)")
    ap.add_argument("--tokenizer", type=Path,
                    help="tokenizer folder (default: runs/tokenizer; with --text, one is trained)")
    ap.add_argument("--steps", type=int, default=1200, help="optimizer steps (default 1200: about 4.9M tokens)")
    ap.add_argument("--batch-size", type=int, default=32, help="sequences per step (default 32)")
    ap.add_argument("--context", type=int, default=128,
                    help="training window in tokens (default 128, at most the preset's context)")
    ap.add_argument("--lr", type=cli.positive_float, default=3e-3, help="peak learning rate (default 3e-3)")
    ap.add_argument("--warmup", type=int, default=50, help="warmup steps (default 50)")
    ap.add_argument("--dropout", type=cli.finite_float, default=0.0,
                    help="dropout (default 0: the tiny world is plentiful)")
    ap.add_argument("--eval-interval", type=int, default=100, help="steps between validation runs (default 100)")
    ap.add_argument("--compile", default="auto", choices=["auto", "on", "off"],
                    help="torch.compile; auto = on for CUDA only")
    ap.add_argument("--no-resume", action="store_true", help="start over even if --out holds an interrupted run")
    cli.add_common_args(ap, "pretrain", dtype=True)
    cli.add_prerequisite_arg(ap)
    args = ap.parse_args(argv)
    args.quick = args.quick or quick_mode()
    if args.quick:
        args.steps, args.batch_size, args.eval_interval, args.warmup = 30, 8, 15, 5
    for name in ("steps", "batch_size", "context", "eval_interval"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be ≥ 1")
    return args


def load_corpus(args):
    """(tokenizer, train token ids, val token ids, entropy floor in nats/token or None)."""
    if args.text:
        text = read_text(args.text)
        cut = int(len(text) * 0.95)
        train_text, val_text = text[:cut], text[cut:]
        tok = Tokenizer.load(args.tokenizer) if args.tokenizer else Tokenizer.train(train_text, 768)
        floor = None
    else:
        sizes = dataset_files.QUICK_SIZES if args.quick else {}
        paths = dataset_files.ensure_datasets(tinyworld_dir(args.quick), seed=0, **sizes)
        train_text = paths["pretrain_train"].read_text(encoding="utf-8")
        val_text = paths["pretrain_val"].read_text(encoding="utf-8")
        tok = Tokenizer.load(args.tokenizer or prerequisite("tokenizer", args.quick, build=not args.no_build))
        floor = json.loads(paths["pretrain_meta"].read_text())["splits"]["val"]["total_nats"]
    train_ids = np.array(tok.encode(train_text, allowed_special={EOS_TOKEN}), dtype=np.int64)
    val_ids = np.array(tok.encode(val_text, allowed_special={EOS_TOKEN}), dtype=np.int64)
    if floor is not None:
        floor /= len(val_ids)  # total nats of the validation documents / their tokens, each document's EOS included
    return tok, train_ids, val_ids, floor


def samples(model: GPT, tok: Tokenizer, temperature: float, seed: int = 0) -> list[str]:
    prompts = [tok.encode(p) for p in PROMPTS]
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    out = generate(model, prompts, 40, temperature=temperature, top_k=None, eos_id=tok.eos_id, pad_id=tok.pad_id,
                   generator=g)
    return [p + tok.decode([t for t in c if t != tok.eos_id]) for p, c in zip(PROMPTS, out.completions())]


def main(argv=None) -> dict:
    args = parse_args(argv)
    root = runs_root(args.quick)
    out = args.out or root / "pretrain"
    device = distributed.setup(args.device)  # pick_device, and the process group under torchrun
    if args.no_resume and out.exists() and distributed.is_main():
        shutil.rmtree(out)
    seed_everything(args.seed)

    with distributed.main_first():  # rank 0 builds what is missing (data, tokenizer); the others then read it
        tok, train_ids, val_ids, floor = load_corpus(args)
    preset = dict(PRESETS[args.preset])
    if args.context > preset["context_length"]:
        raise ValueError(f"--context {args.context} is longer than the {args.preset} preset's "
                         f"{preset['context_length']}")
    config = GPTConfig.preset(args.preset, vocab_size=tok.vocab_size, dropout=args.dropout)
    model = GPT(config).to(device)

    sampler = WindowSampler(train_ids, args.context, args.batch_size, seed=args.seed)
    dtype = choose_dtype(args.dtype, device)  # auto: float32 on a CPU, the same on every CPU (device.py)
    why = " (auto)" if args.dtype == "auto" else ""
    compile_ = args.compile == "on" or (args.compile == "auto" and device.type == "cuda")
    processes = f" | {distributed.world_size()} processes" if distributed.world_size() > 1 else ""
    print(f"device {device}{processes} | precision {dtype}{why} | compile {'on' if compile_ else 'off'}"
          f" | {model.num_params():,} parameters | {len(train_ids):,} training tokens, "
          f"{len(val_ids):,} validation tokens")
    if floor is not None:
        print(f"entropy floor of the validation text: {floor:.4f} nats/token")

    cfg = TrainConfig(max_steps=args.steps, batch_size=args.batch_size, lr=args.lr, min_lr=args.lr / 10,
                      warmup_steps=args.warmup, eval_interval=args.eval_interval,
                      checkpoint_interval=args.eval_interval,
                      log_interval=max(1, min(10, args.eval_interval // 2)), eval_batches=20,
                      dtype=dtype, compile=compile_, seed=args.seed)
    if floor is not None:  # whole documents from their start: the floor's own terms
        val_set, skipped = document_windows(val_ids, tok.eos_id, args.context, args.batch_size, tok.pad_id)
        if skipped:
            raise ValueError(f"{skipped} validation documents are longer than --context {args.context}: "
                             f"the floor would not be like for like; use a longer --context")
        print(f"validation: all {int(sum((y != -100).sum() for _, y in val_set)):,} tokens of the validation "
              f"documents, in {len(val_set)} batches of windows that start at a document boundary")
    else:  # any text: random windows, the same ones every time
        val_sampler = WindowSampler(val_ids, args.context, args.batch_size, seed=10_000 + args.seed)
        val_set = [val_sampler.batch(i) for i in range(cfg.eval_batches)]
    val_batches = lambda: val_set  # noqa: E731

    resuming = (out / "last" / "train_state.pt").is_file()
    before = samples(model, tok, temperature=1.0) if not resuming else []
    for s in before:
        print("  before | " + s.replace("\n", " "))
    if distributed.is_main():
        start_run(out)  # until this run finishes, the folder holds no finished run
        tok.save(out)
    t0 = time.perf_counter()
    summary = train(model, cfg, sampler.batch, val_batches, out, resume=True, quiet=args.quiet,
                    on_eval=lambda step, m: {"samples": samples(m, tok, temperature=0.0)})
    seconds = time.perf_counter() - t0
    if not distributed.is_main():  # rank 0 samples, plots and writes the summary
        return summary

    best = load_gpt(out, device=device, vocab_size=tok.vocab_size)
    after = samples(best, tok, temperature=0.8, seed=1)
    for s in after:
        print("  after  | " + s.replace("\n", " "))
    records = read_jsonl(out / "metrics.jsonl")
    loss_plot(records, out / "loss.png", floor=floor, title=f"Pretraining the {args.preset} GPT")
    result = {"preset": args.preset, "params": model.num_params(), "steps": args.steps, "seconds_this_run": seconds,
              "tokens": summary["tokens"], "best_val_loss": summary["best_val"], "entropy_floor": floor,
              "gap_to_floor": None if floor is None else summary["best_val"] - floor, "device": str(device),
              "processes": distributed.world_size(),
              "precision": cfg.dtype, "compile": compile_,
              "validation": "document windows" if floor is not None else "random windows"}
    atomic_write_text(out / "report.md", report(result, before, after))
    write_summary(out, result, args.quick)  # last: marks the run finished
    if floor is not None:
        print(f"best validation loss {summary['best_val']:.4f} nats/token; floor {floor:.4f}; "
              f"gap {summary['best_val'] - floor:.4f}")
    print(f"trained {summary['tokens']:,} tokens in {seconds / 60:.1f} min; checkpoint in {shown(out)}")
    return result


def report(r: dict, before: list[str], after: list[str]) -> str:
    floor = f"{r['entropy_floor']:.4f}" if r["entropy_floor"] is not None else "n/a"
    gap = f"{r['gap_to_floor']:.4f}" if r["gap_to_floor"] is not None else "n/a"
    lines = ["## Chapter 4: pretraining", "",
             f"- {r['preset']} GPT, {r['params']:,} parameters, {r['steps']} steps, {r['tokens']:,} tokens, "
             f"{r['seconds_this_run'] / 60:.1f} min on {r['device']} "
             f"({r['precision']}, compile {'on' if r['compile'] else 'off'})",
             f"- best validation loss **{r['best_val_loss']:.4f}** nats/token; entropy floor {floor}; gap {gap}", "",
             "![loss](pretrain/loss.png)", "", "| before training | after |", "|---|---|"]
    lines += [f"| {b[:90]} | {a[:120]} |" for b, a in zip(before or [""] * len(after), after)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    cli.run(main)
