import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def quick_env(tmp_path_factory):
    """Environment for running chapter scripts and notebooks as smoke runs: quick mode, and every
    artifact under one temporary runs folder (shared by the chapters, in order, like a real course run)."""
    runs = tmp_path_factory.mktemp("runs")
    env = dict(os.environ, LLMFS_QUICK="1", LLMFS_RUNS_DIR=str(runs), MPLBACKEND="Agg", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env
