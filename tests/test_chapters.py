"""Every chapter script explains itself (--help) and the whole course runs end to end as a smoke run.

`run_all.py --quick` runs every chapter script in order, each in its own process, sharing one runs
folder as a real course run does; running them once here (not once per script and again through
run_all) keeps the suite fast. The notebooks (test_notebooks.py) then reuse these runs.
"""

import json
import math
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
    assert [s for s, _, _ in run_all.CHAPTERS] == [s.name for s in SCRIPTS]


def test_ch07_loss_type_and_filter_reach_the_config_and_the_finished_run_check(tmp_path, monkeypatch):
    """--loss-type and --filter-groups land in PGConfig (what eval.json records), in the default folder's name, and
    in the check that keeps a finished run: a run made with other knobs is not mistaken for this one, and a run from
    before the knobs existed (its config without them) counts as their defaults."""
    monkeypatch.delenv("LLMFS_QUICK", raising=False)
    sys.path.insert(0, str(ROOT / "chapters"))
    try:
        import ch07_policy_gradient as ch07
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
    assert ch07.parse_args(["--algo", "reinforce", "--k", "1", "--no-filter-groups"]).k == 1
    for bad in (["--loss-type", "bnpo"], ["--algo", "reinforce", "--k", "1"], ["--task", "stories", "--algo", "reinforce",
                                                                            "--k", "1", "--filter-groups"]):
        with pytest.raises(SystemExit):
            ch07.parse_args(bad)

    out = tmp_path / "run"
    out.mkdir()
    (out / "summary.json").write_text(json.dumps({"quick": False}))
    older = {k: v for k, v in vars(ch07.pg_config(default)).items() if k not in ("loss_type", "filter_groups")}
    result = {"steps": default.steps, "seed": 0, "lr": default.lr, "prompts": default.prompts, "algo": default.algo,
              "eval_samples": 0, "config": older}
    (out / "eval.json").write_text(json.dumps(result))
    assert ch07.finished_seed(default, out, 0) is not None  # from before the knobs: their defaults
    words_result = {**result, "lr": words.lr}  # a word-problem run from before the recipe: not today's default run
    (out / "eval.json").write_text(json.dumps(words_result))
    assert ch07.finished_seed(words, out, 0) is None and ch07.finished_seed(own, out, 0) is not None
    (out / "eval.json").write_text(json.dumps(result))
    assert ch07.finished_seed(dapo, out, 0) is None
    assert ch07.finished_seed(ch07.parse_args(["--task", "stories", "--loss-type", "grpo"]), out, 0) is None
    assert ch07.finished_seed(ch07.parse_args(["--task", "stories", "--filter-groups"]), out, 0) is None
    (out / "eval.json").write_text(json.dumps({**result, "config": vars(ch07.pg_config(dapo))}))
    assert ch07.finished_seed(dapo, out, 0) is not None and ch07.finished_seed(default, out, 0) is None


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
    for name, m in matched.items():  # the same checkpoint, prompts and draws: the chapter's numbers, exactly
        for key, value in m.items():
            assert arena["table"][name][key] == pytest.approx(value, abs=1e-6), (name, key)

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
    assert (chain / "pretrain" / "model.safetensors").read_bytes() == (runs / "pretrain" / "model.safetensors").read_bytes()
    result = json.loads((runs / "arena_seeds" / "seeds.json").read_text())
    assert {"best-of-4", "RFT", "REINFORCE", "RLOO", "GRPO", "RLOO, β = 0", "PPO", "DPO"} <= set(result["spread"])
    seed1 = json.loads((chain / "arena" / "table.json").read_text())
    assert seed1["seed"] == 1 and result["spread"]["PPO"]["kl"]["each"][1] == seed1["table"]["PPO"]["kl"]
    assert (runs / "arena_seeds" / "frontier.png").is_file() and "over 2 seeds" in (runs / "arena_seeds" / "table.md").read_text()
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
            "gold/wrong_object", "time/generate_s", "time/reference_s", "time/reward_s", "time/update_s"} <= set(records[-1])
    # the one schema (evaluation.eval_record): greedy stories are scored by gold (not an accuracy) and the reward model
    assert {"eval/greedy/gold", "eval/greedy/proxy", "eval/greedy/ended"} <= set(records[0]) <= set(records[-1]) | {"step"}
    assert not any(k.startswith("eval/sampled/") or k == "eval/greedy/accuracy" for k in records[-1])  # no --eval-samples
    samples = [json.loads(line) for line in (out / "rollout_samples.jsonl").read_text().splitlines()]
    assert samples and {"proxy", "gold", "name_ok", "object_ok"} <= set(samples[0])

    (out / "summary.json").unlink()  # as if stopped after its last checkpoint
    again = subprocess.run([sys.executable, script, "--quick", "--quiet", "--task", "stories", "--algo", "grpo"],
                           capture_output=True, text=True, env=quick_env, timeout=1200)
    assert again.returncode == 0 and "resuming" in again.stdout, again.stdout[-3000:] + again.stderr[-3000:]
    assert (out / "summary.json").is_file()


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
            "policy/approxkl", "policy/clipfrac", "loss/policy", "loss/value", "value/explained_variance", "value/clipfrac",
            "completions/mean_length", "gold/wrong_name", "time/update_s"} <= set(train[-1])
    assert all(r["objective/kl_coef"] == 0 and r["policy/first_ratio_error"] == 0 for r in train)
    assert (out / "policy_value" / "model.safetensors").is_file() and (out / "curves.png").is_file()

    (out / "summary.json").unlink()  # as if stopped after its last checkpoint
    again = subprocess.run([sys.executable, script, *flags], capture_output=True, text=True, env=quick_env, timeout=1200)
    assert again.returncode == 0 and "resuming" in again.stdout, again.stdout[-3000:] + again.stderr[-3000:]
    assert (out / "summary.json").is_file()


