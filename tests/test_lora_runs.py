"""Appendix A end to end: chapters 7, 8 and 9 with --lora-rank (the reference is the policy with its adapters off),
what their run folders hold, resuming from the adapters alone, and appendix A's own script.

Runs after test_chapters.py (file order), so the quick course's runs (the SFT and reward models) are already in
this session's runs folder."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llm_from_scratch import lora
from llm_from_scratch.checkpoint import load_tensors
from llm_from_scratch.tokenizer import Tokenizer
from llm_from_scratch.train import load_gpt

ROOT = Path(__file__).resolve().parents[1]
POLICY = "policy + LoRA (adapters off: the reference)"  # common.policy_held's name for the one network


def run(env: dict, script: str, *flags: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, str(ROOT / "chapters" / script), "--quick", "--quiet", *flags],
                          capture_output=True, text=True, env=env, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def adapted_from_files(out: Path, init: Path) -> torch.nn.Module:
    """The SFT model of `init` with LoRA put on as the run's eval.json says, and the run's adapters.safetensors
    loaded into it: the trained policy, rebuilt without the merged weights."""
    flags = json.loads((out / "eval.json").read_text())["flags"]
    tok = Tokenizer.load(init)
    model = load_gpt(init, vocab_size=tok.vocab_size, dropout=0.0)
    lora.apply_lora(model, flags["lora_rank"], flags["lora_alpha"], flags["lora_targets"])
    stored = load_tensors(out / "adapters.safetensors")
    lora.Adapters(model).load_state_dict(stored)
    return model, tok


@pytest.mark.slow
def test_dpo_with_lora_holds_one_network_saves_merged_weights_and_resumes_from_the_adapters(quick_env):
    runs = Path(quick_env["LLMFS_RUNS_DIR"]) / "quick"
    run(quick_env, "ch09_dpo.py", "--lora-rank", "4")
    out = runs / "dpo_lora4"
    result = json.loads((out / "eval.json").read_text())
    assert set(result["weights_held"]) == {POLICY}
    assert result["flags"]["lora_rank"] == 4 and result["lr"] == 5e-4  # LoRA's default: 10x (10 × 5e-5 is 5e-4 exactly)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in records if "val/loss" in r)
    # the adapters-off reference is the policy: every margin is exactly 0 and every pair's loss log 2 in float32
    # (4e-8 off); their float32 mean over the 100 held-out pairs, in any order: ≲ 100·6e-8·log 2 ≈ 4e-6
    assert first["val/loss"] == pytest.approx(math.log(2), abs=5e-6)
    assert first["eval/sampled/kl"] == 0.0

    # model.safetensors is the policy with its adapters folded in: the SFT model + the stored adapters gives it back
    policy, tok = adapted_from_files(out, runs / "sft")
    merged = load_gpt(out, vocab_size=tok.vocab_size, dropout=0.0)
    ids = torch.tensor([tok.encode("Write a happy story about Mia.")])
    with torch.no_grad():
        # W + s·BA rounded once against W x + s·B(A x): other orders of 128- and 512-term float32 sums through 4
        # layers, on logits ≲ 5: ~1e-6 (measured 1.4e-6), inside 1e-5 + 1e-5 × |logit|
        torch.testing.assert_close(merged(ids), policy(ids), rtol=1e-5, atol=1e-5)
        sft = load_gpt(runs / "sft", vocab_size=tok.vocab_size, dropout=0.0)
        assert (merged(ids) - sft(ids)).abs().max() > 1e-4  # training moved it: by ~0.1, not by rounding (~1e-6)
        with lora.adapters_disabled(policy):
            assert torch.equal(policy(ids), sft(ids))
    assert sorted(p.name for p in (out / "last").iterdir()) == ["adapters.safetensors", "train_state.pt"]

    before = (out / "model.safetensors").read_bytes()
    (out / "summary.json").unlink()  # as if stopped after its last checkpoint: it resumes from the adapters alone
    again = run(quick_env, "ch09_dpo.py", "--lora-rank", "4")
    assert "resuming" in again.stdout
    assert (out / "model.safetensors").read_bytes() == before


@pytest.mark.slow
def test_rloo_and_ppo_with_lora_name_their_runs_and_hold_no_reference_copy(quick_env):
    runs = Path(quick_env["LLMFS_RUNS_DIR"]) / "quick"
    run(quick_env, "ch07_policy_gradient.py", "--lora-rank", "2", "--lora-targets", "attn")
    out = runs / "pg_word-problems_rloo_lora2"
    result = json.loads((out / "eval.json").read_text())
    assert set(result["weights_held"]) == {POLICY} and result["lr"] == 5e-4  # 10 × 5e-5 is the double 5e-4
    policy, _ = adapted_from_files(out, runs / "sft")
    assert set(lora.adapted_layers(policy)) == {f"blocks.{i}.attn.{n}" for i in range(4) for n in ("c_attn", "c_proj")}

    run(quick_env, "ch08_ppo.py", "--lora-rank", "2", "--critic", "shared")
    out = runs / "ppo_stories_shared_lora2"
    result = json.loads((out / "eval.json").read_text())
    assert set(result["weights_held"]) == {POLICY, "reward model"}
    assert sorted(p.name for p in (out / "last").iterdir()) == ["adapters.safetensors", "train_state.pt",
                                                                "value_head.safetensors"]
    from llm_from_scratch.ppo import PolicyValue  # the shared critic's checkpoint: plain weights, adapters folded in
    PolicyValue.load(out / "policy_value")


@pytest.mark.slow
def test_appendix_a_script_compares_full_and_lora_over_seeds(quick_env):
    done = run(quick_env, "appA_lora.py", "--methods", "dpo", "--seeds", "2", "--rank", "4")
    out = Path(quick_env["LLMFS_RUNS_DIR"]) / "quick" / "appA_lora"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["quick"] is True and summary["checks"]["fresh_equals_sft"]
    # merged against adapted logits (appendix A's check): ~1e-6 on logits ≲ 5, as in the DPO test above
    assert summary["checks"]["adapters_off_equals_sft"] and summary["checks"]["merged_max_abs_diff"] < 1e-4
    counts = {(r["rank"], r["targets"]): r["trained"] for r in summary["counts"]}
    assert counts[(4, "all")] == 4 * 16 * 4 * 128  # n_layer · 16 · r · n_embd (test_lora.py works it out)
    c = summary["comparison"]["dpo"]
    assert len(c["full"]) == len(c["lora"]) == 2 and c["diff"] == [b - a for a, b in zip(c["full"], c["lora"])]
    assert (out / "compare.png").is_file() and "LoRA − full" in (out / "compare.md").read_text()
    assert "Full fine-tuning against LoRA r=4" in done.stdout


def test_the_arena_adds_the_finished_lora_runs_of_chapters_8_and_9(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "chapters"))
    import ch10_arena

    def finished(name: str, quick: bool) -> None:
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps({"quick": quick}))

    finished("dpo_lora8", False)
    finished("ppo_stories_lora4", False)
    finished("dpo_lora16", True)  # a quick run: not beside real ones
    (tmp_path / "dpo_lora2").mkdir()  # not finished
    finished("dpo_lora_x", False)  # not a rank
    assert ch10_arena.lora_dirs(tmp_path, quick=False) == {"PPO, LoRA r=4": tmp_path / "ppo_stories_lora4",
                                                           "DPO, LoRA r=8": tmp_path / "dpo_lora8"}
    assert ch10_arena.lora_dirs(tmp_path, quick=True) == {"DPO, LoRA r=16": tmp_path / "dpo_lora16"}


def test_lora_flags_name_the_run_fill_the_learning_rate_and_enter_the_flags_only_when_used(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "chapters"))
    import ch07_policy_gradient as ch07
    import ch09_dpo as ch09

    import common

    plain, low_rank = ch09.parse_args([]), ch09.parse_args(["--lora-rank", "8", "--lora-targets", "attn"])
    assert not any(k.startswith("lora_") for k in common.flags_record(plain))  # the runs made before appendix A
    assert common.flags_record(low_rank)["lora_rank"] == 8 and common.flags_record(low_rank)["lora_targets"] == "attn"
    assert (plain.lr, low_rank.lr, ch09.parse_args(["--lora-rank", "8", "--lr", "1e-4"]).lr) == (5e-5, 5e-4, 1e-4)
    assert (ch09.run_name(plain), ch09.run_name(low_rank)) == ("dpo", "dpo_lora8")
    stories = ch07.parse_args(["--task", "stories", "--lora-rank", "4"])
    assert stories.lr == 2e-4 and ch07.run_name(stories) == "pg_stories_rloo_lora4"  # 10 × 2e-5 is the double 2e-4
    for bad in (["--lora-rank", "-1"], ["--lora-alpha", "16"], ["--lora-targets", "mlp"],
                ["--lora-rank", "4", "--lora-alpha", "nan"]):
        with pytest.raises(SystemExit):
            ch07.parse_args(bad)
