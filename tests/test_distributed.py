"""Data parallelism (distributed.py) on the CPU with gloo: 2 processes under torchrun against 1 process.

The runs themselves are tests/ddp_worker.py; each launch trains all its cases in one process group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llm_from_scratch import distributed
from llm_from_scratch.checkpoint import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "ddp_worker.py"


def launch(out: Path, *cases: str, processes: int = 1, env: dict | None = None) -> subprocess.CompletedProcess:
    """The worker as one plain process, or under torchrun with `processes` ranks (gloo, on this CPU)."""
    runner = [sys.executable] if processes == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                      f"--nproc_per_node={processes}"]
    env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k not in distributed.TORCHRUN_VARIABLES}
    return subprocess.run(runner + [str(WORKER), str(out), *cases], env={**env, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)


def losses(folder: Path, key: str) -> dict[int, float]:
    records = [r for r in read_jsonl(folder / "metrics.jsonl") if key in r]
    steps = [r["step"] for r in records]
    assert len(steps) == len(set(steps)), f"{folder}: a step recorded twice (more than one rank writing?): {steps}"
    return {r["step"]: r[key] for r in records}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case once as 1 process and once as 2; then a 2-process run killed at step 4 and run again."""
    root = tmp_path_factory.mktemp("ddp")
    for name, processes in (("one", 1), ("two", 2)):
        done = launch(root / name, "lm", "lm_accum", "sft_accum", *(["dropout"] if processes == 2 else []),
                      processes=processes)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    killed = launch(root / "resumed", "dropout", processes=2, env={"LLMFS_TEST_CRASH_AT": "4"})
    assert killed.returncode != 0 and "killed at step 4" in killed.stderr, killed.stderr[-3000:]
    (root / "killed_state").write_text(str(torch.load(root / "resumed" / "dropout" / "last" / "train_state.pt",
                                                      weights_only=True)["step"]))
    resumed = launch(root / "resumed", "dropout", processes=2)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    return root


# How close 1 and 2 processes can be. Each rank sums the gradient of its 64 targets (sft: 64 and 8), then the
# all-reduce adds the two halves: another order than one sum of 128, ≲ 128·6e-8 of Σ|terms| apart (step 1's loss:
# ≲ 3e-5 of ~4.2 in the worst order, 2.5e-7 seen). AdamW then follows relative changes of a gradient (lr·m̂/√v̂,
# lr ≤ 3e-2) and turns a near-zero one's noise into moves of up to lr·noise/eps: after a few steps the weights are
# ~3e-5 apart in norm (more in the key biases, whose gradient is 0 in exact arithmetic and which leave the loss as it
# is), and a loss moves by ≤ ‖g‖·‖Δw‖ ≈ 1e-4 (5.4e-6 seen: 1e-5 was too close). A wrong shard weight (the sft
# case's 7:1 targets counted 1:1) is 1.6e-3 off from step 1.
LOSS_ABS = 1e-4


@pytest.mark.parametrize("case", ["lm", "lm_accum", "sft_accum"])
def test_two_processes_give_the_losses_of_one(runs, case):
    """The same global batch on 1 or 2 processes: the same training and validation losses at every step (the
    sft case's targets fall 7:1 between the ranks, so an unweighted per-rank mean would not match)."""
    for key in ("loss/train", "loss/val"):
        one, two = losses(runs / "one" / case, key), losses(runs / "two" / case, key)
        assert one.keys() == two.keys() and len(one) >= 2
        for step in one:
            assert two[step] == pytest.approx(one[step], abs=LOSS_ABS), (case, key, step)
    moved = losses(runs / "one" / case, "loss/train")
    assert abs(moved[6] - moved[1]) > 1e-2  # the steps did change the model (by ≥ 0.06, 600 × LOSS_ABS)


@pytest.mark.parametrize("case", ["lm", "lm_accum", "sft_accum"])
def test_ranks_keep_identical_weights(runs, case):
    ranks = json.loads((runs / "two" / case / "ranks.json").read_text())
    assert ranks["world_size"] == 2
    assert ranks["checksums"][0] == ranks["checksums"][1]


def test_only_rank_0_writes(runs):
    """One record per step (losses() checks it) and rank 0's checkpoint holds every rank's random state."""
    for case in ("lm", "lm_accum", "sft_accum"):
        assert sorted(losses(runs / "two" / case, "loss/train")) == list(range(1, 7))
    state = torch.load(runs / "two" / "lm" / "last" / "train_state.pt", weights_only=False)
    assert len(state["rng_ranks"]) == 2


def test_a_killed_two_process_run_resumes(runs):
    """Rank 1 killed at step 4: rank 0 had saved step 3; run again, it resumes there, each rank with its own random
    state (dropout 0.2, different masks on each rank), and ends where the unbroken 2-process run ends."""
    assert (runs / "killed_state").read_text() == "3"
    resumed = losses(runs / "resumed" / "dropout", "loss/train")
    unbroken = losses(runs / "two" / "dropout", "loss/train")
    assert sorted(resumed) == list(range(1, 7))
    # the same 2 processes, the same weights, Adam state, random states and batches from step 3: one computation (an
    # all-reduce of 2 ranks is a + b whatever DDP's buckets, and JSON keeps a float's every bit), so equal bit for bit
    for step in unbroken:
        assert resumed[step] == unbroken[step], step


# --- the helpers, in one process (what they must do when torchrun did not start us)

