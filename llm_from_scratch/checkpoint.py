"""Runs on disk: where they live, their metrics, model checkpoints, and files that survive a crash.

Atomic writes: write a temp file in the same folder, fsync, then `os.replace` it over the target.
`os.replace` is atomic when source and target are on the same file system, so a reader sees either
the old file or the new one, never half of one, and a crash mid-write loses nothing already saved.

One checkpoint format for every kind of model: a folder with `model.safetensors` (the weights, never a
pickle) and `config.json` = {"kind": "gpt" | "reward_model" | ..., "config": {...}}, enough to rebuild the
module before its weights are loaded. Tensors that share storage (a tied LM head and token embedding)
are stored once and shared again on load. Every error names the folder, the tensor and the chapter
that rebuilds the run.

Runs: `runs/<stage>/` for real runs, `runs/quick/<stage>/` for smoke runs (`LLMFS_QUICK=1`), so a
smoke run never lands where a real one belongs; `prerequisite(stage)` finds, or builds, an earlier
chapter's run for a later one.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
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


# ----------------------------------------------------------------------------- where runs live

REPO_ROOT = Path(__file__).resolve().parents[1]


def quick_mode() -> bool:
    """True when `LLMFS_QUICK=1`: every chapter script and notebook shrinks to a smoke run."""
    return os.environ.get("LLMFS_QUICK", "") not in ("", "0")


def runs_root(quick: bool | None = None) -> Path:
    """The folder a run writes into: `runs/` (or `$LLMFS_RUNS_DIR`) for real runs, and its `quick/` subfolder for
    smoke runs, so a smoke run never overwrites, or passes for, the artifacts of a real one."""
    quick = quick_mode() if quick is None else quick
    base = Path(os.environ["LLMFS_RUNS_DIR"]) if os.environ.get("LLMFS_RUNS_DIR") else REPO_ROOT / "runs"
    return base / "quick" if quick else base


def append_metrics(path: str | os.PathLike, record: dict) -> None:
    """Append one JSON line to `metrics.jsonl` (appends of one short line are all-or-nothing in practice).

    Keys follow one scheme, `section/name`: `loss/train`, `loss/val`, `train/lr`, `train/grad_norm`,
    `val/accuracy`, `rewards/accuracies`, ... plus the plain counters `step` and `tokens`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


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
        raise CheckpointError(f"no weights at {path}{rebuild_hint(path.parent)}")
    try:
        return safetensors.torch.load_file(str(path), device=str(device))
    except (safetensors.SafetensorError, OSError, ValueError) as err:  # a bad header, a short file
        raise CheckpointError(f"{path} is truncated or corrupt ({type(err).__name__}: {err}){rebuild_hint(path.parent)}") from None


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, corrupt, of the wrong kind, or for another vocabulary."""


def save_model(model: nn.Module, folder: str | os.PathLike, kind: str, config: dict) -> Path:
    """`model.safetensors` (the state dict) + `config.json` ({"kind", "config"}) in `folder`, both atomic."""
    folder = Path(folder)
    save_tensors(folder / "model.safetensors", model.state_dict())
    atomic_write_text(folder / "config.json", json.dumps({"kind": kind, "config": config}, indent=2) + "\n")
    return folder


def read_config(folder: str | os.PathLike, kind: str) -> dict:
    """The `config` of a checkpoint folder, checked to be of `kind`."""
    folder = Path(folder)
    file = folder / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{folder} is not a checkpoint folder: {file} does not exist{rebuild_hint(folder)}")
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{file} is not valid JSON ({err.msg}){rebuild_hint(folder)}") from None
    if not isinstance(meta, dict) or "kind" not in meta or "config" not in meta:
        raise CheckpointError(f"{file} names no kind of model: it was written by an older version of the course"
                              f"{rebuild_hint(folder)}")
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
                              f"tokenizer has {vocab_size}: they do not belong together{rebuild_hint(folder)}")
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
            raise CheckpointError(f"{path} has no tensor {names[0]!r}{rebuild_hint(path.parent)}")
        for n in names:
            state[n] = stored[found[0]]
    unexpected = sorted(set(stored) - set(state))
    if unexpected:
        raise CheckpointError(f"{path} holds tensors this model does not have: {', '.join(unexpected[:5])}"
                              f"{rebuild_hint(path.parent)}")
    try:
        model.load_state_dict(state)
    except RuntimeError as err:  # a shape mismatch
        raise CheckpointError(f"{path} does not fit the model built from its config.json: {err}"
                              f"{rebuild_hint(path.parent)}") from None
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


# ----------------------------------------------------------------------------- runs that later chapters build on

STAGES = {  # run folder -> (the chapter script that makes it, how long its real run took on a 2-core CPU)
    "tokenizer": ("ch01_tokenizer.py", "about 10 seconds"),
    "pretrain": ("ch04_pretrain.py", "about 4 minutes"),
    "sft": ("ch05_sft.py", "about 4 minutes"),
    "reward_model": ("ch06_reward_model.py", "about 2 minutes"),
    "pg_word-problems_rloo": ("ch07_policy_gradient.py", "about 3 minutes"),
    "ppo_stories": ("ch08_ppo.py", "about 4 minutes"),
    "dpo": ("ch09_dpo.py", "about 5 minutes"),
}
RESUMABLE = ("pretrain", "sft")  # these continue an interrupted run in place: rebuilding one starts over


class PrerequisiteError(RuntimeError):
    """An earlier chapter's run is missing (and may not be built here) or cannot be built on."""


