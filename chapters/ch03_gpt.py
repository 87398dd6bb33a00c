"""Chapter 3: the GPT, sampling and the KV cache.

Builds the GPT-2 architecture of llm_from_scratch/model.py and counts its parameters component by
component (the tiny and small presets of the course, and OpenAI's GPT-2 small: 124,439,808 with the
tied head) and its training FLOPs per token. Shows the sampling strategies (temperature, top-k,
top-p) on a fixed toy distribution, where their effect can be read off exactly, and on real text
when chapter 4 has left a pretrained model in runs/pretrain/. Checks that a left-padded batch
computes the same logits as each prompt alone. Finally times generation with and without the KV
cache at batch 1 and batch 8, checks that both give the same greedy tokens, and plots the times.

    python chapters/ch03_gpt.py              # the real run (well under two minutes on 2 CPU cores)
    python chapters/ch03_gpt.py --quick      # a smoke run (also: LLMFS_QUICK=1)
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import cli  # noqa: E402  chapters/cli.py: one-line errors at the terminal
from llm_from_scratch import tinyworld  # noqa: E402
from llm_from_scratch.checkpoint import append_metrics, atomic_write_text
from llm_from_scratch.course import (  # noqa: E402
    finished_run,
    prerequisite,
    quick_mode,
    runs_root,
    shown,
    start_run,
    write_summary,
)
from llm_from_scratch.device import DEVICE_CHOICES, pick_device, seed_everything  # noqa: E402
from llm_from_scratch.generation import filter_logits, generate, left_pad, sample_next  # noqa: E402
from llm_from_scratch.model import GPT, PRESETS, GPTConfig  # noqa: E402
from llm_from_scratch.plots import line_plot, save  # noqa: E402
from llm_from_scratch.tokenizer import Tokenizer  # noqa: E402
from llm_from_scratch.train import load_gpt  # noqa: E402

PROMPT = "Once upon a time,"
# A fixed next-token distribution to show what each sampling rule does (10 tokens, logits made up).
TOY_TOKENS = ["the", "a", "kite", "red", "ball", "happy", "dog", "ran", "blue", "sad"]
TOY_LOGITS = [3.0, 2.2, 1.8, 1.2, 0.9, 0.5, 0.1, -0.4, -1.0, -1.6]
TOY_TOP_K, TOY_TOP_P = 3, 0.9
TOY_TEMPERATURES = (0.5, 1.0, 2.0)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=list(PRESETS),
                    help="GPT size used for the samples and the KV-cache timings (default tiny)")
    ap.add_argument("--device", default="auto",
                    help=f"one of {', '.join(DEVICE_CHOICES)} (default auto: cuda, then mps, then cpu)")
    ap.add_argument("--threads", type=int, default=0,
                    help="CPU threads (default 0 = PyTorch's default); 1 steadies the timings on a busy machine, "
                         "where a thread waiting for a core stalls every step")
    ap.add_argument("--seed", type=int, default=0, help="seed of the model initialisation and the sampling (default 0)")
    ap.add_argument("--out", type=Path, help="output folder (default: runs/gpt)")
    ap.add_argument("--quick", action="store_true", help="a smoke run with fewer tokens (also LLMFS_QUICK=1)")
    ap.add_argument("--quiet", action="store_true",
                    help="no progress bars (this chapter has none; accepted like every chapter)")
    cli.add_fast_arg(ap)
    ap.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    args = ap.parse_args(argv)
    args.quick = args.quick or quick_mode()
    return args


# ----------------------------------------------------------------------------- counting


def build_on_meta(config: GPTConfig) -> GPT:
    """The model's structure without its memory: on the "meta" device tensors have shapes but no storage,
    so even GPT-2's 124M parameters are 'built' in milliseconds (enough to count them)."""
    with torch.device("meta"):
        return GPT(config)


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def param_breakdown(model: GPT) -> dict[str, int]:
    """Parameters per component, read off the real modules (not a formula)."""
    block = model.blocks[0]
    parts = {
        "token embedding (= LM head, tied)": count(model.wte),
        "position embedding": count(model.wpe),
        "per block: attention (c_attn + c_proj)": count(block.attn),
        "per block: MLP (c_fc + c_proj)": count(block.mlp),
        "per block: 2 LayerNorms": count(block.ln_1) + count(block.ln_2),
        "per block: total": count(block),
        "all blocks (n_layer x per block)": count(model.blocks),
        "final LayerNorm": count(model.ln_f),
        # parameters() yields a shared tensor once, so the tied head adds nothing here
        "LM head (extra, beyond the tied matrix)":
            count(model) - sum(count(m) for m in (model.wte, model.wpe, model.blocks, model.ln_f)),
    }
    parts["total"] = model.num_params()
    parts["non-embedding"] = model.num_params(non_embedding=True)
    return parts


