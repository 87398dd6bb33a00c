"""The course's runs: where they live, which chapter makes which, and how a later chapter finds (or builds) an
earlier one's run.

Runs: `runs/<stage>/` for real runs, `runs/quick/<stage>/` for smoke runs (`LLMFS_QUICK=1`), so a smoke run never
lands where a real one belongs. A run is finished when its folder holds `summary.json` (written last, recording
whether it was a quick run); a real run refuses to build on a quick one. `prerequisite(stage)` returns an earlier
chapter's finished run, running that chapter's script first when it is missing.

This is the one library module that knows the chapter scripts (`STAGES`); `checkpoint.py` knows only files.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from llm_from_scratch import reproducible
from llm_from_scratch.checkpoint import atomic_write_text
from llm_from_scratch.distributed import TORCHRUN_VARIABLES

REPO_ROOT = Path(__file__).resolve().parents[1]

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


def quick_mode() -> bool:
    """True when `LLMFS_QUICK=1`: every chapter script and notebook shrinks to a smoke run."""
    return os.environ.get("LLMFS_QUICK", "") not in ("", "0")


def runs_root(quick: bool | None = None) -> Path:
    """The folder a run writes into: `runs/` (or `$LLMFS_RUNS_DIR`) for real runs, and its `quick/` subfolder for
    smoke runs, so a smoke run never overwrites, or passes for, the artifacts of a real one."""
    quick = quick_mode() if quick is None else quick
    base = Path(os.environ["LLMFS_RUNS_DIR"]) if os.environ.get("LLMFS_RUNS_DIR") else REPO_ROOT / "runs"
    return base / "quick" if quick else base


def shown(path: str | os.PathLike) -> str:
    """A path as a person should read it: relative to the repository when it is inside it."""
    path = Path(path).resolve()
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


def chapter_command(stage: str, quick: bool = False, again: bool = False) -> str:
    """The command that makes a stage's run; again=True: the one that makes it anew over a broken one."""
    return (f"python chapters/{STAGES[stage][0]}" + (" --quick" if quick else "")
            + (" --no-resume" if again and stage in RESUMABLE else ""))


def rebuild_hint(folder: str | os.PathLike | None) -> str:
    """'; rebuild it with `python chapters/chNN_....py`' when the folder is (inside) a known run, else ''."""
    if folder is None:
        return ""
    folder = Path(folder)
    for part in (folder.name, folder.parent.name):
        if part in STAGES:
            return f"; rebuild it with `{chapter_command(part, quick='quick' in folder.parts, again=True)}`"
    return ""


def write_summary(folder: str | os.PathLike, summary: dict, quick: bool) -> Path:
    """`summary.json`, written last by every chapter run: it marks the run finished and records whether it was
    a quick (smoke) run, so that a real run never builds on a smoke run, and the CPU arithmetic it ran
    (`reproducible.record()`: the CPU, the kernel level, the BLAS branch, the threads, whether it is the course's
    reproducible setting), so that a course run keeps it only in the same mode."""
    record = {"quick": quick, **summary, "cpu": reproducible.record()}
    return atomic_write_text(Path(folder) / "summary.json", json.dumps(record, indent=2))


def same_cpu_mode(summary: dict | None) -> bool:
    """Whether a finished run (its summary) was computed in the CPU mode this process runs, reproducible or not
    (`reproducible.record()`; a run from before the mode was not): a course run keeps a finished run only then,
    since the other mode makes another chain."""
    return bool(summary) and summary.get("cpu", {}).get("reproducible", False) == reproducible.reproducible()


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
    `build`, a PrerequisiteError gives the exact command to run. A finished run made in another CPU mode is used,
    with a note that says so."""
    quick = quick_mode() if quick is None else quick
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}: choose one of {', '.join(STAGES)}")
    folder = runs_root(quick) / stage
    command = chapter_command(stage, quick)
    if finished_run(folder) is not None:
        require_real(folder, quick)
        if not same_cpu_mode(finished_run(folder)):  # usable, but another chain: say so (run_all.py rebuilds it)
            print(f"note: {shown(folder)} was made in another CPU mode than this one ({reproducible.describe()}); "
                  "what builds on it is another chain than the course's (`python chapters/run_all.py` remakes it)",
                  flush=True)
        return folder
    if not build:
        raise PrerequisiteError(f"no finished {stage} run in {folder}: make it first with `{command}`")
    print(f"no finished {stage} run in {shown(folder)}: running "
          f"`{command}` with its defaults now ({'seconds' if quick else STAGES[stage][1]})", flush=True)
    env = dict(os.environ, LLMFS_QUICK="1" if quick else "0", PYTHONUNBUFFERED="1")
    for name in TORCHRUN_VARIABLES:  # under torchrun (rank 0 builds it): the earlier chapter runs as one process
        env.pop(name, None)
    script = str(REPO_ROOT / "chapters" / STAGES[stage][0])
    with subprocess.Popen([sys.executable, script] + (["--quiet"] if quiet else []),
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as child:
        for line in child.stdout:  # through this process's stdout, so that a notebook cell shows it too
            print(f"  [{stage}] {line}", end="", flush=True)
    if child.returncode != 0 or finished_run(folder) is None:
        raise PrerequisiteError(f"`{command}` failed (exit code {child.returncode}; its output is above)")
    return folder
