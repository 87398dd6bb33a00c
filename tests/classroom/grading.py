"""Run assignments' graders as a student would, each in a fresh process, without paying torch's import each time.

A grading must see only the assignment's own `llm_from_scratch`, never the repository's, so every grading is a new
process. Starting one from nothing costs about 2.5 s on a 2-core CPU (Python, torch, pytest, numpy), more than most
graders' tests take, and the kit's tests grade about 200 assignments. So the processes are forked from a server that
imported those libraries once (multiprocessing's "forkserver"), and nothing of the repository: this module imports
only the standard library, and the child checks that no `llm_from_scratch` or test module came with the fork.
"""

import multiprocessing
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

PRELOAD = ["torch", "numpy", "pytest", "hypothesis", "tiktoken"]  # what every grader imports; never the repository


def _run_pytest(folder: str, repository: str) -> tuple[int, str]:
    """In the forked child: the assignment's folder is the working folder and the first place imports look; the
    repository is off sys.path; pytest's output goes to a file, which is returned with the exit code."""
    leaked = [m for m in sys.modules if m == "llm_from_scratch" or m.startswith(("llm_from_scratch.", "test_"))]
    assert not leaked, f"the grading process already holds {leaked[:3]}: it would not test the assignment's code"
    os.chdir(folder)
    os.environ.clear()
    os.environ.update({"PATH": "/usr/bin:/bin", "HOME": folder, "MPLBACKEND": "Agg", "PYTHONDONTWRITEBYTECODE": "1"})
    sys.dont_write_bytecode = True
    def ours(path: str) -> bool:  # the repository and its tests' folders (not a .venv inside it)
        path = os.path.realpath(path)
        return path == repository or path.startswith(os.path.join(repository, "tests"))
    sys.path[:] = [folder] + [p for p in sys.path if p and not ours(p)]
    import pytest
    import torch
    torch.set_num_threads(1)  # two graders at a time on two cores
    log = Path(folder) / ".grader-output.txt"
    with open(log, "w") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        code = pytest.main(["-q", "-rA", "-p", "no:cacheprovider"])
        sys.stdout.flush()
        sys.stderr.flush()
    return int(code), log.read_text()


_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(PRELOAD)


def grade_all(folders: list[Path], repository: Path, workers: int = 2) -> list[tuple[int, dict[str, list[str]], str]]:
    """Grade each folder in its own process, `workers` at a time. For each: the exit code, {test function: the
    outcomes of its instances}, and the end of the output."""
    repository = os.path.realpath(repository)
    with ProcessPoolExecutor(workers, mp_context=_CONTEXT, max_tasks_per_child=1) as pool:
        runs = [pool.submit(_run_pytest, str(folder), repository) for folder in folders]
        results = []
        for run in runs:
            code, out = run.result(timeout=600)
            outcomes: dict[str, list[str]] = {}
            for status, node in re.findall(r"^(PASSED|FAILED|ERROR) (\S+)", out, re.M):
                outcomes.setdefault(node.split("[")[0], []).append(status)
            results.append((code, outcomes, out[-6000:]))
    return results
