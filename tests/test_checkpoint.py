import os

import pytest
import torch

from llm_from_scratch import checkpoint as ck
from llm_from_scratch import course


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


def test_atomic_write_fsyncs_the_temp_file_before_renaming_it(tmp_path, monkeypatch):
    """The bytes must be on disk before the rename makes them the file: os.fsync of the temp file (same inode),
    then os.replace of that temp file over the target, in this order."""
    calls = []
    fsync, replace = os.fsync, os.replace

    def recording_fsync(fd):
        calls.append(("fsync", os.fstat(fd).st_ino))
        fsync(fd)

    def recording_replace(src, dst):
        calls.append(("replace", os.stat(src).st_ino, str(dst)))
        replace(src, dst)

    monkeypatch.setattr(ck.os, "fsync", recording_fsync)
    monkeypatch.setattr(ck.os, "replace", recording_replace)
    target = tmp_path / "f.bin"
    ck.atomic_write_bytes(target, b"new bytes")
    assert [c[0] for c in calls] == ["fsync", "replace"]
    (_, synced), (_, renamed, dst) = calls
    assert synced == renamed == os.stat(target).st_ino and dst == str(target)
    assert target.read_bytes() == b"new bytes"


def test_train_state_is_written_atomically(tmp_path, monkeypatch):
    """A crash while train_state.pt is being replaced (os.replace fails) leaves the previous state whole."""
    path = tmp_path / "train_state.pt"
    ck.save_train_state(path, {"step": 3, "w": torch.arange(4.0)})

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(ck.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        ck.save_train_state(path, {"step": 4, "w": torch.zeros(1000)})
    back = ck.load_train_state(path)
    assert back["step"] == 3 and torch.equal(back["w"], torch.arange(4.0))
    assert os.listdir(path.parent) == ["train_state.pt"]  # no temp file left behind


def test_tied_tensors_are_stored_once(tmp_path):
    w = torch.randn(4, 3)
    ck.save_tensors(tmp_path / "m.safetensors", {"wte.weight": w, "lm_head.weight": w, "b": torch.ones(2)})
    back = ck.load_tensors(tmp_path / "m.safetensors")
    assert set(back) == {"wte.weight", "b"} and torch.equal(back["wte.weight"], w)
    assert (tmp_path / "m.safetensors").read_bytes()[:8] != b"\x80\x02\x8a\x0al\xfc\x9cF"  # not a pickle
    with pytest.raises(ck.CheckpointError, match="no weights"):
        ck.load_tensors(tmp_path / "missing.safetensors")


def test_train_state_roundtrip_with_weights_only(tmp_path):
    state = {"step": 7, "rng": {"cpu": torch.get_rng_state()}, "best_val": float("inf"), "opt": {"lr": 0.1}}
    ck.save_train_state(tmp_path / "s.pt", state)
    back = ck.load_train_state(tmp_path / "s.pt")
    assert (back["step"] == 7 and back["best_val"] == float("inf")
            and torch.equal(back["rng"]["cpu"], state["rng"]["cpu"]))


def test_metrics_roundtrip_and_errors(tmp_path):
    f = tmp_path / "metrics.jsonl"
    ck.append_metrics(f, {"step": 1, "loss": 2.5})
    ck.append_metrics(f, {"step": 2, "loss": 2.0})
    assert ck.read_jsonl(f) == [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.0}]
    with open(f, "a") as fh:
        fh.write("{broken\n")
    with pytest.raises(ValueError, match="metrics.jsonl, line 3: not valid JSON"):
        ck.read_jsonl(f)
    f.write_text('{"step": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match="line 2: expected a JSON object"):
        ck.read_jsonl(f)


def test_runs_root_quick_and_override(monkeypatch, tmp_path):
    monkeypatch.delenv("LLMFS_RUNS_DIR", raising=False)
    assert course.runs_root(quick=False) == course.REPO_ROOT / "runs"
    assert course.runs_root(quick=True) == course.REPO_ROOT / "runs" / "quick"
    monkeypatch.setenv("LLMFS_RUNS_DIR", str(tmp_path))
    assert course.runs_root(quick=False) == tmp_path
    # smoke runs stay in their own folder wherever the runs live
    assert course.runs_root(quick=True) == tmp_path / "quick"
    monkeypatch.setenv("LLMFS_QUICK", "1")
    assert course.quick_mode()
    monkeypatch.setenv("LLMFS_QUICK", "0")
    assert not course.quick_mode()


class Tied(torch.nn.Module):
    """A tiny module with a tied pair of weights, like a GPT's embedding and LM head."""

    def __init__(self, config):
        super().__init__()
        self.embed = torch.nn.Embedding(config["vocab_size"], 3)
        self.head = torch.nn.Linear(3, config["vocab_size"], bias=False)
        self.head.weight = self.embed.weight
        self.norm = torch.nn.LayerNorm(3)


def test_model_roundtrip_restores_tied_weights_by_sharing(tmp_path):
    torch.manual_seed(0)
    m = Tied({"vocab_size": 5})
    ck.save_model(m, tmp_path, "toy", {"vocab_size": 5})
    assert set(ck.load_tensors(tmp_path / "model.safetensors")) == {"embed.weight", "norm.weight", "norm.bias"}
    back = ck.load_model(tmp_path, "toy", Tied, vocab_size=5)
    assert back.head.weight is back.embed.weight and torch.equal(back.embed.weight, m.embed.weight)


def test_checkpoint_errors_name_the_folder_tensor_and_chapter(tmp_path):
    run = tmp_path / "sft"  # a run folder the course knows: the error says which chapter rebuilds it
    ck.save_model(Tied({"vocab_size": 5}), run, "toy", {"vocab_size": 5})
    with pytest.raises(ck.CheckpointError, match="holds a 'toy' checkpoint, not a 'gpt' one"):
        ck.load_model(run, "gpt", Tied)
    with pytest.raises(ck.CheckpointError, match=r"vocabulary of 5 tokens but the tokenizer has 6") as err:
        ck.load_model(run, "toy", Tied, vocab_size=6)
    # checkpoint.py knows files, not chapters: course.py turns the folder at fault into the command that remakes it
    assert (err.value.folder == run
            and course.rebuild_hint(err.value.folder).endswith("`python chapters/ch05_sft.py --no-resume`"))
    weights = run / "model.safetensors"
    full = weights.read_bytes()
    weights.write_bytes(full[: len(full) // 2])  # a copy cut short
    with pytest.raises(ck.CheckpointError, match=r"model.safetensors is truncated or corrupt") as err:
        ck.load_model(run, "toy", Tied)
    assert err.value.folder == run
    ck.save_tensors(weights, {"embed.weight": torch.zeros(5, 3)})  # the LayerNorm's tensors are missing
    with pytest.raises(ck.CheckpointError, match="has no tensor 'norm.weight'"):
        ck.load_model(run, "toy", Tied)
    (run / "config.json").write_text('{"vocab_size": 5, "n_layer": 4}')  # the format before checkpoints named a kind
    with pytest.raises(ck.CheckpointError, match=r"older version") as err:
        ck.load_model(run, "toy", Tied)
    assert course.rebuild_hint(err.value.folder) == "; rebuild it with `python chapters/ch05_sft.py --no-resume`"
    assert (course.rebuild_hint(tmp_path / "quick" / "dpo" / "last")
            == "; rebuild it with `python chapters/ch09_dpo.py --quick`")
    assert course.rebuild_hint(tmp_path / "my_own_run") == ""


def test_metrics_are_cut_back_to_the_checkpoint_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    for step in (0, 10, 20, 30, 20):  # a killed run wrote steps 10..30 past its checkpoint of step 20, then resumed
        ck.append_metrics(path, {"step": step, "loss": float(step)})
    ck.append_metrics(path, {"note": "no step"})
    ck.truncate_metrics(path, 20)
    assert [r.get("step") for r in ck.read_jsonl(path)] == [0, 10, 20, 20, None]
    ck.truncate_metrics(path, 10)
    assert [r.get("step") for r in ck.read_jsonl(path)] == [0, 10, None]
    ck.truncate_metrics(tmp_path / "none.jsonl", 5)  # nothing to cut: no error, no file made
    assert not (tmp_path / "none.jsonl").exists()


def test_prerequisite_refuses_with_the_command_and_never_builds_on_a_quick_run(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMFS_RUNS_DIR", str(tmp_path))
    with pytest.raises(course.PrerequisiteError, match="python chapters/ch04_pretrain.py`"):
        course.prerequisite("pretrain", quick=False, build=False)
    with pytest.raises(course.PrerequisiteError, match="python chapters/ch04_pretrain.py --quick`"):
        course.prerequisite("pretrain", quick=True, build=False)
    course.write_summary(tmp_path / "quick" / "pretrain", {"steps": 3}, quick=True)
    assert course.prerequisite("pretrain", quick=True, build=False) == tmp_path / "quick" / "pretrain"
    course.write_summary(tmp_path / "pretrain", {"steps": 3}, quick=True)  # a smoke run where a real one belongs
    with pytest.raises(course.PrerequisiteError, match="quick .smoke. run: a real run cannot build on it"):
        course.prerequisite("pretrain", quick=False, build=False)
    ck.atomic_write_text(tmp_path / "pretrain" / "summary.json", '{"steps": 3}')  # older runs did not say
    with pytest.raises(course.PrerequisiteError, match="does not record whether it was quick"):
        course.require_real(tmp_path / "pretrain" / "last", quick=False)
    course.write_summary(tmp_path / "pretrain", {"steps": 1200}, quick=False)
    assert course.prerequisite("pretrain", quick=False, build=False) == tmp_path / "pretrain"
