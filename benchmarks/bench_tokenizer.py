"""Tokenizer speed, measured in one run on one corpus (ratios, not absolute times, are the claim).

1. BPE training: the fast trainer (distinct chunks counted once, incremental pair counts, lazy heap)
   against the naive one (recount every pair of the corpus before each merge). Both must learn
   identical merges; the script checks it.
2. Encoding throughput: tiktoken (Rust) against our pure-Python reference encoder, same ranks, same
   pattern, same tokens (checked).

    python benchmarks/bench_tokenizer.py   # ~1 MB of the Python stdlib, vocab 4096 (naive: many minutes)
    python benchmarks/bench_tokenizer.py --chars 100000 --vocab-size 1024   # a quick look
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llm_from_scratch.data import python_stdlib_text, read_text  # noqa: E402
from llm_from_scratch.tokenizer import (  # noqa: E402
    GPT2_SPLIT_PATTERN,
    Tokenizer,
    bpe_encode,
    learn_merges,
    learn_merges_naive,
    ranks_from_merges,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chars", type=int, default=1_000_000, help="corpus size in characters (default 1,000,000)")
    ap.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size (default 4096)")
    ap.add_argument("--text", type=Path, help="a UTF-8 file to use instead of the Python standard library's sources")
    ap.add_argument("--encode-chars", type=int, default=200_000, help="characters to encode for the throughput test")
    args = ap.parse_args()

    text = read_text(args.text)[: args.chars] if args.text else python_stdlib_text(args.chars)
    print(f"corpus: {len(text):,} chars ({len(text.encode()):,} bytes), vocab {args.vocab_size}, GPT-2 split pattern")

    # wall time and this process's CPU time: on a shared machine the CPU time is the steadier of the two
    t0, c0 = time.perf_counter(), time.process_time()
    fast = learn_merges(text, args.vocab_size, GPT2_SPLIT_PATTERN, progress=True)
    t_fast, c_fast = time.perf_counter() - t0, time.process_time() - c0
    print(f"fast trainer : {t_fast:8.2f} s wall, {c_fast:8.2f} s CPU  ({len(fast)} merges)", flush=True)

    t0, c0 = time.perf_counter(), time.process_time()
    naive = learn_merges_naive(text, args.vocab_size, GPT2_SPLIT_PATTERN)
    t_naive, c_naive = time.perf_counter() - t0, time.process_time() - c0
    print(f"naive trainer: {t_naive:8.2f} s wall, {c_naive:8.2f} s CPU  ({len(naive)} merges)")
    same = naive == fast
    print(f"identical merges: {same}")
    print(f"BPE training speedup (naive / fast): {t_naive / t_fast:.1f}x wall, {c_naive / c_fast:.1f}x CPU")

    ranks = ranks_from_merges(fast)
    tok = Tokenizer.from_ranks(ranks, pattern=GPT2_SPLIT_PATTERN)
    sample = text[: args.encode_chars]
    t0 = time.perf_counter()
    ours = bpe_encode(sample, ranks, GPT2_SPLIT_PATTERN)
    t_py = time.perf_counter() - t0
    reps = 20
    t0 = time.perf_counter()
    for _ in range(reps):
        theirs = tok.encode(sample)
    t_tt = (time.perf_counter() - t0) / reps
    print(f"encode {len(sample):,} chars -> {len(ours):,} tokens ({len(sample.encode()) / len(ours):.2f} bytes/token)")
    print(f"pure-Python encoder: {len(ours) / t_py:12,.0f} tokens/s")
    print(f"tiktoken           : {len(theirs) / t_tt:12,.0f} tokens/s")
    print(f"same tokens: {ours == theirs}")
    print(f"encode speedup (tiktoken / pure Python): {t_py / t_tt:.1f}x")
    if not same or ours != theirs:
        sys.exit("MISMATCH: the two trainers or the two encoders disagree")


if __name__ == "__main__":
    main()
