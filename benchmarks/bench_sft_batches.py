"""SFT batches: length-grouped against plain random batches, measured in one run.

A batch is padded to its longest row, and the tiny world's tasks differ a lot in length (a worked sum is
~40 tokens, a QA prompt holds a whole story). `SFTBatches(group=16)` sorts 16 batches' worth of randomly
drawn examples by length before cutting them into batches; `group=1` is plain random batches. Both draw
every example uniformly. On the SFT training set and the course's tiny GPT (random weights: speed does
not depend on them), this prints the share of real (non-padding) tokens and the time of a forward +
backward pass per batch, and the ratio of the two settings.

    python benchmarks/bench_sft_batches.py
    python benchmarks/bench_sft_batches.py --steps 64 --batch-size 64
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llm_from_scratch import dataset_files  # noqa: E402
from llm_from_scratch.checkpoint import read_jsonl  # noqa: E402
from llm_from_scratch.data import tinyworld_dir  # noqa: E402
from llm_from_scratch.model import GPT, GPTConfig  # noqa: E402
from llm_from_scratch.sft import SFTBatches  # noqa: E402
from llm_from_scratch.tokenizer import Tokenizer  # noqa: E402
from llm_from_scratch.train import lm_loss  # noqa: E402


def measure(model, batches: SFTBatches, steps: int) -> tuple[float, float]:
    """(share of real tokens, seconds per forward + backward) over the first `steps` batches."""
    real = padded = 0
    lm_loss(model, *batches.batch(10_000)).backward()  # warm up
    t0 = time.perf_counter()
    for step in range(steps):
        x, y = batches.batch(step)
        real += sum(len(batches.examples[i][0]) - 1 for i in batches.indices(step))
        padded += x.numel()
        model.zero_grad(set_to_none=True)
        lm_loss(model, x, y).backward()
    return real / padded, (time.perf_counter() - t0) / steps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=48, help="batches timed per setting (default 48)")
    ap.add_argument("--batch-size", type=int, default=32, help="examples per batch (default 32, chapter 5's)")
    ap.add_argument("--group", type=int, default=16, help="the grouped setting's group (default 16, SFTBatches')")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    paths = dataset_files.ensure_datasets(tinyworld_dir(False), seed=0)
    rows = read_jsonl(paths["sft_train"])
    tok = Tokenizer.train("".join(r["prompt"] + " " + r["response"] + " " for r in rows[:3000]), 768)
    model = GPT(GPTConfig.preset("tiny", vocab_size=tok.vocab_size))
    results = {}
    for name, group in (("random batches", 1), (f"grouped by length ({args.group})", args.group)):
        batches = SFTBatches(tok, rows, model.config.context_length, args.batch_size, seed=0, group=group)
        results[name] = measure(model, batches, args.steps)
        share, sec = results[name]
        print(f"{name:>24}: {share:6.1%} of the batch tokens are real, {sec * 1000:7.1f} ms per forward + backward")
    (s1, t1), (s2, t2) = results.values()
    print(f"grouping: {s2 / s1:.2f}x the share of real tokens, {t1 / t2:.2f}x faster per step "
          f"({args.steps} batches of {args.batch_size}, {torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
