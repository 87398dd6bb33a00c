"""The tiny world's datasets on disk: every file the chapters read, written from one seed.

    pretrain_train.txt, pretrain_val.txt       pretraining documents (tinyworld.py), each followed by DOC_SEPARATOR
    pretrain_meta.json                         generator version, seed, sizes and, per split: documents, characters,
                                               total nats and the entropy floor per character (tinyworld.nats_per_char)
    sft_train.jsonl, sft_val.jsonl             instruction examples (tasks.py), tasks mixed by SFT_WEIGHTS and
                                               SFT_VAL_WEIGHTS
    preferences_train.jsonl, ..._val.jsonl     labelled story pairs (preferences.py)
    rl_verifiable.jsonl, rl_stories.jsonl      the RL prompt sets (tasks.rl_prompts)

Each kind of data is drawn from its own seed string ("{seed}/pretrain/train", "{seed}/sft/val", "{seed}/pref/train",
"{seed}/rl/stories", ...), so the size of one kind leaves the other files unchanged; the train and val sides of the
SFT examples and of the preference pairs never share a prompt (tasks.prompt_split). DEFAULT_SIZES are the course's,
QUICK_SIZES the smoke runs'. The meta file is written last, so it marks a complete set: ensure_datasets regenerates
when a file is missing or the meta's generator version, seed or sizes differ (bump GENERATOR_VERSION whenever the
generator changes what it writes).

    python -m llm_from_scratch.dataset_files [DATA_DIR]    # default sizes, seed 0; prints the numbers of data/README.md
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from llm_from_scratch.checkpoint import atomic_write_text, read_jsonl  # the project's atomic writer, JSONL reader
from llm_from_scratch.preferences import bayes_accuracy, preference_pairs
from llm_from_scratch.tasks import RL_KINDS, SFT_VAL_WEIGHTS, SFT_WEIGHTS, TASKS, generate_instructions, rl_prompts
from llm_from_scratch.tinyworld import DOC_SEPARATOR, generate_pretraining, nats_per_char, vocabulary

FILES = {"pretrain_train": "pretrain_train.txt", "pretrain_val": "pretrain_val.txt",
         "pretrain_meta": "pretrain_meta.json", "sft_train": "sft_train.jsonl", "sft_val": "sft_val.jsonl",
         "preferences_train": "preferences_train.jsonl", "preferences_val": "preferences_val.jsonl",
         "rl_verifiable": "rl_verifiable.jsonl", "rl_stories": "rl_stories.jsonl"}
DEFAULT_SIZES = {"n_chars": 4_000_000, "val_fraction": 0.05, "n_sft": 20_000, "n_sft_val": 1_500,
                 "n_pref": 10_000, "n_pref_val": 1_000, "n_rl": 2_000}
# the smoke runs' sizes (--quick)
QUICK_SIZES = {"n_chars": 200_000, "n_sft": 500, "n_sft_val": 100, "n_pref": 300, "n_pref_val": 100, "n_rl": 100}
GENERATOR_VERSION = 15  # bump when the generator changes, so ensure_datasets regenerates


def _jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def write_datasets(data_dir: str | Path, seed: int = 0, **sizes) -> dict[str, Path]:
    """Generate every file into data_dir (sizes: any of DEFAULT_SIZES' keys). Returns {name: path}."""
    unknown = set(sizes) - set(DEFAULT_SIZES)
    if unknown:
        raise TypeError(f"unknown sizes {sorted(unknown)}; choose from {sorted(DEFAULT_SIZES)}")
    sizes = {**DEFAULT_SIZES, **sizes}
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    paths = {k: data_dir / v for k, v in FILES.items()}
    splits = {}
    for split, n_chars in (("train", sizes["n_chars"]), ("val", int(sizes["n_chars"] * sizes["val_fraction"]))):
        t0, split_seed = time.perf_counter(), f"{seed}/pretrain/{split}"
        samples = generate_pretraining(n_chars, split_seed)
        seconds = time.perf_counter() - t0
        atomic_write_text(paths[f"pretrain_{split}"], "".join(s.text + DOC_SEPARATOR for s in samples))
        nats = sum(-s.logp for s in samples)
        splits[split] = {"n_docs": len(samples), "n_chars": sum(len(s.text) for s in samples), "total_nats": nats,
                         "nats_per_char": nats_per_char(samples), "seed": split_seed, "seconds": round(seconds, 3)}
    for split, n in (("train", sizes["n_sft"]), ("val", sizes["n_sft_val"])):
        weights = [(SFT_WEIGHTS if split == "train" else SFT_VAL_WEIGHTS)[t] for t in TASKS]
        rows = [e.to_dict() for e in generate_instructions(n, f"{seed}/sft/{split}", weights=weights, split=split)]
        atomic_write_text(paths[f"sft_{split}"], _jsonl(rows))
    for split, n in (("train", sizes["n_pref"]), ("val", sizes["n_pref_val"])):
        pairs = preference_pairs(n, f"{seed}/pref/{split}", split=split)
        atomic_write_text(paths[f"preferences_{split}"], _jsonl(pairs))
    for kind in RL_KINDS:
        atomic_write_text(paths[f"rl_{kind}"], _jsonl(rl_prompts(kind, sizes["n_rl"], f"{seed}/rl/{kind}")))
    meta = {"generator_version": GENERATOR_VERSION, "seed": seed, "sizes": sizes, "doc_separator": DOC_SEPARATOR,
            "splits": splits}
    atomic_write_text(paths["pretrain_meta"], json.dumps(meta, indent=2))  # written last: it marks a complete set
    return paths


def ensure_datasets(data_dir: str | Path, seed: int = 0, **sizes) -> dict[str, Path]:
    """Return the paths, regenerating if a file is missing or the meta's version, seed or sizes differ."""
    paths = {k: Path(data_dir) / v for k, v in FILES.items()}
    want = {**DEFAULT_SIZES, **sizes}
    if all(p.exists() for p in paths.values()):
        try:
            meta = json.loads(paths["pretrain_meta"].read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            meta = {}
        if (meta.get("generator_version"), meta.get("seed"), meta.get("sizes")) == (GENERATOR_VERSION, seed, want):
            return paths
    return write_datasets(data_dir, seed, **sizes)


def load_pretraining(path: str | Path) -> list[str]:
    """The documents of a pretrain_*.txt file (each one was followed by DOC_SEPARATOR)."""
    docs = Path(path).read_text(encoding="utf-8").split(DOC_SEPARATOR)
    return docs[:-1] if docs and docs[-1] == "" else docs


# python -m llm_from_scratch.dataset_files [DATA_DIR]: write the default files, print the numbers of data/README.md
if __name__ == "__main__":
    out = write_datasets(sys.argv[1] if len(sys.argv) > 1 else "data/tinyworld")
    meta = json.loads(out["pretrain_meta"].read_text())
    print(f"vocabulary: {len(vocabulary())} words")
    for split, m in meta["splits"].items():
        print(f"pretrain {split}: {m['n_docs']} docs, {m['n_chars']} chars, {m['nats_per_char']:.4f} nats/char, "
              f"{m['seconds']:.2f} s")
    for split in ("train", "val"):
        print(f"preferences {split}: bayes ceiling {bayes_accuracy(read_jsonl(out[f'preferences_{split}'])):.4f}")
