"""A few training steps of a tiny GPT per case, run by tests/test_distributed.py as one process or under torchrun.

    python tests/ddp_worker.py OUT [CASE ...]
    torchrun --standalone --nproc_per_node=2 tests/ddp_worker.py OUT [CASE ...]

Each case trains into OUT/<case>/ with train.train(); rank 0 then writes OUT/<case>/ranks.json with every rank's
checksum of its final weights. LLMFS_TEST_CRASH_AT=s makes rank 1 fail when it asks for step s's batch (a killed
run, to be resumed by running the same command again): rank 0 then waits in step s's all-reduce, after it has
written the checkpoint of step s - 1, until torchrun stops it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llm_from_scratch import distributed  # noqa: E402
from llm_from_scratch.model import GPT, GPTConfig  # noqa: E402
from llm_from_scratch.train import TrainConfig, train  # noqa: E402

B, T, V = 8, 16, 64  # the global batch: 8 rows of 16 tokens
CASES = {  # name: (micro-batches per step, targets masked unevenly between the rows, dropout)
    "lm": (1, False, 0.0),
    "lm_accum": (2, False, 0.0),
    "sft_accum": (2, True, 0.0),
    "dropout": (2, True, 0.2),  # each rank its own dropout masks: for the resume test, not for 1 against 2 processes
}


def batch_maker(masked: bool, grad_accum: int):
    crash_at = int(os.environ.get("LLMFS_TEST_CRASH_AT", "-1"))

    def get_batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i // grad_accum == crash_at and distributed.rank() == 1:
            raise RuntimeError(f"killed at step {crash_at} (LLMFS_TEST_CRASH_AT)")
        g = torch.Generator().manual_seed(1000 + i)
        x = torch.randint(0, V, (B, T), generator=g)  # (B, T)
        y = (x + 1) % V  # something to learn: the first rows (rank 0's under 2 processes) "add one",
        y[B // 2:] = (3 * x[B // 2:]) % V  # the last rows (rank 1's) "times three"
        if masked:  # like SFT's prompts: the first rows keep every target, the last rows only their last 2
            y[B // 2:, : T - 2] = -100  # so rank 0 holds 7 times the targets of rank 1
        return x, y

    return get_batch


def main() -> None:
    out, cases = Path(sys.argv[1]), sys.argv[2:] or list(CASES)  # "dropout" runs only when named
    device = distributed.setup("cpu")
    for case in cases:
        grad_accum, masked, dropout = CASES[case]
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=V, context_length=T, n_layer=2, n_head=2, n_embd=32, dropout=dropout))
        model = model.to(device)
        cfg = TrainConfig(max_steps=6, batch_size=B, grad_accum=grad_accum, lr=3e-2, min_lr=3e-3, warmup_steps=2,
                          eval_interval=3, eval_batches=3, log_interval=1, checkpoint_interval=3)
        val = [batch_maker(masked, 1)(10_000 + i) for i in range(3)]  # 3 batches: the ranks share them unevenly
        train(model, cfg, batch_maker(masked, grad_accum), lambda: val, out / case, quiet=True)
        checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
        checksums = distributed.all_gather_objects(checksum)
        if distributed.is_main():
            (out / case / "ranks.json").write_text(json.dumps({"world_size": distributed.world_size(),
                                                               "checksums": checksums}))
    distributed.cleanup()


if __name__ == "__main__":
    main()
