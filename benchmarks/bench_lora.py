"""LoRA against full fine-tuning: trainable parameters, weights held, peak memory and time per step (appendix A).

Two ways to train a policy that must stay near a reference π_ref (the model it starts from):

- full: every parameter of the policy learns, and a second, frozen copy of the network is the reference.
- LoRA: the network is frozen and rank --rank adapters (α = --alpha, default 2·rank) on the --targets linear layers
  learn (lora.apply_lora); the reference is the same network with its adapters off (lora.AdaptersOff): one network,
  two policies.

Each is measured on two kinds of step, with AdamW over the trainable parameters only (so its state exists after the
first step):

- dpo: a DPO step with a live reference: the reference scores the batch (frozen_logps), then dpo_step; --pairs real
  tiny-world preference pairs per step (bench_dpo's data).
- rloo: an RLOO step: rollout (--prompts prompts × --k samples of up to --max-new-tokens tokens, scored by a trivial
  length reward, the reference's log-probs computed), then pg_update (algo "rloo").

Random weights of the --preset size (speed and memory do not depend on their values). Measured:

- trainable parameters, and the weights held: the bytes of the policy's and the reference's parameters, each tensor
  counted once (LoRA's reference is the policy's own network, so LoRA holds one network plus its adapters).
- peak memory: each (mode, step kind) trains --memory-steps steps in a fresh process, as bench_dpo does. On a CPU
  the peak resident set size (VmHWM) over the RSS just before any model was built, with glibc's mmap threshold
  fixed (--mmap-threshold, 1 MiB) so that freed tensors leave the resident set; tensors smaller than it come from
  the heap, whose freed chunks mostly stay resident, so the smaller a step's tensors the more the figure holds of
  the heap's fragmentation besides live tensors (lower the threshold to see how much). On CUDA,
  torch.cuda.max_memory_allocated over memory_allocated before the models. (On MPS the resident set is read, which
  may miss the GPU's allocations.)
  The batches come in order of length, the longest last: AdamW's state exists from the end of the first step, and
  the peak is where it meets the largest activations (the tiny world's pairs differ in length up to 3x, and full
  fine-tuning's peak with them). Before the baseline, a throwaway AdamW step on an 8×8 tensor does what a process
  does once (the first optimizer imports torch._dynamo: tens of MiB of modules), so that it is not counted as the
  models' memory.
- time per step: one process holds both modes' models and runs --steps steps of each, full and LoRA alternating for
  --rounds rounds (each going first in every other round) so that a slow moment of the machine hits both; the
  ratio of the fastest rounds, LoRA over full, is reported for each step kind. LoRA's backward computes no
  gradient for the frozen matrices (about a third of a full step's arithmetic) and AdamW updates the adapters alone,
  but each adapted layer adds two thin matmuls; RLOO's sampling, most of its step, is the same network either way
  (plus the adapters on every generated token).

What dominates the memory, with W the bytes of one network's weights and a the bytes of the adapters (float32):

    full   W (policy) + W (its gradients) + 2W (AdamW's exp_avg and exp_avg_sq) + W (the reference)   ≈ 5W
    LoRA   W (the network, once) + a + a (gradients) + 2a (AdamW)                                     ≈ W + 4a

plus, in both, the activations A kept for the backward pass (about the same: the gradient must flow back through
every frozen layer to reach the first adapters) and the runtime's own allocations. So LoRA's peak should be about
(W + 4a) / 5W of full's without them, a little over 1/5 (an 80% reduction), and (W + 4a + A) / (5W + A) with them:
the more tokens a step holds, the closer to 1 (at gpt2-124m the (rows, T, 50257) logits are a large part of A). The
script prints the first ratio, computed from the parameter counts, beside the measured one, and for each mode the
measured peak minus that arithmetic ("beyond the expected peak": the activations and the runtime). It should be of
the same order in the two modes, not equal: the peaks fall at different moments of a step (full fine-tuning's where
its gradients and AdamW's state meet the activations, LoRA's where the activations and the backward pass's
temporaries are largest), so LoRA's is usually the larger; many times the other would mean that one mode holds
something the arithmetic leaves out. The issue's goal is a peak ≥ 60% below full fine-tuning's; the result reports
what was measured and whether it met it, at this batch: fewer tokens per step (--pairs, --prompts, --k,
--max-new-tokens) bring the reduction nearer 80%.

Measure at gpt2-124m, the default: at small the activations of these batches already outweigh the 42 MiB of
weights, and at tiny the Python runtime dwarfs the model. The speed process holds three networks (the full policy,
its reference and the LoRA model) and the full policy's gradients and AdamW state: about 6W (3 GiB at gpt2-124m).
The numbers go to runs/bench_lora/result.json.

    python benchmarks/bench_lora.py                        # gpt2-124m, rank 8, 2 pairs / 2 prompts × 4 samples
    python benchmarks/bench_lora.py --preset small --rank 16
    python benchmarks/bench_lora.py --preset tiny --steps 1 --rounds 1 --memory-steps 1   # a smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_dpo, when this file is imported from elsewhere

from bench_dpo import build, data, rss_now, rss_peak  # noqa: E402

from llm_from_scratch.checkpoint import atomic_write_text  # noqa: E402
from llm_from_scratch.course import runs_root, shown  # noqa: E402
from llm_from_scratch.device import pick_device  # noqa: E402
from llm_from_scratch.dpo import DPOConfig, dpo_step, frozen_logps, preference_batch  # noqa: E402
from llm_from_scratch.lora import TARGETS, AdaptersOff, apply_lora, trainable_parameters  # noqa: E402
from llm_from_scratch.model import PRESETS  # noqa: E402
from llm_from_scratch.policy_gradient import MovingAverageBaseline, PGConfig, pg_update, rollout  # noqa: E402
from llm_from_scratch.tokenizer import Tokenizer, encode_chat  # noqa: E402

MODES = ("full", "lora")
KINDS = ("dpo", "rloo")
TEMPERATURE = 1.0  # RLOO's sampling temperature
GOAL_REDUCTION = 60.0  # the goal: LoRA's peak memory at least this many percent below full fine-tuning's


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="gpt2-124m", choices=list(PRESETS),
                    help="model size (default gpt2-124m: 124M parameters with GPT-2's vocabulary)")
    ap.add_argument("--rank", type=int, default=8, help="LoRA's rank r (default 8)")
    ap.add_argument("--alpha", type=float, help="LoRA's α; the update is scaled by α / r (default 2 · rank)")
    ap.add_argument("--targets", default="all", choices=list(TARGETS),
                    help="the linear layers that get adapters (default all: attention and MLP)")
    ap.add_argument("--pairs", type=int, default=2, help="preference pairs per DPO step (default 2)")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per RLOO step (default 2)")
    ap.add_argument("--k", type=int, default=4, help="RLOO's samples per prompt, ≥ 2 (default 4)")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="RLOO's longest completion (default 32)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per mode and step kind in each round (default 3)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of the speed test (default 3)")
    ap.add_argument("--memory-steps", type=int, default=3,
                    help="steps of each memory process (default 3; at least 2 for a step's activations to meet "
                         "AdamW's state)")
    ap.add_argument("--mmap-threshold", type=int, default=2**20,
                    help="glibc's mmap threshold in the memory processes, bytes (default 1 MiB, as bench_dpo; lower "
                         "puts smaller tensors in their own mappings too, so less of the heap's fragmentation counts)")
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda or mps (default auto)")
    ap.add_argument("--out", type=Path, help="output folder (default runs/bench_lora)")
    ap.add_argument("--memory-child", help=argparse.SUPPRESS)  # internal: one memory run, "<mode>:<kind>"
    args = ap.parse_args(argv)
    for flag in ("rank", "pairs", "prompts", "steps", "rounds", "memory_steps", "max_new_tokens", "mmap_threshold"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be ≥ 1, got {getattr(args, flag)}")
    if args.k < 2:
        ap.error(f"--k must be ≥ 2 (RLOO's baseline is the mean of the other k − 1 samples), got {args.k}")
    if args.alpha is not None and args.alpha <= 0:
        ap.error(f"--alpha must be > 0, got {args.alpha:g}")
    args.alpha = 2.0 * args.rank if args.alpha is None else args.alpha
    context = PRESETS[args.preset]["context_length"]
    if args.max_new_tokens >= context:
        ap.error(f"--max-new-tokens must be below the {args.preset} preset's context length {context}, "
                 f"got {args.max_new_tokens}")
    try:
        pick_device(args.device)
    except ValueError as e:
        ap.error(f"--device: {e}")
    if args.memory_child is not None and args.memory_child not in [f"{m}:{k}" for m in MODES for k in KINDS]:
        ap.error(f"--memory-child: unknown {args.memory_child!r}")
    return args


def length_reward(prompts: list[str], completions: list[str]) -> list[float]:
    """A trivial reward (the benchmark times the step, not the learning): longer completions score more."""
    return [len(c) / 100 for c in completions]


@dataclass
class Work:
    """What the steps consume: the tokenizer, a DPO batch and an RLOO prompt group per step (on the device)."""
    tok: Tokenizer
    dpo_batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    prompt_groups: list[list[str]]


def work(args, device, n_steps: int, longest_last: bool = False) -> Work:
    """n_steps steps' worth of real tiny-world data: --pairs pairs for DPO and --prompts prompts for RLOO per step;
    longest_last: each kind's batches in order of length, so that the longest comes when AdamW's state exists."""
    tok, rows = data(n_steps, max(args.pairs, args.prompts))
    batches = [tuple(t.to(device) for t in preference_batch(tok, b[:args.pairs])) for b in rows]
    groups = [[p["prompt"] for p in b[:args.prompts]] for b in rows]
    if longest_last:
        batches.sort(key=lambda batch: batch[0].shape[1])  # (2N, T): T, the padded length
        groups.sort(key=lambda group: max(len(encode_chat(tok, p)[0]) for p in group))
    return Work(tok, batches, groups)


def sample_only_the_tokenizers_ids(model: torch.nn.Module, n: int) -> None:
    """A GPT-2 preset keeps its 50,257-token vocabulary, but the tokenizer trained here decodes only its first n ids,
    and random weights would sample any of them: the head's logits past n are pushed to -1e4 (finite, so that their
    probability is 0 and p·log p stays 0 in the entropy), the same extra work in both modes."""
    if model.config.vocab_size > n:
        banned = torch.arange(model.config.vocab_size, device=model.wte.weight.device) >= n  # (V,)
        model.lm_head.register_forward_hook(lambda module, inputs, logits: logits.masked_fill(banned, -1e4))


class Trainer:
    """One mode's policy, reference, optimizer and RLOO state; `step` runs one step of a kind on the work's i-th
    batch and returns the completion tokens it trained on (DPO: response tokens; RLOO: sampled tokens)."""

    def __init__(self, args, mode: str, vocab_size: int, device: torch.device):
        self.args, self.mode = args, mode
        self.policy = build(args.preset, vocab_size, device)
        sample_only_the_tokenizers_ids(self.policy, vocab_size)
        if mode == "full":
            self.reference = build(args.preset, vocab_size, device).requires_grad_(False)  # same seed: π_ref = π_0
            sample_only_the_tokenizers_ids(self.reference, vocab_size)
        else:
            apply_lora(self.policy, args.rank, args.alpha, args.targets)
            self.reference = AdaptersOff(self.policy)  # the base network, seen through the policy: no second copy
        self.optimizer = torch.optim.AdamW(trainable_parameters(self.policy), lr=1e-5)
        self.generator = torch.Generator(device=device).manual_seed(0)
        self.baseline = MovingAverageBaseline()
        self.pg = PGConfig(algo="rloo", k=args.k, max_new_tokens=args.max_new_tokens, temperature=TEMPERATURE)

    def step(self, kind: str, w: Work, i: int) -> int:
        if kind == "dpo":
            batch = w.dpo_batches[i]
            ref_c, ref_r = frozen_logps(self.reference, *batch)
            dpo_step(self.policy, self.optimizer, batch, ref_c, ref_r, DPOConfig())
            return int(batch[2].sum())
        ro = rollout(self.policy, self.reference, w.tok, w.prompt_groups[i], self.args.k, length_reward, None,
                     self.args.max_new_tokens, TEMPERATURE, 0.0, self.generator)
        pg_update(self.policy, self.optimizer, ro, self.pg, self.baseline)
        return int(ro.mask.sum())

    def sizes(self) -> dict:
        trainable = trainable_parameters(self.policy)
        held = {id(p): p for m in (self.policy, self.reference) for p in m.parameters()}.values()  # each tensor once
        return {"trainable_params": sum(p.numel() for p in trainable),
                "trainable_bytes": sum(p.numel() * p.element_size() for p in trainable),
                "weights_held_bytes": sum(p.numel() * p.element_size() for p in held),
                "network_params": sum(p.numel() for p in self.reference.parameters() if not p.requires_grad)}


def expected_peak(sizes: dict) -> int:
    """Weights held + the trainable parameters' gradients and AdamW's two states (activations not counted)."""
    return sizes["weights_held_bytes"] + 3 * sizes["trainable_bytes"]


def speed(args, device) -> tuple[dict, dict]:
    """Alternating rounds of --steps steps per mode, for each step kind, in this process; and each mode's sizes."""
    w = work(args, device, args.steps)
    trainers = {mode: Trainer(args, mode, w.tok.vocab_size, device) for mode in MODES}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    tokens = {kind: {mode: [] for mode in MODES} for kind in KINDS}

    def run(kind: str, mode: str) -> float:
        sync()
        t0 = time.perf_counter()
        n = sum(trainers[mode].step(kind, w, i) for i in range(args.steps))
        sync()
        tokens[kind][mode].append(n / args.steps)
        return (time.perf_counter() - t0) / args.steps

    for kind in KINDS:  # warm-up: the allocator, the kernels, AdamW's state
        for mode in MODES:
            trainers[mode].step(kind, w, 0)
    times = {kind: {mode: [] for mode in MODES} for kind in KINDS}
    for r in range(args.rounds):
        for kind in KINDS:
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):  # each mode goes first in every other round
                times[kind][mode].append(run(kind, mode))
                print(f"round {r + 1}: {kind:4s} {mode:4s} {times[kind][mode][-1]:.3f} s per step", flush=True)
    result = {}
    for kind in KINDS:
        fastest = {mode: min(times[kind][mode]) for mode in MODES}
        result[kind] = {"seconds_per_step": times[kind], "fastest": fastest,
                        "lora_over_full": fastest["lora"] / fastest["full"],
                        "completion_tokens_per_step": {m: sum(v) / len(v) for m, v in tokens[kind].items()}}
    return result, {mode: t.sizes() for mode, t in trainers.items()}


