"""DPO with cached reference log-probs against a live reference model: steps per second and peak memory, in one run.

The same model, data and batch both ways. A live reference scores every batch again (one forward pass over the 2N
rows, no graph); a cached one was scored once before training and stored, so training holds the policy alone.

- Speed: one process builds a policy and a reference of the --preset size (random weights: speed does not depend
  on their values), then times --steps DPO steps with the live reference and --steps with the cached log-probs,
  the two alternating for --rounds rounds so that a slow moment of the machine hits both. The ratio of the
  fastest rounds is the speed-up (the ideal is about 4/3: the policy's forward and backward cost about three
  forward passes, the reference's one).
- Memory: each mode trains --memory-steps steps in a fresh process. On a CPU the peak resident set size
  (VmHWM) is compared with the process's RSS just before any model was built, with glibc's mmap threshold
  fixed at 1 MiB so that freed tensors leave the resident set (otherwise it measures the heap's fragmentation); on CUDA,
  torch.cuda.max_memory_allocated. The cached process reads the log-probs from a file written beforehand (as
  chapter 9 stores them in its run folder) and never builds a reference. The saving, live minus cached, is set
  against the reference's weight bytes, the most that releasing it can give.

Measure at a preset where weights dominate memory (gpt2-124m, the default, or small), not at tiny, where the Python
runtime dwarfs the model. The numbers go to runs/bench_dpo/result.json (notebook 09 reads them).

    python benchmarks/bench_dpo.py                       # gpt2-124m, 2 pairs per step
    python benchmarks/bench_dpo.py --preset small --pairs 8
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llm_from_scratch import preferences  # noqa: E402
from llm_from_scratch.checkpoint import atomic_write_text, load_tensors, save_tensors
from llm_from_scratch.course import runs_root, shown  # noqa: E402
from llm_from_scratch.device import pick_device  # noqa: E402
from llm_from_scratch.dpo import DPOConfig, dpo_step, frozen_logps, preference_batch, reference_logps  # noqa: E402
from llm_from_scratch.model import GPT, PRESETS, GPTConfig  # noqa: E402
from llm_from_scratch.tokenizer import Tokenizer  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="gpt2-124m", choices=["tiny", "small", "gpt2-124m", "gpt2-medium"],
                    help="model size (default gpt2-124m: 124M parameters with GPT-2's vocabulary)")
    ap.add_argument("--pairs", type=int, default=2, help="preference pairs per step (default 2)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per mode in each round (default 3)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of the speed test (default 3)")
    ap.add_argument("--memory-steps", type=int, default=3, help="steps of each memory process (default 3)")
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda or mps (default auto)")
    ap.add_argument("--out", type=Path, help="output folder (default runs/bench_dpo)")
    ap.add_argument("--memory-child", choices=["live", "cached"], help=argparse.SUPPRESS)  # internal: one memory run
    args = ap.parse_args(argv)
    for flag in ("pairs", "steps", "rounds", "memory_steps"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be ≥ 1")
    return args


def data(n_batches: int, pairs: int) -> tuple[Tokenizer, list[list[dict]]]:
    """A tokenizer trained here on the tiny world's pairs (seconds), and n_batches batches of real pairs."""
    rows = preferences.preference_pairs(n_batches * pairs + 200, seed="bench_dpo")
    text = "\n".join(p["prompt"] + " " + p["chosen"] + " " + p["rejected"] for p in rows[:200])
    tok = Tokenizer.train(text, 512)
    return tok, [rows[200 + i * pairs:200 + (i + 1) * pairs] for i in range(n_batches)]


def build(preset: str, vocab_size: int, device, seed: int = 0) -> GPT:
    """A GPT of the preset's size; GPT-2 presets keep their 50,257-token vocabulary (ours fits inside it)."""
    torch.manual_seed(seed)
    overrides = {} if "vocab_size" in PRESETS[preset] else {"vocab_size": vocab_size}
    return GPT(GPTConfig.preset(preset, dropout=0.0, **overrides)).to(device)


def weight_bytes(model: GPT) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def proc_status(field: str) -> int | None:
    """A memory field of /proc/self/status in bytes (Linux), or None."""
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return None


def rss_now() -> int:
    """Resident set size in bytes (Linux; elsewhere the peak so far, the best the OS reports)."""
    return proc_status("VmRSS") or rss_peak()


def rss_peak() -> int:
    """Peak resident set size in bytes: VmHWM on Linux, which belongs to this address space alone (getrusage's
    ru_maxrss survives exec, so a child would report its parent's peak); ru_maxrss elsewhere."""
    hwm = proc_status("VmHWM")
    if hwm is not None:
        return hwm
    import resource
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def memory_child(args) -> None:
    """One mode's memory: train --memory-steps steps and print the peak rise over the baseline as JSON."""
    device = pick_device(args.device)
    tok, batches = data(args.memory_steps, args.pairs)
    batches = [tuple(t.to(device) for t in preference_batch(tok, b)) for b in batches]
    cache = load_tensors(args.out / "reference_logps.safetensors")["logps"] if args.memory_child == "cached" else None
    gc.collect()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated() if cuda else rss_now()
    policy = build(args.preset, tok.vocab_size, device)
    reference = build(args.preset, tok.vocab_size, device).requires_grad_(False) if cache is None else None
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-5)
    for i, batch in enumerate(batches):
        if reference is not None:
            ref_c, ref_r = frozen_logps(reference, *batch)
        else:
            ref_c, ref_r = cache[i * args.pairs:(i + 1) * args.pairs].to(device).unbind(1)
        dpo_step(policy, optimizer, batch, ref_c, ref_r, DPOConfig())
    peak = torch.cuda.max_memory_allocated() if cuda else rss_peak()
    print(json.dumps({"mode": args.memory_child, "baseline": baseline, "peak": peak, "rise": peak - baseline}))


