"""Attention speed, measured in one run: the explicit implementation against PyTorch's fused kernel.

CausalSelfAttention with attn_impl="explicit" (scores, causal mask, softmax and the product with V as separate steps,
writing the whole (B, H, T, T) weights tensor to memory and reading it back) against attn_impl="sdpa"
(torch.nn.functional.scaled_dot_product_attention: one fused kernel, FlashAttention-style on its causal path, which
never materialises that tensor). The same weights and input both ways, one forward pass, for each sequence length T.

For each T the two sides alternate for --rounds rounds of --reps timed passes each (after two warm-up passes), so a
slow moment of the machine hits both; a side's time is its fastest pass (other work on the machine can only make a
pass slower, so the minimum is the least noisy estimate). The claim is the ratio explicit / sdpa within this run and
how it grows with T, not the milliseconds, which belong to this machine and whatever else it was running. The last
column is the size of the weights tensor the explicit side materialises (float32), which grows as T^2.

Chapter 2 (chapters/ch02_attention.py) shows that the two compute the same function and tests/test_attention.py
checks it; here only the largest |explicit - sdpa| of the timed outputs is printed, as a sanity check of what was
timed. The numbers go to runs/bench_attention/result.json, the plot to runs/bench_attention/timing.png.

    python benchmarks/bench_attention.py                               # T = 64 ... 1024, B = 8, C = 128, 4 heads
    python benchmarks/bench_attention.py --lengths 32 128 --reps 2     # a quick look
    python benchmarks/bench_attention.py --device cuda --batch 32 --lengths 256 1024 4096
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llm_from_scratch.attention import CausalSelfAttention  # noqa: E402
from llm_from_scratch.checkpoint import atomic_write_text  # noqa: E402
from llm_from_scratch.course import runs_root, shown  # noqa: E402
from llm_from_scratch.device import DEVICE_CHOICES, pick_device  # noqa: E402
from llm_from_scratch.plots import line_plot  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 256, 512, 1024],
                    help="sequence lengths T to time (default 64 128 256 512 1024)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per forward pass (default 8)")
    ap.add_argument("--n-embd", type=int, default=128, help="model width C (default 128, the course's tiny GPT)")
    ap.add_argument("--heads", type=int, default=4, help="attention heads; must divide --n-embd (default 4)")
    ap.add_argument("--reps", type=int, default=5, help="timed forward passes per side in each round (default 5)")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the two sides per length (default 2)")
    ap.add_argument("--device", default="auto",
                    help=f"one of {', '.join(DEVICE_CHOICES)} (default auto: the best available)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights and inputs (default 0)")
    ap.add_argument("--out", type=Path, help="output folder (default runs/bench_attention)")
    args = ap.parse_args(argv)
    for flag in ("batch", "n_embd", "heads", "reps", "rounds"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be ≥ 1")
    if min(args.lengths) < 1:
        ap.error("--lengths must all be ≥ 1")
    if args.n_embd % args.heads:
        ap.error(f"--heads {args.heads} must divide --n-embd {args.n_embd}")
    return args


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work: a GPU kernel returns before it has finished."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    elif device.type == "mps":
        torch.mps.synchronize()


def fastest_pass(module: torch.nn.Module, x: torch.Tensor, reps: int) -> float:
    """The fastest of `reps` forward passes of `module` on x, in seconds."""
    best = float("inf")
    with torch.inference_mode():
        for _ in range(reps):
            synchronize(x.device)
            t0 = time.perf_counter()
            module(x)
            synchronize(x.device)
            best = min(best, time.perf_counter() - t0)
    return best


def measure(T: int, args, device: torch.device) -> dict:
    """One sequence length: both sides' fastest pass (ms), their ratio, the weights tensor's size, and the outputs'
    largest difference."""
    explicit = CausalSelfAttention(args.n_embd, args.heads, attn_impl="explicit").to(device).eval()
    fused = CausalSelfAttention(args.n_embd, args.heads, attn_impl="sdpa").to(device).eval()
    fused.load_state_dict(explicit.state_dict())  # the same weights in both
    x = torch.randn(args.batch, T, args.n_embd, device=device)
    with torch.inference_mode():
        max_diff = (explicit(x) - fused(x)).abs().max().item()  # also the first warm-up pass of each
        explicit(x), fused(x)
    best = {"explicit": float("inf"), "sdpa": float("inf")}
    sides = [("explicit", explicit), ("sdpa", fused)]
    for r in range(args.rounds):
        for name, module in sides if r % 2 == 0 else sides[::-1]:  # each side goes first in every other round
            best[name] = min(best[name], fastest_pass(module, x, args.reps))
    return {"explicit_ms": best["explicit"] * 1e3, "sdpa_ms": best["sdpa"] * 1e3,
            "explicit_over_sdpa": best["explicit"] / best["sdpa"],
            "weights_mb": args.batch * args.heads * T * T * 4 / 2**20, "max_abs_diff": max_diff}


def main(argv=None) -> None:
    args = parse_args(argv)
    out = args.out or runs_root(False) / "bench_attention"
    device = pick_device(args.device)
    torch.manual_seed(args.seed)
    threads = torch.get_num_threads()
    print(f"causal self-attention, one forward pass: B={args.batch}, C={args.n_embd}, {args.heads} heads, on {device} "
          f"({threads} threads), torch {torch.__version__}; the fastest of {args.rounds} rounds x {args.reps} passes, "
          "the two sides alternating")
    print(f"{'T':>6s} {'explicit (ms)':>13s} {'sdpa (ms)':>10s} {'explicit/sdpa':>13s} {'weights (MB)':>12s} "
          f"{'max |diff|':>10s}")
    rows = {}
    for T in sorted(set(args.lengths)):
        r = rows[T] = measure(T, args, device)
        print(f"{T:6d} {r['explicit_ms']:13.3f} {r['sdpa_ms']:10.3f} {r['explicit_over_sdpa']:12.2f}x "
              f"{r['weights_mb']:12.1f} {r['max_abs_diff']:10.1e}", flush=True)
    first, last = min(rows), max(rows)
    print(f"explicit/sdpa: {rows[first]['explicit_over_sdpa']:.2f}x at T={first}, "
          f"{rows[last]['explicit_over_sdpa']:.2f}x at T={last} (ratios of this run; the milliseconds are this "
          "machine's)")

    line_plot(list(rows), {"explicit": [r["explicit_ms"] for r in rows.values()],
                           "sdpa (fused)": [r["sdpa_ms"] for r in rows.values()]},
              "sequence length T", "ms per forward (fastest pass)",
              f"Causal self-attention, B={args.batch}, C={args.n_embd}, {args.heads} heads, {device.type}",
              out / "timing.png", logx=True)
    result = {"device": str(device), "threads": threads, "torch": torch.__version__, "batch": args.batch,
              "n_embd": args.n_embd, "heads": args.heads, "reps": args.reps, "rounds": args.rounds, "seed": args.seed,
              "rows": {str(T): r for T, r in rows.items()},
              "command": "python benchmarks/bench_attention.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    atomic_write_text(out / "result.json", json.dumps(result, indent=2))
    print(f"saved {shown(out / 'result.json')} and {shown(out / 'timing.png')}")


if __name__ == "__main__":
    main()