def test_one_process_helpers_do_nothing():
    model = torch.nn.Linear(2, 2)
    assert distributed.world_size() == 1 and distributed.rank() == 0 and distributed.is_main()
    assert distributed.wrap(model) is model and distributed.unwrap(model) is model
    assert distributed.all_reduce([1.5, 2.0]).tolist() == [1.5, 2.0]
    assert distributed.all_gather_objects({"a": 1}) == [{"a": 1}]
    assert distributed.broadcast_object("x") == "x"
    assert distributed.shard_rows(5) == slice(0, 5)
    with distributed.main_first():
        pass
    with pytest.raises(ValueError, match="'sum' or 'mean'"):
        distributed.all_reduce([1.0], op="max")


def test_shard_rows_cover_the_batch_once(monkeypatch):
    for W in (1, 2, 3, 4):
        for n_rows in range(W, 11):
            monkeypatch.setattr(distributed, "world_size", lambda W=W: W)
            shards = []
            for r in range(W):
                monkeypatch.setattr(distributed, "rank", lambda r=r: r)
                shards.append(distributed.shard_rows(n_rows))
            rows = [i for s in shards for i in range(n_rows)[s]]
            assert rows == list(range(n_rows)), (W, n_rows)
            assert max(s.stop - s.start for s in shards) - min(s.stop - s.start for s in shards) <= 1
    monkeypatch.setattr(distributed, "world_size", lambda: 4)
    with pytest.raises(ValueError, match="at least 4"):
        distributed.shard_rows(3)


def test_shard_weight_makes_the_average_the_global_mean(monkeypatch):
    """(1/W) Σ_r w_r L_r with w_r = W n_r / N equals the mean over all N targets, worked out for 2 ranks."""
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    token_losses = [[1.0, 2.0, 3.0, 6.0], [10.0]]  # rank 0: 4 targets, rank 1: one
    N = 5
    average = sum(distributed.shard_weight(len(t), N) * (sum(t) / len(t)) for t in token_losses) / 2
    # float64, a few ops on each side (~1e-16 relative; default rel 1e-6); the mean of the means is 50% off
    assert average == pytest.approx(22.0 / 5)  # (1+2+3+6+10) / 5, not the mean of the means, (3 + 10) / 2


def test_torchrun_with_mps_is_refused(monkeypatch):
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "localhost"),
                        ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(distributed, "pick_device", lambda name: torch.device("mps"))
    with pytest.raises(ValueError, match="MPS has no multi-process backend"):
        distributed.setup("mps")


def test_chapters_4_to_9_under_torchrun(tmp_path):
    """The chapter scripts themselves on 2 processes (quick mode): rank 0 builds the tokenizer they need, both ranks
    train, rank 0 alone evaluates and writes, each step is recorded once; chapters 7 and 8 save both ranks' sampling
    streams. (Chapter 7 filters out equal groups: a rank left without a row must still join the update, or the run
    hangs.) Chapter 9 (DPO, dropout 0, no sampling while training) then runs once more as one process: its 2
    processes, each with half of every step's pairs and the reference log-probs rank 0 cached, give the same losses."""
    env = {k: v for k, v in os.environ.items() if k not in distributed.TORCHRUN_VARIABLES}
    env.update(LLMFS_QUICK="1", LLMFS_RUNS_DIR=str(tmp_path), MPLBACKEND="Agg", OMP_NUM_THREADS="1")
    for chapter, stage, key in (("ch04_pretrain.py", "pretrain", "loss/train"), ("ch05_sft.py", "sft", "loss/train"),
                                ("ch06_reward_model.py", "reward_model", "loss/train"),
                                ("ch07_policy_gradient.py", "pg_word-problems_rloo", "loss/train"),
                                ("ch08_ppo.py", "ppo_stories", "loss/train"), ("ch09_dpo.py", "dpo", "train/loss")):
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               str(ROOT / "chapters" / chapter), "--quiet"], env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        summary = json.loads((tmp_path / "quick" / stage / "summary.json").read_text())
        assert summary["processes"] == 2, summary
        losses(tmp_path / "quick" / stage, key)  # one record per step
        if stage.startswith(("pg_", "ppo_")):
            state = torch.load(tmp_path / "quick" / stage / "last" / "train_state.pt", weights_only=True)
            assert len(state["generators"]) == 2
        else:
            assert "2 processes" in done.stdout, chapter

    one = subprocess.run([sys.executable, str(ROOT / "chapters" / "ch09_dpo.py"), "--quiet", "--out",
                          str(tmp_path / "dpo_one_process")], env=env, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    two, single = losses(tmp_path / "quick" / "dpo", "train/loss"), losses(tmp_path / "dpo_one_process", "train/loss")
    steps = json.loads((tmp_path / "dpo_one_process" / "summary.json").read_text())["steps"]
    assert list(two) == list(single) == list(range(1, steps + 1)), (two, single)
    # 1 against 2 processes, as in test_two_processes_give_the_losses_of_one; here h is a difference of sequence
    # log-probs ~250 (ulp 1.5e-5) and the loss moves by β/2·Δh ≈ 0.25·Δh: 4e-6 an ulp of h (3.8e-6 seen)
    for step, loss in single.items():
        assert two[step] == pytest.approx(loss, abs=LOSS_ABS), (step, two, single)


def test_dpo_compare_refuses_torchrun(monkeypatch):
    """Chapter 9's --compare (its variants share one file of reference log-probs) runs as one process: under
    torchrun it says so in one line, before it starts anything, instead of running W copies that overwrite each
    other."""
    monkeypatch.syspath_prepend(str(ROOT / "chapters"))
    import ch09_dpo

    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "localhost"),
                        ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=r"chapter 9 \(DPO\) --compare does not run under torchrun yet"):
        ch09_dpo.main(["--compare", "--quick"])
    monkeypatch.setenv("WORLD_SIZE", "1")
    ch09_dpo.common.refuse_torchrun("chapter 9 (DPO) --compare")  # torchrun with one process: nothing to refuse