def memory(args, out: Path) -> dict:
    """Both memory processes; the cache they read is computed first, here, by the reference."""
    tok, batches = data(args.memory_steps, args.pairs)
    device = pick_device(args.device)
    reference = build(args.preset, tok.vocab_size, device).requires_grad_(False)
    ref_bytes = weight_bytes(reference)
    logps = reference_logps(reference, tok, [p for b in batches for p in b], batch_size=args.pairs)
    save_tensors(out / "reference_logps.safetensors", {"logps": logps})
    del reference
    result = {"reference_weight_bytes": ref_bytes}
    for mode in ("live", "cached"):
        cmd = [sys.executable, __file__, "--memory-child", mode, "--preset", args.preset, "--pairs", str(args.pairs),
               "--memory-steps", str(args.memory_steps), "--device", args.device, "--out", str(out)]
        # glibc raises its mmap threshold after a large block is freed, so later large tensors come from the heap, which
        # it rarely returns: the resident set then tracks fragmentation more than live tensors. A fixed threshold keeps
        # every tensor over 1 MiB in its own mapping, returned when freed.
        env = dict(os.environ, PYTHONUNBUFFERED="1", MALLOC_MMAP_THRESHOLD_=str(2**20))
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            sys.exit(f"bench_dpo: the {mode} memory process failed:\n{done.stderr}")
        result[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    result["saving_bytes"] = result["live"]["rise"] - result["cached"]["rise"]
    result["saving_share_of_reference_weights"] = result["saving_bytes"] / ref_bytes
    return result


def speed(args) -> dict:
    """Alternating rounds of --steps live-reference steps and --steps cached steps on one policy."""
    device = pick_device(args.device)
    tok, pairs = data(args.steps, args.pairs)
    batches = [tuple(t.to(device) for t in preference_batch(tok, b)) for b in pairs]
    policy = build(args.preset, tok.vocab_size, device)
    reference = build(args.preset, tok.vocab_size, device).requires_grad_(False)
    cache = [frozen_logps(reference, *b) for b in batches]  # what the cached mode reads
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-5)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def run(live: bool) -> float:
        sync()
        t0 = time.perf_counter()
        for batch, cached in zip(batches, cache):
            ref_c, ref_r = frozen_logps(reference, *batch) if live else cached
            dpo_step(policy, optimizer, batch, ref_c, ref_r, DPOConfig())
        sync()
        return (time.perf_counter() - t0) / len(batches)

    run(True), run(False)  # warm-up: the allocator, the kernels
    times = {"live": [], "cached": []}
    for r in range(args.rounds):
        for mode in (("live", "cached") if r % 2 == 0 else ("cached", "live")):  # each goes first in every other round
            times[mode].append(run(mode == "live"))
            print(f"round {r + 1}: {mode:6s} {times[mode][-1]:.3f} s per step", flush=True)
    fastest = {k: min(v) for k, v in times.items()}
    return {"seconds_per_step": times, "fastest": fastest, "speedup": fastest["live"] / fastest["cached"],
            "rows_per_step": 2 * args.pairs, "tokens_per_row": batches[0][0].shape[1],
            "params": sum(p.numel() for p in policy.parameters())}


def main(argv=None) -> None:
    args = parse_args(argv)
    args.out = args.out or runs_root(False) / "bench_dpo"
    if args.memory_child:
        return memory_child(args)
    args.out.mkdir(parents=True, exist_ok=True)
    device = pick_device(args.device)
    torch_threads = torch.get_num_threads()
    print(f"DPO at the {args.preset} preset on {device} ({torch_threads} threads), {args.pairs} pairs per step")
    sp = speed(args)
    mem = memory(args, args.out)
    mb = lambda b: f"{b / 2**20:,.0f} MiB"  # noqa: E731
    print(f"\n{sp['params'] / 1e6:.1f} M parameters, {sp['rows_per_step']} rows of up to {sp['tokens_per_row']} "
          "tokens per step"
          f"\nsteps per second: cached {1 / sp['fastest']['cached']:.3f}, live {1 / sp['fastest']['live']:.3f}; "
          f"cached is {sp['speedup']:.2f}x as fast (fastest of {args.rounds} rounds; the ideal is about 1.33x)"
          f"\npeak memory over the baseline ({'CUDA allocated' if device.type == 'cuda' else 'CPU resident set'}): "
          f"live {mb(mem['live']['rise'])}, cached {mb(mem['cached']['rise'])}; saving {mb(mem['saving_bytes'])} = "
          f"{mem['saving_share_of_reference_weights']:.0%} of the reference's "
          f"{mb(mem['reference_weight_bytes'])} of weights")
    result = {"preset": args.preset, "pairs": args.pairs, "device": str(device), "threads": torch_threads,
              "speed": sp, "memory": mem, "command": "python benchmarks/bench_dpo.py " + " ".join(sys.argv[1:])}
    atomic_write_text(args.out / "result.json", json.dumps(result, indent=2))
    print(f"saved {shown(args.out / 'result.json')}")


if __name__ == "__main__":
    main()
