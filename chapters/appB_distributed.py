"""Appendix B: two CPU cores used three ways for RL (llm_from_scratch/distributed.py and async_rollouts.py).

A step of chapter 7's RLOO (or chapter 8's PPO) samples a batch, then updates on it. With two cores there are three
ways to run it, each here by the chapter script itself, in its own process, from the same SFT model per seed:

    sync    one process with 2 threads: sample, then update (the chapters' default)
    async   two processes of 1 thread: a rollout worker samples batch t+1 with the weights of step t while the trainer
            updates on batch t (--async: one step off-policy, truncated importance weights)
    ddp     two processes of 1 thread under torchrun: each samples and updates on half of every step's prompts, the
            gradients averaged by DistributedDataParallel (the same global batch as sync)

For each mode and seed: the training step's time (sampling + update, from metrics.jsonl), the run's training time
(the held-out evaluations run only before and after training here: they are most of a CPU run's time, and every
mode would pay the same for them), and what it learned: the held-out score's gain over the SFT model (greedy
accuracy on word problems for RLOO, the sampled gold reward on stories for PPO) and the KL to the SFT model. Gains
and speed are compared to sync's paired by seed (the same SFT model, the same prompts): the mean difference ± its
standard error over seeds. A finished run of the same flags is kept, so an interrupted appendix continues where it was.

Written to runs/appB_distributed/: each run's folder (<method>_<mode>/seed<k>), compare.md, compare.png, report.md,
summary.json.

    python chapters/appB_distributed.py                    # RLOO, 3 seeds x 3 modes: about 30 minutes on 2 cores
    python chapters/appB_distributed.py --methods rloo ppo --modes sync async
    python chapters/appB_distributed.py --quick            # a smoke run (also LLMFS_QUICK=1)
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import matplotlib.pyplot as plt

import cli  # chapters/cli.py: common flags, one-line errors (also puts the repository on sys.path)
import run_all  # chapters/run_all.py: a chapter script in its own process, the machine's description
from llm_from_scratch import distributed
from llm_from_scratch.checkpoint import atomic_write_text, read_jsonl
from llm_from_scratch.course import prerequisite, quick_mode, require_real, runs_root, shown, start_run, write_summary
from llm_from_scratch.plots import save

ROOT = Path(__file__).resolve().parents[1]
# method -> (chapter script, what its held-out score is, extra flags, its default steps). Here the held-out
# evaluation runs before and after training only (--eval-interval = the steps), and chapter 7's SFT pass@k not at
# all: evaluations are most of a CPU run's time, and every mode would pay the same for them
METHODS = {"rloo": ("ch07_policy_gradient.py", "held-out accuracy (greedy, word problems)", ["--pass-at-k", "0"], 100),
           "ppo": ("ch08_ppo.py", "held-out gold reward (sampled, stories)", [], 120)}
# mode -> (what runs, its flags, its threads per process, processes under torchrun (0: a plain process))
MODES = {"sync": ("1 process x 2 threads", [], 2, 0),
         "async": ("trainer + rollout worker, 1 thread each", ["--async", "--rollout-threads", "1"], 2, 0),
         "ddp": ("torchrun, 2 processes x 1 thread", [], 1, 2)}


def parse_args(argv=None):
    ap = cli.parser(__doc__)
    ap.add_argument("--methods", nargs="+", default=["rloo"], choices=list(METHODS),
                    help="rloo (chapter 7, word problems) and/or ppo (chapter 8, stories) (default rloo)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES),
                    help="sync, async, ddp (default all three; sync is the baseline of the paired differences)")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per mode, seed k from chapter 5's seed k (default 3)")
    ap.add_argument("--steps", type=int, help="RL steps per run (default: the chapter's own)")
    ap.add_argument("--out", type=Path, help="default runs/appB_distributed")
    ap.add_argument("--quick", action="store_true", help="a smoke run: chapter quick modes, 1 seed (LLMFS_QUICK=1)")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    cli.add_fast_arg(ap)
    args = ap.parse_args(argv)
    args.quick = args.quick or quick_mode()
    if args.quick:
        args.seeds = 1
    if args.seeds < 1:
        ap.error("--seeds must be ≥ 1")
    if args.steps is not None and args.steps < 1:
        ap.error("--steps must be ≥ 1")
    if "sync" not in args.modes:
        ap.error("--modes must include sync: the other modes are compared to it")
    return args


def run_one(args, method: str, mode: str, seed: int, sft_sweep: Path, out: Path) -> dict:
    """One chapter run in its own process(es), as the mode launches it; its eval.json."""
    script, _, extra, default_steps = METHODS[method]
    _, flags, threads, processes = MODES[mode]
    folder = out / f"{method}_{mode}" / f"seed{seed}"
    steps = args.steps or default_steps
    cmd = [str(ROOT / "chapters" / script), "--init", str(sft_sweep / f"seed{seed}"), "--seed", str(seed), "--out",
           str(folder), *extra, *flags, "--steps", str(steps), "--eval-interval", str(steps),
           *(["--quick"] if args.quick else []), *(["--quiet"] if args.quiet else [])]
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
                if processes else [sys.executable])
    env = {k: v for k, v in os.environ.items() if k not in distributed.TORCHRUN_VARIABLES}
    env.update(OMP_NUM_THREADS=str(threads), LLMFS_QUICK="1" if args.quick else "0")
    print(f"\n--- {method}, {mode} ({MODES[mode][0]}), seed {seed}", flush=True)
    done = subprocess.run(launcher + cmd, env=env)
    if done.returncode != 0:
        sys.exit(f"appB: {' '.join(launcher + cmd)} failed (exit code {done.returncode}); finished runs are kept in "
                 f"{shown(out)}, and running this script again continues")
    result = json.loads((folder / "eval.json").read_text(encoding="utf-8"))
    records = read_jsonl(folder / "metrics.jsonl")
    steps = [r for r in records if "time/update_s" in r]
    result["step_seconds"] = statistics.mean(r["time/rollout_s"] + r["time/update_s"] for r in steps)
    # where a step goes: the sampling itself (with --async the worker's, hidden or not), the update
    result["sampling_seconds"] = statistics.mean(r["time/generate_s"] + r["time/reference_s"] + r["time/reward_s"]
                                                 for r in steps)
    result["update_seconds"] = statistics.mean(r["time/update_s"] for r in steps)
    result["offpolicy_ratio"] = (statistics.mean(r["offpolicy/ratio"] for r in steps)
                                 if steps and "offpolicy/ratio" in steps[0] else None)
    return result


def mean_se(values: list[float]) -> tuple[float, float]:
    """The mean and its standard error over seeds (nan with one seed: one seed says nothing about the noise)."""
    return statistics.mean(values), statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else math.nan


def pm(mean: float, se: float, fmt: str) -> str:
    """mean ± s.e. in `fmt`, or the mean and "(1 seed)" when there is no standard error."""
    return f"{mean:{fmt}} ± {se:{fmt.lstrip('+')}}" if not math.isnan(se) else f"{mean:{fmt}} (1 seed)"


def gain(e: dict) -> float:
    return e["after"]["gold"] - e["before"]["gold"]


def compare(runs: dict[str, list[dict]]) -> dict:
    """Per mode: each seed's step time, speed-up over sync, gain, KL; and the paired differences from sync."""
    base = runs["sync"]
    table = {}
    for mode, results in runs.items():
        speedup = [b["step_seconds"] / r["step_seconds"] for b, r in zip(base, results)]
        diff = [gain(r) - gain(b) for b, r in zip(base, results)]
        table[mode] = {"step_seconds": [r["step_seconds"] for r in results], "speedup": speedup,
                       "sampling_seconds": [r["sampling_seconds"] for r in results],
                       "update_seconds": [r["update_seconds"] for r in results],
                       "speedup_mean_se": mean_se(speedup), "gain": [gain(r) for r in results],
                       "gain_mean_se": mean_se([gain(r) for r in results]), "gain_minus_sync": diff,
                       "gain_minus_sync_mean_se": mean_se(diff), "kl": [r["kl"] for r in results],
                       "after": [r["after"]["gold"] for r in results], "seconds": [r["seconds"] for r in results],
                       "offpolicy_ratio": [r["offpolicy_ratio"] for r in results]}
    return table


