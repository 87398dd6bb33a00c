"""Appendix A: LoRA, and the reference policy for free (llm_from_scratch/lora.py).

Three parts, each printed and written to runs/appA_lora/:

1. What LoRA trains. On chapter 5's SFT model: the trained parameters for each rank and choice of layers (r · (in +
   out) per adapted layer, against every weight for full fine-tuning), and three checks on the real model: with fresh
   adapters (B = 0) the model is the SFT model bit for bit; after a few steps, the adapters switched off give the SFT
   model bit for bit (the reference, with no second copy); merging the adapters into the weights changes no output
   beyond float rounding.
2. The same alignment budgets, full fine-tuning against LoRA, over --seeds seeds: chapter 9's DPO and chapter 7's
   RLOO on word problems, each run by its chapter script (`--seeds N`, and `--lora-rank R` for LoRA), seed k from
   chapter 5's seed k, so the two runs of a seed start from the same SFT model and are paired. A sweep that is already
   finished is kept by the chapter script. The table: each seed's gain for both, the paired difference (LoRA − full)
   with its mean and standard error over seeds, the KL, the trained parameters, the weights held and the minutes.
3. Memory and speed at GPT-2's size: benchmarks/bench_lora.py's last result (runs/bench_lora/result.json), when it has
   run; this script does not run it (minutes of a CPU at the gpt2-124m preset).

    python chapters/appA_lora.py                 # rank 8, 3 seeds: about 50 minutes on 2 CPU cores
    python chapters/appA_lora.py --rank 4 --methods dpo
    python chapters/appA_lora.py --quick         # a smoke run (also LLMFS_QUICK=1)
"""

from __future__ import annotations

import copy
import json
import os
import statistics
from pathlib import Path

import matplotlib.pyplot as plt
import torch

import cli  # chapters/cli.py: common flags, one-line errors (also puts the repository on sys.path)
import run_all  # chapters/run_all.py: a chapter script in its own process
from llm_from_scratch import lora
from llm_from_scratch.checkpoint import atomic_write_text
from llm_from_scratch.course import prerequisite, quick_mode, require_real, runs_root, shown, start_run, write_summary
from llm_from_scratch.device import pick_device, seed_everything
from llm_from_scratch.plots import save
from llm_from_scratch.tokenizer import Tokenizer
from llm_from_scratch.train import load_gpt

# method -> (chapter script, its sweep folder for full fine-tuning, the gain's eval.json reader, label of the score)
METHODS = {
    "dpo": ("ch09_dpo.py", "dpo", lambda e: e["gold_gain"], "DPO on stories: gold gain (sampled, paired)"),
    "rloo": ("ch07_policy_gradient.py", "pg_word-problems_rloo", lambda e: e["after"]["gold"] - e["before"]["gold"],
             "RLOO on word problems: held-out accuracy gain"),
}
RANKS = (1, 2, 4, 8, 16)


def parse_args(argv=None):
    ap = cli.parser(__doc__)
    ap.add_argument("--rank", type=int, default=8, help="LoRA's rank for the comparison (default 8)")
    ap.add_argument("--alpha", type=cli.positive_float, help="LoRA's α (default 2 · rank)")
    ap.add_argument("--targets", default="all", choices=["attn", "mlp", "all"],
                    help="the layers that get adapters (default all)")
    ap.add_argument("--seeds", type=int, default=3, help="seeds of each sweep (default 3)")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS),
                    help="which comparisons to run (default: dpo rloo)")
    cli.add_common_args(ap, "appA_lora")
    cli.add_prerequisite_arg(ap)
    args = ap.parse_args(argv)
    args.quick = args.quick or quick_mode()
    if args.rank < 1:
        ap.error("--rank must be ≥ 1")
    if args.seeds < 2:
        ap.error("--seeds must be ≥ 2: a comparison over seeds needs at least two")
    return args


# ----------------------------------------------------------------------------- 1. what LoRA trains


