"""Run code as a student's copy would, each time in a fresh process, without paying torch's import each time.

An assignment's grader (tests/classroom) and a module copied out alone (test_standalone.py) must see only the copy's
own `llm_from_scratch`, never the repository's, so each runs in a new process. Starting one from nothing costs about
2.5 s on a 2-core CPU (Python, torch, pytest, numpy), more than most of those tests take, and the suite starts about
250. So the processes are forked from a server that imported those libraries once (multiprocessing's "forkserver"),
and nothing of the repository: this module imports only the standard library, and each child checks that no
`llm_from_scratch` or test module came with the fork.
"""

import importlib
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import NamedTuple

PRELOAD = ["torch", "numpy", "pytest", "hypothesis", "tiktoken"]  # what the copies import; never the repository
PYTEST = ("-q", "-rA", "-p", "no:cacheprovider")


class Run(NamedTuple):
    code: int  # pytest's exit code (0 when only imports were asked for)
    output: str  # what pytest printed
    files: dict[str, str]  # module asked for -> the file it was imported from


def _run_in_copy(folder: str, repository: str, imports: tuple[str, ...], pytest_args: tuple[str, ...] | None,
                 threads: int) -> Run:
    """In the forked child: the copy's folder is the working folder and the first place imports look, the
    repository is off sys.path; import `imports`, then run pytest with `pytest_args` (None: do not), its output
    into a file."""
    leaked = [m for m in sys.modules if m == "llm_from_scratch" or m.startswith(("llm_from_scratch.", "test_"))]
    assert not leaked, f"the fresh process already holds {leaked[:3]}: it would not test the copy's code"
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
    torch.set_num_threads(threads)
    files = {name: importlib.import_module(name).__file__ for name in imports}
    log = Path(folder) / ".pytest-output.txt"
    code = 0
    with open(log, "w") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        if pytest_args is not None:
            code = int(pytest.main(list(pytest_args)))
        sys.stdout.flush()
        sys.stderr.flush()
    return Run(code, log.read_text(), files)


_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(PRELOAD)


def run_isolated(folders: list[Path], repository: Path, *, imports: tuple[str, ...] = (),
                 pytest_args: tuple[str, ...] | None = PYTEST, workers: int = 2) -> list[Run]:
    """For each folder, in its own fresh process (`workers` at a time, the CPU's threads shared among them): import
    `imports` and run pytest there."""
    repository, threads = os.path.realpath(repository), max(1, (os.cpu_count() or 1) // workers)
    with ProcessPoolExecutor(workers, mp_context=_CONTEXT, max_tasks_per_child=1) as pool:
        runs = [pool.submit(_run_in_copy, str(folder), repository, tuple(imports), pytest_args, threads)
                for folder in folders]
        return [run.result(timeout=600) for run in runs]