def warm_up(device: torch.device) -> None:
    """What the first optimizer step imports and sets up once per process (AdamW's first construction imports
    torch._dynamo: tens of MiB of modules), done on a throwaway tensor before the baseline so that it is not counted
    as the models' memory."""
    x = torch.nn.Parameter(torch.ones(8, 8, device=device))
    opt = torch.optim.AdamW([x], lr=1e-5)
    torch.nn.functional.linear(x, x).sum().backward()
    opt.step()


def memory_child(args) -> None:
    """One (mode, step kind): train --memory-steps steps and print the peak rise over the baseline as JSON."""
    mode, kind = args.memory_child.split(":")
    device = pick_device(args.device)
    w = work(args, device, args.memory_steps, longest_last=True)
    warm_up(device)
    gc.collect()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated() if cuda else rss_now()
    trainer = Trainer(args, mode, w.tok.vocab_size, device)
    for i in range(args.memory_steps):
        trainer.step(kind, w, i)
    peak = torch.cuda.max_memory_allocated() if cuda else rss_peak()
    print(json.dumps({"mode": mode, "kind": kind, "baseline": baseline, "peak": peak, "rise": peak - baseline}))


def memory(args) -> dict:
    """A fresh process per (mode, step kind)."""
    result = {}
    for kind in KINDS:
        result[kind] = {}
        for mode in MODES:
            cmd = [sys.executable, __file__, "--memory-child", f"{mode}:{kind}", "--preset", args.preset,
                   "--rank", str(args.rank), "--alpha", repr(args.alpha), "--targets", args.targets,
                   "--pairs", str(args.pairs), "--prompts", str(args.prompts), "--k", str(args.k),
                   "--max-new-tokens", str(args.max_new_tokens), "--memory-steps", str(args.memory_steps),
                   "--device", args.device, "--out", str(args.out)]
            # as in bench_dpo: a fixed mmap threshold keeps every tensor over it (1 MiB) in its own mapping, returned to
            # the OS when freed, so the resident set tracks live tensors rather than the heap's fragmentation
            env = dict(os.environ, PYTHONUNBUFFERED="1", MALLOC_MMAP_THRESHOLD_=str(args.mmap_threshold))
            done = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if done.returncode != 0:
                sys.exit(f"bench_lora: the {mode} {kind} memory process failed:\n{done.stderr}")
            result[kind][mode] = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"memory: {kind:4s} {mode:4s} peak {mib(result[kind][mode]['rise'])} over the baseline", flush=True)
        ratio = result[kind]["lora"]["rise"] / result[kind]["full"]["rise"]
        result[kind].update(lora_over_full=ratio, reduction_percent=100 * (1 - ratio),
                            goal_met=100 * (1 - ratio) >= GOAL_REDUCTION)
    return result


