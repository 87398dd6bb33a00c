"""Run the whole course, chapter by chapter, on the built-in tiny world, then write runs/report.md.

Each chapter script runs in its own process, in order; each writes its artifacts and a report.md
fragment into its run folder, and this script stitches the fragments (tables and figures) together.
Chapters that later issues add join the CHAPTERS list.

    python chapters/run_all.py            # the real course
    python chapters/run_all.py --quick    # a smoke run of every chapter (minutes)
    python chapters/run_all.py --keep-finished   # after an interruption: keep the chapters already finished
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llm_from_scratch.checkpoint import atomic_write_text, finished_run, quick_mode, runs_root  # noqa: E402

# (script, run folder it writes)
CHAPTERS = [
    ("ch01_tokenizer.py", "tokenizer"),
    ("ch02_attention.py", "attention"),
    ("ch03_gpt.py", "gpt"),
    ("ch04_pretrain.py", "pretrain"),
    ("ch05_sft.py", "sft"),
    ("ch06_reward_model.py", "reward_model"),
    ("ch07_policy_gradient.py", "pg_word-problems_rloo"),
    ("ch08_ppo.py", "ppo_stories"),
    ("ch09_dpo.py", "dpo"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke-run every chapter (also LLMFS_QUICK=1)")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    ap.add_argument("--only", nargs="*", metavar="chNN", help="run only these chapters (e.g. --only ch01)")
    ap.add_argument("--keep-finished", action="store_true",
                    help="keep every chapter whose run folder already holds a finished run (its summary.json) and run "
                         "only the others: picks up after an interruption")
    args = ap.parse_args()
    quick = args.quick or quick_mode()
    env = dict(os.environ, LLMFS_QUICK="1" if quick else os.environ.get("LLMFS_QUICK", "0"))
    root = runs_root(quick)

    sections, timings = [], []
    for script, folder in CHAPTERS:
        if args.only and not any(script.startswith(o) for o in args.only):
            continue
        if args.keep_finished and (done := finished_run(root / folder)) and bool(done.get("quick")) == quick:
            print(f"\n=== {script}: keeping the finished run in {folder}/ ===", flush=True)
            seconds = done.get("seconds", done.get("seconds_this_run"))  # training time, as the run recorded it
            timings.append((script, "kept" + (f" (trained in {seconds:.0f} s)" if seconds else "")))
        else:
            timings.append((script, run_chapter(script, quick, args.quiet, env)))
        fragment = root / folder / "report.md"
        sections.append(fragment.read_text(encoding="utf-8") if fragment.exists() else f"## {script}\n\n(no report)\n")

    lines = ["# llm-from-scratch: course report", "",
             f"{'Quick smoke run' if quick else 'Full run'} of {len(timings)} chapter(s), {time.strftime('%Y-%m-%d %H:%M')}.", "",
             "| chapter | seconds |", "|---|---:|"]
    lines += [f"| {s} | {t if isinstance(t, str) else f'{t:.0f}'} |" for s, t in timings] + [""]
    atomic_write_text(root / "report.md", "\n".join(lines + sections))
    print(f"\nreport: {root / 'report.md'}")


def run_chapter(script: str, quick: bool, quiet: bool, env: dict) -> float:
    """Run one chapter script in its own process; its wall-clock seconds. Exits on failure."""
    cmd = [sys.executable, str(ROOT / "chapters" / script)] + (["--quick"] if quick else []) + (["--quiet"] if quiet else [])
    print(f"\n=== {script} ===", flush=True)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env)
    if done.returncode != 0:
        sys.exit(f"run_all: {script} failed (exit code {done.returncode}); the chapters before it are saved in "
                 f"{runs_root(quick)}; `python chapters/run_all.py --keep-finished` picks up from there")
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
