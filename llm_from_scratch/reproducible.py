"""One chain of runs on every x86-64 CPU: fix what decides the order of float32 sums.

A float32 sum is not associative: (a + b) + c and a + (b + c) can differ in the last bit, and a few hundred optimizer
steps amplify a last-bit difference into another model (another SFT accuracy, another RL result). On a CPU, three
things choose the order in which PyTorch adds:

* **ATen's kernel level** (`ATEN_CPU_CAPABILITY`): PyTorch compiles its vectorised kernels (softmax, layer norm, GELU,
  reductions, AdamW's arithmetic) for several instruction sets and runs the widest the CPU has: AVX-512 adds 16 floats
  at a time, AVX2 8. The course pins `avx2`, which every Intel Core since 2013 and every AMD CPU since 2015 has
  (some low-end Pentium, Celeron and Atom chips lack it: they are not pinned, and say so).
* **the BLAS's code path** (`MKL_CBWR`): Intel's MKL, which does PyTorch's matrix products on x86, picks its kernels
  by CPU model and vendor. Its conditional-numerical-reproducibility branches AVX2 and AVX-512 run only on Intel
  CPUs (on AMD, MKL runs AUTO whatever is asked), and AUTO differs between vendors. COMPATIBLE (SSE2 without the
  approximate rcpps/rsqrtps) is the one branch MKL runs the same way on every x86-64 CPU, so the course pins it
  (`benchmarks/bench_reproducible.py` measures what it costs and shows each branch's digest).
* **the threads**: a sum split over two threads adds two halves, then the halves. The course pins 2 intra-op threads
  per machine, whatever the machine has (under torchrun, 2 shared between the processes of a machine).

oneDNN, which PyTorch uses on a CPU for bfloat16 matrix products (not on the float32 path: its verbose log stays
empty there), has its instruction set capped at AVX2 too (`ONEDNN_MAX_CPU_ISA`).

The kernel level and MKL's branch are read once, at the first operation that needs them, so `apply()` must run
before any torch operation (before `import torch` to be safe): every chapter script calls it first thing
(`chapters/cli.py`), `chapters/run_all.py` before it starts, every notebook in its first cell, and the tests in
`tests/conftest.py`. It then reads back what torch and MKL really use and refuses a setting that did not take.

`LLMFS_FAST=1` in the environment (or a chapter's `--fast`) leaves all of this to torch: every core, the widest
kernels, MKL's own choice. Faster, and another chain: its numbers differ from the reproducible chain's.

This module imports only the standard library, so it can run before torch is imported.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

COURSE_THREADS = 2  # intra-op threads per machine in the reproducible mode (the course's 2-core laptop)
# what the reproducible mode puts in the environment, before torch reads it
PINNED = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "AVX2"}
FAST_VARIABLE = "LLMFS_FAST"
MODE_VARIABLE = "LLMFS_CPU_MODE"  # what apply() chose, for the processes this one starts: "reproducible" or "fast"
# MKL's numbers for its branches (mkl_cbwr.h): what mkl_serv_cbwr_get(MKL_CBWR_BRANCH) answers
MKL_BRANCHES = {1: "OFF", 2: "AUTO", 3: "COMPATIBLE", 4: "SSE2", 6: "SSSE3", 7: "SSE4_1", 8: "SSE4_2", 9: "AVX",
                10: "AVX2", 12: "AVX512", 14: "AVX512_E1", 17: "AVX512_E4", 18: "AVX2_E1", 19: "AVX512_E5"}


class SettingNotApplied(RuntimeError):
    """The reproducible setting was asked for after torch had already chosen its kernels."""


def fast_requested(argv: list[str] | None = None) -> bool:
    """True when the fast mode is asked for: `--fast` among argv, or LLMFS_FAST=1 in the environment."""
    return "--fast" in (argv or []) or os.environ.get(FAST_VARIABLE, "0") not in ("", "0")


def course_threads() -> int:
    """The intra-op threads of one process: the course's 2 per machine, shared between torchrun's local processes
    (at least 1 each: 3 or more processes on a machine use 1 thread each)."""
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, COURSE_THREADS // local_processes)


def apply(fast: bool = False) -> str:
    """Put this process (and the processes it starts) in the reproducible CPU mode, or in the fast mode.

    Reproducible: the PINNED variables are set (overriding what the environment had, so a chapter started from
    anywhere runs the course's setting), torch gets `course_threads()` threads, and the result is checked (`check`).
    Fast (`fast=True` or LLMFS_FAST=1): LLMFS_FAST=1 is set for the processes this one starts, the PINNED variables
    are taken out again where a reproducible parent process set them (LLMFS_CPU_MODE says so; a user's own
    ATEN_CPU_CAPABILITY stays), and torch keeps its own thread count. On a CPU that is not x86-64 with
    AVX2 nothing is pinned (those kernels do not exist there). Returns the line to print."""
    if fast or fast_requested():
        if os.environ.get(MODE_VARIABLE) == "reproducible":  # pinned by a parent process, not by the user: unpin
            for name in PINNED:
                os.environ.pop(name, None)
        os.environ.update({FAST_VARIABLE: "1", MODE_VARIABLE: "fast"})
        return describe()
    if not on_x86_with_avx2():  # the pinned kernels do not exist here: torch's own choice, and describe() says so
        return describe()
    os.environ.update({**PINNED, MODE_VARIABLE: "reproducible"})
    import torch

    torch.set_num_threads(course_threads())
    check()
    return describe()


def check() -> None:
    """Raise SettingNotApplied when the reproducible mode is on but torch or MKL already run something else (they
    chose before `apply` set the environment). A CPU without AVX2 (or not x86) cannot run the pinned kernels at all:
    that is not an error, `record()` says `"reproducible": false` and `describe()` why."""
    if not on_x86_with_avx2():
        return
    level, branch = kernel_level(), blas_branch()
    if level != "AVX2":
        raise SettingNotApplied(f"torch already runs its {level} kernels: call llm_from_scratch.reproducible.apply() "
                                "before any torch operation (in a notebook: restart the kernel, run the first cell)")
    if branch not in (None, "COMPATIBLE"):
        raise SettingNotApplied(f"MKL already runs its {branch} branch: call llm_from_scratch.reproducible.apply() "
                                "before the first matrix product (in a notebook: restart the kernel)")


def kernel_level() -> str:
    """The instruction set of the ATen kernels this process runs: AVX512, AVX2, DEFAULT, ... (torch's own answer)."""
    import torch

    return torch.backends.cpu.get_cpu_capability()


def blas_branch() -> str | None:
    """MKL's code branch in this process (OFF: MKL's own dispatch, unpinned; COMPATIBLE; ...), read from MKL
    itself; None where torch has no MKL (Apple silicon, ARM) or does not expose it."""
    import torch

    if not torch.backends.mkl.is_available():
        return None
    import ctypes

    for name in ("libtorch_cpu.so", "torch_cpu.dll", "libtorch_cpu.dylib"):  # Linux, Windows, an Intel Mac
        try:
            code = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / name)).mkl_serv_cbwr_get(1)  # MKL_CBWR_BRANCH
            break
        except (OSError, AttributeError):  # not this platform's library, or a build that hides MKL's symbols
            continue
    else:
        return None
    return MKL_BRANCHES.get(code, f"branch {code}")


