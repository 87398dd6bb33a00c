"""Files on disk: metrics, model checkpoints, training state, and writes that survive a crash.

Atomic writes: write a temp file in the same folder, fsync, then `os.replace` it over the target.
`os.replace` is atomic when source and target are on the same file system, so a reader sees either
the old file or the new one, never half of one, and a crash mid-write loses nothing already saved.

One checkpoint format for every kind of model: a folder with `model.safetensors` (the weights, never a
pickle) and `config.json` = {"kind": "gpt" | "reward_model" | ..., "config": {...}}, enough to rebuild the
module before its weights are loaded. Tensors that share storage (a tied LM head and token embedding)
are stored once and shared again on load. Every error names the file and the tensor, and carries the folder at
fault (`CheckpointError.folder`), so a chapter script can add which chapter rebuilds it. This module knows files,
not the course: where runs live and which chapter makes which run are `course.py`'s.

Metrics: one JSON object per line in `metrics.jsonl`, appended as a run goes; a run that resumes or starts over
first cuts the file back to the step its checkpoint holds (`truncate_metrics`), so every step is recorded once.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

# torch and safetensors are imported inside the functions that need them, so that the tiny world's generator
# (standard library only) can use this module's atomic writer and JSONL reader without them.


_UMASK = os.umask(0o022)  # read the process's umask (the only way is to set it) ...
os.umask(_UMASK)  # ... and put it back at once


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write `data` to `path` atomically (temp file + fsync + rename). Creates the parent folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes the file private (0600); give it the permissions open() would
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """`atomic_write_bytes` for UTF-8 text."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def append_metrics(path: str | os.PathLike, record: dict) -> None:
    """Append one JSON line to `metrics.jsonl` (appends of one short line are all-or-nothing in practice).

    Keys follow one scheme, `section/name`: `loss/train`, `loss/val`, `train/lr`, `train/grad_norm`,
    `val/accuracy`, `rewards/accuracies`, ... plus the plain counters `step` and `tokens`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def truncate_metrics(path: str | os.PathLike, step: int) -> None:
    """Cut a `metrics.jsonl` back to the records of steps ≤ `step` (a record without a step counts as step 0), so a
    run that resumes from its checkpoint of `step` records every later step once, not a second time after the ones
    a killed run wrote past its checkpoint. (A run that starts over deletes the file.) Atomic, like every write here."""
    path = Path(path)
    if not path.is_file():
        return
    kept = [r for r in read_jsonl(path) if r.get("step", 0) <= step]
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept))


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Every record of a JSONL file (metrics, datasets, preference pairs); a malformed line or a line that is not
    a JSON object is an error naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    records = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}, line {lineno}: not valid JSON ({err.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}, line {lineno}: expected a JSON object, got {type(record).__name__}")
            records.append(record)
    return records


# ----------------------------------------------------------------------------- model weights and training state


def save_tensors(path: str | os.PathLike, tensors: dict, metadata: dict[str, str] | None = None) -> Path:
    """Weights as safetensors (never pickle), written atomically.

    Tensors that share storage (a tied LM head and token embedding) are stored once: safetensors
    refuses aliases, and the model re-ties them when it is built.
    """
    import safetensors.torch

    unique, seen = {}, set()
    for name, t in tensors.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key not in seen:
            seen.add(key)
            unique[name] = t.detach().contiguous().cpu()
    return atomic_write_bytes(path, safetensors.torch.save(unique, metadata=metadata))


def load_tensors(path: str | os.PathLike, device: str = "cpu") -> dict:
    """The tensors of a safetensors file; a missing, truncated or corrupt file is a CheckpointError naming it."""
    import safetensors
    import safetensors.torch

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no weights at {path}", path.parent)
    try:
        return safetensors.torch.load_file(str(path), device=str(device))
    except (safetensors.SafetensorError, OSError, ValueError) as err:  # a bad header, a short file
        raise CheckpointError(f"{path} is truncated or corrupt ({type(err).__name__}: {err})", path.parent) from None


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, corrupt, of the wrong kind, or for another vocabulary. `folder` is
    the folder at fault, so that whoever knows which chapter makes it (chapters/cli.py, via course.rebuild_hint) can
    say how to rebuild it."""

    def __init__(self, message: str, folder: str | os.PathLike | None = None):
        super().__init__(message)
        self.folder = None if folder is None else Path(folder)


