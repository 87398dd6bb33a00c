"""Run the whole course, chapter by chapter, on the built-in tiny world, then write runs/report.md.

Each chapter script runs in its own process, in order; each writes its artifacts and a report.md
fragment into its run folder, and this script stitches the fragments (tables and figures) together.
Chapters that later issues add join the CHAPTERS list.

    python chapters/run_all.py            # the real course
    python chapters/run_all.py --quick    # a smoke run of every chapter (minutes)
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

from llm_from_scratch.checkpoint import atomic_write_text, quick_mode, runs_root  # noqa: E402

# (script, run folder it writes)
CHAPTERS = [
    ("ch01_tokenizer.py", "tokenizer"),
    ("ch02_attention.py", "attention"),
    ("ch03_gpt.py", "gpt"),
    ("ch04_pretrain.py", "pretrain"),
    ("ch05_sft.py", "sft"),
    ("ch06_reward_model.py", "reward_model"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke-run every chapter (also LLMFS_QUICK=1)")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    ap.add_argument("--only", nargs="*", metavar="chNN", help="run only these chapters (e.g. --only ch01)")
    args = ap.parse_args()
    quick = args.quick or quick_mode()
    env = dict(os.environ, LLMFS_QUICK="1" if quick else os.environ.get("LLMFS_QUICK", "0"))
    root = runs_root(quick)

    sections, timings = [], []
    for script, folder in CHAPTERS:
        if args.only and not any(script.startswith(o) for o in args.only):
            continue
        cmd = [sys.executable, str(ROOT / "chapters" / script)] + (["--quick"] if quick else []) + (["--quiet"] if args.quiet else [])
        print(f"\n=== {script} ===", flush=True)
        t0 = time.perf_counter()
        done = subprocess.run(cmd, env=env)
        timings.append((script, time.perf_counter() - t0))
        if done.returncode != 0:
            sys.exit(f"run_all: {script} failed (exit code {done.returncode}); the chapters before it are saved in {root}")
        fragment = root / folder / "report.md"
        sections.append(fragment.read_text(encoding="utf-8") if fragment.exists() else f"## {script}\n\n(no report)\n")

    lines = ["# llm-from-scratch: course report", "",
             f"{'Quick smoke run' if quick else 'Full run'} of {len(timings)} chapter(s), {time.strftime('%Y-%m-%d %H:%M')}.", "",
             "| chapter | seconds |", "|---|---:|"]
    lines += [f"| {s} | {t:.0f} |" for s, t in timings] + [""]
    atomic_write_text(root / "report.md", "\n".join(lines + sections))
    print(f"\nreport: {root / 'report.md'}")


if __name__ == "__main__":
    main()
