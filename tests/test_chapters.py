"""Every chapter script explains itself (--help) and the whole course runs end to end as a smoke run.

`run_all.py --quick` runs every chapter script in order, each in its own process, sharing one runs
folder as a real course run does; running them once here (not once per script and again through
run_all) keeps the suite fast. The notebooks (test_notebooks.py) then reuse these runs.
"""

import dataclasses
import hashlib
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from llm_from_scratch import reproducible

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "chapters").glob("ch[0-9][0-9]_*.py"))

# The golden chain: the quick course in the reproducible CPU mode (llm_from_scratch/reproducible.py), stage by stage,
# as the first 16 hex digits of the SHA-256 of what each stage made (the tokenizer's merges file; every other stage's
# weights, tensor by tensor in name order), per CPU vendor on which it was measured. The same digests on another
# machine mean the same chain of runs, bit for bit. A change that alters what the course computes (a default, the
# data, the model) changes them on purpose: then replace them with the digests the failing test prints, for every
# vendor you can measure, and the README's numbers will need a new course run too.
CHAIN = ("tokenizer", "pretrain", "sft", "reward_model", "pg_word-problems_rloo", "ppo_stories", "dpo")
GOLDEN = {
    # AMD EPYC (family 25, model 17), 2 cores, torch 2.13.0+cpu, 2026-12-07; sft on: the data of GENERATOR_VERSION 15
    "AuthenticAMD": {"tokenizer": "9552be5f73c7e241", "pretrain": "9ae91630e0cd012e", "sft": "a798a1527a7f3b8b",
                     "reward_model": "ccb9ba93122ea4aa", "pg_word-problems_rloo": "c06eb35be8f68957",
                     "ppo_stories": "0a85ba26082cbadb", "dpo": "e6606a3af856ed5b"},
}
QUICK_CHAIN = {}  # the digests of the quick course that test_run_all_quick made, before it interrupts and resumes it


def stage_digest(folder: Path) -> str | None:
    """The digest of what a stage made (see GOLDEN): the tokenizer's merges, or a model's weights; None when missing."""
    weights = folder / "model.safetensors"
    if not weights.is_file():
        merges = folder / "tokenizer.tiktoken"
        return hashlib.sha256(merges.read_bytes()).hexdigest()[:16] if merges.is_file() else None
    h = hashlib.sha256()
    with safe_open(weights, "pt") as f:
        for name in sorted(f.keys()):
            tensor = f.get_tensor(name)
            h.update(name.encode())
            h.update(tensor.contiguous().view(-1).view(dtype=torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def test_run_all_lists_every_chapter_script():
    sys.path.insert(0, str(ROOT / "chapters"))
    try:
        import run_all
    finally:
        sys.path.pop(0)
    assert [s for s, _, _ in run_all.CHAPTERS] == [s.name for s in SCRIPTS]


def test_ch07_loss_type_and_filter_reach_the_config_and_the_finished_run_check(tmp_path, monkeypatch):
    """--loss-type and --filter-groups land in PGConfig (what eval.json records), in the default folder's name, and
    in the check that keeps a finished run (chapters/common.py): a run made with other flags is not mistaken for this
    one, and neither is a run from before eval.json recorded its flags."""
    monkeypatch.delenv("LLMFS_QUICK", raising=False)
    sys.path.insert(0, str(ROOT / "chapters"))
    try:
        import ch07_policy_gradient as ch07

        import common
    finally:
        sys.path.pop(0)
    default = ch07.parse_args(["--task", "stories"])  # the stories' recipe: the estimator's own loss, no filter
    dapo = ch07.parse_args(["--task", "stories", "--loss-type", "dapo", "--filter-groups"])
    assert (ch07.pg_config(default).loss_type, ch07.pg_config(default).filter_groups, default.lr) == (None, False, 2e-5)
    assert (ch07.pg_config(dapo).loss_type, ch07.pg_config(dapo).filter_groups) == ("dapo", True)
    assert ch07.pg_config(ch07.parse_args(["--algo", "grpo", "--loss-type", "dr_grpo"])).loss_type == "dr_grpo"
    assert (ch07.run_name(default), ch07.run_name(dapo)) == ("pg_stories_rloo", "pg_stories_rloo_dapo_filter")
    # word problems' recipe is DAPO's loss and filter at 5e-5; leaving it gets a folder of its own
    words, own = ch07.parse_args([]), ch07.parse_args(["--loss-type", "own", "--no-filter-groups"])
    assert (ch07.pg_config(words).loss_type, ch07.pg_config(words).filter_groups, words.lr) == ("dapo", True, 5e-5)
    assert (ch07.pg_config(own).loss_type, ch07.pg_config(own).filter_groups) == (None, False)
    assert ch07.run_name(words) == ch07.run_name(ch07.parse_args(["--loss-type", "dapo"])) == "pg_word-problems_rloo"
    assert ch07.run_name(own) == "pg_word-problems_rloo_own_nofilter"
    # a word problem's answer restates each event (up to 138 tokens): its rollouts get 144, stories keep 128
    assert (words.max_new_tokens, default.max_new_tokens) == (144, 128)
    assert ch07.parse_args(["--max-new-tokens", "100"]).max_new_tokens == 100
    assert ch07.parse_args(["--algo", "reinforce", "--k", "1", "--no-filter-groups"]).k == 1
    for bad in (["--loss-type", "bnpo"], ["--algo", "reinforce", "--k", "1"],
                ["--task", "stories", "--algo", "reinforce", "--k", "1", "--filter-groups"]):
        with pytest.raises(SystemExit):
            ch07.parse_args(bad)

    with pytest.raises(dataclasses.FrozenInstanceError):  # parsed once, never changed
        default.lr = 1.0

    # a finished run is kept (not trained again) only when every flag that decides what it computes is the same, and
    # so are its seed and the weights it started from
    out, sft = tmp_path / "run", tmp_path / "sft"
    out.mkdir()
    sft.mkdir()
    (sft / "model.safetensors").write_bytes(b"the SFT model's weights")
    run = common.Run(out, 0, sft, "cpu")
    made_here = {"quick": False, "cpu": reproducible.record()}  # made in this CPU mode
    other_mode = {**made_here["cpu"], "reproducible": not made_here["cpu"]["reproducible"]}
    (out / "summary.json").write_text(json.dumps({**made_here, "cpu": other_mode}))
    (out / "eval.json").write_text(json.dumps({"flags": common.flags_record(default), "origin": common.origin(run)}))
    assert common.finished_result(default, run) is None  # made in the other CPU mode: another chain
    (out / "summary.json").write_text(json.dumps(made_here))
    assert common.finished_result(default, run) is not None
    # PPO-ptx's flags count only when it is on: a batch size without a coefficient computes the same run
    assert common.finished_result(ch07.parse_args(["--task", "stories", "--ptx-batch-size", "4"]), run) is not None
    assert common.finished_result(ch07.parse_args(["--task", "stories", "--ptx-coef", "1"]), run) is None
    assert ch07.run_name(ch07.parse_args(["--ptx-coef", "0.5"])) == "pg_word-problems_rloo_ptx0.5"
    where = ch07.parse_args(["--task", "stories", "--quiet", "--device", "cpu", "--out", str(out), "--no-build"])
    assert common.finished_result(where, run) is not None  # where it writes and how it reports: not what it is
    assert common.finished_result(default, run._replace(seed=1)) is None  # another seed
    for other in (dapo, ch07.parse_args(["--task", "stories", "--loss-type", "grpo"]),
                  ch07.parse_args(["--task", "stories", "--filter-groups"]), ch07.parse_args(["--task", "stories",
                                                                                              "--lr", "3e-5"]),
                  ch07.parse_args(["--task", "stories", "--eval-samples", "4"]), words):
        assert common.finished_result(other, run) is None, other
    assert common.finished_result(ch07.parse_args(["--task", "stories", "--no-resume"]), run) is None
    (sft / "model.safetensors").write_bytes(b"chapter 5 trained again")  # the same folder, other weights
    assert common.finished_result(default, run) is None
    (out / "eval.json").write_text(json.dumps({"seed": 0, "config": vars(ch07.pg_config(default))}))
    assert common.finished_result(default, run) is None  # a run from before eval.json recorded its flags


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.stem for s in SCRIPTS])
def test_chapter_help(script, quick_env):
    help_ = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, env=quick_env)
    assert help_.returncode == 0 and "--quick" in help_.stdout and "usage:" in help_.stdout


