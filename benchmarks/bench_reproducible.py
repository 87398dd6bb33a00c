"""What the reproducible CPU mode costs, and which of its pins changes the numbers: measured in one run.

The course runs in the reproducible CPU mode (llm_from_scratch/reproducible.py): 2 threads, ATen's AVX2 kernels and
MKL's COMPATIBLE branch, so that every x86-64 CPU with AVX2 computes the same float32 sums. `--fast` leaves torch its
own choice: every core, the CPU's widest kernels, MKL's own dispatch. This script times the course's two kinds of work
in each setting, each in a fresh process (the kernel level and MKL's branch are chosen once per process):

    train   a training step of chapter 4's tiny GPT (4 layers, 128 dims, 768 tokens) on 32 × 128 tokens: forward,
            loss, backward, AdamW (pretraining, SFT, the reward model and DPO are such steps)
    sample  chapter 7's rollout: 64 completions (8 prompts × 8 samples) of 64 new tokens with the KV cache

Besides the two modes it runs each pin alone (fast + AVX2 kernels; fast + MKL COMPATIBLE), to show what each costs.
Settings alternate for --rounds rounds, so a machine that slows down slows all of them alike; a figure is the median
round. Every setting also reports a digest of the weights after its --steps training steps: the settings that share a
digest computed the same float32 numbers.

--emulate-intel (Linux, with a C compiler) repeats the digests with MKL's vendor check answered "Intel" (a two-line
shim loaded with LD_PRELOAD): on an AMD CPU it shows the numbers an Intel CPU's MKL would compute for each branch.
That is how the course chose COMPATIBLE: the AVX2 branch computes other sums on Intel than MKL's path on AMD.

    python benchmarks/bench_reproducible.py                 # 5 rounds; writes runs/bench_reproducible/result.json
    python benchmarks/bench_reproducible.py --rounds 3 --emulate-intel
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llm_from_scratch import reproducible  # noqa: E402  (stdlib only: this process never imports torch)

# name -> (what it is, the environment of its process); every setting but "reproducible" runs with LLMFS_FAST=1, so
# apply() pins nothing and the variables named here are all that differs
SETTINGS = {
    "reproducible": ("the course's mode: 2 threads, ATen AVX2, MKL COMPATIBLE", {}),
    "fast": ("torch's own choice: every core, the widest kernels, MKL's dispatch", {"LLMFS_FAST": "1"}),
    "fast + AVX2 kernels": ("the kernel level pinned alone", {"LLMFS_FAST": "1", "ATEN_CPU_CAPABILITY": "avx2"}),
    "fast + MKL COMPATIBLE": ("MKL's branch pinned alone", {"LLMFS_FAST": "1", "MKL_CBWR": "COMPATIBLE"}),
}
SHIM = "int mkl_serv_intel_cpu_true(void) { return 1; }\nint mkl_serv_intel_cpu(void) { return 1; }\n"


def child(steps: int) -> None:
    """In a fresh process: apply the mode the environment asks for, time both workloads, print one JSON line."""
    mode = reproducible.apply()
    import torch

    from llm_from_scratch.generation import generate
    from llm_from_scratch.model import GPT, GPTConfig
    from llm_from_scratch.train import TrainConfig, accumulate_gradients, configure_optimizer, optimizer_step

    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", vocab_size=768, dropout=0.0))
    optimizer = configure_optimizer(model, TrainConfig())
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 768, (32, 128), generator=g), torch.randint(0, 768, (32, 128), generator=g))
               for _ in range(4)]
    accumulate_gradients(model, [batches[0]])  # warm-up: the first step allocates
    optimizer.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    for i in range(steps):
        accumulate_gradients(model, [batches[i % 4]])
        optimizer_step(model, optimizer, 1.0)
    train_s = (time.perf_counter() - t0) / steps
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    prompts = [[int(t) for t in torch.randint(3, 768, (12,), generator=g)] for _ in range(8)] * 8  # 8 prompts × 8
    t0 = time.perf_counter()
    generate(model, prompts, max_new_tokens=64, temperature=1.0, generator=torch.Generator().manual_seed(1))
    sample_s = time.perf_counter() - t0
    print(json.dumps({"train_s": train_s, "sample_s": sample_s, "digest": digest.hexdigest()[:16], "mode": mode,
                      "record": reproducible.record()}))


def run_setting(env: dict, steps: int) -> dict:
    clean = {k: v for k, v in os.environ.items()
             if k not in (*reproducible.PINNED, "LLMFS_FAST", reproducible.MODE_VARIABLE, "LD_PRELOAD")}
    done = subprocess.run([sys.executable, __file__, "--child", "--steps", str(steps)], env={**clean, **env},
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the setting {env} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def emulated_intel(steps: int) -> dict | None:
    """The digest of each MKL branch with MKL's vendor check answered "Intel" (None without Linux or a compiler)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if not sys.platform.startswith("linux") or cc is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "shim.c").write_text(SHIM)
        subprocess.run([cc, "-shared", "-fPIC", "-o", f"{tmp}/shim.so", f"{tmp}/shim.c"], check=True)
        out = {}
        for branch in ("AUTO", "AVX2", "COMPATIBLE"):
            env = {"LLMFS_FAST": "1", "ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": branch, "LD_PRELOAD": f"{tmp}/shim.so"}
            out[branch] = run_setting({**env, "OMP_NUM_THREADS": "2"}, steps)["digest"]
        out["this CPU, COMPATIBLE"] = run_setting({"LLMFS_FAST": "1", "ATEN_CPU_CAPABILITY": "avx2",
                                                    "MKL_CBWR": "COMPATIBLE", "OMP_NUM_THREADS": "2"}, steps)["digest"]
        out["this CPU, AVX2"] = run_setting({"LLMFS_FAST": "1", "ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2",
                                             "OMP_NUM_THREADS": "2"}, steps)["digest"]
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds of every setting (default 5)")
    ap.add_argument("--steps", type=int, default=10, help="timed training steps per round (default 10)")
    ap.add_argument("--emulate-intel", action="store_true",
                    help="also the digests of MKL's branches as an Intel CPU's MKL computes them (needs cc)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_reproducible", help="where result.json goes")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        ap.error("--rounds and --steps must be ≥ 1")
    if args.child:
        return child(args.steps)
    rounds = {name: [] for name in SETTINGS}
    for r in range(args.rounds):
        for name, (_, env) in SETTINGS.items():
            rounds[name].append(run_setting(env, args.steps))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{name} {rounds[name][-1]['train_s'] * 1e3:.0f} ms/step" for name in SETTINGS), flush=True)
    median = {name: {k: statistics.median(x[k] for x in rs) for k in ("train_s", "sample_s")}
              for name, rs in rounds.items()}
    base = median["fast"]
    first = rounds["reproducible"][0]["record"]
    print(f"\n{first['cpu']} ({first['vendor']}), {os.cpu_count()} CPUs, torch {first['torch']}; median of "
          f"{args.rounds} rounds (ratio: time over the fast mode's, above 1 slower)\n")
    print("| setting | threads, kernels, BLAS | train step (ms) | × fast | 64 rollouts (s) | × fast | weights |")
    print("|---|---|---:|---:|---:|---:|---|")
    for name, rs in rounds.items():
        m, rec = median[name], rs[0]["record"]
        digests = sorted({x["digest"] for x in rs})
        print(f"| {name} | {rec['threads']}, {rec['kernel_level']}, {rec['blas']} | {m['train_s'] * 1e3:.0f} | "
              f"{m['train_s'] / base['train_s']:.2f} | {m['sample_s']:.2f} | {m['sample_s'] / base['sample_s']:.2f} "
              f"| {', '.join(digests)} |")
    result = {"machine": first, "rounds": args.rounds, "steps": args.steps, "median": median,
              "ratio": {name: {k: median[name][k] / base[k] for k in base} for name in median},
              "digests": {name: sorted({x["digest"] for x in rs}) for name, rs in rounds.items()}}
    if args.emulate_intel:
        result["emulated_intel"] = emulated_intel(args.steps)
        if result["emulated_intel"] is None:
            print("\n--emulate-intel needs Linux and a C compiler (cc): skipped")
        else:
            print("\nweights after the steps, ATen AVX2 kernels and 2 threads, by MKL branch:")
            for name, digest in result["emulated_intel"].items():
                print(f"  {name if name.startswith('this CPU') else 'MKL answering Intel, ' + name}: {digest}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "result.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
