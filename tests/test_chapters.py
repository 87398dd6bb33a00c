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


def test_reward_model_agreement_by_part_by_hand():
    sys.path.insert(0, str(ROOT / "chapters"))
    try:
        import ch06_reward_model as ch06
    finally:
        sys.path.pop(0)
    import torch

    from llm_from_scratch import tinyworld as tw

    spec = {"name": "Mia", "color": "red", "object": "kite", "mood": "happy"}
    good = ("Once upon a time, there was a girl named Mia. Mia found a red kite. She played with the red kite all day. "
            "Then Mia shared the red kite with a friend. Mia was very happy. The end.")
    sad = good.replace("Mia was very happy.", "Mia was very sad.")  # differs in the ending only
    other = good.replace("Mia", "Ava")  # differs in the name only
    rows = []
    for chosen, rejected in ((good, sad), (sad, good), (good, other), (good, sad.replace("Mia", "Ava"))):
        rows.append({"spec": spec, "chosen": chosen, "rejected": rejected,
                     "gold_chosen": tw.story_reward(spec, chosen), "gold_rejected": tw.story_reward(spec, rejected)})
    # margins r_c - r_r: right on the first ending pair, wrong on the second, wrong on the name pair;
    # the last pair differs in several parts and is left out
    out = ch06.agreement_by_part(rows, torch.tensor([1.0, 2.0, -0.5, 3.0]))
    assert out == {"ending": {"agreement": 0.5, "n": 2}, "name": {"agreement": 0.0, "n": 1}}
