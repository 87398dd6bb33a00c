"""Run the whole course, chapters 1 to 10, on the built-in tiny world, then write runs/report.md.

Each chapter script runs in its own process, in order, with its defaults; each writes its artifacts and a report.md
fragment into its run folder, and this script stitches the fragments together under a header that names the machine
and the time each stage took, with the arena's table and frontier (chapter 10) first.

A stage whose run folder already holds a finished run (its summary.json, of the same mode: real or quick) is kept, so
an interrupted course picks up where it stopped (the first unfinished stage resumes its own interrupted run); once a
stage runs, every later stage starts over too (they build on it). --again starts every stage over.

It runs in the reproducible CPU mode (llm_from_scratch/reproducible.py: 2 threads, ATen's AVX2 kernels, MKL's
COMPATIBLE branch), printed first and recorded in the report and in every run's summary.json: the same chain on any
x86-64 CPU with AVX2. --fast (or LLMFS_FAST=1) uses every core and the CPU's widest kernels instead: faster, another
chain. A finished stage is kept only when it was made in the same mode.

    python chapters/run_all.py              # the real course (about 55 minutes on a 2-core CPU)
    python chapters/run_all.py --quick      # a smoke run of every chapter (minutes); writes under runs/quick/
    python chapters/run_all.py --again      # start over, even where runs/ holds finished stages
    python chapters/run_all.py --only ch10  # just these stages (their earlier chapters are built if missing)
    python chapters/run_all.py --fast       # every core: faster, and another chain (other numbers)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llm_from_scratch import reproducible  # noqa: E402
from llm_from_scratch.checkpoint import atomic_write_text  # noqa: E402
from llm_from_scratch.course import finished_run, quick_mode, runs_root, same_cpu_mode  # noqa: E402

# (script, the run folder it writes, minutes its real run took in the course run of 2026-12-03 on an idle 2-core CPU:
# the progress line's estimate)
CHAPTERS = [
    ("ch01_tokenizer.py", "tokenizer", 0.2),
    ("ch02_attention.py", "attention", 0.1),
    ("ch03_gpt.py", "gpt", 0.3),
    ("ch04_pretrain.py", "pretrain", 6.1),
    ("ch05_sft.py", "sft", 5.8),
    ("ch06_reward_model.py", "reward_model", 2.5),
    ("ch07_policy_gradient.py", "pg_word-problems_rloo", 7.2),
    ("ch08_ppo.py", "ppo_stories", 6.3),
    ("ch09_dpo.py", "dpo", 7.1),
    ("ch10_arena.py", "arena", 22.4),
]
TIMES_FILE = "stage_times.json"  # in the runs folder: each stage's wall time when it last ran


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke-run every chapter (also LLMFS_QUICK=1)")
    ap.add_argument("--quiet", action="store_true", help="no progress bars inside the chapters")
    ap.add_argument("--only", nargs="+", metavar="chNN", help="run only these chapters (e.g. --only ch01 ch02)")
    ap.add_argument("--again", action="store_true", help="rerun every stage, even one that finished before")
    ap.add_argument("--fast", action="store_true",
                    help="every CPU core and the CPU's widest kernels instead of the reproducible mode: faster, but "
                         "another chain of runs, other numbers (also LLMFS_FAST=1)")
    args = ap.parse_args()
    unknown = [o for o in args.only or [] if not any(s.startswith(o) for s, _, _ in CHAPTERS)]
    if unknown:
        ap.error(f"--only {' '.join(unknown)}: no such chapter; choose from {', '.join(s[:4] for s, _, _ in CHAPTERS)}")
    mode = reproducible.apply(fast=args.fast)  # before anything computes; the chapters inherit it (and re-apply it)
    print(mode, flush=True)
    quick = args.quick or quick_mode()
    env = dict(os.environ, LLMFS_QUICK="1" if quick else os.environ.get("LLMFS_QUICK", "0"))
    root = runs_root(quick)
    root.mkdir(parents=True, exist_ok=True)
    times_file = root / TIMES_FILE
    times = json.loads(times_file.read_text(encoding="utf-8")) if times_file.is_file() else {}

    stages = [c for c in CHAPTERS if not args.only or any(c[0].startswith(o) for o in args.only)]
    t0, ran_one, status = time.perf_counter(), False, {}
    for k, (script, folder, minutes) in enumerate(stages, start=1):
        done = finished_run(root / folder)
        if done and bool(done.get("quick")) == quick and same_cpu_mode(done) and not args.again and not ran_one:
            print(f"\n[{k}/{len(stages)}] {script}: keeping the finished run in {folder}/", flush=True)
            status[script] = "kept"
            continue
        left = sum(m for _, _, m in stages[k - 1:])
        print(f"\n[{k}/{len(stages)}] === {script} === ({elapsed(time.perf_counter() - t0)} so far"
              + ("" if quick else f"; about {left:.0f} min left on a 2-core CPU") + ")", flush=True)
        fresh = args.again or ran_one  # what it would resume from was built on what just changed (or on nothing asked)
        times[script] = {"seconds": run_chapter(script, quick, args.quiet, env, fresh),
                         "when": time.strftime("%Y-%m-%d %H:%M")}
        atomic_write_text(times_file, json.dumps(times, indent=2))
        status[script], ran_one = "ran", True

    report = course_report(root, quick, stages, status, times, time.perf_counter() - t0, mode)
    atomic_write_text(root / "report.md", report)
    print(f"\nthe course took {elapsed(time.perf_counter() - t0)} here; report: {root / 'report.md'}")


def elapsed(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


def run_chapter(script: str, quick: bool, quiet: bool, env: dict, fresh: bool, extra: list[str] = ()) -> float:
    """Run one chapter script in its own process; its wall-clock seconds. Exits on failure. fresh: the script starts
    over (--no-resume, for the scripts that resume) instead of continuing what its folder holds. extra: more flags."""
    path = ROOT / "chapters" / script
    cmd = [sys.executable, str(path)] + (["--quick"] if quick else []) + (["--quiet"] if quiet else []) + list(extra)
    if fresh and "--no-resume" in path.read_text(encoding="utf-8"):
        cmd.append("--no-resume")
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env)
    if done.returncode != 0:
        sys.exit(f"run_all: {script} failed (exit code {done.returncode}); the chapters before it are saved in "
                 f"{env.get('LLMFS_RUNS_DIR') or runs_root(quick)}, "
                 f"and `python chapters/run_all.py{' --quick' if quick else ''}` picks up from there")
    return time.perf_counter() - t0


def machine() -> str:
    """The CPU (or GPU), its cores, the memory, and the versions: what the report's times were measured on."""
    import torch  # here, not at the top: --help answers without loading torch

    cpu = reproducible.cpu_name()
    try:
        memory = f", {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2 ** 30:.0f} GiB"
    except (ValueError, OSError, AttributeError):
        memory = ""
    gpu = f"; GPU: {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return (f"{cpu}, {os.cpu_count()} cores{memory}{gpu}; {platform.system()}, Python {platform.python_version()}, "
            f"torch {torch.__version__}")


