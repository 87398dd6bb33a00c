"""Chapter 5: supervised fine-tuning (SFT) of the pretrained GPT on the tiny world's instruction tasks.

Starts from runs/pretrain/ (chapter 4; run first if missing), trains on <|user|> prompt <|assistant|>
response <|endoftext|> with the loss on the response only (--train-on-prompt to also train on the
prompt), and measures, on held-out prompts, each task's accuracy (the gold reward: the final number for
sums and word problems, exact match for the other verifiable tasks, the gold story score for stories)
and the share of well-formed answers, before and after. Writes runs/sft/: the model, the tokenizer,
metrics.jsonl, eval.json, samples.md, accuracy.png, loss.png, report.md and summary.json.

--seeds N runs the default run with N seeds (0 .. N-1) into runs/sft_seeds/seed<k>/ and prints the
spread (min / median / max) of each headline number: one lucky run is not a result.

    python chapters/ch05_sft.py              # the default run: about 6 minutes on 2 CPU cores
    python chapters/ch05_sft.py --seeds 5    # the seed sweep behind the README's spread
    python chapters/ch05_sft.py --quick      # a smoke run (also LLMFS_QUICK=1)
    torchrun --standalone --nproc_per_node=2 chapters/ch05_sft.py   # 2 processes share each batch

Under torchrun the --batch-size is the global batch, shared out between the processes (distributed.py); rank 0
evaluates and writes, and every rank returns its result.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import matplotlib.pyplot as plt

import cli  # chapters/cli.py: common flags, one-line errors (also puts the repository on sys.path)
import common  # chapters/common.py: seed sweeps
from llm_from_scratch import dataset_files, distributed
from llm_from_scratch.checkpoint import atomic_write_text, read_jsonl
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
from llm_from_scratch.data import tinyworld_dir
from llm_from_scratch.device import choose_dtype, seed_everything
from llm_from_scratch.plots import loss_plot, save
from llm_from_scratch.sft import SFTBatches, evaluate_tasks
from llm_from_scratch.tokenizer import Tokenizer
from llm_from_scratch.train import TrainConfig, load_gpt, train

HEADLINE = ("arithmetic", "word_problem", "story")  # the numbers a sweep reports (story: the gold score)


def parse_args(argv=None):
    ap = cli.parser(__doc__)
    ap.add_argument("--init", type=Path,
                    help="checkpoint to start from (default runs/pretrain); or a Hugging Face GPT-2 "
                         "folder (config.json + model.safetensors), imported once (appendix C)")
    # 3,400 steps of 16 at 2e-3 rather than 1,700 of 32 at 1e-3 (the same examples, as fast on 2 cores): a word
    # problem's answer copies each event's sentence from the prompt, and that copying appears abruptly, late in
    # training (data/README.md); with fewer or smaller updates it appeared in some seeds only
    ap.add_argument("--steps", type=int, default=3400, help="optimizer steps (default 3400)")
    ap.add_argument("--batch-size", type=int, default=16, help="examples per step (default 16)")
    ap.add_argument("--lr", type=cli.positive_float, default=2e-3, help="peak learning rate (default 2e-3)")
    ap.add_argument("--warmup", type=int, default=50, help="warmup steps (default 50)")
    ap.add_argument("--train-on-prompt", action="store_true", help="also put the loss on the prompt tokens")
    ap.add_argument("--eval-examples", type=int, default=1500,
                    help="held-out examples to score (default 1500: all, every task)")
    ap.add_argument("--seeds", type=int, default=0, metavar="N",
                    help="run seeds 0..N-1 into runs/sft_seeds/ and print the spread of the results")
    ap.add_argument("--no-resume", action="store_true", help="start over even if --out holds an interrupted run")
    cli.add_common_args(ap, "sft", dtype=True)
    cli.add_prerequisite_arg(ap)
    args = ap.parse_args(argv)
    args.quick = args.quick or quick_mode()
    if args.quick:
        args.steps, args.batch_size, args.eval_examples, args.warmup = 20, 8, 35, 5
    for name in ("steps", "batch_size", "eval_examples"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be ≥ 1")
    if args.seeds < 0:
        ap.error("--seeds must be ≥ 0")
    return args


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


def sft_run(args, out: Path, seed: int, init: Path, device, before: dict | None = None) -> dict:
    """One SFT run with `seed` into `out`: train, keep the best checkpoint by validation loss, evaluate, report."""
    main = distributed.is_main()
    if args.no_resume and out.exists() and main:
        shutil.rmtree(out)
    distributed.barrier()  # no rank looks into `out` before rank 0 has cleared it
    seed_everything(seed)
    tok = Tokenizer.load(init)
    model = load_gpt(init, device=device, vocab_size=tok.vocab_size)

    sizes = dataset_files.QUICK_SIZES if args.quick else {}
    with distributed.main_first():  # rank 0 writes the datasets if they are missing, the others read them
        paths = dataset_files.ensure_datasets(tinyworld_dir(args.quick), seed=0, **sizes)
    train_examples = read_jsonl(paths["sft_train"])
    val_examples = read_jsonl(paths["sft_val"])
    eval_set = val_examples[: args.eval_examples]
    ctx = model.config.context_length
    batches = SFTBatches(tok, train_examples, ctx, args.batch_size, seed=seed, train_on_prompt=args.train_on_prompt)
    # a fair sample of every task
    val_batches = SFTBatches(tok, val_examples, ctx, args.batch_size, seed=10_000, group=1)
    print(f"seed {seed}: {len(batches.examples):,} training examples "
          f"({batches.dropped} longer than the context dropped), {len(eval_set)} held-out examples scored; loss on "
          f"{'prompt and response' if args.train_on_prompt else 'the response only'}")

    dtype = choose_dtype(args.dtype, device)  # auto: float32 on a CPU, the same on every CPU (device.py)
    print(f"precision {dtype}" + (f", {distributed.world_size()} processes" if distributed.world_size() > 1 else ""))
    if main:  # rank 0 evaluates and writes; the others only train
        start_run(out)  # until this run finishes, the folder holds no finished run
        if before is None and (out / "eval_before.json").is_file() and (out / "last" / "train_state.pt").is_file():
            before = json.loads((out / "eval_before.json").read_text())  # a resumed run
        if before is None:
            before, _ = evaluate_tasks(model, tok, eval_set)
            print("before SFT:\n" + table(before))
        atomic_write_text(out / "eval_before.json", json.dumps(before, indent=2))

    cfg = TrainConfig(max_steps=args.steps, batch_size=args.batch_size, lr=args.lr, min_lr=args.lr / 10,
                      warmup_steps=args.warmup, eval_interval=max(10, args.steps // 5),
                      checkpoint_interval=max(10, args.steps // 5), log_interval=10, eval_batches=10, dtype=dtype,
                      seed=seed)
    if main:
        tok.save(out)
    t0 = time.perf_counter()
    train(model, cfg, batches.batch, lambda: [val_batches.batch(i) for i in range(cfg.eval_batches)], out,
          quiet=args.quiet)
    seconds = time.perf_counter() - t0
    if not main:
        return distributed.broadcast_object(None)  # rank 0's result, once it has evaluated and written the run

    best = load_gpt(out, device=device, vocab_size=tok.vocab_size)
    after, rows = evaluate_tasks(best, tok, eval_set)
    print(f"after SFT (seed {seed}):\n" + table(after))
    loss_plot(read_jsonl(out / "metrics.jsonl"), out / "loss.png",
              title="SFT loss (" + ("prompt and response tokens)" if args.train_on_prompt else "response tokens)"))
    accuracy_plot(before, after, out / "accuracy.png")
    samples = ["| task | prompt | response | reward |", "|---|---|---|---:|"]
    shown_per_task = {}
    for r in rows:
        if shown_per_task.get(r["task"], 0) < 2:
            shown_per_task[r["task"]] = shown_per_task.get(r["task"], 0) + 1
            samples.append(f"| {r['task']} | {table_cell(r['prompt'])} | {table_cell(r['response'])} | "
                           f"{r['reward']:.2f} |")
    result = {"before": before, "after": after, "seconds": seconds, "steps": args.steps, "seed": seed, "lr": args.lr,
              "train_on_prompt": args.train_on_prompt, "device": str(device), "precision": dtype,
              "processes": distributed.world_size()}
    atomic_write_text(out / "eval.json", json.dumps(result, indent=2))
    atomic_write_text(out / "samples.md", "\n".join(samples) + "\n")
    atomic_write_text(out / "report.md", "\n".join([
        "## Chapter 5: supervised fine-tuning", "",
        f"{args.steps} steps in {seconds / 60:.1f} min on {device} ({dtype}), seed {seed}; loss on "
        f"{'prompt and response' if args.train_on_prompt else 'the response only'}.", "",
        "Before:", "", table(before), "", "After:", "", table(after), "",
        f"![accuracy]({out.name}/accuracy.png) ![loss]({out.name}/loss.png)", "", "\n".join(samples), ""]))
    write_summary(out, {k: v for k, v in result.items() if k != "before"}, args.quick)  # last: marks the run finished
    print(f"trained in {seconds / 60:.1f} min; model in {shown(out)}")
    return distributed.broadcast_object(result)


def table_cell(text: str, width: int = 160) -> str:
    """One markdown table cell: newlines and pipes replaced; a long text keeps its start and its end (a QA prompt's
    question comes last)."""
    text = text.replace("\n", " ").replace("|", "/")
    return text if len(text) <= width else text[: width // 2 - 2] + " … " + text[-(width // 2 - 2):]


def finished_seed(args, out: Path, seed: int) -> dict | None:
    """The result of a finished run of this very configuration in `out` (a sweep picks up where it stopped), else
    None."""
    if args.no_resume or not same_cpu_mode(finished_run(out)) or not (out / "eval.json").is_file():
        return None
    result = json.loads((out / "eval.json").read_text(encoding="utf-8"))
    same = {"steps": args.steps, "seed": seed, "lr": args.lr, "train_on_prompt": args.train_on_prompt}
    if any(result.get(k) != v for k, v in same.items()) or args.dtype not in ("auto", result["precision"]):
        return None
    print(f"seed {seed}: keeping the finished run in {shown(out)} ({result['precision']})")
    return result


def spread_rows(results: list[dict]) -> dict:
    """The rows of the sweep's table (common.spread_table): each headline task's accuracy over the runs (story: the
    gold score)."""
    return {task: (task, [r["after"][task]["accuracy"] for r in results], "{:.1%}".format)
            for task in HEADLINE if all(task in r["after"] for r in results)}


def main(argv=None) -> dict:
    args = parse_args(argv)
    root = runs_root(args.quick)
    device = distributed.setup(args.device)  # pick_device, and the process group under torchrun
    with distributed.main_first():  # rank 0 builds a missing prerequisite, the others find it
        init = common.init_folder(args.init, args.quick) if args.init else prerequisite("pretrain", args.quick,
                                                                                       build=not args.no_build)
    require_real(init, args.quick)
    if not args.seeds:
        return sft_run(args, args.out or root / "sft", args.seed, init, device)

    sweep_dir = args.out or root / "sft_seeds"
    kept = {k: finished_seed(args, sweep_dir / f"seed{k}", k) for k in range(args.seeds)}  # seeds already finished
    done = [r for r in kept.values() if r]
    if done and args.dtype == "auto":
        args.dtype = done[0]["precision"]  # new seeds train as the finished ones did
    results, before = [], done[0]["before"] if done else None
    for k in range(args.seeds):
        results.append(kept[k] or sft_run(args, sweep_dir / f"seed{k}", k, init, device, before))
        before = results[-1]["before"]  # the same pretrained model: evaluate it once
        args.dtype = results[-1]["precision"]  # and choose the precision once: every seed trains alike
    text, spread = common.spread_table(spread_rows(results), first="task")
    precisions = sorted({r["precision"] for r in results})
    print(f"\n{args.seeds} seeds of the default run ({args.steps} steps, {' and '.join(precisions)}):\n{text}")
    summary = {"seeds": list(range(args.seeds)), "spread": spread, "steps": args.steps,
               "precision": [r["precision"] for r in results], "seconds": [r["seconds"] for r in results]}
    common.write_sweep(sweep_dir, "ch05_sft.py", argv, text, summary, args.quick)
    return summary


if __name__ == "__main__":
    cli.run(main)