def chapter_command(stage: str, quick: bool = False, again: bool = False) -> str:
    """The command that makes a stage's run; again=True: the one that makes it anew over a broken one."""
    return (f"python chapters/{STAGES[stage][0]}" + (" --quick" if quick else "")
            + (" --no-resume" if again and stage in RESUMABLE else ""))


def rebuild_hint(folder: Path) -> str:
    """'; rebuild it with `python chapters/chNN_....py`' when the folder is (inside) a known run, else ''."""
    for part in (folder.name, folder.parent.name):
        if part in STAGES:
            return f"; rebuild it with `{chapter_command(part, quick='quick' in folder.parts, again=True)}`"
    return ""


def shown(path: str | os.PathLike) -> str:
    """A path as a person should read it: relative to the repository when it is inside it."""
    path = Path(path).resolve()
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


def write_summary(folder: str | os.PathLike, summary: dict, quick: bool) -> Path:
    """`summary.json`, written last by every chapter run: it marks the run finished and records whether it was
    a quick (smoke) run, so that a real run never builds on a smoke run."""
    return atomic_write_text(Path(folder) / "summary.json", json.dumps({"quick": quick, **summary}, indent=2))


def start_run(folder: str | os.PathLike, fresh: tuple[str, ...] = ()) -> Path:
    """Called when a chapter run starts: its folder no longer holds a finished run (summary.json goes, and so do
    the `fresh` files a run that does not resume starts anew, e.g. metrics.jsonl) until the run writes its own."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("summary.json", *fresh):
        (folder / name).unlink(missing_ok=True)
    return folder


def finished_run(folder: str | os.PathLike) -> dict | None:
    """The summary of the finished run in `folder`, or None when there is none."""
    file = Path(folder) / "summary.json"
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise PrerequisiteError(f"{file} is not valid JSON ({err.msg}){rebuild_hint(Path(folder))}") from None


def weights_file_digest(folder: str | os.PathLike) -> str | None:
    """The first 12 hex digits of the SHA-256 of `folder/model.safetensors` (None when there is none): the same
    digest means the very same weights, so notebooks that print it can be seen to read one chain's model."""
    file = Path(folder) / "model.safetensors"
    return hashlib.sha256(file.read_bytes()).hexdigest()[:12] if file.is_file() else None


def require_real(folder: str | os.PathLike, quick: bool) -> None:
    """A real run refuses to start from a quick one (or from one that does not say which it was)."""
    if quick:
        return
    if runs_root(quick=True).resolve() in Path(folder).resolve().parents:
        raise PrerequisiteError(f"{folder} is inside the quick runs folder: a real run cannot build on it")
    summary = finished_run(folder) or finished_run(Path(folder).parent)  # a run folder, or its last/ checkpoint
    if summary is None:  # a checkpoint of the user's own, not a course run
        return
    if summary.get("quick") is not False:
        what = "a quick (smoke) run" if summary.get("quick") else "a run that does not record whether it was quick"
        raise PrerequisiteError(f"{folder} holds {what}: a real run cannot build on it{rebuild_hint(Path(folder))}")


def prerequisite(stage: str, quick: bool | None = None, build: bool = True, quiet: bool = True) -> Path:
    """The finished run of an earlier chapter that a later one starts from: `runs/<stage>` (quick mode:
    `runs/quick/<stage>`). When it is missing and `build`, the chapter that makes it runs now with its real
    defaults (quick mode: as a smoke run, under runs/quick/), saying so and how long it takes; when not
    `build`, a PrerequisiteError gives the exact command to run."""
    quick = quick_mode() if quick is None else quick
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}: choose one of {', '.join(STAGES)}")
    folder = runs_root(quick) / stage
    command = chapter_command(stage, quick)
    if finished_run(folder) is not None:
        require_real(folder, quick)
        return folder
    if not build:
        raise PrerequisiteError(f"no finished {stage} run in {folder}: make it first with `{command}`")
    print(f"no finished {stage} run in {shown(folder)}: running "
          f"`{command}` with its defaults now ({'seconds' if quick else STAGES[stage][1]})", flush=True)
    env = dict(os.environ, LLMFS_QUICK="1" if quick else "0", PYTHONUNBUFFERED="1")
    with subprocess.Popen([sys.executable, str(REPO_ROOT / "chapters" / STAGES[stage][0])] + (["--quiet"] if quiet else []),
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as child:
        for line in child.stdout:  # through this process's stdout, so that a notebook cell shows it too
            print(f"  [{stage}] {line}", end="", flush=True)
    if child.returncode != 0 or finished_run(folder) is None:
        raise PrerequisiteError(f"`{command}` failed (exit code {child.returncode}; its output is above)")
    return folder
