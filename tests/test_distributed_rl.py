"""Policy-gradient and PPO updates (pg_update, ppo_step) on 2 processes under torchrun against 1, on this CPU with gloo.

The runs are tests/ddp_rl_worker.py: every process samples the same global rollouts up front, each rank updates on
its share of the prompts' groups, and the step's metrics and the weights must be the one process's; a live case
checks that 2 ranks sampling their own prompts learn a toy task."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llm_from_scratch import distributed

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "ddp_rl_worker.py"
UPDATE_CASES = ["rloo", "grpo_kl_loss", "dapo_filtered", "reinforce_baseline", "filter_idle_rank",
                "ppo_shared_critic", "ppo_separate_critic"]


def launch(out: Path, processes: int) -> None:
    runner = [sys.executable] if processes == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                      f"--nproc_per_node={processes}"]
    env = {k: v for k, v in os.environ.items() if k not in distributed.TORCHRUN_VARIABLES}
    done = subprocess.run(runner + [str(WORKER), str(out)], env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=180)  # a rank that skips DDP's all-reduce hangs: the timeout says so
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp_rl")
    launch(root / "one", 1)
    launch(root / "two", 2)
    return root


def result(runs: Path, processes: str, case: str) -> dict:
    return json.loads((runs / processes / f"{case}.json").read_text())


# How close 1 and 2 processes can be. The rollouts are the same floats in both; each rank sums its rows' terms and the
# all-reduce adds the two halves: another order, ≲ N·6e-8 of Σ|terms| apart for N ≲ 120 tokens (a mean like the
# entropy ~5.7: ≲ 7e-6 relative). AdamW (lr 1e-2) then follows relative changes of a gradient and turns a near-zero
# one's noise into moves of up to lr·noise/eps, so after 1-3 steps the weights drift (an embedding row by ~1e-4) and
# log-probs with them: a per-sequence sum of ≤ 6 tokens (a KL) by ~1e-5 (2.5e-6 seen). REL for the large numbers (a
# gradient norm after 3 Adam steps was 1.4e-6 relative apart on another CPU in test_distributed_prefs), ABS near 0.
# The ranks' shares (3 and 2 groups) weighted 1:1 move the losses by 0.1-3 and the checksums by 3-12.
REL, ABS = 1e-4, 1e-4


@pytest.mark.parametrize("case", UPDATE_CASES)
def test_two_processes_update_as_one(runs, case):
    """Every metric of every step (the loss, the KL, the rewards and their std, the entropy, the clip fraction, the
    rows the filter kept, the gradient norm) as one process computes it on the whole batch."""
    one, two = result(runs, "one", case), result(runs, "two", case)
    assert two["world_size"] == 2 and len(one["steps"]) == len(two["steps"]) == (2 if case.startswith("ppo") else 4)
    for step, (a, b) in enumerate(zip(one["steps"], two["steps"])):
        assert a.keys() == b.keys(), (case, step)
        for name in a:
            assert b[name] == pytest.approx(a[name], rel=REL, abs=ABS), (case, step, name)
    assert two["checksums"][0] == two["checksums"][1]  # the ranks' weights stay identical
    # Σ of ~3e4 weights ≈ 100, each drifting as above: the 32 key biases (gradient 0 in exact arithmetic, noise ~1e-11
    # ≪ eps) by ≲ lr·noise/eps ≈ 1e-5 a step, the others by ≲ lr times their gradient's relative rounding: ≲ 1e-3 in
    # all (3e-4 seen; rel 1e-5 was 1e-3)
    assert two["checksums"][0] == pytest.approx(one["checksums"][0], rel=1e-4)
    if case.startswith("ppo"):  # the adaptive KL coefficient moved, and by every rank's KL alike
        # the KL (≈ 0 at the start, then < 0) stays under 0.8·target: KL/target − 1 is clipped to −0.2 whatever its
        # last bits, and the coefficient is the same float64 ops on the same numbers: equal bit for bit
        assert two["kl_coef"] == one["kl_coef"] and one["kl_coef"] != 0.05


def test_the_filter_case_drops_groups(runs):
    kept = [s["train/rows"] for s in result(runs, "one", "filter_idle_rank")["steps"]]
    assert all(k <= 12 for k in kept) and any(k > 0 for k in kept)  # rank 1's 8 rows never kept, some of rank 0's


def test_two_ranks_sampling_their_own_prompts_learn_a_toy_task(runs):
    two = result(runs, "two", "learn")
    assert two["checksums"][0] == two["checksums"][1]
    assert two["before"] < 0.3 and two["after"] > two["before"] + 0.3