def save_model(model: nn.Module, folder: str | os.PathLike, kind: str, config: dict, state: dict | None = None) -> Path:
    """`model.safetensors` (the state dict, or `state` in its place) + `config.json` ({"kind", "config"}) in
    `folder`, both atomic."""
    folder = Path(folder)
    save_tensors(folder / "model.safetensors", model.state_dict() if state is None else state)
    atomic_write_text(folder / "config.json", json.dumps({"kind": kind, "config": config}, indent=2) + "\n")
    return folder


def read_config(folder: str | os.PathLike, kind: str) -> dict:
    """The `config` of a checkpoint folder, checked to be of `kind`."""
    folder = Path(folder)
    file = folder / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{folder} is not a checkpoint folder: {file} does not exist", folder)
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{file} is not valid JSON ({err.msg})", folder) from None
    if not isinstance(meta, dict) or "kind" not in meta or "config" not in meta:
        raise CheckpointError(f"{file} names no kind of model: it was written by an older version of the course",
                              folder)
    if meta["kind"] != kind:
        raise CheckpointError(f"{folder} holds a {meta['kind']!r} checkpoint, not a {kind!r} one")
    return meta["config"]


def load_model(folder: str | os.PathLike, kind: str, build: Callable[[dict], nn.Module],
               device: str | torch.device = "cpu", vocab_size: int | None = None) -> nn.Module:
    """Rebuild a module from `folder`: `build(config)` makes it (tied weights tied by its constructor), then the
    weights are loaded. A tensor stored once for several names that share it (a tied head) is loaded into the
    one parameter they share. `vocab_size`: the tokenizer's, checked against config["vocab_size"]."""
    folder = Path(folder)
    config = read_config(folder, kind)
    if vocab_size is not None and config.get("vocab_size") not in (None, vocab_size):
        raise CheckpointError(f"the checkpoint in {folder} has a vocabulary of {config['vocab_size']} tokens but the "
                              f"tokenizer has {vocab_size}: they do not belong together", folder)
    model = build(config)
    load_state(model, folder / "model.safetensors")
    return model.to(device)


def load_state(model: nn.Module, path: str | os.PathLike) -> nn.Module:
    """Load a safetensors file into `model` in place. Names that share one tensor in the model (found by
    identity, not by name) need only one of them in the file; a missing or unexpected tensor is an error."""
    path = Path(path)
    stored = load_tensors(path, device=str(next(model.parameters()).device))
    shared: dict[int, list[str]] = {}  # one entry per distinct tensor: every name it goes by
    for name, t in model.state_dict(keep_vars=True).items():
        shared.setdefault(id(t), []).append(name)
    state = {}
    for names in shared.values():
        found = [n for n in names if n in stored]
        if not found:
            raise CheckpointError(f"{path} has no tensor {names[0]!r}", path.parent)
        for n in names:
            state[n] = stored[found[0]]
    unexpected = sorted(set(stored) - set(state))
    if unexpected:
        raise CheckpointError(f"{path} holds tensors this model does not have: {', '.join(unexpected[:5])}",
                              path.parent)
    try:
        model.load_state_dict(state)
    except RuntimeError as err:  # a shape mismatch
        raise CheckpointError(f"{path} does not fit the model built from its config.json: {err}", path.parent) from None
    return model


def save_train_state(path: str | os.PathLike, state: dict) -> Path:
    """Optimizer state, step, RNG states: tensors and plain Python values only, so `torch.load(weights_only=True)`
    can read it back without running any pickled code."""
    import torch

    buf = io.BytesIO()
    torch.save(state, buf)
    return atomic_write_bytes(path, buf.getvalue())


def load_train_state(path: str | os.PathLike) -> dict:
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)
