"""Reward-model steps: one padded batch against length-sorted chunks, measured in one run.

A reward-model step scores 2 x batch_size responses (chosen and rejected). Padded as one batch
(`data.preference_collate`), every row is as long as the longest, and the tiny world's preference stories
run from about 30 to 200 tokens. `reward_model.score_rows` sorts the rows by length and scores them in
chunks of `chunk_rows` similar rows; each reward and gradient is the same up to float rounding
(tests/test_reward_model.py).
On the training pairs and the course's tiny GPT (random weights: speed does not
depend on them), this prints the share of real (non-padding) tokens and the time of a Bradley–Terry
forward + backward per step, for each setting, and the ratio.

    python benchmarks/bench_reward_model.py
    python benchmarks/bench_reward_model.py --chunk-rows 8 --batch-size 64
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
from llm_from_scratch.data import preference_collate, tinyworld_dir  # noqa: E402
from llm_from_scratch.model import GPT, GPTConfig  # noqa: E402
from llm_from_scratch.reward_model import RewardModel, bradley_terry_loss, encode_pairs, score_rows  # noqa: E402
from llm_from_scratch.tokenizer import Tokenizer  # noqa: E402


def one_batch(rm: RewardModel, pairs: list, pad_id: int) -> tuple[torch.Tensor, int]:
    ids, mask, _ = preference_collate(pairs, pad_id)
    return rm(ids, mask), ids.numel()


def chunked(rm: RewardModel, pairs: list, pad_id: int, chunk_rows: int) -> tuple[torch.Tensor, int]:
    rows = [c for c, _ in pairs] + [r for _, r in pairs]
    lengths = sorted(len(r) for r in rows)
    padded = sum(max(lengths[k:k + chunk_rows]) * len(lengths[k:k + chunk_rows])
                 for k in range(0, len(rows), chunk_rows))
    return score_rows(rm, rows, pad_id, chunk_rows), padded


def measure(rm: RewardModel, batches: list, score) -> tuple[float, float]:
    """(share of real tokens, seconds per forward + backward) over the batches (the first is a warm-up)."""
    real = padded = 0
    for i, pairs in enumerate(batches):
        if i == 1:
            t0 = time.perf_counter()
        r, n_padded = score(pairs)
        rm.zero_grad(set_to_none=True)
        bradley_terry_loss(r[:len(pairs)], r[len(pairs):]).backward()
        if i >= 1:
            real += sum(len(c) + len(rj) for c, rj in pairs)
            padded += n_padded
    return real / padded, (time.perf_counter() - t0) / (len(batches) - 1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=24, help="steps timed per setting (default 24)")
    ap.add_argument("--batch-size", type=int, default=32, help="pairs per step (default 32, chapter 6's)")
    ap.add_argument("--chunk-rows", type=int, default=16, help="rows per chunk (default 16, train_reward_model's)")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1 or args.chunk_rows < 1:
        ap.error("--steps, --batch-size and --chunk-rows must be at least 1")
    torch.manual_seed(0)
    paths = dataset_files.ensure_datasets(tinyworld_dir(False), seed=0)
    rows = read_jsonl(paths["preferences_train"])
    tok = Tokenizer.train("".join(r["prompt"] + " " + r["chosen"] + " " for r in rows[:3000]), 768)
    rm = RewardModel(GPT(GPTConfig.preset("tiny", vocab_size=tok.vocab_size)))
    pairs = encode_pairs(tok, rows[:5000], rm.gpt.config.context_length)
    g = torch.Generator().manual_seed(0)
    batches = [[pairs[i] for i in torch.randint(0, len(pairs), (args.batch_size,), generator=g).tolist()]
               for _ in range(args.steps + 1)]
    results = {}
    for name, score in (("one padded batch", lambda p: one_batch(rm, p, tok.pad_id)),
                        (f"sorted chunks of {args.chunk_rows}", lambda p: chunked(rm, p, tok.pad_id, args.chunk_rows))):
        results[name] = measure(rm, batches, score)
        share, sec = results[name]
        print(f"{name:>20}: {share:6.1%} of the batch tokens are real, {sec * 1000:7.1f} ms per forward + backward")
    (s1, t1), (s2, t2) = results.values()
    print(f"sorted chunks: {s2 / s1:.2f}x the share of real tokens, {t1 / t2:.2f}x faster per step "
          f"({args.steps} steps of {args.batch_size} pairs, {torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
