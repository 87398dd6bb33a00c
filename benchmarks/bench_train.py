"""Training throughput and model FLOPs utilisation (MFU), measured in one run.

For each model shape, attention implementation (explicit / sdpa), precision (fp32 / bf16 autocast) and
mode (eager / torch.compile) it times full training steps (forward + backward + AdamW) and prints
tokens/s and achieved GFLOP/s, with FLOPs per token from GPT.flops_per_token() (6N + 12·L·C·T).
MFU is achieved GFLOP/s over this machine's own torch.mm peak in the same precision, measured at the
start of the same run; the ratio column compares each setting with fp32 eager explicit attention.

    python benchmarks/bench_train.py                 # both shapes, every setting (several minutes on 2 cores)
    python benchmarks/bench_train.py --shapes a --no-compile
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llm_from_scratch.device import autocast, pick_device  # noqa: E402
from llm_from_scratch.model import GPT, GPTConfig  # noqa: E402
from llm_from_scratch.train import TrainConfig, configure_optimizer, lm_loss  # noqa: E402

SHAPES = {
    "a": dict(cfg=dict(vocab_size=4096, context_length=128, n_layer=4, n_head=4, n_embd=128), batch=32),
    "b": dict(cfg=dict(vocab_size=4096, context_length=256, n_layer=6, n_head=6, n_embd=384), batch=16),
}


def matmul_gflops(device, dtype, n=1024, reps=10) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e9


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_setting(shape: dict, impl: str, dtype: torch.dtype | None, compile_: bool, device, steps: int, warmup: int):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**shape["cfg"], attn_impl=impl)).to(device)
    opt = configure_optimizer(model, TrainConfig())
    fwd = torch.compile(model) if compile_ else model
    B, T, V = shape["batch"], shape["cfg"]["context_length"], shape["cfg"]["vocab_size"]
    x = torch.randint(0, V, (B, T), device=device)
    y = torch.randint(0, V, (B, T), device=device)

    def step():
        with autocast(device, dtype):
            loss = lm_loss(fwd, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(warmup):  # includes compilation
        step()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    loss.item()
    sync(device)
    seconds = (time.perf_counter() - t0) / steps
    tokens_per_s = B * T / seconds
    return tokens_per_s, tokens_per_s * model.flops_per_token(T) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="ab", help="which shapes to run: a, b or ab (default ab)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per setting (default 10)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile settings")
    ap.add_argument("--no-bf16", action="store_true", help="skip the bf16 autocast settings")
    args = ap.parse_args()
    device = pick_device(args.device)
    print(f"device: {device}, torch {torch.__version__}, {torch.get_num_threads()} threads")

    peak = {"fp32": matmul_gflops(device, torch.float32)}
    if not args.no_bf16:
        peak["bf16"] = matmul_gflops(device, torch.bfloat16, reps=2 if device.type == "cpu" else 10)
    print("torch.mm 1024x1024 peak: " + ", ".join(f"{k} {v:,.1f} GFLOP/s" for k, v in peak.items()))

    for name in args.shapes:
        shape = SHAPES[name]
        c = shape["cfg"]
        print(f"\n({name}) {c['n_layer']} layers, {c['n_head']} heads, {c['n_embd']} dims, "
              f"context {c['context_length']}, vocab {c['vocab_size']}, batch {shape['batch']}")
        print(f"{'attention':9s} {'precision':9s} {'mode':8s} {'tokens/s':>10s} {'GFLOP/s':>8s} {'MFU':>6s} "
              f"{'vs fp32 eager explicit':>23s}")
        base = None
        for compile_ in ([False] if args.no_compile else [False, True]):
            for prec in (["fp32"] if args.no_bf16 else ["fp32", "bf16"]):
                for impl in ("explicit", "sdpa"):
                    dtype = torch.bfloat16 if prec == "bf16" else None
                    if prec == "bf16" and peak["bf16"] < 0.5 * peak["fp32"]:
                        # this processor emulates bf16 matmuls: a training step would take minutes and cannot win
                        print(f"{impl:9s} {prec:9s} {'compile' if compile_ else 'eager':8s} skipped: "
                              f"bf16 torch.mm runs at {peak['bf16'] / peak['fp32']:.0%} of fp32 speed on this device")
                        continue
                    tps, gflops = bench_setting(shape, impl, dtype, compile_, device, args.steps,
                                                warmup=3 if compile_ else 2)
                    base = base or tps
                    print(f"{impl:9s} {prec:9s} {'compile' if compile_ else 'eager':8s} {tps:10,.0f} {gflops:8.1f} "
                          f"{gflops / peak[prec]:6.1%} {tps / base:22.2f}x", flush=True)


if __name__ == "__main__":
    main()
