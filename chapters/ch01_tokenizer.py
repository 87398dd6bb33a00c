"""Chapter 1: the tiny world and a BPE tokenizer trained from scratch.

Generates the tiny world's datasets (or reuses them), shows samples and the entropy floor, trains
the course tokenizer with byte-level BPE, draws its first merges, sweeps the vocabulary size,
reports bytes per token on the tiny world and on real text nobody here wrote (the Python standard
library's sources, or --text PATH), checks the pure-Python encoder against tiktoken token for token,
and saves the tokenizer to runs/tokenizer/ for every later chapter.

    python chapters/ch01_tokenizer.py              # the real run (under a minute on 2 CPU cores)
    python chapters/ch01_tokenizer.py --quick      # a smoke run (also: LLMFS_QUICK=1)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import regex  # noqa: E402

import cli  # noqa: E402  chapters/cli.py: one-line errors at the terminal
from llm_from_scratch import dataset_files, tinyworld  # noqa: E402
from llm_from_scratch.checkpoint import append_metrics, atomic_write_text
from llm_from_scratch.course import quick_mode, runs_root, shown, start_run, write_summary  # noqa: E402
from llm_from_scratch.data import python_stdlib_text, read_text, tinyworld_dir  # noqa: E402
from llm_from_scratch.plots import line_plot, merges_plot  # noqa: E402
from llm_from_scratch.tokenizer import (  # noqa: E402
    COURSE_SPLIT_PATTERN,
    EOS_TOKEN,
    SPECIAL_TOKENS,
    Tokenizer,
    bpe_encode,
    learn_merges,
    ranks_from_merges,
)

DEFAULT_VOCAB = 768  # chosen from the sweep below: see notebooks/01_tokenizer_and_data.ipynb
SWEEP = (256 + 4, 384, 512, 640, 768, 1024, 2048, 4096)
WORD = regex.compile(r" ?\p{L}+")  # a word as the split pattern sees it (with its leading space)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB,
                    help=f"tokens in all, the 4 special ones included (default {DEFAULT_VOCAB})")
    ap.add_argument("--train-text", type=Path, help="train the tokenizer on this UTF-8 file instead of the tiny world")
    ap.add_argument("--text", type=Path,
                    help="real text to measure bytes/token on (default: the Python standard library's sources)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the tiny world (default 0)")
    ap.add_argument("--out", type=Path, help="output folder (default: runs/tokenizer)")
    ap.add_argument("--quick", action="store_true", help="a smoke run on tiny data (also LLMFS_QUICK=1)")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    cli.add_fast_arg(ap)
    ap.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    args = ap.parse_args(argv)
    args.quick = args.quick or quick_mode()
    if args.vocab_size < 256 + len(SPECIAL_TOKENS):
        ap.error(f"--vocab-size {args.vocab_size}: must be at least {256 + len(SPECIAL_TOKENS)} "
                 f"(256 bytes + {len(SPECIAL_TOKENS)} special tokens)")
    return args


def single_token_word_fraction(text: str, ranks: dict[bytes, int]) -> float:
    """Fraction of word occurrences (letters, with their leading space) that are one token."""
    words = Counter(WORD.findall(text))
    single = sum(n for w, n in words.items() if w.encode("utf-8") in ranks)
    return single / max(1, sum(words.values()))


def bytes_per_token(tok: Tokenizer, text: str) -> float:
    return len(text.encode("utf-8")) / max(1, len(tok.encode(text, allowed_special={EOS_TOKEN})))


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = args.out or runs_root(args.quick) / "tokenizer"
    start_run(out, fresh=("metrics.jsonl",))  # this run's metrics only; no summary until it finishes
    say = print

    # 1. the tiny world ------------------------------------------------------------------------
    sizes = dataset_files.QUICK_SIZES if args.quick else {}
    t0 = time.perf_counter()
    paths = dataset_files.ensure_datasets(tinyworld_dir(args.quick), seed=args.seed, **sizes)
    meta = json.loads(paths["pretrain_meta"].read_text())["splits"]
    say(f"tiny world: {paths['pretrain_train'].parent} ready in {time.perf_counter() - t0:.1f}s")
    train_docs = dataset_files.load_pretraining(paths["pretrain_train"])
    val_docs = dataset_files.load_pretraining(paths["pretrain_val"])
    train_text = paths["pretrain_train"].read_text(encoding="utf-8")
    val_text = paths["pretrain_val"].read_text(encoding="utf-8")
    vocab_words = len(tinyworld.vocabulary())
    say(f"  {len(train_docs):,} train / {len(val_docs):,} val documents, {len(train_text):,} chars of training text, "
        f"{vocab_words} distinct words")
    say(f"  entropy floor: {meta['val']['nats_per_char']:.4f} nats/char (the generator's own choices)")
    for doc in val_docs[:3]:
        say("  | " + doc.replace("\n", " ")[:160])

    # 2. train BPE -----------------------------------------------------------------------------
    corpus = read_text(args.train_text) if args.train_text else train_text.replace(tinyworld.DOC_SEPARATOR, "\n")
    n_ordinary = max(SWEEP[-1], args.vocab_size) - len(SPECIAL_TOKENS)
    t0 = time.perf_counter()
    merges = learn_merges(corpus, n_ordinary, COURSE_SPLIT_PATTERN, progress=not args.quiet)
    train_seconds = time.perf_counter() - t0
    say(f"BPE: {len(merges)} merges learned on {len(corpus):,} chars in {train_seconds:.1f}s")
    saturated = 256 + len(merges) + len(SPECIAL_TOKENS)  # every chunk of the corpus is one token from here on
    if saturated < n_ordinary + len(SPECIAL_TOKENS):
        say(f"  the corpus ran out of pairs: every chunk is a single token at {saturated} tokens")
    if args.vocab_size > saturated:
        say(f"  --vocab-size {args.vocab_size} is more than this corpus can use; the tokenizer has {saturated} tokens")
    # BPE is greedy, so the first k merges of a long run ARE the k-merge tokenizer: one training gives the whole sweep
    all_ranks = ranks_from_merges(merges)
    ranks = {b: r for b, r in all_ranks.items() if r < args.vocab_size - len(SPECIAL_TOKENS)}
    tok = Tokenizer.from_ranks(ranks, pattern=COURSE_SPLIT_PATTERN)

    first = [tok.token_bytes(r).decode("utf-8", errors="replace").replace(" ", "·")
             for r in range(256, min(286, 256 + len(merges)))]
    merges_plot(first, [c for _, c in merges[: len(first)]], out / "first_merges.png")
    say("first merges: " + "  ".join(first[:15]))

    # 3. bytes per token: tiny world and real text -----------------------------------------------
    real_text = read_text(args.text) if args.text else python_stdlib_text(50_000 if args.quick else 300_000)
    real_name = str(args.text) if args.text else "Python stdlib sources"
    val_plain = val_text.replace(tinyworld.DOC_SEPARATOR, "\n")  # documents as plain text, for the word counts
    sweep = sorted({v for v in SWEEP if v < saturated} | {min(saturated, SWEEP[-1]), tok.vocab_size})
    rows = []
    for v in sweep:
        sub = Tokenizer.from_ranks({b: r for b, r in all_ranks.items() if r < v - len(SPECIAL_TOKENS)},
                                   pattern=COURSE_SPLIT_PATTERN)
        rows.append({
            "vocab_size": v,
            "tinyworld_bytes_per_token": bytes_per_token(sub, val_plain),
            "real_bytes_per_token": bytes_per_token(sub, real_text),
            "single_token_words": single_token_word_fraction(val_plain, sub.ranks),
        })
    line_plot([r["vocab_size"] for r in rows],
              {"tiny world (val)": [r["tinyworld_bytes_per_token"] for r in rows],
               real_name: [r["real_bytes_per_token"] for r in rows]},
              "vocabulary size", "bytes per token", "Compression against vocabulary size", out / "vocab_sweep.png",
              logx=True)
    say("vocab  bytes/token(tiny world)  bytes/token(real)  words that are one token")
    for r in rows:
        say(f"{r['vocab_size']:5d}  {r['tinyworld_bytes_per_token']:22.2f}  {r['real_bytes_per_token']:17.2f}  "
            f"{r['single_token_words']:9.1%}")

    # 4. the entropy floor in nats per token of THIS tokenizer -----------------------------------
    n_val_tokens = len(tok.encode(val_text, allowed_special={EOS_TOKEN}))
    floor = meta["val"]["total_nats"] / n_val_tokens
    say(f"entropy floor with vocab {tok.vocab_size}: {floor:.4f} nats/token on the val split ({n_val_tokens:,} tokens)")

    # 5. our pure-Python encoder against tiktoken -------------------------------------------------
    check = {"tiny world": val_plain[:100_000], real_name: real_text[:50_000]}
    for name, sample in check.items():
        t0 = time.perf_counter()
        ours = bpe_encode(sample, tok.ranks, COURSE_SPLIT_PATTERN)
        t_py = time.perf_counter() - t0
        t0 = time.perf_counter()
        theirs = tok.encode(sample)
        t_tt = time.perf_counter() - t0
        if ours != theirs:
            raise RuntimeError(f"MISMATCH on {name}: the pure-Python encoder and tiktoken disagree")
        say(f"pure-Python encoder == tiktoken on {name}: {len(ours):,} tokens identical "
            f"(tiktoken {t_py / t_tt:.0f}x faster)")

    # 6. save ----------------------------------------------------------------------------------
    tok.save(out)
    row = next((r for r in rows if r["vocab_size"] == tok.vocab_size), None) or {
        "tinyworld_bytes_per_token": bytes_per_token(tok, val_plain),
        "real_bytes_per_token": bytes_per_token(tok, real_text),
        "single_token_words": single_token_word_fraction(val_plain, tok.ranks)}
    summary = {
        "vocab_size": tok.vocab_size, "bpe_train_seconds": train_seconds, "tinyworld_words": vocab_words,
        "tinyworld_train_chars": len(train_text), "tinyworld_generation_seconds": meta["train"].get("seconds"),
        "entropy_floor_nats_per_char": meta["val"]["nats_per_char"], "entropy_floor_nats_per_token": floor,
        "tinyworld_bytes_per_token": row["tinyworld_bytes_per_token"],
        "real_bytes_per_token": row["real_bytes_per_token"],
        "real_text": real_name, "single_token_words": row["single_token_words"], "quick": args.quick,
    }
    append_metrics(out / "metrics.jsonl", summary)
    atomic_write_text(out / "sweep.json", json.dumps(rows, indent=2))
    atomic_write_text(out / "report.md", report(summary, rows, real_name))
    write_summary(out, summary, args.quick)  # last: marks the run finished (later chapters look for it)
    say(f"saved the tokenizer ({tok.vocab_size} tokens) to {shown(out)}")
    return summary


def report(s: dict, rows: list[dict], real_name: str) -> str:
    lines = [
        "## Chapter 1: the tiny world and the tokenizer", "",
        f"- tiny world: {s['tinyworld_words']} distinct words, {s['tinyworld_train_chars']:,} chars of training text",
        f"- entropy floor: {s['entropy_floor_nats_per_char']:.4f} nats/char = "
        f"{s['entropy_floor_nats_per_token']:.4f} nats/token",
        f"- tokenizer: {s['vocab_size']} tokens, trained in {s['bpe_train_seconds']:.1f}s; "
        f"{s['tinyworld_bytes_per_token']:.2f} bytes/token on the tiny world, "
        f"{s['real_bytes_per_token']:.2f} on {real_name}", "",
        "| vocab | bytes/token (tiny world) | bytes/token (real) | one-token words |", "|---:|---:|---:|---:|",
    ]
    lines += [f"| {r['vocab_size']} | {r['tinyworld_bytes_per_token']:.2f} | {r['real_bytes_per_token']:.2f} | "
              f"{r['single_token_words']:.1%} |" for r in rows]
    lines += ["", "![first merges](tokenizer/first_merges.png)", "![vocab sweep](tokenizer/vocab_sweep.png)", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    cli.run(main)
