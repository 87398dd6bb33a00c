"""Appendix C: OpenAI's GPT-2 weights in and out of the course's GPT.

Loads a Hugging Face GPT-2 folder (config.json, model.safetensors, vocab.json, merges.txt) into the GPT of
llm_from_scratch/model.py with llm_from_scratch/gpt2_weights.py, prints its configuration and parameters, continues
a prompt (top-k sampling, seeded), times greedy generation with and without the KV cache, exports the model back to
the Hugging Face layout and reloads it (bit for bit), and, when transformers is installed, compares the logits with
its GPT2LMHeadModel, loaded from the same folder and from the export. Writes runs/appC_gpt2/: summary.json,
report.md and export/ (the model in the Hugging Face layout again).

Where the weights come from, the first that applies:
    --model-dir PATH     a Hugging Face GPT-2 folder you have
    --download NAME      gpt2, gpt2-medium, gpt2-large or gpt2-xl from the Hub into runs/NAME (needs a network; the
                         files are checked against the Hub's sha256; nothing else in the course downloads)
    runs/gpt2            ($LLMFS_GPT2_DIR if set) when it holds one
    otherwise            a small RANDOM GPT-2-shaped checkpoint, written into the run folder in the same layout, so
                         that every step runs offline; it says so loudly, its text is noise, and summary.json records
                         "weights": "random"

--import-to DIR makes the model a checkpoint of this course (its tokenizer gains <|pad|>, <|user|>, <|assistant|>, and
the embedding their rows), which chapters 5-9 start from with --init DIR. --export-course-model PATH writes one of
the course's checkpoints (e.g. runs/sft) in the Hugging Face layout too, into the run folder.

    python chapters/appC_gpt2.py --download gpt2                        # OpenAI's GPT-2 small, once (about 550 MB)
    python chapters/appC_gpt2.py --import-to runs/gpt2_course           # then: ch05_sft.py --init runs/gpt2_course
    python chapters/appC_gpt2.py --export-course-model runs/sft         # the course's SFT model for transformers
    python chapters/appC_gpt2.py --quick                                # a smoke run (also LLMFS_QUICK=1)
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

import cli  # chapters/cli.py: common flags, one-line errors (also puts the repository on sys.path)
from llm_from_scratch import tinyworld
from llm_from_scratch.checkpoint import atomic_write_text
from llm_from_scratch.course import quick_mode, runs_root, shown, start_run, write_summary
from llm_from_scratch.device import pick_device, seed_everything
from llm_from_scratch.generation import generate
from llm_from_scratch.gpt2_weights import (
    HUB_MODELS,
    download_gpt2,
    import_hf_gpt2,
    load_hf_gpt2,
    save_hf_gpt2,
    save_hf_vocab,
)
from llm_from_scratch.model import GPT, GPTConfig
from llm_from_scratch.tokenizer import EOS_TOKEN, GPT2_SPLIT_PATTERN, Tokenizer, learn_merges, ranks_from_merges
from llm_from_scratch.train import load_gpt

# the random stand-in: GPT-2's layout at the size of the course's tiny preset (quick: smaller still), and a byte-level
# BPE of 511 ordinary tokens learned from the tiny world's text, plus <|endoftext|> as GPT-2 has it
RANDOM_SHAPE = dict(n_layer=4, n_head=4, n_embd=128, context_length=256)
RANDOM_SHAPE_QUICK = dict(n_layer=2, n_head=2, n_embd=32, context_length=256)
RANDOM_ORDINARY_TOKENS = 511


def parse_args(argv=None):
    ap = cli.parser(__doc__)
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--model-dir", type=Path, help="a local Hugging Face GPT-2 folder (default runs/gpt2 or "
                                                      "$LLMFS_GPT2_DIR when it holds one)")
    where.add_argument("--download", choices=list(HUB_MODELS), metavar="NAME",
                       help=f"fetch {', '.join(HUB_MODELS)} from the Hub into runs/NAME first (needs a network)")
    ap.add_argument("--prompt", default="The meaning of life is", help="the text to continue")
    ap.add_argument("--new-tokens", type=int, default=40, help="tokens of the sampled continuation (default 40)")
    ap.add_argument("--top-k", type=int, default=40, help="top-k sampling (default 40)")
    ap.add_argument("--temperature", type=cli.positive_float, default=1.0, help="sampling temperature (default 1)")
    ap.add_argument("--timing-tokens", type=int, default=64,
                    help="new tokens of the greedy generation timed with and without the KV cache (default 64)")
    ap.add_argument("--threads", type=int, default=0,
                    help="CPU threads (default 0 = PyTorch's default); 1 steadies the timings on a busy machine, "
                         "where a thread waiting for a core stalls every step")
    ap.add_argument("--import-to", type=Path, metavar="DIR",
                    help="also write the model as a course checkpoint into DIR, for chapters 5-9's --init DIR")
    ap.add_argument("--export-course-model", type=Path, metavar="PATH",
                    help="also export this course checkpoint (e.g. runs/sft) to the Hugging Face layout")
    cli.add_common_args(ap, "appC_gpt2")
    args = ap.parse_args(argv)
    args.quick = args.quick or quick_mode()
    if args.quick:
        args.new_tokens, args.timing_tokens = min(args.new_tokens, 8), min(args.timing_tokens, 8)
    if args.threads < 0:
        ap.error("--threads must be ≥ 0 (0: PyTorch's default)")
    for name in ("new_tokens", "top_k", "timing_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be ≥ 1")
    return args


# ----------------------------------------------------------------------------- where the weights come from


def default_model_dir() -> Path:
    """$LLMFS_GPT2_DIR, else runs/gpt2 (where `--download gpt2` puts it; a real run's folder even in quick mode)."""
    return Path(os.environ["LLMFS_GPT2_DIR"]) if os.environ.get("LLMFS_GPT2_DIR") else runs_root(False) / "gpt2"


def how_to_get(folder: Path) -> str:
    return ("To get OpenAI's GPT-2 small (about 550 MB):\n"
            "  python chapters/appC_gpt2.py --download gpt2        (needs a network)\n"
            "  or by hand: config.json, model.safetensors, vocab.json and merges.txt from\n"
            f"  https://huggingface.co/openai-community/gpt2/tree/main into {shown(folder)}")


def write_random_gpt2(folder: Path, quick: bool, seed: int = 0) -> Path:
    """A GPT-2-shaped checkpoint with random weights in Hugging Face's layout, what --download would have fetched:
    vocab.json + merges.txt of a byte-level BPE learned from the tiny world's text (its ids are its ranks, and
    <|endoftext|> comes last, as in GPT-2's), and a GPT with GPT-2's initialisation saved by save_hf_gpt2."""
    text = "\n".join(s.text for s in tinyworld.generate_pretraining(50_000 if quick else 200_000, seed=seed))
    ranks = ranks_from_merges(learn_merges(text, RANDOM_ORDINARY_TOKENS, GPT2_SPLIT_PATTERN))
    eos = len(ranks)
    shape = RANDOM_SHAPE_QUICK if quick else RANDOM_SHAPE
    save_hf_vocab(folder, ranks, {EOS_TOKEN: eos}, shape["context_length"])
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=eos + 1, **shape))
    return save_hf_gpt2(model, folder, eos_id=eos)


