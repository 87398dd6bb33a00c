"""The reward model's training and the DPO step under data parallelism (distributed.py): 2 processes under torchrun
(gloo, on this CPU) against 1 process, on the same global batches.

The runs themselves are tests/ddp_prefs_worker.py; each launch runs every case in one process group. The odd batches
(5 pairs: 3 on rank 0, 2 on rank 1) make the shard weight w_r = W n_r / N matter: an unweighted average of the two
ranks' mean losses would give rank 1's pairs 5/4 of their share, and the steps after the first would drift."""

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
from llm_from_scratch.dpo import pair_rows

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "ddp_prefs_worker.py"
DPO_CASES = ["dpo", "dpo_ipo"]
# the reward model's numbers that do not depend on the head's bias: the Bradley–Terry loss sees only differences of
# rewards, so the bias's gradient is 0 up to float rounding, and Adam turns that rounding into steps of ±lr: the
# mean, min and max reward drift apart between 1 and 2 processes (by ~1e-4 here) while everything else agrees
REWARD_KEYS = ("loss/train", "train/grad_norm", "rewards/accuracies", "rewards/margins", "loss/val", "val/accuracy",
               "val/margin")


def launch(out: Path, processes: int) -> subprocess.CompletedProcess:
    """The worker as one plain process, or under torchrun with `processes` ranks."""
    runner = [sys.executable] if processes == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                      f"--nproc_per_node={processes}"]
    env = {k: v for k, v in os.environ.items() if k not in distributed.TORCHRUN_VARIABLES}
    return subprocess.run(runner + [str(WORKER), str(out)], env={**env, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)


# How close 1 and 2 processes can be. One process sums a step's gradient over every token of its pairs; two processes
# each sum their own pairs, then all-reduce the two halves: the same terms in another order. Two orders of a float32
# sum of n terms differ by up to ~n·u of Σ|term| (u = 2^-24 ≈ 6e-8); here n ≈ 5 pairs × 2 rows × 64 tokens = 640, so
# ≲ 4e-5 relative. AdamW then turns that rounding into different steps: its first step moves every weight by ±lr
# whatever its gradient's size, so a near-zero gradient whose rounding differs moves its weight differently, and from
# the second step on the two runs' numbers differ by more than one sum's rounding (a gradient norm of 28.07 by 1.4e-6
# relative on an AMD CPU, where a bound of 1e-6 had been read off an Intel run). 1e-4 relative covers both, and a
# wrong shard weight (each rank's mean loss weighted alike: rank 1's 2 pairs counted as half of the 5) still fails.
REL, ABS = 1e-4, 1e-5  # ABS: numbers near 0 (an accuracy, a margin at the first step), where rel means nothing


def close(a: float, b: float) -> bool:
    """Equal up to the rounding of another summation order and what Adam's steps make of it (REL, ABS above)."""
    return b == pytest.approx(a, abs=ABS, rel=REL)


def records(folder: Path, key: str) -> dict[int, float]:
    """step -> value of `key` in folder/metrics.jsonl; a step recorded twice fails (more than one rank writing)."""
    rows = [r for r in read_jsonl(folder / "metrics.jsonl") if key in r]
    steps = [r["step"] for r in rows]
    assert len(steps) == len(set(steps)), f"{folder}: {key} recorded twice at a step (every rank writing?): {steps}"
    return {r["step"]: r[key] for r in rows}


def ranks(folder: Path) -> dict:
    return json.loads((folder / "ranks.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp_prefs")
    for name, processes in (("one", 1), ("two", 2)):
        done = launch(root / name, processes)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return root


def test_reward_model_two_processes_give_the_numbers_of_one(runs):
    """Every logged training and validation number of the global batch, step by step (the accuracy and the margin
    too: a rank's own 3 or 2 pairs would not give the batch's)."""
    for key in REWARD_KEYS:
        one, two = records(runs / "one" / "reward", key), records(runs / "two" / "reward", key)
        assert one.keys() == two.keys() and len(one) >= 2, key
        for step in one:
            assert close(one[step], two[step]), (key, step, one[step], two[step])
    loss = records(runs / "one" / "reward", "loss/train")
    assert abs(loss[6] - loss[1]) > 1e-2  # the steps did change the model


def test_reward_model_ranks_agree_and_rank_0_alone_writes(runs):
    """The same weights and the same best evaluation on both ranks (the best-model decision taken alike), one
    record per step, and rank 0's saved best model."""
    two = ranks(runs / "two" / "reward")
    assert two["world_size"] == 2
    assert two["checksums"][0] == two["checksums"][1]
    assert two["returned"][0] == two["returned"][1]
    best_one, best_two = ranks(runs / "one" / "reward")["returned"][0], two["returned"][0]
    assert best_two["step"] == best_one["step"]
    for key in ("accuracy", "margin", "loss"):
        assert close(best_one[key], best_two[key]), key
    assert sorted(records(runs / "two" / "reward", "loss/train")) == list(range(1, 7))
    assert sorted(records(runs / "two" / "reward", "loss/val")) == [3, 6]
    assert (runs / "two" / "reward" / "model.safetensors").is_file()


@pytest.mark.parametrize("case", DPO_CASES)
def test_dpo_two_processes_give_the_metrics_of_one(runs, case):
    """dpo_step's loss, preference metrics and gradient norm: the one-process numbers at every step."""
    one, two = ranks(runs / "one" / case)["returned"][0], ranks(runs / "two" / case)["returned"][0]
    assert len(one) == len(two) == 6
    for step, (a, b) in enumerate(zip(one, two), start=1):
        assert a.keys() == b.keys()
        for key in a:
            assert close(a[key], b[key]), (case, step, key, a[key], b[key])
    assert one[-1]["rewards/margins"] != pytest.approx(one[0]["rewards/margins"], abs=1e-3)  # the policy moved


@pytest.mark.parametrize("case", DPO_CASES)
def test_dpo_ranks_return_the_same_metrics_and_keep_the_same_weights(runs, case):
    two = ranks(runs / "two" / case)
    assert two["world_size"] == 2
    assert two["checksums"][0] == two["checksums"][1]
    assert two["returned"][0] == two["returned"][1]  # the global batch's numbers, identical on every rank
    assert two["refused"] == [True, True]  # the bare policy (no DDP: no gradient averaging) is refused


# --- in one process


def test_pair_rows_keep_both_rows_of_each_pair_in_the_batch_layout():
    """3 pairs: rows 0-2 chosen, 3-5 rejected; pairs 1 and 2 are rows 1, 2 (chosen) and 4, 5 (rejected)."""
    ids = torch.arange(6)[:, None].expand(6, 4)  # (2N, T): row i holds i
    completion = ids[:, 1:] * 10  # (2N, T-1)
    mine = pair_rows((ids, torch.ones_like(ids), completion), slice(1, 3))
    assert mine[0][:, 0].tolist() == [1, 2, 4, 5] and mine[2][:, 0].tolist() == [10, 20, 40, 50]
    assert mine[1].shape == (4, 4)
