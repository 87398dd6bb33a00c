"""Generation speed: KV cache against recomputing the whole context every step, measured in one run.

16-token prompts, 128 new tokens (greedy, so both paths must produce the same tokens: checked), at
batch 1 and batch 32, on a 4-layer, 4-head, 128-dim GPT (vocab 4,096, context 256). Prints seconds,
tokens/s and the speedup ratio of the cache.

    python benchmarks/bench_generate.py
    python benchmarks/bench_generate.py --batches 1 8 64 --new-tokens 200
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llm_from_scratch.device import pick_device  # noqa: E402
from llm_from_scratch.generation import generate  # noqa: E402
from llm_from_scratch.model import GPT, GPTConfig  # noqa: E402


def timed(model, prompts, new_tokens, use_cache, device, reps):
    generate(model, prompts, 4, temperature=0, use_cache=use_cache)  # warm up
    best = float("inf")
    for _ in range(reps):  # the best of a few runs: the least disturbed by other work on the machine
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = generate(model, prompts, new_tokens, temperature=0, use_cache=use_cache)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best, out.sequences


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3, help="runs per setting; the fastest counts (default 3)")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    device = pick_device(args.device)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=4096, context_length=256, n_layer=4, n_head=4, n_embd=128)).to(device).eval()
    print(f"device {device}; prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens, greedy")
    print(f"{'batch':>5s} {'no cache (s)':>12s} {'KV cache (s)':>12s} {'tokens/s (cache)':>16s} {'speedup':>8s}  same tokens")
    for B in args.batches:
        g = torch.Generator().manual_seed(B)
        prompts = torch.randint(0, 4096, (B, args.prompt_tokens), generator=g).tolist()
        t_cache, seq_cache = timed(model, prompts, args.new_tokens, True, device, args.reps)
        t_full, seq_full = timed(model, prompts, args.new_tokens, False, device, args.reps)
        print(f"{B:5d} {t_full:12.3f} {t_cache:12.3f} {B * args.new_tokens / t_cache:16,.0f} {t_full / t_cache:7.1f}x  "
              f"{torch.equal(seq_cache, seq_full)}", flush=True)


if __name__ == "__main__":
    main()
