import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from llm_from_scratch import reproducible  # noqa: E402

# The suite computes in the course's reproducible CPU mode (2 threads, ATen's AVX2 kernels, MKL's COMPATIBLE branch),
# set here before any test imports torch: the same float32 sums on every x86-64 CPU with AVX2, so a test's numbers do
# not depend on the machine CI lands on. The processes the tests start inherit its kernel level and MKL branch (the
# chapter scripts and notebooks apply all of it again, threads included); LLMFS_FAST=1 runs the suite fast.
CPU_MODE = reproducible.apply()


def pytest_report_header(config):
    return CPU_MODE


@pytest.fixture(scope="session")
def quick_env(tmp_path_factory):
    """Environment for running chapter scripts and notebooks as smoke runs: quick mode, and every
    artifact under one temporary runs folder (shared by the chapters, in order, like a real course run)."""
    runs = tmp_path_factory.mktemp("runs")
    env = dict(os.environ, LLMFS_QUICK="1", LLMFS_RUNS_DIR=str(runs), MPLBACKEND="Agg", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env
