"""PPO with a separate critic against a shared one: time per step and the weights each holds, in one run.

One rollout batch of story completions is sampled once from the SFT model (chapter 5) and scored by the reward model
(chapter 6). Then, on that same batch, each critic's `ppo_step` (2 epochs x 2 minibatches: old log-probs and values,
GAE, four clipped updates) is timed, the two alternating round by round so that a slow moment of the machine hits
both, each from fresh copies of the models. It prints the fastest and the median seconds per step of each, their
ratio, the rollout's own time (the same for both: the critic does not sample), and the parameters and bytes of
weights of every model each setup holds in memory (a tied matrix counted once):

    separate   policy, reference, reward model, critic (a second trunk, initialised from the reward model)
    shared     policy with a value head on its trunk, reference, reward model

The numbers go to runs/bench_ppo_critic/result.json (notebook 08 reads them).

    python benchmarks/bench_ppo_critic.py                 # 64 samples, 5 rounds
    python benchmarks/bench_ppo_critic.py --rounds 9
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llm_from_scratch import dataset_files  # noqa: E402
from llm_from_scratch.checkpoint import atomic_write_text, read_jsonl
from llm_from_scratch.course import prerequisite, runs_root, shown  # noqa: E402
from llm_from_scratch.data import tinyworld_dir  # noqa: E402
from llm_from_scratch.policy_gradient import rollout  # noqa: E402
from llm_from_scratch.ppo import (  # noqa: E402
    AdaptiveKLController,
    PolicyValue,
    PPOConfig,
    make_optimizer,
    ppo_step,
    weights_held,
)
from llm_from_scratch.reward_model import RewardModel, reward_fn  # noqa: E402
from llm_from_scratch.tokenizer import Tokenizer  # noqa: E402
from llm_from_scratch.train import load_gpt  # noqa: E402


def setup(kind: str, sft: Path, rm_dir: Path, vocab_size: int):
    """Fresh models for one timed step: (policy, critic or None, optimizer, the models held by name)."""
    gpt = load_gpt(sft, vocab_size=vocab_size, dropout=0.0)
    reference = load_gpt(sft, vocab_size=vocab_size, dropout=0.0).requires_grad_(False)
    rm = RewardModel.load(rm_dir, vocab_size=vocab_size).requires_grad_(False)
    if kind == "separate":
        policy, critic = gpt, RewardModel.load(rm_dir, vocab_size=vocab_size)
        held = {"policy": policy, "reference": reference, "reward model": rm, "critic": critic}
    else:
        policy, critic = PolicyValue(gpt), None
        held = {"policy (with the value head)": policy, "reference": reference, "reward model": rm}
    return policy, critic, make_optimizer(policy, critic, 5e-5, 1e-4), held


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=64, help="story completions in the batch (default 64)")
    ap.add_argument("--rounds", type=int, default=5, help="timed steps of each critic, alternating (default 5)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sft, rm_dir = prerequisite("sft"), prerequisite("reward_model")
    tok = Tokenizer.load(sft)
    paths = dataset_files.ensure_datasets(tinyworld_dir(False), seed=0)
    prompts = [p for p in read_jsonl(paths["rl_stories"]) if p["task"] == "story"][: args.samples]
    sampler = load_gpt(sft, vocab_size=tok.vocab_size, dropout=0.0)
    rm = RewardModel.load(rm_dir, vocab_size=tok.vocab_size).requires_grad_(False)
    t0 = time.perf_counter()
    ro = rollout(sampler, sampler, tok, [p["prompt"] for p in prompts], 1, reward_fn(rm, tok), max_new_tokens=128,
                 temperature=1.0, generator=torch.Generator().manual_seed(0))
    rollout_s = time.perf_counter() - t0
    tokens = int(ro.mask.sum())
    print(f"one rollout batch: {args.samples} stories, {tokens} completion tokens, "
          f"sampled and scored in {rollout_s:.2f} s "
          f"({', '.join(f'{k} {v:.2f} s' for k, v in ro.seconds.items())}); {torch.get_num_threads()} threads")

    seconds = {"separate": [], "shared": []}
    held = {}
    for r in range(args.rounds):
        order = ("separate", "shared") if r % 2 == 0 else ("shared", "separate")  # each goes first every other round
        for kind in order:
            policy, critic, optimizer, held[kind] = setup(kind, sft, rm_dir, tok.vocab_size)
            t0 = time.perf_counter()
            ppo_step(policy, critic, optimizer, ro, AdaptiveKLController(0.05, 1.0, 1000), PPOConfig(),
                     torch.Generator().manual_seed(r))
            seconds[kind].append(time.perf_counter() - t0)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in seconds.items()))

    memory = {kind: weights_held(models) for kind, models in held.items()}
    result = {"samples": args.samples, "tokens": tokens, "rounds": args.rounds, "threads": torch.get_num_threads(),
              "rollout_s": rollout_s, "update_s": seconds, "weights_held": memory}
    print("\n| | separate critic | shared critic |\n|---|---:|---:|")
    names = ["policy", "reference", "reward model", "critic"]
    for name in names:
        cells = []
        for kind in ("separate", "shared"):
            row = memory[kind].get(name) or (memory[kind].get("policy (with the value head)") if name == "policy"
                                             else None)
            cells.append(f"{row['params'] / 1e6:.3f} M ({row['bytes'] / 2 ** 20:.2f} MiB)" if row else "–")
        print(f"| {name}: parameters (bytes) | {cells[0]} | {cells[1]} |")
    totals = {k: sum(v["bytes"] for v in m.values()) for k, m in memory.items()}
    print(f"| all weights held | {totals['separate'] / 2 ** 20:.2f} MiB | {totals['shared'] / 2 ** 20:.2f} MiB |")
    best = {k: min(v) for k, v in seconds.items()}
    median = {k: statistics.median(v) for k, v in seconds.items()}
    print(f"| ppo_step, fastest of {args.rounds} (median) | {best['separate']:.2f} s ({median['separate']:.2f}) | "
          f"{best['shared']:.2f} s ({median['shared']:.2f}) |")
    print(f"| a whole step with the rollout ({rollout_s:.2f} s) | {best['separate'] + rollout_s:.2f} s | "
          f"{best['shared'] + rollout_s:.2f} s |")
    print(f"\nshared / separate: weights {totals['shared'] / totals['separate']:.2f}x, update time "
          f"{best['shared'] / best['separate']:.2f}x (fastest), {median['shared'] / median['separate']:.2f}x (median), "
          f"whole step {(best['shared'] + rollout_s) / (best['separate'] + rollout_s):.2f}x")
    out = runs_root(False) / "bench_ppo_critic" / "result.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(result, indent=2))
    print(f"saved {shown(out)}")


if __name__ == "__main__":
    main()
