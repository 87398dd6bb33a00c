"""Generation speed, measured in one run: the KV cache against recomputing the context, and this code
against another checkout of it.

A 4-layer, 4-head, 128-dim GPT (vocab 4,096, context 256), 128 new tokens, two kinds of batch:
  greedy    16-token prompts, temperature 0: every path must produce the same tokens (checked);
  sampled   prompts of 8-16 tokens, left-padded, temperature 1, a fixed seed: what an RL rollout does.

    python benchmarks/bench_generate.py                       # KV cache vs no cache, batch 1 and 32
    python benchmarks/bench_generate.py --against ../old      # this checkout vs another (a git worktree)
    python benchmarks/bench_generate.py --profile 32          # where one generation spends its time

--against alternates the two checkouts, one fresh process per measurement, for --rounds rounds (each side
going first in every other round), and keeps each side's fastest time: this machine's speed drifts, and
alternating exposes both to the same drift.
Make the other checkout with, e.g., `git worktree add ../old <commit>`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parents[1]


def setup(root: Path, batch: int, kind: str, prompt_tokens: int):
    """The model and prompts, built from the checkout at `root` (same seed: the same weights in every checkout)."""
    sys.path.insert(0, str(root))
    from llm_from_scratch.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=4096, context_length=256, n_layer=4, n_head=4, n_embd=128)).eval()
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, 4096, (batch, prompt_tokens), generator=g).tolist()
    if kind == "sampled":  # 8..16 tokens: a left-padded batch, as in a rollout
        prompts = [p[: 8 + i % (prompt_tokens - 7)] for i, p in enumerate(prompts)]
    return model, prompts


def timed(generate, model, prompts, new_tokens, kind, use_cache, reps):
    """The fastest of `reps` generations (seconds) and the tokens of the last one."""
    temperature = 0.0 if kind == "greedy" else 1.0
    run = lambda n: generate(model, prompts, n, temperature=temperature, use_cache=use_cache,  # noqa: E731
                             generator=torch.Generator().manual_seed(0))
    run(4)  # warm up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        out = run(new_tokens)
        best = min(best, time.perf_counter() - t0)
    return best, out.sequences


def digest(sequences: torch.Tensor) -> str:
    return hashlib.sha1(sequences.numpy().tobytes()).hexdigest()[:12]


def worker(args) -> None:
    """One measurement in this process, with the code of --worker's checkout; prints one JSON line."""
    model, prompts = setup(Path(args.worker), args.batches[0], args.kind, args.prompt_tokens)
    from llm_from_scratch.generation import generate

    seconds, seq = timed(generate, model, prompts, args.new_tokens, args.kind, True, args.reps)
    print(json.dumps({"seconds": seconds, "tokens": digest(seq), "new": int(seq.size(1) - len(max(prompts, key=len)))}))


def against(args) -> None:
    """This checkout vs another, alternating fresh processes."""
    other = Path(args.against).resolve()
    if not (other / "llm_from_scratch" / "generation.py").is_file():
        sys.exit(f"--against {args.against}: no llm_from_scratch/generation.py there "
                 f"(make one: git worktree add {args.against} <commit>)")
    print(f"this checkout: {HERE}\nagainst:       {other}\n{args.new_tokens} new tokens, KV cache, the fastest of "
          f"{args.rounds} rounds x {args.reps} runs each, the two sides alternating")
    print(f"{'kind':>8s} {'batch':>5s} {'before tok/s':>12s} {'after tok/s':>12s} {'speedup':>8s}  same tokens")
    for kind in ("greedy", "sampled"):
        for B in args.batches:
            best = {"before": float("inf"), "after": float("inf")}
            tokens = {}
            for r in range(args.rounds):
                sides = [("before", other), ("after", HERE)]
                for side, root in sides if r % 2 == 0 else sides[::-1]:  # each side goes first in every other round
                    cmd = [sys.executable, __file__, "--worker", str(root), "--kind", kind, "--batches", str(B),
                           "--reps", str(args.reps), "--new-tokens", str(args.new_tokens),
                           "--prompt-tokens", str(args.prompt_tokens)]
                    r = json.loads(subprocess.run(cmd, check=True, capture_output=True,
                                                  text=True).stdout.splitlines()[-1])
                    best[side] = min(best[side], r["seconds"])
                    tokens[side] = r["tokens"]
            n = B * args.new_tokens
            same = tokens["before"] == tokens["after"] if kind == "greedy" else "n/a (sampler changed)" \
                if tokens["before"] != tokens["after"] else True
            print(f"{kind:>8s} {B:5d} {n / best['before']:12,.0f} {n / best['after']:12,.0f} "
                  f"{best['before'] / best['after']:7.2f}x  {same}", flush=True)


def cache_vs_full(args) -> None:
    """The KV cache against re-running the whole context, greedy (the tokens must agree)."""
    from llm_from_scratch.generation import generate

    print(f"prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens, greedy, "
          f"CPU threads {torch.get_num_threads()}")
    print(f"{'batch':>5s} {'no cache (s)':>12s} {'KV cache (s)':>12s} {'tokens/s (cache)':>16s} "
          f"{'speedup':>8s}  same tokens")
    for B in args.batches:
        model, prompts = setup(HERE, B, "greedy", args.prompt_tokens)
        t_cache, seq_cache = timed(generate, model, prompts, args.new_tokens, "greedy", True, args.reps)
        t_full, seq_full = timed(generate, model, prompts, args.new_tokens, "greedy", False, args.reps)
        print(f"{B:5d} {t_full:12.3f} {t_cache:12.3f} {B * args.new_tokens / t_cache:16,.0f} {t_full / t_cache:7.1f}x  "
              f"{torch.equal(seq_cache, seq_full)}", flush=True)


def profile(args) -> None:
    """torch.profiler's table of one sampled generation with the KV cache (operators by their own CPU time)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    root = Path(args.against).resolve() if args.against else HERE
    model, prompts = setup(root, args.profile, "sampled", args.prompt_tokens)
    from llm_from_scratch.generation import generate

    timed(generate, model, prompts, 8, "sampled", True, 1)
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        generate(model, prompts, args.new_tokens, temperature=1.0, generator=torch.Generator().manual_seed(0))
    print(f"{root}: batch {args.profile}, sampled, {args.new_tokens} new tokens")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", help="batch sizes (default 1 32; with --against 32 64)")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3, help="runs per measurement; the fastest counts (default 3)")
    ap.add_argument("--against", metavar="DIR", help="another checkout of this repository to compare with")
    ap.add_argument("--rounds", type=int, default=3, help="with --against: alternations of the two sides (default 3)")
    ap.add_argument("--profile", type=int, metavar="BATCH", help="print a torch.profiler table at this batch size "
                    "(of --against's checkout when given)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--kind", default="greedy", choices=["greedy", "sampled"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    args.batches = args.batches or ([32, 64] if args.against else [1, 32])
    if args.profile:
        return profile(args)
    if args.against:
        return against(args)
    sys.path.insert(0, str(HERE))
    cache_vs_full(args)


if __name__ == "__main__":
    main()
