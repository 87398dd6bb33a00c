"""Chapter 5: supervised fine-tuning (SFT) of the pretrained GPT on the tiny world's instruction tasks.

Starts from runs/pretrain/ (chapter 4), trains on <|user|> prompt <|assistant|> response <|endoftext|>
with the loss on the response only (--train-on-prompt to also train on the prompt), and measures, on
held-out prompts, each task's accuracy (the gold reward: the final number for sums and word problems, exact
match for the other verifiable tasks, the gold story score for stories) and the share of
well-formed answers, before and after. Writes runs/sft/: the model, the tokenizer, metrics.jsonl,
eval.json, samples.md, accuracy.png, loss.png and report.md.

    python chapters/ch05_sft.py            # the default run: a few minutes on 2 CPU cores
    python chapters/ch05_sft.py --quick    # a smoke run (also LLMFS_QUICK=1)
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from llm_from_scratch import tinyworld  # noqa: E402
from llm_from_scratch.checkpoint import atomic_write_text, quick_mode, read_metrics, runs_root  # noqa: E402
from llm_from_scratch.data import tinyworld_dir  # noqa: E402
from llm_from_scratch.device import fastest_autocast_dtype, pick_device, seed_everything  # noqa: E402
from llm_from_scratch.model import load_gpt  # noqa: E402
from llm_from_scratch.plots import loss_plot, save  # noqa: E402
from llm_from_scratch.sft import SFTBatches, evaluate_tasks  # noqa: E402
from llm_from_scratch.tokenizer import Tokenizer  # noqa: E402
from llm_from_scratch.train import TrainConfig, train  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--init", type=Path, help="checkpoint to start from (default runs/pretrain)")
    ap.add_argument("--steps", type=int, default=1700, help="optimizer steps (default 1700)")
    ap.add_argument("--batch-size", type=int, default=32, help="examples per step (default 32)")
    ap.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3)")
    ap.add_argument("--warmup", type=int, default=50, help="warmup steps (default 50)")
    ap.add_argument("--train-on-prompt", action="store_true", help="also put the loss on the prompt tokens")
    ap.add_argument("--eval-examples", type=int, default=1000, help="held-out examples to score (default 1000, all tasks)")
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda or mps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="output folder (default runs/sft)")
    ap.add_argument("--no-resume", action="store_true", help="start over even if --out holds an interrupted run")
    ap.add_argument("--quick", action="store_true", help="a smoke run (also LLMFS_QUICK=1)")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    args = ap.parse_args(argv)
    args.quick = args.quick or quick_mode()
    if args.quick:
        args.steps, args.batch_size, args.eval_examples, args.warmup = 20, 8, 35, 5
    return args


def ensure_pretrained(root: Path, quick: bool) -> Path:
    """runs/pretrain, made by a quick chapter-4 run if it is missing (said out loud: its results are poor)."""
    folder = root / "pretrain"
    if not (folder / "summary.json").is_file():  # written when a chapter-4 run finishes
        print(f"no pretrained model in {folder}: making a quick one with chapters/ch04_pretrain.py --quick "
              f"(run the full chapter 4 for real results)")
        subprocess.run([sys.executable, str(ROOT / "chapters" / "ch04_pretrain.py"), "--quick", "--quiet", "--out", str(folder)],
                       check=True)
    return folder


def accuracy_plot(before: dict, after: dict, path: Path):
    tasks = list(after)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    xs = range(len(tasks))
    ax.bar([x - 0.2 for x in xs], [before[t]["accuracy"] for t in tasks], width=0.4, label="pretrained")
    ax.bar([x + 0.2 for x in xs], [after[t]["accuracy"] for t in tasks], width=0.4, label="after SFT")
    ax.set_xticks(list(xs), tasks, rotation=20)
    ax.set(ylabel="accuracy / gold story score", ylim=(0, 1), title="Held-out tasks before and after SFT")
    ax.legend()
    return save(fig, path)


def table(summary: dict) -> str:
    lines = ["| task | accuracy | well-formed | n |", "|---|---:|---:|---:|"]
    lines += [f"| {t} | {s['accuracy']:.1%} | {s['well_formed']:.1%} | {s['n']} |" for t, s in summary.items()]
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    root = runs_root(args.quick)
    out = args.out or root / "sft"
    if args.no_resume and out.exists():
        shutil.rmtree(out)
    device = pick_device(args.device)
    seed_everything(args.seed)
    init = args.init or ensure_pretrained(root, args.quick)
    tok = Tokenizer.load(init)
    model = load_gpt(init, device=device, vocab_size=tok.vocab_size)

    sizes = tinyworld.QUICK_SIZES if args.quick else {}
    paths = tinyworld.ensure_datasets(tinyworld_dir(args.quick), seed=0, **sizes)
    train_examples = tinyworld.read_jsonl(paths["sft_train"])
    val_examples = tinyworld.read_jsonl(paths["sft_val"])
    eval_set = val_examples[: args.eval_examples]
    ctx = model.config.context_length
    batches = SFTBatches(tok, train_examples, ctx, args.batch_size, seed=args.seed, train_on_prompt=args.train_on_prompt)
    val_batches = SFTBatches(tok, val_examples, ctx, args.batch_size, seed=10_000, group=1)  # a fair sample of every task
    print(f"{len(batches.examples):,} training examples ({batches.dropped} longer than the context dropped), "
          f"{len(eval_set)} held-out examples scored; loss on {'prompt and response' if args.train_on_prompt else 'the response only'}")

    resuming = (out / "last" / "train_state.pt").is_file()
    if resuming and (out / "eval_before.json").is_file():
        before = json.loads((out / "eval_before.json").read_text())
    else:
        before, _ = evaluate_tasks(model, tok, eval_set)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "eval_before.json", json.dumps(before, indent=2))
    print("before SFT:\n" + table(before))

    dtype = fastest_autocast_dtype(device)
    cfg = TrainConfig(max_steps=args.steps, batch_size=args.batch_size, lr=args.lr, min_lr=args.lr / 10,
                      warmup_steps=args.warmup, eval_interval=max(10, args.steps // 5), checkpoint_interval=max(10, args.steps // 5),
                      log_interval=10, eval_batches=10, dtype="bfloat16" if dtype else "float32", seed=args.seed)
    tok.save(out)
    t0 = time.perf_counter()
    try:
        train(model, cfg, batches.batch, lambda: [val_batches.batch(i) for i in range(cfg.eval_batches)], out, quiet=args.quiet)
    except KeyboardInterrupt:
        raise SystemExit(130)
    except FloatingPointError as err:
        raise SystemExit(f"stopped: {err}")
    seconds = time.perf_counter() - t0

    best = load_gpt(out, device=device, vocab_size=tok.vocab_size)
    after, rows = evaluate_tasks(best, tok, eval_set)
    print("after SFT:\n" + table(after))
    loss_plot(read_metrics(out / "metrics.jsonl"), out / "loss.png",
              title="SFT loss (" + ("prompt and response tokens)" if args.train_on_prompt else "response tokens)"))
    accuracy_plot(before, after, out / "accuracy.png")
    samples = ["| task | prompt | response | reward |", "|---|---|---|---:|"]
    shown = {}
    for r in rows:
        if shown.get(r["task"], 0) < 2:
            shown[r["task"]] = shown.get(r["task"], 0) + 1
            cell = lambda s: s.replace("\n", " ").replace("|", "/")[:160]  # noqa: E731
            samples.append(f"| {r['task']} | {cell(r['prompt'])} | {cell(r['response'])} | {r['reward']:.2f} |")
    result = {"before": before, "after": after, "seconds": seconds, "steps": args.steps,
              "train_on_prompt": args.train_on_prompt, "device": str(device)}
    atomic_write_text(out / "eval.json", json.dumps(result, indent=2))
    atomic_write_text(out / "samples.md", "\n".join(samples) + "\n")
    atomic_write_text(out / "report.md", "\n".join([
        "## Chapter 5: supervised fine-tuning", "",
        f"{args.steps} steps in {seconds / 60:.1f} min on {device}; loss on "
        f"{'prompt and response' if args.train_on_prompt else 'the response only'}.", "",
        "Before:", "", table(before), "", "After:", "", table(after), "",
        f"![accuracy]({out.name}/accuracy.png) ![loss]({out.name}/loss.png)", "", "\n".join(samples), ""]))
    print(f"trained in {seconds / 60:.1f} min; model in {out}")
    return result


if __name__ == "__main__":
    main()
