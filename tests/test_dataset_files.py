"""Tests for llm_from_scratch.dataset_files: the files on disk, and a generator that needs only the standard
library."""

import json

import pytest

from llm_from_scratch import dataset_files
from llm_from_scratch import tinyworld as tw
from llm_from_scratch.checkpoint import read_jsonl


def test_read_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"a": 1}\n{"a": \n')
    with pytest.raises(ValueError, match=r"bad\.jsonl.*line 2"):
        read_jsonl(path)


SMALL = {"n_chars": 20_000, "n_sft": 300, "n_sft_val": 60, "n_pref": 40, "n_pref_val": 20, "n_rl": 30}


def test_write_and_ensure_datasets(tmp_path, monkeypatch):
    paths = dataset_files.ensure_datasets(tmp_path, seed=0, **SMALL)
    assert all(p.exists() for p in paths.values()) and set(paths) == set(dataset_files.FILES)
    meta = json.loads(paths["pretrain_meta"].read_text())
    docs = dataset_files.load_pretraining(paths["pretrain_train"])
    assert len(docs) == meta["splits"]["train"]["n_docs"] and docs[0].startswith(
        tw.generate_pretraining(100, "0/pretrain/train")[0].text)
    assert paths["pretrain_train"].read_text().count(tw.DOC_SEPARATOR) == len(docs)
    assert sum(map(len, docs)) == meta["splits"]["train"]["n_chars"] >= 20_000
    for split in ("train", "val"):
        assert len(read_jsonl(paths[f"sft_{split}"])) == SMALL["n_sft" if split == "train" else "n_sft_val"]
    for name in ("sft", "preferences"):
        train = {r["prompt"] for r in read_jsonl(paths[f"{name}_train"])}
        val = {r["prompt"] for r in read_jsonl(paths[f"{name}_val"])}
        assert val and not train & val
    # same arguments: nothing is regenerated
    calls = []
    real_write = dataset_files.write_datasets
    monkeypatch.setattr(dataset_files, "write_datasets", lambda *a, **k: calls.append(1) or real_write(*a, **k))
    dataset_files.ensure_datasets(tmp_path, seed=0, **SMALL)
    assert calls == []
    paths["rl_stories"].unlink()  # a missing file
    dataset_files.ensure_datasets(tmp_path, seed=0, **SMALL)
    assert calls == [1] and paths["rl_stories"].exists()
    dataset_files.ensure_datasets(tmp_path, seed=0, **{**SMALL, "n_rl": 31})  # other sizes
    assert calls == [1, 1] and len(read_jsonl(paths["rl_stories"])) == 31
    assert not list(tmp_path.glob("*.tmp"))


def test_the_generator_needs_only_the_standard_library():
    import subprocess
    import sys

    code = ("import sys, llm_from_scratch.tinyworld, llm_from_scratch.tasks, llm_from_scratch.gold_rewards, "
            "llm_from_scratch.preferences, llm_from_scratch.dataset_files; "
            "bad = {'torch', 'numpy', 'safetensors'} & set(sys.modules); print(sorted(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