def test_arena_refuses_bad_flags(quick_env):
    for flags, message in ((["--rft-keep", "1.5"], "--rft-keep must be in (0, 1]"),
                           (["--bon-samples", "0"], "--bon-samples must be ≥ 1")):
        run = subprocess.run([sys.executable, str(ROOT / "chapters" / "ch10_arena.py"), *flags], capture_output=True,
                             text=True, env=quick_env)
        assert run.returncode == 2 and message in run.stderr, run.stderr


def test_run_all_refuses_an_unknown_chapter(quick_env):
    run = subprocess.run([sys.executable, str(ROOT / "chapters" / "run_all.py"), "--only", "ch11"], capture_output=True,
                         text=True, env=quick_env)
    assert run.returncode == 2 and "--only ch11: no such chapter" in run.stderr, run.stderr


@pytest.mark.slow
def test_run_all_quick(quick_env):
    run = subprocess.run(
        [sys.executable, str(ROOT / "chapters" / "run_all.py"), "--quick", "--quiet"],
        capture_output=True, text=True, env=quick_env, timeout=1800,
    )
    assert run.returncode == 0, f"run_all failed:\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
    runs = Path(quick_env["LLMFS_RUNS_DIR"]) / "quick"  # a smoke run writes only under runs/quick/
    QUICK_CHAIN.update({stage: stage_digest(runs / stage) for stage in CHAIN})  # test_the_quick_chain_is_golden
    cpu_mode = reproducible.describe()
    assert run.stdout.startswith(cpu_mode), run.stdout[:300]  # the CPU mode comes first, and the report records it
    assert f"{cpu_mode}." in (runs / "report.md").read_text()
    assert json.loads((runs / "sft" / "summary.json").read_text())["cpu"] == reproducible.record()
    report = (runs / "report.md").read_text()
    for n, script in enumerate(SCRIPTS, start=1):
        assert f"## Chapter {n}:" in report, f"no report section from {script.name}"
    for folder in ("tokenizer", "pretrain", "sft", "reward_model"):
        assert (runs / folder / "report.md").is_file()
        assert json.loads((runs / folder / "summary.json").read_text())["quick"] is True

    assert "Machine: " in report and "| **all stages** |" in report
    assert report.index("## Chapter 10:") < report.index("## Chapter 1:")  # the arena's table comes first
    arena = json.loads((runs / "arena" / "table.json").read_text())
    assert {"SFT", "best-of-4", "RFT", "REINFORCE", "RLOO", "GRPO", "PPO", "DPO"} <= set(arena["table"])
    assert (runs / "arena" / "frontier.png").is_file()
    matched = {name: m for name, m in arena["chapter_numbers"].items() if m}
    assert {"REINFORCE", "RLOO", "GRPO", "PPO", "RLOO (word problems)"} <= set(matched)
    for name, m in matched.items():  # the same checkpoint, prompts and draws, the same evaluation code in the same
        for key, value in m.items():  # CPU mode: the chapter's numbers, the same floats
            assert arena["table"][name][key] == value, (name, key)

    # picking up after an interruption: the finished chapters before the unfinished one are kept, and it and every
    # chapter after it run again (they build on it)
    (runs / "dpo" / "summary.json").unlink()
    again = subprocess.run([sys.executable, str(ROOT / "chapters" / "run_all.py"), "--quick", "--quiet"],
                           capture_output=True, text=True, env=quick_env, timeout=1800)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    kept = [line for line in again.stdout.splitlines() if "keeping the finished run" in line and line.startswith("[")]
    assert len(kept) == len(SCRIPTS) - 2
    assert "=== ch09_dpo.py ===" in again.stdout and "=== ch10_arena.py ===" in again.stdout
    assert (runs / "dpo" / "summary.json").is_file()
    assert (runs / "report.md").read_text().count("| kept (time of its last run) |") == len(SCRIPTS) - 2


