"""Every chapter script runs end to end as a smoke run (`--quick`), in chapter order, and explains itself."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "chapters").glob("ch[0-9][0-9]_*.py"))


def test_there_are_chapter_scripts():
    assert SCRIPTS, "no chapters/chNN_*.py found"


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS, ids=[s.stem for s in SCRIPTS])
def test_chapter_runs_quick(script, quick_env):
    help_ = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, env=quick_env)
    assert help_.returncode == 0 and "--quick" in help_.stdout
    run = subprocess.run(
        [sys.executable, str(script), "--quick", "--quiet"], capture_output=True, text=True, env=quick_env, timeout=600
    )
    assert run.returncode == 0, f"{script.name} failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"


@pytest.mark.slow
def test_run_all_quick(quick_env):
    run = subprocess.run(
        [sys.executable, str(ROOT / "chapters" / "run_all.py"), "--quick", "--quiet"],
        capture_output=True, text=True, env=quick_env, timeout=1200,
    )
    assert run.returncode == 0, f"run_all failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    report = Path(quick_env["LLMFS_RUNS_DIR"]) / "report.md"
    assert report.is_file() and "Chapter 1" in report.read_text()
