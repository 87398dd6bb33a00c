"""Training throughput and model FLOPs utilisation (MFU), measured in one run.

For each model shape, attention implementation (explicit / sdpa), precision (fp32 / bf16 autocast) and
mode (eager / torch.compile) it times full training steps (forward + backward + AdamW) and prints
tokens/s and achieved GFLOP/s, with FLOPs per token from GPT.flops_per_token() (6N + 12·L·C·T).
MFU is achieved GFLOP/s over this machine's own torch.mm peak in the same precision, measured at the
start of the same run; the ratio column compares each setting with the first one (fp32 eager explicit attention).

On a CUDA GPU a second MFU column divides by the GPU's dense bf16 tensor-core peak from NVIDIA's datasheets
(GPU_PEAK_BF16; the usual convention, as in the PaLM paper and nanoGPT, whatever precision the row ran in), or by
--peak-tflops; a GPU not in the table prints "unknown GPU: pass --peak-tflops". On a GPU, float32 matmuls run in
TF32 (device.allow_tf32), the fp32 rows included.

    python benchmarks/bench_train.py                 # both shapes, every setting (several minutes on 2 cores)
    python benchmarks/bench_train.py --shapes a --no-compile
    python benchmarks/bench_train.py --device cuda --preset gpt2-124m --no-fp32 --impls sdpa   # eager and compiled
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llm_from_scratch.device import autocast, pick_device  # noqa: E402
from llm_from_scratch.model import GPT, PRESETS, GPTConfig  # noqa: E402
from llm_from_scratch.train import TrainConfig, configure_optimizer, lm_loss  # noqa: E402

SHAPES = {
    "a": dict(cfg=dict(vocab_size=4096, context_length=128, n_layer=4, n_head=4, n_embd=128), batch=32),
    "b": dict(cfg=dict(vocab_size=4096, context_length=256, n_layer=6, n_head=6, n_embd=384), batch=16),
}

# dense (no sparsity) bf16 tensor-core peaks in FLOP/s, from NVIDIA's datasheets; matched as whole words in
# torch.cuda.get_device_name(), the first match wins (so "H100 PCIe" before "H100": the SXM part reads
# "NVIDIA H100 80GB HBM3")
GPU_PEAK_BF16 = [
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM
    ("H200", 989e12),
    ("A100", 312e12),
    ("L4", 121e12),  # not the L40 or L40S: whole words only
    ("RTX 4090", 165e12),
]


def gpu_peak_flops(name: str) -> float | None:
    """The dense bf16 peak (FLOP/s) of the GPU called `name` (torch.cuda.get_device_name()), None when unknown."""
    for pattern, peak in GPU_PEAK_BF16:
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(pattern)}(?![A-Za-z0-9])", name, flags=re.IGNORECASE):
            return peak
    return None


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: the FLOP/s the model's arithmetic needs at this speed over the hardware's peak.
    flops_per_token: training FLOPs per token, GPT.flops_per_token() = 6 N + 12 L C T (forward and backward)."""
    return tokens_per_s * flops_per_token / peak_flops


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
    """Time this setting's training step -> (tokens/s, achieved GFLOP/s, training FLOPs per token)."""
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
    flops_per_token = model.flops_per_token(T)
    return tokens_per_s, tokens_per_s * flops_per_token / 1e9, flops_per_token


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="ab", help="which shapes to run: a, b or ab (default ab)")
    ap.add_argument("--preset", choices=list(PRESETS),
                    help="run this model preset (model.PRESETS; vocab 4096 where it names none) instead of --shapes")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step with --preset (default 8)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per setting (default 10)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile settings")
    ap.add_argument("--no-bf16", action="store_true", help="skip the bf16 autocast settings")
    ap.add_argument("--no-fp32", action="store_true", help="skip the fp32 settings")
    ap.add_argument("--impls", default="explicit,sdpa", help="attention implementations (default explicit,sdpa)")
    ap.add_argument("--peak-tflops", type=float,
                    help="the accelerator's peak in TFLOP/s for the second MFU column (default on CUDA: the "
                         "GPU's dense bf16 peak from GPU_PEAK_BF16)")
    args = ap.parse_args(argv)
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    if not impls or set(impls) - {"explicit", "sdpa"}:
        ap.error(f"--impls: a comma-separated list of explicit and sdpa, got {args.impls!r}")
    precisions = [p for p, off in (("fp32", args.no_fp32), ("bf16", args.no_bf16)) if not off]
    if not precisions:
        ap.error("--no-fp32 and --no-bf16 together leave nothing to run")
    device = pick_device(args.device)
    print(f"device: {device}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    spec_peak = args.peak_tflops * 1e12 if args.peak_tflops else None
    if device.type == "cuda" and spec_peak is None:
        gpu = torch.cuda.get_device_name(device)
        spec_peak = gpu_peak_flops(gpu)
        print(f"GPU: {gpu}: " + (f"dense bf16 peak {spec_peak / 1e12:,.0f} TFLOP/s (datasheet)" if spec_peak
                                 else "unknown GPU: pass --peak-tflops for MFU against its peak"))

    peak = {"fp32": matmul_gflops(device, torch.float32)}
    if not args.no_bf16:
        peak["bf16"] = matmul_gflops(device, torch.bfloat16, reps=2 if device.type == "cpu" else 10)
    print("torch.mm 1024x1024 peak: " + ", ".join(f"{k} {v:,.1f} GFLOP/s" for k, v in peak.items()))

    if args.preset:
        shapes = {args.preset: dict(cfg={"vocab_size": 4096, **PRESETS[args.preset]}, batch=args.batch)}
    else:
        shapes = {name: SHAPES[name] for name in args.shapes}
    first = f"{precisions[0]} eager {impls[0]}"  # the first setting run: the ratio column's base
    for name, shape in shapes.items():
        c = shape["cfg"]
        print(f"\n({name}) {c['n_layer']} layers, {c['n_head']} heads, {c['n_embd']} dims, "
              f"context {c['context_length']}, vocab {c['vocab_size']}, batch {shape['batch']}")
        print(f"{'attention':9s} {'precision':9s} {'mode':8s} {'tokens/s':>10s} {'GFLOP/s':>8s} {'MFU':>6s} "
              f"{'vs ' + first:>23s}" + (f" {'MFU/peak':>8s}" if spec_peak else ""))
        base = None
        for compile_ in ([False] if args.no_compile else [False, True]):
            for prec in precisions:
                for impl in impls:
                    dtype = torch.bfloat16 if prec == "bf16" else None
                    if prec == "bf16" and peak["bf16"] < 0.5 * peak["fp32"]:
                        # this processor emulates bf16 matmuls: a training step would take minutes and cannot win
                        print(f"{impl:9s} {prec:9s} {'compile' if compile_ else 'eager':8s} skipped: "
                              f"bf16 torch.mm runs at {peak['bf16'] / peak['fp32']:.0%} of fp32 speed on this device")
                        continue
                    tps, gflops, per_token = bench_setting(shape, impl, dtype, compile_, device, args.steps,
                                                           warmup=3 if compile_ else 2)
                    base = base or tps
                    at_peak = f" {mfu(tps, per_token, spec_peak):8.1%}" if spec_peak else ""
                    print(f"{impl:9s} {prec:9s} {'compile' if compile_ else 'eager':8s} {tps:10,.0f} {gflops:8.1f} "
                          f"{gflops / peak[prec]:6.1%} {tps / base:22.2f}x{at_peak}", flush=True)


if __name__ == "__main__":
    main()