@pytest.mark.slow
def test_the_quick_chain_is_golden():
    """The quick course's chain (test_run_all_quick) ends, stage by stage, in the digests committed for this CPU's
    vendor. On a vendor no one has measured yet it skips, printing the digests to add; it never passes silently."""
    if not QUICK_CHAIN:
        pytest.skip("test_run_all_quick did not run (or failed), so there is no quick chain to check")
    setting = reproducible.describe()
    if not reproducible.reproducible():
        pytest.skip(f"not in the reproducible CPU mode, so no chain to hold to the golden one: {setting}")
    vendor, cpu = reproducible.cpu_vendor(), reproducible.cpu_name()
    made = {stage: QUICK_CHAIN[stage] for stage in CHAIN}
    if vendor not in GOLDEN:
        same = [v for v, golden in GOLDEN.items() if golden == made]
        pytest.skip(f"no golden chain measured on {vendor} yet ({cpu}; {setting}). "
                    + (f"It is the same as {', '.join(same)}'s: " if same else "It differs from every measured one: ")
                    + f"add to GOLDEN in tests/test_chapters.py: {vendor!r}: {json.dumps(made)}")
    golden = GOLDEN[vendor]
    first = next((stage for stage in CHAIN if made[stage] != golden[stage]), None)
    assert first is None, (
        f"the quick chain left the golden one at stage {first!r} on {cpu} ({vendor}; {setting}): {made[first]} where "
        f"{golden[first]} was measured; every stage: {json.dumps(made)}. A change to what the course computes changes "
        "them on purpose (update GOLDEN); otherwise something the setting does not pin reached the numbers here")


def arena_module():
    sys.path.insert(0, str(ROOT / "chapters"))
    try:
        import ch10_arena
    finally:
        sys.path.pop(0)
    return ch10_arena


def test_arena_spread_over_seeds_by_hand():
    """Median and range of each method's gain over seeds, the word-problem gain over each seed's own SFT model, and
    a difference called only where it holds in every seed (B beats C in two seeds of three: not called)."""
    ch10 = arena_module()
    gains = {"A": [0.30, 0.10, 0.20], "B": [0.05, 0.12, 0.15], "C": [0.10, 0.02, 0.01]}
    tables = [{"table": {"SFT": {"gold": 0.3, "accuracy": 0.70 + 0.1 * k},
                         **{m: {"gain": g[k], "gain_se": 0.01, "kl": 1.0 + k, "gold": 0.3 + g[k], "accuracy": 0.75}
                            for m, g in gains.items()}}} for k in range(3)]
    spread = ch10.seed_spread(tables)
    assert set(spread) == {"A", "B", "C"}  # SFT, the baseline of every gain, is not a row
    assert spread["A"]["gain"] == {"each": [0.30, 0.10, 0.20], "median": 0.20, "min": 0.10, "max": 0.30}
    assert spread["B"]["kl"]["median"] == 2.0
    assert spread["A"]["accuracy_gain"]["each"] == pytest.approx([0.05, -0.05, -0.15])  # over that seed's SFT model
    assert ch10.median([3.0, 1.0, 2.0, 10.0]) == 2.5
    wins = ch10.every_seed_wins(spread)
    assert sorted(wins) == [("A", "C")]  # A > B fails in seed 1 (0.10 < 0.12); B > C fails in seed 0
    text = ch10.seeds_markdown(spread, [0, 1, 2], wins)
    assert "- A > C" in text and "| A | +0.200 [+0.100, +0.300] |" in text
    assert ch10.every_seed_wins({k: spread[k] for k in ("B", "C")}) == [] and "- none" in ch10.seeds_markdown(
        {k: spread[k] for k in ("B", "C")}, [0, 1, 2], [])


@pytest.mark.slow
def test_arena_over_seeds_quick(quick_env):
    """--seeds 2 after the quick course: seed 0 is the course's arena, seed 1 its own chain from chapter 5 on (every
    stage with --seed 1, from the same pretrained model); a second call keeps everything."""
    script = [sys.executable, str(ROOT / "chapters" / "ch10_arena.py"), "--quick", "--quiet", "--seeds", "2"]
    run = subprocess.run(script, capture_output=True, text=True, env=quick_env, timeout=1800)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    runs = Path(quick_env["LLMFS_RUNS_DIR"]) / "quick"
    chain = runs / "arena_seeds" / "seed1" / "quick"
    for stage in ("sft", "reward_model", "pg_word-problems_rloo", "ppo_stories", "dpo"):
        assert json.loads((chain / stage / "summary.json").read_text())["seed"] == 1, stage
    assert ((chain / "pretrain" / "model.safetensors").read_bytes()
            == (runs / "pretrain" / "model.safetensors").read_bytes())
    result = json.loads((runs / "arena_seeds" / "seeds.json").read_text())
    assert {"best-of-4", "RFT", "REINFORCE", "RLOO", "GRPO", "RLOO, β = 0", "PPO", "DPO"} <= set(result["spread"])
    seed1 = json.loads((chain / "arena" / "table.json").read_text())
    assert seed1["seed"] == 1 and result["spread"]["PPO"]["kl"]["each"][1] == seed1["table"]["PPO"]["kl"]
    assert ((runs / "arena_seeds" / "frontier.png").is_file()
            and "over 2 seeds" in (runs / "arena_seeds" / "table.md").read_text())
    again = subprocess.run(script, capture_output=True, text=True, env=quick_env, timeout=1800)
    kept = [line for line in again.stdout.splitlines() if line.startswith("seed 1: keeping ")
            and "the finished run" not in line]  # the chain's stages (the arena's own kept runs say "the finished run")
    assert again.returncode == 0 and len(kept) == 5, again.stdout[-3000:]
    assert json.loads((runs / "arena_seeds" / "seeds.json").read_text())["spread"] == result["spread"]