def param_formula(c: GPTConfig) -> int:
    """The same total by hand (biases on): V C + T C + L (12 C^2 + 13 C) + 2 C.

    Per block: attention 3C^2+3C (q, k, v) + C^2+C (output), MLP 4C^2+4C + 4C^2+C, two LayerNorms 2C each."""
    C = c.n_embd
    return c.vocab_size * C + c.context_length * C + c.n_layer * (12 * C * C + 13 * C) + 2 * C


# ----------------------------------------------------------------------------- sampling on a toy distribution


def toy_distributions(logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """The next-token probabilities under each rule (what sample_next draws from), for a (V,) logit vector."""
    z = logits[None].float()  # (1, V): filter_logits works on batches
    probs = {f"temperature {t:g}": F.softmax(z / t, dim=-1)[0] for t in TOY_TEMPERATURES}
    probs[f"top-k {TOY_TOP_K}"] = F.softmax(filter_logits(z, top_k=TOY_TOP_K), dim=-1)[0]
    probs[f"top-p {TOY_TOP_P:g}"] = F.softmax(filter_logits(z, top_p=TOY_TOP_P), dim=-1)[0]
    return probs


def entropy(p: torch.Tensor) -> float:
    """H(p) = -sum p log p in nats (0 log 0 = 0)."""
    p = p[p > 0]
    return float(-(p * p.log()).sum())


def sampling_plot(tokens: list[str], probs: dict[str, torch.Tensor], path: Path | None):
    """One bar chart per rule over the same tokens; a grey cross marks a token the rule can never draw."""
    fig, axes = plt.subplots(1, len(probs), figsize=(3.0 * len(probs), 3.0), sharey=True)
    for ax, (label, p) in zip(axes, probs.items()):
        ax.bar(range(len(tokens)), p.tolist(), color="tab:blue")
        dropped = [i for i, x in enumerate(p.tolist()) if x == 0]
        if dropped:  # a cross where the rule set p to exactly 0
            ax.plot(dropped, [0] * len(dropped), "x", color="gray", clip_on=False)
        ax.set_xticks(range(len(tokens)), tokens, rotation=60, fontsize=8)
        ax.set_title(f"{label}\nH = {entropy(p):.2f} nats", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("probability of the next token")
    fig.suptitle("One set of logits, five sampling rules", y=1.1)
    return save(fig, path)


# ----------------------------------------------------------------------------- the KV cache


def timed_generate(model: GPT, prompts: list[list[int]], n_new: int, use_cache: bool, device: torch.device,
                   repeats: int = 1):
    """Greedy generation of exactly n_new tokens (no EOS stop); returns (seconds, Generation).

    The time is the best of `repeats` runs: on a busy machine the fastest run is the one least disturbed."""
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()  # GPU work is asynchronous: wait for it before reading the clock
        t0 = time.perf_counter()
        out = generate(model, prompts, n_new, temperature=0, use_cache=use_cache)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best, out


def kv_cache_bytes(c: GPTConfig, batch: int, length: int, bytes_per_value: int = 4) -> int:
    """Keys and values of every layer: 2 x n_layer x B x length x n_embd numbers."""
    return 2 * c.n_layer * batch * length * c.n_embd * bytes_per_value


# ----------------------------------------------------------------------------- the chapter


def main(argv=None) -> dict:
    args = parse_args(argv)
    root = runs_root(args.quick)
    out = args.out or root / "gpt"
    start_run(out, fresh=("metrics.jsonl",))  # this run's metrics only; no summary until it finishes
    device = pick_device(args.device)
    seed_everything(args.seed)
    threads = args.threads if device.type == "cpu" and args.threads > 0 else 0
    if threads:
        torch.set_num_threads(threads)
    say = print
    n_threads = torch.get_num_threads()
    say(f"device: {device} ({n_threads} CPU thread{'s' if n_threads != 1 else ''}) | preset: {args.preset} | "
        f"{'quick' if args.quick else 'full'} run -> {out}")

    # 1. the tokenizer of chapter 1 --------------------------------------------------------------
    tok = Tokenizer.load(prerequisite("tokenizer", args.quick))  # chapter 1's (made now if missing: about a minute)
    say(f"tokenizer: {tok.vocab_size} tokens (EOS {tok.eos_id}, PAD {tok.pad_id})")

    # 2. the GPT, counted component by component -----------------------------------------------
    configs = {
        "tiny": GPTConfig.preset("tiny", vocab_size=tok.vocab_size),
        "small": GPTConfig.preset("small", vocab_size=tok.vocab_size),
        "gpt2-124m": GPTConfig.preset("gpt2-124m"),  # vocab 50,257: OpenAI's GPT-2 small
    }
    counts, flops = {}, {}
    for name, c in configs.items():
        m = build_on_meta(c)
        parts = param_breakdown(m)
        by_hand = param_formula(c)
        if by_hand != parts["total"]:
            raise SystemExit(f"MISMATCH: {name} has {parts['total']:,} parameters but the formula says {by_hand:,}")
        counts[name], flops[name] = parts, m.flops_per_token()
        say(f"\n{name}: vocab {c.vocab_size:,}, context {c.context_length}, {c.n_layer} layers, {c.n_head} heads, "
            f"width {c.n_embd}")
        for label, n in parts.items():
            say(f"  {label:42s} {n:>13,}")
        n_matmul = m.num_params(non_embedding=True) + c.vocab_size * c.n_embd  # the matrices every token multiplies
        attn = 12 * c.n_layer * c.n_embd * c.context_length
        say(f"  = V C + T C + L (12 C^2 + 13 C) + 2 C = {by_hand:,} (the formula agrees)")
        say(f"  training FLOPs/token at T={c.context_length}: 6 N + 12 L C T = 6 x {n_matmul:,} + {attn:,} = "
            f"{flops[name]:.3e} (attention scores {attn / flops[name]:.0%}); "
            f"generating costs about a third: {flops[name] / 3:.2e}")
    c124 = configs["gpt2-124m"]
    say(f"\nGPT-2 small: {counts['gpt2-124m']['total']:,} parameters with the tied head "
        f"(the 124M of the GPT-2 release; an untied head would add {c124.vocab_size * c124.n_embd:,})")

    # 3. sampling ---------------------------------------------------------------------------------
    say(f"\nsampling rules on a fixed toy distribution (logits {TOY_LOGITS}):")
    toy = toy_distributions(torch.tensor(TOY_LOGITS))
    say(f"  {'token':>6s} " + " ".join(f"{label:>15s}" for label in toy))
    for i, t in enumerate(TOY_TOKENS):
        say(f"  {t:>6s} " + " ".join(f"{float(p[i]):15.3f}" for p in toy.values()))
    say(f"  {'H':>6s} " + " ".join(f"{entropy(p):15.3f}" for p in toy.values()) + "   (entropy, nats)")
    say(f"  {'kept':>6s} " + " ".join(f"{int((p > 0).sum()):15d}" for p in toy.values())
        + "   (tokens that can be drawn)")
    sampling_plot(TOY_TOKENS, toy, out / "sampling.png")

    # sample_next must draw from exactly these distributions: count many draws
    n_draws = 20_000 if args.quick else 100_000
    gen = torch.Generator().manual_seed(args.seed)
    z = torch.tensor(TOY_LOGITS).expand(n_draws, -1)  # n_draws rows of the same logits
    draws = sample_next(z, temperature=1.0, top_p=TOY_TOP_P, generator=gen)
    freq = torch.bincount(draws, minlength=len(TOY_LOGITS)).float() / n_draws
    draw_err = float((freq - toy[f"top-p {TOY_TOP_P:g}"]).abs().max())
    say(f"  {n_draws:,} draws of sample_next(top_p={TOY_TOP_P}): largest |frequency - probability| = {draw_err:.4f} "
        f"(sampling noise is about {1 / math.sqrt(n_draws):.4f})")

    config = GPTConfig.preset(args.preset, vocab_size=tok.vocab_size)
    model = GPT(config).to(device).eval()
    prompt_ids = tok.encode(PROMPT)
    gen = torch.Generator(device=device)
    untrained = generate(model, [prompt_ids], 24, temperature=1.0, generator=gen.manual_seed(args.seed))
    say(f"\nan untrained {args.preset} GPT ({model.num_params():,} parameters) continues {PROMPT!r} with noise:")
    say(f"  {tok.decode(untrained.completions()[0])!r}")
    say(f"  (at initialisation every logit is close to 0, so the loss is about ln {tok.vocab_size} = "
        f"{math.log(tok.vocab_size):.2f} nats)")

    pretrain = root / "pretrain"
    samples = {}
    if finished_run(pretrain) is not None:  # optional: chapter 4 comes later in the course
        trained = load_gpt(pretrain, device=device, vocab_size=tok.vocab_size)
        say(f"\nthe pretrained model of chapter 4 ({pretrain}, {trained.num_params():,} parameters) "
            f"continues {PROMPT!r}:")
        strategies = {"greedy": dict(temperature=0), "T=0.8": dict(temperature=0.8),
                      "top-k 10": dict(temperature=1.0, top_k=10), "top-p 0.9": dict(temperature=1.0, top_p=0.9)}
        n_new = min(60, trained.config.context_length - len(prompt_ids))
        for label, kw in strategies.items():
            g = generate(trained, [prompt_ids], n_new, eos_id=tok.eos_id, pad_id=tok.pad_id,
                         generator=gen.manual_seed(args.seed), **kw)
            samples[label] = tok.decode(g.completions()[0])
            say(f"  {label:>9s}: {samples[label]!r}")
    else:
        say(f"\nno pretrained model in {pretrain} yet: chapter 4 (chapters/ch04_pretrain.py) trains one, "
            f"and then this chapter shows its samples")

    # 4. left padding: a padded row computes the same logits as the row alone ----------------------
    docs = [s.text for s in tinyworld.generate_pretraining(20_000, seed=args.seed + 1)]
    rows = [tok.encode(d)[:n] for d, n in zip(docs, (5, 9, 16))]  # three prompts of different lengths
    ids, mask = left_pad(rows, tok.pad_id)
    with torch.no_grad():
        batched = model(ids.to(device), attention_mask=mask.to(device))  # (3, 16, V)
        pad_diff = max(float((batched[i, ids.size(1) - len(r):]
                              - model(torch.tensor([r], device=device))[0]).abs().max())
                       for i, r in enumerate(rows))
    say(f"\nleft padding: prompts of {[len(r) for r in rows]} tokens padded to {ids.size(1)}; "
        f"largest |logit difference| against each prompt alone = {pad_diff:.2e}")

    # 5. the KV cache -------------------------------------------------------------------------------
    n_points = (8, 16, 32) if args.quick else (16, 32, 64, 128)
    batches = (1, 8)
    # 16-token prompts of real text
    prompts = [ids[:16] for ids in map(tok.encode, docs) if len(ids) >= 16][:max(batches)]
    say(f"\nKV cache: greedy generation from 16-token prompts, {args.preset} GPT on {device}, best of 2 runs")
    say(f"  {'batch':>5s} {'new tokens':>10s} {'cache (s)':>10s} {'no cache (s)':>12s} {'speedup':>8s}  same tokens")
    times = {(b, uc): [] for b in batches for uc in (True, False)}
    timed_generate(model, prompts[:1], 4, True, device)  # warm-up: first calls allocate and pick kernels
    timed_generate(model, prompts[:1], 4, False, device)
    for b in batches:
        for n in n_points:
            t_cache, g_cache = timed_generate(model, prompts[:b], n, True, device, repeats=2)
            t_full, g_full = timed_generate(model, prompts[:b], n, False, device, repeats=2)
            same = torch.equal(g_cache.sequences, g_full.sequences)
            if not same:
                raise SystemExit(f"MISMATCH: with and without the KV cache, greedy generation differs "
                                 f"(batch {b}, {n} tokens)")
            times[(b, True)].append(t_cache)
            times[(b, False)].append(t_full)
            say(f"  {b:5d} {n:10d} {t_cache:10.3f} {t_full:12.3f} {t_full / t_cache:7.1f}x  {same}")
    curves = {f"batch {b}, {'KV cache' if uc else 'no cache'}": t for (b, uc), t in times.items()}
    line_plot(list(n_points), curves, "new tokens generated", "seconds",
              f"Generation time, {args.preset} GPT on {device.type}", out / "kv_cache.png")
    speedup = {b: times[(b, False)][-1] / times[(b, True)][-1] for b in batches}
    n_max = n_points[-1]
    say(f"  at {n_max} new tokens the cache is {speedup[1]:.1f}x faster at batch 1 and {speedup[8]:.1f}x at batch 8")
    say(f"  its memory: {kv_cache_bytes(config, 1, 16 + n_max) / 1e6:.2f} MB here (batch 1, float32); "
        "GPT-2 small at its full "
        f"context of {c124.context_length}: {kv_cache_bytes(c124, 1, c124.context_length) / 1e6:.0f} MB per sequence")

    # 6. save --------------------------------------------------------------------------------------
    summary = {
        "preset": args.preset, "device": str(device), "quick": args.quick, "vocab_size": tok.vocab_size,
        "params": {name: parts["total"] for name, parts in counts.items()},
        "non_embedding_params": {name: parts["non-embedding"] for name, parts in counts.items()},
        "flops_per_token": flops,
        "toy_entropy_nats": {label: entropy(p) for label, p in toy.items()},
        "top_p_draw_max_error": draw_err, "left_pad_max_abs_diff": pad_diff,
        "cpu_threads": torch.get_num_threads() if device.type == "cpu" else None,
        "kv_new_tokens": list(n_points), "kv_prompt_tokens": 16,
        "kv_seconds": {f"batch{b}_{'cache' if uc else 'no_cache'}": t for (b, uc), t in times.items()},
        "kv_speedup_batch1": speedup[1], "kv_speedup_batch8": speedup[8],
        "pretrained_samples": samples,
    }
    append_metrics(out / "metrics.jsonl", summary)
    atomic_write_text(out / "report.md", report(summary, counts, out.name))
    write_summary(out, summary, args.quick)  # last: marks the run finished
    say(f"\nsaved metrics.jsonl, report.md, sampling.png and kv_cache.png to {shown(out)}")
    return summary


def report(s: dict, counts: dict, folder: str) -> str:
    n_max = s["kv_new_tokens"][-1]
    sec = s["kv_seconds"]
    lines = [
        "## Chapter 3: the GPT", "",
        "| model | parameters | non-embedding | training FLOPs/token |", "|---|---:|---:|---:|",
    ]
    lines += [f"| {name} | {s['params'][name]:,} | {s['non_embedding_params'][name]:,} | "
              f"{s['flops_per_token'][name]:.3e} |" for name in counts]
    lines += [
        "",
        "- sampling on a toy distribution: entropy "
        + ", ".join(f"{k} {v:.2f}" for k, v in s["toy_entropy_nats"].items()) + " nats",
        f"- a left-padded batch matches each prompt alone to {s['left_pad_max_abs_diff']:.1e} "
        "(largest logit difference)",
        f"- KV cache ({s['preset']} GPT, {s['device']}"
        + (f" with {s['cpu_threads']} thread(s)" if s["cpu_threads"] else "")
        + f", 16-token prompts, {n_max} new tokens, greedy, same tokens with and without): "
        f"batch 1 {sec['batch1_cache'][-1]:.2f}s vs {sec['batch1_no_cache'][-1]:.2f}s "
        f"(**{s['kv_speedup_batch1']:.1f}x**), "
        f"batch 8 {sec['batch8_cache'][-1]:.2f}s vs {sec['batch8_no_cache'][-1]:.2f}s "
        f"(**{s['kv_speedup_batch8']:.1f}x**)",
    ]
    if s["pretrained_samples"]:
        lines += ["", f"Samples from the pretrained model for {PROMPT!r}:", ""]
        lines += [f"- {label}: {text!r}" for label, text in s["pretrained_samples"].items()]
    lines += ["", f"![sampling rules]({folder}/sampling.png)", f"![KV cache timings]({folder}/kv_cache.png)", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    cli.run(main)