def trained_counts(model: torch.nn.Module) -> list[dict]:
    """Trained parameters of LoRA on a copy of `model` for each rank and choice of layers, against full fine-tuning."""
    full = sum(p.numel() for p in model.parameters())
    rows = [{"method": "full fine-tuning", "rank": None, "targets": "every weight", "trained": full}]
    for targets in ("attn", "mlp", "all"):
        for rank in RANKS:
            adapted = lora.apply_lora(copy.deepcopy(model), rank, targets=targets)
            rows.append({"method": "LoRA", "rank": rank, "targets": targets,
                         "trained": sum(p.numel() for p in lora.trainable_parameters(adapted))})
    for r in rows:
        r["share"] = r["trained"] / full
    return rows


def checks(sft: torch.nn.Module, tok: Tokenizer, rank: int, alpha: float | None, targets: str, seed: int) -> dict:
    """The three facts LoRA rests on, measured on the SFT model: fresh adapters change nothing; adapters off is the
    SFT model after training; merging changes no output beyond rounding."""
    seed_everything(seed)
    policy = lora.apply_lora(copy.deepcopy(sft), rank, alpha, targets)
    text = "Write a happy story about Mia and a red kite. Once upon a time, Mia had a red kite."
    ids = torch.tensor([tok.encode(text)], device=next(sft.parameters()).device)
    with torch.no_grad():
        sft_logits = sft(ids)
        fresh_equal = torch.equal(policy(ids), sft_logits)
    optimizer = torch.optim.AdamW(lora.trainable_parameters(policy), lr=1e-2)
    for _ in range(5):  # a few steps of next-token loss on the text, enough to move the adapters
        logits = policy(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[0, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        adapted = policy(ids)
        with lora.adapters_disabled(policy):
            off_equal = torch.equal(policy(ids), sft_logits)
        lora.merge(policy)
        merged_diff = (policy(ids) - adapted).abs().max().item()
        lora.unmerge(policy)
    return {"fresh_equals_sft": fresh_equal, "trained_moved": (adapted - sft_logits).abs().max().item(),
            "adapters_off_equals_sft": off_equal, "merged_max_abs_diff": merged_diff}


# ----------------------------------------------------------------------------- 2. full fine-tuning against LoRA


def sweep(args, method: str, use_lora: bool, env: dict) -> list[dict]:
    """One chapter sweep (--seeds N, with --lora-rank for LoRA), run by its script in its own process (it keeps a
    finished sweep); the eval.json of each seed."""
    script, name, _, _ = METHODS[method]
    flags = ["--seeds", str(args.seeds), "--device", args.device]
    if use_lora:
        flags += ["--lora-rank", str(args.rank), "--lora-targets", args.targets]
        flags += ["--lora-alpha", str(args.alpha)] if args.alpha else []
        name += f"_lora{args.rank}"
    print(f"\n--- {method}, {'LoRA rank ' + str(args.rank) if use_lora else 'full fine-tuning'}: python chapters/"
          f"{script} {' '.join(flags)}", flush=True)
    run_all.run_chapter(script, args.quick, args.quiet, env, False, flags + (["--no-build"] if args.no_build else []))
    folder = runs_root(args.quick) / f"{name}_seeds"
    return [json.loads((folder / f"seed{k}" / "eval.json").read_text(encoding="utf-8")) for k in range(args.seeds)]


def held_bytes(e: dict) -> float | None:
    """MiB of weights a run held while it trained (eval.json's weights_held; None for a run that did not record it)."""
    held = e.get("weights_held")
    return sum(v["bytes"] for v in held.values()) / 2 ** 20 if held else None


def mean_se(values: list[float]) -> tuple[float, float]:
    """The mean and its standard error over seeds."""
    return statistics.mean(values), statistics.stdev(values) / len(values) ** 0.5


def comparison(method: str, full: list[dict], low_rank: list[dict]) -> dict:
    """Each seed's gain with full fine-tuning and with LoRA (paired: the same SFT model), and their difference."""
    gain = METHODS[method][2]
    g_full, g_lora = [gain(e) for e in full], [gain(e) for e in low_rank]
    diff = [b - a for a, b in zip(g_full, g_lora)]
    return {"full": g_full, "lora": g_lora, "diff": diff, "diff_mean_se": mean_se(diff),
            "full_mean_se": mean_se(g_full), "lora_mean_se": mean_se(g_lora),
            "kl_full": [e["kl"] for e in full], "kl_lora": [e["kl"] for e in low_rank],
            "minutes_full": [e["seconds"] / 60 for e in full], "minutes_lora": [e["seconds"] / 60 for e in low_rank],
            "lr_full": full[0]["lr"], "lr_lora": low_rank[0]["lr"],
            "held_full": held_bytes(full[0]), "held_lora": held_bytes(low_rank[0])}


def comparison_markdown(results: dict, rank: int) -> str:
    lines = ["| method | seed | full fine-tuning | LoRA r=" + str(rank) + " | LoRA − full | KL full / LoRA | "
             "minutes full / LoRA |", "|---|---:|---:|---:|---:|---:|---:|"]
    for method, c in results.items():
        for k, (a, b) in enumerate(zip(c["full"], c["lora"])):
            lines.append(f"| {method} | {k} | {a:+.3f} | {b:+.3f} | {b - a:+.3f} | {c['kl_full'][k]:.2f} / "
                         f"{c['kl_lora'][k]:.2f} | {c['minutes_full'][k]:.1f} / {c['minutes_lora'][k]:.1f} |")
        (fm, fs), (lm, ls), (dm, ds) = c["full_mean_se"], c["lora_mean_se"], c["diff_mean_se"]
        lines.append(f"| {method} | mean ± s.e. | {fm:+.3f} ± {fs:.3f} | {lm:+.3f} ± {ls:.3f} | "
                     f"**{dm:+.3f} ± {ds:.3f}** | | |")
    notes = []
    for method, c in results.items():
        held = (f"weights held {c['held_full']:.2f} MiB → {c['held_lora']:.2f} MiB"
                if c["held_full"] and c["held_lora"] else "")
        notes.append(f"{method}: lr {c['lr_full']:g} (full) and {c['lr_lora']:g} (LoRA)"
                     + (f"; {held}" if held else ""))
    return "\n".join(lines) + "\n\n" + "; ".join(notes) + "."


def comparison_figure(out: Path, results: dict, rank: int) -> None:
    """Each seed's gain, full against LoRA, one panel per method: points on the diagonal are ties."""
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4.2), constrained_layout=True, squeeze=False)
    for ax, (method, c) in zip(axes[0], results.items()):
        ax.scatter(c["full"], c["lora"], s=40, zorder=3)
        for k, (a, b) in enumerate(zip(c["full"], c["lora"])):
            ax.annotate(f"seed {k}", (a, b), fontsize=7, xytext=(4, 4), textcoords="offset points")
        lo = min(c["full"] + c["lora"] + [0.0])
        hi = max(c["full"] + c["lora"] + [0.0])
        pad = 0.1 * (hi - lo or 1.0)
        ax.plot([lo - pad, hi + pad], [lo - pad, hi + pad], "k--", lw=0.8, label="LoRA = full")
        ax.set(xlabel="gain with full fine-tuning", ylabel=f"gain with LoRA r={rank}", title=METHODS[method][3])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save(fig, out / "compare.png")