@pytest.mark.slow
def test_policy_gradient_on_stories_and_resume(quick_env):
    """Chapter 7 against the (quick) reward model with GRPO, then an interrupted word-problem run picks up."""
    script = str(ROOT / "chapters" / "ch07_policy_gradient.py")
    run = subprocess.run([sys.executable, script, "--quick", "--quiet", "--task", "stories", "--algo", "grpo"],
                         capture_output=True, text=True, env=quick_env, timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = Path(quick_env["LLMFS_RUNS_DIR"]) / "quick" / "pg_stories_grpo"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["quick"] is True and summary["reward"] == "rm" and summary["algo"] == "grpo"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {"gold/reward", "proxy/reward", "objective/kl", "objective/kl_k3", "policy/clipfrac", "gold/wrong_name",
            "gold/wrong_object", "time/generate_s", "time/reference_s", "time/reward_s",
            "time/update_s"} <= set(records[-1])
    # the one schema (evaluation.eval_record): greedy stories are scored by gold (not an accuracy) and the reward model
    assert ({"eval/greedy/gold", "eval/greedy/proxy", "eval/greedy/ended"}
            <= set(records[0]) <= set(records[-1]) | {"step"})
    # no --eval-samples
    assert not any(k.startswith("eval/sampled/") or k == "eval/greedy/accuracy" for k in records[-1])
    samples = [json.loads(line) for line in (out / "rollout_samples.jsonl").read_text().splitlines()]
    assert samples and {"proxy", "gold", "name_ok", "object_ok"} <= set(samples[0])

    (out / "summary.json").unlink()  # as if stopped after its last checkpoint
    again = subprocess.run([sys.executable, script, "--quick", "--quiet", "--task", "stories", "--algo", "grpo"],
                           capture_output=True, text=True, env=quick_env, timeout=1200)
    assert again.returncode == 0 and "resuming" in again.stdout, again.stdout[-3000:] + again.stderr[-3000:]
    assert (out / "summary.json").is_file()


@pytest.mark.slow
def test_policy_gradient_with_ptx_reports_the_kinds_of_errors_and_pass_at_k_after(quick_env):
    """Quick chapter 7 with PPO-ptx: its own folder, loss/ptx at every step, the wrong greedy answers by kind at every
    evaluation, pass@k before and after on the same problems, and the figure of it."""
    script = str(ROOT / "chapters" / "ch07_policy_gradient.py")
    run = subprocess.run([sys.executable, script, "--quick", "--quiet", "--ptx-coef", "0.5"], capture_output=True,
                         text=True, env=quick_env, timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "wrong answers, share of the held-out problems before -> after: slip" in run.stdout
    out = Path(quick_env["LLMFS_RUNS_DIR"]) / "quick" / "pg_word-problems_rloo_ptx0.5"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "objective/kl" in r and not r.get("train/skipped_step")]
    assert steps and all(r["loss/ptx"] > 0 for r in steps)
    evals = [r for r in records if "eval/greedy/accuracy" in r]
    for r in evals:  # the kinds of wrong answers and the right ones make up every answer
        kinds = [r[f"eval/greedy/errors/{k}"] for k in ("slip", "strategy", "events", "malformed")]
        assert sum(kinds) + r["eval/greedy/accuracy"] == pytest.approx(1.0, abs=1e-9)  # shares of n ≤ 1,000 answers
    result = json.loads((out / "eval.json").read_text())
    assert set(result["before"]["pass_at_k"]) == set(result["after"]["pass_at_k"]) == {"1", "2"}
    assert result["flags"]["ptx_coef"] == 0.5 and (out / "pass_at_k.png").is_file()


@pytest.mark.slow
def test_ppo_with_a_shared_critic_and_no_kl_penalty_and_resume(quick_env):
    """Chapter 8 with the shared critic and a fixed coefficient of 0; then an interrupted run picks up."""
    script = str(ROOT / "chapters" / "ch08_ppo.py")
    flags = ["--quick", "--quiet", "--critic", "shared", "--kl-ctl", "fixed", "--kl-coef", "0"]
    run = subprocess.run([sys.executable, script, *flags], capture_output=True, text=True, env=quick_env, timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = Path(quick_env["LLMFS_RUNS_DIR"]) / "quick" / "ppo_stories_shared_fixed0"
    result = json.loads((out / "eval.json").read_text())
    assert result["critic"] == "shared" and set(result["weights_held"]) == {"policy", "reference", "reward model"}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "objective/kl" in r]
    assert {"objective/kl", "objective/kl_coef", "objective/entropy", "objective/scores", "gold/reward", "proxy/reward",
            "policy/approxkl", "policy/clipfrac", "loss/policy", "loss/value", "value/explained_variance",
            "value/clipfrac", "completions/mean_length", "gold/wrong_name", "time/update_s"} <= set(train[-1])
    assert all(r["objective/kl_coef"] == 0 and r["policy/first_ratio_error"] == 0 for r in train)
    assert (out / "policy_value" / "model.safetensors").is_file() and (out / "curves.png").is_file()

    (out / "summary.json").unlink()  # as if stopped after its last checkpoint
    again = subprocess.run([sys.executable, script, *flags], capture_output=True, text=True, env=quick_env,
                           timeout=1200)
    assert again.returncode == 0 and "resuming" in again.stdout, again.stdout[-3000:] + again.stderr[-3000:]
    assert (out / "summary.json").is_file()


@pytest.mark.slow
def test_dpo_run_then_the_comparison_reuses_it_then_an_interrupted_run_resumes(quick_env):
    """Chapter 9's default run (the reference's log-probs cached): its records, figures and files; --compare keeps it
    and tabulates every loss; an interrupted run picks up with the cached log-probs read back. (That the cached and a
    live reference train the same policy, and how sampled pairs are labelled, are unit tests in test_dpo.py.)"""
    script = str(ROOT / "chapters" / "ch09_dpo.py")
    runs = Path(quick_env["LLMFS_RUNS_DIR"]) / "quick"
    run = subprocess.run([sys.executable, script, "--quick", "--quiet"], capture_output=True, text=True, env=quick_env,
                         timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = runs / "dpo"
    result = json.loads((out / "eval.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {"train/loss", "train/rewards/chosen", "train/rewards/rejected", "train/rewards/margins",
            "train/rewards/accuracies", "train/logps/chosen", "train/logps/rejected"} <= set(records[1])
    evals = [r for r in records if "val/loss" in r]
    assert ([r["step"] for r in evals] == [0, 3, 6]
            and [r["step"] for r in records if "train/loss" in r] == [*range(1, 7)])
    assert {"eval/sampled/kl", "eval/sampled/kl_k3", "eval/sampled/gold", "eval/sampled/gold_se"} <= set(evals[-1])
    assert "eval/sampled/proxy" not in evals[-1]  # DPO has no reward model: its proxy would be gold itself
    # step 0: π = π_ref, and the policy's held-out log-probs come from the same function, batches and weights as the
    # cached reference's, so every h is exactly 0 and the loss is log 2 up to the float32 rounding of the mean
    # (−log σ(0) in float32 is log 2 within an ulp, and a float32 mean of the 100 held-out pairs' copies of it within
    # 100·u·log 2 ≈ 4e-6 in the worst order)
    assert evals[0]["val/loss"] == pytest.approx(math.log(2), abs=5e-6) and evals[0]["val/rewards/margins"] == 0.0
    assert evals[0]["eval/sampled/kl"] == 0.0
    rows = [json.loads(line) for line in (out / "side_by_side.jsonl").read_text().splitlines()]
    assert {r["step"] for r in rows} == {0, 3, 6} and {"prompt", "reference", "policy", "gold_policy"} <= set(rows[0])
    for name in ("curves.png", "kl_gold.png", "logp_shift.png", "samples.md", "model.safetensors",
                 "reference_logps.safetensors"):
        assert (out / name).is_file(), name
    assert set(result["weights_held"]) == {"policy"}  # the reference released once its log-probs were cached

    compare = subprocess.run([sys.executable, script, "--quick", "--quiet", "--compare"], capture_output=True,
                             text=True, env=quick_env, timeout=1200)
    assert compare.returncode == 0, compare.stdout[-3000:] + compare.stderr[-3000:]
    assert compare.stdout.count("keeping the finished run") == 1  # the default run above, not trained again
    table = (runs / "dpo_compare" / "compare.md").read_text()
    assert all(f"| {loss} | {beta} | {eps} |" in table for loss, beta, eps in
               (("sigmoid", "0.1", "0"), ("sigmoid", "0.5", "0"), ("sigmoid", "2", "0"), ("ipo", "0.5", "0"),
                ("sigmoid", "0.5", "0.1")))
    assert (runs / "dpo_compare" / "compare.png").is_file()

    # on-policy pairs, sampled by the chapter and kept in the run folder (their labelling: test_dpo.py)
    sampled = subprocess.run([sys.executable, script, "--quick", "--quiet", "--pairs", "sampled"], capture_output=True,
                             text=True, env=quick_env, timeout=1200)
    pairs = (runs / "dpo_sampled" / "sampled_pairs.jsonl").read_text().splitlines()
    if not pairs:  # the 20-step quick SFT model can write stories that all score 0 under the parsing gold: a clear stop
        assert sampled.returncode != 0 and "tied on gold, so the model's own stories give no pair" in sampled.stderr
    else:
        assert sampled.returncode == 0, sampled.stdout[-3000:] + sampled.stderr[-3000:]
        assert json.loads((runs / "dpo_sampled" / "eval.json").read_text())["train_pairs"] == len(pairs)

    (out / "summary.json").unlink()  # as if stopped after its last checkpoint
    again = subprocess.run([sys.executable, script, "--quick", "--quiet"], capture_output=True, text=True,
                           env=quick_env, timeout=1200)
    assert again.returncode == 0 and "resuming" in again.stdout, again.stdout[-3000:] + again.stderr[-3000:]
    assert "the reference's log-probs" not in again.stdout  # read back from the run folder, not computed again
    assert (out / "summary.json").is_file()


def test_dpo_names_the_line_of_a_malformed_pair(quick_env, tmp_path):
    bad = tmp_path / "pairs.jsonl"
    bad.write_text('{"prompt": "Hi.", "chosen": "Hello.", "rejected": "Go."}\n{"prompt": "Hi.", "chosen": "Hello."}\n')
    env = dict(quick_env, LLMFS_RUNS_DIR=str(tmp_path / "runs"))
    run = subprocess.run([sys.executable, str(ROOT / "chapters" / "ch09_dpo.py"), "--quick", "--train-pairs", str(bad)],
                         capture_output=True, text=True, env=env)
    assert run.returncode == 2 and run.stderr.strip() == f"error: {bad}, line 2: missing field 'rejected'", run.stderr
    assert not (tmp_path / "runs").exists()  # refused before building anything


@pytest.mark.slow
def test_seed_sweep_prints_the_spread(quick_env):
    run = subprocess.run([sys.executable, str(ROOT / "chapters" / "ch05_sft.py"), "--quick", "--quiet", "--seeds", "2"],
                         capture_output=True, text=True, env=quick_env, timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "2 seeds of the default run" in run.stdout and "| arithmetic |" in run.stdout
    sweep = Path(quick_env["LLMFS_RUNS_DIR"]) / "quick" / "sft_seeds"
    summary = json.loads((sweep / "summary.json").read_text())
    assert summary["quick"] is True and summary["seeds"] == [0, 1]
    runs = summary["spread"]["arithmetic"]["runs"]
    seed_results = [json.loads((sweep / f"seed{k}" / "eval.json").read_text())["after"]["arithmetic"]["accuracy"]
                    for k in (0, 1)]
    assert runs == seed_results and summary["spread"]["arithmetic"]["min"] == min(seed_results)

    # a sweep picks up where it stopped: finished seeds of the same configuration are kept, not trained again
    again = subprocess.run([sys.executable, str(ROOT / "chapters" / "ch05_sft.py"), "--quick", "--quiet",
                            "--seeds", "2"], capture_output=True, text=True, env=quick_env, timeout=1200)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert again.stdout.count("keeping the finished run") == 2 and "trained in" not in again.stdout
    assert json.loads((sweep / "summary.json").read_text())["spread"] == summary["spread"]

    # chapter 7's sweep starts seed k from chapter 5's seed k
    pg = subprocess.run([sys.executable, str(ROOT / "chapters" / "ch07_policy_gradient.py"), "--quick", "--quiet",
                         "--seeds", "2"], capture_output=True, text=True, env=quick_env, timeout=1200)
    assert pg.returncode == 0, pg.stdout[-3000:] + pg.stderr[-3000:]
    pg_sweep = Path(quick_env["LLMFS_RUNS_DIR"]) / "quick" / "pg_word-problems_rloo_seeds"
    spread = json.loads((pg_sweep / "summary.json").read_text())["spread"]
    for k in (0, 1):
        result = json.loads((pg_sweep / f"seed{k}" / "eval.json").read_text())
        assert Path(result["init"]) == sweep / f"seed{k}" and result["seed"] == k
        assert spread["after"]["runs"][k] == result["after"]["gold"]
        # the sweep's gain is after − before of the same two floats, subtracted in float64 there and here: exact
        assert spread["gain"]["runs"][k] == result["after"]["gold"] - result["before"]["gold"]

    # and so does chapter 8's
    ppo = subprocess.run([sys.executable, str(ROOT / "chapters" / "ch08_ppo.py"), "--quick", "--quiet", "--seeds", "2"],
                         capture_output=True, text=True, env=quick_env, timeout=1200)
    assert ppo.returncode == 0, ppo.stdout[-3000:] + ppo.stderr[-3000:]
    assert "2 seeds of PPO on stories" in ppo.stdout and "within ±30% of the target" in ppo.stdout
    ppo_sweep = Path(quick_env["LLMFS_RUNS_DIR"]) / "quick" / "ppo_stories_seeds"
    summary = json.loads((ppo_sweep / "summary.json").read_text())
    for k in (0, 1):
        result = json.loads((ppo_sweep / f"seed{k}" / "eval.json").read_text())
        assert (Path(result["init"]) == sweep / f"seed{k}"
                and summary["spread"]["after"]["runs"][k] == result["after"]["gold"])

    # and chapter 9's
    dpo = subprocess.run([sys.executable, str(ROOT / "chapters" / "ch09_dpo.py"), "--quick", "--quiet", "--seeds", "2"],
                         capture_output=True, text=True, env=quick_env, timeout=1200)
    assert dpo.returncode == 0, dpo.stdout[-3000:] + dpo.stderr[-3000:]
    assert "2 seeds of dpo_beta0.5" in dpo.stdout and "| held-out preference accuracy |" in dpo.stdout
    dpo_sweep = Path(quick_env["LLMFS_RUNS_DIR"]) / "quick" / "dpo_seeds"
    spread = json.loads((dpo_sweep / "summary.json").read_text())["spread"]
    for k in (0, 1):
        result = json.loads((dpo_sweep / f"seed{k}" / "eval.json").read_text())
        assert Path(result["init"]) == sweep / f"seed{k}" and result["seed"] == k
        assert spread["held-out preference accuracy"]["runs"][k] == result["accuracy"]


@pytest.mark.slow
def test_quick_chapter_6_from_an_empty_runs_folder_writes_only_under_quick(tmp_path, quick_env):
    env = dict(quick_env, LLMFS_RUNS_DIR=str(tmp_path))
    run = subprocess.run([sys.executable, str(ROOT / "chapters" / "ch06_reward_model.py"), "--quick", "--quiet"],
                         capture_output=True, text=True, env=env, timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "no finished sft run in" in run.stdout  # it said what it was building
    assert sorted(p.name for p in tmp_path.iterdir()) == ["quick"]
    assert {"tokenizer", "pretrain", "sft", "reward_model"} <= {p.name for p in (tmp_path / "quick").iterdir()}


@pytest.mark.parametrize("args,message", [
    (["ch05_sft.py", "--device", "tpu"], "error: unknown device 'tpu'"),
    (["ch04_pretrain.py", "--text", "no/such/file.txt"], "error: --text: no/such/file.txt does not exist"),
    (["ch06_reward_model.py", "--init", "no/such/run"],
     "error: Tokenizer.load: no/such/run/tokenizer.tiktoken does not exist"),
    (["ch07_policy_gradient.py", "--seeds", "2"], "error: --seeds 2 starts seed k from"),
    (["ch08_ppo.py", "--seeds", "2"], "error: --seeds 2 starts seed k from"),
    (["ch09_dpo.py", "--seeds", "2"], "error: --seeds 2 starts seed k from"),
])
def test_bad_input_is_one_line_with_exit_code_2(args, message, quick_env, tmp_path):
    env = dict(quick_env, LLMFS_RUNS_DIR=str(tmp_path))
    run = subprocess.run([sys.executable, str(ROOT / "chapters" / args[0]), *args[1:], "--quick"], capture_output=True,
                         text=True, env=env, cwd=ROOT)
    assert run.returncode == 2 and run.stderr.strip().splitlines() == [run.stderr.strip()], run.stderr
    assert run.stderr.startswith(message)
    debug = subprocess.run([sys.executable, str(ROOT / "chapters" / args[0]), *args[1:], "--quick", "--debug"],
                           capture_output=True, text=True, env=env, cwd=ROOT)
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_no_build_refuses_with_the_command(quick_env, tmp_path):
    env = dict(quick_env, LLMFS_RUNS_DIR=str(tmp_path))
    run = subprocess.run([sys.executable, str(ROOT / "chapters" / "ch06_reward_model.py"), "--quick", "--no-build"],
                         capture_output=True, text=True, env=env)
    assert run.returncode == 2 and "make it first with `python chapters/ch05_sft.py --quick`" in run.stderr, run.stderr
    assert not (tmp_path / "quick" / "sft").exists()  # nothing was built


# a chapter-4 run in its own process that SIGKILLs itself right after the metrics record (step, kind) is on disk:
# a kill at a chosen moment, not a race against a file appearing
def uninterrupted_run(env: dict, stage: str, command: list[str]) -> Path:
    """The folder of an uninterrupted quick run with a chapter's default flags: the course's own quick run of `stage`
    when `test_run_all_quick` made it in this session's runs folder (the same command, into another folder), else
    `command` run now; a killed run of the same flags must end equal to it."""
    from llm_from_scratch.course import finished_run

    kept = Path(env["LLMFS_RUNS_DIR"]) / "quick" / stage
    if finished_run(kept) is not None:
        return kept
    run = subprocess.run([sys.executable, *command], capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return Path(command[-1])


KILLED_CH04 = """
import os, signal, sys
sys.path.insert(0, {chapters!r})
import cli, ch04_pretrain
import llm_from_scratch.train as train_module

append, (step, kind) = train_module.append_metrics, {kill!r}
def append_then_die(path, record):
    append(path, record)
    if record["step"] == step and kind in record:
        os.kill(os.getpid(), signal.SIGKILL)
train_module.append_metrics = append_then_die
cli.run(ch04_pretrain.main, sys.argv[1:])
"""


@pytest.mark.slow
def test_pretraining_killed_before_and_after_its_first_checkpoint_ends_as_an_uninterrupted_run(quick_env, tmp_path):
    """Quick chapter 4 (30 steps; train records every 7 steps, validation and checkpoint at 15 and 30), SIGKILLed
    after recording step 14 (no checkpoint yet: the next run starts over), then after recording step 21 (checkpoint
    of 15: the next run resumes there), then left to finish: metrics.jsonl holds each record once, as an
    uninterrupted run's, and the best and last weights are bit-identical to its."""
    import torch
    from safetensors.torch import load_file

    from llm_from_scratch.checkpoint import load_train_state, read_jsonl

    env = quick_env
    flags = ["--quick", "--quiet", "--out"]
    script = str(ROOT / "chapters" / "ch04_pretrain.py")
    uninterrupted = uninterrupted_run(env, "pretrain", [script, *flags, str(tmp_path / "a")])

    out = tmp_path / "b"

    def killed(step, kind):
        code = KILLED_CH04.format(chapters=str(ROOT / "chapters"), kill=(step, kind))
        run = subprocess.run([sys.executable, "-c", code, *flags, str(out)], capture_output=True, text=True, env=env,
                             timeout=600)
        assert run.returncode == -9, run.stdout[-3000:] + run.stderr[-3000:]  # died by SIGKILL
        return run

    def records(folder):
        return [(r["step"], "loss/train" in r, r.get("loss/train", r.get("loss/val")))
                for r in read_jsonl(folder / "metrics.jsonl")]

    killed(14, "loss/train")
    assert [s for s, _, _ in records(out)] == [7, 14] and not (out / "last").exists()
    second = killed(21, "loss/train")
    assert "before |" in second.stdout  # it started over (a resumed run prints no samples of the untrained model)
    assert load_train_state(out / "last" / "train_state.pt")["step"] == 15
    assert [s for s, _, _ in records(out)] == [7, 14, 15, 21]
    third = subprocess.run([sys.executable, script, *flags, str(out)], capture_output=True, text=True, env=env,
                           timeout=600)
    assert third.returncode == 0 and "before |" not in third.stdout, third.stdout[-3000:] + third.stderr[-3000:]
    assert records(out) == records(uninterrupted) and [s for s, _, _ in records(out)] == [7, 14, 15, 21, 28, 30, 30]
    for weights in ("model.safetensors", "last/model.safetensors"):
        a, b = load_file(str(uninterrupted / weights)), load_file(str(out / weights))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), weights


def test_a_nan_learning_rate_is_refused_before_anything_is_built(quick_env, tmp_path):
    """End to end, in its own process: exit code 2, one error line, and an empty runs folder."""
    env = dict(quick_env, LLMFS_RUNS_DIR=str(tmp_path))
    run = subprocess.run([sys.executable, str(ROOT / "chapters" / "ch04_pretrain.py"), "--lr", "nan"],
                         capture_output=True, text=True, env=env, cwd=ROOT)
    errors = [line for line in run.stderr.splitlines() if "error:" in line]
    message = "ch04_pretrain.py: error: argument --lr: must be a finite number, got nan"
    assert run.returncode == 2 and errors == [message], run.stderr
    assert not any(tmp_path.iterdir())  # refused before building anything


@pytest.mark.parametrize("script,flag", [("ch05_sft", "--lr"), ("ch06_reward_model", "--lr"),
                                         ("ch07_policy_gradient", "--lr"), ("ch07_policy_gradient", "--beta"),
                                         ("ch08_ppo", "--kl-coef"), ("ch08_ppo", "--critic-lr"), ("ch09_dpo", "--beta"),
                                         ("ch09_dpo", "--lr"), ("ch10_arena", "--rft-lr")])
def test_every_chapter_refuses_a_nan_float_flag(script, flag, capsys, monkeypatch):
    """The float flags of every training chapter go through cli.finite_float (float() alone accepts "nan")."""
    monkeypatch.delenv("LLMFS_QUICK", raising=False)
    sys.path.insert(0, str(ROOT / "chapters"))
    try:
        chapter = __import__(script)
    finally:
        sys.path.pop(0)
    with pytest.raises(SystemExit) as stop:
        chapter.parse_args([flag, "nan"])
    assert stop.value.code == 2 and f"argument {flag}: must be a finite number, got nan" in capsys.readouterr().err


def test_ppo_word_problem_rollouts_fit_a_restated_answer(capsys, monkeypatch):
    """Chapter 8's word-problem rollouts get chapter 7's 144 tokens (an answer restates each event: up to 138),
    stories keep 128, and --max-new-tokens 0 is refused, not taken for the default."""
    monkeypatch.delenv("LLMFS_QUICK", raising=False)
    sys.path.insert(0, str(ROOT / "chapters"))
    try:
        import ch08_ppo as ch08
    finally:
        sys.path.pop(0)
    assert ch08.parse_args(["--task", "word-problems"]).max_new_tokens == 144
    assert ch08.parse_args([]).max_new_tokens == 128
    with pytest.raises(SystemExit) as stop:
        ch08.parse_args(["--task", "word-problems", "--max-new-tokens", "0"])
    assert stop.value.code == 2 and "--max-new-tokens must be ≥ 1" in capsys.readouterr().err


def test_finite_and_positive_float_flags(capsys):
    sys.path.insert(0, str(ROOT / "chapters"))
    try:
        import cli
    finally:
        sys.path.pop(0)
    ap = cli.parser("test")
    ap.add_argument("--lr", type=cli.positive_float, default=1.0)
    ap.add_argument("--coef", type=cli.finite_float, default=0.0)
    args = ap.parse_args(["--lr", "3e-4", "--coef", "-0.5"])
    assert (args.lr, args.coef) == (3e-4, -0.5) and ap.parse_args([]).lr == 1.0
    for argv, message in ((["--coef", "inf"], "argument --coef: must be a finite number, got inf"),
                          (["--coef=-Infinity"], "argument --coef: must be a finite number, got -Infinity"),
                          (["--lr", "NaN"], "argument --lr: must be a finite number, got NaN"),
                          (["--lr", "0"], "argument --lr: must be a positive number, got 0"),
                          (["--lr=-1e-3"], "argument --lr: must be a positive number, got -1e-3"),
                          (["--lr", "fast"], "argument --lr: must be a number, got 'fast'")):
        with pytest.raises(SystemExit) as exit_:
            ap.parse_args(argv)
        assert exit_.value.code == 2 and capsys.readouterr().err.splitlines()[-1].endswith(f": error: {message}"), argv


KILLED_CH07 = """
import os, signal, sys
sys.path.insert(0, {chapters!r})
import cli, ch07_policy_gradient

append, step = ch07_policy_gradient.append_metrics, {kill!r}
def append_then_die(path, record):
    append(path, record)
    if path.name == "metrics.jsonl" and record["step"] == step:
        os.kill(os.getpid(), signal.SIGKILL)
ch07_policy_gradient.append_metrics = append_then_die
cli.run(ch07_policy_gradient.main, sys.argv[1:])
"""


@pytest.mark.slow
def test_policy_gradient_killed_before_and_after_its_first_checkpoint_ends_as_an_uninterrupted_run(quick_env,
                                                                                                   tmp_path):
    """Quick chapter 7 (4 steps, an evaluation and a checkpoint at steps 2 and 4), SIGKILLed after recording step 1
    (no checkpoint yet: the next run starts over), then after recording step 3 (checkpoint of step 2: the next run
    resumes there, with the rollouts' random numbers where they were), then left to finish: metrics.jsonl and
    rollout_samples.jsonl hold each record once, as an uninterrupted run's, and the weights are bit-identical."""
    import torch
    from safetensors.torch import load_file

    from llm_from_scratch.checkpoint import read_jsonl

    script = str(ROOT / "chapters" / "ch07_policy_gradient.py")
    flags = ["--quick", "--quiet", "--out"]
    uninterrupted = uninterrupted_run(quick_env, "pg_word-problems_rloo", [script, *flags, str(tmp_path / "a")])
    out = tmp_path / "b"

    def killed(step):
        code = KILLED_CH07.format(chapters=str(ROOT / "chapters"), kill=step)
        run = subprocess.run([sys.executable, "-c", code, *flags, str(out)], capture_output=True, text=True,
                             env=quick_env, timeout=900)
        assert run.returncode == -9, run.stdout[-3000:] + run.stderr[-3000:]  # died by SIGKILL
        return run

    def records(folder, name="metrics.jsonl"):  # every record but its timings (the one thing a rerun may change)
        return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in read_jsonl(folder / name)]

    killed(1)
    assert [r["step"] for r in records(out)] == [0, 1] and not (out / "last").exists()
    second = killed(3)
    assert "resuming" not in second.stdout  # no checkpoint to resume from: it started over
    assert [r["step"] for r in records(out)] == [0, 1, 2, 3]
    third = subprocess.run([sys.executable, script, *flags, str(out)], capture_output=True, text=True, env=quick_env,
                           timeout=900)
    assert third.returncode == 0 and "resuming" in third.stdout, third.stdout[-3000:] + third.stderr[-3000:]
    assert records(out) == records(uninterrupted) and [r["step"] for r in records(out)] == [0, 1, 2, 3, 4]
    assert records(out, "rollout_samples.jsonl") == records(uninterrupted, "rollout_samples.jsonl")
    a, b = load_file(str(uninterrupted / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)




@pytest.mark.slow
def test_chapter_7_async_killed_resumes_and_finishes(quick_env, tmp_path):
    """Quick chapter 7 with --async, SIGKILLed after recording step 3 (checkpoint at step 2), then resumed: each step
    recorded once; the first batch of each start is sampled by the weights it updates (ratio exactly 1), the others
    one update earlier (ratios ≠ 1: a missing EOS costs 1, so the rewards vary and every update moves the weights);
    the run records its flags, and its worker died with the trainer."""
    out = tmp_path / "async"
    flags = ["--quick", "--quiet", "--async", "--no-filter-groups", "--missing-eos-penalty", "1", "--out", str(out)]
    marked = {**quick_env, "ASYNC_TEST_RUN": str(out)}  # the worker inherits it: how to find it afterwards
    killed = subprocess.run([sys.executable, "-c", KILLED_CH07.format(chapters=str(ROOT / "chapters"), kill=3), *flags],
                            capture_output=True, text=True, env=marked, timeout=600)
    assert killed.returncode == -9, killed.stdout[-3000:] + killed.stderr[-3000:]
    time.sleep(3)  # the worker notices within a second that its trainer is gone
    assert not processes_with(f"ASYNC_TEST_RUN={out}"), "a rollout worker outlived its killed trainer"
    done = subprocess.run([sys.executable, str(ROOT / "chapters" / "ch07_policy_gradient.py"), *flags],
                          capture_output=True, text=True, env=quick_env, timeout=600)
    assert done.returncode == 0 and "resuming" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    ratios = {r["step"]: r["offpolicy/ratio"] for r in records if "offpolicy/ratio" in r}
    assert ratios[1] == 1.0 and ratios[3] == 1.0  # a fresh start and the resumed one: sampled by these weights
    assert ratios[2] != 1.0 and ratios[4] != 1.0  # sampled one update earlier
    result = json.loads((out / "eval.json").read_text())
    assert result["flags"]["async_rollouts"] is True and result["flags"]["is_cap"] == 2.0


def processes_with(marker: str) -> list[str]:
    """The pids of the running processes whose environment holds `marker` (Linux's /proc; elsewhere none)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in environ.read_bytes().split(b"\0"):
                found.append(environ.parent.name)
        except OSError:  # gone, or not ours to read
            pass
    return found


def test_resume_continues_only_the_same_flags_and_weights_and_cuts_the_logs_back(tmp_path, capsys):
    """chapters/common.py: resume() loads the weights, optimizer and RNG of the last checkpoint and cuts the logs back
    to its step; it starts over (removing the checkpoint and the logs, nothing else) for other flags, another seed or
    starting model, weights written after the train state (a kill between the two writes), and under --no-resume."""
    import dataclasses as dc

    import torch

    from llm_from_scratch.checkpoint import append_metrics, read_jsonl, save_tensors

    sys.path.insert(0, str(ROOT / "chapters"))
    try:
        import common
    finally:
        sys.path.pop(0)

    @dc.dataclass(frozen=True)
    class Cfg:
        lr: float = 0.1
        no_resume: bool = False
        quiet: bool = False

    out, sft = tmp_path / "run", tmp_path / "sft"
    sft.mkdir()
    (sft / "model.safetensors").write_bytes(b"the SFT model's weights")
    run = common.Run(out, 0, sft, "cpu")

    def checkpoint(model, optimizer, step):
        save_tensors(out / "last" / "model.safetensors", model.state_dict())
        common.save_state(run, Cfg(), step, optimizer, {"model.safetensors": model}, note=step)

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for step in range(1, 6):
        model(torch.randn(4, 3)).square().mean().backward()
        optimizer.step()
        append_metrics(out / "metrics.jsonl", {"step": step})
        if step == 3:
            checkpoint(model, optimizer, step)
            saved, rng = {k: v.clone() for k, v in model.state_dict().items()}, torch.get_rng_state()
    (out / "notes.txt").write_text("a file of the user's own")

    fresh = torch.nn.Linear(3, 2)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    state = common.resume(run, Cfg(), {"model.safetensors": fresh}, fresh_opt)
    assert state["step"] == 3 and state["note"] == 3 and torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(fresh.state_dict()[k], saved[k]) for k in saved)
    assert fresh_opt.state_dict()["state"][0]["step"] == 3
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3]

    def starts_over(cfg, run_, why):
        assert common.resume(run_, cfg, {"model.safetensors": fresh}, fresh_opt) is None
        assert not (out / "last").exists() and not (out / "metrics.jsonl").exists()
        assert (out / "notes.txt").is_file() and why in capsys.readouterr().out  # nothing else of the folder goes
        checkpoint(model, optimizer, 3)
        append_metrics(out / "metrics.jsonl", {"step": 3})

    starts_over(Cfg(lr=0.2), run, "is of other flags")
    starts_over(Cfg(), run._replace(seed=1), "another seed or starting model")
    (sft / "model.safetensors").write_bytes(b"chapter 5 trained again")
    starts_over(Cfg(), run, "another seed or starting model")
    save_tensors(out / "last" / "model.safetensors", {k: v + 1 for k, v in model.state_dict().items()})  # killed
    starts_over(Cfg(), run, "weights its train state was not saved with")  # between the two writes
    starts_over(Cfg(no_resume=True), run, "")
