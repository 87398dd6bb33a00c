"""The reproducible CPU mode (llm_from_scratch/reproducible.py): it pins what decides the order of float32 sums, it
overrides what a process inherited, it refuses to claim a setting that did not take, and --fast undoes it.

Each case runs in a fresh process: the kernel level and MKL's branch are chosen once per process, so this test
process (put in the reproducible mode by conftest.py) cannot show them changing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llm_from_scratch import reproducible
from llm_from_scratch.course import same_cpu_mode

ROOT = Path(__file__).resolve().parents[1]
needs_avx2 = pytest.mark.skipif(not reproducible.on_x86_with_avx2(), reason="the pinned kernels need x86-64 with AVX2")

# a few AdamW steps of a small GPT from a fixed start, as a function: train() -> the digest of the weights. A case's
# program applies the mode (or not), then prints one JSON line built from train() and what reproducible reports
STEPS = """
import hashlib, json, torch
from llm_from_scratch.model import GPT, GPTConfig
def train():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=97, context_length=32, n_layer=2, n_head=2, n_embd=64, dropout=0.0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.randint(0, 97, (16, 32), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        logits = model(x)
        logits = logits[0] if isinstance(logits, tuple) else logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 97), x[:, 1:].reshape(-1))
        opt.zero_grad(); loss.backward(); opt.step()
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
def report(**more):
    print(json.dumps({"record": reproducible.record(), "describe": reproducible.describe(),
                      "env": {k: os.environ.get(k) for k in (*reproducible.PINNED, "LLMFS_FAST")}, **more}))
"""
PRELUDE = "import os, sys\nsys.path.insert(0, %r)\nfrom llm_from_scratch import reproducible\n"


def run(program: str, **env: str) -> dict:
    """`program` after STEPS in a fresh Python whose environment is this one's without the mode's variables, plus
    `env`; the JSON line it printed last."""
    base = {k: v for k, v in os.environ.items()
            if k not in (*reproducible.PINNED, reproducible.FAST_VARIABLE, reproducible.MODE_VARIABLE)}
    done = subprocess.run([sys.executable, "-c", PRELUDE % str(ROOT) + STEPS + program], env={**base, **env},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def pinned():
    """The steps in the reproducible mode, twice, then again with 1 thread instead of 2 (the rest still pinned)."""
    program = ("reproducible.apply()\nfirst, again = train(), train()\n"
               "torch.set_num_threads(1)\none = train()\ntorch.set_num_threads(2)\n"
               "report(digest=first, again=again, one_thread=one)\n")
    return run(program)


def test_this_suite_runs_in_the_reproducible_mode():
    """conftest.py applied it: the numbers every other test checks are the same on any x86-64 CPU with AVX2."""
    if reproducible.fast_requested():
        pytest.skip("LLMFS_FAST=1: the suite runs in the fast mode, as asked")
    if not reproducible.on_x86_with_avx2():
        assert not reproducible.reproducible() and "not reproducible here" in reproducible.describe()
        return
    record = reproducible.record()
    assert reproducible.reproducible() and record["reproducible"] is True
    assert (record["kernel_level"], record["threads"]) == ("AVX2", reproducible.COURSE_THREADS)
    assert record["blas"] in ("MKL COMPATIBLE", "no MKL")
    assert reproducible.describe().startswith("CPU mode: reproducible (ATen AVX2 kernels")
    assert same_cpu_mode({"cpu": record}) and not same_cpu_mode({"cpu": {**record, "reproducible": False}})
    assert not same_cpu_mode({"quick": True}) and not same_cpu_mode(None)  # a run from before the mode: not kept


@needs_avx2
def test_apply_overrides_what_the_process_inherited(pinned):
    """A chapter started from a shell that asks for other kernels, another MKL branch and one thread computes the
    course's numbers all the same: the same weights, bit for bit, as a process started with nothing set."""
    other = run("reproducible.apply()\nreport(digest=train())\n", ATEN_CPU_CAPABILITY="default", MKL_CBWR="AUTO",
                OMP_NUM_THREADS="1")
    assert pinned["record"]["reproducible"] and other["record"]["reproducible"]
    assert other["record"]["kernel_level"] == "AVX2" and other["record"]["threads"] == 2
    assert other["env"]["ATEN_CPU_CAPABILITY"] == "avx2" and other["env"]["MKL_CBWR"] == "COMPATIBLE"
    assert other["digest"] == pinned["digest"]


@needs_avx2
def test_each_pin_reaches_the_numbers(pinned):
    """The pins are not decoration: the same steps with torch's DEFAULT kernels, or with 1 thread instead of 2, the
    rest pinned, end in other weights (another order of the same float32 sums); the same steps twice in the same
    setting end in the same weights."""
    kernels = run("report(digest=train())\n", LLMFS_FAST="1", ATEN_CPU_CAPABILITY="default", MKL_CBWR="COMPATIBLE",
                  OMP_NUM_THREADS="2")
    assert kernels["record"]["kernel_level"] == "DEFAULT" and kernels["record"]["threads"] == 2
    assert pinned["again"] == pinned["digest"]
    assert pinned["one_thread"] != pinned["digest"] and kernels["digest"] != pinned["digest"]


@needs_avx2
def test_a_setting_that_did_not_take_is_refused():
    """torch chose its kernels before apply() (an operation ran first): apply() says so instead of claiming the mode,
    and names what to do."""
    program = ("torch.ones(8).sum()\n"
               "try:\n    reproducible.apply()\nexcept reproducible.SettingNotApplied as err:\n"
               "    print(json.dumps({'refused': str(err)}))\n")
    out = run(program, ATEN_CPU_CAPABILITY="default")
    assert "already runs its DEFAULT kernels" in out["refused"] and "before any torch operation" in out["refused"]


def test_fast_unpins_what_a_reproducible_parent_set_and_keeps_a_users_choice():
    """--fast (LLMFS_FAST=1) in a process started by a reproducible one: the inherited pins are taken out (torch's own
    kernels and MKL's own dispatch), and the processes it starts are fast too; a user's own ATEN_CPU_CAPABILITY, set
    by hand and not by the mode, stays."""
    inherited = run("reproducible.apply()\nreport()\n", LLMFS_FAST="1", LLMFS_CPU_MODE="reproducible",
                    **reproducible.PINNED)
    assert inherited["env"] == {**{k: None for k in reproducible.PINNED}, "LLMFS_FAST": "1"}
    assert not inherited["record"]["reproducible"] and inherited["describe"].startswith("CPU mode: fast")
    own = run("reproducible.apply(fast=True)\nreport()\n", ATEN_CPU_CAPABILITY="default")
    assert own["env"]["ATEN_CPU_CAPABILITY"] == "default" and own["record"]["kernel_level"] == "DEFAULT"


def test_threads_are_the_courses_two_per_machine(monkeypatch):
    """2 intra-op threads per machine: one process gets both, torchrun's local processes share them."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert reproducible.course_threads() == 2
    for processes, threads in (("1", 2), ("2", 1), ("4", 1)):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", processes)
        assert reproducible.course_threads() == threads


def test_chapter_flag_and_help():
    """Every chapter script's --help offers --fast; a script's first line is the mode (chapters/cli.py)."""
    assert reproducible.fast_requested(["--quick", "--fast"]) and not reproducible.fast_requested(["--quick"])
    help_ = subprocess.run([sys.executable, str(ROOT / "chapters" / "ch02_attention.py"), "--help"],
                           capture_output=True, text=True, timeout=120)
    assert help_.returncode == 0 and "--fast" in help_.stdout and "CPU mode: " not in help_.stdout