# ----------------------------------------------------------------------------- 3. the benchmark's last result


def bench_summary() -> str | None:
    """The table benchmarks/bench_lora.py printed last (runs/bench_lora/result.json, a real run's folder even in
    quick mode: the benchmark has no quick mode), with the command and the machine; None when it has not run."""
    file = runs_root(False) / "bench_lora" / "result.json"
    if not file.is_file():
        return None
    r = json.loads(file.read_text(encoding="utf-8"))
    machine = r.get("machine", {})
    return (f"`{r.get('command', 'python benchmarks/bench_lora.py')}` ({machine.get('device', '?')}, "
            f"{machine.get('cpu', machine.get('gpu', ''))}):\n\n```\n{r.get('table', '')}\n```")


def main(argv=None) -> dict:
    args = parse_args(argv)
    root = runs_root(args.quick)
    out = args.out or root / "appA_lora"
    start_run(out)
    device = pick_device(args.device)
    sft_dir = prerequisite("sft", args.quick, build=not args.no_build)
    require_real(sft_dir, args.quick)
    tok = Tokenizer.load(sft_dir)
    sft = load_gpt(sft_dir, device=device, vocab_size=tok.vocab_size, dropout=0.0)

    counts = trained_counts(sft)
    count_lines = ["| method | rank | layers | trained parameters | share of the model |", "|---|---:|---|---:|---:|"]
    count_lines += [f"| {r['method']} | {r['rank'] or '—'} | {r['targets']} | {r['trained']:,} | {r['share']:.2%} |"
                    for r in counts]
    print("What LoRA trains on chapter 5's SFT model:\n" + "\n".join(count_lines))
    facts = checks(sft, tok, args.rank, args.alpha, args.targets, args.seed)
    print(f"fresh adapters (B = 0) give the SFT model's logits bit for bit: {facts['fresh_equals_sft']}; after 5 "
          f"steps the logits moved by up to {facts['trained_moved']:.3f}, and with the adapters off they are the SFT "
          f"model's bit for bit: {facts['adapters_off_equals_sft']}; merged into the weights, the outputs differ by "
          f"at most {facts['merged_max_abs_diff']:.1e} (float rounding)")

    env = dict(os.environ, LLMFS_QUICK="1" if args.quick else "0")
    print(f"\n--- chapter 5's seed sweep ({args.seeds} seeds), where seed k of every sweep starts", flush=True)
    run_all.run_chapter("ch05_sft.py", args.quick, args.quiet, env, False, ["--seeds", str(args.seeds)])
    results = {m: comparison(m, sweep(args, m, False, env), sweep(args, m, True, env)) for m in args.methods}
    table = comparison_markdown(results, args.rank)
    print(f"\nFull fine-tuning against LoRA r={args.rank}, the same budgets, seed k from chapter 5's seed k:\n{table}")
    comparison_figure(out, results, args.rank)
    bench = bench_summary()

    command = "python chapters/appA_lora.py " + " ".join(argv if argv is not None else os.sys.argv[1:])
    report = ["## Appendix A: LoRA", "", f"`{command.strip()}`", "", "What LoRA trains on the SFT model:", "",
              "\n".join(count_lines), "",
              f"Checks on the SFT model: fresh adapters = SFT bit for bit ({facts['fresh_equals_sft']}); adapters off "
              f"after training = SFT bit for bit ({facts['adapters_off_equals_sft']}); merged outputs within "
              f"{facts['merged_max_abs_diff']:.1e}.", "", f"Full fine-tuning against LoRA r={args.rank}:", "", table,
              "", f"![compare]({out.name}/compare.png)", ""]
    if bench:
        report += ["Memory and speed at GPT-2's size (benchmarks/bench_lora.py):", "", bench, ""]
    atomic_write_text(out / "compare.md", table + "\n")
    atomic_write_text(out / "report.md", "\n".join(report))
    summary = {"rank": args.rank, "targets": args.targets, "seeds": args.seeds, "counts": counts, "checks": facts,
               "comparison": results, "device": str(device)}
    write_summary(out, summary, args.quick)
    print(f"\nwrote {shown(out)}/report.md, compare.md, compare.png")
    return summary


if __name__ == "__main__":
    cli.run(main)