def find_weights(args, out: Path) -> tuple[Path, str]:
    """(the folder to load, "pretrained" or "random")."""
    if args.download:
        print(f"downloading {HUB_MODELS[args.download]} into {shown(runs_root(False) / args.download)} ...")
        return download_gpt2(args.download, runs_root(False)), "pretrained"
    if args.model_dir:
        return args.model_dir, "pretrained"  # a folder that is not one gets load_hf_gpt2's one-line error
    folder = default_model_dir()
    if (folder / "config.json").is_file():
        return folder, "pretrained"
    random_dir = out / "random_gpt2"
    bar = "=" * 100
    print(f"{bar}\nNO GPT-2 WEIGHTS: {shown(folder)} does not hold a Hugging Face GPT-2 folder.\n{how_to_get(folder)}\n"
          f"FALLING BACK to a small RANDOM GPT-2-shaped checkpoint, written now into {shown(random_dir)}:\n"
          f"every step below runs the same way, but the model knows nothing and its text is noise.\n{bar}")
    return write_random_gpt2(random_dir, args.quick, args.seed), "random"


def tokenizer_for(folder: Path) -> Tokenizer:
    """GPT-2's BPE from the folder's vocab.json (tiktoken's copy when there is none), with the course's special
    tokens after it."""
    return Tokenizer.gpt2(folder) if (folder / "vocab.json").is_file() else Tokenizer.gpt2()


