import os
import platform
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from llm_from_scratch.device import autocast, available_devices, pick_device, seed_everything

ROOT = Path(__file__).resolve().parents[1]


def test_auto_picks_the_best_available():
    assert pick_device("auto").type == available_devices()[0]
    assert pick_device("CPU") == torch.device("cpu")


def test_missing_device_names_what_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="not available.*available: .*cpu"):
        pick_device("cuda")
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        pick_device("tpu")


def test_seed_everything_repeats_all_three_generators():
    seed_everything(123)
    a = (random.random(), np.random.rand(), torch.rand(3))
    seed_everything(123)
    b = (random.random(), np.random.rand(), torch.rand(3))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


def test_autocast_is_off_on_cpu_unless_asked():
    x = torch.randn(4, 4)
    with autocast("cpu"):
        assert (x @ x).dtype == torch.float32
    with autocast("cpu", dtype=torch.bfloat16):
        assert (x @ x).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        autocast("cpu", dtype="fp8")


def test_precision_names():
    from llm_from_scratch.device import choose_dtype, dtype_of

    assert dtype_of("float32") is None and dtype_of("bfloat16") == torch.bfloat16
    assert choose_dtype("bfloat16", "cpu") == "bfloat16"
    with pytest.raises(ValueError, match="dtype must be one of"):
        dtype_of("float16")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt: Linux with glibc only")
def test_keep_freed_memory_reuses_large_blocks_instead_of_faulting_them_in_again():
    """64 MiB tensors, one after the other: glibc maps and zeroes each anew (16,384 page faults apiece) unless
    keep_freed_memory() keeps freed blocks for the next ones (after the heap has grown to hold them). Fresh
    processes: the setting is process-wide."""
    code = (
        "import resource, sys, torch\n"
        "from llm_from_scratch.device import keep_freed_memory\n"
        "took = keep_freed_memory() if sys.argv[1] == 'on' else None\n"
        "for _ in range(10):\n"  # the heap grows until a freed hole fits the next aligned request
        "    torch.ones(16 * 2**20)\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "for _ in range(5):\n"
        "    torch.ones(16 * 2**20)\n"
        "print(took, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)\n")
    faults = {}
    for mode, env in (("off", {}), ("on", {}), ("on", {"LLMFS_KEEP_FREED_MEMORY": "0"})):
        done = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT), **env}, check=True)
        took, faults[mode, bool(env)] = done.stdout.split()
        assert took == {"off": "None", "on": "False" if env else "True"}[mode], (mode, env, took)
    assert int(faults["off", False]) > 40_000  # 5 × 16,384 pages of 4 KiB, zeroed by the kernel
    assert int(faults["on", False]) < 2_000  # freed blocks reused
    assert int(faults["on", True]) > 40_000  # LLMFS_KEEP_FREED_MEMORY=0: as if never called


def test_tf32_is_a_cuda_setting_only(monkeypatch):
    """pick_device lets float32 matmuls use TF32 on CUDA alone: on a CPU (or MPS) the flag is left as it was, so CPU
    arithmetic is the same bit for bit; LLMFS_TF32=0 keeps full float32 on CUDA too."""
    from llm_from_scratch.device import allow_tf32

    before = torch.backends.cuda.matmul.allow_tf32
    assert allow_tf32("cpu") is False and allow_tf32(torch.device("cpu")) is False
    pick_device("cpu")
    assert torch.backends.cuda.matmul.allow_tf32 == before
    monkeypatch.setenv("LLMFS_TF32", "0")
    assert allow_tf32("cuda") is False and torch.backends.cuda.matmul.allow_tf32 == before


def test_the_first_pick_announces_the_device_and_its_precision_once(capsys, monkeypatch):
    from llm_from_scratch.device import announce_first_pick, describe

    line = describe("cpu")
    assert line.startswith("device cpu (") and "float32 matmuls: float32" in line and "bf16 autocast" in line
    announce_first_pick()
    pick_device("cpu")
    pick_device("cpu")  # a later pick (a helper's) says nothing
    assert capsys.readouterr().out == line + "\n"
    announce_first_pick()
    announce_first_pick(on=False)  # taken back before any pick
    pick_device("cpu")
    monkeypatch.setenv("RANK", "1")  # under torchrun only rank 0 prints
    announce_first_pick()
    pick_device("cpu")
    assert capsys.readouterr().out == ""