def _cpuinfo(field: str) -> str | None:
    """A field of the first processor in Linux's /proc/cpuinfo ("model name", "vendor_id", "flags"); None elsewhere."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.split(":", 1)[0].strip() == field:
                return line.split(":", 1)[1].strip()
    return None


def cpu_name() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo; elsewhere what platform knows)."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def cpu_vendor() -> str:
    """GenuineIntel, AuthenticAMD, ... on x86 Linux; else the machine's architecture (arm64, ...)."""
    return _cpuinfo("vendor_id") or platform.machine()


def on_x86_with_avx2() -> bool:
    """Whether this CPU can run the pinned kernels: x86-64 with AVX2 and FMA."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    flags = _cpuinfo("flags")
    if flags is not None:  # Linux
        return "avx2" in flags.split() and "fma" in flags.split()
    try:
        if sys.platform == "darwin":  # an Intel Mac
            import subprocess

            answer = subprocess.run(["sysctl", "-n", "hw.optional.avx2_0"], capture_output=True, text=True)
            return answer.stdout.strip() == "1"
        if sys.platform == "win32":
            import ctypes

            return bool(ctypes.windll.kernel32.IsProcessorFeaturePresent(40))  # PF_AVX2_INSTRUCTIONS_AVAILABLE
    except (OSError, AttributeError):
        pass
    return False  # unknown: pin nothing rather than refuse later


def reproducible() -> bool:
    """Whether this process runs the course's reproducible setting (pinned, and taken)."""
    if fast_requested() or not on_x86_with_avx2():
        return False
    import torch

    return (kernel_level() == "AVX2" and blas_branch() in (None, "COMPATIBLE")
            and torch.get_num_threads() == course_threads())


def record() -> dict:
    """What a run's summary.json records about the CPU arithmetic it ran: the CPU, the kernel level, the BLAS
    branch, the threads, and whether that is the course's reproducible setting."""
    import torch

    return {"cpu": cpu_name(), "vendor": cpu_vendor(), "kernel_level": kernel_level(),
            "blas": f"MKL {blas_branch()}" if blas_branch() else "no MKL", "threads": torch.get_num_threads(),
            "reproducible": reproducible(), "torch": torch.__version__}


def describe() -> str:
    """One line: the CPU mode this process runs and what it means for its numbers."""
    r = record()
    setting = f"ATen {r['kernel_level']} kernels, {r['blas']}, {r['threads']} thread{'s' * (r['threads'] != 1)}"
    if r["reproducible"]:
        return (f"CPU mode: reproducible ({setting}): the same chain of runs on any x86-64 CPU with AVX2; "
                f"--fast or {FAST_VARIABLE}=1 uses every core")
    if fast_requested():
        return f"CPU mode: fast ({setting}): every core; another chain than the reproducible one"
    why = "this CPU has no AVX2" if platform.machine().lower() in ("x86_64", "amd64") else \
        f"a {platform.machine()} CPU runs other kernels"
    return f"CPU mode: not reproducible here ({setting}; {why}): another chain than the reproducible one"


if __name__ == "__main__":  # python -m llm_from_scratch.reproducible: this machine's setting, in both modes
    print(apply(fast="--fast" in sys.argv[1:]))