# ----------------------------------------------------------------------------- measurements


def timed_greedy(model: GPT, prompt: list[int], n_new: int, use_cache: bool, device: torch.device,
                 repeats: int = 2) -> tuple[float, list[int]]:
    """Best of `repeats` wall times of a greedy generation of exactly n_new tokens, and its tokens."""
    best, tokens = float("inf"), []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        g = generate(model, [prompt], n_new, temperature=0, use_cache=use_cache)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best, tokens = min(best, time.perf_counter() - t0), g.sequences[0].tolist()
    return best, tokens


def same_weights(a: GPT, b: GPT) -> bool:
    """Every tensor of the two state dicts equal, bit for bit."""
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k].to(sa[k].device)) for k in sa)


def transformers_logit_diff(folder: Path, model: GPT, ids: torch.Tensor) -> float | None:
    """max |logits of transformers' GPT2LMHeadModel from `folder` - ours| on ids (1, T); None without transformers."""
    try:
        import transformers
    except ImportError:
        return None
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    hf = transformers.GPT2LMHeadModel.from_pretrained(folder, local_files_only=True).eval()
    with torch.no_grad():
        theirs = hf(ids.cpu()).logits  # (1, T, V)
        ours = model.eval()(ids).cpu()
    return float((theirs - ours).abs().max())