def machine(device: torch.device) -> dict:
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]
        cpu = names[0] if names else cpu
    info = {"device": str(device), "cpu": cpu, "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "python": platform.python_version(), "platform": platform.platform()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def mib(b: float) -> str:
    return f"{b / 2**20:,.1f} MiB" if abs(b) < 100 * 2**20 else f"{b / 2**20:,.0f} MiB"


def table(args, sizes: dict, sp: dict, mem: dict, expected: dict, device) -> str:
    """The printed summary: one row per quantity, full and LoRA side by side, and LoRA's share of full's."""
    rows = [("trainable parameters", *(f"{sizes[m]['trainable_params']:,}" for m in MODES),
             f"{sizes['lora']['trainable_params'] / sizes['full']['trainable_params']:.2%}"),
            ("weights held", *(mib(sizes[m]["weights_held_bytes"]) for m in MODES),
             f"{sizes['lora']['weights_held_bytes'] / sizes['full']['weights_held_bytes']:.0%}"),
            ("expected peak (no activations)", *(mib(expected[m]) for m in MODES),
             f"{expected['lora_over_full']:.0%} ({-expected['reduction_percent']:+.0f}%)")]
    for kind in KINDS:
        rows.append((f"{kind.upper()} peak memory", *(mib(mem[kind][m]["rise"]) for m in MODES),
                     f"{mem[kind]['lora_over_full']:.0%} ({-mem[kind]['reduction_percent']:+.0f}%)"))
        rows.append(("  beyond the expected peak", *(mib(mem[kind][m]["beyond_expected"]) for m in MODES), ""))
        rows.append((f"{kind.upper()} time per step", *(f"{sp[kind]['fastest'][m]:.3f} s" for m in MODES),
                     f"{sp[kind]['lora_over_full']:.2f}x"))
    head = ("", "full + reference", f"LoRA r={args.rank} ({args.targets})", "LoRA / full")
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(4)]
    fmt = lambda r: "  ".join([r[0].ljust(widths[0])] + [str(c).rjust(w) for c, w in zip(r[1:], widths[1:])])  # noqa: E731
    where = "CUDA allocated" if device.type == "cuda" else "resident set"
    return "\n".join([fmt(head), *map(fmt, rows)]) + (
        f"\nexpected peak: the weights held + 3x the trainable parameters' bytes (gradient, AdamW's 2 states); beyond"
        f" it: activations and runtime\npeak memory: the {where} over the baseline, a fresh process per row,"
        f" {args.memory_steps} steps; time: the fastest of {args.rounds} rounds of {args.steps} steps")