def course_report(root: Path, quick: bool, stages: list, status: dict, times: dict, seconds: float,
                  mode: str = "") -> str:
    """runs/report.md: the machine, its CPU mode (reproducible.describe) and each stage's time, the arena's table and
    frontier, then every chapter's section (its headline numbers, figures and sample responses)."""
    rows = ["| | chapter | run folder | minutes | this time |", "|---:|---|---|---:|---|"]
    total = 0.0
    for k, (script, folder, _) in enumerate(stages, start=1):
        s = times.get(script, {}).get("seconds")
        total += s or 0.0
        rows.append(f"| {k} | {script} | {folder}/ | {f'{s / 60:.1f}' if s else '—'} | "
                    f"{status.get(script, '—')}"
                    f"{'' if status.get(script) == 'ran' else ' (time of its last run)' if s else ''} |")
    rows.append(f"| | **all stages** | | **{total / 60:.1f}** | |")
    lines = ["# llm-from-scratch: course report", "",
             f"{'Quick smoke run' if quick else 'Full run'} of {len(stages)} chapter(s), finished "
             f"{time.strftime('%Y-%m-%d %H:%M')}; this invocation took {seconds / 60:.1f} min.", "",
             f"Machine: {machine()}.", "", f"{mode or reproducible.describe()}.", "", "\n".join(rows), ""]
    sections = []
    for script, folder, _ in stages:
        fragment = root / folder / "report.md"
        text = fragment.read_text(encoding="utf-8") if fragment.exists() else f"## {script}\n\n(no report)\n"
        sections.append(text)
    arena = [s for (script, _, _), s in zip(stages, sections) if script.startswith("ch10")]
    others = [s for (script, _, _), s in zip(stages, sections) if not script.startswith("ch10")]
    return "\n".join(lines + arena + others)


if __name__ == "__main__":
    main()
