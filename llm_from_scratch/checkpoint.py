"""Runs on disk: where they live, their metrics, and files that survive a crash.

Atomic writes: write a temp file in the same folder, fsync, then `os.replace` it over the target.
`os.replace` is atomic when source and target are on the same file system, so a reader sees either
the old file or the new one, never half of one, and a crash mid-write loses nothing already saved.

Later chapters add the model checkpoints here (safetensors weights + JSON config).
"""

from __future__ import annotations

import io
import json
import os
import tempfile
from pathlib import Path

import safetensors.torch
import torch


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write `data` to `path` atomically (temp file + fsync + rename). Creates the parent folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
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


# ----------------------------------------------------------------------------- where runs live

REPO_ROOT = Path(__file__).resolve().parents[1]


def quick_mode() -> bool:
    """True when `LLMFS_QUICK=1`: every chapter script and notebook shrinks to a smoke run."""
    return os.environ.get("LLMFS_QUICK", "") not in ("", "0")


def runs_root(quick: bool | None = None) -> Path:
    """The folder every run writes into: `$LLMFS_RUNS_DIR` if set, else `runs/` (quick runs: `runs/quick/`,
    so a smoke run never overwrites the artifacts of a real one)."""
    quick = quick_mode() if quick is None else quick
    if os.environ.get("LLMFS_RUNS_DIR"):
        return Path(os.environ["LLMFS_RUNS_DIR"])
    return REPO_ROOT / "runs" / "quick" if quick else REPO_ROOT / "runs"


def append_metrics(path: str | os.PathLike, record: dict) -> None:
    """Append one JSON line to `metrics.jsonl` (appends of one short line are all-or-nothing in practice)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Every record of a `metrics.jsonl`; a malformed line is an error naming the file and line."""
    path = Path(path)
    records = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}, line {lineno}: not valid JSON ({err.msg})") from err
    return records


# ----------------------------------------------------------------------------- model weights and training state


def save_tensors(path: str | os.PathLike, tensors: dict, metadata: dict[str, str] | None = None) -> Path:
    """Weights as safetensors (never pickle), written atomically.

    Tensors that share storage (a tied LM head and token embedding) are stored once: safetensors
    refuses aliases, and the model re-ties them when it is built.
    """
    unique, seen = {}, set()
    for name, t in tensors.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key not in seen:
            seen.add(key)
            unique[name] = t.detach().contiguous().cpu()
    return atomic_write_bytes(path, safetensors.torch.save(unique, metadata=metadata))


def load_tensors(path: str | os.PathLike, device: str = "cpu") -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no weights at {path}")
    return safetensors.torch.load_file(str(path), device=str(device))


def save_train_state(path: str | os.PathLike, state: dict) -> Path:
    """Optimizer state, step, RNG states: tensors and plain Python values only, so `torch.load(weights_only=True)`
    can read it back without running any pickled code."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return atomic_write_bytes(path, buf.getvalue())


def load_train_state(path: str | os.PathLike) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)
