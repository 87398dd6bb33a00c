"""Every chapter script explains itself (--help) and the whole course runs end to end as a smoke run.

`run_all.py --quick` runs every chapter script in order, each in its own process, sharing one runs
folder as a real course run does; running them once here (not once per script and again through
run_all) keeps the suite fast. The notebooks (test_notebooks.py) then reuse these runs.
"""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "chapters").glob("ch[0-9][0-9]_*.py"))


def test_run_all_lists_every_chapter_script():
    sys.path.insert(0, str(ROOT / "chapters"))
    try:
        import run_all
    finally:
        sys.path.pop(0)
    assert [s for s, _ in run_all.CHAPTERS] == [s.name for s in SCRIPTS]


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.stem for s in SCRIPTS])
def test_chapter_help(script, quick_env):
    help_ = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, env=quick_env)
    assert help_.returncode == 0 and "--quick" in help_.stdout and "usage:" in help_.stdout


@pytest.mark.slow
def test_run_all_quick(quick_env):
    run = subprocess.run(
        [sys.executable, str(ROOT / "chapters" / "run_all.py"), "--quick", "--quiet"],
        capture_output=True, text=True, env=quick_env, timeout=1800,
    )
    assert run.returncode == 0, f"run_all failed:\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
    runs = Path(quick_env["LLMFS_RUNS_DIR"])
    report = (runs / "report.md").read_text()
    for n, script in enumerate(SCRIPTS, start=1):
        assert f"## Chapter {n}:" in report, f"no report section from {script.name}"
    for folder in ("tokenizer", "pretrain", "sft", "reward_model"):
        assert (runs / folder / "report.md").is_file()