@pytest.mark.slow
def test_dpo_cached_and_live_reference_agree_and_the_comparison_reuses_the_default_run(quick_env):
    """Chapter 9 with the reference's log-probs cached (the default) and with a live reference: the same numbers;
    then --compare keeps the default run and tabulates every loss; then an interrupted run picks up."""
    script = str(ROOT / "chapters" / "ch09_dpo.py")
    runs = Path(quick_env["LLMFS_RUNS_DIR"]) / "quick"
    results = {}
    for reference in ("cached", "live"):
        run = subprocess.run([sys.executable, script, "--quick", "--quiet", "--reference", reference],
                             capture_output=True, text=True, env=quick_env, timeout=1200)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        out = runs / ("dpo" if reference == "cached" else "dpo_live")
        results[reference] = json.loads((out / "eval.json").read_text())
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert {"train/loss", "train/rewards/chosen", "train/rewards/rejected", "train/rewards/margins",
                "train/rewards/accuracies", "train/logps/chosen", "train/logps/rejected"} <= set(records[1])
        evals = [r for r in records if "val/loss" in r]
        assert [r["step"] for r in evals] == [0, 3, 6]
        assert {"eval/sampled/kl", "eval/sampled/kl_k3", "eval/sampled/gold", "eval/sampled/gold_se"} <= set(evals[-1])
        assert "eval/sampled/proxy" not in evals[-1]  # DPO has no reward model: its proxy would be gold itself
        # step 0: π = π_ref, so every pair's loss is log 2, up to float32: in cached mode the reference's sums of
        # log-probs come from other batches than the policy's (2e-4 apart once on this Intel CPU)
        assert evals[0]["val/loss"] == pytest.approx(0.693147, abs=1e-3) and evals[0]["eval/sampled/kl"] == 0.0
        rows = [json.loads(line) for line in (out / "side_by_side.jsonl").read_text().splitlines()]
        assert {r["step"] for r in rows} == {0, 3, 6} and {"prompt", "reference", "policy", "gold_policy"} <= set(rows[0])
        for name in ("curves.png", "kl_gold.png", "logp_shift.png", "samples.md", "model.safetensors"):
            assert (out / name).is_file(), name
    cached, live = results["cached"], results["live"]
    assert set(cached["weights_held"]) == {"policy"} and set(live["weights_held"]) == {"policy", "reference"}
    assert (runs / "dpo" / "reference_logps.safetensors").is_file() and not (runs / "dpo_live" / "reference_logps.safetensors").exists()
    # the first step sees the same weights and the same reference log-probs up to float32 rounding (sums of ~300
    # log-probs made in other batches): its numbers agree to the 6th digit
    first = {}
    for reference in ("cached", "live"):
        out = runs / ("dpo" if reference == "cached" else "dpo_live")
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        first[reference] = next(r for r in records if r.get("step") == 1 and "train/loss" in r)
    for key in ("train/loss", "train/rewards/margins", "train/logps/chosen"):
        assert first["cached"][key] == pytest.approx(first["live"][key], rel=1e-5, abs=1e-4), key
    # after a few AdamW steps they drift apart by more: Adam divides each gradient by its own running size, so a
    # parameter whose gradient is ~0 steps by ±lr on the sign of its rounding error (4e-4 in the margins seen once)
    for key in ("rewards/accuracies", "rewards/margins", "loss", "logps/chosen"):
        assert cached["val"][key] == pytest.approx(live["val"][key], rel=0.02, abs=5e-3), key
    assert cached["after"]["gold"] == pytest.approx(live["after"]["gold"], abs=1e-6)

    compare = subprocess.run([sys.executable, script, "--quick", "--quiet", "--compare"], capture_output=True, text=True,
                             env=quick_env, timeout=1200)
    assert compare.returncode == 0, compare.stdout[-3000:] + compare.stderr[-3000:]
    assert compare.stdout.count("keeping the finished run") == 1  # the default run above, not trained again
    table = (runs / "dpo_compare" / "compare.md").read_text()
    assert all(f"| {loss} | {beta} | {eps} |" in table for loss, beta, eps in
               (("sigmoid", "0.1", "0"), ("sigmoid", "0.5", "0"), ("sigmoid", "2", "0"), ("ipo", "0.5", "0"),
                ("sigmoid", "0.5", "0.1")))
    assert (runs / "dpo_compare" / "compare.png").is_file()

    # on-policy pairs: the SFT model's own stories, best against worst by gold, labelled with Bradley–Terry noise
    sampled = subprocess.run([sys.executable, script, "--quick", "--quiet", "--pairs", "sampled"], capture_output=True,
                             text=True, env=quick_env, timeout=1200)
    out = runs / "dpo_sampled"
    rows = [json.loads(line) for line in (out / "sampled_pairs.jsonl").read_text().splitlines()]
    if not rows:  # the 20-step quick SFT model can write stories that all score 0 under the parsing gold: a clear stop
        assert sampled.returncode != 0 and "tied on gold, so the model's own stories give no pair" in sampled.stderr
    else:
        assert sampled.returncode == 0, sampled.stdout[-3000:] + sampled.stderr[-3000:]
        assert json.loads((out / "eval.json").read_text())["train_pairs"] == len(rows) >= 1
    for r in rows:
        assert r["gold_chosen"] != r["gold_rejected"] and "<|" not in r["chosen"] + r["rejected"]
        assert r["p_chosen"] == pytest.approx(1 / (1 + math.exp(-8 * (r["gold_chosen"] - r["gold_rejected"]))))

    (runs / "dpo" / "summary.json").unlink()  # as if stopped after its last checkpoint
    again = subprocess.run([sys.executable, script, "--quick", "--quiet"], capture_output=True, text=True, env=quick_env,
                           timeout=1200)
    assert again.returncode == 0 and "resuming" in again.stdout, again.stdout[-3000:] + again.stderr[-3000:]
    assert "the reference's log-probs" not in again.stdout  # read back from the run folder, not computed again
    assert (runs / "dpo" / "summary.json").is_file()


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
    seed_results = [json.loads((sweep / f"seed{k}" / "eval.json").read_text())["after"]["arithmetic"]["accuracy"] for k in (0, 1)]
    assert runs == seed_results and summary["spread"]["arithmetic"]["min"] == min(seed_results)

    # a sweep picks up where it stopped: finished seeds of the same configuration are kept, not trained again
    again = subprocess.run([sys.executable, str(ROOT / "chapters" / "ch05_sft.py"), "--quick", "--quiet", "--seeds", "2"],
                           capture_output=True, text=True, env=quick_env, timeout=1200)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert again.stdout.count("keeping the finished run") == 2 and "trained in" not in again.stdout
    assert json.loads((sweep / "summary.json").read_text())["spread"] == summary["spread"]

    # chapter 7's sweep starts seed k from chapter 5's seed k
    pg = subprocess.run([sys.executable, str(ROOT / "chapters" / "ch07_policy_gradient.py"), "--quick", "--quiet", "--seeds", "2"],
                        capture_output=True, text=True, env=quick_env, timeout=1200)
    assert pg.returncode == 0, pg.stdout[-3000:] + pg.stderr[-3000:]
    pg_sweep = Path(quick_env["LLMFS_RUNS_DIR"]) / "quick" / "pg_word-problems_rloo_seeds"
    spread = json.loads((pg_sweep / "summary.json").read_text())["spread"]
    for k in (0, 1):
        result = json.loads((pg_sweep / f"seed{k}" / "eval.json").read_text())
        assert Path(result["init"]) == sweep / f"seed{k}" and result["seed"] == k
        assert spread["after"]["runs"][k] == result["after"]["gold"]
        assert spread["gain"]["runs"][k] == pytest.approx(result["after"]["gold"] - result["before"]["gold"])

    # and so does chapter 8's
    ppo = subprocess.run([sys.executable, str(ROOT / "chapters" / "ch08_ppo.py"), "--quick", "--quiet", "--seeds", "2"],
                         capture_output=True, text=True, env=quick_env, timeout=1200)
    assert ppo.returncode == 0, ppo.stdout[-3000:] + ppo.stderr[-3000:]
    assert "2 seeds of PPO on stories" in ppo.stdout and "within ±30% of the target" in ppo.stdout
    ppo_sweep = Path(quick_env["LLMFS_RUNS_DIR"]) / "quick" / "ppo_stories_seeds"
    summary = json.loads((ppo_sweep / "summary.json").read_text())
    for k in (0, 1):
        result = json.loads((ppo_sweep / f"seed{k}" / "eval.json").read_text())
        assert Path(result["init"]) == sweep / f"seed{k}" and summary["spread"]["after"]["runs"][k] == result["after"]["gold"]

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
    (["ch06_reward_model.py", "--init", "no/such/run"], "error: Tokenizer.load: no/such/run/tokenizer.tiktoken does not exist"),
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