def markdown(method: str, table: dict) -> str:
    score = METHODS[method][1]
    lines = [f"{method.upper()}: gain in {score} over the SFT model, KL in nats per completion (mean of the last 10 "
             "steps), step time (the wait for the batch + the update, evaluations left out) and its ratio to sync's, "
             "paired by seed; the sampling itself (generation, the reference's and, with --async, the sampler's own "
             "log-probs, the reward: the worker's time, hidden behind the update as far as it goes) and the update", "",
             "| mode | seed | step s | sampling s | update s | speed vs sync | gain | gain − sync's | KL | train min |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for mode, c in table.items():
        for k in range(len(c["gain"])):
            lines.append(f"| {mode} | {k} | {c['step_seconds'][k]:.2f} | {c['sampling_seconds'][k]:.2f} | "
                         f"{c['update_seconds'][k]:.2f} | {c['speedup'][k]:.2f}x | {c['gain'][k]:+.3f} | "
                         f"{c['gain_minus_sync'][k]:+.3f} | {c['kl'][k]:.2f} | {c['seconds'][k] / 60:.1f} |")
        (sm, ss), (gm, gs), (dm, ds) = c["speedup_mean_se"], c["gain_mean_se"], c["gain_minus_sync_mean_se"]
        lines.append(f"| {mode} | mean ± s.e. | | | | **{pm(sm, ss, '.2f')}x** | {pm(gm, gs, '+.3f')} | "
                     f"**{pm(dm, ds, '+.3f')}** | {statistics.mean(c['kl']):.2f} | |")
    return "\n".join(lines)


def figure(out: Path, tables: dict[str, dict]) -> None:
    """Per method: each seed's step time by mode, and its gain by mode (the seeds joined across modes)."""
    fig, axes = plt.subplots(len(tables), 2, figsize=(10, 3.6 * len(tables)), constrained_layout=True, squeeze=False)
    for row, (method, table) in zip(axes, tables.items()):
        modes = list(table)
        seeds = len(table["sync"]["gain"])
        for k in range(seeds):
            row[0].plot(modes, [table[m]["step_seconds"][k] for m in modes], marker="o", label=f"seed {k}")
            row[1].plot(modes, [table[m]["gain"][k] for m in modes], marker="o", label=f"seed {k}")
        row[0].set(ylabel="seconds per step", title=f"{method.upper()}: step time (sampling + update)")
        row[1].set(ylabel="gain over the SFT model", title=f"{method.upper()}: {METHODS[method][1]}")
        row[1].axhline(0, color="grey", lw=0.8)
        for a in row:
            a.grid(alpha=0.3)
            a.legend(fontsize=8)
    save(fig, out / "compare.png")


def main(argv=None) -> dict:
    args = parse_args(argv)
    root = runs_root(args.quick)
    out = args.out or root / "appB_distributed"
    start_run(out)
    env = dict(os.environ, LLMFS_QUICK="1" if args.quick else "0")
    print(f"--- chapter 5's seed sweep ({args.seeds} seeds), where seed k of every run starts", flush=True)
    run_all.run_chapter("ch05_sft.py", args.quick, args.quiet, env, False, ["--seeds", str(args.seeds)])
    if "ppo" in args.methods:  # chapter 8 trains against chapter 6's reward model: built if missing, before timing
        require_real(prerequisite("reward_model", args.quick), args.quick)
    sft_sweep = root / "sft_seeds"
    tables = {}
    for method in args.methods:
        runs = {mode: [] for mode in args.modes}
        for seed in range(args.seeds):  # the modes of one seed back to back: a busy machine slows them alike
            for mode in args.modes:
                runs[mode].append(run_one(args, method, mode, seed, sft_sweep, out))
        tables[method] = compare(runs)
        print("\n" + markdown(method, tables[method]))
    figure(out, tables)
    text = "\n\n".join(markdown(m, t) for m, t in tables.items())
    command = "python chapters/appB_distributed.py " + " ".join(argv if argv is not None else sys.argv[1:])
    machine = run_all.machine()
    report = ["## Appendix B: two cores, three ways", "", f"`{command.strip()}` on {machine}", "",
              "\n".join(f"- **{m}**: {d}" for m, (d, *_rest) in MODES.items() if m in args.modes), "", text, "",
              f"![compare]({out.name}/compare.png)", ""]
    atomic_write_text(out / "compare.md", text + "\n")
    atomic_write_text(out / "report.md", "\n".join(report))
    summary = {"methods": args.methods, "modes": args.modes, "seeds": args.seeds, "steps": args.steps,
               "machine": machine, "comparison": tables}
    write_summary(out, summary, args.quick)
    print(f"\nwrote {shown(out)}/report.md, compare.md, compare.png")
    return summary


if __name__ == "__main__":
    cli.run(main)
