import os

import pytest
import torch

from llm_from_scratch import checkpoint as ck


def test_atomic_write_leaves_old_file_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "f.txt"
    ck.atomic_write_text(target, "old")

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(ck.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        ck.atomic_write_text(target, "new")
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["f.txt"]  # no temp file left behind


def test_tied_tensors_are_stored_once(tmp_path):
    w = torch.randn(4, 3)
    ck.save_tensors(tmp_path / "m.safetensors", {"wte.weight": w, "lm_head.weight": w, "b": torch.ones(2)})
    back = ck.load_tensors(tmp_path / "m.safetensors")
    assert set(back) == {"wte.weight", "b"} and torch.equal(back["wte.weight"], w)
    assert (tmp_path / "m.safetensors").read_bytes()[:8] != b"\x80\x02\x8a\x0al\xfc\x9cF"  # not a pickle
    with pytest.raises(FileNotFoundError, match="no weights"):
        ck.load_tensors(tmp_path / "missing.safetensors")


def test_train_state_roundtrip_with_weights_only(tmp_path):
    state = {"step": 7, "rng": {"cpu": torch.get_rng_state()}, "best_val": float("inf"), "opt": {"lr": 0.1}}
    ck.save_train_state(tmp_path / "s.pt", state)
    back = ck.load_train_state(tmp_path / "s.pt")
    assert back["step"] == 7 and back["best_val"] == float("inf") and torch.equal(back["rng"]["cpu"], state["rng"]["cpu"])


def test_metrics_roundtrip_and_errors(tmp_path):
    f = tmp_path / "metrics.jsonl"
    ck.append_metrics(f, {"step": 1, "loss": 2.5})
    ck.append_metrics(f, {"step": 2, "loss": 2.0})
    assert ck.read_metrics(f) == [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.0}]
    with open(f, "a") as fh:
        fh.write("{broken\n")
    with pytest.raises(ValueError, match="line 3"):
        ck.read_metrics(f)


def test_runs_root_quick_and_override(monkeypatch, tmp_path):
    monkeypatch.delenv("LLMFS_RUNS_DIR", raising=False)
    assert ck.runs_root(quick=False) == ck.REPO_ROOT / "runs"
    assert ck.runs_root(quick=True) == ck.REPO_ROOT / "runs" / "quick"
    monkeypatch.setenv("LLMFS_RUNS_DIR", str(tmp_path))
    assert ck.runs_root(quick=True) == tmp_path
    monkeypatch.setenv("LLMFS_QUICK", "1")
    assert ck.quick_mode()
    monkeypatch.setenv("LLMFS_QUICK", "0")
    assert not ck.quick_mode()
