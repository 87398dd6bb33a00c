"""The default training step of this working tree against the same step of an earlier commit, side by side.

The step is what `train.train` runs for every optimizer step: `accumulate_gradients` (forward, loss, backward) and
`optimizer_step` (clipping, AdamW), built by each code base's own `GPT` and `configure_optimizer`, after the process
set-up that side's `train.train` does first (since this commit, `device.keep_freed_memory`). The default shapes are
the issue's: float32, 4 layers, 128 dims, 4 heads, context 128, vocabulary 4,096, batch 32 (--vocab, --context,
--batch and --layers change them). Each side also reports its process's peak resident memory (VmHWM).

Each side runs in a fresh process that imports its own copy of the package (the earlier commit is exported with
`git archive` into a temporary folder); the sides alternate for --rounds rounds, so a machine that slows down during
the run slows both alike. Each round warms up, then times --steps steps; a side's figure is its median round. The
ratio is this tree's tokens per second over the earlier commit's: above 1, this tree is faster.

    python benchmarks/bench_step_vs_checkout.py                   # against HEAD (uncommitted changes vs. last commit)
    python benchmarks/bench_step_vs_checkout.py --baseline d81946a --rounds 7
    python benchmarks/bench_step_vs_checkout.py --baseline d81946a --vocab 50257 --context 256 --batch 4 --layers 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
def peak_mib() -> float:
    """This process's peak resident memory so far (Linux's VmHWM), in MiB; nan elsewhere."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return float("nan")
    return int(status.split("VmHWM:")[1].split()[0]) / 1024


def child(package_root: str, steps: int, warmup: int, shape: dict, batch: int) -> None:
    """Time the training step of the package in `package_root`; print one JSON line."""
    sys.path.insert(0, package_root)
    import torch

    from llm_from_scratch import train
    from llm_from_scratch.model import GPT, GPTConfig
    from llm_from_scratch.train import TrainConfig, accumulate_gradients, configure_optimizer, optimizer_step

    if hasattr(train, "keep_freed_memory"):  # what this side's train.train() does before its first step
        train.keep_freed_memory()
    torch.manual_seed(0)
    model = GPT(GPTConfig(**shape))
    optimizer = configure_optimizer(model, TrainConfig())
    g = torch.Generator().manual_seed(0)
    V, T = shape["vocab_size"], shape["context_length"]
    batches = [(torch.randint(0, V, (batch, T), generator=g), torch.randint(0, V, (batch, T), generator=g))
               for _ in range(4)]
    for i in range(warmup):
        accumulate_gradients(model, [batches[i % 4]])
        optimizer_step(model, optimizer, 1.0)
    t0 = time.perf_counter()
    for i in range(steps):
        loss, _ = accumulate_gradients(model, [batches[i % 4]])
        optimizer_step(model, optimizer, 1.0)
    seconds = (time.perf_counter() - t0) / steps
    print(json.dumps({"tokens_per_s": batch * T / seconds, "seconds_per_step": seconds, "peak_mib": peak_mib(),
                      "loss": loss, "threads": torch.get_num_threads(), "torch": torch.__version__}))


def run_side(package_root: Path, args) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", str(package_root), "--steps", str(args.steps),
                           "--warmup", str(args.warmup), "--vocab", str(args.vocab), "--context", str(args.context),
                           "--batch", str(args.batch), "--layers", str(args.layers)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the step of {package_root} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def export(ref: str, folder: Path) -> str:
    """The package as it was at `ref`, into `folder`; returns the commit's short hash."""
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", ref], capture_output=True, text=True)
    if commit.returncode != 0:
        raise SystemExit(f"error: --baseline {ref!r} is not a commit of {ROOT}")
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "llm_from_scratch"], capture_output=True,
                             check=True)
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    return commit.stdout.strip()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default="HEAD", help="the earlier commit (default HEAD)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds per side (default 5)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per round (default 10)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    ap.add_argument("--vocab", type=int, default=4096, help="vocabulary size (default 4096)")
    ap.add_argument("--context", type=int, default=128, help="tokens per row (default 128)")
    ap.add_argument("--batch", type=int, default=32, help="rows per step (default 32)")
    ap.add_argument("--layers", type=int, default=4, help="blocks of 128 dims and 4 heads (default 4)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if min(args.rounds, args.steps, args.vocab, args.context, args.batch, args.layers) < 1 or args.warmup < 0:
        ap.error("--rounds, --steps, --vocab, --context, --batch and --layers must be ≥ 1, --warmup ≥ 0")
    shape = dict(vocab_size=args.vocab, context_length=args.context, n_layer=args.layers, n_head=4, n_embd=128)
    if args.child:
        return child(args.child, args.steps, args.warmup, shape, args.batch)
    with tempfile.TemporaryDirectory() as tmp:
        commit = export(args.baseline, Path(tmp))
        sides = {f"baseline {commit}": Path(tmp), "this tree": ROOT}
        rounds = {name: [] for name in sides}
        for r in range(args.rounds):
            for name, root in sides.items():
                rounds[name].append(run_side(root, args))
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{name} {rounds[name][-1]['tokens_per_s']:,.0f} tok/s" for name in sides), flush=True)
    median = {name: statistics.median(x["tokens_per_s"] for x in rs) for name, rs in rounds.items()}
    peak = {name: max(x["peak_mib"] for x in rs) for name, rs in rounds.items()}
    base, this = f"baseline {commit}", "this tree"
    ratios = [b["tokens_per_s"] / a["tokens_per_s"] for a, b in zip(rounds[base], rounds[this])]
    print(f"\n{args.layers} layers, vocabulary {args.vocab:,}, batch {args.batch} × {args.context} tokens; median of "
          f"{args.rounds} rounds ({rounds[this][0]['threads']} threads, torch {rounds[this][0]['torch']}): "
          f"{base} {median[base]:,.0f} tok/s, {this} {median[this]:,.0f} tok/s: **{median[this] / median[base]:.3f}×** "
          f"(rounds {min(ratios):.2f}–{max(ratios):.2f}×); peak memory {peak[base]:,.0f} → {peak[this]:,.0f} MiB")
    same_loss = rounds[this][-1]["loss"] == rounds[base][-1]["loss"]
    print(f"the last timed step's loss is {'the same, bit for bit' if same_loss else 'different'} on both sides")
    return {"baseline": commit, "tokens_per_s": median, "ratio": median[this] / median[base], "peak_mib": peak,
            "same_loss": same_loss}


if __name__ == "__main__":
    main()