# ----------------------------------------------------------------------------- the appendix


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = args.out or runs_root(args.quick) / "appC_gpt2"
    start_run(out)  # no summary until this run finishes
    device = pick_device(args.device)
    seed_everything(args.seed)
    if device.type == "cpu" and args.threads > 0:
        torch.set_num_threads(args.threads)
    print(f"device: {device} | {'quick' if args.quick else 'full'} run -> {shown(out)}")

    # 1. the weights ------------------------------------------------------------------------------------------
    folder, weights = find_weights(args, out)
    t0 = time.perf_counter()
    model = load_hf_gpt2(folder, device=device).eval()
    load_s = time.perf_counter() - t0
    tok = tokenizer_for(folder)
    c = model.config
    print(f"\nloaded {shown(folder)} ({'RANDOM weights' if weights == 'random' else 'pretrained weights'}) into our "
          f"GPT in {load_s:.1f}s: {model.num_params():,} parameters (the head tied to the embedding)")
    print(f"  {c.n_layer} layers, {c.n_head} heads, width {c.n_embd}, context {c.context_length}, vocabulary "
          f"{c.vocab_size:,}; tokenizer {tok.vocab_size:,} tokens with the course's special tokens (EOS {tok.eos_id})")

    # 2. a continuation ----------------------------------------------------------------------------------------
    prompt = tok.encode(args.prompt)
    n_new = min(args.new_tokens, c.context_length - len(prompt))
    gen = torch.Generator(device=device).manual_seed(args.seed)
    sample = generate(model, [prompt], n_new, temperature=args.temperature, top_k=args.top_k, eos_id=tok.eos_id,
                      pad_id=tok.eos_id, generator=gen)
    continuation = tok.decode(sample.completions()[0])
    print(f"\n{args.prompt!r} continued (top-k {args.top_k}, temperature {args.temperature:g}, seed {args.seed}):\n"
          f"  {args.prompt}{continuation}")

    # 3. the KV cache --------------------------------------------------------------------------------------------
    n_time = min(args.timing_tokens, c.context_length - len(prompt))
    timed_greedy(model, prompt, 2, True, device, repeats=1)  # warm-up
    t_cache, with_cache = timed_greedy(model, prompt, n_time, True, device)
    t_full, without = timed_greedy(model, prompt, n_time, False, device)
    same_tokens = with_cache == without
    if not same_tokens:
        raise SystemExit("MISMATCH: greedy generation differs with and without the KV cache")
    print(f"\ngreedy generation of {n_time} tokens, best of 2: {n_time / t_cache:.1f} tokens/s with the KV cache, "
          f"{n_time / t_full:.1f} without ({t_full / t_cache:.1f}x); the same tokens: {same_tokens}")

    # 4. export and reload -----------------------------------------------------------------------------------
    export = save_hf_gpt2(model, out / "export", eos_id=tok.eos_id)
    bit_for_bit = same_weights(model, load_hf_gpt2(export, device=device))
    print(f"\nexported to {shown(export)} (Hugging Face's layout) and loaded back: every tensor equal bit for bit: "
          f"{bit_for_bit}")
    if not bit_for_bit:
        raise SystemExit("MISMATCH: the exported model does not load back bit for bit")

    # 5. against transformers --------------------------------------------------------------------------------
    ids = sample.sequences[:, : c.context_length]  # (1, P + N): the prompt and its sampled continuation
    diff_source = transformers_logit_diff(folder, model, ids)
    diff_export = transformers_logit_diff(export, model, ids) if diff_source is not None else None
    if diff_source is None:
        print("\ntransformers is not installed: no comparison with GPT2LMHeadModel (pip install transformers)")
    else:
        print(f"\ntransformers' GPT2LMHeadModel on the same {ids.size(1)} tokens: largest |logit difference| "
              f"{diff_source:.2e} (loaded from {shown(folder)}), {diff_export:.2e} (from our export)")

    # 6. a course checkpoint, and a course model for transformers ------------------------------------------------
    imported = None
    if args.import_to:
        dst = import_hf_gpt2(folder, args.import_to)
        ctok = Tokenizer.load(dst)
        course_model = load_gpt(dst, device=device, vocab_size=ctok.vocab_size).eval()
        with torch.no_grad():
            old = course_model(ids)[..., : c.vocab_size]  # the logits of the ids GPT-2 knows
            diff = float((old - model(ids)).abs().max())
        command = (f"python chapters/ch05_sft.py --init {shown(dst)} --out {shown(runs_root(args.quick) / 'sft_gpt2')}"
                   + (" --quick" if args.quick else ""))
        imported = {"dir": shown(dst), "vocab_size_before": c.vocab_size, "vocab_size": ctok.vocab_size,
                    "max_abs_logit_diff_old_ids": diff, "next": command}
        print(f"\na course checkpoint in {shown(dst)}: vocabulary {c.vocab_size:,} -> {ctok.vocab_size:,} "
              f"(<|pad|>, <|user|>, <|assistant|> added, their rows the mean of the others); the logits of the old "
              f"ids differ by {diff:.1e}. Start chapter 5 from it with:\n  {command}")
    course_export = None
    if args.export_course_model:
        ctok = Tokenizer.load(args.export_course_model)
        course_model = load_gpt(args.export_course_model, device=device, vocab_size=ctok.vocab_size).eval()
        dst = save_hf_gpt2(course_model, out / f"{args.export_course_model.name}_hf", tokenizer=ctok)
        chat = torch.tensor([ctok.encode("<|user|>Add 2 and 3.<|assistant|>", allowed_special="all")], device=device)
        course_export = {"source": shown(args.export_course_model), "dir": shown(dst),
                         "transformers_max_abs_logit_diff": transformers_logit_diff(dst, course_model, chat)}
        diff = course_export["transformers_max_abs_logit_diff"]
        print(f"\nthe course checkpoint {shown(args.export_course_model)} exported to {shown(dst)} (weights, config "
              f"and tokenizer files)" + ("" if diff is None else f"; transformers' logits differ by {diff:.1e}"))

    # 7. save --------------------------------------------------------------------------------------------------------
    summary = {
        "weights": weights, "source": shown(folder), "device": str(device),
        "config": {"n_layer": c.n_layer, "n_head": c.n_head, "n_embd": c.n_embd, "context_length": c.context_length,
                   "vocab_size": c.vocab_size},
        "params": model.num_params(), "load_seconds": load_s, "tokenizer_vocab_size": tok.vocab_size,
        "prompt": args.prompt, "sample": continuation, "top_k": args.top_k, "temperature": args.temperature,
        "timing_new_tokens": n_time, "tokens_per_s_cache": n_time / t_cache, "tokens_per_s_no_cache": n_time / t_full,
        "kv_cache_same_tokens": same_tokens, "export_dir": shown(export), "round_trip_bit_for_bit": bit_for_bit,
        "transformers_max_abs_logit_diff": diff_source, "transformers_export_max_abs_logit_diff": diff_export,
        "import": imported, "course_export": course_export,
        "cpu_threads": torch.get_num_threads() if device.type == "cpu" else None,
    }
    atomic_write_text(out / "report.md", report(summary))
    write_summary(out, summary, args.quick)  # last: marks the run finished
    print(f"\nsaved summary.json and report.md to {shown(out)}")
    return summary