def main(argv=None) -> None:
    args = parse_args(argv)
    args.out = args.out or runs_root(False) / "bench_lora"
    if args.memory_child:
        return memory_child(args)
    args.out.mkdir(parents=True, exist_ok=True)
    device = pick_device(args.device)
    info = machine(device)
    print(f"LoRA (rank {args.rank}, α {args.alpha:g}, {args.targets}) against full fine-tuning at the {args.preset} "
          f"preset on {device} ({info['threads']} threads): DPO {args.pairs} pairs per step, RLOO {args.prompts} "
          f"prompts × {args.k} samples of up to {args.max_new_tokens} tokens", flush=True)
    sp, sizes = speed(args, device)
    mem = memory(args)
    expected = {m: expected_peak(sizes[m]) for m in MODES}
    expected["lora_over_full"] = expected["lora"] / expected["full"]
    expected["reduction_percent"] = 100 * (1 - expected["lora_over_full"])
    for kind in KINDS:  # the activations and the runtime: of the same order in the two modes (see the docstring)
        for m in MODES:
            mem[kind][m]["beyond_expected"] = mem[kind][m]["rise"] - expected[m]
    text = table(args, sizes, sp, mem, expected, device)
    print("\n" + text)
    verdict = ", ".join(f"{k.upper()} {-mem[k]['reduction_percent']:+.0f}% "
                        f"({'met' if mem[k]['goal_met'] else 'not met'})" for k in KINDS)
    print(f"goal: LoRA's peak memory ≥ {GOAL_REDUCTION:.0f}% below full fine-tuning's: {verdict}; "
          f"{-expected['reduction_percent']:+.0f}% expected from the parameter counts (activations not counted)")
    result = {"preset": args.preset, "lora": {"rank": args.rank, "alpha": args.alpha, "targets": args.targets},
              "dpo": {"pairs": args.pairs}, "rloo": {"prompts": args.prompts, "k": args.k,
                                                     "max_new_tokens": args.max_new_tokens},
              "steps": args.steps, "rounds": args.rounds, "memory_steps": args.memory_steps,
              "mmap_threshold": args.mmap_threshold,
              "machine": info, "modes": sizes, "expected_peak_bytes": expected,
              "memory": mem, "speed": sp, "goal_reduction_percent": GOAL_REDUCTION, "table": text,
              "command": "python benchmarks/bench_lora.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    atomic_write_text(args.out / "result.json", json.dumps(result, indent=2))
    print(f"saved {shown(args.out / 'result.json')}")


if __name__ == "__main__":
    main()