def report(s: dict) -> str:
    c = s["config"]
    what = ("OpenAI's pretrained weights" if s["weights"] == "pretrained"
            else "**random weights** (no GPT-2 folder was found: the text below is noise)")
    lines = [
        "## Appendix C: GPT-2 weights in and out", "",
        f"- `{s['source']}`, {what}: {c['n_layer']} layers, {c['n_head']} heads, width {c['n_embd']}, context "
        f"{c['context_length']}, vocabulary {c['vocab_size']:,}; {s['params']:,} parameters, loaded in "
        f"{s['load_seconds']:.1f}s",
        f"- continuation of {s['prompt']!r} (top-k {s['top_k']}, temperature {s['temperature']:g}): "
        f"{s['prompt']!r} + {s['sample']!r}",
        f"- greedy generation of {s['timing_new_tokens']} tokens on {s['device']}"
        + (f" ({s['cpu_threads']} thread{'s' if s['cpu_threads'] != 1 else ''})" if s["cpu_threads"] else "")
        + f": {s['tokens_per_s_cache']:.1f} tokens/s with the KV cache, {s['tokens_per_s_no_cache']:.1f} without, "
        "the same tokens",
        f"- exported to `{s['export_dir']}` and loaded back bit for bit: {s['round_trip_bit_for_bit']}",
    ]
    if s["transformers_max_abs_logit_diff"] is not None:
        lines.append(f"- transformers' GPT2LMHeadModel: largest |logit difference| "
                     f"{s['transformers_max_abs_logit_diff']:.1e} (same folder), "
                     f"{s['transformers_export_max_abs_logit_diff']:.1e} (our export)")
    if s["import"]:
        lines.append(f"- course checkpoint `{s['import']['dir']}` (vocabulary {s['import']['vocab_size_before']:,} -> "
                     f"{s['import']['vocab_size']:,}); next: `{s['import']['next']}`")
    if s["course_export"]:
        lines.append(f"- `{s['course_export']['source']}` exported to `{s['course_export']['dir']}`")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    cli.run(main)
